"""Warm-up lengths: on a GPU short lengths, powers of two and their neighbours; on the CPU one length past
each row limit where the kernels change path; bounded by the budget and the cache either way."""

from __future__ import annotations

from services.worker.linear import BLOCK_QUANT_MAX_ROWS, SPLIT_MAX_ROWS
from services.worker.loop import WARMUP_MAX_TOKENS, warmup_lengths


def test_gpu_ladder_covers_short_lengths_and_powers_of_two_up_to_the_budget() -> None:
    assert warmup_lengths(256, 16384, "cuda") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256]
    assert warmup_lengths(100, 16384, "cuda")[-4:] == [63, 64, 65, 100]


def test_cpu_lengths_step_past_every_row_limit_of_the_kernels_and_stay_short() -> None:
    lengths = warmup_lengths(512, 16384, "cpu")
    for limit in (BLOCK_QUANT_MAX_ROWS, SPLIT_MAX_ROWS, 32):  # 32: the takeover pool's (csrc/takeover_pool.h)
        assert limit in lengths or limit + 1 in lengths, (limit, lengths)
    assert 1 in lengths and sum(lengths) < 100  # the first request's stall is what warm-up saves; it must not cost seconds


def test_lengths_are_bounded_by_the_cache_and_a_fixed_cap() -> None:
    for device in ("cpu", "cuda"):
        assert max(warmup_lengths(256, 20, device)) == 19  # one slot is left for the decode step
        assert max(warmup_lengths(1 << 20, 1 << 22, device)) <= WARMUP_MAX_TOKENS
    assert max(warmup_lengths(1 << 20, 1 << 22, "cuda")) == WARMUP_MAX_TOKENS
