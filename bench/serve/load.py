"""The load shapes of one level: a closed loop at fixed concurrency, or Poisson arrivals at a request rate.

Each level first sends its warm-up requests (recorded, not counted) at the level's own load shape, waits for
them all, then sends the measured ones, in one go or split into rounds that alternate with the other
endpoints' (``bench.serve.cli``). The prompt of request i is the workload's prompt i (cycled), the same
sequence for every endpoint, so two endpoints see identical work.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from bench.serve.client import RequestRecord, request_body, stream_request
from bench.serve.workload import Workload


@dataclass(frozen=True)
class Level:
    mode: str  # "concurrency" or "rate"
    value: float  # streams in flight, or requests per second
    max_concurrency: int | None = None  # a cap on streams in flight for rate mode

    def describe(self) -> dict:
        level = {"mode": self.mode, "value": self.value}
        if self.max_concurrency is not None:
            level["max_concurrency"] = self.max_concurrency
        return level

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "concurrency" else f"rate={self.value:g}/s"

    @property
    def parallel_slots(self) -> int:
        """How many concurrent streams a server needs to hold at this level (llama-server's --parallel)."""
        if self.mode == "concurrency":
            return int(self.value)
        return self.max_concurrency or 32


async def _closed_loop(concurrency: int, count: int, send: Callable[[int], Awaitable[None]]) -> None:
    """count requests, at most `concurrency` in flight; a stream's end starts the next one."""
    next_index = 0

    async def stream_slot() -> None:
        nonlocal next_index
        while next_index < count:
            index = next_index
            next_index += 1
            await send(index)

    await asyncio.gather(*(stream_slot() for _ in range(min(concurrency, count))))


async def _poisson(rate: float, count: int, max_concurrency: int | None, rng: random.Random, send: Callable[[int], Awaitable[None]]) -> None:
    """count requests whose send times are a Poisson process of `rate` per second (exponential gaps)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def gated(index: int) -> None:
        if gate is None:
            await send(index)
            return
        async with gate:
            await send(index)

    tasks = []
    for index in range(count):
        tasks.append(asyncio.create_task(gated(index)))
        if index + 1 < count:
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)


async def run_phase(
    url: str, model: str, endpoint: str, workload: Workload, level: Level, phase: str, indices: range, prompt_offset: int, seed: int,
    request_timeout_s: float, clock_origin: float, round_index: int = 0,
) -> list[RequestRecord]:  # fmt: skip
    """Requests ``indices`` of one phase ("warmup" or "measured") against one endpoint at the level's load
    shape; returns their records in index order. Request i of the phase gets the workload's prompt
    ``prompt_offset + i`` (cycled), so every endpoint and every split into rounds sees the same prompts.
    Send times are relative to ``clock_origin`` (perf_counter seconds)."""
    records: list[RequestRecord | None] = [None] * len(indices)

    # Each request on a fresh connection (stream_request's): a server may close an idle keep-alive connection
    # just as a reused one is written to (llama-server does), which would fail a request for the client's sake.
    async def send(position: int) -> None:
        index = indices[position]
        prompt_index = (prompt_offset + index) % len(workload.prompts)
        path, body = request_body(workload, model, workload.prompts[prompt_index])
        record = RequestRecord(endpoint, level.describe(), phase, index, prompt_index, workload.output_tokens, workload.ignore_eos, round=round_index)
        records[position] = await stream_request(url, path, body, record, clock_origin, request_timeout_s)

    if level.mode == "concurrency":
        await _closed_loop(int(level.value), len(indices), send)
    else:
        await _poisson(level.value, len(indices), level.max_concurrency, random.Random(seed + round_index), send)
    return [r for r in records if r is not None]
