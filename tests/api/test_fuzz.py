"""Hypothesis-generated bodies against every POST route of /openapi.json: every answer is a 2xx or a 4xx in the
protocol's error shape (naming a field where one is at fault), never a 5xx, and the api keeps serving.

Bodies are mutations of a valid one (a field replaced by any JSON value, a field dropped, an unknown field
added), arbitrary JSON, and arbitrary bytes; the field names come from the OpenAPI document, so every
documented field is exercised.
"""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shared.config import DEFAULT_MODEL_DIR
from tests.api.conftest import Api, start_api

MODEL = "SmolLM2-135M-Instruct"
VALID = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
}
EXAMPLES_PER_ROUTE = 150  # 1,050 requests: 20-60 s on 2 shared cores

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)


def _schema_fields(document: dict, path: str) -> list[str]:
    ref = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return sorted(document["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


def _bodies(fields: list[str], valid: dict) -> st.SearchStrategy[bytes]:
    replaced = st.tuples(st.sampled_from(fields), json_values).map(lambda kv: {**valid, kv[0]: kv[1]})
    dropped = st.sampled_from(sorted(valid)).map(lambda k: {f: v for f, v in valid.items() if f != k})
    unknown = st.tuples(st.text(min_size=1, max_size=10).filter(lambda k: k not in fields), json_values).map(lambda kv: {**valid, kv[0]: kv[1]})
    mutated = (replaced | dropped | unknown).map(lambda body: json.dumps(body).encode())
    anything = json_values.map(lambda value: json.dumps(value).encode())
    return st.one_of(mutated, mutated, mutated, anything, st.binary(max_size=64))


def _fuzz(loop: asyncio.AbstractEventLoop, api: Api, path: str, fields: list[str], statuses: dict[int, int]) -> None:
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None, phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(body=_bodies(fields, VALID[path]))
    def check(body: bytes) -> None:
        async def post() -> tuple[int, bytes]:
            response = await api.client.post(path, data=body, headers={"Content-Type": "application/json"})
            return response.status, await response.read()

        status, text = loop.run_until_complete(post())
        statuses[status] = statuses.get(status, 0) + 1
        assert status < 500, f"{path} answered {status} to {body!r}: {text!r}"
        if status >= 400:
            error = json.loads(text)["error"]
            assert error["type"] if path.startswith("/v1/messages") else error["message"], text

    check()


def test_no_body_makes_the_api_fail() -> None:
    loop = asyncio.new_event_loop()
    api = loop.run_until_complete(start_api(DEFAULT_MODEL_DIR))
    try:
        document = loop.run_until_complete(loop.run_until_complete(api.client.get("/openapi.json")).json())
        assert set(VALID) <= set(document["paths"])
        statuses: dict[int, int] = {}
        for path in VALID:
            _fuzz(loop, api, path, _schema_fields(document, path), statuses)
        assert sum(statuses.values()) >= len(VALID) * EXAMPLES_PER_ROUTE * 0.9
        assert sum(n for s, n in statuses.items() if s < 300) > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0
        status, _ = loop.run_until_complete(api.post("/v1/completions", VALID["/v1/completions"]))
        assert status == 200  # still serving
    finally:
        loop.run_until_complete(api.close())
        loop.close()
