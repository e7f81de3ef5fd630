"""Fused Mixture-of-Experts in Triton: the GPU path of ``services.worker.moe`` (whose grouped torch
path is the reference).

1. ``moe_align_triton``: the (token, expert) pairs grouped by expert, padded to BLOCK_M rows;
2. gate/up GEMM over the aligned blocks, SwiGLU fused: ``act[p] = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)``;
3. down GEMM over the same blocks, routed weight fused: ``y[p] = w[p] * act[p] @ down_e.T``;
4. top-k reduction, residual fused: ``out[t] = residual[t] + Σ_j y[t·k + j]``.

Every block of rows belongs to one expert, so a program streams one expert's weight tile for up to
BLOCK_M rows; a padding row (pair id ``T·k``) is masked out. Experts in q4_0 / q4_1 / q8_0 blocks
(``block_quant.BlockQuantized``, the row layout: a row's codes, then its fp16 scales and minimums) are
dequantized tile by tile in the K loop, so they stay in their blocks in memory. All sizes depend only on T, k and the
weights, never on the routing, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from services.worker.block_quant import BLOCK, CODE_BYTES, BlockQuantized
from services.worker.kernels.moe_align import moe_align_triton

WEIGHT_FORMATS = {None: 0, "q4_0": 1, "q4_1": 2, "q8_0": 3}  # the kernel's FMT: float weights, or their blocks


class MoEConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int  # row blocks that share weight tiles in L2 (program order)
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_tokens: int, num_experts: int) -> MoEConfig:
    """vLLM's untuned defaults: small row blocks while a block of an expert would be mostly padding."""
    if num_tokens <= num_experts:
        return MoEConfig(block_m=16, block_n=32, block_k=64, group_m=1)
    return MoEConfig(block_m=64, block_n=64, block_k=32, group_m=8)


