"""A sampled request's draft proposal is drawn from the draft's distribution q, and the rejection sampler divides
by q: the first token keeps the target's distribution p whatever q is (chi-square at a fixed seed set), and a
proposal is accepted with probability sum(min(p, q)), more than a proposal taken as certain would be (sum(p q))."""

from __future__ import annotations

import msgspec
import pytest
import torch

from services.worker.request_table import RequestState
from services.worker.speculative.draft import _choose
from services.worker.speculative.verifier import target_probs, verify
from shared.frames import SamplingParams, Slice
from tests.worker.test_speculative import chi_square_p

VOCAB = 6
SAMPLES = 6000


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.95)])
def test_proposals_drawn_from_the_drafts_q_keep_the_target_distribution(params: SamplingParams) -> None:
    torch.manual_seed(0)
    target = torch.randn(2, VOCAB) * 1.5
    draft = target[0] + torch.randn(VOCAB)  # a draft that roughly agrees with the target
    p, q = target_probs(target[0], params), target_probs(draft, params)
    first = torch.zeros(VOCAB)
    accepted = 0
    for seed in range(SAMPLES):
        request = RequestState.start(Slice("r", 0, 1, [0], sampling=msgspec.structs.replace(params, seed=seed)))
        proposed, drawn_from = _choose(draft, request)
        verified = verify(target, [proposed], request, drawn_from[None])
        first[verified.tokens[0]] += 1
        accepted += verified.accepted
    kept = p > 0
    assert first[~kept].sum() == 0
    assert chi_square_p(first[kept], p[kept].float()) > 1e-3, (first.tolist(), p.tolist())
    # The acceptance rate's standard deviation at 6,000 samples is under 0.007; min(p, q) and p q differ by far more here.
    assert abs(accepted / SAMPLES - float(torch.minimum(p, q).sum())) < 0.03
    assert float(torch.minimum(p, q).sum()) - float((p * q).sum()) > 0.1
