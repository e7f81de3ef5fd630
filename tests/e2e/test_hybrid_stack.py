"""A hybrid model (a tiny random qwen3_next with the default model's tokenizer) served end to end: chat, streaming,
the reasoning split, tool calls, aborts and a killed worker, and its prefix cache: a multi-turn conversation gives the
same greedy answers with the cache and without, resuming each turn at the GDN checkpoint of its last unchanged message."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from shared.devtools.random_model import build_random_qwen3_next
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, launched_stack, metric_value, wait_healthy, wait_supervised, wait_until_quiescent

MODEL = "tiny-qwen3-next"
FLAGS = ["--num-threads", "1", "--kv-cache-tokens", "4096", "--block-size", "8", "--reasoning-parser", "think", "--tool-call-parser", "hermes"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return build_random_qwen3_next(str(tmp_path_factory.mktemp("hybrid") / MODEL))


def _stack(model_dir: str, tmp_path_factory, name: str, flags: list[str]) -> Iterator[Stack]:
    log_path = str(tmp_path_factory.mktemp(name) / "stack.log")
    with launched_stack(free_port_block(), ["--model", model_dir, *FLAGS, *flags], log_path) as stack:
        wait_healthy(stack, 300)
        yield stack


@pytest.fixture(scope="module")
def stack(model_dir: str, tmp_path_factory) -> Iterator[Stack]:
    yield from _stack(model_dir, tmp_path_factory, "hybrid_cached", [])


@pytest.fixture(scope="module")
def uncached(model_dir: str, tmp_path_factory) -> Iterator[Stack]:
    yield from _stack(model_dir, tmp_path_factory, "hybrid_uncached", ["--enable-prefix-cache", "false"])


def client_of(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(stack: Stack, messages: list[dict], **kwargs):
    settings = {"max_tokens": 12, "temperature": 0, **kwargs}
    return client_of(stack).chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": True}, **settings)


def test_both_processes_say_the_hybrid_prefix_cache_is_on_and_what_its_checkpoints_hold(stack: Stack) -> None:
    scheduler, worker = stack.instrumentation("scheduler"), stack.instrumentation("worker")["runner"]
    assert scheduler["prefix_cache"]["enabled"] is True and scheduler["prefix_cache"]["gdn_checkpoints"]["total"] == 64
    assert worker["family"] == "qwen3_next" and worker["prefix_cache"] == {"enabled": True}
    assert worker["gdn_state"]["checkpoints_total"] == 64
    assert worker["gdn_state"]["checkpoint_bytes"] == 64 * worker["gdn_state"]["bytes_per_slot"]


def test_chat_streamed_and_not_say_the_same_with_usage(stack: Stack) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    whole = chat(stack, messages)
    streamed = list(chat(stack, messages, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    assert text == whole.choices[0].message.content and streamed[-1].usage.completion_tokens == 12


def test_a_multi_turn_conversation_answers_the_same_with_the_cache_and_resumes_at_its_anchors(stack: Stack, uncached: Stack) -> None:
    system = {"role": "system", "content": "You are a careful assistant who answers every question about the weather in a few words. " * 4}
    answers: dict[str, list[str]] = {}
    cached: dict[str, list[int]] = {}
    prompts: list[int] = []
    for name, s in (("off", uncached), ("on", stack)):
        history = [system, {"role": "user", "content": "What is the weather in Paris today?"}]
        first = chat(s, history)
        history += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And tomorrow?"}]
        second = chat(s, history)
        edited = [*history[:-1], {"role": "user", "content": "And in Lyon?"}]  # turn 2's last user message edited
        third = chat(s, edited)
        answers[name] = [r.choices[0].message.content for r in (first, second, third)]
        cached[name] = [r.usage.prompt_tokens_details.cached_tokens or 0 for r in (first, second, third)]
        prompts = [r.usage.prompt_tokens for r in (first, second, third)]
    assert answers["on"] == answers["off"]
    assert cached["off"] == [0, 0, 0]
    # turn 2 resumes where turn 1's prompt ended (whole blocks of 8), turn 3 after turn 1's answer: the message before the edit
    assert prompts[0] - 8 < cached["on"][1] <= prompts[0]
    assert cached["on"][1] < cached["on"][2] < prompts[2]
    text = stack.metrics("scheduler")
    assert metric_value(text, "tokenyard:prefix_cache_gdn_checkpoints_used_total") >= 2
    assert metric_value(text, "tokenyard:prefix_cache_hits_total") >= sum(cached["on"])


def test_reasoning_is_split_from_the_answer(stack: Stack) -> None:
    # An assistant message that opens a reasoning block, continued: the answer so far is all reasoning.
    messages = [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "<think>\n"}]
    reply = client_of(stack).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False},
    )  # fmt: skip
    message = reply.choices[0].message
    assert message.reasoning_content and not message.content  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens_details.reasoning_tokens > 0  # the reasoning text's tokens, counted again


def test_a_required_tool_call_is_parsed_into_tool_calls(stack: Stack) -> None:
    weather = {
        "type": "function",
        "function": {
            "name": "weather",
            "strict": True,  # a random model closes its arguments only when the grammar holds their schema
            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"], "additionalProperties": False},
        },
    }
    reply = client_of(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[weather],
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        reasoning_effort="none",  # a thinking model's grammar holds only what follows its reasoning
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Lyon")


def test_an_aborted_stream_leaves_no_blocks_or_state_slots_behind(stack: Stack) -> None:
    aborted = metric_value(stack.metrics("scheduler"), 'tokenyard:scheduler_requests_finished_total{finished_reason="abort"}', 0)
    chunks = chat(stack, [{"role": "user", "content": "Go on and on."}], max_tokens=3000, stream=True)
    for n, _ in enumerate(chunks):
        if n == 3:
            break
    chunks.close()
    deadline = time.monotonic() + 30
    while metric_value(stack.metrics("scheduler"), 'tokenyard:scheduler_requests_finished_total{finished_reason="abort"}', 0) == aborted:
        assert time.monotonic() < deadline, "the abort never reached the scheduler"
        time.sleep(0.1)
    text = wait_until_quiescent(stack, 30)
    assert metric_value(text, "tokenyard:gdn_state_slots_used") == 0


def test_a_killed_worker_fails_its_requests_then_the_stack_answers_as_before(stack: Stack) -> None:
    wait_supervised(stack, 30)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    before = chat(stack, messages).choices[0].message.content  # its prefix is now cached: KV and GDN checkpoints
    os.kill(stack.instrumentation("worker")["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 300  # a restarted worker loads and warms up again
    while True:
        try:
            after = chat(stack, messages)
            break
        except (openai.APIError, openai.APIConnectionError):
            assert time.monotonic() < deadline, stack.log()[-3000:]
            time.sleep(0.5)
    # the new worker holds none of the old cache: the scheduler forgot it, so the answer is recomputed, and the same
    assert after.choices[0].message.content == before
    assert (after.usage.prompt_tokens_details.cached_tokens or 0) == 0
