"""Oversized bodies get a 413 in the OpenAI error shape, and the server keeps serving."""

from __future__ import annotations

import pytest

from tests.api.conftest import Api

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_body_over_the_limit_is_413(smol: Api) -> None:
    limit = smol.state.config.max_body_bytes
    status, body = await smol.post("/v1/completions", {"model": smol.model, "prompt": "x" * (limit + 1)})
    assert status == 413
    assert body["error"]["code"] == "request_too_large" and str(limit) in body["error"]["message"]
    status, _ = await smol.post("/tokenize", {"model": smol.model, "prompt": "still serving"})
    assert status == 200
