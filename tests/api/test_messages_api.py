"""The Anthropic Messages API around a scripted engine, through the anthropic SDK: blocks, events, stop reasons, errors."""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest

from services.api.errors import ApiError
from shared.frames import GrammarKind
from tests.api.conftest import Api

pytestmark = pytest.mark.asyncio(loop_scope="module")

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "Weather now", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
GREEDY = {"temperature": 0.0, "top_k": 5}  # this SDK version passes sampling through extra_body


async def _raw_events(api: Api, body: dict, **headers: str) -> list[tuple[str, dict]]:
    response = await api.client.post("/v1/messages", json={**body, "stream": True}, headers=headers)
    assert response.status == 200, await response.text()
    events = []
    for block in (await response.text()).strip().split("\n\n"):
        name, data = block.split("\n", 1)
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


async def test_text_answer_with_system_blocks_and_usage(smol: Api) -> None:
    smol.engine.script("Paris", " is sunny.", cached_tokens=16)
    message = await smol.anthropic().messages.create(
        model=smol.model,
        max_tokens=64,
        system=[{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Use metric units."}],
        messages=ASK,
        metadata={"user_id": "u-1"},
        extra_body=GREEDY,
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "Paris is sunny."
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    prompt_tokens = len(smol.engine.submits[-1].prompt_ids)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_tokens and message.usage.cache_read_input_tokens == 16
    assert message.usage.output_tokens == 2
    assert "You are terse.\n\nUse metric units." in smol.prompt()
    sampling = smol.engine.submits[-1].sampling
    assert sampling.temperature == 0.0 and sampling.top_k == 5 and smol.engine.submits[-1].max_tokens == 64


async def test_stream_event_order_with_thinking_text_and_tool_use(qwen: Api) -> None:
    qwen.engine.script("<think>\nNeed", " weather.</think>\n\n", "Checking.", "\n" + CALL)
    body = {"model": qwen.model, "max_tokens": 64, "messages": ASK, "tools": [WEATHER]}
    events = await _raw_events(qwen, body, **{"x-api-key": "k", "anthropic-version": "2023-06-01"})
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(payload["type"] == name for name, payload in events)
    starts = [p["content_block"]["type"] for n, p in events if n == "content_block_start"]
    deltas = [p["delta"]["type"] for n, p in events if n == "content_block_delta"]
    assert starts == ["thinking", "text", "tool_use"] and deltas == ["thinking_delta", "thinking_delta", "text_delta", "input_json_delta"]
    assert [p["index"] for n, p in events if n.startswith("content_block")] == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    tool_start = events[9][1]["content_block"]
    assert tool_start["id"].startswith("toolu_") and tool_start["name"] == "get_weather" and tool_start["input"] == {}
    assert json.loads(events[10][1]["delta"]["partial_json"]) == {"city": "Paris"}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and delta["usage"]["output_tokens"] == 4
    assert events[0][1]["message"]["content"] == [] and events[0][1]["message"]["stop_reason"] is None


async def test_sdk_stream_helper_and_unstreamed_answer_agree(qwen: Api) -> None:
    script = ("<think>\nNeed weather.</think>\n\n", CALL)
    qwen.engine.script(*script)
    async with qwen.anthropic().messages.stream(model=qwen.model, max_tokens=64, messages=ASK, tools=[WEATHER]) as stream:
        streamed = await stream.get_final_message()
    qwen.engine.script(*script)
    whole = await qwen.anthropic().messages.create(model=qwen.model, max_tokens=64, messages=ASK, tools=[WEATHER])
    for message in (streamed, whole):
        assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.stop_reason == "tool_use"
        assert message.content[0].thinking == "Need weather." and message.content[1].input == {"city": "Paris"}
    assert whole.usage.output_tokens_details.thinking_tokens > 0  # type: ignore[union-attr]


async def test_stop_reasons(smol: Api) -> None:
    client = smol.anthropic()
    smol.engine.script("one", " two", finish="length")
    message = await client.messages.create(model=smol.model, max_tokens=2, messages=ASK)
    assert message.stop_reason == "max_tokens"
    smol.engine.script("Count: 1, 2", matched="3")
    message = await client.messages.create(model=smol.model, max_tokens=20, messages=ASK, stop_sequences=["3"])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "3") and smol.engine.submits[-1].stop == ["3"]
    smol.engine.script("Count: 1, 2", matched="3")
    events = await _raw_events(smol, {"model": smol.model, "max_tokens": 20, "messages": ASK, "stop_sequences": ["3"]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "3"}


async def test_ping_during_a_long_silence(smol: Api) -> None:
    smol.state.keepalive_s = 0.05
    smol.engine.script("a", "b", delay_s=0.3)
    events = await _raw_events(smol, {"model": smol.model, "max_tokens": 5, "messages": ASK})
    names = [name for name, _ in events]
    first_delta = names.index("content_block_delta")
    assert names[:3] == ["message_start", "ping", "content_block_start"] and "ping" in names[first_delta:]


async def test_tool_blocks_and_prefill_reach_the_template(qwen: Api) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]}]},
        {"role": "assistant", "content": "It is"},
    ]
    qwen.engine.script(" 18 C.")
    message = await qwen.anthropic().messages.create(model=qwen.model, max_tokens=16, messages=messages, tools=[WEATHER])
    assert message.content[0].text == " 18 C."
    prompt = qwen.prompt()
    assert "<think>\nUse the tool.\n</think>" in prompt and '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt and prompt.endswith("<|im_start|>assistant\nIt is")


