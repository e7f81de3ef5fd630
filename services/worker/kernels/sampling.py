"""Token sampling on the device: the GPU path of ``services.worker.sampling`` (the same distribution:
greedy is argmax; top-k, then top-p of the top-k renormalised, then min-p), drawn by an exponential race
per row (``argmax(p / E)`` with ``E ~ Exp(1)`` per token) where the CPU path inverts the CDF.

Everything is batched tensor work with no host round-trip and no per-row Python loop. The race's
noise comes from a counter-based hash of (request seed, draw index, token id) rather than a
``torch.Generator``, so a row's draw depends only on its own logits, seed and how many tokens the
request has drawn: the same in any batch, and reproducible for a seeded request (though not the
same stream as the CPU path's generator). Plain torch, so it runs and is tested on the CPU too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from shared.frames import SamplingParams

_MASK_53 = (1 << 53) - 1


class SamplingTensors(NamedTuple):
    """One row per request, on the logits' device."""

    temperature: torch.Tensor  # [N] float32, 0: greedy
    top_k: torch.Tensor  # [N] int64, vocab when unset
    top_p: torch.Tensor  # [N] float32
    min_p: torch.Tensor  # [N] float32
    seeds: torch.Tensor  # [N] int64
    draws: torch.Tensor  # [N] int64, tokens the request has drawn before this one

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], draws: Sequence[int], vocab: int, device: torch.device) -> SamplingTensors:
        def put(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            put([p.temperature for p in params], torch.float32),
            put([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64),
            put([p.top_p for p in params], torch.float32),
            put([p.min_p for p in params], torch.float32),
            put(list(seeds), torch.int64),
            put(list(draws), torch.int64),
        )


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic; shifts masked to be logical)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9 as a signed int64
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def exponential_noise(seeds: torch.Tensor, draws: torch.Tensor, vocab: int) -> torch.Tensor:
    """``E[i, v] ~ Exp(1)``, a pure function of (seeds[i], draws[i], v): [N, vocab] float32."""
    stream = _mix(seeds * 0x9E3779B9 + draws)  # one stream per (request, draw)
    bits = _mix(stream[:, None] + torch.arange(vocab, device=seeds.device) * -7046029254386353131)
    uniform = ((bits & _MASK_53).double() + 0.5) / float(1 << 53)  # in (0, 1)
    return (-torch.log(uniform)).float()


def filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Tokens that survive top-k, then top-p (of the top-k renormalised), then min-p: [N, V] bool.
    The set ``services.worker.sampling._filter_mask`` keeps, computed for every row unconditionally."""
    vocab = scaled.shape[-1]
    ordered = scaled.sort(dim=-1, descending=True).values
    ordered.masked_fill_(torch.arange(vocab, device=scaled.device) >= top_k[:, None], float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    # The kept set is a prefix of the ordering: a token stays while the mass ranked above it is below top_p.
    within_p = ((probs.cumsum(dim=-1) - probs) < top_p[:, None]).sum(dim=-1).clamp_(1, None)
    count = torch.where(top_p < 1, within_p.minimum(top_k), top_k)
    keep = scaled >= ordered.gather(1, (count - 1)[:, None])
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); min_p = 0 keeps every token.
    return keep & (scaled >= scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None])


def sample_on_device(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """One token id per row of ``logits`` [N, V] (int64, on the logits' device)."""
    greedy = logits.argmax(dim=-1)
    random_row = t.temperature > 0
    scaled = logits.float() / torch.where(random_row, t.temperature, 1.0)[:, None]
    scaled.masked_fill_(~filter_mask(scaled, t.top_k, t.top_p, t.min_p), float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    drawn = probs.div_(exponential_noise(t.seeds, t.draws, logits.shape[-1])).argmax(dim=-1)
    return torch.where(random_row, drawn, greedy)
