"""Batched token sampling: per-row temperature (0 = greedy argmax), top-k, top-p, min-p and seed.

Each row's result depends only on its own logits and generator, never on the other rows, so
a seeded request draws the same tokens whatever batch it shares. A draw is an exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)`` per token), which samples exactly from ``p``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.frames import SamplingParams


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of ``logits`` [N, V]; ``generators[i]`` is row i's rng (None: the global one)."""
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if p.temperature > 0]
    if not random_rows:
        return greedy
    rows = torch.tensor(random_rows)
    chosen = [params[i] for i in random_rows]
    scaled = logits[rows].float() / torch.tensor([p.temperature for p in chosen])[:, None]
    keep = _filter_mask(scaled, chosen)
    if keep is not None:
        scaled.masked_fill_(~keep, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    race = torch.empty_like(probs)
    if any(generators[i] is None for i in random_rows):
        race.exponential_()
    for j, i in enumerate(random_rows):
        if (generator := generators[i]) is not None:
            race[j].exponential_(generator=generator)
    drawn = probs.div_(race.clamp_min_(1e-30)).argmax(dim=-1)
    return greedy.index_copy_(0, rows, drawn)


def _filter_mask(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor | None:
    """Tokens that survive top-k, then top-p (of the top-k renormalised), then min-p; None: all do."""
    vocab = scaled.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    keep = None
    if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
        ordered = scaled.sort(dim=-1, descending=True).values
        ranks = torch.arange(vocab)
        ordered.masked_fill_(ranks >= top_k[:, None], float("-inf"))
        probs = torch.softmax(ordered, dim=-1)
        # A token stays while the mass ranked above it is below top_p (the first always stays);
        # the kept set is a prefix of the ordering, so a threshold logit describes it.
        # Rows without top-p keep exactly top_k: a cumsum rounded past 1.0 must not trim them.
        within_p = ((probs.cumsum(dim=-1) - probs) < top_p[:, None]).sum(dim=-1).clamp_(1, None)
        count = torch.where(top_p < 1, within_p.minimum(top_k), top_k)
        threshold = ordered.gather(1, (count - 1)[:, None])
        keep = scaled >= threshold
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        keep = scaled >= floor if keep is None else keep & (scaled >= floor)
    return keep
