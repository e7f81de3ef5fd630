"""The bounded expert cache of a CPU worker (``--expert-cache-bytes``): a MoE model's experts in blocks are
written once, at load, to a spill file (``ExpertStore``), each layer's as that layer is built (``ExpertSpill``), so
that loading never holds the whole model's; and one bank of slots in RAM, shared by every MoE
layer under one replacement policy (``--expert-cache-policy``: ``SlotLRU`` or the scan-resistant ``SlotLFU``), holds
the experts that the steps route to.

A slot is laid out as a store record (gate_up panels, then down panels, zero padding to a page), so a miss is
one read of its whole record straight into its slot, with O_DIRECT where the filesystem allows it; the kernel
sees the bank's gate_up and down as views a slot's size apart. A layer-step learns its routed ids from the
grouped kernel's own routing (``route_experts``), fills all of its misses from the store (its runs of adjacent
records read side by side), then runs its grouped call over the bank (``csrc/grouped_moe.cpp`` with
``expert_slots``): the same bits as with every expert resident. Where the store reads by native AIO, the fills run
in C++ (``csrc/expert_bank.cpp``: the one-call decoder's without a call into Python), choosing victims as the
policy does, and the policy hears of every layer-step afterwards, in order. A step whose tokens route to more experts than
the bank holds runs in groups of consecutive tokens that fit (a token's bits do not depend on the other tokens
of its call), so any bank of at least one layer's top-k slots serves any step. A long step may instead stream
every layer whole through two layers of lent slots (``LayerStream``, ``--expert-cache-fill``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import shutil
import tempfile
import time
import weakref
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from prometheus_client import Counter, Gauge, Histogram

from services.worker.cpu_kernels import cpu_kernels
from services.worker.expert_reads import AioReads, StoreReads
from services.worker.moe import BLOCKS_NEEDED, ExpertPanels, SharedExpertMoE, SparseMoE, routed_experts
from shared.choices import EXPERT_CACHE_FILLS, EXPERT_CACHE_POLICIES, EXPERT_CACHE_PREFETCH, keyed_by
from shared.metrics import PREFIX

FAMILIES = ("qwen3_moe", "qwen3_next")
STREAM_MIN_TOKENS = 2  # a one-token step reads its top-k experts at most: never a whole layer
# auto streams steps of this many tokens or more only: a decode batch's few misses stay on demand (lending two layers'
# slots step after step would empty a small bank of the experts its decodes hit)
AUTO_STREAM_MIN_TOKENS = 16
# steps of more tokens read no experts ahead: their misses keep the storage busy and the guesses' extra bytes cost more
# than the overlap gains (a cache of 25 %, one process taking turns: 2 streams 42.0 against 36.8 ms a step without, 4
# streams 66.8 against 56.0, 8 streams 86.0 against 75.1; one stream at 50 % gains 9-20 %)
READ_AHEAD_MAX_TOKENS = 1
EXPLORE_EVERY = 8  # auto: after this many steps the rule kept on demand, one streams anyway, so that both rates stay measured
COMPUTE_MIN_TOKENS = 16  # layer calls of this many tokens or more measure the experts' compute per token (what a streamed read overlaps)
RATE_WEIGHT = 0.25  # the newest measurement's weight in the fill rule's moving averages
READ_MOST = 256  # records one read takes at most: a buffer each, and IOV_MAX is 1024
ALIGN = 4096  # records and slots start on page boundaries, so that O_DIRECT reads land straight in a slot

HITS = Counter(f"{PREFIX}expert_cache_hits", "Routed experts a layer-step found in the expert cache's slots")
MISSES = Counter(f"{PREFIX}expert_cache_misses", "Routed experts a layer-step read from the expert store into a slot")
EVICTIONS = Counter(f"{PREFIX}expert_cache_evictions", "Experts evicted from the expert cache's slots")
BYTES_READ = Counter(f"{PREFIX}expert_cache_bytes_read", "Bytes read from the expert store into the expert cache's slots")
FILL_TIME = Histogram(
    f"{PREFIX}expert_cache_fill_seconds",
    "Time a layer-step spent filling its misses from the expert store",
    buckets=(1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0),
)
LAYER_STEPS = Counter(f"{PREFIX}expert_cache_layer_steps", "MoE layer-steps run from the expert cache, by how they read their experts", ["fill"])
LAYER_STEPS_BY_FILL = {fill: LAYER_STEPS.labels(fill) for fill in ("on-demand", "streamed")}  # both series from the start, at 0
PREFETCHES = Counter(
    f"{PREFIX}expert_cache_prefetches", "Experts read ahead of their layer-step from a predicted routing, by whether it routed to them", ["outcome"]
)
PREFETCHES_BY_OUTCOME = {outcome: PREFETCHES.labels(outcome) for outcome in ("used", "unused")}
SLOTS_USED = Gauge(f"{PREFIX}expert_cache_slots_used", "Expert cache slots holding an expert")
SLOTS_TOTAL = Gauge(f"{PREFIX}expert_cache_slots_total", "Expert cache slots")


def cache_bytes(spec: str, experts_bytes: int) -> int:
    """``--expert-cache-bytes``: a byte count, or a percentage of the experts' size (``25%``)."""
    text = spec.strip()
    try:
        if text.endswith("%"):
            if 0 <= (percent := float(text[:-1])) <= 100:
                return int(experts_bytes * percent / 100)
        elif int(text) >= 0:
            return int(text)
    except ValueError:
        pass
    raise ValueError(f"--expert-cache-bytes takes bytes or a percentage (0% to 100%) of the experts' size, such as 25%; got {spec!r}")


def expert_cache_on(spec: str) -> bool:
    """Whether ``--expert-cache-bytes`` asks for a cache (not 0 or 0 %)."""
    return cache_bytes(spec, 1 << 60) > 0


