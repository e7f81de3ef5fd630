"""The bounded expert cache (services/worker/expert_cache.py): each replacement policy over one bank of slots
never refills a slot that its own layer-step reads, never leaks a slot and never holds more than its bound, and LFU keeps a stable resident set under a cyclic scan
larger than the bank, where LRU never hits; the store gives
back every byte it was given, with O_DIRECT into padded slots where the filesystem allows and buffered reads where it refuses; tiny qwen3_moe and qwen3_next models with int4 experts give the same greedy
tokens (and the same logits, bit for bit) at every cache size from one layer's top-k to all resident, a checkpoint's float
experts quantized as they load (int4, int4-a8, or auto on the block grid) included; loading a GGUF or a safetensors
checkpoint into the cache holds about one layer's experts at a time, each layer's stored before the next layer's are
read; and what the cache cannot serve is refused at start, naming why."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import ctypes.util
import errno
import gc
import mmap
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple
from unittest import mock

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.launcher.__main__ import check_expert_cache
from services.worker import block_quant, weights_loading
from services.worker.block_quant import BlockQuantized
from services.worker.cpu_kernels import cpu_kernels
from services.worker.decoder_backends import DECODER_BACKENDS
from services.worker.expert_cache import (
    ALIGN,
    POLICIES,
    ExpertCache,
    ExpertSpill,
    ExpertStore,
    SlotLFU,
    SlotLRU,
    cache_bytes,
    default_store_dir,
    padded,
    read_ahead_predictors,
)
from services.worker.expert_reads import AioReads, StoreReads, ThreadReads
from services.worker.moe import ExpertPanels, SharedExpert, SparseMoE, routed_experts
from services.worker.rmsnorm import RMSNorm
from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.weights import SafetensorsFile
from shared.choices import EXPERT_CACHE_PREFETCH
from shared.config import StackConfig
from shared.frames import Slice, StepPlan
from shared.metrics import exposition

from .gguf_files import tiny_gguf
from .harness import GREEDY, Checkpoint, build_tiny, drive, prompt_of

needs_kernels = pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")

LAYERS, EXPERTS = 3, 6
ROUTED_EXPERTS = ".mlp.experts."  # a checkpoint's tensors of a layer's routed experts have this in their names


class StoreDir(NamedTuple):
    path: str
    mode: str  # the read mode the store must report there


def _refuses_direct(directory: str) -> str | None:
    """Why ``directory`` refuses O_DIRECT reads of a page-aligned page, or None where it takes them."""
    with tempfile.NamedTemporaryFile(dir=directory) as file:
        file.write(bytes(ALIGN))
        file.flush()
        try:
            fd = os.open(file.name, os.O_RDONLY | os.O_DIRECT)
        except (OSError, AttributeError) as exc:
            return str(exc)
        try:
            os.preadv(fd, [mmap.mmap(-1, ALIGN)], 0)
        except OSError as exc:
            return str(exc)
        finally:
            os.close(fd)
    return None


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[str]:
    """A directory that takes O_DIRECT: the test's own where it does, else one on the disk of the user's cache (tmpfs refuses it)."""
    if _refuses_direct(str(tmp_path)) is None:
        yield str(tmp_path)
        return
    os.makedirs(parent := default_store_dir(), exist_ok=True)
    if (why := _refuses_direct(parent)) is not None:
        pytest.skip(f"neither {tmp_path} nor {parent} takes O_DIRECT reads: {why}")
    with tempfile.TemporaryDirectory(dir=parent) as directory:
        yield directory


@pytest.fixture(params=["O_DIRECT", "buffered"])
def store_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreDir]:
    """Where a test's expert store goes, once per read mode: O_DIRECT on a disk, and buffered + DONTNEED as on a filesystem that refuses O_DIRECT."""
    if request.param == "O_DIRECT":
        yield StoreDir(request.getfixturevalue("disk_dir"), "O_DIRECT")
        return

    def refuse(path: str) -> int:  # a fresh error each time: one kept would keep its traceback's frames (and their panels) alive
        raise OSError(errno.EINVAL, "Invalid argument")

    with mock.patch("services.worker.expert_cache._open_direct", refuse):
        yield StoreDir(str(tmp_path), "buffered + DONTNEED (this filesystem refuses O_DIRECT: [Errno 22] Invalid argument)")


# A layer-step: (layer, the experts it routes to).
steps = st.lists(st.tuples(st.integers(0, LAYERS - 1), st.lists(st.integers(0, EXPERTS - 1), min_size=1, max_size=EXPERTS)), max_size=40)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@given(slots=st.integers(1, LAYERS * EXPERTS), steps=steps)
def test_each_policy_keeps_hits_in_place_refills_no_slot_its_step_reads_and_leaks_none(policy: str, slots: int, steps: list[tuple[int, list[int]]]) -> None:
    lru = POLICIES[policy](slots)
    holds: dict[int, tuple[int, int]] = {}  # slot -> (layer, expert), as the bank's memory would
    for layer, experts in steps:
        experts = experts[:slots]
        held_before = {key: slot for slot, key in holds.items()}
        hits, fills = lru.take(layer, experts)
        assert hits == {e: held_before[(layer, e)] for e in experts if (layer, e) in held_before}  # a hit reads nothing and stays where it is
        filled = [f.slot for f in fills]
        assert len(set(filled)) == len(filled) and not set(filled) & set(hits.values())  # no slot the step reads is refilled
        assert sorted([*hits, *(f.expert for f in fills)]) == sorted(set(experts))
        for fill in fills:
            assert fill.evicted == holds.get(fill.slot) and (fill.evicted is None or fill.evicted[0] != layer or fill.evicted[1] not in experts)
            holds[fill.slot] = (layer, fill.expert)
        assert all(holds[slot] == (layer, e) for e, slot in [*hits.items(), *((f.expert, f.slot) for f in fills)])
        assert {slot: key for key, slot in lru.held.items()} == holds  # the policy's view is the bank's
        assert sorted([*lru.held.values(), *lru.free]) == list(range(slots))  # bound respected, no slot leaked
        assert sorted(lru.ranked()) == sorted(lru.held)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@given(
    slots=st.integers(1, LAYERS * EXPERTS), steps=steps, predicted=st.lists(st.lists(st.integers(0, EXPERTS - 1), max_size=EXPERTS), min_size=40, max_size=40)
)
def test_experts_read_ahead_take_no_slot_the_step_reads_and_are_the_first_to_go_unless_a_step_uses_them(
    policy: str, slots: int, steps: list[tuple[int, list[int]]], predicted: list[list[int]]
) -> None:
    cache = POLICIES[policy](slots)
    for (layer, experts), ahead in zip(steps, predicted):
        hits, fills = cache.take(layer, experts[:slots])
        keep = [*hits.values(), *(f.slot for f in fills)]
        following = (layer + 1) % LAYERS
        wanted = [e for e in dict.fromkeys(ahead) if (following, e) not in cache.held]
        holds = {slot: key for key, slot in cache.held.items()}
        reserved = cache.reserve(following, wanted, keep)
        assert len(reserved) == min(len(wanted), slots - len(keep))  # as many as fit beside the step's own
        taken = [f.slot for f in reserved]
        assert len(set(taken)) == len(taken) and not set(taken) & set(keep)
        assert all(f.evicted == holds.get(f.slot) and cache.held[(following, f.expert)] == f.slot for f in reserved)
        assert sorted([*cache.held.values(), *cache.free]) == list(range(slots))
        if reserved and not cache.free:  # the next victim is an expert read ahead that no step has used
            probe = copy.deepcopy(cache)
            _, (victim,) = probe.take(LAYERS, [0])
            assert victim.evicted in {(following, f.expert) for f in reserved}


