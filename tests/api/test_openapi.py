"""/openapi.json documents every route, and every POST route's body schema, from the structs that validate it."""

from __future__ import annotations

import pytest

from tests.api.conftest import Api

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_every_route_is_documented_with_its_body(smol: Api) -> None:
    response = await smol.client.get("/openapi.json")
    assert response.status == 200
    document = await response.json()
    assert document["openapi"].startswith("3.")
    routes = {(r.method.lower(), r.resource.canonical) for r in smol.client.app.router.routes() if r.method != "HEAD"}
    documented = {(method, path) for path, operations in document["paths"].items() for method in operations}
    assert routes == documented
    for path, operations in document["paths"].items():
        if "post" in operations:
            ref = operations["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
            assert schema["type"] == "object" and schema["properties"], path
