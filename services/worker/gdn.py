"""The Gated DeltaNet token mixer's ops in torch (the CPU path and the reference of the Triton kernels),
and the choice between the two backends.

Every op works on packed variable-length batches (``cu_seqlens`` delimits the sequences) and keeps
each sequence's state in a slot of a pool, read and written in place:

- the recurrence, per value head ``h`` (reading q/k head ``h // (Hv // Hk)``) and token ``t``:
  ``S = S·exp(g_t);  δ = β_t·(v_t − kᵀ_t S);  S = S + k_t δᵀ;  o_t = (scale·q_t)ᵀ S``,
  with ``S`` of shape [Dk, Dv] in fp32, kept in ``state_pool[slot]``;
- the causal depthwise conv1d with SiLU whose window reaches ``K − 1`` inputs back, across chunk
  boundaries through ``conv_state_pool[slot]`` (the last ``K − 1`` inputs seen).

Prefill uses the chunked form of the recurrence (chunks of ``CHUNK`` tokens, each solved with the
WY/UT transform as a few matrix products); decode, one token per sequence, the recurrent form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

CHUNK = 64


# The gated delta rule. ------------------------------------------------------------------------------


def _per_value_head(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """q or k [..., Hk, D] → [..., Hv, D]: value head h reads q/k head h // (Hv // Hk)."""
    return x if x.shape[-2] == num_v_heads else x.repeat_interleave(num_v_heads // x.shape[-2], dim=-2)


def _pad_to_chunks(x: torch.Tensor, seq: torch.Tensor, offset: torch.Tensor, num_seqs: int, padded_len: int) -> torch.Tensor:
    """Packed rows [N, ...] → [B, padded_len, ...], row j going to (seq[j], offset[j]); zeros elsewhere."""
    out = x.new_zeros(num_seqs * padded_len, *x.shape[1:])
    out.index_copy_(0, seq * padded_len + offset, x)
    return out.view(num_seqs, padded_len, *x.shape[1:])


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """The recurrence over B packed sequences: q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv] fp32 → o [N, Hv, Dv].

    Sequence b starts from ``state_pool[slot_ids[b]]`` (zeros where ``has_initial_state[b]`` is
    False) and leaves its final state there. Each sequence is cut into chunks of ``CHUNK`` from its
    own start; its last chunk is padded with k = v = β = g = 0, which leaves the state unchanged.
    """
    num_tokens, num_v_heads, dim_v = v.shape
    out_dtype, num_seqs = v.dtype, slot_ids.shape[0]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    num_chunks = -(-int(lens.max()) // CHUNK)
    padded = num_chunks * CHUNK
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=v.device), lens, output_size=num_tokens)
    offset = torch.arange(num_tokens, device=v.device) - cu_seqlens[:-1].long()[seq]

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [N, Hv, ...] → [B, Hv, C, CHUNK, ...] fp32
        x = _pad_to_chunks(x.float(), seq, offset, num_seqs, padded).transpose(1, 2)
        return x.reshape(num_seqs, num_v_heads, num_chunks, CHUNK, *x.shape[3:])

    q, k = chunked(_per_value_head(q, num_v_heads)) * scale, chunked(_per_value_head(k, num_v_heads))
    v, g, beta = chunked(v), chunked(g), chunked(beta)

    # Within a chunk, with γ_t = Σ_{s≤t} g_s and decay(t, j) = exp(γ_t − γ_j) for j ≤ t:
    #   δ_t = β_t v_t − β_t e^{γ_t} S0ᵀk_t − Σ_{j<t} β_t decay(t, j) (k_t·k_j) δ_j
    # i.e. (I + A) Δ = βV − diag(β e^γ) K S0 with A strictly lower triangular, so Δ = U − W S0 with
    # U = (I + A)⁻¹ βV and W = (I + A)⁻¹ diag(β e^γ) K. Then o_t = e^{γ_t} q_tᵀS0 + Σ_{j≤t} decay(t, j)(q_t·k_j) δ_j
    # and the chunk's final state is e^{γ_last} S0 + Σ_j decay(last, j) k_j δ_jᵀ.
    gamma = g.cumsum(-1)
    lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=v.device).tril()
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [.., t, j], 0 above the diagonal
    k_beta = k * beta[..., None]
    a = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # strictly lower: I + A is unit lower triangular
    eye = torch.eye(CHUNK, dtype=a.dtype, device=a.device)
    u = torch.linalg.solve_triangular(a + eye, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a + eye, k_beta * gamma.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # causal, diagonal included
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [B, Hv, C, 1, 1]

    slots = slot_ids.long()
    state = state_pool.index_select(0, slots) * has_initial_state.to(state_pool).view(-1, 1, 1, 1)
    out = torch.empty_like(v)
    for c in range(num_chunks):  # chunks of all sequences advance together; padding chunks change nothing
        delta = u[:, :, c] - w[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + scores[:, :, c] @ delta
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ delta
    state_pool.index_copy_(0, slots, state)
    out = out.reshape(num_seqs, num_v_heads, padded, dim_v).transpose(1, 2).reshape(num_seqs * padded, num_v_heads, dim_v)
    return out.index_select(0, seq * padded + offset).to(out_dtype)


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
) -> torch.Tensor:
    """One step of the recurrence for B sequences of one token: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv] → o [B, Hv, Dv]."""
    num_v_heads = v.shape[1]
    slots = slot_ids.long()
    q = _per_value_head(q, num_v_heads).float() * scale
    k = _per_value_head(k, num_v_heads).float()
    state = state_pool.index_select(0, slots) * g.float().exp()[..., None, None]  # [B, Hv, Dk, Dv]
    predicted = (k[..., None, :] @ state).squeeze(-2)  # kᵀS [B, Hv, Dv]
    delta = (v.float() - predicted) * beta.float()[..., None]
    state += k[..., :, None] * delta[..., None, :]
    state_pool.index_copy_(0, slots, state)
    return (q[..., None, :] @ state).squeeze(-2).to(v.dtype)


# The causal depthwise conv1d. ------------------------------------------------------------------------


def causal_conv1d_varlen(
    x: torch.Tensor,
    cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``silu(conv(x))`` over B packed sequences, x [N, C], weight [C, K] → [N, C].

    Sequence b's window reaches back into ``conv_state_pool[slot_ids[b]]`` [C, K − 1] (zeros where
    ``has_initial_state[b]`` is False), which then holds the sequence's last K − 1 inputs.
    """
    num_tokens, channels = x.shape
    history = weight.shape[1] - 1
    num_seqs = slot_ids.shape[0]
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    longest = int(lens.max())
    seq = torch.repeat_interleave(torch.arange(num_seqs, device=x.device), lens, output_size=num_tokens)
    offset = torch.arange(num_tokens, device=x.device) - cu_seqlens[:-1].long()[seq]
    slots = slot_ids.long()
    initial = conv_state_pool.index_select(0, slots) * has_initial_state.to(conv_state_pool).view(-1, 1, 1)  # [B, C, K-1]
    padded = _pad_to_chunks(x, seq, offset, num_seqs, longest).transpose(1, 2)  # [B, C, L]
    window = torch.cat([initial.to(x.dtype), padded], dim=-1)  # [B, C, K-1+L]
    # A depthwise conv as one broadcast product: F.conv1d's depthwise CPU path is far slower at these sizes.
    y = (window.unfold(-1, history + 1, 1) * weight[:, None, :]).sum(-1)  # [B, C, L]
    if bias is not None:
        y += bias[:, None]
    # Sequence b's last K-1 inputs end at column K-1+len_b of its window.
    ends = history + lens.long()
    cols = ends[:, None] + torch.arange(-history, 0, device=x.device)  # [B, K-1]
    conv_state_pool.index_copy_(0, slots, window.gather(2, cols[:, None, :].expand(-1, channels, -1)).to(conv_state_pool.dtype))
    return F.silu(y.transpose(1, 2)[seq, offset])


def causal_conv1d_update(
    x: torch.Tensor, conv_state_pool: torch.Tensor, slot_ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """One input per sequence, x [B, C] → ``silu(conv)`` [B, C]; each slot's window slides by one."""
    slots = slot_ids.long()
    window = torch.cat([conv_state_pool.index_select(0, slots).to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    y = (window * weight).sum(-1)
    if bias is not None:
        y += bias
    conv_state_pool.index_copy_(0, slots, window[:, :, 1:].to(conv_state_pool.dtype))
    return F.silu(y)


# Backends. ---------------------------------------------------------------------------------------------


class GDNKernels(NamedTuple):
    """The four ops of a GDN layer, and where each pair comes from."""

    chunk_gated_delta_rule: Callable[..., torch.Tensor]
    fused_recurrent_gated_delta_rule: Callable[..., torch.Tensor]
    causal_conv1d_varlen: Callable[..., torch.Tensor]
    causal_conv1d_update: Callable[..., torch.Tensor]
    names: dict[str, str]  # {"delta_rule": backend, "conv1d": backend}, for /instrumentation


TORCH_KERNELS = GDNKernels(
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    causal_conv1d_varlen,
    causal_conv1d_update,
    {"delta_rule": "torch", "conv1d": "torch"},
)


def select_gdn_kernels(device: torch.device) -> GDNKernels:
    """On CUDA the Triton kernels (``services.worker.kernels.gdn`` and ``.conv1d``) where they import,
    each pair falling back to torch on its own; elsewhere torch. Chosen once, at load."""
    if device.type != "cuda":
        return TORCH_KERNELS
    kernels, names = list(TORCH_KERNELS[:4]), dict(TORCH_KERNELS.names)
    try:
        from services.worker.kernels import gdn as triton_gdn  # imports triton: only on the GPU path

        kernels[0:2] = triton_gdn.chunk_gated_delta_rule, triton_gdn.fused_recurrent_gated_delta_rule
        names["delta_rule"] = "triton"
    except ImportError as exc:
        names["delta_rule"] = f"torch (triton unavailable: {exc})"
    try:
        from services.worker.kernels import conv1d as triton_conv1d

        kernels[2:4] = triton_conv1d.causal_conv1d_varlen, triton_conv1d.causal_conv1d_update
        names["conv1d"] = "triton"
    except ImportError as exc:
        names["conv1d"] = f"torch (triton unavailable: {exc})"
    return GDNKernels(*kernels, names)
