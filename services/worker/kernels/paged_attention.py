"""Paged attention in Triton: the GPU path of ``services.worker.attention`` (whose torch path is the reference).

One kernel serves decode and prefill. A step is a flat batch of ``S`` sequences; sequence ``s`` has
``n_s`` query rows (1 for a decode) at positions ``start_s .. start_s + n_s - 1`` and attends causally
to every key at positions ``0 .. start_s + n_s - 1``, read from the paged cache through its block
table (``slot = table[p // block_size] * block_size + p % block_size``), this step's keys included:
the caller stores them first.

A program owns ``BLOCK_Q`` query tokens of one sequence and one kv head, i.e. ``BLOCK_Q × G`` rows
(``G`` query heads share a kv head under GQA), so each key tile is loaded once for the whole group.
It streams key tiles with an online softmax in fp32. Grid sizes depend only on the batch shape
(sequences and the longest query), never on context lengths, so a decode step can be captured in a
CUDA graph and replayed while contexts grow.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    cache_ptr,
    out_ptr,
    tables_ptr,
    query_starts_ptr,  # [S + 1] row of each sequence's first query in q (cumulative)
    context_starts_ptr,  # [S] position of each sequence's first query
    scale,
    block_size,
    stride_qt,
    stride_qh,
    stride_cs,  # cache: [slots, 2, kv_heads, D]
    stride_ckv,
    stride_ch,
    stride_ot,
    stride_oh,
    stride_tb,
    G: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # next power of two >= max(BLOCK_Q * G, 16)
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    row_begin = tl.load(query_starts_ptr + seq)
    num_queries = tl.load(query_starts_ptr + seq + 1) - row_begin
    if q_tile * BLOCK_Q >= num_queries:
        return
    context_start = tl.load(context_starts_ptr + seq)

    rows = tl.arange(0, BLOCK_M)
    query = q_tile * BLOCK_Q + rows // G  # index of the query token within the sequence
    head = kv_head * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (query < num_queries)
    q_position = context_start + query
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    token = (row_begin + query).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # A finite floor instead of -inf: a padding row (every key masked) keeps m = floor, l = 0, acc = 0.
    m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    table_row = tables_ptr + seq.to(tl.int64) * stride_tb
    last_query = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, num_queries) - 1
    kv_end = context_start + last_query + 1  # keys this tile's last query sees
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, kv_end, BLOCK_N):
        k_position = n0 + offs_n
        k_ok = k_position < kv_end
        block = tl.load(table_row + k_position // block_size, mask=k_ok, other=0).to(tl.int64)
        slot = block * block_size + k_position % block_size
        kv_ptrs = cache_ptr + slot[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = (k_position[None, :] <= q_position[:, None]) & k_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_ptrs + stride_ckv, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _block_q(max_query_len: int, group: int) -> int:
    """Query tokens per program: one for decode-only steps, else enough for ~64 rows."""
    if max_query_len <= 1:
        return 1
    return max(1, min(triton.next_power_of_2(max_query_len), 64 // triton.next_power_of_2(group)))


def paged_attention_kernel(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_starts: torch.Tensor,
    max_query_len: int,
    block_size: int,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` [T, heads, D] over one layer's paged ``cache`` [slots, 2, kv_heads, D]
    → ``out`` [T, heads, D].

    ``block_tables`` [S, W] (int32; row s names sequence s's blocks in order, entries past its
    context unused), ``query_starts`` [S + 1] (int32, cumulative query rows, 0 first),
    ``context_starts`` [S] (int32, position of each sequence's first query row);
    ``max_query_len`` bounds every sequence's query rows (it sizes the grid only).
    """
    tokens, heads, dim = q.shape
    kv_heads = cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} kv heads evenly")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("paged attention needs unit stride along head_dim in q and the cache")
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    num_seqs = block_tables.shape[0]
    if tokens == 0 or num_seqs == 0:
        return out
    block_q = _block_q(max_query_len, group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_d = max(16, triton.next_power_of_2(dim))
    grid = (num_seqs, triton.cdiv(max(max_query_len, 1), block_q), kv_heads)
    _paged_attention_kernel[grid](
        q, cache, out, block_tables, query_starts, context_starts, dim**-0.5 if scale is None else scale, block_size,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        G=group, HEAD_DIM=dim, BLOCK_D=block_d, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64 if block_m <= 32 else 32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return out
