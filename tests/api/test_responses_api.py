"""The Responses API around a scripted engine, through the openai SDK: items, the event sequence, refusals."""

from __future__ import annotations

import json

import openai
import pytest

from services.api.errors import ApiError
from tests.api.conftest import Api

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": False}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_TEXT_CALL = ("<think>\nWeather", " needed.</think>\n\n", "Let me check.", "\n" + CALL)

EXPECTED_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",  # reasoning
    "response.content_part.added",
    "response.reasoning_text.delta",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.output_item.added",  # message
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.output_item.added",  # function call
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
    "response.completed",
]


async def test_plain_text_answer(smol: Api) -> None:
    smol.engine.script("Paris", " is the capital.")
    response = await smol.openai().responses.create(model=smol.model, input="Capital of France?", instructions="Answer briefly.")
    assert response.object == "response" and response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == "Paris is the capital."
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert response.usage.output_tokens == 2 and response.usage.input_tokens == len(smol.engine.submits[-1].prompt_ids)
    assert response.usage.total_tokens == response.usage.input_tokens + 2 and response.usage.output_tokens_details.reasoning_tokens == 0
    assert response.instructions == "Answer briefly." and "Answer briefly." in smol.prompt()


async def test_stream_event_sequence_and_final_response(qwen: Api) -> None:
    qwen.engine.script(*THINK_TEXT_CALL)
    events = [e async for e in await qwen.openai().responses.create(model=qwen.model, input="Weather in Paris?", tools=[WEATHER], stream=True)]
    assert [e.type for e in events] == EXPECTED_EVENTS
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    reasoning, message, call = final.output
    assert reasoning.content[0].text == "Weather needed." and message.content[0].text == "Let me check."
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [item.id for item in final.output]
    assert final.usage.output_tokens_details.reasoning_tokens > 0
    # the unstreamed answer has the same items
    qwen.engine.script(*THINK_TEXT_CALL)
    whole = await qwen.openai().responses.create(model=qwen.model, input="Weather in Paris?", tools=[WEATHER])
    assert [(i.type, getattr(i, "status", None)) for i in whole.output] == [(i.type, getattr(i, "status", None)) for i in final.output]
    assert whole.output_text == "Let me check." and whole.output[2].arguments == call.arguments


async def test_sdk_stream_helper_accumulates_our_events(qwen: Api) -> None:
    qwen.engine.script(*THINK_TEXT_CALL)
    async with qwen.openai().responses.stream(model=qwen.model, input="Weather in Paris?", tools=[WEATHER]) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert final.output_text == "Let me check." and final.output[-1].type == "function_call"


async def test_length_is_incomplete(smol: Api) -> None:
    smol.engine.script("a", "b", finish="length")
    response = await smol.openai().responses.create(model=smol.model, input="x", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert smol.engine.submits[-1].max_tokens == 2
    smol.engine.script("a", "b", finish="length")
    events = [e async for e in await smol.openai().responses.create(model=smol.model, input="x", max_output_tokens=2, stream=True)]
    assert events[-1].type == "response.incomplete" and events[-2].item.status == "incomplete"


async def test_input_items_reach_the_template(qwen: Api) -> None:
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "18 C"},
    ]
    qwen.engine.script("18 C in Paris.")
    response = await qwen.openai().responses.create(model=qwen.model, input=items, tools=[WEATHER], reasoning={"effort": "low"})
    assert response.output_text == "18 C in Paris." and response.reasoning.effort == "low"
    prompt = qwen.prompt()
    assert prompt.startswith("[effort=low]") and "Be terse." in prompt and "Weather in Paris?" in prompt
    assert "<think>\nCall the tool.\n</think>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt and "<tool_response>\n18 C\n</tool_response>" in prompt
    await qwen.openai().responses.create(model=qwen.model, input="x", reasoning={"effort": "none"})
    assert qwen.prompt().endswith("<think>\n\n</think>\n\n")