@triton.jit
def _weight_tile(w_ptr, w_half_ptr, row_bytes, k, mask, code_bytes, blocks, FMT: tl.constexpr):
    """Weights [BLOCK_K, BLOCK_N] as float32 from the rows starting at byte ``row_bytes`` [1, BLOCK_N],
    features ``k`` [BLOCK_K, 1]: FMT 0 reads floats (``row_bytes`` then counts elements), 1-3 decode
    q4_0 / q4_1 / q8_0 blocks (``code_bytes`` per row before the fp16 scales, ``blocks`` per row)."""
    if FMT == 0:
        return tl.load(w_ptr + row_bytes + k, mask=mask, other=0.0).to(tl.float32)
    block = k // 32
    scales = w_half_ptr + (row_bytes + code_bytes) // 2 + block  # fp16 view of the same bytes
    d = tl.load(scales, mask=mask, other=0.0).to(tl.float32)
    if FMT == 3:
        code = tl.load(w_ptr + row_bytes + k, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return d * code
    byte = tl.load(w_ptr + row_bytes + block * 16 + k % 16, mask=mask, other=0)
    code = tl.where(k % 32 < 16, byte & 0x0F, byte >> 4).to(tl.float32)
    if FMT == 1:
        return d * (code - 8.0)
    return d * code + tl.load(scales + blocks, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    w_half_ptr,
    out_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    num_blocks_m,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    code_bytes,
    blocks,
    slots_ptr,  # HAS_SLOTS: w's row of each expert (a bank of slots)
    FMT: tl.constexpr,  # 0: float weights (strides in elements); 1-3: q4_0 / q4_1 / q8_0 rows (strides in bytes)
    TOP_K: tl.constexpr,  # a's row of pair p is p // TOP_K (1: a has one row per pair)
    SWIGLU: tl.constexpr,  # w holds [gate; up] ([2N, K]): out = silu(a @ gate.T) * (a @ up.T)
    MUL_WEIGHT: tl.constexpr,  # scale row p by topk_weights[p]
    DOT_PRECISION: tl.constexpr,
    HAS_SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[p, n] for the BLOCK_M pairs of one aligned block and BLOCK_N columns; a, w and out have unit last stride."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_size = min(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return

    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if HAS_SLOTS:
        expert = tl.load(slots_ptr + expert).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    rows = expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N] of w.T's columns

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SWIGLU:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        k = k0 + offs_k[:, None]
        w = _weight_tile(w_ptr, w_half_ptr, rows, k, w_mask, code_bytes, blocks, FMT).to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if SWIGLU:
            w_up = _weight_tile(w_ptr, w_half_ptr, rows + N * stride_wn, k, w_mask, code_bytes, blocks, FMT).to(a.dtype)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K

    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _topk_sum_kernel(y_ptr, residual_ptr, out_ptr, H, TOP_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = residual[t] + Σ_j y[t·k + j], accumulated in fp32."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if HAS_RESIDUAL:
        acc += tl.load(residual_ptr + token * H + offs, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + j) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * H + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _weights(w: torch.Tensor | BlockQuantized) -> tuple[torch.Tensor, torch.Tensor, int, int, int, int, int]:
    """(bytes or floats, their fp16 view, expert stride, row stride, code bytes per row, blocks per row, FMT)."""
    if not isinstance(w, BlockQuantized):
        return w, w, w.stride(0), w.stride(1), 0, 0, 0
    data, blocks = w.data.contiguous(), w.in_features // BLOCK
    return data, data.view(torch.float16), data.stride(0), data.stride(1), blocks * CODE_BYTES[w.fmt], blocks, WEIGHT_FORMATS[w.fmt]


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor | BlockQuantized,
    w_down: torch.Tensor | BlockQuantized,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    residual: torch.Tensor | None = None,
    config: MoEConfig | None = None,
    expert_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """``residual + Σ_j topk_weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t))``, ``e = topk_ids[t, j]``:
    the contract of ``services.worker.moe.experts_torch``. ``x`` [T, H], ``w_gate_up`` [E, 2I, H] and
    ``w_down`` [E, H, I] contiguous, or either in blocks (``BlockQuantized``, products in fp32 or x's dtype);
    ``expert_slots`` (int32 [E]): the weights' row of each expert, where they are a bank of slots."""
    tokens, hidden = x.shape
    num_experts, inter = w_gate_up.shape[0] if expert_slots is None else expert_slots.numel(), w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x) if residual is None else residual.clone()
    if not (x.is_contiguous() and all(isinstance(w, BlockQuantized) or w.is_contiguous() for w in (w_gate_up, w_down))):
        raise ValueError("fused_moe needs contiguous x, w_gate_up and w_down")
    cfg = config or default_config(tokens, num_experts)
    sorted_ids, expert_ids, num_padded = moe_align_triton(topk_ids, num_experts, cfg.block_m)
    num_pairs, blocks_m = tokens * top_k, expert_ids.numel()
    weights = topk_weights.contiguous()
    slots = sorted_ids if expert_slots is None else expert_slots.contiguous()  # any pointer where there are none
    launch = dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 serving means fp32 products
        HAS_SLOTS=expert_slots is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    w, w_half, stride_we, stride_wn, code_bytes, blocks, fmt = _weights(w_gate_up)
    _moe_gemm_kernel[(blocks_m * triton.cdiv(inter, cfg.block_n),)](
        x, w, w_half, act, weights, sorted_ids, expert_ids, num_padded, num_pairs, blocks_m, inter, hidden,
        x.stride(0), stride_we, stride_wn, act.stride(0), code_bytes, blocks, slots, FMT=fmt, TOP_K=top_k, SWIGLU=True, MUL_WEIGHT=False, **launch,
    )  # fmt: skip
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    w, w_half, stride_we, stride_wn, code_bytes, blocks, fmt = _weights(w_down)
    _moe_gemm_kernel[(blocks_m * triton.cdiv(hidden, cfg.block_n),)](
        act, w, w_half, y, weights, sorted_ids, expert_ids, num_padded, num_pairs, blocks_m, hidden, inter,
        act.stride(0), stride_we, stride_wn, y.stride(0), code_bytes, blocks, slots, FMT=fmt, TOP_K=1, SWIGLU=False, MUL_WEIGHT=True, **launch,
    )  # fmt: skip
    out = torch.empty_like(x)
    block_h = min(1024, triton.next_power_of_2(hidden))
    has_residual = residual is not None
    _topk_sum_kernel[(tokens, triton.cdiv(hidden, block_h))](
        y, residual.contiguous() if has_residual else y, out, hidden, TOP_K=top_k, HAS_RESIDUAL=has_residual, BLOCK_H=block_h
    )
    return out
