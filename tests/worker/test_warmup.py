"""The warm-up ladder: short lengths, powers of two and their neighbours, bounded by budget and cache."""

from __future__ import annotations

from services.worker.loop import WARMUP_MAX_TOKENS, warmup_lengths


def test_ladder_covers_short_lengths_and_powers_of_two_up_to_the_budget() -> None:
    assert warmup_lengths(256, 16384) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256]
    assert warmup_lengths(100, 16384)[-4:] == [63, 64, 65, 100]


def test_ladder_is_bounded_by_the_cache_and_a_fixed_cap() -> None:
    assert max(warmup_lengths(256, 64)) == 63  # one slot is left for the decode step
    assert max(warmup_lengths(1 << 20, 1 << 22)) == WARMUP_MAX_TOKENS
