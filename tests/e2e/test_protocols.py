"""The whole stack through the official SDKs beyond chat completions: Responses (openai), Messages and
count_tokens (anthropic), tool and reasoning fields on chat, /tokenize and /version.

SmolLM2 has no thinking template and no tool training, so these check protocol shapes,
usage and stop reasons; what reasoning and tool calls parse into is covered in tests/api.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from shared.frames import TextDelta
from tests.e2e.conftest import Stack, http_get, http_post

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def oai(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def test_responses_answer_streamed_and_not(oai: openai.OpenAI) -> None:
    whole = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0, store=False)
    assert whole.status == "completed" and "Paris" in whole.output_text and [i.type for i in whole.output] == ["message"]
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens and whole.usage.output_tokens > 0
    events = list(oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert [e.type for e in events[-4:]] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_responses_length_is_incomplete_and_statefulness_is_refused(oai: openai.OpenAI) -> None:
    cut = oai.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens" and cut.usage.output_tokens == 3
    with pytest.raises(openai.BadRequestError) as error:
        oai.responses.create(model=MODEL, input=QUESTION, previous_response_id=cut.id)
    assert error.value.body["param"] == "previous_response_id"


def test_messages_answer_streamed_and_not(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": QUESTION}]
    whole = claude.messages.create(model=MODEL, max_tokens=32, messages=ask, extra_body={"temperature": 0})
    assert whole.type == "message" and [b.type for b in whole.content] == ["text"] and "Paris" in whole.content[0].text
    assert whole.stop_reason == "end_turn" and whole.usage.output_tokens > 0
    counted = claude.messages.count_tokens(model=MODEL, messages=ask)
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == counted.input_tokens
    with claude.messages.stream(model=MODEL, max_tokens=32, messages=ask, extra_body={"temperature": 0}) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].text == whole.content[0].text and streamed.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and "content_block_delta" in kinds


def test_messages_stop_reasons(claude: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": QUESTION}]
    cut = claude.messages.create(model=MODEL, max_tokens=2, messages=ask, extra_body={"temperature": 0})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    stopped = claude.messages.create(model=MODEL, max_tokens=32, messages=ask, stop_sequences=["Paris"], extra_body={"temperature": 0})
    assert "Paris" not in stopped.content[0].text if stopped.content else True
    if "matched" in TextDelta.__struct_fields__:
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    else:  # the api cannot tell a stop string from EOS until TextDelta carries the matched string
        assert stopped.stop_reason == "end_turn"


def test_anthropic_errors_and_headers(stack: Stack) -> None:
    status, body = http_post(f"{stack.base_url}/v1/messages", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}).encode())
    error = json.loads(body)
    assert status == 400 and error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and "max_tokens" in error["error"]["message"]
    client = anthropic.Anthropic(base_url=stack.base_url, api_key="sk-any", max_retries=0, default_headers={"anthropic-version": "2023-06-01"})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}], thinking={"type": "enabled", "budget_tokens": 1024})


def test_chat_with_tools_and_reasoning_fields(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=16, temperature=0, tools=[WEATHER], reasoning_effort="none"
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks) and counts == sorted(counts) and counts[-1] == 8


def test_models_tokenize_and_version(stack: Stack, oai: openai.OpenAI) -> None:
    (card,) = oai.models.list().data
    assert card.context_length > 0 and card.reasoning_efforts == ["none"]  # type: ignore[attr-defined]
    status, body = http_post(f"{stack.base_url}/tokenize", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]}).encode())
    tokens = json.loads(body)
    reply = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=1)
    assert status == 200 and tokens["count"] == reply.usage.prompt_tokens
    status, body = http_post(f"{stack.base_url}/detokenize", json.dumps({"tokens": [504, 3575, 282, 4649, 314]}).encode())
    assert status == 200 and json.loads(body) == {"prompt": "The capital of France is"}
    status, body = http_get(f"{stack.base_url}/version")
    assert status == 200 and json.loads(body)["version"]
