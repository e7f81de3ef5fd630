"""Structured outputs through the whole stack, as the official SDKs ask for them. On the default model: ``parse``
with a pydantic model (a strict ``json_schema``) on chat and on Responses, ``json_object`` streamed, tool_choice
required / named answered with a call; sampled requests that a small KV cache preempts, whose grammars must resume
where their outputs were. On a random tiny model (whose text means nothing, so only the grammar makes it valid):
every schema of ``structured_schemas.json``, regex / choice / GBNF outputs, strict tool calls, a slow-compiling
schema beside a running stream, and a thinking qwen3 checkpoint whose answer follows the schema after its reasoning."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from shared.config import DEFAULT_MODEL_DIR
from shared.devtools.random_model import build_random_smollm
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import TINY_MODEL, Stack, launched_stack, metric_value, tiny_model_stack, wait_healthy

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str
    population: int = Field(ge=0, le=100_000_000)  # unbounded, the 135M model writes one digit forever


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
    assert isinstance(json.loads(call.arguments), dict)  # not strict: any object


CITIES = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
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


BURSTS = 3


def test_preempted_requests_resume_their_grammar_and_end_in_valid_json(tmp_path_factory: pytest.TempPathFactory) -> None:
    with tiny_model_stack(tmp_path_factory, "structured-preempted", ["--kv-cache-tokens", "320", "--max-num-seqs", "8"]) as stack:  # 8 answers need ~1000
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        response_format = {"type": "json_schema", "json_schema": {"name": "cities", "schema": CITIES}}

        def ask(i: int):
            messages = [{"role": "user", "content": f"List {2 + i % 3} large cities with their population as JSON."}]
            return client.chat.completions.create(model=TINY_MODEL, messages=messages, max_tokens=250, temperature=0.8, seed=i, response_format=response_format)

        # Whether the answers overlap enough to preempt depends on when each one starts (a loaded machine may spread
        # them out): bursts until one has, every reply checked.
        for _ in range(BURSTS):
            with ThreadPoolExecutor(8) as pool:
                replies = list(pool.map(ask, range(8)))
            for reply in replies:
                choice = reply.choices[0]
                assert choice.finish_reason == "stop", choice.message.content
                jsonschema.validate(json.loads(choice.message.content), CITIES)
            if metric_value(stack.metrics("scheduler"), "tokenyard:num_preemptions_total") > 0:
                return
        pytest.fail(f"the cache was meant to preempt, and {BURSTS} bursts of 8 answers did not")


SCHEMAS = json.load(open(os.path.join(os.path.dirname(__file__), "structured_schemas.json"), encoding="utf-8"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> openai.OpenAI:
    with tiny_model_stack(tmp_path_factory, "structured-tiny", ["--max-num-seqs", "8"]) as stack:
        yield openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_the_schema_set_has_forty_schemas_of_every_kind() -> None:
    text = json.dumps(SCHEMAS)
    assert len(SCHEMAS) >= 40 and all(k in text for k in ('"$ref"', '"pattern"', '"minimum"', '"anyOf"', '"enum"', '"format"', '"items"'))


def test_every_schema_of_the_set_is_followed_by_a_random_model(tiny: openai.OpenAI) -> None:
    def ask(i: int):
        spec = SCHEMAS[i]
        response_format = {"type": "json_schema", "json_schema": {"name": spec["name"], "schema": spec["schema"], "strict": True}}
        messages = [{"role": "user", "content": "Answer in JSON."}]
        return tiny.chat.completions.create(model=TINY_MODEL, messages=messages, response_format=response_format, max_tokens=300, temperature=1.0, seed=i)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(ask, range(len(SCHEMAS))))
    for spec, reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (spec["name"], choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), spec["schema"], format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"regex": r"[A-Z][a-z]{2,5}-[0-9]{3}"}, lambda text: re.fullmatch(r"[A-Z][a-z]{2,5}-[0-9]{3}", text)),
        ({"choice": ["red", "green", "deep blue"]}, lambda text: text in ("red", "green", "deep blue")),
        ({"grammar": 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'}, lambda text: re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", text)),
    ],
    ids=["regex", "choice", "gbnf"],
)
def test_regex_choice_and_grammar_outputs_match_through_chat_and_completions(tiny: openai.OpenAI, structured: dict, check) -> None:
    for seed in range(3):
        chat = tiny.chat.completions.create(
            model=TINY_MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=60,
            temperature=1.0,
            seed=seed,
            extra_body={"structured_outputs": structured},
        )
        assert chat.choices[0].finish_reason == "stop" and check(chat.choices[0].message.content), chat.choices[0].message.content
        completion = tiny.completions.create(
            model=TINY_MODEL, prompt="x", max_tokens=60, temperature=1.0, seed=seed, extra_body={"structured_outputs": structured}
        )
        assert completion.choices[0].finish_reason == "stop" and check(completion.choices[0].text), completion.choices[0].text


def test_a_malformed_grammar_is_a_400_naming_the_field(tiny: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as error:
        tiny.chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], extra_body={"structured_outputs": {"grammar": "root ::= x"}}
        )
    assert error.value.body["param"] == "structured_outputs.grammar" and 'Rule "x" is not defined' in error.value.body["message"]


STRICT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit", "days"],
            "additionalProperties": False,
        },
    },
}


STRICT_TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False},
    },
}


def test_strict_tool_calls_arguments_follow_the_parameters(tiny: openai.OpenAI) -> None:
    for seed in range(3):
        reply = tiny.chat.completions.create(
            model=TINY_MODEL,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[STRICT_WEATHER, STRICT_TIME],
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        call = choice.message.tool_calls[0].function
        tool = {"get_weather": STRICT_WEATHER, "get_time": STRICT_TIME}[call.name]
        jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])


def test_a_slowly_compiling_schema_does_not_stall_a_running_stream(tiny: openai.OpenAI) -> None:
    slow = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{1,{i + 3}}}[0-9]{{2}}$"} for i in range(40)},
        "additionalProperties": False,
    }
    gaps: list[float] = []
    stream = tiny.chat.completions.create(
        model=TINY_MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    started = threading.Event()
    slow_reply: list = []

    def ask_slow() -> None:
        started.wait()
        response_format = {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow}}
        slow_reply.append(
            tiny.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "x"}], response_format=response_format, max_tokens=10)
        )

    thread = threading.Thread(target=ask_slow)
    thread.start()
    last, tokens, during = time.monotonic(), 0, 0
    for chunk in stream:
        now = time.monotonic()
        if chunk.choices and chunk.choices[0].delta.content:
            tokens += 1
            started.set()
            if not slow_reply and thread.is_alive() and tokens > 5:
                during += 1
            gaps.append(now - last)
        last = now
    thread.join()
    assert slow_reply and tokens >= 300
    assert during > 0  # the stream went on while the slow schema compiled (its request was waiting, not the batch)


THINKING_TEMPLATE = """{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{%- endif %}"""


@pytest.fixture(scope="module")
def thinking_qwen3(tmp_path_factory: pytest.TempPathFactory) -> openai.OpenAI:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tmp = tmp_path_factory.mktemp("thinking-qwen3")
    path = str(tmp / "tiny-qwen3")
    build_random_smollm(path)  # for SmolLM2's tokenizer files; the weights are replaced by a qwen3's
    config = Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    for name in os.listdir(path):
        if name.endswith((".safetensors", "config.json")) and not name.startswith("tokenizer"):
            os.remove(os.path.join(path, name))
    Qwen3ForCausalLM(config).save_pretrained(path)
    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    settings = json.load(open(tokenizer_config, encoding="utf-8"))
    json.dump({**settings, "chat_template": THINKING_TEMPLATE}, open(tokenizer_config, "w", encoding="utf-8"))
    flags = ["--model", path, "--num-threads", "1", "--kv-cache-tokens", "4096"]
    with launched_stack(free_port_block(), flags, str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        yield openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_thinking_qwen3_reasons_freely_then_answers_under_the_schema(thinking_qwen3: openai.OpenAI) -> None:
    from shared.tokenizer import load_tokenizer

    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
    }
    # The random model ends its reasoning only when pushed to: a bias toward the end tag's tokens (the grammar masks them later).
    think_end_bias = {str(t): 100 for t in load_tokenizer(DEFAULT_MODEL_DIR).encode("</think>", add_special_tokens=False)}
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    model = thinking_qwen3.models.list().data[0].id
    for seed in range(2):
        reply = thinking_qwen3.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "2+2?"}], response_format=response_format, max_tokens=400, temperature=1.0, seed=seed,
            logit_bias=think_end_bias,
        )  # fmt: skip
        message = reply.choices[0].message
        assert message.reasoning_content, message  # type: ignore[attr-defined]
        jsonschema.validate(json.loads(message.content), schema)
