"""/tokenize, /detokenize (vLLM's shapes) and /version."""

from __future__ import annotations

import pytest

from tests.api.conftest import Api

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_tokenize_prompt_and_back(smol: Api) -> None:
    status, body = await smol.post("/tokenize", {"model": smol.model, "prompt": "The capital of France is", "return_token_strs": True})
    assert status == 200 and body["tokens"] == [504, 3575, 282, 4649, 314] and body["count"] == 5
    assert body["max_model_len"] == smol.state.max_model_len and body["token_strs"][1] == "Ġcapital"
    status, back = await smol.post("/detokenize", {"model": smol.model, "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "The capital of France is"}


async def test_tokenize_chat_counts_what_chat_completions_submits(qwen: Api) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    status, body = await qwen.post("/tokenize", {"messages": messages, "tools": tools})
    assert status == 200 and body["token_strs"] is None
    await qwen.post("/v1/chat/completions", {"model": qwen.model, "messages": messages, "tools": tools})
    assert body["tokens"] == qwen.engine.submits[-1].prompt_ids


async def test_refusals_and_version(smol: Api) -> None:
    cases = [
        ({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "model": "nope"}, "model"),
    ]
    for body, param in cases:
        status, error = await smol.post("/tokenize", body)
        assert status in (400, 404) and error["error"]["param"] == param, error
    status, error = await smol.post("/detokenize", {"tokens": [10**9]})
    assert status == 400 and error["error"]["param"] == "tokens"
    response = await smol.client.get("/version")
    assert response.status == 200 and (await response.json())["version"]
