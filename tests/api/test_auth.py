"""API keys: every generation and admin route needs one (Bearer or x-api-key), answered with a 401 in the route's
protocol shape otherwise; /health and /metrics stay open unless configured; the official SDKs authenticate."""

from __future__ import annotations

import anthropic
import openai
import pytest
import pytest_asyncio

from shared.config import DEFAULT_MODEL_DIR
from tests.api.conftest import Api, start_api

pytestmark = pytest.mark.asyncio(loop_scope="module")

KEYS = "key-one,key-two"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def keyed() -> Api:
    api = await start_api(DEFAULT_MODEL_DIR, api_key=KEYS)
    yield api
    await api.close()


def _chat(api: Api) -> dict:
    return {"model": api.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


GUARDED = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/instrumentation"),
    ("GET", "/version"),
]


@pytest.mark.parametrize(("method", "path"), GUARDED)
async def test_routes_without_a_key_get_401_in_the_openai_shape(keyed: Api, method: str, path: str) -> None:
    response = await keyed.client.request(method, path, json={})
    assert response.status == 401
    error = (await response.json())["error"]
    assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key" and "missing" in error["message"]
    response = await keyed.client.request(method, path, json={}, headers={"Authorization": "Bearer key-three"})
    assert response.status == 401 and "invalid" in (await response.json())["error"]["message"]


async def test_anthropic_routes_answer_401_in_the_anthropic_shape(keyed: Api) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = await keyed.client.post(path, json={}, headers={"x-api-key": "wrong"})
        assert response.status == 401
        assert await response.json() == {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}}


async def test_either_header_with_any_configured_key_is_let_in(keyed: Api) -> None:
    status, body = await keyed.post("/v1/chat/completions", _chat(keyed), headers={"Authorization": "Bearer key-two"})
    assert status == 200 and body["choices"][0]["message"]["content"] == "Hello world"
    status, _ = await keyed.post("/v1/chat/completions", _chat(keyed), headers={"x-api-key": "key-one"})
    assert status == 200


async def test_health_metrics_and_the_openapi_document_stay_open(keyed: Api) -> None:
    for path in ("/health", "/metrics", "/openapi.json"):
        assert (await keyed.client.get(path)).status == 200, path


async def test_health_and_metrics_can_require_the_key() -> None:
    api = await start_api(DEFAULT_MODEL_DIR, api_key="secret", auth_health_metrics=True)
    try:
        for path in ("/health", "/metrics"):
            assert (await api.client.get(path)).status == 401, path
            assert (await api.client.get(path, headers={"Authorization": "Bearer secret"})).status == 200, path
    finally:
        await api.close()


async def test_the_official_sdks_authenticate_with_their_own_headers(keyed: Api) -> None:
    good = openai.AsyncOpenAI(base_url=f"{keyed.url}/v1", api_key="key-one", max_retries=0)
    bad = anthropic.AsyncAnthropic(base_url=keyed.url, api_key="nope", max_retries=0)
    good_anthropic = anthropic.AsyncAnthropic(base_url=keyed.url, api_key="key-two", max_retries=0)
    try:
        completion = await good.chat.completions.create(model=keyed.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert completion.choices[0].message.content == "Hello world"
        with pytest.raises(openai.AuthenticationError):
            await keyed.openai().models.list()  # the fixture's client sends the key "unused"
        with pytest.raises(anthropic.AuthenticationError):
            await bad.messages.create(model=keyed.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        message = await good_anthropic.messages.create(model=keyed.model, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert message.content[0].text == "Hello world"
    finally:
        for sdk in (good, bad, good_anthropic):
            await sdk.close()
