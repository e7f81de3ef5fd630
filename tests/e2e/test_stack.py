"""The whole stack, driven by the official OpenAI SDK: answers, streaming, usage, errors, aborts."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Stack, http_get, http_post, metric_value, wait_until_quiescent

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_three_processes_with_their_own_pids(stack: Stack) -> None:
    assert stack.processes == ("api", "scheduler", "worker")  # by default the api makes the text
    pids = {name: stack.instrumentation(name)["pid"] for name in stack.processes}
    assert len(set(pids.values())) == 3 and stack.process.pid not in pids.values()
    assert stack.instrumentation("api")["detokenize_in"] == "api"
    worker = stack.instrumentation("worker")
    assert worker["runner"]["dtype"] == "float32" and worker["kv_blocks_total"] == 8192 // worker["block_size"]
    assert worker["runner"]["weight_prefetch"].startswith(("keep: ", "stream: "))  # auto: decided by this CPU's L3
    assert worker["runner"]["pair_tiles"].startswith(("from ", "never: "))  # decided by this core's measured 512-bit rate
    scheduler = stack.instrumentation("scheduler")
    assert scheduler["kv_blocks_total"] == worker["kv_blocks_total"] and scheduler["addresses"]["worker"] == worker["addresses"]["inbox"]


def test_loading_state_was_reported_before_ready(stack: Stack) -> None:
    assert stack.seen_while_loading, "the api never answered while the worker loaded"
    health, status, body = stack.seen_while_loading[0]
    assert json.loads(health)["status"] in ("loading", "unavailable")
    assert status == 503 and "not ready" in json.loads(body)["error"]["message"]


def test_models_and_health(client: openai.OpenAI, stack: Stack) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http_get(f"{stack.base_url}/health")[0] == 200


def test_chat_paris_not_streamed(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-") and reply.created > 0
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens > 0 and reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_chat_paris_streamed_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    unstreamed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0)
    assert text == unstreamed.choices[0].message.content and chunks[-1].usage.completion_tokens == unstreamed.usage.completion_tokens


def test_length_finish_and_completions(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5 and "Paris" in reply.choices[0].text
    tokens = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=5, temperature=0)  # the same prompt as token ids
    assert tokens.usage.prompt_tokens == 5


def test_eight_concurrent_streams_finish_with_correct_usage(client: openai.OpenAI) -> None:
    results: dict[int, tuple[str, int, str]] = {}

    def run(i: int) -> None:
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Count to {i + 3}:",
            max_tokens=24 + i,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        results[i] = (text, chunks[-1].usage.completion_tokens, finish[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert sorted(results) == list(range(8))
    for i, (text, completion_tokens, finish) in results.items():
        assert completion_tokens == 24 + i and finish == "length" and text


def test_seed_reproduces_and_stop_strings_are_not_returned(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=20, temperature=1.0, top_p=0.95, seed=1234, extra_body={"top_k": 50})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    greedy = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0).choices[0].text
    stop = greedy.strip().split()[1]
    cut = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert greedy.startswith(cut.choices[0].text)


def test_bad_requests_get_4xx_naming_the_field(stack: Stack) -> None:
    url = f"{stack.base_url}/v1/chat/completions"
    cases = {
        b'{"model": "SmolLM2-135M-Instruct", "messages": [], "max_tokens": 3}': (400, "messages"),
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "max_tokens": "3"}': (400, "max_tokens"),
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "temperature": 5}': (400, "temperature"),
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "bogus": 1}': (400, "bogus"),
        b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}': (404, "model"),
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}': (400, "max_tokens"),
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 30}': (400, "top_logprobs"),
        b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"49152": 1}}': (400, "logit_bias"),
        b"{not json": (400, None),
    }
    for body, (status, param) in cases.items():
        got, raw = http_post(url, body)
        error = json.loads(raw)["error"]
        assert got == status, (body, raw)
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, (body, error)


def test_client_disconnect_frees_kv_blocks(stack: Stack, client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt="Write a long story.", max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    assert metric_value(stack.metrics("scheduler"), "tokenyard:kv_blocks_used") > 0
    stream.close()
    text = wait_until_quiescent(stack, 10)
    assert metric_value(text, 'tokenyard:scheduler_requests_finished_total{finished_reason="abort"}') >= 1


def test_garbage_frame_does_not_stop_the_scheduler(stack: Stack, client: openai.OpenAI) -> None:
    address = stack.instrumentation("scheduler")["addresses"]["inbox"]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    sock.send(b"\x93\xa6Submit\xc0garbage")
    sock.close(linger=1000)
    ctx.term()
    time.sleep(0.3)
    assert metric_value(stack.metrics("scheduler"), 'tokenyard:frame_decode_errors_total{socket="scheduler_inbox"}') >= 1
    assert "Paris" in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0).choices[0].message.content


def test_every_process_exports_metrics(stack: Stack) -> None:
    assert "tokenyard:time_to_first_token_seconds_bucket" in stack.metrics("api")
    assert "tokenyard:http_requests_total" in stack.metrics("api")
    assert "tokenyard:step_tokens_bucket" in stack.metrics("scheduler")
    assert "tokenyard:worker_forward_seconds_bucket" in stack.metrics("worker")
    assert "tokenyard:detokenizer_requests" in stack.metrics("api")


def test_one_request_can_be_followed_through_every_process_log(stack: Stack, client: openai.OpenAI) -> None:
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say something about logs."}], max_tokens=4, temperature=0)
    time.sleep(0.5)  # let every process flush its last lines
    events = []
    for line in stack.log().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue  # the launcher's own plain lines
    submitted = [e["rid"] for e in events if e.get("process") == "api" and e.get("event") == "request_submitted"]
    assert submitted, "the api logs no request_submitted events"
    rid = submitted[-1]
    seen = {e["process"] for e in events if e.get("rid") == rid or rid in e.get("rids", [])}
    assert seen == set(stack.processes), seen


def test_every_sample_of_every_process_carries_the_model_name(stack: Stack) -> None:
    for process in stack.processes:
        samples = [s for family in text_string_to_metric_families(stack.metrics(process)) for s in family.samples]
        assert samples, process
        assert {s.labels.get("model_name") for s in samples} == {MODEL}, process
