"""The device memory budget: after the weights load, how many KV blocks (and GDN state slots) fit.

The worker may use ``utilization × total`` bytes of the device. What is in use once the weights are
loaded (``total - free_after_load``: the weights, and anything other processes hold) is already
spent; ``reserve`` is kept back for one step's activations and the CUDA graphs' pool. The rest holds
the GDN state pool first (one slot per running request) and
then as many KV blocks as fit. Pure arithmetic, so it is tested without a device.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

GRAPH_POOL_RESERVE = 512 << 20  # captured decode graphs' intermediates, and allocator slack
ACTIVATION_FACTOR = 24  # an upper estimate of live activations per token, in units of hidden × dtype bytes


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    free_before_load_bytes: int
    free_after_load_bytes: int
    utilization: float
    reserve_bytes: int
    kv_bytes_per_token: int
    block_size: int
    state_bytes_per_slot: int
    state_slots: int
    state_pool_bytes: int
    kv_cache_bytes: int
    num_blocks: int

    @property
    def weights_bytes(self) -> int:
        """What loading took (the weights, and whatever else the load allocated)."""
        return self.free_before_load_bytes - self.free_after_load_bytes

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "weights_bytes": self.weights_bytes, "kv_cache_tokens": self.num_blocks * self.block_size}


def activation_reserve(max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int, vocab_size: int, dtype_bytes: int) -> int:
    """Bytes kept back for one step's activations (a step of the full token budget, logits in fp32
    for every sequence) and the CUDA graph pool."""
    activations = ACTIVATION_FACTOR * max_num_batched_tokens * hidden_size * dtype_bytes
    logits = 2 * max_num_seqs * vocab_size * 4
    return activations + logits + GRAPH_POOL_RESERVE


def gdn_bytes_per_slot(shape: Any, dtype: torch.dtype) -> int:
    """One request's GDN state over every GDN layer (``GDNShape``; None: not a hybrid model): the conv
    history in the model dtype and the fp32 recurrent state, as ``gdn_state.GDNStateCache`` holds them."""
    if shape is None:
        return 0
    conv = shape.conv_channels * shape.conv_history * dtype.itemsize
    recurrent = shape.num_v_heads * shape.key_dim * shape.value_dim * 4
    return shape.num_layers * (conv + recurrent)


def plan_memory(
    total_bytes: int,
    free_before_load_bytes: int,
    free_after_load_bytes: int,
    utilization: float,
    reserve_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    state_bytes_per_slot: int = 0,
    state_slots: int = 0,
) -> MemoryPlan:
    """Size the KV cache (and the state pool) from the budget; ``ValueError`` naming the flag when nothing fits."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if kv_bytes_per_token <= 0 or block_size <= 0:
        raise ValueError(f"kv_bytes_per_token and block_size must be positive, got {kv_bytes_per_token} and {block_size}")
    in_use = total_bytes - free_after_load_bytes
    available = int(total_bytes * utilization) - in_use - reserve_bytes
    state_pool = state_bytes_per_slot * state_slots
    kv_bytes = available - state_pool
    num_blocks = max(kv_bytes, 0) // (kv_bytes_per_token * block_size)
    if num_blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"no KV cache fits: gpu_memory_utilization={utilization} of {total_bytes / gib:.2f} GiB leaves "
            f"{available / gib:.2f} GiB after {in_use / gib:.2f} GiB in use and a {reserve_bytes / gib:.2f} GiB reserve"
            + (f", and the state pool takes {state_pool / gib:.2f} GiB" if state_pool else "")
            + "; raise --gpu-memory-utilization or serve a smaller model"
        )
    return MemoryPlan(
        total_bytes, free_before_load_bytes, free_after_load_bytes, utilization, reserve_bytes, kv_bytes_per_token, block_size,
        state_bytes_per_slot, state_slots, state_pool, num_blocks * kv_bytes_per_token * block_size, num_blocks,
    )  # fmt: skip
