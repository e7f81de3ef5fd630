"""Two engine replicas behind one api (``--replicas 2 --router-policy prefix``), on a tiny Llama with
the default model's tokenizer so that steps take milliseconds.

Load spreads across both replicas, a shared long prefix stays on the replica that cached it, and a
replica whose worker or scheduler is killed fails only its own requests, leaves rotation and rejoins.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import openai
import pytest

from shared.devtools.random_model import build_random_smollm
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import ENGINES, Replicas, launched_stack, metric_value, wait_supervised

MODEL = "tiny-smollm"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Replicas:
    tmp = tmp_path_factory.mktemp("replicas")
    build_random_smollm(str(tmp / MODEL))
    flags = ["--model", str(tmp / MODEL), "--replicas", "2", "--router-policy", "prefix", "--kv-cache-tokens", "8192", "--num-threads", "1"]
    with launched_stack(free_port_block(7), flags, str(tmp / "stack.log")) as stack:
        replicas = Replicas(stack)
        replicas.wait_all_in_rotation(180)
        wait_supervised(stack, 30)  # the tests kill engine processes: the launcher must be restarting them
        yield replicas


def complete(client: openai.OpenAI, prompt: str, max_tokens: int = 4) -> str:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    return reply.choices[0].finish_reason


def test_concurrent_load_spreads_over_both_replicas(replicas: Replicas) -> None:
    before = replicas.routed()
    threads = [threading.Thread(target=complete, args=(replicas.client, f"request number {i}", 64)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    routed = {name: replicas.routed()[name] - before[name] for name in ENGINES}
    assert sum(routed.values()) == 8 and min(routed.values()) >= 2, routed


def test_shared_long_prefix_stays_on_one_replica(replicas: Replicas) -> None:
    shared = "The following is a long shared system prompt about tensors and caches. " * 12  # well over 4 blocks
    hits_before = [metric_value(replicas.metrics(e), f'tokenyard:prefix_cache_hits_total{{replica="engine-{e}"}}') for e in (0, 1)]
    before = replicas.routed()
    for i in range(4):
        assert complete(replicas.client, f"{shared} Question {i}: why?") == "length"
    routed = {name: replicas.routed()[name] - before[name] for name in ENGINES}
    assert sorted(routed.values()) == [0, 4], routed
    owner = ENGINES.index(max(routed, key=routed.get))
    hits = [metric_value(replicas.metrics(e), "tokenyard:prefix_cache_hits_total") - hits_before[e] for e in (0, 1)]
    assert hits[owner] >= 3 * 100 and hits[1 - owner] == 0, hits  # three later requests reuse the shared blocks


@pytest.mark.parametrize("victim", ["worker", "scheduler"])
def test_killed_replica_fails_only_its_requests_and_rejoins(replicas: Replicas, victim: str) -> None:
    replicas.wait_all_in_rotation(120)
    outcomes: dict[int, str] = {}

    def stream(i: int) -> None:
        try:
            chunks = replicas.client.completions.create(model=MODEL, prompt=f"long story {i}", max_tokens=600, stream=True, extra_body={"ignore_eos": True})
            outcomes[i] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        except (openai.APIError, openai.APIConnectionError) as exc:
            outcomes[i] = f"error: {exc}"

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while any(metric_value(replicas.metrics(e), "tokenyard:num_requests_running") < 2 for e in (0, 1)):
        assert time.monotonic() < deadline, "the four streams did not spread two per replica"
        time.sleep(0.05)
    pid = replicas.pid(1, victim)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung after the kill"
    assert sorted(o if o == "length" else "error" for o in outcomes.values()) == ["error", "error", "length", "length"], outcomes
    # While replica 1 is out of rotation, new requests go to replica 0; then it rejoins.
    assert complete(replicas.client, "hello again") == "length"
    deadline = time.monotonic() + 60
    while replicas.pid(1, victim) in (pid, None):
        assert time.monotonic() < deadline, "the launcher did not restart the killed process"
        time.sleep(0.2)
    replicas.wait_all_in_rotation(120)
