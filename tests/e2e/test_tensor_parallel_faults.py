"""A worker of two tensor-parallel ranks (gloo on the CPU) whose rank 1 is killed mid-generation.

Rank 0 notices the dead rank at once (not at torch.distributed's timeout, 600s): every stream in
flight ends with an error that names the rank, the stack reports why in /health, rank 0 exits by
itself for a restart, and the launcher brings the ranks back together. A rank 1 whose rank 0 is
killed exits by itself too.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import openai
import pytest

from shared.devtools.random_model import build_random_smollm
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, http_get, launched_stack, wait_healthy, wait_supervised, wait_until_quiescent

MODEL = "tiny-smollm"
FAIL_FAST_S = 15.0  # far below the group's 600s timeout; on a quiet machine it takes about one second


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("tensor_parallel")
    build_random_smollm(str(tmp / MODEL))
    flags = ["--model", str(tmp / MODEL), "--tensor-parallel-size", "2", "--num-threads", "1", "--kv-cache-tokens", "8192"]
    with launched_stack(free_port_block(), flags, str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        wait_supervised(stack, 30)  # the tests kill ranks: the launcher must be restarting them
        yield stack


def stream_until_killed(stack: Stack, client: openai.OpenAI, kill: Callable[[], None]) -> tuple[list[str], float]:
    """Two long greedy streams; once both are generating, ``kill()``; each stream's outcome and the
    seconds from the kill to the last one's end."""
    wait_healthy(stack, 120)  # an earlier test's restart has finished, whatever that test found
    generating = threading.Barrier(3)
    outcomes: dict[int, tuple[str, float]] = {}

    def stream(i: int) -> None:
        try:
            messages = [{"role": "user", "content": f"story {i}"}]
            for n, _ in enumerate(
                client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
            ):
                if n == 2:
                    generating.wait(30)
            outcomes[i] = ("finished", time.monotonic())
        except (openai.APIError, openai.APIConnectionError) as exc:
            outcomes[i] = (f"error: {exc}", time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    generating.wait(60)
    killed_at = time.monotonic()
    kill()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a client hung after the rank died"
    return [o for o, _ in outcomes.values()], max(at for _, at in outcomes.values()) - killed_at


def wait_for_log(stack: Stack, line: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in stack.log():
        assert time.monotonic() < deadline, f"no {line!r} in:\n{stack.log()[-3000:]}"
        time.sleep(0.2)


def serves_again(stack: Stack, client: openai.OpenAI, before: dict) -> None:
    """The launcher restarted both ranks, and the new pair serves."""
    wait_healthy(stack, 120)
    restarted = stack.instrumentation("worker")
    assert restarted["pid"] != before["pid"] and restarted["tensor_parallel"]["peers"][0]["pid"] != before["tensor_parallel"]["peers"][0]["pid"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "again"}], max_tokens=8, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    wait_until_quiescent(stack, 5)


def test_killed_rank_1_fails_the_streams_at_once_and_rank_0_exits_for_a_restart(tp_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tp_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    worker = tp_stack.instrumentation("worker")
    (rank1,) = worker["tensor_parallel"]["peers"]
    assert rank1["rank"] == 1
    outcomes, took = stream_until_killed(tp_stack, client, lambda: os.kill(rank1["pid"], signal.SIGKILL))
    assert all(o.startswith("error") and "tensor-parallel rank 1" in o for o in outcomes), outcomes
    assert took < FAIL_FAST_S, (took, outcomes)
    status, body = http_get(f"{tp_stack.base_url}/health")  # rank 0 said why before it left (the ranks restart in seconds)
    assert status == 503 and "tensor-parallel rank 1" in body.decode(), body
    wait_for_log(tp_stack, f"worker (pid {worker['pid']}) exited by itself with code 3", 30)  # the launcher did not have to kill it
    serves_again(tp_stack, client, worker)


def test_killed_rank_0_fails_the_streams_and_rank_1_exits_by_itself(tp_stack: Stack) -> None:
    client = openai.OpenAI(base_url=f"{tp_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    worker = tp_stack.instrumentation("worker")
    (rank1,) = worker["tensor_parallel"]["peers"]
    outcomes, took = stream_until_killed(tp_stack, client, lambda: os.kill(worker["pid"], signal.SIGKILL))
    assert all(o.startswith("error") for o in outcomes), outcomes  # the scheduler lost its worker
    assert took < FAIL_FAST_S, (took, outcomes)
    wait_for_log(tp_stack, f"worker-rank1 (pid {rank1['pid']}) exited by itself with code 3", 30)
    serves_again(tp_stack, client, worker)
