"""RMSNorm as five cheap torch ops: ``x / sqrt(mean(x²) + eps) * w``.

torch's ``F.rms_norm`` is a composite on the CPU that costs about as much again per call, and a
decode step calls it twice per layer.
"""

from __future__ import annotations

import torch


class RMSNorm:
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        size = weight.shape[-1]
        # x / sqrt(sum(x²) / n + eps) * w == x * rsqrt(sum(x²) + n * eps) * (w * sqrt(n))
        self.weight, self.scaled_weight, self.eps_n = weight, weight * size**0.5, size * eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        inv = x.square().sum(-1, keepdim=True).add_(self.eps_n).rsqrt_()
        return (x * inv).mul_(self.scaled_weight)

    def norm_(self, x: torch.Tensor) -> None:
        """Normalise ``x`` in place (it may be a view, e.g. q and k inside a fused qkv output)."""
        inv = x.square().sum(-1, keepdim=True).add_(self.eps_n).rsqrt_()
        x.mul_(inv).mul_(self.scaled_weight)
