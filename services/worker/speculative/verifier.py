"""A speculative step's tokens: the longest run of proposed tokens the target model accepts, and its own token after it.

Row ``i`` of a request's verify logits is the target's distribution after its input token and the first ``i``
proposed tokens. Each row is processed as the sampler would process it there (logit bias, then the penalties
over the history that already holds the tokens accepted before it), so a token's distribution is exactly the
one a plain decode step would sample it from.

- Greedy: a proposed token is accepted while it is the row's argmax; the first row where it is not gives the
  argmax instead, and a run that accepts every proposal ends with the last row's argmax: the same tokens as
  plain decoding.
- Sampled: rejection sampling (Leviathan et al., 2023). A proposal ``x`` drawn from ``q`` is accepted with
  probability ``min(1, p(x) / q(x))`` where ``p`` is the target's distribution after temperature, top-k, top-p
  and min-p; a rejected one is replaced by a draw from ``max(0, p - q)`` normalised, and a run that accepts
  every proposal draws its last token from the last row's ``p``. Each token is then distributed exactly as
  ``p``. A proposer with no distribution of its own (prompt lookup) proposes with ``q`` = 1 at its token, so
  acceptance is ``p(x)`` and the residual is ``p`` without ``x``. The uniforms come from the request's own
  generator (its seed), else the global one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from services.worker.request_table import RequestState
from services.worker.sampling import _filter_mask, process_logits, row_argmax, token_logprobs
from shared.frames import SamplingParams, TokenLogprobs


class Verified(NamedTuple):
    tokens: list[int]  # the accepted proposals, then the target's own token
    logprobs: list[TokenLogprobs | None]  # one per token where the request asked for them

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def target_probs(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The distribution a sampled row draws from ([V], float64): temperature, then top-k, top-p and min-p;
    None where no token has a finite logit (the sampler answers such a row as greedy)."""
    scaled = processed.float() / params.temperature
    if not bool(torch.isfinite(scaled.max())):
        return None
    keep = _filter_mask(scaled[None], [params])
    if keep is not None:
        scaled = scaled.masked_fill(~keep[0], float("-inf"))
    return torch.softmax(scaled.double(), dim=-1)


def verify(logits: torch.Tensor, proposal: list[int], request: RequestState, draft_probs: torch.Tensor | None = None) -> Verified:
    """The tokens of a request's speculative step from its logits [len(proposal) + 1, V] (processed in place); ``draft_probs``
    [len(proposal), V] is the proposer's distribution of each proposed token (None: each one certain). Each
    token is recorded in the request's state (its history, its last token) as it is taken."""
    params = request.params
    tokens: list[int] = []
    logprobs: list[TokenLogprobs | None] = []
    for i in range(len(proposal) + 1):
        row = process_logits(logits[i : i + 1], [params], [request.history], [request.bias])  # in place: each row is read once
        proposed = proposal[i] if i < len(proposal) else None
        token = _choose(row[0], params, request.generator, proposed, None if draft_probs is None or proposed is None else draft_probs[i])
        tokens.append(token)
        logprobs.append(token_logprobs(row, torch.tensor([token]), [params])[0])
        request.record_sampled(token)
        if token != proposed:
            break
    return Verified(tokens, logprobs)


def _choose(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, proposed: int | None, q: torch.Tensor | None) -> int:
    """The token at one row: ``proposed`` if accepted, else the target's own (``proposed`` None: the last row)."""
    if params.temperature <= 0:
        return int(row_argmax(row[None])[0])
    p = target_probs(row, params)
    if p is None:
        return int(row_argmax(row[None])[0])
    if proposed is not None:
        q_x = 1.0 if q is None else float(q[proposed])
        if _uniform(generator) * q_x < float(p[proposed]):  # u < p(x) / q(x), without the division
            return proposed
        p = (p - q.double()).clamp_(min=0) if q is not None else p.clone().index_fill_(0, torch.tensor([proposed]), 0.0)
        if float(p.sum()) <= 0:  # p == q up to rounding: nothing left to draw, and x was as likely as anything
            return proposed
    return draw(p, generator)


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn in proportion to ``weights`` with one uniform of ``generator`` (None: the global one)."""
    return _draw(weights, _uniform(generator))


def _uniform(generator: torch.Generator | None) -> float:
    return torch.rand(1, generator=generator, dtype=torch.float64).item()


def _draw(weights: torch.Tensor, u: float) -> int:
    """The first token whose running weight exceeds ``u`` of the total (the inverse of the distribution's CDF)."""
    running = weights.cumsum(0)
    index = int(torch.searchsorted(running, torch.tensor([u * float(running[-1])], dtype=running.dtype), right=True)[0])
    last = int((weights > 0).nonzero()[-1])  # rounding may leave the target unmet: the last token with weight then
    return min(index, last)