_STORES: dict[str, tuple[ExpertStore, list[ExpertPanels]]] = {}  # a test's store, read by each of its examples


@needs_kernels
@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    slots=st.integers(EXPERTS, LAYERS * EXPERTS),
    steps=steps,
    predicted=st.lists(st.lists(st.integers(0, EXPERTS - 1), max_size=EXPERTS), min_size=40, max_size=40),
    begins=st.lists(st.booleans(), min_size=40, max_size=40),
)
def test_the_expert_banks_fills_choose_read_and_count_as_the_policy_does_in_python(
    policy: str, slots: int, steps: list[tuple[int, list[int]]], predicted: list[list[int]], begins: list[bool], disk_dir: str
) -> None:
    if disk_dir not in _STORES:
        layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=40 + layer) for layer in range(LAYERS)]
        _STORES[disk_dir] = ExpertStore(disk_dir, layers), layers
    store, layers = _STORES[disk_dir]
    gc.collect()  # the earlier examples' caches, and their AIO contexts (aio-max-nr bounds them)
    in_cpp, in_python = (ExpertCache(store, slots, 1, 0, policy, "on-demand") for _ in range(2))
    in_python.expert_bank = cpu_kernels()[0].ExpertBank(None, store.fd, store.record, in_python.records, in_python.slot_of)  # Python fills
    assert in_cpp.expert_bank.fills and not in_python.expert_bank.fills
    for (layer, experts), ahead, begin in zip(steps, predicted, begins):
        for cache in (in_cpp, in_python):
            if begin:
                cache.begin_step(1)
            cache.fill(layer, sorted(set(experts))[:slots], ahead=(layer + 1, sorted(set(ahead))) if layer + 1 < LAYERS else None)
        assert in_cpp.policy.held == in_python.policy.held and list(in_cpp.policy.held) == list(in_python.policy.held)  # LRU: in the same order
        assert in_cpp.policy.free == in_python.policy.free and in_cpp.policy.ranked() == in_python.policy.ranked()
        assert all(torch.equal(a, b) for a, b in zip(in_cpp.slot_of, in_python.slot_of))
        counted = [(c.hits, c.misses, c.evictions, c.bytes_read, c.prefetched, c.layer_steps) for c in (in_cpp, in_python)]
        assert counted[0] == counted[1]
    in_cpp.begin_step(1)  # reads ahead land
    for layer, slot_of in enumerate(in_cpp.slot_of):
        for expert, slot in enumerate(slot_of.tolist()):
            if slot >= 0:
                assert torch.equal(in_cpp.gate_up[slot], layers[layer].gate_up[expert]) and torch.equal(in_cpp.down[slot], layers[layer].down[expert])


def test_a_layers_predictor_routes_its_normed_input_as_the_next_layers_router_routes_the_same_residual() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden, experts, top_k = 32, 16, 4

    def moe_layer(norm: torch.Tensor) -> SimpleNamespace:
        router = torch.randn(experts, hidden, generator=generator)
        w_gate_up, w_down = torch.randn(experts, 2 * 8, hidden, generator=generator), torch.randn(experts, hidden, 8, generator=generator)
        return SimpleNamespace(post_norm=RMSNorm(norm, 1e-6), mlp=SparseMoE(router, w_gate_up, w_down, top_k, False, "torch"))

    norms = [torch.rand(hidden, generator=generator) + 0.5 for _ in range(3)]
    norms[1][3] = 0.0  # a channel the second layer's norm zeroes
    model = SimpleNamespace(layers=[moe_layer(norm) for norm in norms])
    predictors = read_ahead_predictors(model)
    assert predictors[-1] is None
    residual = torch.randn(64, hidden, generator=generator)
    first, second = model.layers[:2]
    predicted = torch.topk(F.linear(first.post_norm(residual), predictors[0]), top_k).indices.sort().values
    assert torch.equal(predicted, torch.topk(F.linear(second.post_norm(residual), second.mlp.router), top_k).indices.sort().values)
    assert torch.all(predictors[1][:, 3] == 0) and torch.all(predictors[1][:, :3] != 0)  # what the second's norm zeroes tells nothing


@contextlib.contextmanager
def failing_reads(cache: ExpertCache, fails: Callable[[int, int], bool]) -> Iterator[None]:
    """The cache's reads of (layer, first expert) that ``fails`` picks fail with EIO: its ExpertBank's, or where Python
    fills, its ``reads``'."""
    bank, store = cache.expert_bank, cache.store
    if not bank.fills:
        start = cache.reads.start

        def failing(requests: list[tuple[int, int, list[int]]]) -> list[Any]:
            started = start([r for r in requests if not fails(*r[:2])])
            return [OSError(errno.EIO, "Input/output error") if fails(*r[:2]) else started.pop(0) for r in requests]

        with mock.patch.object(cache.reads, "start", side_effect=failing):
            yield
        return
    bank.fail_reads_of([(layer, first) for layer in range(store.num_layers) for first in range(store.num_experts) if fails(layer, first)])
    try:
        yield
    finally:
        bank.fail_reads_of([])


@contextlib.contextmanager
def reads_queued(cache: ExpertCache) -> Iterator[Callable[[], int]]:
    """How many reads the cache queues from here on (each a run of adjacent records)."""
    if cache.expert_bank.fills:
        before = cache.expert_bank.runs_read
        yield lambda: cache.expert_bank.runs_read - before
        return
    with mock.patch.object(cache.reads, "start", wraps=cache.reads.start) as start:
        yield lambda: start.call_count


def _cyclic_scan_hit_rate(policy: str, slots: int, layers: int, routed: int, passes: int) -> float:
    """Each layer-step routes to its layer's experts 0..``routed``-1, layers 0..``layers``-1 in turn: the hit rate after the first pass."""
    cache, hits, lookups = POLICIES[policy](slots), 0, 0
    for n in range(passes):
        for layer in range(layers):
            found, _ = cache.take(layer, range(routed))
            hits, lookups = (hits + len(found), lookups + routed) if n else (hits, lookups)
    return hits / lookups


@pytest.mark.parametrize("routed", [2, 3])
def test_under_a_cyclic_scan_of_twice_the_bank_lfu_keeps_a_resident_set_where_lru_never_hits(routed: int) -> None:
    slots, layers = 24, 48 // routed  # working set: twice the slots
    assert _cyclic_scan_hit_rate("lru", slots, layers, routed, 20) == 0.0
    assert _cyclic_scan_hit_rate("lfu", slots, layers, routed, 20) >= 0.4  # the optimum: about (slots - routed) / working set


def test_lfu_keeps_the_hot_experts_and_follows_a_shift_in_routing() -> None:
    lfu = SlotLFU(2 * EXPERTS)
    for n in range(40):  # experts 0 and 1 of every layer at each step, with a scan of the others
        for layer in range(LAYERS):
            lfu.take(layer, [0, 1, 2 + (n + layer) % (EXPERTS - 2)])
    assert {(layer, e) for layer in range(LAYERS) for e in (0, 1)} <= set(lfu.held)
    assert set(lfu.ranked()[-2 * LAYERS :]) == {(layer, e) for layer in range(LAYERS) for e in (0, 1)}
    for n in range(40):  # now 4 and 5 are hot, 0 and 1 no longer routed
        for layer in range(LAYERS):
            lfu.take(layer, [4, 5, 2 + (n + layer) % 2])
    assert set(lfu.ranked()[-2 * LAYERS :]) == {(layer, e) for layer in range(LAYERS) for e in (4, 5)}
    assert not {(layer, e) for layer in range(LAYERS) for e in (0, 1)} & set(lfu.held)


