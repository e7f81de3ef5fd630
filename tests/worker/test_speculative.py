"""The worker's speculative decoding parts: prompt lookup's proposals, and a verifier whose tokens are distributed
exactly as plain sampling's, whatever the proposal, under every sampling parameter."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.worker.request_table import RequestState
from services.worker.sampling import process_logits
from services.worker.speculative.ngram import NgramProposer, PromptLookup
from services.worker.speculative.verifier import target_probs, verify
from shared.frames import SamplingParams, Slice


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match() -> None:
    lookup = PromptLookup(1, 3)
    lookup.extend([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3])
    # "1 2 3" (3 tokens) last occurred at the start, followed by 4 5 9; "2 3" alone would propose 7 8.
    assert lookup.propose(3) == [4, 5, 9]
    lookup.extend([6])
    assert lookup.propose(2) == []  # "6" never occurred before
    lookup.extend([1, 2])
    assert lookup.propose(4) == [3, 6, 1, 2]  # "6 1 2" never occurred before; "1 2" last did at 10-11


def test_prompt_lookup_stops_at_the_end_of_the_tokens_and_honours_min_n() -> None:
    lookup = PromptLookup(2, 2)
    lookup.extend([5, 6, 7, 5])
    assert lookup.propose(3) == []  # only "7 5" is looked up, a 1-gram match of 5 does not count
    lookup.extend([6])
    assert lookup.propose(5) == [7, 5, 6]
    proposer = NgramProposer(2, 2)
    proposer.extend("a", [5, 6, 7, 5, 6])
    assert proposer.propose({"a": 2, "unknown": 2}) == {"a": [7, 5]}
    assert proposer.has_guess("a") and not proposer.has_guess("unknown")
    proposer.extend("a", [9])
    assert not proposer.has_guess("a")  # "6 9" never occurred before
    proposer.extend("a", [5, 6])
    assert proposer.has_guess("a")
    proposer.release("a")
    assert proposer.propose({"a": 2}) == {}
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 2)


def state(params: SamplingParams, seed: int | None = None) -> RequestState:
    if seed is not None:
        params = msgspec.structs.replace(params, seed=seed)
    request = RequestState.start(Slice("r", 0, 1, [0], sampling=params))
    request.record_prefill(0, [3, 3, 5], None)  # a prompt for the repetition penalty
    return request


def test_greedy_verify_accepts_while_proposals_are_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.0], [2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    assert verify(logits, [1, 0], state(greedy)).tokens == [1, 0, 3]  # all accepted, then the bonus
    assert verify(logits, [1, 2], state(greedy)).tokens == [1, 0]  # rejected at the second: the argmax instead
    assert verify(logits, [2, 0], state(greedy)).tokens == [1]
    # A penalty that counts the first accepted token changes the second row's argmax (0 -> 2).
    penalised = SamplingParams(temperature=0, frequency_penalty=5.0)
    logits[1] = torch.tensor([2.0, 0.0, 1.5, 0.0])
    request = state(penalised)
    request.history.add_outputs([0])
    assert verify(logits, [1, 2], request).tokens == [1, 2, 3]


VOCAB = 6


@pytest.mark.parametrize(
    "params,samples",
    [
        (SamplingParams(temperature=1.0), 12000),
        (SamplingParams(temperature=0.7, top_k=4, top_p=0.95), 3000),
        (SamplingParams(temperature=1.3, min_p=0.05, logit_bias={0: 1.5}, presence_penalty=0.5, repetition_penalty=1.3), 3000),
    ],
)
def test_rejection_sampling_preserves_the_target_distribution(params: SamplingParams, samples: int) -> None:
    """Chi-square at a fixed seed set: the first token's and (after an accepted first) the second token's frequencies
    against the target's probabilities, with proposals the target finds likely and unlikely. At 12,000 samples a
    2 % shift of probability between two tokens moves the statistic by ~30, past the 0.001 critical value (~20)."""
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 1.5
    for proposal in ([int(logits[0].argmax()), 2], [int(logits[0].argmin()), 5]):
        first = torch.zeros(VOCAB)
        second = torch.zeros(VOCAB)
        expected_first = target_probs(process_logits(logits[:1].clone(), [params], [state(params).history], [state(params).bias])[0], params)
        after_accept = state(params)
        after_accept.record_sampled(proposal[0])
        expected_second = target_probs(process_logits(logits[1:2].clone(), [params], [after_accept.history], [after_accept.bias])[0], params)
        for seed in range(samples):
            tokens = verify(logits.clone(), proposal, state(params, seed)).tokens  # verify processes its logits in place
            first[tokens[0]] += 1
            if tokens[0] == proposal[0]:
                second[tokens[1]] += 1
        for counts, probs in ((first, expected_first), (second, expected_second)):
            kept = probs > 0
            assert counts[~kept].sum() == 0  # never a token the filters remove
            if counts.sum() > 300 and int(kept.sum()) > 1:
                assert chi_square_p(counts[kept], probs[kept].float()) > 1e-3, (proposal, counts.tolist(), probs.tolist())


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square test of ``counts`` against ``probs``."""
    expected = probs / probs.sum() * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(counts) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, statistic.double() / 2))