async def test_stateful_features_are_refused_by_name(smol: Api) -> None:
    base = {"model": smol.model, "input": "x"}
    cases = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"store": True}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),  # SmolLM2 does not reason
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "string", "pattern": "a(b"}}}}, "text.format.schema"),
        ({"bogus": 1}, "bogus"),
        ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]
    for extra, param in cases:
        status, body = await smol.post("/v1/responses", {**base, **extra})
        assert status == 400 and body["error"]["param"] == param, (extra, body)
    status, body = await smol.post("/v1/responses", {**base, "store": False})
    assert status == 200 and body["store"] is False
    status, body = await smol.post("/v1/responses", {**base, "service_tier": "auto", "metadata": {"team": "search"}})
    assert status == 200 and body["metadata"] == {"team": "search"}


async def test_engine_failure_mid_stream_is_response_failed(smol: Api) -> None:
    smol.engine.script("partial", error=ApiError(503, "the engine stopped responding"))
    events = [e async for e in await smol.openai().responses.create(model=smol.model, input="x", stream=True)]
    assert events[-1].type == "response.failed" and events[-1].response.error.message == "the engine stopped responding"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    smol.engine.status = smol.engine.status.__class__(state="loading")
    try:
        with pytest.raises(openai.APIStatusError) as error:
            await smol.openai().responses.create(model=smol.model, input="x", stream=True)
        assert error.value.status_code == 503
    finally:
        smol.engine.status = smol.engine.status.__class__(state="ready")


async def test_output_text_logprobs_when_included(smol: Api) -> None:
    smol.engine.script("Par", "is.")
    response = await smol.openai().responses.create(model=smol.model, input="Capital?", include=["message.output_text.logprobs"], top_logprobs=2)
    assert smol.engine.submits[-1].sampling.logprobs == 2
    logprobs = response.output[0].content[0].logprobs
    assert [(t.token, t.logprob, t.bytes) for t in logprobs] == [("Par", -0.1, list(b"Par")), ("is.", -0.2, list(b"is."))]
    assert [[a.token for a in t.top_logprobs] for t in logprobs] == [["Par", "alt1"], ["is.", "alt1"]]
    smol.engine.script("Par", "is.")
    events = [e async for e in await smol.openai().responses.create(model=smol.model, input="Capital?", include=["message.output_text.logprobs"], stream=True)]
    streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    assert streamed == ["Par", "is."] and [t.token for t in events[-1].response.output[0].content[0].logprobs] == ["Par", "is."]
    response = await smol.openai().responses.create(model=smol.model, input="Capital?")
    assert smol.engine.submits[-1].sampling.logprobs is None and response.output[0].content[0].logprobs == []
    for extra, param in (({"include": ["reasoning.encrypted_content"]}, "include"), ({"top_logprobs": 21}, "top_logprobs")):
        status, body = await smol.post("/v1/responses", {"model": smol.model, "input": "x", **extra})
        assert status == 400 and body["error"]["param"] == param


async def test_text_format_carries_the_schema_the_output_must_follow_and_is_echoed(smol: Api) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
    text_format = {"type": "json_schema", "name": "place", "schema": schema, "strict": True}
    smol.engine.script('{"city": "Oslo"}')
    status, body = await smol.post("/v1/responses", {"model": smol.model, "input": "Where?", "text": {"format": text_format}})
    assert status == 200 and body["output"][0]["content"][0]["text"] == '{"city": "Oslo"}'
    assert body["text"]["format"] == text_format and json.loads(smol.engine.submits[-1].sampling.grammar.text) == schema
    smol.engine.script("{}")
    status, body = await smol.post("/v1/responses", {"model": smol.model, "input": "x", "text": {"format": {"type": "json_object"}}})
    assert status == 200 and body["text"]["format"] == {"type": "json_object"}
    assert json.loads(smol.engine.submits[-1].sampling.grammar.text) == {"type": "object"}
