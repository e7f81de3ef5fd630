"""Causal depthwise conv1d with SiLU over a rolling conv state, in Triton: the GPU path of the GDN layers'
short convolution (the torch forms in ``services.worker.gdn`` are the reference).

For channel c and width K, ``y[t, c] = silu(bias[c] + Σ_j weight[c, j]·x[t − (K−1) + j, c])``, where inputs
before a sequence's first token come from its state slot ``conv_state_pool[slot, c, :]`` (the K−1 inputs that
preceded it, oldest first), or are zero for a sequence without initial state. Afterwards the slot holds the
sequence's last K−1 inputs (older state included when the sequence is shorter than K−1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16
BLOCK_C = 128


@triton.jit
def _conv_varlen_kernel(
    x_ptr,
    y_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    seq_of_token_ptr,
    cu_seqlens_ptr,
    slot_ids_ptr,
    has_initial_ptr,
    num_tokens,
    C,
    stride_xn,
    stride_slot,
    stride_sc,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    """y for BT tokens (of any sequences) and BC channels; the state is only read here."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    t_ok, c_ok = offs_t < num_tokens, offs_c < C
    seq = tl.load(seq_of_token_ptr + offs_t, mask=t_ok, other=0)
    bos = tl.load(cu_seqlens_ptr + seq, mask=t_ok, other=0)
    slot = tl.load(slot_ids_ptr + seq, mask=t_ok, other=0).to(tl.int64)
    from_state = tl.load(has_initial_ptr + seq, mask=t_ok, other=0) != 0
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    ok = t_ok[:, None] & c_ok[None, :]
    for j in tl.static_range(K):
        src = offs_t - (K - 1) + j
        in_seq = (src >= bos)[:, None]
        xv = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_xn + offs_c[None, :], mask=ok & in_seq, other=0.0)
        # before the sequence: state column (K−1) + (src − bos), which lies in [0, K−2]
        state_ptrs = state_ptr + slot[:, None] * stride_slot + offs_c[None, :] * stride_sc + (K - 1 + src - bos)[:, None]
        sv = tl.load(state_ptrs, mask=ok & ~in_seq & from_state[:, None], other=0.0)
        wj = tl.load(weight_ptr + offs_c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * wj[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_ptr + offs_t.to(tl.int64)[:, None] * C + offs_c[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_state_kernel(
    x_ptr,
    state_ptr,
    cu_seqlens_ptr,
    slot_ids_ptr,
    has_initial_ptr,
    C,
    stride_xn,
    stride_slot,
    stride_sc,
    K: tl.constexpr,
    BW: tl.constexpr,  # K − 1 rounded up to a power of two
    BC: tl.constexpr,
):
    """The slot of one sequence ← its last K−1 inputs: column i is input eos − (K−1) + i, taken from the old
    state (column i + length) when that lies before the sequence. All loads precede the store."""
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_w = tl.arange(0, BW)
    bos = tl.load(cu_seqlens_ptr + seq)
    eos = tl.load(cu_seqlens_ptr + seq + 1)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    # inputs src < state_end come from the old state; src >= eos − (K−1) > bos − K, so none without one
    state_end = tl.where(tl.load(has_initial_ptr + seq) != 0, bos, bos - K)
    ok = (offs_c < C)[:, None] & (offs_w < K - 1)[None, :]
    src = eos - (K - 1) + offs_w
    xv = tl.load(x_ptr + src.to(tl.int64)[None, :] * stride_xn + offs_c[:, None], mask=ok & (src >= bos)[None, :], other=0.0)
    slot_ptrs = state_ptr + slot * stride_slot + offs_c[:, None] * stride_sc
    sv = tl.load(slot_ptrs + (offs_w + eos - bos)[None, :], mask=ok & (src < state_end)[None, :], other=0.0)
    tl.store(slot_ptrs + offs_w[None, :], (xv + sv).to(state_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_update_kernel(
    x_ptr,
    y_ptr,
    weight_ptr,
    bias_ptr,
    state_ptr,
    slot_ids_ptr,
    C,
    stride_xn,
    stride_slot,
    stride_sc,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BW: tl.constexpr,  # K rounded up to a power of two
    BC: tl.constexpr,
):
    """One decode token of one sequence: window = [state, x], y = silu(window·w + b), state ← window[1:]."""
    seq = tl.program_id(0).to(tl.int64)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_w = tl.arange(0, BW)
    c_ok = offs_c < C
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    slot_ptrs = state_ptr + slot * stride_slot + offs_c[:, None] * stride_sc
    x = tl.load(x_ptr + seq * stride_xn + offs_c, mask=c_ok, other=0.0)
    old = (offs_w < K - 1)[None, :] & c_ok[:, None]
    window = tl.load(slot_ptrs + offs_w[None, :], mask=old, other=0.0).to(tl.float32)
    window = tl.where((offs_w == K - 1)[None, :], x.to(tl.float32)[:, None], window)
    shifted = tl.load(slot_ptrs + offs_w[None, :] + 1, mask=(offs_w < K - 2)[None, :] & c_ok[:, None], other=0.0)
    shifted = tl.where((offs_w == K - 2)[None, :], x[:, None].to(shifted.dtype), shifted)
    w = tl.load(weight_ptr + offs_c[:, None] * K + offs_w[None, :], mask=c_ok[:, None] & (offs_w < K)[None, :], other=0.0).to(tl.float32)
    acc = tl.sum(window * w, 1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + seq * C + offs_c, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=c_ok)
    tl.store(slot_ptrs + offs_w[None, :], shifted.to(state_ptr.dtype.element_ty), mask=old)


def _check(x: torch.Tensor, conv_state_pool: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int]:
    channels, width = weight.shape
    if width < 2 or x.shape[-1] != channels or x.stride(-1) != 1:
        raise ValueError(f"causal conv1d: x {tuple(x.shape)} (unit last stride) must match weight [C, K >= 2] {tuple(weight.shape)}")
    if conv_state_pool.shape[1:] != (channels, width - 1) or conv_state_pool.stride(2) != 1:
        raise ValueError(f"causal conv1d: conv_state_pool {tuple(conv_state_pool.shape)} must be [slots, {channels}, {width - 1}] with unit last stride")
    if not weight.is_contiguous() or (bias is not None and bias.shape != (channels,)):
        raise ValueError("causal conv1d: weight must be contiguous and bias [C]")
    return channels, width


def causal_conv1d_varlen(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Prefill of packed sequences (x [N, C], ``cu_seqlens`` [B+1]): y [N, C] in x's dtype, and each sequence's
    slot ``conv_state_pool[slot_ids[b]]`` left holding its last K−1 inputs. No host sync."""
    channels, width = _check(x, conv_state_pool, weight, bias)
    num_tokens, batch = x.shape[0], slot_ids.shape[0]
    y = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    cu = cu_seqlens.to(device=x.device, dtype=torch.int32)
    slots = slot_ids.to(device=x.device, dtype=torch.int32)
    has_initial = has_initial_state.to(device=x.device, dtype=torch.int32)
    block_c = min(BLOCK_C, triton.next_power_of_2(channels))
    bias_arg = bias if bias is not None else weight
    if num_tokens:
        seq_of_token = torch.repeat_interleave(torch.arange(batch, dtype=torch.int32, device=x.device), cu[1:] - cu[:-1], output_size=num_tokens)
        _conv_varlen_kernel[(triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(channels, block_c))](
            x, y, weight, bias_arg, conv_state_pool, seq_of_token, cu, slots, has_initial, num_tokens, channels,
            x.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1), K=width, HAS_BIAS=bias is not None, BT=BLOCK_T, BC=block_c,
        )  # fmt: skip
    _conv_state_kernel[(batch, triton.cdiv(channels, block_c))](  # after the conv on the same stream: it overwrites what the conv read
        x, conv_state_pool, cu, slots, has_initial, channels, x.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1),
        K=width, BW=triton.next_power_of_2(width - 1), BC=block_c,
    )  # fmt: skip
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Decode, one token per sequence (x [B, C]): y [B, C] in x's dtype; each slot shifts in its token. No host sync."""
    channels, width = _check(x, conv_state_pool, weight, bias)
    batch = x.shape[0]
    y = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y
    block_c = min(BLOCK_C, triton.next_power_of_2(channels))
    _conv_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x, y, weight, bias if bias is not None else weight, conv_state_pool, slot_ids.to(dtype=torch.int32), channels,
        x.stride(0), conv_state_pool.stride(0), conv_state_pool.stride(1), K=width, HAS_BIAS=bias is not None, BW=triton.next_power_of_2(width), BC=block_c,
    )  # fmt: skip
    return y
