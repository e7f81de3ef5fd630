"""Paged KV cache tensors and attention over a flat batch of decode slices and prefill chunks.

Slot layout: position ``p`` of a request lives at slot ``table[p // block_size] * block_size +
p % block_size`` of every layer's cache. ``AttentionMetadata`` turns a step's slices into the
slot indices and masks once; every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


class KVCache:
    """Keys and values of every layer: ``[num_layers, num_blocks * block_size, 2, kv_heads, head_dim]``.

    Zero-filled at start-up, so its memory is committed and a masked padding slot is never NaN.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.tensor = torch.zeros(num_layers, num_blocks * block_size, 2, num_kv_heads, head_dim, dtype=dtype)
        self.layers = list(self.tensor.unbind(0))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


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

    @classmethod
    def build(cls, starts: list[int], lens: list[int], tables: list[list[int]], num_decodes: int, block_size: int, dtype: torch.dtype) -> AttentionMetadata:
        """Slices given in flat-batch order: ``num_decodes`` decodes (``lens`` 1), then prefill chunks."""
        width = max(map(len, tables))
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        in_block = torch.arange(block_size)
        start_t, len_t = torch.tensor(starts), torch.tensor(lens)
        total = sum(lens)
        seq = torch.repeat_interleave(torch.arange(len(lens)), len_t, output_size=total)
        positions = torch.arange(total) + (start_t - (torch.cumsum(len_t, 0) - len_t))[seq]
        write_slots = table[seq, positions // block_size] * block_size + positions % block_size

        b = num_decodes
        decode_len, decode_slots, decode_mask = 0, None, None
        if b:
            context = start_t[:b] + 1
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
            if start:
                end = start + n
                nblocks = -(-end // block_size)
                slots = (table[j, :nblocks, None] * block_size + in_block).view(-1)[:end]
                mask = _additive(torch.arange(end)[None, :] <= torch.arange(start, end)[:, None], dtype)
            prefills.append(PrefillChunk(slice(row, row + n), slots, mask))
            row += n
        max_position = max(s + n for s, n in zip(starts, lens)) - 1
        return cls(positions, write_slots, b, decode_len, decode_slots, decode_mask, tuple(prefills), max_position)


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype).masked_fill_(~keep, float("-inf"))


def paged_attention(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Store this step's ``kv`` [T, 2, kv_heads, D] in ``cache``, then attend: ``q`` [T, heads, D] → [T, heads * D]."""
    cache.index_copy_(0, meta.write_slots, kv)
    heads, dim = q.shape[1:]
    kv_heads = kv.shape[2]
    outs = []
    if b := meta.num_decodes:
        context = cache.index_select(0, meta.decode_slots).view(b, meta.decode_len, 2, kv_heads, dim)
        k, v = context[:, :, 0].transpose(1, 2), context[:, :, 1].transpose(1, 2)
        # GQA for one query token: the heads that share kv head j (heads j*g .. j*g+g-1) become
        # g queries of that kv head, so keys are never repeated.
        qd = q[:b].view(b, kv_heads, heads // kv_heads, dim)
        outs.append(F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask).reshape(b, heads * dim))
    for chunk in meta.prefills:
        n = chunk.rows.stop - chunk.rows.start
        context = kv[chunk.rows] if chunk.context_slots is None else cache.index_select(0, chunk.context_slots)
        k, v = context[:, 0].transpose(0, 1), context[:, 1].transpose(0, 1)
        qp = q[chunk.rows].transpose(0, 1)
        out = F.scaled_dot_product_attention(qp, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, enable_gqa=True)
        outs.append(out.transpose(0, 1).reshape(n, heads * dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
