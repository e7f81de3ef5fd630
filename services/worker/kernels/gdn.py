"""Gated DeltaNet in Triton: the GPU path of ``services.worker.gdn`` (whose torch forms are the reference).

Per v-head, per token t (q, k L2-normalised; v-head h reads q/k head ``h // (Hv // Hk)``)::

    S = S·exp(g_t);  δ_t = β_t·(v_t − k_tᵀS);  S = S + k_t δ_tᵀ;  o_t = (scale·q_t)ᵀS      (S: [Dk, Dv], fp32)

Prefill (``chunk_gated_delta_rule``) works on chunks of BT = 64 tokens of one sequence. With γ the cumulative
log-decay inside the chunk and S₀ the state at its start, the chunk's deltas solve a unit lower-triangular
system (the WY / UT transform)::

    (I + A) δ = β⊙V − (β·e^γ ⊙ K) S₀,   A[i, j] = β_i e^{γ_i−γ_j} k_i·k_j  (j < i)
    δ = U − W S₀,   U = (I + A)⁻¹ (β⊙V),   W = (I + A)⁻¹ (β·e^γ ⊙ K)
    S_end = e^{γ_last} S₀ + (e^{γ_last−γ} ⊙ K)ᵀ δ
    O = scale · ((e^γ ⊙ Q) S₀ + (QKᵀ ⊙ e^{γ_i−γ_j} ⊙ [j ≤ i]) δ)

Five kernels: (1) γ and A per chunk, (2) (I + A)⁻¹ from its 16×16 diagonal blocks and a three-term series,
(3) W and U per chunk, (4) the only sequential part, the state from chunk to chunk per (sequence, head,
Dv block), which also turns U into δ, and (5) the output per chunk. Only (4) reads and writes the state
pool. Decode (``fused_recurrent_gated_delta_rule``) is one kernel that applies the step to the state slot
in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # tokens per chunk of the prefill; the solve below is written for four 16-row blocks


@triton.jit
def _chunk_bounds(chunk_seq_ptr, chunk_offsets_ptr, cu_seqlens_ptr, chunk, BT: tl.constexpr):
    """First token of chunk ``chunk`` (global index) and the end of its sequence."""
    seq = tl.load(chunk_seq_ptr + chunk)
    bos = tl.load(cu_seqlens_ptr + seq)
    eos = tl.load(cu_seqlens_ptr + seq + 1)
    start = bos + (chunk - tl.load(chunk_offsets_ptr + seq)) * BT
    return start, eos


@triton.jit
def _kkt_kernel(
    k_ptr,
    g_ptr,
    beta_ptr,
    gcum_ptr,
    a_ptr,
    chunk_seq_ptr,
    chunk_offsets_ptr,
    cu_seqlens_ptr,
    stride_kn,
    stride_kh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,  # v-heads per q/k head
    DK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """γ = cumsum(g) within the chunk, and A[i, j] = β_i e^{γ_i−γ_j} k_i·k_j for j < i (0 elsewhere), rows by token."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, eos = _chunk_bounds(chunk_seq_ptr, chunk_offsets_ptr, cu_seqlens_ptr, chunk, BT)
    offs_t = tl.arange(0, BT)
    rows = start + offs_t
    valid = rows < eos
    rows64 = rows.to(tl.int64)
    gamma = tl.cumsum(tl.load(g_ptr + rows64 * HV + head, mask=valid, other=0.0), 0)
    tl.store(gcum_ptr + rows64 * HV + head, gamma, mask=valid)
    beta = tl.load(beta_ptr + rows64 * HV + head, mask=valid, other=0.0)

    kkt = tl.zeros((BT, BT), dtype=tl.float32)
    k_rows = k_ptr + rows64[:, None] * stride_kn + (head // GROUP) * stride_kh
    for k0 in range(0, DK, BK):
        offs_k = k0 + tl.arange(0, BK)
        kb = tl.load(k_rows + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < DK), other=0.0)
        kkt = tl.dot(kb, tl.trans(kb), kkt, input_precision=DOT_PRECISION)
    lower = (offs_t[:, None] > offs_t[None, :]) & valid[:, None] & valid[None, :]
    decay = tl.exp(tl.where(lower, gamma[:, None] - gamma[None, :], 0.0))  # exponent ≤ 0 where kept
    a = tl.where(lower, kkt * decay * beta[:, None], 0.0)
    tl.store(a_ptr + rows64[:, None] * (HV * BT) + head * BT + offs_t[None, :], a, mask=valid[:, None])


