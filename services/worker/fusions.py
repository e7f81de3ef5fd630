"""The decoder's elementwise fusions: fused residual-add + RMSNorm, SiLU-and-mul and in-place rotary,
their torch references, and the choice of backend.

With them the decoder folds each residual add into the RMSNorm that follows it and runs the SwiGLU
activation (and, on the CPU, the q/k rotation) as one kernel each. On CUDA they are the Triton kernels
of ``services.worker.kernels.fusions`` (rotary stays torch); on the CPU, for fp32 models, the C++
kernels of ``csrc/decoder_fusions.cpp``, which save the per-op dispatch of ~25 small torch ops a layer,
and also norm Qwen3's q and k heads in place.
Elsewhere (a bf16/fp16 CPU model, no compiler, ``TOKENYARD_CPU_KERNELS=0``) the decoder keeps its
unfused forward, and ``names`` says why.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import cpu_kernels


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
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None  # ``apply_rotary_``'s contract
    norm_heads: Callable[[torch.Tensor, torch.Tensor, float], None] | None  # (heads [T, N, D], weight [N, D], eps): RMSNorm each head in place
    names: dict[str, str]  # for /instrumentation


def _unfused(reason: str) -> FusionKernels:
    return FusionKernels(None, None, None, None, dict.fromkeys(("add_rms_norm", "silu_and_mul", "rotary", "norm_heads"), reason))


UNFUSED = _unfused("none (torch, unfused)")


def select_fusion_kernels(device: torch.device, dtype: torch.dtype) -> FusionKernels:
    """The Triton kernels where the model runs on CUDA and triton imports; the C++ kernels for an fp32
    model on the CPU once they built; unfused elsewhere. Chosen once, at load."""
    if device.type == "cpu":
        return _cpu_fusions(dtype)
    if device.type != "cuda":
        return UNFUSED
    try:
        from services.worker.kernels import fusions  # imports triton: only on the GPU path
    except ImportError as exc:
        return _unfused(f"none (triton unavailable: {exc})")
    return FusionKernels(
        fusions.add_rms_norm, fusions.silu_and_mul, None, None,
        {"add_rms_norm": "triton", "silu_and_mul": "triton", "rotary": "none (torch)", "norm_heads": "none (torch)"},
    )  # fmt: skip


def _cpu_fusions(dtype: torch.dtype) -> FusionKernels:
    if dtype != torch.float32:
        return _unfused(f"none (the C++ kernels are fp32, the model is {str(dtype).removeprefix('torch.')})")
    kernels, why = cpu_kernels()
    if kernels is None:
        return _unfused(f"none (C++ kernels unavailable: {why})")
    # add_rms_norm writes h over x: the decoder passes each mixer's or MLP's fresh output, dead after the call.
    return FusionKernels(
        kernels.add_rms_norm, kernels.silu_and_mul, kernels.rotary_, kernels.rms_norm_heads_,
        dict.fromkeys(("add_rms_norm", "silu_and_mul", "rotary", "norm_heads"), "cpp"),
    )  # fmt: skip
