"""Batched sampling: greedy is exact argmax, filters keep the right tokens, draws follow the
distribution, and a seeded row draws the same tokens whatever batch it shares."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.sampling import sample
from shared.frames import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]


def _frequencies(params: SamplingParams, n: int = 20000) -> list[float]:
    logits = torch.tensor([math.log(p) for p in PROBS]).repeat(n, 1)
    tokens = sample(logits, [params] * n, [None] * n)
    return (torch.bincount(tokens, minlength=len(PROBS)).double() / n).tolist()


def _normalised(weights: list[float]) -> list[float]:
    return [w / sum(weights) for w in weights]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=2.0), _normalised([p**0.5 for p in PROBS])),
        (SamplingParams(temperature=1.0, top_k=2), _normalised([0.5, 0.3, 0, 0])),
        (SamplingParams(temperature=1.0, top_p=0.85), _normalised([0.5, 0.3, 0.15, 0])),  # 0.05 lies past 0.95
        (SamplingParams(temperature=1.0, min_p=0.4), _normalised([0.5, 0.3, 0, 0])),  # keeps p >= 0.2
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.7), _normalised([0.5 / 0.95, 0.3 / 0.95, 0, 0])),
    ],
)
def test_draws_follow_the_filtered_distribution(params: SamplingParams, expected: list[float]) -> None:
    torch.manual_seed(0)
    for got, want in zip(_frequencies(params), expected):
        assert got == pytest.approx(want, abs=0.015)


def _logits(rows: int, vocab: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_top_k_one_and_tiny_top_p_are_argmax() -> None:
    logits = _logits(6)
    greedy = logits.argmax(dim=-1)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, seed=5),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=0.7, top_k=1, seed=3),
        SamplingParams(temperature=2.0, min_p=1.0),
    ]
    for _ in range(5):
        assert torch.equal(sample(logits, params, [None] * 6), greedy)


def test_seeded_row_draws_the_same_tokens_in_any_batch() -> None:
    logits = _logits(4)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def draws(batch: list[int], others: SamplingParams) -> list[int]:
        gens = [torch.Generator().manual_seed(42) if i == 0 else None for i in batch]
        params = [seeded if i == 0 else others for i in batch]
        row = batch.index(0)
        return [sample(logits[batch], params, gens)[row].item() for _ in range(10)]

    alone = draws([0], seeded)
    assert draws([2, 0, 1], SamplingParams(temperature=0.8, top_k=5)) == alone
    assert draws([3, 1, 0], SamplingParams(temperature=0.0)) == alone
    assert len(set(alone)) > 1  # it really samples


def test_different_seeds_draw_different_tokens() -> None:
    logits = _logits(1, vocab=50000)
    runs = []
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        runs.append([sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [gen]).item() for _ in range(8)])
    assert runs[0] != runs[1]
