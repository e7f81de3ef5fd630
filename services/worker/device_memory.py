"""The device memory budget: after the weights load, how many KV blocks (and GDN state slots) fit.

The worker may use ``utilization × total`` bytes of the device. What is in use once the weights are
loaded (``total - free_after_load``: the weights, the CUDA context, and anything other processes hold)
is already spent. Then come one step's activations, measured rather than guessed: before the KV cache
exists, the runner runs one profile step at the largest step (``max_num_batched_tokens`` prompt tokens
over as many sequences as a step may hold, sampled) through scratch KV blocks and state slots, and the
allocator's peak minus what it held before (the weights) and the scratch is the activation peak
(``ActivationProfile``). The CUDA graphs' pool gets a fixed estimate when graphs are on. The rest holds
the GDN state pool first (one slot per running request, and the graphs' dummy slot) and then as many KV
blocks as fit. Pure arithmetic, so it is tested without a device, with injected numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple, Protocol

import torch

from shared.frames import SamplingParams, Slice

GRAPH_POOL_RESERVE = 512 << 20  # captured decode graphs' intermediates (one shared pool), and allocator slack


@dataclass(frozen=True)
class ActivationProfile:
    """One profile step's memory, as the caching allocator counted it (bytes)."""

    tokens: int
    sequences: int
    weights_bytes: int  # allocated before the profile: the weights (and anything else loading left)
    scratch_bytes: int  # the profile's own KV blocks and state slots, which are not activations
    peak_bytes: int  # max allocated during the step

    @property
    def activation_bytes(self) -> int:
        return max(self.peak_bytes - self.weights_bytes - self.scratch_bytes, 0)

    def describe(self) -> dict[str, Any]:
        return {**asdict(self), "activation_peak_bytes": self.activation_bytes}


class MemoryProbe(Protocol):
    """What the profile step reads off the allocator (``CudaMemoryProbe``; tests inject numbers)."""

    def allocated(self) -> int: ...

    def reset_peak(self) -> None: ...

    def peak(self) -> int: ...

    def release(self) -> None:
        """Hand cached, unused blocks back to the device, so free memory is read true afterwards."""
        ...


class CudaMemoryProbe:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class KVBudget:
    """How a runner sizes its KV cache once the weights are loaded: ``size(model, profile, state_slots)`` says
    how many KV blocks fit (graphs' dummy block included) beside ``state_slots`` GDN state slots. With
    ``profile_tokens`` > 0 (and no tensor parallelism: every rank would have to join the profile step) it
    first gets the ``ActivationProfile`` of one step of that many tokens, measured by ``probe`` (the CUDA
    allocator's by default)."""

    size: Callable[[Any, ActivationProfile | None, int], int]
    profile_tokens: int = 0
    probe: MemoryProbe | None = None


class ProfileStep(NamedTuple):
    """The profile step's slices and the scratch they run through."""

    slices: list[Slice]
    sequences: int
    blocks: int


def profile_step(tokens: int, max_num_seqs: int, block_size: int, vocab_size: int) -> ProfileStep:
    """One step at the largest a plan may be: ``tokens`` prompt tokens over as many sequences as a step may
    hold, every one sampled (top-k/top-p, so the sampler's buffers count), each sequence in its own blocks
    and state slot."""
    seqs = max(1, min(max_num_seqs, tokens))
    lens = [tokens // seqs + (i < tokens % seqs) for i in range(seqs)]
    blocks = [-(-n // block_size) for n in lens]
    first, slices = 0, []
    for i, n in enumerate(lens):
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=i)
        prompt = [(first + j) % vocab_size for j in range(n)]
        slices.append(Slice(f"__profile{i}__", 0, n, prompt, list(range(first, first + blocks[i])), sampling=params, slot=i))
        first += blocks[i]
    return ProfileStep(slices, seqs, sum(blocks))


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    free_before_load_bytes: int
    free_after_load_bytes: int
    utilization: float
    activation_peak_bytes: int  # measured: ``profile.activation_bytes``
    graph_pool_bytes: int  # estimated: GRAPH_POOL_RESERVE with graphs, else 0
    kv_bytes_per_token: int
    block_size: int
    state_bytes_per_slot: int
    state_slots: int
    state_pool_bytes: int
    kv_cache_bytes: int
    num_blocks: int
    profile: ActivationProfile | None = None

    @property
    def weights_bytes(self) -> int:
        """What loading took (the weights, and whatever else the load allocated)."""
        return self.free_before_load_bytes - self.free_after_load_bytes

    @property
    def reserve_bytes(self) -> int:
        return self.activation_peak_bytes + self.graph_pool_bytes

    def describe(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if k != "profile"}
        budget = int(self.total_bytes * self.utilization)
        return {
            **fields,
            "weights_bytes": self.weights_bytes,
            "in_use_after_load_bytes": self.total_bytes - self.free_after_load_bytes,
            "reserve_bytes": self.reserve_bytes,
            "budget_bytes": budget,
            "arithmetic": "budget (utilization × total) − in use after load − activation peak − graph pool − state pool = KV cache (+ remainder)",
            "activation_profile": None if self.profile is None else self.profile.describe(),
            "kv_cache_tokens": self.num_blocks * self.block_size,
        }


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
    profile: ActivationProfile | None,
    graph_pool_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    state_bytes_per_slot: int = 0,
    state_slots: int = 0,
) -> MemoryPlan:
    """Size the KV cache (and the state pool) from the budget; ``ValueError`` naming the flag when nothing fits.
    ``profile`` None: no activation peak was measured (nothing is kept back for it)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if kv_bytes_per_token <= 0 or block_size <= 0:
        raise ValueError(f"kv_bytes_per_token and block_size must be positive, got {kv_bytes_per_token} and {block_size}")
    activations = 0 if profile is None else profile.activation_bytes
    in_use = total_bytes - free_after_load_bytes
    available = int(total_bytes * utilization) - in_use - activations - graph_pool_bytes
    state_pool = state_bytes_per_slot * state_slots
    kv_bytes = available - state_pool
    num_blocks = max(kv_bytes, 0) // (kv_bytes_per_token * block_size)
    if num_blocks < 1:
        gib = 1 << 30
        raise ValueError(
            f"no KV cache fits: gpu_memory_utilization={utilization} of {total_bytes / gib:.2f} GiB leaves "
            f"{available / gib:.2f} GiB after {in_use / gib:.2f} GiB in use, a measured activation peak of "
            f"{activations / gib:.2f} GiB and a {graph_pool_bytes / gib:.2f} GiB graph pool"
            + (f", and the state pool takes {state_pool / gib:.2f} GiB" if state_pool else "")
            + "; raise --gpu-memory-utilization, lower --max-num-batched-tokens or serve a smaller model"
        )
    return MemoryPlan(
        total_bytes, free_before_load_bytes, free_after_load_bytes, utilization, activations, graph_pool_bytes, kv_bytes_per_token, block_size,
        state_bytes_per_slot, state_slots, state_pool, num_blocks * kv_bytes_per_token * block_size, num_blocks, profile,
    )  # fmt: skip
