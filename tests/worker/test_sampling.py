"""Batched sampling: greedy is exact argmax, filters keep the right tokens, draws follow the
distribution, a seeded row draws the same tokens whatever batch it shares; penalties and
logit bias move exactly the logits they should, and logprobs are those of the processed logits.
The draws are checked through both samplers: the compiled kernel (csrc/sample_rows.cpp), which the
CPU worker uses, and the torch path, its fallback."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker import sampling
from services.worker.cpu_kernels import cpu_kernels
from services.worker.sampling import LogitBias, TokenHistory, process_logits, row_argmax, sample, token_logprobs
from shared.frames import SamplingParams

PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.fixture(params=["kernel", "torch"])
def sampler(request, monkeypatch) -> str:
    """``sample`` through the compiled kernel, or through its torch fallback (as without the kernels)."""
    if request.param == "kernel":
        assert cpu_kernels()[0] is not None, "the kernel under test is not built"
    else:
        monkeypatch.setattr(sampling, "cpu_kernels", lambda: (None, "disabled by the test"))
    return request.param


# Where PROBS's tokens sit in a longer row (the rest -inf): in the kernel's blocks of eight and in its tail.
SPREAD = {3: 0, 9: 1, 16: 2, 20: 3}


def _frequencies(params: SamplingParams, spread: bool, n: int = 20000) -> list[float]:
    row = torch.tensor([math.log(p) for p in PROBS])
    if spread:
        row = torch.full((21,), float("-inf")).index_copy_(0, torch.tensor(list(SPREAD)), row)
    tokens = sample(row.repeat(n, 1), [params] * n, [None] * n)
    if spread:
        assert set(tokens.unique().tolist()) <= set(SPREAD)
        tokens = torch.tensor([SPREAD[t] for t in tokens.tolist()])
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
@pytest.mark.parametrize("spread", [False, True])
def test_draws_follow_the_filtered_distribution(params: SamplingParams, expected: list[float], spread: bool, sampler: str) -> None:
    torch.manual_seed(0)
    for got, want in zip(_frequencies(params, spread), expected):
        assert got == pytest.approx(want, abs=0.015)


def _logits(rows: int, vocab: int = 1000, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_top_k_one_and_tiny_top_p_are_argmax(sampler: str) -> None:
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


def test_seeded_row_draws_the_same_tokens_in_any_batch(sampler: str) -> None:
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


# Penalties, logit bias and logprobs on fixed logit vectors. -------------------------------------

LOGITS = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])


def _history(params: SamplingParams, prompt: list[int], outputs: list[int]) -> TokenHistory:
    history = TokenHistory(params)
    history.add_prompt(prompt)
    history.add_outputs(outputs)
    return history


def test_penalties_lower_repeated_tokens_by_the_documented_amounts() -> None:
    # token 0 (2.0) output twice, token 1 (-1.0) output once, token 3 (-3.0) in the prompt only, 5 (0.0) in both
    prompt, outputs = [3, 5], [0, 1, 0, 5]
    cases = [
        (SamplingParams(presence_penalty=0.5), [1.5, -1.5, 0.5, -3.0, 1.0, -0.5]),
        (SamplingParams(frequency_penalty=0.25), [1.5, -1.25, 0.5, -3.0, 1.0, -0.25]),
        (SamplingParams(frequency_penalty=-1.0), [4.0, 0.0, 0.5, -3.0, 1.0, 1.0]),
        # repetition: seen positive logits divided, negative multiplied, prompt tokens included
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.5, -6.0, 1.0, 0.0]),
        (SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), [0.0, -2.75, 0.5, -6.0, 1.0, -0.75]),
    ]
    for params, expected in cases:
        processed = process_logits(LOGITS.clone(), [params], [_history(params, prompt, outputs)])
        assert processed[0].tolist() == pytest.approx(expected), params


def test_repetition_penalty_ignores_the_prompt_for_presence_and_frequency() -> None:
    params = SamplingParams(presence_penalty=1.0, frequency_penalty=1.0)
    processed = process_logits(LOGITS.clone(), [params], [_history(params, [0, 0, 0, 4], [])])
    assert torch.equal(processed, LOGITS)


def test_logit_bias_shifts_and_can_force_or_ban_a_token() -> None:
    bias = LogitBias.of({3: 10.0, 0: -100.0})
    processed = process_logits(LOGITS.clone(), [SamplingParams()], None, [bias])
    assert processed[0].tolist() == pytest.approx([-98.0, -1.0, 0.5, 7.0, 1.0, 0.0])
    assert sample(processed, [SamplingParams(temperature=0.0)], [None]).item() == 3
    # bias is added before the penalties (vLLM's order): token 3 biased to 7, then divided by 2
    params = SamplingParams(repetition_penalty=2.0)
    processed = process_logits(LOGITS.clone(), [params], [_history(params, [3], [])], [bias])
    assert processed[0, 3].item() == pytest.approx(3.5)


def test_rows_keep_their_own_penalties_and_biases_in_a_batch() -> None:
    penalised = SamplingParams(frequency_penalty=1.0)
    logits = LOGITS.repeat(3, 1)
    processed = process_logits(
        logits.clone(), [SamplingParams(), penalised, SamplingParams()], [None, _history(penalised, [], [0]), None], [None, None, LogitBias.of({1: 1.0})]
    )
    assert torch.equal(processed[0], LOGITS[0])
    assert processed[1].tolist() == pytest.approx([1.0, -1.0, 0.5, -3.0, 1.0, 0.0])
    assert processed[2].tolist() == pytest.approx([2.0, 0.0, 0.5, -3.0, 1.0, 0.0])


def test_logprobs_are_the_log_softmax_of_the_processed_logits() -> None:
    logits = _logits(3, vocab=50)
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_k=3, logprobs=0)]
    bias = [LogitBias.of({7: 4.0}), None, None]
    processed = process_logits(logits.clone(), params, None, bias)
    tokens = sample(processed, params, [None] * 3)
    out = token_logprobs(processed, tokens, params)
    expected = torch.log_softmax(processed, dim=-1)
    assert out[1] is None
    assert out[0].logprob == pytest.approx(expected[0, tokens[0]].item()) and tokens[0] == processed[0].argmax()
    assert out[0].top_ids == expected[0].topk(5).indices.tolist()
    assert out[0].top_logprobs == sorted(out[0].top_logprobs, reverse=True) and len(out[0].top_logprobs) == 5
    assert out[0].top_logprobs == pytest.approx(expected[0].topk(5).values.tolist())
    # not the temperature-scaled or top-k-truncated distribution: logprobs stay finite and independent of them
    assert out[2].logprob == pytest.approx(expected[2, tokens[2]].item()) and out[2].top_ids == []


@pytest.mark.parametrize("vocab", [50, 1003, 49152])
def test_the_logprobs_kernel_answers_as_log_softmax_gather_and_topk(vocab: int) -> None:
    kernels = cpu_kernels()[0]
    assert kernels is not None, "the kernel under test is not built"
    logits = _logits(6, vocab=vocab, seed=vocab)
    logits[1] *= 0.02  # flat: the top 5 among many near the largest
    logits[2] = -4.0 * torch.arange(1, vocab + 1).float().log()  # peaked
    tokens = torch.randint(0, vocab, (6,), generator=torch.Generator().manual_seed(1))
    tokens[3] = logits[3].argmax()
    expected = torch.log_softmax(logits, dim=-1)
    for k in (0, 1, 5, 20):
        chosen, values, ids, ok = kernels.logprobs_rows(logits, tokens, k)
        assert bool(ok.all())
        torch.testing.assert_close(chosen, expected.gather(1, tokens[:, None]).squeeze(1), rtol=1e-5, atol=1e-5)
        top = expected.topk(k, dim=-1)
        assert torch.equal(ids, top.indices)
        torch.testing.assert_close(values, top.values, rtol=1e-5, atol=1e-5)


def test_logprobs_of_rows_without_a_finite_logit_are_torchs() -> None:
    logits = torch.zeros(3, 40)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")
    logits[2, 5] = 1.0
    out = token_logprobs(logits, torch.tensor([3, 0, 5]), [SamplingParams(temperature=0.0, logprobs=2)] * 3)
    assert math.isnan(out[0].logprob) and math.isnan(out[1].logprob)
    assert out[2].logprob == pytest.approx(torch.log_softmax(logits[2], dim=-1)[5].item())
    assert out[2].top_ids[0] == 5 and len(out[2].top_ids) == 2


def test_penalties_read_and_write_only_each_rows_distinct_tokens_as_a_dense_pass_would() -> None:
    """The sparse history against the penalties' dense definition, on the default model's vocabulary:
    rows mixing the three penalties, repeated output tokens, prompt tokens and rows without penalties."""
    vocab = 49152
    generator = torch.Generator().manual_seed(9)
    logits = torch.randn(4, vocab, generator=generator) * 4
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
        SamplingParams(),
        SamplingParams(frequency_penalty=-0.5),
        SamplingParams(repetition_penalty=0.8),
    ]
    prompts = [torch.randint(0, vocab, (300,), generator=generator).tolist() for _ in params]
    outputs = [torch.randint(0, 500, (400,), generator=generator).tolist() for _ in params]  # many repeats
    histories = [_history(p, prompt, output) if p.penalised else None for p, prompt, output in zip(params, prompts, outputs)]
    expected = logits.clone()
    for row, p in enumerate(params):
        counts = torch.bincount(torch.tensor(outputs[row]), minlength=vocab).float()
        seen = counts > 0
        if p.repetition_penalty != 1:
            seen[prompts[row]] = True
            values = expected[row]
            expected[row] = torch.where(seen, torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty), values)
        expected[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    assert torch.equal(process_logits(logits.clone(), params, histories), expected)


def test_seeded_penalised_row_draws_the_same_tokens_in_any_batch() -> None:
    logits = _logits(3, vocab=200)
    seeded = SamplingParams(temperature=1.0, seed=11, presence_penalty=1.5, repetition_penalty=1.2, logit_bias={4: 2.0})

    def draws(batch: list[int]) -> list[int]:
        row = batch.index(0)
        gen = torch.Generator().manual_seed(11)
        history = TokenHistory(seeded)
        history.add_prompt([4, 9])
        others = SamplingParams(temperature=0.9, frequency_penalty=0.5)
        params = [seeded if i == 0 else others for i in batch]
        out = []
        for _ in range(12):
            histories = [history if i == 0 else TokenHistory(others) for i in batch]
            biases = [LogitBias.of(p.logit_bias) for p in params]
            processed = process_logits(logits[batch].clone(), params, histories, biases)
            token = sample(processed, params, [gen if i == 0 else None for i in batch])[row].item()
            history.add_outputs([token])
            out.append(token)
        return out

    alone = draws([0])
    assert draws([2, 0, 1]) == alone and draws([1, 2, 0]) == alone
    assert len(set(alone)) > 2  # it really samples


@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (3, 7), (2, 8), (4, 13), (5, 1003), (32, 49152)])
def test_row_argmax_is_torch_argmax(rows: int, vocab: int) -> None:
    """Greedy's argmax (the C++ kernel for fp32 on the CPU): rows shorter than, equal to and not a
    multiple of its eight lanes, and the default model's vocabulary."""
    assert cpu_kernels()[0] is not None, "the kernel under test is not built"
    scores = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows * vocab))
    assert torch.equal(row_argmax(scores), scores.argmax(dim=-1))


