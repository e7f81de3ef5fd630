"""Both places the text can be made (``--detokenize-in``): the api (the default: no detokenizer process runs,
the worker sends each request's tokens to the api that owns it) or a detokenizer process. Either way clients
get the same: the stream says what the whole reply says, token for token with logprobs; a stop string ends
the text where it ends the whole reply and the engine stops the request; a client that leaves mid-stream
leaves nothing behind."""

from __future__ import annotations

import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import TINY_MODEL, Stack, ask_tiny, http_get, metric_value, tiny_model_stack, wait_until_quiescent


@pytest.fixture(scope="module", params=["api", "detokenizer"])
def text_stack(request, tmp_path_factory) -> Stack:
    with tiny_model_stack(tmp_path_factory, f"detokenize_in_{request.param}", ["--detokenize-in", request.param]) as stack:
        yield stack


@pytest.fixture(scope="module")
def oai(text_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{text_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def finished(stack: Stack, reason: str) -> float:
    return metric_value(stack.metrics("scheduler"), f'tokenyard:scheduler_requests_finished_total{{finished_reason="{reason}"}}', default=0)


def test_the_worker_sends_tokens_to_the_process_that_makes_the_text(text_stack: Stack) -> None:
    text_maker = text_stack.instrumentation(text_stack.text_maker)["addresses"]["inbox"]
    assert text_stack.instrumentation("worker")["addresses"][text_stack.text_maker] == text_maker
    assert list(text_stack.instrumentation("scheduler")["peers"]) == [p for p in ("worker", "detokenizer") if p in text_stack.processes]
    pids = {text_stack.instrumentation(name)["pid"] for name in text_stack.processes}
    assert len(pids) == len(text_stack.processes) and text_stack.instrumentation("api")["detokenize_in"] == text_stack.detokenize_in
    if text_stack.detokenize_in == "api":
        with pytest.raises(OSError):  # nothing serves the detokenizer's metrics port
            http_get(f"http://127.0.0.1:{text_stack.port + 3}/instrumentation", timeout=2)


def test_the_text_maker_exports_its_metrics_and_every_sample_names_the_model(text_stack: Stack) -> None:
    assert "tokenyard:detokenizer_requests" in text_stack.metrics(text_stack.text_maker)
    if "detokenizer" in text_stack.processes:
        assert "tokenyard:detokenize_batch_seconds_bucket" in text_stack.metrics("detokenizer")
    for process in text_stack.processes:
        samples = [s for family in text_string_to_metric_families(text_stack.metrics(process)) for s in family.samples]
        assert {s.labels.get("model_name") for s in samples} == {TINY_MODEL}, process


def test_the_stream_says_what_the_whole_reply_says_token_for_token(oai: openai.OpenAI) -> None:
    whole = ask_tiny(oai, logprobs=True, top_logprobs=2)
    chunks = [c for c in ask_tiny(oai, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, len(t.top_logprobs)) for t in streamed] == [(t.token, 2) for t in whole.choices[0].logprobs.content]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 40
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


def test_a_stop_string_ends_the_text_where_it_ends_the_whole_reply_and_stops_the_engine(text_stack: Stack, oai: openai.OpenAI) -> None:
    seeded = {"temperature": 1.0, "seed": 7}  # varied text (greedy, this random model repeats one token)
    text = ask_tiny(oai, **seeded).choices[0].message.content
    stop = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 3) if text.find(text[i : i + 3]) == i and text[i : i + 3].strip())
    stopped = finished(text_stack, "stop")
    whole = ask_tiny(oai, stop=[stop], **seeded)
    streamed = list(ask_tiny(oai, stop=[stop], stream=True, **seeded))
    assert whole.choices[0].message.content == text[: text.find(stop)] and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    assert finished(text_stack, "stop") == stopped + 2  # the text maker told the scheduler, which ended both requests
    wait_until_quiescent(text_stack, 30)


def test_a_client_that_leaves_mid_stream_leaves_nothing_behind(text_stack: Stack, oai: openai.OpenAI) -> None:
    aborted = finished(text_stack, "abort")
    stream = ask_tiny(oai, max_tokens=3000, stream=True)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    assert metric_value(text_stack.metrics(text_stack.text_maker), "tokenyard:detokenizer_requests") == 1
    stream.close()
    deadline = time.monotonic() + 30
    while finished(text_stack, "abort") == aborted or metric_value(text_stack.metrics(text_stack.text_maker), "tokenyard:detokenizer_requests") != 0:
        assert time.monotonic() < deadline, "the request the client left is still held"
        time.sleep(0.1)
    wait_until_quiescent(text_stack, 30)
