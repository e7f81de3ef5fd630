"""A stack as it runs across hosts: ZMQ inboxes on all interfaces (CURVE required) and API keys. A peer without
the stack's key gets no frame in, one with it does; clients need their key; SIGTERM drains, then exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
import zmq

from shared.devtools.stack import free_port_block
from shared.transport import Curve, Outbox, create_keys
from tests.e2e.conftest import ROOT, Stack, http_get, http_post, launched_stack, metric_value, wait_healthy

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "e2e-secret"
DRAIN_S = 3.0


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> str:
    return create_keys(str(tmp_path_factory.mktemp("keys")))


@pytest.fixture(scope="module")
def secured(tmp_path_factory, keys_file: str) -> Stack:
    port = free_port_block(7)  # the api and metrics ports, then the three inboxes (the api makes the text)
    inboxes = {name: f"tcp://0.0.0.0:{port + 4 + i}" for i, name in enumerate(("api", "scheduler", "worker"))}
    log_path = str(tmp_path_factory.mktemp("secured") / "stack.log")
    flags = ["--kv-cache-tokens", "4096", "--max-num-batched-tokens", "64"]
    flags += [arg for name, address in inboxes.items() for arg in (f"--{name}-addr", address)]
    flags += ["--curve-key-file", keys_file, "--api-key", API_KEY, "--drain-timeout-s", str(DRAIN_S)]
    with launched_stack(port, flags, log_path) as stack:
        wait_healthy(stack, 600)  # a busy 2-core machine warms up slowly
        yield stack


def test_exposed_inboxes_without_keys_stop_the_launcher_at_once() -> None:
    port = free_port_block(5)
    result = subprocess.run(
        [sys.executable, "-m", "services.launcher", "--port", str(port), "--scheduler-addr", f"tcp://0.0.0.0:{port + 4}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "needs CURVE keys" in result.stderr


def _decode_errors(stack: Stack) -> float:
    try:
        return metric_value(stack.metrics("scheduler"), 'tokenyard:frame_decode_errors_total{socket="scheduler_inbox"}')
    except KeyError:  # none yet
        return 0.0


def test_only_a_peer_with_the_stack_key_gets_frames_in(secured: Stack, keys_file: str) -> None:
    address = secured.instrumentation("scheduler")["addresses"]["inbox"].replace("0.0.0.0", "127.0.0.1")
    ctx = zmq.Context()
    before = _decode_errors(secured)
    stranger = ctx.socket(zmq.PUSH)
    stranger.connect(address)
    stranger.send(b"garbage from a stranger")  # counted as a decode error if it ever got in
    time.sleep(2.0)
    assert _decode_errors(secured) == before
    member = Outbox(ctx, address, "member", Curve.load(keys_file))
    member.socket.send(b"garbage from a member")
    deadline = time.monotonic() + 10
    while _decode_errors(secured) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _decode_errors(secured) == before + 1
    stranger.close(0)
    member.close()
    ctx.term()


def test_clients_need_the_api_key(secured: Stack) -> None:
    assert http_get(f"{secured.base_url}/health")[0] == 200  # open for probes
    status, body = http_post(f"{secured.base_url}/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode())
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    client = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0)
    assert "Paris" in reply.choices[0].message.content


def test_sigterm_drains_then_exits_zero(secured: Stack) -> None:
    client = openai.OpenAI(base_url=f"{secured.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    outcome: list[str] = []

    def long_stream() -> None:
        try:
            stream = client.completions.create(model=MODEL, prompt="Tell me a long story.", max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
            for _ in stream:
                if not outcome:
                    outcome.append("streaming")
            outcome.append("finished")
        except openai.APIError as exc:
            outcome.append(f"error: {exc}")

    thread = threading.Thread(target=long_stream)
    thread.start()
    deadline = time.monotonic() + 60
    while not outcome and time.monotonic() < deadline:
        time.sleep(0.05)
    assert outcome == ["streaming"]
    request = urllib.request.Request(f"{secured.base_url}/instrumentation", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        api_pid = json.loads(response.read())["pid"]
    secured.process.send_signal(signal.SIGTERM)

    draining = False
    deadline = time.monotonic() + DRAIN_S
    while not draining and time.monotonic() < deadline:  # the launcher passes SIGTERM on to the api, which starts draining
        status, body = http_get(f"{secured.base_url}/health")
        draining = status == 503 and json.loads(body)["status"] == "draining"
        time.sleep(0.02)
    assert draining, "the api never reported draining on /health"
    refusal = client.with_options(timeout=5).completions.with_raw_response
    with pytest.raises(openai.APIStatusError) as refused:
        refusal.create(model=MODEL, prompt="hi", max_tokens=2)
    status, body = refused.value.status_code, refused.value.response.content
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down", body  # admission is closed while the stream still runs

    thread.join(DRAIN_S + 30)
    assert not thread.is_alive(), "the stream hung through the drain"
    assert outcome[-1].startswith("error") and "drain deadline" in outcome[-1], outcome  # an error event reached the client
    assert secured.process.wait(60) == 0
    assert not os.path.exists(f"/proc/{api_pid}") or open(f"/proc/{api_pid}/status").read().find("zombie") >= 0
    assert "drain_finished" in secured.log()