def test_the_least_recently_used_expert_is_evicted_first() -> None:
    lru = SlotLRU(3)
    lru.take(0, [0, 1])
    lru.take(1, [0])
    lru.take(0, [0])  # (0, 1) is now the oldest
    _, fills = lru.take(1, [5])
    assert fills[0].evicted == (0, 1)
    with pytest.raises(ValueError, match="4 experts does not fit 3 slots"):
        lru.take(0, [0, 1, 2, 3])


def _random_panels(experts: int, gate_up_shape: tuple[int, ...], down_shape: tuple[int, ...], seed: int) -> ExpertPanels:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randint(0, 256, (experts, *gate_up_shape), dtype=torch.uint8, generator=generator)
    return ExpertPanels(("q4_1", "q4_1"), gate_up, torch.randint(0, 256, (experts, *down_shape), dtype=torch.uint8, generator=generator))


# q4_1 records of 160 bytes: a few bytes, a page each, and the MoE benchmark model's 138,240 + 69,120
SHAPES = {"unaligned": ((8, 2, 20), (8, 1, 20)), "page-sized": ((2, 2, 1024), (4, 1, 1024)), "benchmark": ((27, 32, 160), (16, 27, 160))}


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_the_store_gives_back_every_byte_of_every_layers_experts(store_dir: StoreDir, shapes: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    layers = [_random_panels(EXPERTS, *shapes, seed=layer) for layer in range(LAYERS)]
    store = ExpertStore(store_dir.path, layers)
    assert os.listdir(store_dir.path) == []  # unlinked once open: nothing is left behind by a worker that dies
    assert store.read_mode == store_dir.mode
    slot_bytes = padded(layers[0].gate_up[0].nbytes + layers[0].down[0].nbytes)
    assert store.record == slot_bytes and store.nbytes == LAYERS * EXPERTS * slot_bytes
    cache = ExpertCache(store, EXPERTS, 1, 0)
    assert cache.nbytes == EXPERTS * slot_bytes and cache.gate_up.stride(0) == cache.down.stride(0) == slot_bytes
    buffers = [memoryview(cache.records[s].numpy()) for s in range(EXPERTS)]
    for layer in range(LAYERS):
        for first, count in [(0, 1), (EXPERTS - 1, 1), (1, 3), (0, EXPERTS)]:  # adjacent records are one read
            order = torch.randperm(EXPERTS, generator=torch.Generator().manual_seed(first))[:count].tolist()  # into slots in any order
            assert store.read_into(layer, first, [buffers[s] for s in order]) == count * slot_bytes
            for expert, slot in zip(range(first, first + count), order):
                assert torch.equal(cache.gate_up[slot], layers[layer].gate_up[expert]) and torch.equal(cache.down[slot], layers[layer].down[expert])
                assert not cache.records[slot, layers[0].gate_up[0].nbytes + layers[0].down[0].nbytes :].any()  # the padding is zeros


def test_a_store_of_padded_slots_reads_with_o_direct_where_the_filesystem_takes_it(disk_dir: str) -> None:
    layers = [_random_panels(EXPERTS, *SHAPES["benchmark"], seed=layer) for layer in range(2)]  # 138,240 + 69,120: no multiple of a page
    cache = ExpertCache(ExpertStore(disk_dir, layers), 3, 2, 0)
    assert cache.describe()["store_reads"] == "O_DIRECT" and cache.describe()["slot_bytes"] == 208896
    with mock.patch("os.posix_fadvise") as fadvise:
        list(cache.passes(1, torch.tensor([[3, 4], [5, 3]], dtype=torch.int32)))
    assert fadvise.call_count == 0  # the page cache is bypassed, not dropped after
    for expert in (3, 4, 5):
        slot = int(cache.slot_of[1][expert])
        assert torch.equal(cache.gate_up[slot], layers[1].gate_up[expert]) and torch.equal(cache.down[slot], layers[1].down[expert])


@given(
    slots=st.integers(2, 2 * EXPERTS), steps=st.lists(st.tuples(st.integers(0, 1), st.lists(st.integers(0, EXPERTS - 1), min_size=2, max_size=8)), max_size=25)
)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_layer_step_reads_its_misses_only_and_the_bank_holds_what_the_slot_maps_say(
    store_dir: StoreDir, policy: str, slots: int, steps: list[tuple[int, list[int]]]
) -> None:
    layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=10 + layer) for layer in range(2)]
    cache = ExpertCache(ExpertStore(store_dir.path, layers), slots, 2, 0, policy)  # top-2: at least two slots
    assert cache.store.read_mode == store_dir.mode
    distinct = 0
    for layer, routed in steps:
        ids = torch.tensor(routed[: len(routed) // 2 * 2], dtype=torch.int32).reshape(-1, 2)  # tokens of top-2
        covered = []
        for rows, slot_map in cache.passes(layer, ids):
            covered += range(ids.shape[0])[rows]
            experts = ids[rows].unique().tolist()
            distinct += len(experts)
            assert len(experts) <= slots
            for expert in experts:  # what the kernel reads through the slot map is that expert's panels
                slot = int(slot_map[expert])
                assert torch.equal(cache.gate_up[slot], layers[layer].gate_up[expert]) and torch.equal(cache.down[slot], layers[layer].down[expert])
        assert covered == list(range(ids.shape[0]))  # consecutive groups, every token once
        mapped = [s for slot_of in cache.slot_of for s in slot_of.tolist() if s >= 0]
        assert sorted(mapped) == sorted(cache.policy.held.values())  # one slot per held expert, -1 elsewhere
    assert cache.hits + cache.misses == distinct
    assert cache.bytes_read == cache.misses * padded(layers[0].gate_up[0].nbytes + layers[0].down[0].nbytes)  # hits read nothing


def test_misses_are_read_once_and_hits_are_not_read(store_dir: StoreDir) -> None:
    layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=layer) for layer in range(2)]
    cache = ExpertCache(ExpertStore(store_dir.path, layers), 4, 2, 0)
    assert cache.store.read_mode == store_dir.mode
    slot_bytes = padded(layers[0].gate_up[0].nbytes + layers[0].down[0].nbytes)
    ids = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    with reads_queued(cache) as queued:
        assert [r for r, _ in cache.passes(0, ids)] == [slice(0, 2)]
        assert queued() == 1  # three adjacent records: one read
    assert (cache.hits, cache.misses, cache.bytes_read) == (0, 3, 3 * slot_bytes)
    list(cache.passes(0, ids))
    assert (cache.hits, cache.misses, cache.bytes_read) == (3, 3, 3 * slot_bytes)
    list(cache.passes(1, torch.tensor([[4, 5]], dtype=torch.int32)))  # evicts layer 0's two least recently used
    assert (cache.misses, cache.evictions) == (5, 1) and int(cache.slot_of[0][0]) == -1 and cache.describe()["slots_used"] == 4
    wide = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 5]], dtype=torch.int32)  # six experts over four slots: two groups of tokens
    assert [r for r, _ in cache.passes(1, wide)] == [slice(0, 2), slice(2, 4)]


