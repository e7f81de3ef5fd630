"""The pool that runs few-row products and attention (csrc/takeover_pool.h): the caller takes over the
items of a helper that is not running, and a helper taken over never writes into the output afterwards."""

from __future__ import annotations

import time

import pytest
import torch

from services.worker import block_quant
from services.worker.cpu_kernels import cpu_kernels

from .harness import check_same_bits_at_every_thread_count

pytestmark = pytest.mark.skipif(cpu_kernels()[0] is None, reason="the CPU kernels did not build here")

STALL_US = 50_000  # each helper item: far longer than the caller's patience (4x its mean item: a flat 500 000-token top-p row takes ~10 ms), so every one is taken over


def kernels():
    return cpu_kernels()[0]


def few_row_calls(rows: int) -> list:
    """A product over q4_1 panels (with a bias), one over q8_0 panels (lm_head's), attention over a paged
    cache (long contexts read in place; short ones, from 8 rows on 2 threads, copied row by row) and
    sampling (argmax, and draws under each filter; an item per row: from 2 rows): each long enough for a helper to take items
    before the caller is done."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(4099, 1536, generator=generator)
    q4 = block_quant.to_panels(block_quant.quantize(weight, "q4_1"))
    q8 = block_quant.to_panels(block_quant.quantize(weight, "q8_0"), "q8_0")
    x, bias = torch.randn(rows, 1536, generator=generator), torch.randn(4099, generator=generator)
    cache = torch.randn(2400 * 16, 2, 3, 64, generator=generator)
    q = torch.randn(rows, 9, 64, generator=generator)
    tables = torch.randint(0, 2400, (rows, 256), generator=generator, dtype=torch.int32)  # rows may share blocks: attention only reads
    lens = torch.randint(2048, 256 * 16, (rows,), generator=generator, dtype=torch.int32)
    half_cache = cache.half()
    short_lens = torch.randint(100, 240, (rows,), generator=generator, dtype=torch.int32)
    logits = torch.randn(rows, 500_000, generator=generator)
    # temperature, top_k, top_p, min_p and the uniform draw per row: greedy, plain, top-k, top-p, min-p rows
    filters = [[(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.2, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1)][r % 5] for r in range(rows)]
    filters = [list(values) for values in zip(*filters)] + [torch.rand(rows, generator=generator, dtype=torch.float64).tolist()]
    return [
        lambda: kernels().block_quant_gemm(x, q4, 4099, bias, None, 16),
        lambda: kernels().block_quant_gemm(x, q8, 4099, None, None, 16),
        lambda: kernels().paged_decode_attention(q, cache, tables, lens, 16, 0.125),
        lambda: kernels().paged_decode_attention(q, half_cache, tables, short_lens, 16, 0.125),
    ] + ([lambda: kernels().argmax_rows(logits), lambda: kernels().sample_rows(logits, *filters)] if rows > 1 else [])


def taken_over() -> int:
    return kernels().takeover_pool_stats()["taken_over"]


def call_until_taken_over(call, expected: torch.Tensor | None = None) -> torch.Tensor:
    """Calls until one call had an item taken over (a helper must be running to take one first), checking
    each result against ``expected``; returns that call's result.

    The calls follow one another at once: a helper asleep when one starts may wake after the caller has
    taken every item, and it then spins for the next job, which the next call gives it; a helper still
    stalled in an earlier call's item takes new ones once it is back."""
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        before = taken_over()
        out = call()
        if expected is not None:
            assert torch.equal(out, expected)
        if taken_over() > before:
            return out
    raise AssertionError("no item was taken over in 10 s of calls")


@pytest.fixture(autouse=True)
def takeover_pool():
    """The pool on, as the runner turns it on for the dense decoder; off again afterwards."""
    kernels().set_takeover_pool(True)
    yield
    kernels().set_takeover_pool(False)


@pytest.fixture
def stalled_helpers():
    """Every pool helper stalls before committing an item, as if preempted there; two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    kernels().set_takeover_helper_stall_us(STALL_US)
    try:
        yield
    finally:
        kernels().set_takeover_helper_stall_us(0)
        time.sleep(2 * STALL_US / 1e6)  # the last stalled helpers leave their jobs
        torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 32])
def test_items_taken_over_from_a_stalled_helper_give_the_results_of_one_thread(rows: int, stalled_helpers) -> None:
    calls = few_row_calls(rows)
    torch.set_num_threads(1)
    alone = [call() for call in calls]
    torch.set_num_threads(2)
    for call, expected in zip(calls, alone):
        call_until_taken_over(call, expected)


def test_a_helper_taken_over_never_writes_into_the_output_after_the_call_returned(stalled_helpers) -> None:
    for call in few_row_calls(1):
        out = call_until_taken_over(call)
        out.fill_(7.0)  # the caller's next kernel writes over it (add_rms_norm does, in place)
        time.sleep(3 * STALL_US / 1e6)  # the stalled helper has woken and tried to commit by now
        assert bool((out == 7.0).all())


@pytest.mark.parametrize("rows", [3, 8, 32])
def test_few_row_calls_give_the_same_bits_at_every_thread_count_unstalled(rows: int) -> None:
    for call in few_row_calls(rows):
        check_same_bits_at_every_thread_count(call)