async def test_thinking_switch_and_tool_choice(qwen: Api, smol: Api) -> None:
    client = qwen.anthropic()
    await client.messages.create(model=qwen.model, max_tokens=4096, messages=ASK, thinking={"type": "enabled", "budget_tokens": 2048})
    assert qwen.prompt().startswith("[effort=low]")
    await client.messages.create(model=qwen.model, max_tokens=64, messages=ASK, thinking={"type": "disabled"})
    assert qwen.prompt().endswith("<think>\n\n</think>\n\n")
    await client.messages.create(model=qwen.model, max_tokens=64, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"})
    assert "You must answer by calling one or more of the provided tools." in qwen.prompt()
    with pytest.raises(anthropic.BadRequestError) as error:
        await smol.anthropic().messages.create(model=smol.model, max_tokens=4096, messages=ASK, thinking={"type": "enabled", "budget_tokens": 2048})
    assert error.value.body["error"]["type"] == "invalid_request_error"
    assert "does not reason, so thinking of type 'enabled' cannot be honoured" in error.value.body["error"]["message"]


async def test_service_tier_auto_and_standard_only_are_served(smol: Api) -> None:
    for tier in ("auto", "standard_only"):
        smol.engine.script("Hi")
        reply = await smol.anthropic().messages.create(model=smol.model, max_tokens=8, messages=ASK, service_tier=tier)
        assert reply.content[0].text == "Hi"


async def test_output_config_format_carries_the_schema_and_refuses_what_cannot_be_followed(smol: Api, qwen: Api) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
    smol.engine.script('{"city": "Paris"}')
    reply = await smol.anthropic().messages.create(
        model=smol.model, max_tokens=32, messages=ASK, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    grammar = smol.engine.submits[-1].sampling.grammar
    assert reply.content[0].text == '{"city": "Paris"}' and json.loads(grammar.text) == schema and grammar.strict
    cases = [
        (smol, {"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type must be 'json_schema'"),
        (smol, {"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema: Field required"),
        (smol, {"output_config": {"format": {"type": "json_schema", "schema": {"type": "string", "pattern": "a(b"}}}}, "The parenthesis is not closed"),
    ]
    for api, extra, message in cases:
        got, error = await api.post("/v1/messages", {"model": api.model, "max_tokens": 8, "messages": ASK, **extra})
        assert got == 400 and message in error["error"]["message"], (extra, error)
    qwen.engine.script("{}")
    got, _ = await qwen.post(
        "/v1/messages",
        {
            "model": qwen.model,
            "max_tokens": 8,
            "messages": ASK,
            "thinking": {"type": "disabled"},
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    assert got == 200 and qwen.engine.submits[-1].sampling.grammar_after == []  # a reasoning model told not to think
    qwen.engine.script("<think>x</think>{}")
    got, _ = await qwen.post(
        "/v1/messages", {"model": qwen.model, "max_tokens": 8, "messages": ASK, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    )
    assert got == 200 and qwen.engine.submits[-1].sampling.grammar_after == qwen.state.prompts.tokenizer.encode("</think>", add_special_tokens=False)
    smol.engine.script("{}")
    got, _ = await smol.post(
        "/v1/messages",
        {"model": smol.model, "max_tokens": 8, "messages": ASK, "tools": [WEATHER], "output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert got == 200 and smol.engine.submits[-1].sampling.grammar.kind == GrammarKind.STRUCTURAL_TAG  # a call, or the answer under the schema


async def test_tool_choice_any_is_held_to_one_call(smol: Api) -> None:
    smol.engine.script(CALL)
    reply = await smol.anthropic().messages.create(model=smol.model, max_tokens=32, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"})
    tag = json.loads(smol.engine.submits[-1].sampling.grammar.text)
    assert reply.stop_reason == "tool_use" and tag["format"]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert tag["format"]["content"]["json_schema"] == {"type": "object"}
    smol.engine.script(CALL)
    await smol.anthropic().messages.create(model=smol.model, max_tokens=32, messages=ASK, tools=[{**WEATHER, "strict": True}], tool_choice={"type": "any"})
    assert json.loads(smol.engine.submits[-1].sampling.grammar.text)["format"]["content"]["json_schema"] == WEATHER["input_schema"]


async def test_count_tokens_matches_the_prompt(qwen: Api) -> None:
    counted = await qwen.anthropic().messages.count_tokens(model=qwen.model, messages=ASK, system="Be brief.", tools=[WEATHER])
    await qwen.anthropic().messages.create(model=qwen.model, max_tokens=8, messages=ASK, system="Be brief.", tools=[WEATHER])
    assert counted.input_tokens == len(qwen.engine.submits[-1].prompt_ids) > 0


async def test_errors_have_the_anthropic_shape(smol: Api) -> None:
    cases = [
        ({"model": smol.model, "messages": ASK}, 400, "max_tokens"),
        ({"model": "nope", "max_tokens": 5, "messages": ASK}, 404, "nope"),
        ({"model": smol.model, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
        ({"model": smol.model, "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "image"),
        ({"model": smol.model, "max_tokens": 5, "messages": ASK, "bogus": 1}, 400, "bogus"),
        ({"model": smol.model, "max_tokens": 5, "messages": ASK, "service_tier": "priority"}, 400, "service_tier must be auto or standard_only"),
    ]
    for body, status, word in cases:
        got, error = await smol.post("/v1/messages", body)
        assert got == status and error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error") and word in error["error"]["message"]
    got, error = await smol.post("/v1/messages/count_tokens", {"model": smol.model, "messages": []})
    assert got == 400 and error["type"] == "error"


async def test_engine_failure_mid_stream_is_an_error_event(smol: Api) -> None:
    smol.engine.script("partial", error=ApiError(503, "the engine stopped responding"))
    events = await _raw_events(smol, {"model": smol.model, "max_tokens": 5, "messages": ASK})
    assert events[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "the engine stopped responding"}})
    smol.engine.script("partial", error=ApiError(503, "the engine stopped responding"))
    with pytest.raises(anthropic.APIStatusError):
        async with smol.anthropic().messages.stream(model=smol.model, max_tokens=5, messages=ASK) as stream:
            async for _ in stream:
                pass


async def test_client_gone_mid_stream_aborts_the_engine_request(smol: Api) -> None:
    smol.state.keepalive_s = 0.02  # pings pending while the engine is silent
    smol.engine.script(*["word "] * 50, delay_s=0.05)
    response = await smol.client.post("/v1/messages", json={"model": smol.model, "max_tokens": 64, "messages": ASK, "stream": True})
    while b"content_block_delta" not in await response.content.readline():
        pass
    response.close()
    rid = smol.engine.submits[-1].rid
    for _ in range(100):
        if rid in smol.engine.aborted:
            break
        await asyncio.sleep(0.02)
    assert rid in smol.engine.aborted


async def test_tool_use_input_streams_as_json_fragments(qwen: Api) -> None:
    pieces = ('<tool_call>\n{"name": "get_weather", "arguments": {"ci', 'ty": "São ', 'Paulo", "days"', ": 3}}\n</tool_call>")
    qwen.engine.script(*pieces)
    body = {"model": qwen.model, "max_tokens": 64, "messages": ASK, "tools": [WEATHER], "stream": True}
    events = await _raw_events(qwen, body, **{"x-api-key": "k", "anthropic-version": "2023-06-01"})
    fragments = [p["delta"]["partial_json"] for n, p in events if n == "content_block_delta"]
    assert len(fragments) > 2 and json.loads("".join(fragments)) == {"city": "São Paulo", "days": 3}
    qwen.engine.script(*pieces)
    async with qwen.anthropic().messages.stream(model=qwen.model, max_tokens=64, messages=ASK, tools=[WEATHER]) as stream:
        message = await stream.get_final_message()
    assert message.content[0].input == {"city": "São Paulo", "days": 3} and message.stop_reason == "tool_use"