def test_row_argmax_answers_ties_infinities_and_nan_as_torch_does() -> None:
    scores = torch.zeros(6, 40)
    scores[0, [5, 30]] = 1.0  # a tie between lanes: the first position
    scores[1] = float("-inf")  # nothing larger than -inf: position 0
    scores[2, [17, 3]] = float("nan")  # NaN wins, the first one
    scores[3, 39] = float("inf")  # in the tail past the last whole eight
    scores[4] = torch.randint(0, 3, (40,), generator=torch.Generator().manual_seed(0)).float()  # ties in every lane
    scores[5, 36] = float("nan")  # NaN only in the tail
    assert torch.equal(row_argmax(scores), scores.argmax(dim=-1))
    short = torch.tensor([[1.0, float("nan"), 3.0], [2.0, 2.0, 1.0]])
    assert torch.equal(row_argmax(short), short.argmax(dim=-1))


def _peaked_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits as a language model's: a few tokens hold most of the mass, a long tail the rest."""
    generator = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    return (
        torch.stack([(-1.5 * ranks.log())[torch.randperm(vocab, generator=generator)] for _ in range(rows)])
        + torch.rand(rows, vocab, generator=generator) * 0.01
    )


FILTERS = [(0, 0.95), (40, 1.0), (0, 1.0), (50, 0.5), (1000, 0.9), (0, 0.3), (1, 1.0), (0, 0.9)]  # (top_k, top_p) per row