def default_store_dir() -> str:
    """Where a worker writes its expert store unless ``--expert-cache-dir`` says: the user's cache directory
    (a disk, where the temporary directory may be memory)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenyard", "experts")


def padded(nbytes: int) -> int:
    """A record's (and a slot's) size: ``nbytes`` of panels rounded up to ``ALIGN``."""
    return -(-nbytes // ALIGN) * ALIGN


def _open_direct(path: str) -> int:
    """A descriptor that reads ``path`` bypassing the page cache (OSError where the filesystem refuses)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECT)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Anonymous, page-aligned memory (O_DIRECT's buffers must be aligned), touched only when written; in huge pages
    where the kernel gives them on request (a direct read pins each page of its buffers when it is queued: 4 KiB
    pages make that half of a record read's submit cost)."""
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory takes no huge pages here
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


class ExpertStore:
    """Every MoE layer's experts as fixed-size records of one spill file, record ``layer * E + expert`` at
    ``record`` bytes times that: its gate_up panels, then its down panels, zero-padded to ``ALIGN``.

    A store is created empty with its record layout (``empty``: the first layer's formats and shapes, and how
    many layers), written a layer at a time as the model loads (``append``), then ``seal``ed for reads. The file
    is unlinked once open (it lives as long as the worker); whole records are read into page-aligned slots of
    ``record`` bytes, bypassing the page cache (O_DIRECT) where the filesystem allows, else each read is
    followed by ``POSIX_FADV_DONTNEED`` so that the page cache does not quietly keep the whole model
    (``read_mode`` says which, and why)."""

    def __init__(self, directory: str, layers: list[ExpertPanels]) -> None:
        """A sealed store of ``layers``' experts."""
        self._create(directory, layers[0], len(layers))
        for panels in layers:
            self.append(panels)
        self.seal()

    @classmethod
    def empty(cls, directory: str, first: ExpertPanels, layers: int) -> ExpertStore:
        """A store of ``layers`` MoE layers laid out as ``first``'s experts, to ``append`` them to in layer order."""
        store = cls.__new__(cls)
        store._create(directory, first, layers)
        return store

    def _create(self, directory: str, first: ExpertPanels, layers: int) -> None:
        self.formats = first.formats
        self.num_layers, self.num_experts = layers, first.gate_up.shape[0]
        self.gate_up_shape, self.down_shape = tuple(first.gate_up.shape[1:]), tuple(first.down.shape[1:])
        self.gate_up_bytes, self.down_bytes = first.gate_up[0].nbytes, first.down[0].nbytes
        self.record = padded(self.gate_up_bytes + self.down_bytes)
        self.written, self.read_mode, self.direct = 0, "", False  # read_mode and direct: once sealed
        os.makedirs(directory, exist_ok=True)
        if (free := shutil.disk_usage(directory).free) < self.nbytes:
            raise ValueError(f"the expert store needs {self.nbytes} bytes in {directory}, which has {free} free: give --expert-cache-dir a larger disk")
        self._fds: list[int] = []  # closed with the store
        weakref.finalize(self, _close_all, self._fds)
        fd, self.path = tempfile.mkstemp(prefix="experts-", suffix=".bin", dir=directory)
        self._fds.append(fd)
        self.fd = fd
        self._direct: int | None = None  # an O_DIRECT descriptor, opened while the file has a name, tried at seal
        self._buffered_why = ""  # why reads go through the page cache, where they do
        try:
            self._direct = _open_direct(self.path)
            self._fds.append(self._direct)
        except (OSError, AttributeError) as exc:
            self._buffered_why = f"buffered + DONTNEED (this filesystem refuses O_DIRECT: {exc})"
        finally:
            os.unlink(self.path)

    @property
    def layout(self) -> tuple[tuple[str, str], tuple[int, ...], tuple[int, ...]]:
        """The formats and [E, ...] shapes of gate_up and down that every layer's experts must have."""
        return self.formats, (self.num_experts, *self.gate_up_shape), (self.num_experts, *self.down_shape)

    @property
    def nbytes(self) -> int:
        return self.record * self.num_layers * self.num_experts

    def offset(self, layer: int, expert: int) -> int:
        return (layer * self.num_experts + expert) * self.record

    def append(self, panels: ExpertPanels) -> None:
        """Writes the next MoE layer's experts, laid out as the first's (ValueError otherwise, or past the last layer)."""
        layout = (panels.formats, tuple(panels.gate_up.shape), tuple(panels.down.shape))
        if layout != self.layout:
            raise ValueError(f"--expert-cache-bytes needs every MoE layer's experts in one format and shape, got {sorted({self.layout, layout})}")
        if self.written == self.num_layers:
            raise ValueError(f"the expert store holds {self.num_layers} MoE layers: no more are written to it")
        pad = bytes(self.record - self.gate_up_bytes - self.down_bytes)
        for expert in range(self.num_experts):
            parts = [memoryview(t[expert].numpy()).cast("B") for t in (panels.gate_up, panels.down)]
            os.pwritev(self.fd, [*parts, pad], self.offset(self.written, expert))
        self.written += 1

    def seal(self) -> None:
        """Every layer written: from now on the store is read (O_DIRECT where one read of a record into a page-aligned slot succeeds)."""
        if self.written != self.num_layers:
            raise ValueError(f"the expert store was written {self.written} of its {self.num_layers} MoE layers")
        os.fsync(self.fd)  # dirty pages would stay in the page cache whatever DONTNEED says
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if self._direct is not None:
            try:
                if os.preadv(self._direct, [aligned_buffer(self.record)], 0) != self.record:
                    raise OSError("a short read")
            except OSError as exc:
                self._buffered_why = f"buffered + DONTNEED (O_DIRECT reads fail here: {exc})"
        self.read_mode, self.direct = self._buffered_why or "O_DIRECT", not self._buffered_why
        keep, drop = (self._direct, self.fd) if self.direct else (self.fd, self._direct)
        if drop is not None:
            self._fds.remove(drop)
            os.close(drop)
        self.fd = keep

    def read_into(self, layer: int, first: int, slots: list[memoryview]) -> int:
        """Reads the whole records of ``layer``'s experts ``first``, ``first + 1``, ... into their slots (page-aligned
        buffers of ``record`` bytes), in one call: adjacent records are one contiguous read. Returns the bytes read."""
        offset, size = self.offset(layer, first), len(slots) * self.record
        read = os.preadv(self.fd, slots, offset)
        if read != size:
            raise OSError(f"the expert store {self.path} gave {read} of {size} bytes of layer {layer}'s experts {first}..{first + len(slots) - 1}")
        if not self.direct:
            os.posix_fadvise(self.fd, offset, size, os.POSIX_FADV_DONTNEED)
        return size


class Fill(NamedTuple):
    expert: int
    slot: int
    evicted: tuple[int, int] | None  # the (layer, expert) the slot held


Claim = tuple[int, int, int, int]  # an ExpertBank's fill: (expert, slot, evicted layer, evicted expert; -1, -1: a free slot)


class SlotPolicy(ABC):
    """Which (layer, expert) each of ``slots`` slots holds (``held``; ``free``: the empty slots), and which to evict.

    ``take`` gives one layer-step's experts their slots: hits keep theirs, misses take a free slot or evict a
    victim of the policy's choosing; it never evicts an expert of the same call, so no slot that a layer-step
    reads is refilled before the step has run (at most ``slots`` experts per call). ``reserve`` gives slots to
    experts read ahead of their layer-step, as the least worth keeping until a layer-step uses them."""

    name: ClassVar[str]

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.held: dict[tuple[int, int], int] = {}
        self.free = list(range(slots - 1, -1, -1))

    @abstractmethod
    def take(self, layer: int, experts: Iterable[int]) -> tuple[dict[int, int], list[Fill]]:
        """(the hits' slots, the misses' fills) of ``layer``'s ``experts``."""

    @abstractmethod
    def reserve(self, layer: int, experts: list[int], keep: Collection[int]) -> list[Fill]:
        """Slots for as many of ``layer``'s ``experts`` (none held) as fit without evicting a slot in ``keep`` (the
        layer-step's about to run, reads in flight), held as the least worth keeping and counted as no use: an expert
        read ahead that no layer-step routes to goes first."""

    def touch(self, layer: int, experts: list[int]) -> None:
        """A layer-step of ``layer``'s ``experts`` (distinct, ascending), every one held: ``take`` without misses."""
        hits, fills = self.take(layer, experts)
        assert not fills, f"layer {layer}'s experts {experts} ran from the bank, but the policy does not hold them all"

    USES_FROM_BANK: ClassVar[bool] = False  # whether a led ExpertBank keeps the uses (``uses_from``): then only its claims are replayed

    def lead(self, bank: Any) -> None:
        """An ``ExpertBank`` whose fills this step choose as this policy would, from its state as it stands (LRU's order)."""
        bank.begin(self.free, [self.held[key] for key in self.ranked()])

    def uses_from(self, bank: Any) -> None:
        """Takes the uses a led ``bank`` kept (where ``USES_FROM_BANK``)."""
        raise NotImplementedError(f"the {self.name} policy hears of every use in its replay")

    @abstractmethod
    def commit(self, layer: int, experts: list[int], fills: list[Claim], ahead_layer: int, reserved: list[Claim], uses: bool = True) -> None:
        """A layer-step that the ``ExpertBank`` filled: ``layer``'s ``experts`` (ascending) all held now, ``fills`` the slots
        its misses took and ``reserved`` those ``ahead_layer``'s experts read ahead took, each (expert, slot, evicted
        layer, evicted expert) with -1, -1 for a free slot; as ``take`` then ``reserve`` would have left the policy
        (``uses`` False: but for the uses, which the bank kept: ``uses_from``)."""

    def _claim(self, slot: int, evicted_layer: int, evicted_expert: int) -> None:
        """``slot`` given to another expert: out of the free ones, or its expert evicted."""
        if evicted_layer < 0:
            self.free.remove(slot)
        else:
            del self.held[(evicted_layer, evicted_expert)]

    @abstractmethod
    def ranked(self) -> list[tuple[int, int]]:
        """The held (layer, expert) keys, least worth keeping first."""

    def drop(self, key: tuple[int, int]) -> None:
        """Frees ``key``'s slot (a fill that failed)."""
        self.free.append(self.held.pop(key))

    def lend(self, n: int) -> tuple[list[int], list[tuple[int, int]]]:
        """``n`` slots out of the policy's hands until ``give_back`` (a streamed step's): the free ones first, then those
        of the experts least worth keeping, evicted; and the evicted (layer, expert) keys. No ``take`` may run meanwhile."""
        slots = [self.free.pop() for _ in range(min(n, len(self.free)))]
        evicted = self.ranked()[: n - len(slots)]
        for key in evicted:
            self.drop(key)
            slots.append(self.free.pop())
        return slots, evicted

    def give_back(self, slots: list[int]) -> None:
        self.free.extend(slots)

    def rebuilt(self, slots: int) -> tuple[SlotPolicy, dict[int, int]]:
        """A policy of the same kind over ``slots`` new slots holding the experts most worth keeping that fit, in
        slots 0, 1, ..., and each kept expert's old slot -> new slot."""
        new = type(self)(slots)
        kept = self.ranked()[-slots:]
        for slot, key in enumerate(kept):
            new.held[key] = slot
        new.free = list(range(slots - 1, len(kept) - 1, -1))
        return new, {self.held[key]: slot for slot, key in enumerate(kept)}

    @staticmethod
    def _wanted(experts: Iterable[int], slots: int) -> list[int]:
        wanted = list(dict.fromkeys(experts))
        if len(wanted) > slots:
            raise ValueError(f"a layer-step of {len(wanted)} experts does not fit {slots} slots")
        return wanted


class SlotLRU(SlotPolicy):
    """Evicts the least recently used expert (``held`` is in order of use, least recent first)."""

    name = "lru"

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.held: OrderedDict[tuple[int, int], int] = OrderedDict()

    def take(self, layer: int, experts: Iterable[int]) -> tuple[dict[int, int], list[Fill]]:
        wanted = self._wanted(experts, self.slots)
        hits = {}
        for expert in wanted:
            if (slot := self.held.get((layer, expert))) is not None:
                self.held.move_to_end((layer, expert))
                hits[expert] = slot
        fills = []
        for expert in wanted:
            if expert in hits:
                continue
            evicted, slot = (None, self.free.pop()) if self.free else self.held.popitem(last=False)
            self.held[(layer, expert)] = slot
            fills.append(Fill(expert, slot, evicted))
        return hits, fills

    def reserve(self, layer: int, experts: list[int], keep: Collection[int]) -> list[Fill]:
        fills, kept = [], set(keep)
        for expert in experts:
            if self.free:
                evicted, slot = None, self.free.pop()
            elif (victim := next((key for key, slot in self.held.items() if slot not in kept), None)) is not None:
                evicted, slot = victim, self.held.pop(victim)
            else:
                break
            self.held[(layer, expert)] = slot
            self.held.move_to_end((layer, expert), last=False)  # least recently used: the first to go unless a layer-step uses it
            kept.add(slot)
            fills.append(Fill(expert, slot, evicted))
        return fills

    def touch(self, layer: int, experts: list[int]) -> None:
        for expert in experts:
            self.held.move_to_end((layer, expert))  # KeyError: not held

    def commit(self, layer: int, experts: list[int], fills: list[Claim], ahead_layer: int, reserved: list[Claim], uses: bool = True) -> None:
        filled = {claim[0] for claim in fills}  # LRU's uses are its order: always replayed
        for expert in experts:
            if expert not in filled:
                self.held.move_to_end((layer, expert))
        for expert, slot, *evicted in fills:
            self._claim(slot, *evicted)
            self.held[(layer, expert)] = slot
        for expert, slot, *evicted in reserved:
            self._claim(slot, *evicted)
            self.held[(ahead_layer, expert)] = slot
            self.held.move_to_end((ahead_layer, expert), last=False)

    def ranked(self) -> list[tuple[int, int]]:
        return list(self.held)


class SlotLFU(SlotPolicy):
    """Evicts the expert with the fewest recent uses, ties to the most recently used: scan resistant.

    A slot's count grows by one for each layer-step that routes to its expert and every count is halved each
    fourth pass over the layers (a layer-step of a layer no higher than the one before starts a pass), so counts
    weigh the last few steps and a shift in routing is followed within a few. When a step touches more
    experts than the bank holds, in the same order every step, a least-recently-used bank evicts exactly the
    expert needed soonest and never hits; here the experts that stayed gather counts that the newcomers (one
    use) do not reach, the newcomers replace each other, and about slots / working set of the lookups hit."""

    name = "lfu"
    AGING_PASSES = 4
    NEVER = np.iinfo(np.int64).max

    def __init__(self, slots: int) -> None:
        super().__init__(slots)
        self.key_of: list[tuple[int, int] | None] = [None] * slots
        self.count = np.zeros(slots, dtype=np.int64)
        self.last = np.zeros(slots, dtype=np.int64)  # the layer-step that last read the slot
        self.step = self.layer = self.passes = 0

    def _next_step(self, layer: int) -> None:
        if layer <= self.layer:
            self.passes += 1
            if self.passes % self.AGING_PASSES == 0:
                self.count >>= 1
        self.layer, self.step = layer, self.step + 1

    def touch(self, layer: int, experts: list[int]) -> None:
        read = [self.held[(layer, e)] for e in experts]  # KeyError: not held
        self._next_step(layer)
        self.count[read] += 1
        self.last[read] = self.step

    def take(self, layer: int, experts: Iterable[int]) -> tuple[dict[int, int], list[Fill]]:
        wanted = self._wanted(experts, self.slots)
        self._next_step(layer)
        hits = {e: slot for e in wanted if (slot := self.held.get((layer, e))) is not None}
        read = np.fromiter(hits.values(), dtype=np.int64, count=len(hits))
        self.count[read] += 1
        self.last[read] = self.step
        misses = [e for e in wanted if e not in hits]
        fills = self._place(layer, misses, read)
        filled = np.asarray([fill.slot for fill in fills], dtype=np.int64)
        self.count[filled], self.last[filled] = 1, self.step
        return hits, fills

    def reserve(self, layer: int, experts: list[int], keep: Collection[int]) -> list[Fill]:
        fills = self._place(layer, experts[: self.slots - len(set(keep))], np.fromiter(keep, dtype=np.int64, count=len(keep)))
        filled = np.asarray([fill.slot for fill in fills], dtype=np.int64)
        self.count[filled], self.last[filled] = 0, self.step
        return fills

    def _place(self, layer: int, experts: list[int], keep: np.ndarray) -> list[Fill]:
        """Slots for ``layer``'s ``experts`` (none held): the free ones, then the victims outside ``keep``."""
        slots = [self.free.pop() for _ in range(min(len(experts), len(self.free)))]
        if (victims := len(experts) - len(slots)) > 0:  # no free slot is left: every other slot is held
            score = self.count * (self.step + 1) - self.last  # the fewest uses, then the most recent
            score[keep] = self.NEVER
            score[slots] = self.NEVER
            slots += np.argsort(score, kind="stable")[:victims].tolist()  # ties to the lowest slot, as the ExpertBank's choice
        fills = []
        for expert, slot in zip(experts, slots):
            if (evicted := self.key_of[slot]) is not None:
                del self.held[evicted]
            self.held[(layer, expert)], self.key_of[slot] = slot, (layer, expert)
            fills.append(Fill(expert, slot, evicted))
        return fills

    def commit(self, layer: int, experts: list[int], fills: list[Claim], ahead_layer: int, reserved: list[Claim], uses: bool = True) -> None:
        if uses:
            self._next_step(layer)
            filled = {claim[0] for claim in fills}
            read = [self.held[(layer, e)] for e in experts if e not in filled]
            self.count[read] += 1
            self.last[read] = self.step
        for claims, claimed_layer, count in ((fills, layer, 1), (reserved, ahead_layer, 0)):  # a read ahead: no use yet
            for expert, slot, *evicted in claims:
                self._claim(slot, *evicted)
                self.held[(claimed_layer, expert)], self.key_of[slot] = slot, (claimed_layer, expert)
                if uses:
                    self.count[slot], self.last[slot] = count, self.step

    USES_FROM_BANK = True  # the bank counts uses and ages them as _next_step does

    def lead(self, bank: Any) -> None:
        bank.begin_lfu(self.free, torch.from_numpy(self.count), torch.from_numpy(self.last), self.step, self.layer, self.passes, self.AGING_PASSES)

    def uses_from(self, bank: Any) -> None:
        count, last, self.step, self.layer, self.passes = bank.lfu_state()
        self.count[:], self.last[:] = count.numpy(), last.numpy()

    def drop(self, key: tuple[int, int]) -> None:
        self.key_of[self.held[key]] = None
        super().drop(key)

    def ranked(self) -> list[tuple[int, int]]:
        slots = list(self.held.values())
        order = np.lexsort((self.last[slots], self.count[slots]))  # fewest uses first, least recent first among equals
        return [self.key_of[slots[i]] for i in order.tolist()]

    def rebuilt(self, slots: int) -> tuple[SlotLFU, dict[int, int]]:
        new, moved = super().rebuilt(slots)
        assert isinstance(new, SlotLFU)
        old, kept = np.fromiter(moved, dtype=np.int64, count=len(moved)), np.fromiter(moved.values(), dtype=np.int64, count=len(moved))
        new.count[kept], new.last[kept] = self.count[old], self.last[old]  # the counts go with their experts
        for key, slot in new.held.items():
            new.key_of[slot] = key
        new.step, new.layer, new.passes = self.step, self.layer, self.passes
        return new, moved


POLICIES: dict[str, type[SlotPolicy]] = keyed_by(EXPERT_CACHE_POLICIES, {policy.name: policy for policy in (SlotLRU, SlotLFU)})


def token_groups(routed: list[list[int]], slots: int) -> Iterator[slice]:
    """Consecutive tokens (each one's routed experts) whose experts fit ``slots`` at once: a step that routes to more
    experts than a bank holds runs a group at a time (a token's bits do not depend on the other tokens of its call)."""
    start, group = 0, set()
    for t, row in enumerate(routed):
        if len(group.union(row)) > slots:
            yield slice(start, t)
            start, group = t, set()
        group.update(row)
    yield slice(start, len(routed))


def _runs(fills: list[Fill], most: int = READ_MOST) -> Iterator[list[Fill]]:
    """``fills`` (in expert order) cut into runs of consecutive experts, each one read of adjacent records (at most ``most``)."""
    run: list[Fill] = []
    for fill in fills:
        if run and (fill.expert != run[-1].expert + 1 or len(run) == most):
            yield run
            run = []
        run.append(fill)
    if run:
        yield run


class LayerStream:
    """One step's MoE layers read whole from the store into two halves of slots lent by the bank's policy: while a
    layer computes from one half, the next layer's experts are read into the other. Each layer's records are adjacent
    in the store, so a layer is a few long reads (``READ_MOST`` records each), side by side."""

    def __init__(self, reads: StoreReads, slots: list[int]) -> None:
        experts = reads.store.num_experts
        self.store_reads, self.slots = reads, slots
        self.halves = [slots[:experts], slots[experts : 2 * experts]]
        self.maps = [torch.tensor(half, dtype=torch.int32) for half in self.halves]  # each half's expert -> slot
        self.reads: dict[int, tuple[float, list[Any]]] = {}  # layer -> (started at, its reads)

    def start(self, layer: int) -> None:
        """Starts reading ``layer``'s experts into its half (``layer % 2``), which no layer still computing reads."""
        half = self.halves[layer % 2]
        self.reads[layer] = (
            time.perf_counter(),
            self.store_reads.start([(layer, first, half[first : first + READ_MOST]) for first in range(0, len(half), READ_MOST)]),
        )

    def take(self, layer: int) -> tuple[torch.Tensor, int, float, bool]:
        """Waits for ``layer``'s experts: its slot map, the bytes read, their rate (bytes a second since the reads
        started), and whether the caller waited for them (if not, the rate is only a lower bound)."""
        started, reads = self.reads.pop(layer)
        outcomes = _wait_all(self.store_reads, reads)  # all of them, before one's failure gives the slots back
        if failed := next((o for o in outcomes if isinstance(o, BaseException)), None):
            raise failed
        nbytes, waited = sum(o[0] for o in outcomes), any(o[1] for o in outcomes)
        return self.maps[layer % 2], nbytes, nbytes / max(time.perf_counter() - started, 1e-9), waited

    def drain(self) -> None:
        """Waits for every read still in flight (a failed step's), so that no read lands in a slot given back."""
        for _, reads in self.reads.values():
            _wait_all(self.store_reads, reads)
        self.reads.clear()


class _NoBank:
    """Where the C++ kernels are not built: Python fills, and no layer-step runs in C++ to be logged."""

    fills = False

    @staticmethod
    def take_log() -> list[Any]:
        return []


NO_BANK = _NoBank()


class ExpertCache:
    """A bank of ``slots`` experts' panels over ``store``: ``records`` [S, record], one page-aligned slot per
    expert laid out as its store record, seen by the kernel as ``gate_up`` [S, ...] and ``down`` [S, ...] (views
    ``record`` bytes apart per slot); and each layer's slot map (``slot_of[layer]``: int32 [E], -1 where the
    expert is not held) that the kernel reads.

    A step fills its layers on demand (each layer-step reads its misses once its router has run) or streamed (every
    MoE layer read whole, two layers at a time in 2E slots the policy lends for the step, each read overlapping the
    layer before it: a long prefill neither waits on its misses one layer at a time nor sweeps the bank).
    ``fill_mode`` ``auto`` streams a step of ``AUTO_STREAM_MIN_TOKENS`` or more where that is expected to cost less:
    the misses of its tokens' routing at the measured on-demand read rate, against a layer at the measured streamed
    rate less the layer's measured compute for that many tokens, which the read overlaps (and every
    ``EXPLORE_EVERY``-th such step it kept on demand, to measure again); ``streamed`` streams every step of two
    tokens or more, ``on-demand`` none. A bank that cannot lend two layers' experts fills on demand."""

    def __init__(self, store: ExpertStore, slots: int, top_k: int, budget: int, policy: str = "lru", fill: str = "auto", prefetch: str = "on") -> None:
        if slots < top_k:
            raise ValueError(f"the expert cache holds {slots} experts, fewer than one layer's top-k ({top_k})")
        self.store, self.top_k = store, top_k
        self.slot_of = [torch.full((store.num_experts,), -1, dtype=torch.int32) for _ in range(store.num_layers)]
        self._slot_of = [t.numpy() for t in self.slot_of]  # the same maps, written through numpy: a torch item write costs ~10 us
        self.reads = StoreReads.of(store)  # a layer-step's runs of misses, in flight side by side
        self.hits = self.misses = self.evictions = self.bytes_read = 0
        self.fill_mode, self.last_fill = fill, ""  # last_fill: how the latest step read its experts
        self.prefetch = prefetch
        self._ahead: list[tuple[int, list[Fill], Any]] = []  # reads ahead in flight: (layer, the run's fills, its read)
        self.prefetched = {"used": 0, "unused": 0}
        self.layer_steps = {"on-demand": 0, "streamed": 0}
        self._stream: LayerStream | None = None
        self._kept_on_demand = 0  # eligible steps the rule kept on demand since the last streamed one
        self._bank(POLICIES[policy](slots), budget)
        # The fill rule's measurements (moving averages), from priors read here while the bank is empty.
        self.hit_rate_recent = slots / self.experts
        self.fill_rate, self.stream_rate = self._read_rates() if self.streams else (1.0, 1.0)
        self.compute_per_token = 0.0  # seconds of a MoE layer's call per token, once measured

    def _bank(self, policy: SlotPolicy, budget: int) -> None:
        """A bank of ``policy.slots`` empty slots under ``policy``."""
        store, slots = self.store, policy.slots
        self.budget, self.policy = budget, policy
        self.records = torch.frombuffer(aligned_buffer(slots * store.record), dtype=torch.uint8, count=slots * store.record).view(slots, store.record)
        self.gate_up = _panels(self.records, store.gate_up_shape, 0)
        self.down = _panels(self.records, store.down_shape, store.gate_up_bytes)
        self.reads.bank(self.records)
        for slot_of in self.slot_of:
            slot_of.fill_(-1)
        # the layer-steps' fills where the reads are native AIO (else Python fills, and the bank logs the one-call decoder's hits)
        kernels = cpu_kernels()[0]
        self._bank_led = False  # whether the ExpertBank has the policy's state as this step began
        self.expert_bank = (
            kernels.ExpertBank(self.reads.direct if isinstance(self.reads, AioReads) else None, store.fd, store.record, self.records, self.slot_of)
            if kernels is not None
            else NO_BANK
        )
        SLOTS_TOTAL.set(slots)
        SLOTS_USED.set(0)

    @property
    def slot_bytes(self) -> int:
        return self.store.record

    def reads_ahead(self, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens reads each next layer's predicted experts ahead: on, the bank does not hold
        every expert, and the step is small enough that its reads leave the storage idle while its layers compute."""
        return self.prefetch == "on" and self.slots < self.experts and tokens <= READ_AHEAD_MAX_TOKENS

    @property
    def streams(self) -> bool:
        """Whether a step may stream: the bank can lend two layers' experts and does not hold every expert."""
        return self.fill_mode != "on-demand" and 2 * self.store.num_experts <= self.slots < self.experts

    def _read_rates(self) -> tuple[float, float]:
        """(on-demand, streamed) read rates in bytes a second, measured once: four records read one at a time, then a
        layer's records in one read (into slots nothing maps yet)."""
        experts, record = self.store.num_experts, self.store.record
        began = time.perf_counter()
        for expert in range(0, experts, max(1, experts // 4)):
            self.reads.wait(self.reads.start([(0, expert, [0])])[0])
        one_at_a_time = -(-experts // max(1, experts // 4)) * record / max(time.perf_counter() - began, 1e-9)
        began = time.perf_counter()
        layer = min(experts, READ_MOST)
        self.reads.wait(self.reads.start([(0, 0, list(range(layer)))])[0])
        return one_at_a_time, layer * record / max(time.perf_counter() - began, 1e-9)

    def _streamed_is_faster(self, tokens: int) -> bool:
        """The fill rule: the misses ``tokens`` routed uniformly are expected to take at the on-demand rate, against a
        whole layer at the streamed rate less the compute it overlaps."""
        experts, record = self.store.num_experts, self.store.record
        touched = experts * (1 - (1 - self.top_k / experts) ** tokens)
        on_demand = touched * (1 - self.hit_rate_recent) * record / self.fill_rate
        streamed = max(0.0, experts * record / self.stream_rate - tokens * self.compute_per_token)
        return streamed < on_demand

    # A step's fill: chosen by its first MoE layer, streamed layer by layer. ------------------------------------------

    def _chooses_streaming(self, tokens: int) -> bool:
        if not self.streams or tokens < (STREAM_MIN_TOKENS if self.fill_mode == "streamed" else AUTO_STREAM_MIN_TOKENS):
            return False
        if self.fill_mode == "streamed" or self._streamed_is_faster(tokens):
            self._kept_on_demand = 0
            return True
        self._kept_on_demand += 1
        if self._kept_on_demand == EXPLORE_EVERY:  # a measurement of the streamed rate, which on-demand steps do not give
            self._kept_on_demand = 0
            return True
        return False

    def begin_step(self, tokens: int) -> None:
        """The first MoE layer of a step of ``tokens`` tokens: ends the stream a failed step left, and chooses this
        step's fill (``fill_mode``); a streamed step lends its slots and starts reading its first two layers."""
        self._land()
        self._end_stream()
        if not self._chooses_streaming(tokens):
            self.last_fill = "on-demand"
            self._lead_bank()
            return
        slots, evicted = self.policy.lend(2 * self.store.num_experts)
        self._bank_led = False
        for layer, expert in evicted:
            self._slot_of[layer][expert] = -1
        self.evictions += len(evicted)
        EVICTIONS.inc(len(evicted))
        SLOTS_USED.set(len(self.policy.held))
        self._stream, self.last_fill = LayerStream(self.reads, slots), "streamed"
        for layer in range(min(2, self.store.num_layers)):
            self._stream.start(layer)

    @property
    def streaming(self) -> bool:
        """Whether the step running streams its layers."""
        return self._stream is not None

    def streamed(self, layer: int) -> torch.Tensor:
        """A streamed step's MoE layer ``layer``: starts reading the next layer into the half the layer before this one
        ran from, waits for this layer's experts, and gives its slot map."""
        stream = self._stream
        assert stream is not None, "streamed() runs in a step that begin_step chose to stream"
        if 1 <= layer < self.store.num_layers - 1:
            stream.start(layer + 1)
        try:
            slots, nbytes, rate, waited = stream.take(layer)
        except BaseException:
            self._end_stream()
            raise
        if layer >= 2 and (waited or rate > self.stream_rate):  # read alone (the first two are read side by side); a read that landed before
            self.stream_rate += RATE_WEIGHT * (rate - self.stream_rate)  # its layer asked for it gives a lower bound only
        self.bytes_read += nbytes
        BYTES_READ.inc(nbytes)
        self.layer_steps["streamed"] += 1
        LAYER_STEPS_BY_FILL["streamed"].inc()
        return slots

    def layer_ran(self, layer: int, tokens: int, seconds: float) -> None:
        """A MoE layer's call took ``seconds`` for ``tokens`` tokens (what a streamed read overlaps); the step's last
        layer ends its stream."""
        if tokens >= COMPUTE_MIN_TOKENS:
            self.compute_per_token += RATE_WEIGHT * (seconds / tokens - self.compute_per_token)
        if layer == self.store.num_layers - 1:
            self._end_stream()

    def _end_stream(self) -> None:
        if self._stream is not None:
            self._stream.drain()
            self.policy.give_back(self._stream.slots)
            self._stream = None
            self._bank_led = False

    def _lead_bank(self) -> None:
        """The ExpertBank's fills of this step take victims in the policy's order as it stands now."""
        if self.expert_bank.fills:
            self.policy.lead(self.expert_bank)
            self._bank_led = True

    @property
    def experts(self) -> int:
        return self.store.num_layers * self.store.num_experts

    def slots_for(self, budget: int) -> int:
        """The slots a bank of ``budget`` bytes holds (at most every expert); ValueError below one layer's top-k."""
        slots = min(budget // self.slot_bytes, self.experts)
        if slots < self.top_k:
            raise ValueError(
                f"expert_cache_bytes {budget} holds {slots} experts of {self.slot_bytes} bytes, fewer than one layer's top-k ({self.top_k}): "
                f"give at least {self.top_k * self.slot_bytes}"
            )
        return slots

    def resize(self, budget: int) -> None:
        """Rebuilds the bank at ``budget`` bytes (the store stays), keeping the experts that the policy ranks most worth
        keeping that fit (the most recently used under LRU). Only between steps: no layer-step may hold slots of the old bank."""
        self._land()
        self._end_stream()
        policy, moved = self.policy.rebuilt(self.slots_for(budget))
        old = self.records
        self._bank(policy, budget)
        for was, slot in moved.items():
            self.records[slot].copy_(old[was])
        for (layer, expert), slot in policy.held.items():
            self._slot_of[layer][expert] = slot
        SLOTS_USED.set(len(policy.held))
        del old
        _return_freed_memory()

    @property
    def slots(self) -> int:
        return self.policy.slots

    @property
    def nbytes(self) -> int:
        return self.records.nbytes

    def passes(self, layer: int, ids: torch.Tensor, ahead: tuple[int, list[int]] | None = None) -> Iterator[tuple[slice, torch.Tensor]]:
        """Groups of consecutive tokens (rows of the routed ``ids`` [T, k]) whose experts fit the bank at once,
        each with ``layer``'s slot map once the group's misses are filled: one group when the step fits (which
        then reads ``ahead``: (a later layer, its predicted experts)). The caller runs a group before asking for
        the next, whose fills may evict the previous group's experts."""
        experts = sorted(set(ids.view(-1).tolist()))
        if len(experts) <= self.slots:
            self.fill(layer, experts, ahead)
            yield slice(0, ids.shape[0]), self.slot_of[layer]
            return
        routed = ids.tolist()
        for rows in token_groups(routed, self.slots):
            self.fill(layer, sorted(set().union(*routed[rows])))
            yield rows, self.slot_of[layer]

    def fill(self, layer: int, experts: list[int], ahead: tuple[int, list[int]] | None = None) -> None:
        """Makes ``layer``'s ``experts`` (ascending) resident: hits stay (those read ahead once their read lands),
        misses are read from the store, a run of consecutive experts in one read; and behind them, in the same
        submission, starts reading ``ahead`` (a later layer, the experts its router is predicted to pick), where the
        cache reads ahead. Where the reads are native AIO the ExpertBank fills (as the one-call decoder's fills do,
        under the policy's state as the step began) and the policy hears of it after (``replay``)."""
        self._end_stream()  # a failed streamed step's slots: back in the policy's hands before it takes any
        if self.expert_bank.fills:
            if not self._bank_led:
                self._lead_bank()
            ahead_layer, ahead_experts = ahead if ahead is not None and self.prefetch == "on" else (-1, [])
            try:
                self.expert_bank.fill(layer, experts, ahead_layer, ahead_experts)
            finally:
                self.replay(self.expert_bank.take_log())
            return
        started = time.perf_counter()
        read_ahead = self._land(layer, experts)
        hits, fills = self.policy.take(layer, experts)
        self._forget(fill.evicted for fill in fills)
        runs = list(_runs(fills))
        ahead_runs = self._reserve_ahead(*ahead, keep=[*hits.values(), *(fill.slot for fill in fills)]) if ahead is not None and self.prefetch == "on" else []
        reads = self.reads.start(
            [(layer, run[0].expert, [fill.slot for fill in run]) for run in runs]
            + [(ahead[0], run[0].expert, [fill.slot for fill in run]) for run in ahead_runs]
        )
        self._ahead += [(ahead[0], run, started_read) for run, started_read in zip(ahead_runs, reads[len(runs) :])]
        read, failure = 0, None
        for run, outcome in zip(runs, _wait_all(self.reads, reads[: len(runs)])):
            if isinstance(outcome, BaseException):  # its slots hold nothing: free again (the other runs were waited for)
                for failed in run:
                    self.policy.drop((layer, failed.expert))
                failure = failure or outcome
                continue
            read += outcome[0]
            for expert, slot, _ in run:
                self._slot_of[layer][expert] = slot
        if failure is not None:
            raise failure
        if read:  # the whole fill's time, its bookkeeping too: what a step waits for a byte of its misses
            self.fill_rate += RATE_WEIGHT * (read / max(time.perf_counter() - started, 1e-9) - self.fill_rate)
        self._count(len(experts), len(hits) - read_ahead, fills, read, time.perf_counter() - started, read_ahead)

    def _reserve_ahead(self, layer: int, experts: list[int], keep: list[int]) -> list[list[Fill]]:
        """Slots the policy reserves for ``layer``'s ``experts`` that are not held (never one in ``keep``, of a read in
        flight or of the predicted experts held), as runs to read; the slot map shows them once they land (``_land``)."""
        held = self.policy.held
        wanted, predicted_held = [e for e in experts if (layer, e) not in held], [held[(layer, e)] for e in experts if (layer, e) in held]
        if not wanted:
            return []
        fills = self.policy.reserve(layer, wanted, [*keep, *predicted_held, *(fill.slot for _, run, _ in self._ahead for fill in run)])
        self._forget(fill.evicted for fill in fills)
        evictions = sum(fill.evicted is not None for fill in fills)
        self.evictions += evictions
        EVICTIONS.inc(evictions)
        SLOTS_USED.set(len(self.policy.held))
        return list(_runs(fills))

    def _land(self, layer: int = -1, routed: Collection[int] = ()) -> int:
        """Waits for every read ahead and maps the experts it read (a failed one's slot is free again); returns how
        many of ``layer``'s ``routed`` experts were among them (Python's fills: the ExpertBank's land in its own)."""
        if self.expert_bank.fills:
            self.expert_bank.land_all()
            self.replay(self.expert_bank.take_log())
        if not self._ahead:
            return 0
        used = landed = 0
        for (ahead_layer, run, _), outcome in zip(self._ahead, _wait_all(self.reads, [read for _, _, read in self._ahead])):
            if isinstance(outcome, BaseException):  # a layer-step that routes to them reads them again, and fails there if the store does
                for fill in run:
                    self.policy.drop((ahead_layer, fill.expert))
                continue
            for expert, slot, _ in run:
                self._slot_of[ahead_layer][expert] = slot
                used += ahead_layer == layer and expert in routed
            landed += len(run)
        self._ahead.clear()
        self.prefetched["used"] += used
        self.prefetched["unused"] += landed - used
        PREFETCHES_BY_OUTCOME["used"].inc(used)
        PREFETCHES_BY_OUTCOME["unused"].inc(landed - used)
        self.bytes_read += landed * self.store.record
        BYTES_READ.inc(landed * self.store.record)
        return used

    def _forget(self, evicted: Iterable[tuple[int, int] | None]) -> None:
        """Unmaps the experts evicted from their slots."""
        for key in evicted:
            if key is not None:
                self._slot_of[key[0]][key[1]] = -1

    def replay(self, steps: list[Any], tokens: int | None = None) -> None:
        """The ExpertBank's layer-steps (``take_log``), in order: the policy hears of each (a fill's claims, a hit's use, a
        failed read's slot freed) and each is counted as ``fill`` counts its own; ``tokens``: those of the one-call
        decoder's step that ran them, whose calls measure the experts' compute (``layer_ran``)."""
        if not steps:
            return
        record, policy = self.store.record, self.policy
        uses_from_bank = self._bank_led and policy.USES_FROM_BANK  # then an all-hit layer-step changes nothing else
        hits = misses = evictions = read = used = landed = layer_steps = 0
        for step in steps:
            if step.layer >= 0:
                experts, fills, reserved = step.experts, step.fills, step.reserved
                if fills or reserved:
                    policy.commit(step.layer, experts, fills, step.ahead_layer, reserved, uses=not uses_from_bank)
                elif not uses_from_bank:
                    policy.touch(step.layer, experts)
                layer_steps += 1
                hits += len(experts) - len(fills) - step.used
                misses += len(fills)
                evictions += sum(claim[2] >= 0 for claim in fills) + sum(claim[2] >= 0 for claim in reserved)
                self.hit_rate_recent += RATE_WEIGHT * ((len(experts) - len(fills)) / len(experts) - self.hit_rate_recent)
                if step.filled:
                    FILL_TIME.observe(step.fill_seconds)
                    if step.bytes:  # the whole fill's time, its bookkeeping too: what a step waits for a byte of its misses
                        self.fill_rate += RATE_WEIGHT * (step.bytes / max(step.fill_seconds, 1e-9) - self.fill_rate)
                if tokens is not None:
                    self.layer_ran(step.layer, tokens, step.seconds)
            for key in step.dropped:
                policy.drop(tuple(key))
            read += step.bytes + step.landed * record
            used, landed = used + step.used, landed + step.landed
        if uses_from_bank:
            policy.uses_from(self.expert_bank)
        self.hits, self.misses, self.evictions, self.bytes_read = self.hits + hits, self.misses + misses, self.evictions + evictions, self.bytes_read + read
        self.prefetched["used"] += used
        self.prefetched["unused"] += landed - used
        self.layer_steps["on-demand"] += layer_steps
        HITS.inc(hits)
        MISSES.inc(misses)
        EVICTIONS.inc(evictions)
        BYTES_READ.inc(read)
        PREFETCHES_BY_OUTCOME["used"].inc(used)
        PREFETCHES_BY_OUTCOME["unused"].inc(landed - used)
        LAYER_STEPS_BY_FILL["on-demand"].inc(layer_steps)
        SLOTS_USED.set(len(policy.held))

    def _count(self, lookups: int, hits: int, fills: list[Fill], read: int, seconds: float, read_ahead: int = 0) -> None:
        """One on-demand layer-step's counters: ``lookups`` routed experts, ``hits`` of them held before it (and
        ``read_ahead`` read ahead for it), ``fills`` read (``read`` bytes) in ``seconds``."""
        if lookups:  # the experts it found without waiting for a read of its own
            self.hit_rate_recent += RATE_WEIGHT * ((hits + read_ahead) / lookups - self.hit_rate_recent)
        self.layer_steps["on-demand"] += 1
        LAYER_STEPS_BY_FILL["on-demand"].inc()
        evictions = sum(f.evicted is not None for f in fills)
        self.hits, self.misses, self.evictions, self.bytes_read = (
            self.hits + hits,
            self.misses + len(fills),
            self.evictions + evictions,
            self.bytes_read + read,
        )
        HITS.inc(hits)
        if fills:
            MISSES.inc(len(fills))
            EVICTIONS.inc(evictions)
            BYTES_READ.inc(read)
            SLOTS_USED.set(len(self.policy.held))
        FILL_TIME.observe(seconds)

    def _why_not_streamed(self) -> str:
        if self.fill_mode == "on-demand":
            return "--expert-cache-fill on-demand"
        if self.slots >= self.experts:
            return "the bank holds every expert"
        return f"the bank's {self.slots} slots are fewer than two layers' {2 * self.store.num_experts} experts"

    def describe(self) -> dict[str, Any]:
        """The cache's configuration and hit rate, for /instrumentation."""
        lookups = self.hits + self.misses + self.prefetched["used"]
        return {
            "bytes": self.budget,
            "slots": self.slots,
            "slots_used": len(self.policy.held),
            "slot_bytes": self.slot_bytes,
            "bank_bytes": self.nbytes,
            "experts": self.experts,
            "formats": "/".join(dict.fromkeys(self.store.formats)),
            "store": self.store.path,
            "store_bytes": self.store.nbytes,
            "store_reads": self.store.read_mode,
            "reads_in_flight": self.reads.how,
            "fills": "in C++ (the one-call decoder's without Python)" if self.expert_bank.fills else "in Python",
            "fill_policy": self.fill_mode,
            "streamed_prefill": "on" if self.streams else f"off ({self._why_not_streamed()})",
            "last_step_fill": self.last_fill,
            "layer_steps": dict(self.layer_steps),
            "fill_rule": {
                "on_demand_bytes_per_s": round(self.fill_rate),
                "streamed_bytes_per_s": round(self.stream_rate),
                "moe_seconds_per_token": round(self.compute_per_token, 6),
                "recent_hit_rate": round(self.hit_rate_recent, 4),
            },
            "policy": self.policy.name,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "bytes_read": self.bytes_read,
            "hit_rate": round(self.hits / lookups, 4) if lookups else None,
            "prefetch": self.prefetch,
            "prefetched": dict(self.prefetched),
        }


def moe_layer_count(config: dict[str, Any]) -> int:
    """How many of a qwen3_moe / qwen3_next config's layers are MoE layers (those ``Qwen3MoeForCausalLM.is_sparse`` picks)."""
    if not config.get("num_experts", config.get("num_local_experts", 0)):
        return 0
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or [])
    return sum(i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"]))


def refuse_unserved(sharded: bool, policy: str) -> None:
    """What no worker's expert cache serves (ValueError, naming why): tensor parallelism, an unknown policy."""
    if sharded:
        raise ValueError("--expert-cache-bytes does not run with tensor parallelism: leave --tensor-parallel-size at 1")
    if policy not in POLICIES:
        raise ValueError(f"--expert-cache-policy is one of {', '.join(POLICIES)}, not {policy!r}")


def cached_moe_shape(config: dict[str, Any]) -> tuple[int, int]:
    """(MoE layers, top-k) of a model's config, read before its weights; ValueError for a family the cache does not serve."""
    if (family := config.get("model_type", "llama")) not in FAMILIES:
        raise ValueError(f"--expert-cache-bytes serves {' and '.join(FAMILIES)} models, not {family}")
    return moe_layer_count(config), config["num_experts_per_tok"]


class ExpertSpill:
    """A worker's expert cache planned before its weights are read (``plan``): while the model loads, each MoE layer's
    experts go to the store as that layer's blocks are made (``moe.EXPERT_SINK``, set by ``weights_loading.load_model``:
    a GGUF's blocks as read, a checkpoint's float experts once quantized under ``moe.EXPERT_QUANT``), so that loading never
    holds more than about one layer's experts; ``attach`` then runs the MoE layers from a bank of slots over that
    store. Refuses (ValueError, naming why) what the cache cannot serve, each as soon as it is known."""

    on_device = False  # takes blocks (moe.ExpertSink)

    def __init__(self, spec: str, directory: str, policy: str, fill: str = "auto", prefetch: str = "on") -> None:
        self.spec, self.directory, self.policy, self.fill, self.prefetch = spec, directory, policy, fill, prefetch
        self.store: ExpertStore | None = None
        self.layers = self.top_k = self.slots = self.budget = 0

    @classmethod
    def plan(cls, spec: str, directory: str, policy: str, device: torch.device, sharded: bool, fill: str = "auto", prefetch: str = "on") -> ExpertSpill | None:
        """The spill of ``spec`` (``cache_bytes``) under replacement ``policy`` (``POLICIES``), ``fill`` mode and ``prefetch``
        (on: read ahead), its store under ``directory``; None where ``spec`` is 0 (all resident)."""
        if not expert_cache_on(spec):
            return None
        if device.type != "cpu":
            raise ValueError("a GPU worker's expert cache is device_expert_cache.DeviceExpertSpill")
        refuse_unserved(sharded, policy)
        if fill not in EXPERT_CACHE_FILLS:
            raise ValueError(f"--expert-cache-fill is one of {', '.join(EXPERT_CACHE_FILLS)}, not {fill!r}")
        if prefetch not in EXPERT_CACHE_PREFETCH:
            raise ValueError(f"--expert-cache-prefetch is one of {', '.join(EXPERT_CACHE_PREFETCH)}, not {prefetch!r}")
        return cls(spec, directory, policy, fill, prefetch)

    def begin(self, config: dict[str, Any]) -> None:
        """The model's config, read before its weights: its family, MoE layers and top-k."""
        self.layers, self.top_k = cached_moe_shape(config)

    def append(self, panels: ExpertPanels) -> None:
        """The next MoE layer's experts, into the store (created on the first layer: the bank's size is known from there)."""
        if self.store is None:
            slot_bytes = padded(panels.gate_up[0].nbytes + panels.down[0].nbytes)
            experts = panels.gate_up.shape[0] * self.layers
            self.budget = cache_bytes(self.spec, slot_bytes * experts)
            if (slots := min(self.budget // slot_bytes, experts)) < self.top_k:
                raise ValueError(
                    f"--expert-cache-bytes {self.spec} holds {slots} experts of {slot_bytes} bytes, fewer than one layer's top-k ({self.top_k}): "
                    f"give at least {self.top_k * slot_bytes}"
                )
            self.slots, self.store = slots, ExpertStore.empty(self.directory, panels, self.layers)
        self.store.append(panels)
        _trim_heap()  # the previous layer's copies, freed between longer-lived tensors: else the heap keeps every layer's pages

    def attach(self, model: object) -> ExpertCache:
        """``model``'s MoE layers run from a bank over the store, which now holds every layer's experts."""
        layers = routed_experts(model)
        if not layers or self.store is None or any(moe.panels is None for moe in layers):
            raise ValueError(BLOCKS_NEEDED)
        if len(layers) != self.store.num_layers:
            raise ValueError(f"the model has {len(layers)} MoE layers where its config says {self.store.num_layers}")
        self.store.seal()
        cache = ExpertCache(self.store, self.slots, self.top_k, self.budget, self.policy, self.fill, self.prefetch)
        predictors = read_ahead_predictors(model) if self.prefetch == "on" else [None] * len(layers)
        for layer, (moe, predictor) in enumerate(zip(layers, predictors)):
            moe.stream_from(cache, layer, predictor)
        _return_freed_memory()
        return cache


def read_ahead_predictors(model: object) -> list[torch.Tensor | None]:
    """Per MoE layer, the next MoE layer's router as it would see this layer's normed input ``x = RMSNorm(h) * w``
    (None for the last): ``router' * (w' / w)`` per hidden channel, w and w' the two layers' post-attention norm weights,
    so that its top-k over ``x`` is the next layer's routing of ``h``: the residual stream before this layer's MLP and
    the next layer's attention add to it, which in trained (and random) models moves few of a token's top-k."""
    layers = [layer for layer in model.layers if isinstance(layer.mlp, SparseMoE | SharedExpertMoE)]
    norms = [layer.post_norm.weight.float() for layer in layers]
    routers = [moe.router.float() for moe in routed_experts(model)]
    predictors: list[torch.Tensor | None] = []
    for this, following, router in zip(norms, norms[1:], routers[1:]):
        scale = torch.where(this != 0, following / torch.where(this != 0, this, 1), 0)  # a channel the norm zeroes tells nothing
        predictors.append((router * scale).contiguous())
    return [*predictors, None]


def _wait_all(reads: StoreReads, started: list[Any]) -> list[tuple[int, bool] | BaseException]:
    """Waits for every read of ``started`` (``StoreReads.start``'s): each one's (bytes, waited), or what it raised."""
    outcomes: list[tuple[int, bool] | BaseException] = []
    for read in started:
        try:
            outcomes.append(read if isinstance(read, BaseException) else reads.wait(read))
        except BaseException as exc:
            outcomes.append(exc)
    return outcomes


def _panels(records: torch.Tensor, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """[S, *shape]: each slot's contiguous panels at ``offset`` bytes into its record of ``records`` [S, record]."""
    inner = torch.empty(shape, device="meta").stride()
    return records.as_strided((records.shape[0], *shape), (records.stride(0), *inner), records.storage_offset() + offset)


def _return_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc keeps freed tensors' memory otherwise, and the
    dropped panels would still count in the worker's RSS)."""
    gc.collect()
    _trim_heap()


def _trim_heap() -> None:
    if (libc := ctypes.util.find_library("c")) is not None and hasattr(lib := ctypes.CDLL(libc), "malloc_trim"):
        lib.malloc_trim(0)
