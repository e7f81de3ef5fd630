"""A busy machine is not a dead worker: with CPU hogs at normal priority beside the stack, a ~1,000-token
prompt's prefill runs beside four streams, every request completes, and the scheduler takes no slow step
for a lost worker (its liveness hears the worker's heartbeats while a step computes, however long)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from shared.config import DEFAULT_MODEL_DIR
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, launched_stack, wait_healthy

MODEL = "SmolLM2-135M-Instruct"
HOG_LIMIT_S = 120  # each hog ends by itself after this, whatever the test does
LONG_PROMPT = " ".join(f"item{i}" for i in range(270))  # ~1,000 tokens


@contextmanager
def cpu_hogs(count: int, cpus: set[int] | None = None) -> Iterator[None]:
    """``count`` busy-looping processes at normal priority (on ``cpus`` where given), bounded in time."""
    loop = f"import os, time\nos.sched_setaffinity(0, {sorted(cpus)!r})\n" if cpus else "import time\n"
    loop += f"t = time.monotonic()\nwhile time.monotonic() - t < {HOG_LIMIT_S}: pass\n"
    hogs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@contextmanager
def default_model_stack(tmp_path, cpus: set[int] | None) -> Iterator[Stack]:
    """The default model's stack; confined to ``cpus`` where given (its processes inherit the launcher's CPUs)."""
    mine = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)  # this thread's CPUs, which the launcher forked from it inherits
    try:
        stack_cm = launched_stack(free_port_block(), ["--model", DEFAULT_MODEL_DIR], str(tmp_path / "stack.log"))
        stack = stack_cm.__enter__()
    finally:
        os.sched_setaffinity(0, mine)
    try:
        wait_healthy(stack, 300)
        yield stack
    finally:
        stack_cm.__exit__(None, None, None)


def long_prompt_beside_four_streams(stack: Stack) -> dict[str, str]:
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    outcomes: dict[str, str] = {}

    def stream(i: int) -> None:
        try:
            chunks = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell a story about {i}"}], max_tokens=48, stream=True, extra_body={"ignore_eos": True}
            )
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            outcomes[f"stream {i}"] = f"finished: {finishes}"
        except openai.APIError as exc:
            outcomes[f"stream {i}"] = f"error: {exc}"

    def long_prompt() -> None:
        try:
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "system", "content": LONG_PROMPT}, {"role": "user", "content": "Summarize."}], max_tokens=8
            )
            outcomes["long prompt"] = f"finished: {reply.usage.prompt_tokens} prompt tokens"
        except openai.APIError as exc:
            outcomes["long prompt"] = f"error: {exc}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)] + [threading.Thread(target=long_prompt)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return outcomes


@pytest.mark.parametrize("placement", ["every core", "one core"])
def test_a_long_prefill_beside_streams_on_a_busy_machine_fails_nothing(tmp_path, placement: str) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    cpus = {allowed[-1]} if placement == "one core" else None
    with default_model_stack(tmp_path, cpus) as stack:
        with cpu_hogs(3 if cpus else len(allowed), cpus):
            outcomes = long_prompt_beside_four_streams(stack)
        log = stack.log()
    assert len(outcomes) == 5 and all(o.startswith("finished") for o in outcomes.values()), outcomes
    assert all(o == "finished: ['length']" for name, o in outcomes.items() if name.startswith("stream")), outcomes
    assert int(outcomes["long prompt"].split()[1]) >= 900, outcomes
    assert '"peer_lost"' not in log, [line for line in log.splitlines() if "peer_lost" in line]
