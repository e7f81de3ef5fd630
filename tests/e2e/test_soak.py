"""A bounded soak: a few hundred short requests of every kind (streams cut off by their client, stop strings,
requests abandoned before their answer, n > 1) leave nothing behind: no KV block, no request in any table,
and no process's memory grows past a stated bound."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp

from tests.e2e.conftest import Stack, metric_value, wait_until_quiescent

REQUESTS = 200
CONCURRENCY = 12
HANG_GUARD_S = 600.0  # fails a soak that hangs; not a timing: about 60-90 s on 2 idle cores, far longer on busy ones
RSS_GROWTH_BOUND_MB = 64.0  # per process, measured after a warm-up round of the same requests
PROMPTS = ["Tell me a story.", "What is the capital of France?", "List three colors.", "Write a haiku about the sea.", "Count to ten."]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    kind = rng.choice(["plain", "stop", "stream", "cut_stream", "abandon", "n2"])
    messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.8])}
    if kind == "stop":
        body["stop"] = rng.choice([["e"], [" the", "."], ["\n"]])
    if kind == "n2":
        body["n"] = 2
    if kind in ("stream", "cut_stream"):
        body["stream"] = True
    try:
        if kind == "abandon":  # the client gives up before the answer: its handler is cancelled and the request aborted
            timeout = aiohttp.ClientTimeout(total=rng.uniform(0.01, 0.3))
            async with session.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 64}, timeout=timeout) as response:
                await response.read()
            return f"answered {response.status}"
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if kind == "cut_stream":
                async for _ in response.content:
                    if rng.random() < 0.3:
                        response.close()  # disconnect mid-stream
                        return "cut"
            text = await response.read()
            assert response.status in (200, 429), (response.status, text)
            return f"answered {response.status}"
    except (TimeoutError, aiohttp.ClientError):
        return "abandoned"


async def _soak(url: str, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession() as session:

        async def bounded() -> str:
            async with semaphore:
                return await _one(session, url, rng)

        return await asyncio.gather(*[bounded() for _ in range(count)])


def test_soak_leaves_nothing_behind(stack: Stack) -> None:
    pids = {name: stack.instrumentation(name)["pid"] for name in stack.processes}
    asyncio.run(_soak(stack.base_url, 24, seed=1))  # warm-up: allocator pools, caches, compiled paths
    wait_until_quiescent(stack, 30)
    baseline = {name: rss_mb(pid) for name, pid in pids.items()}

    started = time.monotonic()
    outcomes = asyncio.run(asyncio.wait_for(_soak(stack.base_url, REQUESTS, seed=2), HANG_GUARD_S))
    elapsed = time.monotonic() - started
    assert sum(o == "answered 200" for o in outcomes) > REQUESTS // 2, outcomes
    assert {"cut", "abandoned"} & set(outcomes)

    scheduler_metrics = wait_until_quiescent(stack, 30)
    assert metric_value(scheduler_metrics, "tokenyard:num_requests_waiting") == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # aborts and releases settle a moment after the scheduler's step
        facts = {name: stack.instrumentation(name) for name in stack.processes}
        tables = {
            "api streams": facts["api"]["in_flight"],
            "api admitted": facts["api"]["admission"]["in_flight"],
            "scheduler running": facts["scheduler"]["running"],
            "scheduler waiting": facts["scheduler"]["waiting"],
            "kv blocks": facts["scheduler"]["kv_blocks_used"],
            "worker requests": facts["worker"]["runner"]["requests"],
            "detokenizations": metric_value(stack.metrics(stack.text_maker), "tokenyard:detokenizer_requests"),
        }
        if not any(tables.values()):
            break
        time.sleep(0.2)
    assert not any(tables.values()), tables
    assert {name: facts[name]["pid"] for name in stack.processes} == pids, "a process restarted during the soak"
    growth = {name: round(rss_mb(pid) - baseline[name], 1) for name, pid in pids.items()}
    assert all(g < RSS_GROWTH_BOUND_MB for g in growth.values()), f"RSS growth (MB) over {REQUESTS} requests in {elapsed:.0f}s: {growth}"
