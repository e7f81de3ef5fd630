"""Two small fusions of the decoder's GPU path, in Triton (their torch references are in
``services.worker.fusions``):

- ``add_rms_norm``: ``h = x + residual`` then ``RMSNorm(h) · weight``, one read of each input and one
  write of each output, where the unfused path runs the add and five or six norm kernels;
- ``silu_and_mul``: ``silu(gate) · up`` of a fused ``[gate | up]`` projection, one kernel instead of two.

Both compute in fp32 and round once to the input dtype (the sum ``h`` is rounded before it is
normalised, as the unfused path normalises the rounded residual). One program per row (``add_rms_norm``:
the whole row in one block) or per row and column block (``silu_and_mul``); no host sync, so both can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NORM_WIDTH = 1 << 16  # one block per row: wider rows would need a loop (no model here comes close)
SILU_BLOCK = 1024


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    width,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < width
    h = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0).to(tl.float32)
        rounded = h.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + offs, rounded, mask=ok)
        h = rounded.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, axis=0) / width + eps)
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (h * inv * w).to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(x + residual) · weight, x + residual)`` for x, residual [T, H] (residual None: ``(RMSNorm(x) · weight, x)``)."""
    rows, width = x.shape
    if width > MAX_NORM_WIDTH:
        raise ValueError(f"add_rms_norm handles rows of up to {MAX_NORM_WIDTH} elements, got {width}")
    if weight.shape != (width,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not fit rows of {width}")
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("add_rms_norm needs rows with unit stride")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = x if residual is None else torch.empty_like(residual, memory_format=torch.contiguous_format)
    if rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(width)
    r = residual if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x, r, weight.contiguous(), out, residual_out, width, eps,
        x.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
    )  # fmt: skip
    return out, residual_out


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, inter, stride_in, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_in + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) · gate_up[:, I:]`` for gate_up [T, 2I] → [T, I]."""
    rows, double = gate_up.shape
    if double % 2:
        raise ValueError(f"silu_and_mul needs [gate | up] rows of even width, got {double}")
    if gate_up.stride(-1) != 1:
        raise ValueError("silu_and_mul needs rows with unit stride")
    inter = double // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block)
    return out