@needs_kernels
def test_reads_in_flight_land_every_byte_in_any_order_and_a_short_read_fails_at_its_wait(store_dir: StoreDir) -> None:
    layers = [_random_panels(EXPERTS, (2, 2, 1024), (4, 1, 1024), seed=layer) for layer in range(LAYERS)]
    store = ExpertStore(store_dir.path, layers)
    reads = StoreReads.of(store)
    assert isinstance(reads, AioReads if store.direct else ThreadReads)
    records = torch.frombuffer(mmap.mmap(-1, EXPERTS * store.record), dtype=torch.uint8, count=EXPERTS * store.record).view(EXPERTS, store.record)
    reads.bank(records)
    gate_up_bytes = layers[0].gate_up[0].nbytes
    for layer in range(LAYERS):
        runs = [(0, [5, 1]), (2, [0, 3, 2]), (5, [4])]  # (first expert, its slots): adjacent records, one read each
        started = reads.start([(layer, first, slots) for first, slots in runs])  # one submission
        for (first, slots), read in reversed(list(zip(runs, started))):  # waited for in any order
            assert reads.wait(read)[0] == len(slots) * store.record
            for expert, slot in enumerate(slots, first):
                assert torch.equal(records[slot][:gate_up_bytes], layers[layer].gate_up[expert].reshape(-1))
                assert torch.equal(records[slot][gate_up_bytes : gate_up_bytes + layers[layer].down[expert].nbytes], layers[layer].down[expert].reshape(-1))
    (past_the_end,) = reads.start([(LAYERS, 0, [0])])
    with pytest.raises(OSError, match="gave 0 of"):
        reads.wait(past_the_end)
    if store.direct:  # where the kernel refuses AIO contexts, threads read
        with mock.patch.object(cpu_kernels()[0], "DirectReads", side_effect=RuntimeError("io_setup: Operation not permitted")):
            refused = StoreReads.of(store)
        assert isinstance(refused, ThreadReads) and refused.how == "threads (native AIO: io_setup: Operation not permitted)"


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_a_layer_with_its_shared_expert_gives_the_resident_bits_from_a_bank_of_top_k_slots(store_dir: StoreDir, tokens: int) -> None:
    hidden, inter, experts, top_k = 64, 32, 8, 3
    generator = torch.Generator().manual_seed(tokens)

    def layer() -> SparseMoE:
        torch.manual_seed(0)
        gate_up, down = torch.randn(experts, 2 * inter, hidden) / 8, torch.randn(experts, hidden, inter) / 6
        moe = SparseMoE(torch.randn(experts, hidden), BlockQuantized.of(gate_up, "q4_1"), BlockQuantized.of(down, "q4_1"), top_k, True, "torch")
        shared = [BlockQuantized.of(torch.randn(2 * 64, hidden) / 8, "q8_0"), BlockQuantized.of(torch.randn(hidden, 64) / 8, "q4_0")]
        moe.add_shared_expert(SharedExpert(*shared, torch.randn(1, hidden)))
        return moe

    resident, cached = layer(), layer()
    cache = ExpertCache(ExpertStore(store_dir.path, [cached.panels]), top_k, top_k, 0)
    assert cache.store.read_mode == store_dir.mode and cache.gate_up.stride(0) == cache.slot_bytes == 4096  # 3840 bytes of panels in a padded slot
    dropped = [weakref.ref(t) for t in cached.panels[1:]]
    cached.stream_from(cache, 0)
    gc.collect()
    assert [ref() for ref in dropped] == [None, None]  # the panels live in the store alone
    assert cached.panels.gate_up.is_meta and "from the expert cache" in cached.describe()
    for _ in range(3):
        x, residual = torch.randn(tokens, hidden, generator=generator), torch.randn(tokens, hidden, generator=generator)
        assert torch.equal(cached(x, residual.clone()), resident(x, residual.clone()))
        assert torch.equal(cached(x, None), resident(x, None))
    assert cache.misses > 0 and cache.describe()["slots_used"] == top_k


def _greedy_and_logits(
    path: str, spec: str, store: str, policy: str = "lfu", weight_quant: str = "int4", fill: str = "on-demand", decoder: str = "", prefetch: str = "on"
) -> tuple[dict[str, list[int]], torch.Tensor, ModelRunner]:
    """Greedy tokens of four staggered requests in chunked, mixed steps, and one prompt's logits; ``decoder``: a decoder
    backend in place of the one chosen at load."""
    config = RunnerConfig(
        path, num_blocks=64, block_size=4, weight_quant=weight_quant, expert_cache_bytes=spec, expert_cache_dir=store, expert_cache_policy=policy,
        expert_cache_fill=fill, expert_cache_prefetch=prefetch,
    )  # fmt: skip
    runner = ModelRunner(config)
    if decoder:
        runner.decoder = DECODER_BACKENDS[decoder](runner.model)
    prompts = {f"r{i}": prompt_of(10 + i, n) for i, n in enumerate((3, 9, 14, 22))}
    out, stats = drive(runner, prompts, 10, chunk=6, seed=3, arrivals={"r0": 0, "r1": 0, "r2": 2, "r3": 5})
    assert stats.mixed_steps >= 2 and stats.multi_prefill_steps >= 1  # chunked prefills beside decode batches
    slot = 0 if runner.model.gdn_shape is not None else -1
    prompt = prompt_of(99, 17)
    logits = runner.logits(StepPlan(0, [Slice("l", 0, len(prompt), prompt, list(range(5)), sampling=GREEDY, slot=slot)]))["l"]
    return out, logits, runner


