"""Structured outputs through the whole stack on the default model, as the OpenAI SDK asks for them: ``parse``
with a pydantic model (a strict ``json_schema``) on chat and on Responses, ``json_object`` streamed, tool_choice
required / named answered with a call; and sampled requests that a small KV cache preempts, whose grammars must
resume where their outputs were."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, launched_stack, metric_value, wait_healthy

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str
    population: int


ASK = [{"role": "user", "content": "Describe Paris as JSON with its name, country and population."}]


@pytest.fixture(scope="module")
def oai(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_parse_fills_the_pydantic_model(oai: openai.OpenAI) -> None:
    completion = oai.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, max_tokens=96, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City), choice.message.content
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_responses_parse_fills_the_pydantic_model(oai: openai.OpenAI) -> None:
    response = oai.responses.parse(model=MODEL, input=ASK[0]["content"], text_format=City, max_output_tokens=96, temperature=0, store=False)
    assert response.status == "completed" and isinstance(response.output_parsed, City), response.output_text


def test_json_object_streamed_is_one_json_object(oai: openai.OpenAI) -> None:
    chunks = oai.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=160, temperature=0, stream=True)
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop" and isinstance(json.loads(text), dict), text


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"])
def test_tool_choice_is_answered_with_a_call(oai: openai.OpenAI, choice: object) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = oai.chat.completions.create(model=MODEL, messages=messages, tools=[TIME, WEATHER], tool_choice=choice, max_tokens=64, temperature=0)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, message
    call = message.tool_calls[0].function
    assert call.name in (["get_time", "get_weather"] if choice == "required" else ["get_weather"])
    assert set(json.loads(call.arguments)) <= {"city", "zone"}


CITIES = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
                "required": ["city", "population"],
                "additionalProperties": False,
            },
            "minItems": 2,
            "maxItems": 4,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


def test_preempted_requests_resume_their_grammar_and_end_in_valid_json(tmp_path_factory: pytest.TempPathFactory) -> None:
    log = str(tmp_path_factory.mktemp("structured") / "stack.log")
    with launched_stack(free_port_block(), ["--kv-cache-tokens", "640", "--max-num-seqs", "8"], log) as stack:  # 8 answers need ~1000
        wait_healthy(stack, 300)
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        response_format = {"type": "json_schema", "json_schema": {"name": "cities", "schema": CITIES}}

        def ask(i: int):
            messages = [{"role": "user", "content": f"List {2 + i % 3} large cities with their population as JSON."}]
            return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=400, temperature=0.8, seed=i, response_format=response_format)

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(ask, range(8)))
        assert metric_value(stack.metrics("scheduler"), "tokenyard:num_preemptions_total") > 0, "the cache was meant to preempt"
        for reply in replies:
            choice = reply.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), CITIES)
