"""A worker of two tensor-parallel ranks (gloo on the CPU) whose rank 1 is killed mid-generation.

Rank 0 notices the dead rank at once (not at torch.distributed's timeout, 600s): every stream in
flight ends with an error that names the rank, rank 0 exits by itself for a restart, and the
launcher brings the ranks back together.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from bench.stack_client import free_port_block
from tests.e2e.conftest import Stack, build_tiny_smollm, launched_stack, wait_healthy, wait_until_quiescent

MODEL = "tiny-smollm"
FAIL_FAST_S = 15.0  # far below the group's 600s timeout; on a quiet machine it takes about one second


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("tensor_parallel")
    build_tiny_smollm(str(tmp / MODEL))
    flags = ["--model", str(tmp / MODEL), "--tensor-parallel-size", "2", "--num-threads", "1", "--kv-cache-tokens", "8192"]
    with launched_stack(free_port_block(), flags, str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        yield stack


def test_killed_rank_fails_the_streams_fast_and_the_ranks_restart(tp_stack: Stack) -> None:
    stack = tp_stack
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    worker = stack.instrumentation("worker")
    (rank1,) = worker["tensor_parallel"]["peers"]
    assert rank1["rank"] == 1
    started = threading.Barrier(3)
    outcomes: dict[int, tuple[str, float]] = {}

    def stream(i: int) -> None:
        try:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"story {i}"}], max_tokens=3000, stream=True, extra_body={"ignore_eos": True}
            )
            for n, _ in enumerate(chunks):
                if n == 2:
                    started.wait(30)
            outcomes[i] = ("finished", time.monotonic())
        except (openai.APIError, openai.APIConnectionError) as exc:
            outcomes[i] = (f"error: {exc}", time.monotonic())

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    started.wait(60)  # both streams are generating
    killed_at = time.monotonic()
    os.kill(rank1["pid"], signal.SIGKILL)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a client hung after the rank died"
    assert all(o.startswith("error") and "tensor-parallel rank 1" in o for o, _ in outcomes.values()), outcomes
    assert max(at for _, at in outcomes.values()) - killed_at < FAIL_FAST_S, outcomes
    # Rank 0 left by itself (the launcher did not have to kill it), and the ranks come back together.
    deadline = time.monotonic() + 60
    while f"worker (pid {worker['pid']}) exited by itself with code 3" not in stack.log():
        assert time.monotonic() < deadline, stack.log()[-3000:]
        time.sleep(0.2)
    wait_healthy(stack, 120)
    restarted = stack.instrumentation("worker")
    assert restarted["pid"] != worker["pid"] and restarted["tensor_parallel"]["peers"][0]["pid"] != rank1["pid"]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "again"}], max_tokens=8, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 8
    wait_until_quiescent(stack, 5)
    assert "tensor_parallel_rank_lost" in stack.log()