def _masks(scaled: torch.Tensor, filters: list[tuple[int, float]], monkeypatch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """_filter_mask's, the full sort's, and how many times _filter_mask sorted whole rows."""
    vocab = scaled.shape[-1]
    top_k = torch.tensor([k if 0 < k < vocab else vocab for k, _ in filters])
    top_p = torch.tensor([p for _, p in filters])
    expected = scaled >= sampling._cut_logits(scaled, top_k, top_p, candidates=vocab)
    sorts = []
    cut = sampling._cut_logits

    def counted(*args, candidates: int = sampling.FILTER_CANDIDATES):
        sorts.extend([1] if candidates >= vocab else [])
        return cut(*args, candidates=candidates)

    monkeypatch.setattr(sampling, "_cut_logits", counted)
    keep = sampling._filter_mask(scaled, [SamplingParams(top_k=k, top_p=p) for k, p in filters])
    monkeypatch.setattr(sampling, "_cut_logits", cut)
    return keep, expected, len(sorts)


@pytest.mark.parametrize("peaked", [True, False])
def test_the_cut_among_the_largest_logits_keeps_what_a_full_sort_keeps(peaked: bool, monkeypatch) -> None:
    """The cut is looked for among the largest FILTER_CANDIDATES logits, the whole row sorted only when it may lie past them
    (a flat row's top-p): either way each row keeps the tokens that the full sort's cut keeps."""
    scaled = _peaked_logits(len(FILTERS), 49152, seed=3) if peaked else _logits(len(FILTERS), 49152, seed=3)
    keep, expected, sorts = _masks(scaled, FILTERS, monkeypatch)
    assert torch.equal(keep, expected)
    assert keep[2].all() and int(keep[6].sum()) == 1 and int(keep[1].sum()) == 40  # no filter; top-k 1; top-k 40
    assert sorts == (0 if peaked else 1)


def test_a_top_k_beyond_the_candidates_sorts_the_whole_row(monkeypatch) -> None:
    scaled = _peaked_logits(2, 49152, seed=4)
    keep, expected, sorts = _masks(scaled, [(0, 0.9), (sampling.FILTER_CANDIDATES + 500, 1.0)], monkeypatch)
    assert torch.equal(keep, expected) and int(keep[1].sum()) == sampling.FILTER_CANDIDATES + 500
    assert sorts == 1


# The compiled sampler's cut and draw, against a float64 full sort. -------------------------------------

THRESHOLD_FILTERS = [  # (temperature, top_k, top_p, min_p) per row
    (1.0, 0, 1.0, 0.0),
    (0.7, 40, 1.0, 0.0),
    (0.8, 0, 0.95, 0.0),
    (1.0, 50, 0.5, 0.0),
    (1.2, 1000, 0.9, 0.0),
    (1.0, 0, 0.3, 0.0),
    (1.0, 1, 1.0, 0.0),
    (1.0, 0, 0.9, 0.05),
    (1.0, 5000, 1.0, 0.0),
    (1.5, 0, 0.999, 0.0),
    (0.8, 40, 0.95, 0.05),  # llama.cpp's defaults
    (1.0, 0, 1.0, 0.1),  # min-p alone: the kept set among candidates, with no cut
    (0.7, 200, 1.0, 0.2),
    (0.013, 7, 0.9, 0.3),  # logits far apart once scaled
]


def _rows(kind: str, vocab: int) -> torch.Tensor:
    """One row per filter: a language model's spread (the cut among the largest few), a flat row
    (the cut among all of them), or small integers (ties at every cut)."""
    generator = torch.Generator().manual_seed(vocab)
    rows = len(THRESHOLD_FILTERS)
    if kind == "peaked":
        ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
        return torch.stack([(-4.0 * ranks.log())[torch.randperm(vocab, generator=generator)] for _ in range(rows)])
    if kind == "flat":
        return torch.randn(rows, vocab, generator=generator) * 0.5
    return torch.randint(0, 6, (rows, vocab), generator=generator).float()


def _reference_keep(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The tokens sampling keeps, from a float64 sort: top-k, then top-p of the top-k renormalised, then min-p."""
    scaled = row / torch.tensor(temperature, dtype=torch.float32)  # float32 division, as the kernel's
    ordered = scaled.double().sort(descending=True).values
    vocab = len(ordered)
    k = top_k if 0 < top_k < vocab else vocab
    top_p = float(torch.tensor(top_p, dtype=torch.float32))
    probs = torch.softmax(ordered[:k], dim=0)
    count = k if top_p >= 1 else min(max(int(((probs.cumsum(0) - probs) < top_p).sum()), 1), k)
    keep = scaled >= ordered[count - 1].float() if (k < vocab or top_p < 1) else torch.ones(vocab, dtype=torch.bool)
    if min_p > 0:
        keep &= scaled >= scaled.max() + torch.log(torch.tensor(min_p, dtype=torch.float32))
    return keep


def _kernel_args(filters: list[tuple[float, int, float, float]]) -> tuple[list, list, list, list]:
    return [f[0] for f in filters], [f[1] for f in filters], [f[2] for f in filters], [f[3] for f in filters]


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties"])
@pytest.mark.parametrize("vocab", [1003, 49152])
def test_the_kernel_keeps_what_a_full_sort_keeps(kind: str, vocab: int) -> None:
    kernels = cpu_kernels()[0]
    assert kernels is not None, "the kernel under test is not built"
    logits = _rows(kind, vocab)
    thresholds = kernels.sampling_thresholds(logits, *_kernel_args(THRESHOLD_FILTERS))
    for row, threshold, filters in zip(logits, thresholds, THRESHOLD_FILTERS):
        kept = row / torch.tensor(filters[0], dtype=torch.float32) >= threshold
        assert torch.equal(kept, _reference_keep(row, *filters)), (kind, filters, int(kept.sum()), int(_reference_keep(row, *filters).sum()))


@pytest.mark.parametrize("kind", ["peaked", "flat"])
def test_the_kernel_draws_the_token_whose_cdf_interval_holds_the_uniform(kind: str) -> None:
    """Each row drawn at 101 uniforms (0 and just below 1 among them): the token answered is kept, and u x the
    kept total lies in its interval of the kept tokens' running weight (float64, up to rounding)."""
    kernels = cpu_kernels()[0]
    assert kernels is not None, "the kernel under test is not built"
    logits = _rows(kind, 1003)
    uniforms = [i / 100 for i in range(100)] + [1 - 1e-12]
    for row, filters in zip(logits, THRESHOLD_FILTERS):
        n = len(uniforms)
        tokens = kernels.sample_rows(row.repeat(n, 1), *[[value] * n for value in filters], uniforms)
        scaled = (row / torch.tensor(filters[0], dtype=torch.float32)).double()
        weights = torch.where(_reference_keep(row, *filters), (scaled - scaled.max()).exp(), 0.0)
        running = weights.cumsum(0)
        total = float(running[-1])
        for u, token in zip(uniforms, tokens.tolist()):
            assert weights[token] > 0, (filters, u, token)
            before = float(running[token] - weights[token])
            assert before - 1e-6 * total <= u * total <= float(running[token]) + 1e-6 * total, (filters, u, token)


def test_rows_without_a_distribution_answer_as_greedy(sampler: str) -> None:
    """NaN, +inf, or every token banned: the draw is argmax's answer; a row with one finite logit draws it."""
    logits = torch.zeros(4, 40)
    logits[0, 17] = float("nan")
    logits[1, 5] = float("inf")
    logits[2] = float("-inf")
    logits[3] = float("-inf")
    logits[3, 33] = 1.0
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=1.0),
    ]
    assert sample(logits, params, [None] * 4).tolist() == [17, 5, 0, 33]
