"""The expert cache of a GPU worker (``--expert-cache-bytes`` on CUDA): every MoE layer's experts go to host memory
as that layer loads (pinned, so that a copy to the device runs at the bus's rate; the device then holds one layer's
at most while loading), and one bank of slots in device memory, shared by every MoE layer under the CPU worker's
replacement policies (``expert_cache.SlotLRU`` / ``SlotLFU``), holds the experts the steps route to.

A layer-step reads its routing on the host, keeps its hits, copies its misses into their slots (on the step's
stream, so that a copy never overtakes a kernel still reading the slot it refills), and runs the layer's kernel
(the fused Triton MoE) over the bank with each expert's slot (``expert_slots``): the same bits as resident. A step whose tokens route
to more experts than the bank holds runs in groups of consecutive tokens that fit.

Co-execution (``--expert-cache-cpu-experts auto``, FreeToken's bandwidth-adaptive execution): a missed expert that
few of the step's tokens route to may run on the CPU from host memory instead of being copied, while the device
runs the others: ``CoExecution`` compares the copy (the expert's bytes at the measured copy rate) with the CPU's
products (its bytes once per token at the measured CPU rate). Such an expert takes no slot; its pairs run on the
device against the bank's last slot, which holds zeros (their output is exactly 0), and the CPU's weighted sum is
added to the layer's output. The CPU computes in fp32 from the host weights, so its share is rounded differently
from the device kernel's: ``off`` keeps every step's bits those of all experts resident.

Each step reads its routing on the host, so decode steps run eagerly (no CUDA graphs) on such a worker.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from prometheus_client import Counter

from services.worker.expert_cache import (
    BYTES_READ,
    EVICTIONS,
    HITS,
    MISSES,
    POLICIES,
    SLOTS_TOTAL,
    SLOTS_USED,
    Fill,
    SlotPolicy,
    cache_bytes,
    cached_moe_shape,
    expert_cache_on,
    refuse_unserved,
    token_groups,
)
from services.worker.moe import ExpertsFn, routed_experts
from shared.choices import EXPERT_CACHE_CPU_EXPERTS
from shared.metrics import PREFIX

CPU_EXPERTS = Counter(f"{PREFIX}expert_cache_cpu_experts", "Missed experts a GPU worker's layer-step ran on the CPU instead of copying them")
RATE_WEIGHT = 0.25  # the newest measurement's weight in the rates' moving averages
PROBES = 3  # timed rounds of each rate's probe at start


class CoExecution:
    """Where a missed expert runs: copied to the device (``copy_rate`` bytes/s) or computed on the CPU from host memory
    (``cpu_rate``: bytes of an expert's weights a token goes through per second). The CPU reads an expert once per token
    routed to it (a few rows: products bound by the weights' reads), so ``tokens`` tokens run on the CPU where
    ``tokens · bytes / cpu_rate < bytes / copy_rate``, i.e. below ``cpu_rate / copy_rate`` tokens, whatever the size."""

    def __init__(self, copy_rate: float, cpu_rate: float) -> None:
        if copy_rate <= 0 or cpu_rate <= 0:
            raise ValueError(f"rates must be positive: copy {copy_rate}, cpu {cpu_rate} bytes/s")
        self.copy_rate, self.cpu_rate = float(copy_rate), float(cpu_rate)

    def runs_on_cpu(self, tokens: int) -> bool:
        return tokens * self.copy_rate < self.cpu_rate

    @property
    def most_cpu_tokens(self) -> int:
        """The most tokens an expert may have and still run on the CPU (0: none does)."""
        return max(0, -(-int(self.cpu_rate) // int(max(self.copy_rate, 1))) - 1)

    def copied(self, nbytes: int, seconds: float) -> None:
        self.copy_rate += RATE_WEIGHT * (nbytes / max(seconds, 1e-9) - self.copy_rate)

    def computed(self, token_bytes: int, seconds: float) -> None:
        """The CPU ran ``token_bytes`` (tokens × expert bytes) in ``seconds``."""
        self.cpu_rate += RATE_WEIGHT * (token_bytes / max(seconds, 1e-9) - self.cpu_rate)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory, page-locked where a CUDA device is there to copy it."""
    host = t.detach().to("cpu").contiguous()
    return host.pin_memory() if torch.cuda.is_available() else host


class DeviceExpertCache:
    """A bank of ``slots`` experts on ``device`` (``gate_up`` [S + 1, 2I, H], ``down`` [S + 1, H, I], slot S all zeros) over
    ``layers``' experts in host memory (each MoE layer's (gate_up [E, 2I, H], down [E, H, I])), under replacement
    ``policy``; ``cpu``: the co-execution rule (None: every miss is copied)."""

    def __init__(
        self, layers: list[tuple[torch.Tensor, torch.Tensor]], slots: int, top_k: int, budget: int, device: torch.device, policy: str = "lfu",
        cpu: CoExecution | None = None,
    ) -> None:  # fmt: skip
        if slots < top_k:
            raise ValueError(f"the expert cache holds {slots} experts, fewer than one layer's top-k ({top_k})")
        gate_up, down = layers[0]
        self.host, self.device, self.top_k, self.budget, self.cpu = layers, device, top_k, budget, cpu
        self.num_layers, self.num_experts = len(layers), gate_up.shape[0]
        self.expert_bytes = gate_up[0].nbytes + down[0].nbytes
        self.gate_up = torch.zeros((slots + 1, *gate_up.shape[1:]), dtype=gate_up.dtype, device=device)
        self.down = torch.zeros((slots + 1, *down.shape[1:]), dtype=down.dtype, device=device)
        self.zero_slot = slots
        self.policy: SlotPolicy = POLICIES[policy](slots)
        self.slot_of = [np.full(self.num_experts, -1, dtype=np.int64) for _ in layers]
        self.hits = self.misses = self.evictions = self.bytes_copied = 0
        self.cpu_expert_steps = self.cpu_pairs = 0  # experts (per layer-step) and (token, expert) pairs run on the CPU
        self._copy_timing: tuple[Any, Any, int] | None = None  # (start, end event, bytes) of the last copies timed on a GPU
        SLOTS_TOTAL.set(slots)
        SLOTS_USED.set(0)

    @classmethod
    def measured(
        cls, layers: list[tuple[torch.Tensor, torch.Tensor]], slots: int, top_k: int, budget: int, device: torch.device, policy: str, cpu_experts: str
    ) -> DeviceExpertCache:
        """A cache whose co-execution rule (``cpu_experts`` auto) starts from rates probed here: one expert copied into
        slot 0 (zeroed again: nothing is held yet), and one token through one expert on the CPU."""
        cache = cls(layers, slots, top_k, budget, device, policy)
        if cpu_experts == "auto":
            cache.cpu = CoExecution(cache._probe_copy(), cache._probe_cpu())
        return cache

    def _probe_copy(self) -> float:
        gate_up, down = self.host[0]
        seconds = []
        for _ in range(PROBES):
            _synchronize(self.device)
            began = time.perf_counter()
            self.gate_up[0].copy_(gate_up[0], non_blocking=True)
            self.down[0].copy_(down[0], non_blocking=True)
            _synchronize(self.device)
            seconds.append(time.perf_counter() - began)
        self.gate_up[0].zero_()
        self.down[0].zero_()
        return self.expert_bytes / min(seconds)

    def _probe_cpu(self) -> float:
        gate_up, down = self.host[0]
        x, weights, ids = torch.zeros(1, gate_up.shape[2], dtype=gate_up.dtype), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long)
        seconds = []
        for _ in range(PROBES):
            began = time.perf_counter()
            _cpu_products(x, gate_up, down, weights, ids)
            seconds.append(time.perf_counter() - began)
        return self.expert_bytes / min(seconds)

    @property
    def slots(self) -> int:
        return self.policy.slots

    @property
    def slot_bytes(self) -> int:
        return self.expert_bytes

    @property
    def experts(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def run(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor | None, kernel: ExpertsFn) -> torch.Tensor:
        """``kernel``'s contract (``moe.experts_torch``) for MoE layer ``layer`` over the bank: ``residual`` + each token's
        weighted experts."""
        routed = ids.to("cpu").numpy()  # the layer's one wait on the device
        groups = list(self._groups(routed))
        if len(groups) == 1:
            return self._run_group(layer, x, weights, ids, routed, residual, kernel)
        out = torch.zeros_like(x) if residual is None else residual.clone()
        for rows in groups:
            out[rows] = self._run_group(layer, x[rows], weights[rows], ids[rows], routed[rows], out[rows], kernel)
        return out

    def _groups(self, routed: np.ndarray) -> Iterator[slice]:
        """Consecutive tokens whose experts fit the bank at once (one group when the step does)."""
        if len(np.unique(routed)) <= self.slots:
            yield slice(0, routed.shape[0])
            return
        yield from token_groups(routed.tolist(), self.slots)

    def _run_group(
        self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, routed: np.ndarray, residual: torch.Tensor | None, kernel: ExpertsFn
    ) -> torch.Tensor:
        counts = np.bincount(routed.ravel(), minlength=self.num_experts)
        experts = np.flatnonzero(counts)
        slot_of = self.slot_of[layer]
        on_cpu: list[int] = []
        if self.cpu is not None:
            on_cpu = [e for e in experts[slot_of[experts] < 0].tolist() if self.cpu.runs_on_cpu(int(counts[e]))]
        pairs = self._cpu_pairs(on_cpu, x, weights, routed) if on_cpu else None  # read back before copies are queued
        hits, fills = self.policy.take(layer, sorted(set(experts.tolist()) - set(on_cpu)))
        self._fill(layer, fills)
        call_slots = slot_of.astype(np.int32)
        call_slots[on_cpu] = self.zero_slot  # their pairs run against zeros here: the CPU adds theirs
        slots = torch.from_numpy(call_slots).to(self.device)
        out = kernel(x.contiguous(), self.gate_up, self.down, weights, ids, None if residual is None else residual.contiguous(), expert_slots=slots)
        if pairs is not None:  # computed while the device copies and runs the kernel
            out = self._add_cpu_products(layer, len(on_cpu), pairs, out)
        self.hits += len(hits)
        HITS.inc(len(hits))
        return out

    def _fill(self, layer: int, fills: list[Fill]) -> None:
        if not fills:
            return
        gate_up, down = self.host[layer]
        self._harvest_copy_time()
        timed = self.cpu is not None and self.device.type == "cuda"
        if timed:  # timed by events, read once done: waiting for the copies here would stall the CPU's share
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        for expert, slot, evicted in fills:
            if evicted is not None:
                self.slot_of[evicted[0]][evicted[1]] = -1
            self.gate_up[slot].copy_(gate_up[expert], non_blocking=True)
            self.down[slot].copy_(down[expert], non_blocking=True)
            self.slot_of[layer][expert] = slot
        nbytes, evictions = len(fills) * self.expert_bytes, sum(fill.evicted is not None for fill in fills)
        if timed:
            end.record()
            self._copy_timing = (start, end, nbytes)
        elif self.cpu is not None:  # a device whose copies are done when they return
            self.cpu.copied(nbytes, time.perf_counter() - began)
        self.misses += len(fills)
        self.evictions += evictions
        self.bytes_copied += nbytes
        MISSES.inc(len(fills))
        EVICTIONS.inc(evictions)
        BYTES_READ.inc(nbytes)
        SLOTS_USED.set(len(self.policy.held))

    def _harvest_copy_time(self) -> None:
        """The last timed copies' rate, into the co-execution rule, once the device has done them."""
        if self._copy_timing is not None and self._copy_timing[1].query():
            start, end, nbytes = self._copy_timing
            self.cpu.copied(nbytes, start.elapsed_time(end) / 1e3)
            self._copy_timing = None

    def _cpu_pairs(self, experts: list[int], x: torch.Tensor, weights: torch.Tensor, routed: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The (token, expert) pairs of ``experts`` on the host: (tokens, x rows, routing weights, expert ids)."""
        tokens, choices = np.nonzero(np.isin(routed, experts))
        token_ids = torch.from_numpy(tokens)
        pairs_x = x.index_select(0, token_ids.to(x.device)).to("cpu")
        pair_weights = weights[token_ids.to(weights.device), torch.from_numpy(choices).to(weights.device)].to("cpu").float()[:, None]
        return token_ids, pairs_x, pair_weights, torch.from_numpy(routed[tokens, choices]).long()[:, None]

    def _add_cpu_products(self, layer: int, experts: int, pairs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the weighted products of the ``pairs`` (of ``experts`` experts), run on the CPU from host memory."""
        token_ids, pairs_x, pair_weights, pair_ids = pairs
        began = time.perf_counter()
        gate_up, down = self.host[layer]
        products = _cpu_products(pairs_x, gate_up, down, pair_weights, pair_ids)
        self.cpu.computed(len(token_ids) * self.expert_bytes, time.perf_counter() - began)
        self.cpu_expert_steps += experts
        self.cpu_pairs += len(token_ids)
        CPU_EXPERTS.inc(experts)
        return out.index_add(0, token_ids.to(out.device), products.to(out.device, out.dtype))

    def describe(self) -> dict[str, Any]:
        """The cache's configuration, hit rate and co-execution, for /instrumentation."""
        lookups = self.hits + self.misses + self.cpu_expert_steps
        cpu = self.cpu
        return {
            "device": str(self.device),
            "bytes": self.budget,
            "slots": self.slots,
            "slots_used": len(self.policy.held),
            "slot_bytes": self.expert_bytes,
            "bank_bytes": self.nbytes,
            "experts": self.experts,
            "store": "host memory (pinned)" if torch.cuda.is_available() else "host memory",
            "policy": self.policy.name,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes_copied": self.bytes_copied,
            "hit_rate": round(self.hits / lookups, 4) if lookups else None,
            "cpu_experts": "off"
            if cpu is None
            else {
                "copy_bytes_per_s": round(cpu.copy_rate),
                "cpu_bytes_per_s": round(cpu.cpu_rate),
                "most_tokens_on_cpu": cpu.most_cpu_tokens,
                "expert_layer_steps": self.cpu_expert_steps,
                "pairs": self.cpu_pairs,
            },
        }


def _cpu_products(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` [P, H] through its one expert ``ids`` [P, 1] of the host stacks, times ``weights`` [P, 1], in fp32."""
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
    inter = down.shape[2]
    for expert in ids[:, 0].unique().tolist():
        rows = (ids[:, 0] == expert).nonzero()[:, 0]
        h = x.index_select(0, rows).float() @ gate_up[expert].float().T
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_copy_(0, rows, (act @ down[expert].float().T) * weights.index_select(0, rows))
    return out


class DeviceExpertSpill:
    """A GPU worker's expert cache planned before its weights load: each MoE layer's float experts go to host memory as
    that layer is built (``hold``, through ``moe.EXPERT_SINK``) and ``attach`` runs the MoE layers from a bank over them."""

    on_device = True

    def __init__(self, spec: str, policy: str, cpu_experts: str, device: torch.device) -> None:
        self.spec, self.policy, self.cpu_experts, self.device = spec, policy, cpu_experts, device
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_layers = self.top_k = 0

    @classmethod
    def plan(cls, spec: str, policy: str, cpu_experts: str, device: torch.device, sharded: bool) -> DeviceExpertSpill | None:
        """The spill of ``spec`` (``cache_bytes``) on a GPU ``device``; None where ``spec`` is 0 (all resident)."""
        if not expert_cache_on(spec):
            return None
        refuse_unserved(sharded, policy)
        if cpu_experts not in EXPERT_CACHE_CPU_EXPERTS:
            raise ValueError(f"--expert-cache-cpu-experts is one of {', '.join(EXPERT_CACHE_CPU_EXPERTS)}, not {cpu_experts!r}")
        return cls(spec, policy, cpu_experts, device)

    def begin(self, config: dict[str, Any]) -> None:
        self.num_layers, self.top_k = cached_moe_shape(config)

    def hold(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """The next MoE layer's float experts, into host memory."""
        self.layers.append((_pinned(gate_up), _pinned(down)))

    def attach(self, model: object) -> DeviceExpertCache:
        layers = routed_experts(model)
        if not layers or len(layers) != len(self.layers) or len(layers) != self.num_layers:
            raise ValueError(
                f"the model has {len(layers)} MoE layers where its config says {self.num_layers} and {len(self.layers)} held their experts in host memory"
            )
        gate_up, down = self.layers[0]
        expert_bytes, experts = gate_up[0].nbytes + down[0].nbytes, gate_up.shape[0] * len(self.layers)
        budget = cache_bytes(self.spec, expert_bytes * experts)
        if (slots := min(budget // expert_bytes, experts)) < self.top_k:
            raise ValueError(
                f"--expert-cache-bytes {self.spec} holds {slots} experts of {expert_bytes} bytes, fewer than one layer's top-k ({self.top_k}): "
                f"give at least {self.top_k * expert_bytes}"
            )
        cache = DeviceExpertCache.measured(self.layers, slots, self.top_k, budget, self.device, self.policy, self.cpu_experts)
        for layer, moe in enumerate(layers):
            moe.experts_from_device_cache(cache, layer)
        return cache
