"""Paged KV cache tensors and attention over a flat batch of decode slices and prefill chunks.

Slot layout: position ``p`` of a request lives at slot ``table[p // block_size] * block_size +
p % block_size`` of every layer's cache. ``AttentionMetadata`` turns a step's slices into the
slot indices and masks once; every layer reuses them.

Three backends implement ``paged_attention``'s contract, chosen once at load: the torch path below
(the reference, and the CPU fallback), ``cpp`` on the CPU (every row of a step, decode or prefill, reads
the cache in place through its block table in one C++ kernel call, ``csrc/paged_decode_attention.cpp``) and the Triton kernel (``kernels/paged_attention.py``) on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import cpu_kernels
from shared.model_info import KV_Q8_BLOCK, q8_row_width


class KVCache:
    """Keys and values of every layer: ``[num_layers, num_blocks * block_size, 2, kv_heads, head_dim]``;
    an int8 cache's rows are ``q8_row_width(head_dim)`` bytes, each head vector's codes and then its scales.

    Zero-filled at start-up, so its memory is committed and a masked padding slot is never NaN.
    """

    def __init__(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        width = q8_row_width(head_dim) if dtype == torch.int8 else head_dim
        self.tensor = torch.zeros(num_layers, num_blocks * block_size, 2, num_kv_heads, width, dtype=dtype, device=device)
        self.layers = list(self.tensor.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def q8_dequantize(rows: torch.Tensor) -> torch.Tensor:
    """An int8 cache's rows [..., q8_row_width(head_dim)] as float32 [..., head_dim] (the kernels' reference)."""
    head_dim = rows.shape[-1] * KV_Q8_BLOCK // (KV_Q8_BLOCK + 2)
    codes = rows[..., :head_dim].float().unflatten(-1, (-1, KV_Q8_BLOCK))
    scales = rows[..., head_dim:].contiguous().view(torch.float16).float()
    return (codes * scales[..., None]).flatten(-2)


@dataclass(frozen=True)
class PrefillChunk:
    """A chunk of ``rows`` query tokens at positions ``start..start+len(rows)-1`` of one request."""

    rows: slice
    context_slots: torch.Tensor | None  # [start + n] slots of every position so far; None when start == 0
    mask: torch.Tensor | None  # [n, start + n] additive causal mask offset by start; None: plain causal


@dataclass(frozen=True)
class AttentionMetadata:
    """One step's indices and masks. Decode slices (one token each) come first in the flat batch."""

    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] where this step's keys and values go
    num_decodes: int
    decode_len: int  # longest decode context (L)
    decode_slots: torch.Tensor | None  # [B * L] context slots of the decode slices, padded with slot 0
    decode_mask: torch.Tensor | None  # [B, 1, 1, L] additive; None when no decode needs padding
    prefills: tuple[PrefillChunk, ...]
    max_position: int
    # What the Triton backend reads, one row per slice in flat-batch order (int32, on the device).
    block_tables: torch.Tensor | None = None  # [S, W]
    query_starts: torch.Tensor | None = None  # [S + 1] cumulative query rows
    context_starts: torch.Tensor | None = None  # [S] position of each slice's first row
    max_query_len: int = 1
    block_size: int = 0
    # What the cpp backend reads: every row (decode or prefill) is one query over its own context.
    row_block_tables: torch.Tensor | None = None  # [T, W] int32: the block table of each row's request
    row_context_lens: torch.Tensor | None = None  # [T] int32: position + 1 of each row

    @classmethod
    def build(
        cls,
        starts: list[int],
        lens: list[int],
        tables: list[list[int]],
        num_decodes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        backend: str = "torch",
    ) -> AttentionMetadata:
        """Slices given in flat-batch order: ``num_decodes`` decodes (``lens`` 1), then prefill chunks.
        Built on the CPU, then moved to ``device`` (where the model runs), with what ``backend`` reads:
        the torch one context slots and masks, cpp each row's block table and context length, triton none."""
        if backend == "cpp" and num_decodes == len(lens):
            return cls._cpp_decode(starts, tables, block_size)
        decode_context = prefill_context = backend == "torch"
        width = max(map(len, tables))
        padded = [t + [0] * (width - len(t)) for t in tables]
        table = torch.tensor(padded, dtype=torch.int64)
        in_block = torch.arange(block_size)
        # Each row's slice and position, and the slot its keys and values go to, on Python ints: a step
        # holds a few dozen rows or a prefill chunk, where a dozen small tensor ops cost ~0.1 ms more.
        seq = [j for j, n in enumerate(lens) for _ in range(n)]
        rows = [p for start, n in zip(starts, lens) for p in range(start, start + n)]
        positions = torch.tensor(rows, dtype=torch.int64)
        write_slots = torch.tensor([padded[j][p // block_size] * block_size + p % block_size for j, p in zip(seq, rows)], dtype=torch.int64)

        b = num_decodes
        decode_len, decode_slots, decode_mask = 0, None, None
        if b and decode_context:
            context = torch.tensor(starts[:b]) + 1
            decode_len = max(starts[:b]) + 1
            nblocks = -(-decode_len // block_size)
            grid = (table[:b, :nblocks, None] * block_size + in_block).view(b, nblocks * block_size)
            decode_slots = grid[:, :decode_len].reshape(-1)
            if min(starts[:b]) + 1 != decode_len:
                keep = torch.arange(decode_len) < context[:, None]
                decode_mask = _additive(keep, dtype).view(b, 1, 1, decode_len)

        prefills, row = [], b
        for j in range(b, len(lens)):
            start, n = starts[j], lens[j]
            slots = mask = None
            if start and prefill_context:
                end = start + n
                nblocks = -(-end // block_size)
                slots = (table[j, :nblocks, None] * block_size + in_block).view(-1)[:end]
                mask = _additive(torch.arange(end)[None, :] <= torch.arange(start, end)[:, None], dtype)
            prefills.append(PrefillChunk(slice(row, row + n), slots, mask))
            row += n
        max_position = max(s + n for s, n in zip(starts, lens)) - 1
        table32 = table.to(torch.int32)
        row_tables = row_lens = None
        if backend == "cpp":  # decode-only steps (one row per slice) read the slices' tables as they are
            row_tables = table32 if len(rows) == len(lens) else table32[torch.tensor(seq)]
            row_lens = torch.tensor([p + 1 for p in rows], dtype=torch.int32)
        meta = cls(
            positions, write_slots, b, decode_len, decode_slots, decode_mask, tuple(prefills), max_position,
            table32, torch.tensor([0, *accumulate(lens)], dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), max(lens), block_size,
            row_tables, row_lens,
        )  # fmt: skip
        return meta if torch.device(device).type == "cpu" else meta.to(device)

    @classmethod
    def _cpp_decode(cls, starts: list[int], tables: list[list[int]], block_size: int) -> AttentionMetadata:
        """``build`` for a decode-only step on the cpp backend (every CPU decode step), with only what
        that backend reads: four small tensors instead of a dozen (the step's Python glue sits between
        kernels on the critical path; at one row this build took 30 us warm, now 17)."""
        width = max(map(len, tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        write_slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, starts)]
        b = len(starts)
        return cls(
            torch.tensor(starts, dtype=torch.int64), torch.tensor(write_slots, dtype=torch.int64), b, 0, None, None, (), max(starts),
            block_tables, None, None, 1, block_size, block_tables, torch.tensor([p + 1 for p in starts], dtype=torch.int32),
        )  # fmt: skip

    @classmethod
    def for_decode(cls, positions: torch.Tensor, block_tables: torch.Tensor, block_size: int, dtype: torch.dtype, backend: str = "torch") -> AttentionMetadata:
        """A decode-only step from device tensors alone, every shape fixed by ``block_tables`` [B, W]:
        what a CUDA graph captures. For the torch backend every decode attends over ``W * block_size``
        slots, masked past its position; nothing here reads a tensor's value on the host."""
        batch, width = block_tables.shape
        device = block_tables.device
        tables = block_tables.long()
        span = width * block_size
        write_slots = tables.gather(1, (positions // block_size)[:, None]).squeeze(1) * block_size + positions % block_size
        decode_slots = decode_mask = None
        if backend == "torch":
            decode_slots = (tables[:, :, None] * block_size + torch.arange(block_size, device=device)).view(-1)
            keep = torch.arange(span, device=device) <= positions[:, None]
            decode_mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf")).view(batch, 1, 1, span)
        query_starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
        return cls(
            positions, write_slots, batch, span, decode_slots, decode_mask, (), span - 1,
            block_tables, query_starts, positions.to(torch.int32), 1, block_size,
            block_tables if backend == "cpp" else None, (positions + 1).to(torch.int32) if backend == "cpp" else None,
        )  # fmt: skip

    def to(self, device: torch.device | str) -> AttentionMetadata:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        prefills = tuple(PrefillChunk(c.rows, move(c.context_slots), move(c.mask)) for c in self.prefills)
        return AttentionMetadata(
            move(self.positions), move(self.write_slots), self.num_decodes, self.decode_len, move(self.decode_slots), move(self.decode_mask),
            prefills, self.max_position, move(self.block_tables), move(self.query_starts), move(self.context_starts), self.max_query_len, self.block_size,
            move(self.row_block_tables), move(self.row_context_lens),
        )  # fmt: skip


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))


def paged_attention(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Store this step's ``kv`` [T, 2, kv_heads, D] in ``cache`` (in the cache's dtype), then attend:
    ``q`` [T, heads, D] → [T, heads * D], in q's dtype."""
    cache.index_copy_(0, meta.write_slots, kv.to(cache.dtype))
    heads, dim = q.shape[1:]
    kv_heads = kv.shape[2]
    outs = []
    if b := meta.num_decodes:
        context = cache.index_select(0, meta.decode_slots).to(q.dtype).view(b, meta.decode_len, 2, kv_heads, dim)
        k, v = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
        # GQA for one query token: the heads that share kv head j (heads j*g .. j*g+g-1) become
        # g queries of that kv head, so keys are never repeated.
        qd = q[:b].view(b, kv_heads, heads // kv_heads, dim)
        outs.append(F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask).reshape(b, heads * dim))
    outs += _prefill_attention(q, kv, cache, meta)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _prefill_attention(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> list[torch.Tensor]:
    """Each prefill chunk's attention over its context so far (torch SDPA), in flat-batch order."""
    heads, dim = q.shape[1:]
    outs = []
    for chunk in meta.prefills:
        n = chunk.rows.stop - chunk.rows.start
        if chunk.context_slots is None:  # this chunk's own keys and values, as the cache holds them (rounded if it is fp16)
            context = kv[chunk.rows] if cache.dtype == q.dtype else kv[chunk.rows].to(cache.dtype).to(q.dtype)
        else:
            context = cache.index_select(0, chunk.context_slots).to(q.dtype)
        k, v = context[:, 0].transpose(0, 1), context[:, 1].transpose(0, 1)
        qp = q[chunk.rows].transpose(0, 1)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, enable_gqa=True)
        outs.append(out.transpose(0, 1).reshape(n, heads * dim))
    return outs


def paged_attention_cpp(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """``paged_attention``'s contract in one call of the C++ kernel for the whole step: every row, a
    decode or a prefill chunk's, is a query over the cache up to its own position (causal by
    construction), read in place through its request's block table (fp32, fp16 or int8 storage). A fresh
    chunk thus attends over its keys as the cache holds them, as a later prefix-cache hit will."""
    kernels, _ = cpu_kernels()
    kernels.store_kv_(cache, kv, meta.write_slots)
    out = kernels.paged_decode_attention(q, cache, meta.row_block_tables, meta.row_context_lens, meta.block_size, q.shape[-1] ** -0.5)
    return out.view(q.shape[0], -1)


def paged_attention_triton(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """``paged_attention``'s contract with one Triton launch for the whole flat batch, decodes and prefills alike."""
    from services.worker.kernels.paged_attention import paged_attention_kernel

    cache.index_copy_(0, meta.write_slots, kv)
    out = paged_attention_kernel(q, cache, meta.block_tables, meta.query_starts, meta.context_starts, meta.max_query_len, meta.block_size)
    return out.view(q.shape[0], -1)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
ATTENTION_BACKENDS: dict[str, AttentionFn] = {"torch": paged_attention, "cpp": paged_attention_cpp, "triton": paged_attention_triton}


def select_attention_backend(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """The Triton kernel where the model runs on CUDA; on the CPU the C++ decode kernel for fp32 when
    it builds here (else the torch path; ``cpu_kernels()`` says why)."""
    if device.type == "cuda":
        return "triton"
    return "cpp" if dtype == torch.float32 and cpu_kernels()[0] is not None else "torch"
