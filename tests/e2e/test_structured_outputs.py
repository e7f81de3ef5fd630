"""Structured outputs through the whole stack on the default model, as the OpenAI SDK asks for them: ``parse``
with a pydantic model (a strict ``json_schema``) on chat and on Responses, and ``json_object`` streamed."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import Stack

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