@needs_kernels
@pytest.mark.parametrize("prefetch", EXPERT_CACHE_PREFETCH)
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_greedy_tokens_and_logits_are_the_resident_ones_at_every_cache_size(
    family: str, policy: str, prefetch: str, tiny_qwen3_moes: dict[str, Checkpoint], tiny_qwen3_nexts: dict[str, Checkpoint], store_dir: StoreDir
) -> None:
    tiny = tiny_qwen3_moes["renorm-dense-middle"] if family == "qwen3_moe" else tiny_qwen3_nexts["interval-tied-bias"]
    resident_out, resident_logits, resident = _greedy_and_logits(tiny.path, "0", store_dir.path)
    assert resident.expert_cache is None and resident.describe()["expert_cache"] is None
    top_k, experts = tiny.reference.config.num_experts_per_tok, tiny.reference.config.num_experts
    slot_bytes = padded(2 * 32 * 64 // 32 * 20 + 64 * 32 // 32 * 20)  # q4_1 gate_up [64, 64] + down [64, 32]: 20 bytes per block of 32, in a page
    layers, read_ahead_total = resident.describe()["moe_layers"], 0
    for spec in [str(top_k * slot_bytes), str((top_k + 1) * slot_bytes), str((experts - 1) * slot_bytes), "50%", "100%"]:
        out, logits, runner = _greedy_and_logits(tiny.path, spec, store_dir.path, policy, prefetch=prefetch)
        facts = runner.describe()["expert_cache"]
        assert facts["policy"] == policy and facts["prefetch"] == prefetch
        assert all(moe.held_bytes() == 0 for moe in routed_experts(runner.model))  # the bank alone holds experts
        assert facts["bank_bytes"] == facts["slots"] * slot_bytes
        assert facts["slots"] == min(cache_bytes(spec, slot_bytes * experts * layers) // slot_bytes, experts * layers) and facts["slot_bytes"] == slot_bytes
        read_ahead = sum(facts["prefetched"].values())
        assert facts["misses"] > 0 and facts["bytes_read"] == (facts["misses"] + read_ahead) * slot_bytes and facts["fill_policy"] == "on-demand"
        assert read_ahead == 0 or prefetch == "on", spec
        read_ahead_total += read_ahead
        assert (facts["evictions"] > 0) == (facts["slots"] < experts * layers)
        assert out == resident_out, spec
        assert torch.equal(logits, resident_logits), spec
    assert facts["store_reads"] == store_dir.mode
    assert facts["hit_rate"] > 0.5  # 100 %: only the first touch of each expert misses
    assert (read_ahead_total > 0) == (prefetch == "on")


@needs_kernels
@pytest.mark.parametrize("prefetch", EXPERT_CACHE_PREFETCH)
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("spec", ["50%", "100%"])
def test_the_one_call_decoder_runs_held_experts_in_cpp_and_leaves_the_cache_as_the_per_layer_path_does(
    spec: str, policy: str, prefetch: str, tiny_qwen3_moes: dict[str, Checkpoint], store_dir: StoreDir
) -> None:
    path = tiny_qwen3_moes["renorm-dense-middle"].path
    replayed, replay, in_python, run_cached = [], ExpertCache.replay, [], SparseMoE.run_cached

    def counted(cache: ExpertCache, steps: list[Any], tokens: int | None = None) -> None:
        replayed.extend(step.filled for step in steps if tokens is not None and step.layer >= 0)
        replay(cache, steps, tokens)

    def python_layer(moe: SparseMoE, *args: Any) -> torch.Tensor:
        in_python.append(moe.cache_layer)
        return run_cached(moe, *args)

    with mock.patch.object(ExpertCache, "replay", counted), mock.patch.object(SparseMoE, "run_cached", python_layer):
        one_call = _greedy_and_logits(path, spec, store_dir.path, policy, prefetch=prefetch)
    per_layer = _greedy_and_logits(path, spec, store_dir.path, policy, decoder="fused", prefetch=prefetch)
    assert (one_call[2].decoder.name, per_layer[2].decoder.name) == ("one-call-cpp", "fused")
    if store_dir.mode == "O_DIRECT":  # the bank fills in C++: every layer-step ran there, those with misses too where there were any
        assert not in_python and replayed and (any(replayed) or spec == "100%")
    else:  # layer-steps that found their experts held ran in C++ (reading ahead, those whose next layer's predicted experts were held too)
        assert not any(replayed) and (replayed or (prefetch == "on" and spec != "100%"))
    assert one_call[0] == per_layer[0] and torch.equal(one_call[1], per_layer[1])
    caches = [runner.expert_cache for _, _, runner in (one_call, per_layer)]
    facts = [{k: v for k, v in cache.describe().items() if k not in ("store", "fill_rule")} for cache in caches]
    assert facts[0] == facts[1]  # every hit, miss, eviction and layer-step counted alike
    assert (
        caches[0].policy.held == caches[1].policy.held and caches[0].policy.ranked() == caches[1].policy.ranked()
    )  # the policy heard the same steps in the same order


@needs_kernels
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_preempted_request_recomputed_through_two_slots_continues_as_resident(
    policy: str, tiny_qwen3_nexts: dict[str, Checkpoint], store_dir: StoreDir
) -> None:
    prompt = prompt_of(8, 30)

    def greedy(spec: str) -> tuple[list[int], ModelRunner]:
        config = RunnerConfig(
            tiny_qwen3_nexts["interval-tied-bias"].path, 64, 4, max_num_seqs=3, weight_quant="int4", expert_cache_bytes=spec, expert_cache_dir=store_dir.path,
            expert_cache_policy=policy,
        )  # fmt: skip
        runner = ModelRunner(config)

        def prefill(tokens: list[int], slot: int, first_block: int) -> int:  # chunks of 8: 8 tokens route to more experts than two slots hold
            for start in range(0, len(tokens), 8):
                n, blocks = min(8, len(tokens) - start), list(range(first_block + start // 4, first_block + -(-min(start + 8, len(tokens)) // 4)))
                last = start + n == len(tokens)
                plan = StepPlan(start, [Slice("r", start, n, tokens[start : start + n], blocks, last, GREEDY if start == 0 else None, slot=slot)])
                sampled = runner.execute(plan).sampled
            return sampled[0].token_id

        def decode(pos: int, slot: int, first_block: int) -> int:
            blocks = [first_block + pos // 4] if pos % 4 == 0 else []
            return runner.execute(StepPlan(100 + pos, [Slice("r", pos, 1, new_blocks=blocks, slot=slot)])).sampled[0].token_id

        out = [prefill(prompt, 2, 0)]
        out += [decode(len(prompt) + i, 2, 0) for i in range(5)]
        runner.release(["r"])  # preempted: readmission recomputes prompt + outputs in another slot and other blocks
        out.append(prefill(prompt + out, 0, 20))
        while len(out) < 12:
            out.append(decode(len(prompt) + len(out) - 1, 0, 20))
        return out, runner

    (cached, runner), (resident, _) = greedy("8192"), greedy("0")  # two q4_1 slots of 3840 bytes padded to a page: one layer's top-2
    assert cached == resident and runner.expert_cache.evictions > 0 and runner.expert_cache.store.read_mode == store_dir.mode


@needs_kernels
def test_metrics_count_the_caches_hits_misses_and_bytes(tiny_qwen3_moes: dict[str, Checkpoint], tmp_path: Path) -> None:
    _, _, runner = _greedy_and_logits(tiny_qwen3_moes["renorm-dense-middle"].path, "25%", str(tmp_path))
    text = exposition({}).decode()
    for name in ("hits_total", "misses_total", "evictions_total", "bytes_read_total", "fill_seconds_count", "slots_used", "slots_total"):
        assert f"tokenyard:expert_cache_{name} " in text, name
    assert f"tokenyard:expert_cache_slots_total {float(runner.expert_cache.slots)}" in text


@needs_kernels
def test_what_the_cache_cannot_serve_is_refused_at_start_naming_why(
    tiny_qwen3_moes: dict[str, Checkpoint], tiny_llamas: dict[str, Checkpoint], tmp_path: Path
) -> None:
    moe = tiny_qwen3_moes["renorm-dense-middle"].path

    def start(path: str, spec: str, weight_quant: str = "int4") -> None:
        ModelRunner(RunnerConfig(path, num_blocks=8, block_size=4, weight_quant=weight_quant, expert_cache_bytes=spec, expert_cache_dir=str(tmp_path)))

    with pytest.raises(ValueError, match="serves qwen3_moe and qwen3_next models, not llama"):
        start(tiny_llamas["untied"].path, "50%")
    with pytest.raises(ValueError, match="experts in q4_0 / q4_1 / q8_0 blocks"):
        start(moe, "50%", weight_quant="none")
    with pytest.raises(ValueError, match=r"holds 1 experts of 4096 bytes, fewer than one layer's top-k \(2\): give at least 8192"):
        start(moe, "8191")
    with pytest.raises(ValueError, match="bytes or a percentage"):
        start(moe, "half")
    with pytest.raises(ValueError, match="bytes or a percentage"):
        start(moe, "150%")
    start(moe, "0%")  # all resident, as 0
    with pytest.raises(SystemExit, match="not llama"):
        check_expert_cache(StackConfig(model=tiny_llamas["untied"].path, expert_cache_bytes="25%"))
    with pytest.raises(SystemExit, match="tensor parallelism"):
        check_expert_cache(StackConfig(model=moe, expert_cache_bytes="25%", tensor_parallel_size=2))
    with pytest.raises(SystemExit, match="bytes or a percentage"):
        check_expert_cache(StackConfig(model=moe, expert_cache_bytes="-5"))
    with mock.patch("shutil.disk_usage", return_value=mock.Mock(free=1000)):
        with pytest.raises(ValueError, match=f"the expert store needs 65536 bytes in {tmp_path}, which has 1000 free"):
            start(moe, "50%")
    assert os.listdir(tmp_path) == []  # no store was left behind


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _allocated() -> int:
    """The bytes malloc has handed out and not had back (tensors' and arrays' data among them), however much of the heap stays resident."""
    mallinfo2 = ctypes.CDLL(ctypes.util.find_library("c")).mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd


def _measured_at(name: str) -> bool:
    """Whether a routed expert's tensor read is one to measure the heap at: every 8th expert's (mallinfo2 walks every
    free chunk of the heap, ~15 ms a call late in a long test run, and a load reads 8 layers x 64 experts x 3 tensors)."""
    return int(name.split(ROUTED_EXPERTS)[1].split(".")[0]) % 8 == 7


WIDE_LAYERS, WIDE_EXPERTS = 8, 64


@pytest.fixture(scope="module")
def wide_moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A qwen3_moe GGUF whose q4_0 experts (8 layers of 64, 864 KiB a layer) outweigh the rest of it many times over."""
    overrides = {"num_hidden_layers": WIDE_LAYERS, "num_experts": WIDE_EXPERTS, "moe_intermediate_size": 128, "norm_topk_prob": True}
    return tiny_gguf("qwen3_moe", str(tmp_path_factory.mktemp("wide-moe")), {"matrices": Q.Q4_0}, **overrides)[0]


@needs_kernels
def test_loading_into_an_expert_cache_holds_about_one_layer_of_experts_at_a_time_and_decodes_as_resident(wide_moe_gguf: str, disk_dir: str) -> None:
    layer_bytes = WIDE_EXPERTS * (2 * 128 * 64 + 64 * 128) // 32 * 18  # q4_0: 18 bytes a block of 32
    resident_out, resident_logits, resident = _greedy_and_logits(wide_moe_gguf, "0", disk_dir, weight_quant="none")
    assert sum(moe.held_bytes() for moe in routed_experts(resident.model)) == WIDE_LAYERS * layer_bytes
    del resident
    gc.collect()
    held, append = [], ExpertStore.append

    def tracked(store: ExpertStore, panels: ExpertPanels) -> None:  # what the process holds as each layer's experts reach the store
        held.append(_allocated() - before)
        append(store, panels)

    before = _allocated()
    with mock.patch.object(ExpertStore, "append", tracked):
        out, logits, runner = _greedy_and_logits(wide_moe_gguf, "25%", disk_dir, weight_quant="none")
    assert len(held) == WIDE_LAYERS and runner.expert_cache.store.nbytes == 4 * runner.expert_cache.nbytes  # experts 4x the bank
    assert max(held) < 3 * layer_bytes < WIDE_LAYERS * layer_bytes / 2, [
        round(h / layer_bytes, 2) for h in held
    ]  # one layer in flight beside the rest of the model
    assert all(moe.held_bytes() == 0 for moe in routed_experts(runner.model))
    assert out == resident_out and torch.equal(logits, resident_logits)


def _experts_on_the_q4_1_grid(source: str, target: Path) -> str:
    """A copy of the checkpoint at ``source`` whose routed experts lie on the q4_1 grid (as if converted from a q4_1
    GGUF): ``auto`` serves them in their blocks, losslessly."""
    shutil.copytree(source, target)
    for file in target.glob("*.safetensors"):
        tensors = safetensors.torch.load_file(file)
        for name, t in tensors.items():
            if ROUTED_EXPERTS in name:
                rows = t.reshape(-1, t.shape[-1])
                tensors[name] = block_quant.dequantize(block_quant.quantize(rows, "q4_1"), "q4_1").reshape(t.shape)
        safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    return str(target)


@needs_kernels
@pytest.mark.parametrize("weight_quant", ["int4-a8", "auto"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_checkpoints_float_experts_quantized_as_they_load_decode_as_resident_from_one_layers_top_k_slots(
    family: str, weight_quant: str, tiny_qwen3_moes: dict[str, Checkpoint], tiny_qwen3_nexts: dict[str, Checkpoint], disk_dir: str, tmp_path: Path
) -> None:
    tiny = tiny_qwen3_moes["renorm-dense-middle"] if family == "qwen3_moe" else tiny_qwen3_nexts["interval-tied-bias"]
    path = tiny.path if weight_quant != "auto" else _experts_on_the_q4_1_grid(tiny.path, tmp_path / "on-grid")  # auto: in blocks only where lossless
    resident_out, resident_logits, resident = _greedy_and_logits(path, "0", disk_dir, weight_quant=weight_quant)
    assert set(resident.describe()["expert_weights"]) <= {
        "q4_1: grouped_moe (C++, one call per layer)",
        "q4_1: grouped_moe (C++, one call per layer), shared expert in the call",
    }
    out, logits, runner = _greedy_and_logits(path, str(tiny.reference.config.num_experts_per_tok * 4096), disk_dir, weight_quant=weight_quant)
    assert runner.expert_cache.evictions > 0 and runner.describe()["expert_weights"] == {
        f"{kind}, from the expert cache": n for kind, n in resident.describe()["expert_weights"].items()
    }
    assert out == resident_out and torch.equal(logits, resident_logits)


@pytest.fixture(scope="module")
def wide_moe_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A qwen3_moe checkpoint in transformers' safetensors whose float32 experts (8 layers of 64, 6 MiB a layer) outweigh the
    rest of it many times over, by the ``--weight-quant`` that serves it: int4 as is, auto with its experts on the q4_1 grid."""
    root = tmp_path_factory.mktemp("wide-moe-hf")
    overrides = {"num_hidden_layers": WIDE_LAYERS, "num_experts": WIDE_EXPERTS, "moe_intermediate_size": 128, "norm_topk_prob": True}
    build_tiny("qwen3_moe", str(root / "float"), **overrides)
    return {"int4": str(root / "float"), "auto": _experts_on_the_q4_1_grid(str(root / "float"), root / "on-grid")}


@needs_kernels
@pytest.mark.parametrize("weight_quant", ["int4", "auto"])
def test_loading_a_checkpoint_into_an_expert_cache_reads_one_layer_of_experts_at_a_time_and_decodes_as_resident(
    weight_quant: str, wide_moe_checkpoints: dict[str, str], disk_dir: str
) -> None:
    path, float_layer = wide_moe_checkpoints[weight_quant], WIDE_EXPERTS * 3 * 128 * 64 * 4
    resident_out, resident_logits, resident = _greedy_and_logits(path, "0", disk_dir, weight_quant=weight_quant)
    assert resident.describe()["expert_weights"] == {"q4_1: grouped_moe (C++, one call per layer)": WIDE_LAYERS}
    del resident
    gc.collect()
    events: list[tuple[str, int]] = []  # ("read", layer) as an expert tensor is read from the file, ("stored", layer) as a layer's experts reach the store
    held: list[int] = []  # what the process holds at each "stored" and at every 8th expert's reads
    read, append = SafetensorsFile.read, ExpertStore.append

    def tracked_read(file: SafetensorsFile, name: str, *args: object) -> torch.Tensor:
        if ROUTED_EXPERTS in name:
            events.append(("read", int(name.split(".")[2])))
            if _measured_at(name):
                held.append(_allocated() - before)
        return read(file, name, *args)

    def tracked_append(store: ExpertStore, panels: ExpertPanels) -> None:
        held.append(_allocated() - before)
        append(store, panels)
        events.append(("stored", store.written - 1))

    before = _allocated()
    with mock.patch.object(SafetensorsFile, "read", tracked_read), mock.patch.object(ExpertStore, "append", tracked_append):
        out, logits, runner = _greedy_and_logits(path, "25%", disk_dir, weight_quant=weight_quant)
    layers = [event for i, event in enumerate(events) if i == 0 or event != events[i - 1]]
    assert layers == [(kind, layer) for layer in range(WIDE_LAYERS) for kind in ("read", "stored")]  # a layer's experts stored before the next layer's are read
    assert runner.expert_cache.store.nbytes == 4 * runner.expert_cache.nbytes  # experts 4x the bank
    # int4: each expert quantized as it is read, so not even one layer's floats at once; auto: one layer's floats in flight (to find their exact format)
    layers_in_flight = {"int4": 1, "auto": 2}[weight_quant]
    assert max(held) < layers_in_flight * float_layer < WIDE_LAYERS * float_layer / 2, [round(h / float_layer, 2) for h in held]
    assert all(moe.held_bytes() == 0 for moe in routed_experts(runner.model))
    assert out == resident_out and torch.equal(logits, resident_logits)


@needs_kernels
def test_without_a_cache_int4_experts_still_load_a_layer_at_a_time(wide_moe_checkpoints: dict[str, str], disk_dir: str) -> None:
    """All experts resident: each layer's experts go into blocks as it is built (not every layer's floats first, then
    all converted), giving the same bits as quantizing the whole stacks after the model is built."""
    path, float_layer = wide_moe_checkpoints["int4"], WIDE_EXPERTS * 3 * 128 * 64 * 4
    with mock.patch.object(weights_loading, "EXPERT_QUANT", ContextVar("unread", default="none")):  # floats at load, converted once the model is built
        after_out, after_logits, after = _greedy_and_logits(path, "0", disk_dir)
    assert after.describe()["expert_weights"] == {"q4_1: grouped_moe (C++, one call per layer)": WIDE_LAYERS}
    del after
    gc.collect()
    held: list[int] = []  # what the process holds as every 8th expert's tensors are read
    read = SafetensorsFile.read

    def tracked_read(file: SafetensorsFile, name: str, *args: object) -> torch.Tensor:
        if ROUTED_EXPERTS in name and _measured_at(name):
            held.append(_allocated() - before)
        return read(file, name, *args)

    before = _allocated()
    with mock.patch.object(SafetensorsFile, "read", tracked_read):
        out, logits, runner = _greedy_and_logits(path, "0", disk_dir)
    assert runner.describe()["expert_weights"] == {"q4_1: grouped_moe (C++, one call per layer)": WIDE_LAYERS}
    assert max(held) < 3 * float_layer < WIDE_LAYERS * float_layer / 2, [
        round(h / float_layer, 2) for h in held
    ]  # blocks of every layer read so far, one layer's floats at most
    assert out == after_out and torch.equal(logits, after_logits)


def test_a_failed_read_frees_its_slots_and_the_runs_read_beside_it_are_held(store_dir: StoreDir) -> None:
    layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=layer) for layer in range(1)]
    cache = ExpertCache(ExpertStore(store_dir.path, layers), 6, 2, 0)
    with failing_reads(cache, lambda layer, first: first == 3), pytest.raises(OSError, match="Input/output"):
        cache.fill(0, [0, 3, 5])  # three runs, read side by side: the second fails
    assert sorted(cache.policy.held) == [(0, 0), (0, 5)] and cache.slot_of[0].tolist()[3] == -1
    for expert in (0, 5):
        slot = int(cache.slot_of[0][expert])
        assert torch.equal(cache.gate_up[slot], layers[0].gate_up[expert]) and torch.equal(cache.down[slot], layers[0].down[expert])
    cache.fill(0, [3])  # read again on the next try
    assert torch.equal(cache.gate_up[int(cache.slot_of[0][3])], layers[0].gate_up[3])


def test_experts_read_ahead_land_as_the_next_layers_hits_and_a_failed_one_is_read_again_on_demand(store_dir: StoreDir) -> None:
    layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=layer) for layer in range(2)]
    cache = ExpertCache(ExpertStore(store_dir.path, layers), 8, 2, 0, "lfu", "on-demand")
    slot_bytes = cache.slot_bytes
    with failing_reads(cache, lambda layer, first: (layer, first) == (1, 4)):
        cache.fill(0, [0, 1], ahead=(1, [2, 4]))  # layer 1's 2 and 4 read ahead while layer 0 runs; 4's read fails
        assert cache.slot_of[1].tolist()[2] == -1  # not mapped until it has landed
        cache.fill(1, [2, 3, 4])
    assert cache.prefetched == {"used": 1, "unused": 0} and (cache.hits, cache.misses) == (0, 4)  # 4 read again on demand
    assert cache.bytes_read == 5 * slot_bytes
    for expert in (2, 3, 4):
        slot = int(cache.slot_of[1][expert])
        assert torch.equal(cache.gate_up[slot], layers[1].gate_up[expert]) and torch.equal(cache.down[slot], layers[1].down[expert])
    cache.fill(1, [0], ahead=(0, [0, 5]))  # 0 is held: only 5 is read ahead
    cache.begin_step(1)  # a read ahead that no layer-step used lands at the latest when the next step begins
    assert cache.prefetched == {"used": 1, "unused": 1} and int(cache.slot_of[0][5]) >= 0
    assert cache.describe()["hit_rate"] == round(cache.hits / (cache.hits + cache.misses + 1), 4)
    off = ExpertCache(ExpertStore(store_dir.path, layers), 8, 2, 0, "lfu", "on-demand", prefetch="off")
    off.fill(0, [0], ahead=(1, [2]))
    assert off.prefetched == {"used": 0, "unused": 0} and off.slot_of[1].tolist()[2] == -1 and not off.policy.held.get((1, 2))


@needs_kernels
def test_a_read_that_fails_inside_the_one_call_decoder_reaches_the_caller_and_the_next_step_runs_as_resident(
    tiny_qwen3_moes: dict[str, Checkpoint], store_dir: StoreDir
) -> None:
    path, prompt = tiny_qwen3_moes["renorm-dense-middle"].path, prompt_of(5, 12)

    def plan(rid: str) -> StepPlan:
        return StepPlan(0, [Slice(rid, 0, len(prompt), prompt, list(range(4)), sampling=GREEDY)])

    resident = ModelRunner(RunnerConfig(path, num_blocks=16, block_size=4, weight_quant="int4")).logits(plan("r"))["r"]
    runner = ModelRunner(RunnerConfig(path, num_blocks=16, block_size=4, weight_quant="int4", expert_cache_bytes="50%", expert_cache_dir=store_dir.path))
    assert runner.decoder.name == "one-call-cpp"
    with failing_reads(runner.expert_cache, lambda layer, first: True):
        with pytest.raises(OSError, match="Input/output"):  # raised in a fill the C++ decoder called back for
            runner.logits(plan("failed"))
    runner.release(["failed"])
    assert torch.equal(runner.logits(plan("r"))["r"], resident)  # nothing of the failed step is held as if read


TINY_SLOT_BYTES = padded(2 * 32 * 64 // 32 * 20 + 64 * 32 // 32 * 20)  # the tiny checkpoints' q4_1 experts: gate_up [64, 64] + down [64, 32]


@pytest.fixture(scope="module")
def four_moe_layers(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny qwen3_moe whose four layers are all MoE: 32 experts, so that a bank can lend two layers' 16 and keep some."""
    path = str(tmp_path_factory.mktemp("four-moe-layers") / "model")
    build_tiny("qwen3_moe", path, num_hidden_layers=4)
    return path


@needs_kernels
@pytest.mark.parametrize("fill", ["streamed", "auto"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_streamed_steps_give_the_resident_tokens_and_logits(
    family: str, fill: str, four_moe_layers: str, tiny_qwen3_nexts: dict[str, Checkpoint], store_dir: StoreDir
) -> None:
    path = four_moe_layers if family == "qwen3_moe" else tiny_qwen3_nexts["gqa-dense-layer"].path  # 4 and 3 MoE layers of 8 experts
    resident_out, resident_logits, _ = _greedy_and_logits(path, "0", store_dir.path)
    for slots in (16, 19):  # two layers' experts lent, and three slots beside them
        out, logits, runner = _greedy_and_logits(path, str(slots * TINY_SLOT_BYTES), store_dir.path, fill=fill)
        facts = runner.describe()["expert_cache"]
        assert (facts["slots"], facts["fill_policy"], facts["streamed_prefill"]) == (slots, fill, "on")
        if fill == "streamed":  # prefill chunks stream, one-token decode steps read their misses
            assert facts["layer_steps"]["streamed"] > 0 and facts["layer_steps"]["on-demand"] > 0
        assert facts["bytes_read"] >= facts["misses"] * TINY_SLOT_BYTES
        assert out == resident_out, slots
        assert torch.equal(logits, resident_logits), slots


def _four_layer_cache(directory: str, slots: int, fill: str = "streamed") -> tuple[ExpertCache, list[ExpertPanels]]:
    layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=20 + layer) for layer in range(4)]
    return ExpertCache(ExpertStore(directory, layers), slots, 2, 0, "lfu", fill), layers


def _holds(cache: ExpertCache, layers: list[ExpertPanels], layer: int, expert: int, slot: int) -> bool:
    return torch.equal(cache.gate_up[slot], layers[layer].gate_up[expert]) and torch.equal(cache.down[slot], layers[layer].down[expert])


@pytest.mark.parametrize("slots", [2 * EXPERTS + 4, 2 * EXPERTS + 1])
def test_a_streamed_step_reads_every_layer_whole_into_two_lent_halves_and_keeps_the_rest_of_the_bank(store_dir: StoreDir, slots: int) -> None:
    cache, layers = _four_layer_cache(store_dir.path, slots)
    cache.fill(3, [0, 1, 2, 3])  # four held experts; slots - 4 free
    evicted = max(0, 2 * EXPERTS - (slots - 4))
    cache.begin_step(5)
    assert cache.streaming and cache.evictions == evicted and len(cache.policy.held) == 4 - evicted
    kept = dict(cache.policy.held)
    seen = []
    for layer in range(4):
        slot_map = cache.streamed(layer)
        seen.append(slot_map.tolist())
        assert all(_holds(cache, layers, layer, e, int(slot_map[e])) for e in range(EXPERTS))  # the whole layer, read before its call
        assert not set(slot_map.tolist()) & set(kept.values())  # never in a held expert's slot
        cache.layer_ran(layer, 5, 0.001)
    assert not cache.streaming  # the last layer gave the slots back
    assert seen[0] == seen[2] and seen[1] == seen[3] and not set(seen[0]) & set(seen[1])  # two halves, in turn
    for (layer, expert), slot in kept.items():  # the rest of the bank as it was
        assert _holds(cache, layers, layer, expert, slot) and int(cache.slot_of[layer][expert]) == slot
    assert sorted(cache.policy.free + list(cache.policy.held.values())) == list(range(slots))
    assert cache.describe()["layer_steps"] == {"on-demand": 1, "streamed": 4}
    cache.fill(0, [4, 5])  # on demand again, from the slots given back
    assert all(_holds(cache, layers, 0, e, int(cache.slot_of[0][e])) for e in (4, 5))


def test_a_step_that_failed_mid_stream_gives_its_slots_back_before_the_next_one(store_dir: StoreDir) -> None:
    cache, layers = _four_layer_cache(store_dir.path, 2 * EXPERTS + 2)
    cache.begin_step(4)
    cache.streamed(0)  # the step fails after its first layer
    cache.fill(2, [1])  # the next step's on-demand fill
    assert not cache.streaming and _holds(cache, layers, 2, 1, int(cache.slot_of[2][1]))
    assert len(cache.policy.free) == 2 * EXPERTS + 1


def test_the_fill_rule_streams_where_a_whole_layer_costs_less_than_the_misses(store_dir: StoreDir) -> None:
    cache, _ = _four_layer_cache(store_dir.path, 2 * EXPERTS + 1, fill="auto")
    cache.fill_rate = cache.stream_rate = 1e9
    cache.compute_per_token, cache.hit_rate_recent = 0.0, 0.0
    # 6 experts, top-2: t tokens touch 6 * (1 - (2/3)^t) of them; equal rates and no overlap: a layer never costs less.
    assert not any(cache._streamed_is_faster(t) for t in (1, 2, 16, 64))
    cache.stream_rate = 2e9  # sequential reads twice as fast: streams once the misses pass half a layer (3.33 experts at 2 tokens)
    assert [cache._streamed_is_faster(t) for t in (1, 2, 16)] == [False, True, True]
    cache.hit_rate_recent = 0.9  # most of a layer held: its misses are cheaper than the layer
    assert not cache._streamed_is_faster(64)
    cache.compute_per_token = 1.0  # compute that hides any read: streaming is free
    assert cache._streamed_is_faster(64)
    for tokens, streams in ((1, False), (15, False), (64, True)):  # the step's choice, by its token count
        cache.begin_step(tokens)
        assert cache.streaming == streams and cache.describe()["last_step_fill"] == ("streamed" if streams else "on-demand")
        cache.begin_step(1)
    cache.compute_per_token = 0.0  # on demand is cheaper again: seven steps of 64 kept on demand, the eighth streams to measure
    assert [(cache.begin_step(64), cache.streaming)[1] for _ in range(9)] == [False] * 7 + [True, False]


def test_a_bank_that_cannot_lend_two_layers_fills_on_demand_and_says_why(store_dir: StoreDir) -> None:
    cache, _ = _four_layer_cache(store_dir.path, 2 * EXPERTS - 1)
    cache.begin_step(64)
    assert not cache.streaming
    assert cache.describe()["streamed_prefill"] == f"off (the bank's {2 * EXPERTS - 1} slots are fewer than two layers' {2 * EXPERTS} experts)"
    whole, _ = _four_layer_cache(store_dir.path, 4 * EXPERTS)
    assert whole.describe()["streamed_prefill"] == "off (the bank holds every expert)"


def test_a_fill_mode_the_cache_does_not_know_is_refused_before_loading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--expert-cache-fill is one of auto, on-demand, streamed, not 'sometimes'"):
        ExpertSpill.plan("25%", str(tmp_path), "lfu", torch.device("cpu"), False, "sometimes")
    assert ExpertSpill.plan("25%", str(tmp_path), "lfu", torch.device("cpu"), False, "streamed").fill == "streamed"
