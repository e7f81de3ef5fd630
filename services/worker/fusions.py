"""The decoder's elementwise fusions: fused residual-add + RMSNorm and SiLU-and-mul, their torch
references, and the choice of backend.

On CUDA the decoder runs the Triton kernels of ``services.worker.kernels.fusions`` (each residual add
folded into the RMSNorm that follows it, the SwiGLU activation one kernel). On the CPU nothing is
fused: the decoder's own forward (the residual riding on the output projections, ``RMSNorm``'s few
in-place ops) is the tuned production path, so the selection there is "none" and the torch forms
below serve only as the kernels' reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(h) · weight, h)`` with ``h = x + residual`` (in x's dtype; ``h = x`` without a residual), the norm in fp32."""
    h = x if residual is None else x + residual
    h32 = h.float()
    out = h32 * torch.rsqrt(h32.square().mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), h


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of ``[gate | up]`` rows [T, 2I] → [T, I], in fp32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


class FusionKernels(NamedTuple):
    """None where a fusion is off (the decoder keeps its unfused form)."""

    add_rms_norm: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]] | None
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None
    names: dict[str, str]  # for /instrumentation


UNFUSED = FusionKernels(None, None, {"add_rms_norm": "none (torch, unfused)", "silu_and_mul": "none (torch, unfused)"})


def select_fusion_kernels(device: torch.device) -> FusionKernels:
    """The Triton kernels where the model runs on CUDA and triton imports; unfused elsewhere. Chosen once, at load."""
    if device.type != "cuda":
        return UNFUSED
    try:
        from services.worker.kernels import fusions  # imports triton: only on the GPU path
    except ImportError as exc:
        reason = f"none (triton unavailable: {exc})"
        return UNFUSED._replace(names={"add_rms_norm": reason, "silu_and_mul": reason})
    return FusionKernels(fusions.add_rms_norm, fusions.silu_and_mul, {"add_rms_norm": "triton", "silu_and_mul": "triton"})
