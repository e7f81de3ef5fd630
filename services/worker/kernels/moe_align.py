"""Token-to-expert alignment for the fused MoE GEMMs: the T·k (token, expert) pairs grouped by
expert, each expert's group padded to a multiple of the GEMM's row block.

Pair ``p = t * k + j`` is token ``t``'s ``j``-th choice. For a block size B the outputs are:

- ``sorted_ids`` [max_padded] int32: pair ids grouped by expert (in pair order within an expert),
  each group padded with the sentinel ``T·k`` to a multiple of B;
- ``expert_ids`` [max_padded / B] int32: the expert of each block of ``sorted_ids``, -1 past the end;
- ``num_padded`` [1] int32: how many entries of ``sorted_ids`` are in use.

Their sizes depend only on (T·k, E, B), never on the routing, so a CUDA graph can capture them.
``moe_align_torch`` is the reference; ``moe_align_triton`` computes the same tensors in three kernels
(per-chunk expert histograms, their prefix sums with the block → expert map, the scatter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCATTER_CHUNK = 128  # pairs per program of the histogram and scatter kernels
BLOCK_MAP_TILE = 32  # blocks per iteration of the block -> expert map


def max_padded_size(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Room for any routing: each active expert (at most min(E, T·k) of them) wastes < B slots."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_size - 1), block_size) * block_size


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_ids, expert_ids, num_padded)`` for ``topk_ids`` [T, k]; see the module docstring."""
    flat = topk_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    size = max_padded_size(num_pairs, num_experts, block_size)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[experts] + rank] = order.to(torch.int32)
    expert_ids = torch.full((size // block_size,), -1, dtype=torch.int32, device=device)
    owners = torch.repeat_interleave(torch.arange(num_experts, device=device, dtype=torch.int32), padded // block_size)
    expert_ids[: owners.numel()] = owners
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


@triton.jit
def _count_kernel(topk_ids_ptr, counts_ptr, num_pairs, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """counts[c, e] = pairs of chunk c routed to expert e."""
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=0).to(tl.int32)
    tl.store(counts_ptr + chunk * E_POW2 + tl.arange(0, E_POW2), tl.histogram(ids, E_POW2, mask=valid))


@triton.jit
def _offsets_kernel(counts_ptr, expert_start_ptr, expert_ids_ptr, num_padded_ptr, num_chunks, num_blocks, block_size, E_POW2: tl.constexpr, TILE: tl.constexpr):
    """One program: counts[c, e] becomes the pairs of expert e in chunks before c; the experts' padded
    starts, the total, and the expert of every block follow."""
    experts = tl.arange(0, E_POW2)
    total = tl.zeros((E_POW2,), dtype=tl.int32)
    for chunk in range(num_chunks):
        ptrs = counts_ptr + chunk * E_POW2 + experts
        count = tl.load(ptrs)
        tl.store(ptrs, total)
        total += count
    padded = (total + block_size - 1) // block_size * block_size
    ends = tl.cumsum(padded, 0)
    tl.store(expert_start_ptr + experts, ends - padded)
    num_padded = tl.sum(padded, 0)
    tl.store(num_padded_ptr, num_padded)
    for first in range(0, num_blocks, TILE):
        blocks = first + tl.arange(0, TILE)
        row = blocks * block_size
        # A block's owner is the first expert whose group ends after the block's first row; the
        # experts before it (empty ones included) all end at or before that row.
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blocks, tl.where(row < num_padded, owner, -1), mask=blocks < num_blocks)


@triton.jit
def _scatter_kernel(topk_ids_ptr, counts_ptr, expert_start_ptr, sorted_ids_ptr, num_pairs, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """Each pair goes to its expert's start + the expert's pairs in earlier chunks + those earlier in this chunk."""
    chunk = tl.program_id(0)
    lanes = tl.arange(0, CHUNK)
    offs = chunk * CHUNK + lanes
    valid = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=valid, other=-1).to(tl.int32)
    earlier_same = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])  # invalid lanes come last: never counted
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    base = tl.load(expert_start_ptr + ids, mask=valid, other=0) + tl.load(counts_ptr + chunk * E_POW2 + ids, mask=valid, other=0)
    tl.store(sorted_ids_ptr + base + rank, offs, mask=valid)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same tensors as ``moe_align_torch``, computed on the device without a host sync."""
    flat = topk_ids.flatten()
    num_pairs, device = flat.numel(), flat.device
    size = max_padded_size(num_pairs, num_experts, block_size)
    e_pow2 = triton.next_power_of_2(num_experts)
    num_chunks = triton.cdiv(num_pairs, SCATTER_CHUNK)
    counts = torch.empty((num_chunks, e_pow2), dtype=torch.int32, device=device)
    expert_start = torch.empty(e_pow2, dtype=torch.int32, device=device)
    sorted_ids = torch.full((size,), num_pairs, dtype=torch.int32, device=device)
    expert_ids = torch.empty(size // block_size, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](flat, counts, num_pairs, E_POW2=e_pow2, CHUNK=SCATTER_CHUNK)
    _offsets_kernel[(1,)](counts, expert_start, expert_ids, num_padded, num_chunks, expert_ids.numel(), block_size, E_POW2=e_pow2, TILE=BLOCK_MAP_TILE)
    _scatter_kernel[(num_chunks,)](flat, counts, expert_start, sorted_ids, num_pairs, E_POW2=e_pow2, CHUNK=SCATTER_CHUNK)
    return sorted_ids, expert_ids, num_padded
