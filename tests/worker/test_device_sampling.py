"""The device sampler (``services.worker.kernels.sampling``, plain torch, so on the CPU here) against the
torch path of ``services.worker.sampling``: the same filter sets on fixed logits, greedy equal to argmax,
draws distributed as the filtered softmax, reproducible per seed and independent of the batch."""

from __future__ import annotations

import torch

from services.worker.kernels.sampling import SamplingTensors, exponential_noise, filter_mask, sample_on_device
from services.worker.sampling import _filter_mask
from shared.frames import SamplingParams

VOCAB = 64
CPU = torch.device("cpu")

PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.5, top_k=12, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=0.0001),  # the first token always stays
    SamplingParams(temperature=2.0, top_k=VOCAB + 10, top_p=0.95),  # top_k past the vocabulary: unset
]


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    logits[:, 7] = logits[:, 9]  # a tie the threshold must keep together, as the torch path does
    return logits


def _tensors(params: list[SamplingParams], seeds: list[int] | None = None, draws: list[int] | None = None) -> SamplingTensors:
    n = len(params)
    return SamplingTensors.build(params, seeds or list(range(n)), draws or [0] * n, VOCAB, CPU)


def test_filter_sets_equal_the_torch_paths() -> None:
    logits = _logits(len(PARAMS))
    scaled = logits / torch.tensor([p.temperature for p in PARAMS])[:, None]
    t = _tensors(PARAMS)
    ours = filter_mask(scaled, t.top_k, t.top_p, t.min_p)
    theirs = _filter_mask(scaled, PARAMS)
    assert theirs is not None and torch.equal(ours, theirs)
    assert ours[0].all() and ours[5].sum() == 1 and ours[1].sum() == 5  # unfiltered, top-1, top-5
    assert torch.equal(filter_mask(scaled[:1], t.top_k[:1], t.top_p[:1], t.min_p[:1]), torch.ones(1, VOCAB, dtype=torch.bool))


def test_greedy_rows_are_argmax_and_draws_stay_in_the_filter_set() -> None:
    params = [SamplingParams(temperature=0), *PARAMS, SamplingParams(temperature=0, top_k=3)]
    logits = _logits(len(params), seed=1)
    t = _tensors(params)
    scaled = logits / torch.tensor([p.temperature or 1.0 for p in params])[:, None]
    keep = filter_mask(scaled, t.top_k, t.top_p, t.min_p)
    for draw in range(50):
        tokens = sample_on_device(logits, t._replace(draws=torch.full((len(params),), draw)))
        assert tokens[0] == logits[0].argmax() and tokens[-1] == logits[-1].argmax()
        assert all(keep[i, tokens[i]] for i in range(1, len(params) - 1))


def test_draws_follow_the_filtered_softmax() -> None:
    """20k draws of one row (draw index 0..19999) against its top-k/top-p probabilities."""
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    logits = _logits(1, seed=2)
    n = 20000
    t = _tensors([params] * n, seeds=[1234] * n, draws=list(range(n)))
    tokens = sample_on_device(logits.expand(n, -1), t)
    scaled = logits / 0.8
    keep = _filter_mask(scaled, [params])
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)[0]
    freq = torch.bincount(tokens, minlength=VOCAB).double() / n
    assert torch.equal(freq > 0, probs > 0)
    assert (freq - probs.double()).abs().max().item() < 4 * (0.25 / n) ** 0.5  # four standard errors at worst


def test_a_seeded_row_draws_the_same_tokens_in_any_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    logits = _logits(6, seed=3)
    alone = [sample_on_device(logits[2:3], _tensors([params], [42], [d])).item() for d in range(20)]
    batch_params = [SamplingParams(temperature=0.9, top_k=4)] * 6
    batch_params[4] = params
    in_batch = []
    for d in range(20):
        seeds, draws = [7, 8, 9, 10, 42, 11], [d + 3] * 6
        draws[4] = d
        in_batch.append(sample_on_device(logits[[0, 1, 3, 4, 2, 5]], _tensors(batch_params, seeds, draws))[4].item())
    assert alone == in_batch
    other_seed = [sample_on_device(logits[2:3], _tensors([params], [43], [d])).item() for d in range(20)]
    assert other_seed != alone


def test_noise_is_unit_exponential() -> None:
    noise = exponential_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 50000)
    assert noise.min() > 0 and abs(noise.mean().item() - 1) < 0.02 and abs(noise.var().item() - 1) < 0.05
    assert not torch.equal(noise[0], noise[1])
    assert torch.equal(noise, exponential_noise(torch.tensor([5, 6]), torch.tensor([0, 0]), 50000))
