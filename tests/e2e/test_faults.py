"""Fault injection on a stack of its own: a killed process fails its requests cleanly and comes back."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, launched_stack, metric_value, wait_healthy, wait_supervised, wait_until_quiescent

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def fresh_stack(request, tmp_path_factory) -> Stack:
    """A stack of its own, making text where ``request.param`` says (``--detokenize-in``); its two victims' tests
    share it, each leaving it serving."""
    log_path = str(tmp_path_factory.mktemp("faults") / "stack.log")
    with launched_stack(free_port_block(), ["--kv-cache-tokens", "4096", "--detokenize-in", request.param], log_path) as stack:
        wait_healthy(stack, 300)
        wait_supervised(stack, 30)  # the tests kill children: the launcher must be restarting them
        yield stack


def _pid_of(stack: Stack, process: str) -> int | None:
    try:
        return stack.instrumentation(process)["pid"]
    except (OSError, ValueError):
        return None


# The default stack (the api makes the text) loses its worker, then its scheduler; one with a detokenizer, that, then its worker.
VICTIMS = {"api": ("worker", "scheduler"), "detokenizer": ("detokenizer", "worker")}


@pytest.mark.parametrize("turn", [0, 1], ids=["first", "second"])
@pytest.mark.parametrize("fresh_stack", list(VICTIMS), indirect=True)
def test_killed_process_fails_streams_then_the_stack_serves_again(request, fresh_stack: Stack, turn: int) -> None:
    stack, victim = fresh_stack, VICTIMS[request.node.callspec.params["fresh_stack"]][turn]
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    outcomes: list[str] = []

    def stream() -> None:
        try:
            chunks = client.completions.create(model=MODEL, prompt="Tell me a very long story.", max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
            for _ in chunks:
                pass
            outcomes.append("finished")
        except (openai.APIError, openai.APIConnectionError) as exc:
            outcomes.append(f"error: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while metric_value(stack.metrics("scheduler"), "tokenyard:num_requests_running") < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = stack.instrumentation(victim)["pid"]
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a client hung after the kill"
    assert len(outcomes) == 4 and all(o.startswith("error") for o in outcomes), outcomes
    deadline = time.monotonic() + 30
    while _pid_of(stack, victim) in (pid, None) and time.monotonic() < deadline:  # the launcher restarts it
        time.sleep(0.2)
    assert _pid_of(stack, victim) not in (pid, None)
    wait_healthy(stack, 240)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    wait_until_quiescent(stack, 3)