@triton.jit
def _solve_kernel(a_ptr, ai_ptr, chunk_seq_ptr, chunk_offsets_ptr, cu_seqlens_ptr, HV: tl.constexpr, BT: tl.constexpr):
    """Ai = (I + A)⁻¹ for one chunk, A strictly lower. With D the block diagonal of I + A (16×16 blocks) and E
    the rest, (I + A)⁻¹ = (I + N)⁻¹ D⁻¹ with N = D⁻¹E strictly block-lower, so N⁴ = 0 and
    (I + N)⁻¹ = I − N + N² − N³. D⁻¹ comes from forward substitution, row r of all four blocks at once."""
    tl.static_assert(BT == 64)  # four 16-row blocks: the series above stops at N³
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, eos = _chunk_bounds(chunk_seq_ptr, chunk_offsets_ptr, cu_seqlens_ptr, chunk, BT)
    offs = tl.arange(0, BT)
    offs16 = tl.arange(0, 16)
    valid = start + offs < eos
    ptrs = (start + offs).to(tl.int64)[:, None] * (HV * BT) + head * BT + offs[None, :]
    a = tl.load(a_ptr + ptrs, mask=valid[:, None], other=0.0)
    same_block = (offs[:, None] // 16) == (offs[None, :] // 16)
    a_diag, a_off = tl.where(same_block, a, 0.0), tl.where(same_block, 0.0, a)

    # stacked[16b + r, c] = (I + A_bb)⁻¹[r, c]; row r is e_r − Σ_{j<r} A_bb[r, j]·(row j), rows j < r being final.
    stacked = tl.where(offs[:, None] % 16 == offs16[None, :], 1.0, 0.0)
    for r in range(1, 16):
        rows_r = (offs % 16 == r)[:, None]
        prod = tl.dot(tl.where(rows_r, a_diag, 0.0), stacked, input_precision="ieee")
        stacked = tl.where(rows_r, tl.where(offs16[None, :] == r, 1.0, 0.0) - prod, stacked)
    spread = tl.where(offs16[:, None] == offs[None, :] % 16, 1.0, 0.0)  # [16, BT]: column j takes stacked column j % 16
    d_inv = tl.where(same_block, tl.dot(stacked, spread, input_precision="ieee"), 0.0)

    n = tl.dot(d_inv, a_off, input_precision="ieee")
    p = tl.dot(n, d_inv, input_precision="ieee")
    n2 = tl.dot(n, n, input_precision="ieee")
    ai = d_inv - p + tl.dot(n2, d_inv - p, input_precision="ieee")  # (I − N + N² − N³) D⁻¹
    tl.store(ai_ptr + ptrs, ai, mask=valid[:, None])


@triton.jit
def _load_inverse(ai_ptr, start, valid, head, HV: tl.constexpr, BT: tl.constexpr):
    """The chunk's (I + A)⁻¹ as one [BT, BT] tile, zero above the diagonal and in rows past the sequence."""
    offs_t = tl.arange(0, BT)
    ptrs = ai_ptr + (start + offs_t).to(tl.int64)[:, None] * (HV * BT) + head * BT + offs_t[None, :]
    return tl.load(ptrs, mask=valid[:, None] & (offs_t[None, :] <= offs_t[:, None]), other=0.0)


@triton.jit
def _wu_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    gcum_ptr,
    ai_ptr,
    w_ptr,
    u_ptr,
    chunk_seq_ptr,
    chunk_offsets_ptr,
    cu_seqlens_ptr,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """W = Ai (β·e^γ ⊙ K) → w [N, Hv, Dk] and U = Ai (β ⊙ V) → u [N, Hv, Dv], in the dtype of v."""
    chunk, head = tl.program_id(0), tl.program_id(1)
    start, eos = _chunk_bounds(chunk_seq_ptr, chunk_offsets_ptr, cu_seqlens_ptr, chunk, BT)
    rows = start + tl.arange(0, BT)
    valid = rows < eos
    rows64 = rows.to(tl.int64)
    beta = tl.load(beta_ptr + rows64 * HV + head, mask=valid, other=0.0)
    gamma = tl.load(gcum_ptr + rows64 * HV + head, mask=valid, other=0.0)
    ai = _load_inverse(ai_ptr, start, valid, head, HV, BT)
    dot_t = w_ptr.dtype.element_ty
    ai_d = ai.to(dot_t)

    v_rows = v_ptr + rows64[:, None] * stride_vn + head * stride_vh
    u_rows = u_ptr + rows64[:, None] * (HV * DV) + head * DV
    for v0 in range(0, DV, BV):
        offs_v = v0 + tl.arange(0, BV)
        ok = valid[:, None] & (offs_v[None, :] < DV)
        vb = tl.load(v_rows + offs_v[None, :], mask=ok, other=0.0).to(tl.float32) * beta[:, None]
        tl.store(u_rows + offs_v[None, :], tl.dot(ai_d, vb.to(dot_t), input_precision=DOT_PRECISION).to(dot_t), mask=ok)

    k_rows = k_ptr + rows64[:, None] * stride_kn + (head // GROUP) * stride_kh
    w_rows = w_ptr + rows64[:, None] * (HV * DK) + head * DK
    k_scale = beta * tl.exp(gamma)
    for k0 in range(0, DK, BK):
        offs_k = k0 + tl.arange(0, BK)
        ok = valid[:, None] & (offs_k[None, :] < DK)
        kb = tl.load(k_rows + offs_k[None, :], mask=ok, other=0.0).to(tl.float32) * k_scale[:, None]
        tl.store(w_rows + offs_k[None, :], tl.dot(ai_d, kb.to(dot_t), input_precision=DOT_PRECISION).to(dot_t), mask=ok)


@triton.jit
def _state_kernel(
    k_ptr,
    w_ptr,
    u_ptr,
    gcum_ptr,
    h_ptr,
    delta_ptr,
    state_ptr,
    slot_ids_ptr,
    has_initial_ptr,
    chunk_offsets_ptr,
    cu_seqlens_ptr,
    stride_kn,
    stride_kh,
    stride_slot,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The state through one sequence's chunks for one head and BV columns: h[chunk] = the state at the chunk's
    start (for the output kernel), δ = U − W·S, S = e^{γ_last}·S + (e^{γ_last−γ} ⊙ K)ᵀ δ; the state slot is read
    first (when the sequence has an initial state) and overwritten with the final state."""
    seq, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens_ptr + seq)
    eos = tl.load(cu_seqlens_ptr + seq + 1)
    first_chunk = tl.load(chunk_offsets_ptr + seq)
    num_chunks = tl.load(chunk_offsets_ptr + seq + 1) - first_chunk
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    k_ok, v_ok = offs_k < DK, offs_v < DV
    hv_ok = k_ok[:, None] & v_ok[None, :]
    state_ptrs = state_ptr + slot * stride_slot + head * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    state = tl.zeros((BK, BV), dtype=tl.float32)
    if tl.load(has_initial_ptr + seq) != 0:
        state = tl.load(state_ptrs, mask=hv_ok, other=0.0)
    dot_t = w_ptr.dtype.element_ty
    offs_t = tl.arange(0, BT)
    for c in range(num_chunks):
        chunk = (first_chunk + c).to(tl.int64)
        tl.store(h_ptr + (chunk * HV + head) * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :], state.to(h_ptr.dtype.element_ty), mask=hv_ok)
        start = bos + c * BT
        rows = start + offs_t
        valid = rows < eos
        rows64 = rows.to(tl.int64)
        w = tl.load(w_ptr + rows64[:, None] * (HV * DK) + head * DK + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        row_v_ok = valid[:, None] & v_ok[None, :]
        u = tl.load(u_ptr + rows64[:, None] * (HV * DV) + head * DV + offs_v[None, :], mask=row_v_ok, other=0.0).to(tl.float32)
        delta = u - tl.dot(w, state.to(dot_t), input_precision=DOT_PRECISION)
        tl.store(delta_ptr + rows64[:, None] * (HV * DV) + head * DV + offs_v[None, :], delta.to(delta_ptr.dtype.element_ty), mask=row_v_ok)
        gamma = tl.load(gcum_ptr + rows64 * HV + head, mask=valid, other=0.0)
        gamma_last = tl.load(gcum_ptr + (tl.minimum(start + BT, eos) - 1).to(tl.int64) * HV + head)
        kt = tl.load(k_ptr + (head // GROUP) * stride_kh + rows64[None, :] * stride_kn + offs_k[:, None], mask=k_ok[:, None] & valid[None, :], other=0.0)
        delta = tl.where(valid[:, None], delta * tl.exp(gamma_last - gamma)[:, None], 0.0)
        state = state * tl.exp(gamma_last) + tl.dot(kt.to(dot_t), delta.to(dot_t), input_precision=DOT_PRECISION)
    tl.store(state_ptrs, state, mask=hv_ok)


@triton.jit
def _output_kernel(
    q_ptr,
    k_ptr,
    delta_ptr,
    gcum_ptr,
    h_ptr,
    o_ptr,
    chunk_seq_ptr,
    chunk_offsets_ptr,
    cu_seqlens_ptr,
    scale,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """O = scale·((e^γ ⊙ Q) S₀ + (QKᵀ ⊙ e^{γ_i−γ_j} ⊙ [j ≤ i]) δ) for one chunk, head and BV columns."""
    chunk, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, eos = _chunk_bounds(chunk_seq_ptr, chunk_offsets_ptr, cu_seqlens_ptr, chunk, BT)
    offs_t = tl.arange(0, BT)
    rows = start + offs_t
    valid = rows < eos
    rows64 = rows.to(tl.int64)
    offs_v = vb * BV + tl.arange(0, BV)
    v_ok = offs_v < DV
    dot_t = delta_ptr.dtype.element_ty
    q_rows = q_ptr + rows64[:, None] * stride_qn + (head // GROUP) * stride_qh
    k_rows = k_ptr + rows64[:, None] * stride_kn + (head // GROUP) * stride_kh
    h_base = h_ptr + (chunk.to(tl.int64) * HV + head) * (DK * DV)
    inter = tl.zeros((BT, BV), dtype=tl.float32)
    qk = tl.zeros((BT, BT), dtype=tl.float32)
    for k0 in range(0, DK, BK):
        offs_k = k0 + tl.arange(0, BK)
        ok = valid[:, None] & (offs_k[None, :] < DK)
        qb = tl.load(q_rows + offs_k[None, :], mask=ok, other=0.0).to(dot_t)
        kb = tl.load(k_rows + offs_k[None, :], mask=ok, other=0.0).to(dot_t)
        hb = tl.load(h_base + offs_k[:, None] * DV + offs_v[None, :], mask=(offs_k[:, None] < DK) & v_ok[None, :], other=0.0).to(dot_t)
        inter = tl.dot(qb, hb, inter, input_precision=DOT_PRECISION)
        qk = tl.dot(qb, tl.trans(kb), qk, input_precision=DOT_PRECISION)
    gamma = tl.load(gcum_ptr + rows64 * HV + head, mask=valid, other=0.0)
    causal = (offs_t[None, :] <= offs_t[:, None]) & valid[:, None] & valid[None, :]
    qk = tl.where(causal, qk * tl.exp(tl.where(causal, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    delta = tl.load(delta_ptr + rows64[:, None] * (HV * DV) + head * DV + offs_v[None, :], mask=valid[:, None] & v_ok[None, :], other=0.0)
    out = inter * tl.exp(gamma)[:, None] + tl.dot(qk.to(dot_t), delta.to(dot_t), input_precision=DOT_PRECISION)
    tl.store(o_ptr + rows64[:, None] * (HV * DV) + head * DV + offs_v[None, :], (out * scale).to(o_ptr.dtype.element_ty), mask=valid[:, None] & v_ok[None, :])


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state_pool: torch.Tensor) -> tuple[int, int, int, int]:
    """Heads and head sizes, after the layout checks the kernels rely on (unit stride within a head)."""
    hk, dk = q.shape[1], q.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or g.shape != (v.shape[0], hv) or beta.shape != g.shape or v.shape[0] != q.shape[0]:
        raise ValueError(
            f"gated delta rule: shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)} disagree"
        )
    if hv % hk:
        raise ValueError(f"gated delta rule: {hv} value heads are not a multiple of {hk} key heads")
    if state_pool.shape[1:] != (hv, dk, dv) or state_pool.dtype != torch.float32 or not state_pool.is_contiguous():
        raise ValueError(f"gated delta rule: state_pool must be contiguous fp32 [slots, {hv}, {dk}, {dv}], got {tuple(state_pool.shape)} {state_pool.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(2) != 1:
            raise ValueError(f"gated delta rule: {name} must be contiguous within a head (strides {t.stride()})")
    return hk, hv, dk, dv


def _block(size: int, cap: int) -> int:
    """A power-of-two tile edge for a head dimension: at least 16 (tl.dot's minimum), at most ``cap``."""
    return max(16, min(cap, triton.next_power_of_2(size)))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 serving means fp32 products; others use their own dtype


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
    """Prefill of packed sequences ``cu_seqlens`` [B+1]: o [N, Hv, Dv] in v's dtype. Sequence b starts from
    ``state_pool[slot_ids[b]]`` where ``has_initial_state[b]`` (else zeros) and leaves its final state there."""
    hk, hv, dk, dv = _check(q, k, v, g, beta, state_pool)
    num_tokens, batch = q.shape[0], slot_ids.shape[0]
    device, dtype = v.device, v.dtype
    o = torch.empty(num_tokens, hv, dv, dtype=dtype, device=device)
    if num_tokens == 0:  # only empty sequences: each keeps its state, or starts (and ends) from zeros
        state_pool[slot_ids.long()[~has_initial_state.to(device=device, dtype=torch.bool)]] = 0.0
        return o
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    lengths = cu[1:] - cu[:-1]
    chunks_per_seq = (lengths + CHUNK - 1) // CHUNK
    chunk_offsets = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    chunk_offsets[1:] = chunks_per_seq.cumsum(0)
    num_chunks = int(chunk_offsets[-1])  # the one host sync: the grid of the per-chunk kernels
    chunk_seq = torch.repeat_interleave(torch.arange(batch, dtype=torch.int32, device=device), chunks_per_seq, output_size=num_chunks)
    g, beta = g.float().contiguous(), beta.float().contiguous()
    slots = slot_ids.to(device=device, dtype=torch.int32)
    has_initial = has_initial_state.to(device=device, dtype=torch.int32)
    group = hv // hk
    precision = _dot_precision(dtype)
    bk, bv = _block(dk, 64), _block(dv, 64)
    index = (chunk_seq, chunk_offsets, cu)

    gcum = torch.empty(num_tokens, hv, dtype=torch.float32, device=device)
    a = torch.empty(num_tokens, hv, CHUNK, dtype=torch.float32, device=device)
    ai = torch.empty_like(a)
    w = torch.empty(num_tokens, hv, dk, dtype=dtype, device=device)
    u = torch.empty(num_tokens, hv, dv, dtype=dtype, device=device)
    delta = torch.empty_like(u)
    h = torch.empty(num_chunks, hv, dk, dv, dtype=dtype, device=device)  # the state at each chunk's start
    _kkt_kernel[(num_chunks, hv)](
        k, g, beta, gcum, a, *index, k.stride(0), k.stride(1), HV=hv, GROUP=group, DK=dk, BT=CHUNK, BK=bk, DOT_PRECISION=precision
    )  # fmt: skip
    _solve_kernel[(num_chunks, hv)](a, ai, *index, HV=hv, BT=CHUNK, num_warps=8)  # several live 64×64 fp32 tiles
    _wu_kernel[(num_chunks, hv)](
        k, v, beta, gcum, ai, w, u, *index, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HV=hv, GROUP=group, DK=dk, DV=dv, BT=CHUNK, BK=bk, BV=bv, DOT_PRECISION=precision,
    )  # fmt: skip
    state_bv = _block(dv, 32)  # the sequential kernel: narrower column blocks, more programs for one long sequence
    _state_kernel[(batch, hv, triton.cdiv(dv, state_bv))](
        k, w, u, gcum, h, delta, state_pool, slots, has_initial, chunk_offsets, cu, k.stride(0), k.stride(1), state_pool.stride(0),
        HV=hv, GROUP=group, DK=dk, DV=dv, BT=CHUNK, BK=_block(dk, 256), BV=state_bv, DOT_PRECISION=precision,
    )  # fmt: skip
    _output_kernel[(num_chunks, hv, triton.cdiv(dv, bv))](
        q, k, delta, gcum, h, o, *index, scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        HV=hv, GROUP=group, DK=dk, DV=dv, BT=CHUNK, BK=bk, BV=bv, DOT_PRECISION=precision,
    )  # fmt: skip
    return o


@triton.jit
def _recurrent_step_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    o_ptr,
    state_ptr,
    slot_ids_ptr,
    scale,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_slot,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    """One token of one sequence, one head, BV columns of the state: read the slot, step, write it back."""
    seq, head, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slot_ids_ptr + seq).to(tl.int64)
    seq64 = seq.to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    k_ok, v_ok = offs_k < DK, offs_v < DV
    state_ptrs = state_ptr + slot * stride_slot + head * (DK * DV) + offs_k[:, None] * DV + offs_v[None, :]
    state = tl.load(state_ptrs, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    qk_head = head // GROUP
    q = tl.load(q_ptr + seq64 * stride_qn + qk_head * stride_qh + offs_k, mask=k_ok, other=0.0).to(tl.float32) * scale
    k = tl.load(k_ptr + seq64 * stride_kn + qk_head * stride_kh + offs_k, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + seq64 * stride_vn + head * stride_vh + offs_v, mask=v_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + seq64 * HV + head)
    beta = tl.load(beta_ptr + seq64 * HV + head)
    state = state * tl.exp(g)
    delta = beta * (v - tl.sum(k[:, None] * state, 0))
    state = state + k[:, None] * delta[None, :]
    tl.store(state_ptrs, state, mask=k_ok[:, None] & v_ok[None, :])
    out = tl.sum(q[:, None] * state, 0)
    tl.store(o_ptr + seq64 * (HV * DV) + head * DV + offs_v, out.to(o_ptr.dtype.element_ty), mask=v_ok)


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
    """Decode, one token per sequence (q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]): o [B, Hv, Dv] in v's
    dtype; ``state_pool[slot_ids[b]]`` is stepped in place. No host sync, so a step can be graph-captured."""
    hk, hv, dk, dv = _check(q, k, v, g, beta, state_pool)
    batch = q.shape[0]
    o = torch.empty(batch, hv, dv, dtype=v.dtype, device=v.device)
    if batch == 0:
        return o
    bk, bv = _block(dk, 256), _block(dv, 32)
    _recurrent_step_kernel[(batch, hv, triton.cdiv(dv, bv))](
        q, k, v, g.float().contiguous(), beta.float().contiguous(), o, state_pool, slot_ids.to(dtype=torch.int32), scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), state_pool.stride(0),
        HV=hv, GROUP=hv // hk, DK=dk, DV=dv, BK=bk, BV=bv,
    )  # fmt: skip
    return o
