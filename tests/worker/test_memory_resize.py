"""Memory moved at runtime (``ModelRunner.resize_memory``): the expert cache's bank rebuilt at a new size keeps the
experts its policy ranks highest that fit (the most recently used under LRU, the most used under LFU, with their
counts), byte for byte, under consistent slot maps; the KV cache rebuilt at a new block count; the weights stay; greedy tokens after any resize are the resident ones; and what cannot be applied is refused,
naming why, with nothing changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.worker.cpu_kernels import cpu_kernels
from services.worker.expert_cache import ExpertCache, ExpertStore
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan

from .harness import GREEDY, Checkpoint, drive, prompt_of
from .test_expert_cache import EXPERTS, _random_panels

needs_kernels = pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")


def _bank_holds_what_the_maps_say(cache: ExpertCache, layers: list) -> None:
    for layer, slot_of in enumerate(cache.slot_of):
        for expert, slot in enumerate(slot_of.tolist()):
            if slot >= 0:
                assert cache.policy.held[(layer, expert)] == slot
                assert torch.equal(cache.gate_up[slot], layers[layer].gate_up[expert]) and torch.equal(cache.down[slot], layers[layer].down[expert])
    assert sorted([*cache.policy.held.values(), *cache.policy.free]) == list(range(cache.slots))  # no slot leaked


def test_a_rebuilt_lfu_bank_keeps_the_most_used_experts_with_their_counts(tmp_path: Path) -> None:
    layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=layer) for layer in range(2)]
    cache = ExpertCache(ExpertStore(str(tmp_path), layers), 6, 2, 0, "lfu")
    for layer, experts in [(0, [0, 1]), (1, [2, 3]), (0, [0, 1]), (1, [2]), (0, [4, 5]), (1, [2])]:
        list(cache.passes(layer, torch.tensor([experts], dtype=torch.int32)))
    counts = {key: int(cache.policy.count[slot]) for key, slot in cache.policy.held.items()}
    cache.resize(3 * cache.slot_bytes)
    assert cache.slots == 3 and set(cache.policy.held) == {(1, 2), (0, 0), (0, 1)}  # the three most used
    assert {key: int(cache.policy.count[slot]) for key, slot in cache.policy.held.items()} == {key: counts[key] for key in cache.policy.held}
    _bank_holds_what_the_maps_say(cache, layers)
    cache.resize(10 * cache.slot_bytes)
    assert cache.slots == 10 and len(cache.policy.held) == 3 and len(cache.policy.free) == 7
    list(cache.passes(1, torch.tensor([[0, 1], [4, 5]], dtype=torch.int32)))
    _bank_holds_what_the_maps_say(cache, layers)


def test_a_rebuilt_bank_keeps_the_most_recently_used_experts_that_fit(tmp_path: Path) -> None:
    layers = [_random_panels(EXPERTS, (8, 2, 20), (8, 1, 20), seed=layer) for layer in range(2)]
    cache = ExpertCache(ExpertStore(str(tmp_path), layers), 6, 2, 0)
    for layer, experts in [(0, [0, 1]), (1, [2, 3]), (0, [4, 5]), (1, [0])]:  # (0, 0) is evicted by (1, 0)
        list(cache.passes(layer, torch.tensor([experts], dtype=torch.int32)))
    order = list(cache.policy.held)
    cache.resize(3 * cache.slot_bytes)
    assert cache.slots == 3 and list(cache.policy.held) == order[-3:] and cache.nbytes == 3 * cache.slot_bytes
    _bank_holds_what_the_maps_say(cache, layers)
    cache.resize(10 * cache.slot_bytes)  # growing keeps them all, and the new slots are free
    assert cache.slots == 10 and list(cache.policy.held) == order[-3:] and len(cache.policy.free) == 7
    _bank_holds_what_the_maps_say(cache, layers)
    list(cache.passes(0, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)))
    _bank_holds_what_the_maps_say(cache, layers)
    cache.resize(1 << 40)  # more than every expert: one slot each
    assert cache.slots == 2 * EXPERTS and cache.describe()["bytes"] == 1 << 40
    with pytest.raises(ValueError, match=f"holds 1 experts of {cache.slot_bytes} bytes, fewer than one layer's top-k \\(2\\)"):
        cache.resize(2 * cache.slot_bytes - 1)
    assert cache.slots == 2 * EXPERTS  # a refused size changes nothing
    _bank_holds_what_the_maps_say(cache, layers)


@needs_kernels
def test_greedy_tokens_after_moving_memory_both_ways_are_the_resident_ones(tiny_qwen3_moes: dict[str, Checkpoint], tmp_path: Path) -> None:
    path = tiny_qwen3_moes["renorm-dense-middle"].path
    prompts = {f"r{i}": prompt_of(30 + i, n) for i, n in enumerate((4, 11, 19))}

    def runner(spec: str) -> ModelRunner:
        return ModelRunner(RunnerConfig(path, num_blocks=64, block_size=4, weight_quant="int4", expert_cache_bytes=spec, expert_cache_dir=str(tmp_path)))

    resident = runner("0")
    expected, _ = drive(resident, prompts, 8, chunk=5, seed=1)
    with pytest.raises(ValueError, match="no expert cache"):
        resident.resize_memory(expert_cache_bytes=1 << 20)

    cached = runner("25%")
    cache, weights = cached.expert_cache, cached.model.embed
    slot_bytes, block_bytes = cache.slot_bytes, cached.memory_split().kv_block_bytes
    assert drive(cached, prompts, 8, chunk=5, seed=1)[0] == expected
    for kv_blocks, slots in [(20, cache.top_k), (200, cache.experts), (48, 5)]:
        cached.resize_memory(kv_blocks * block_bytes + block_bytes // 2, slots * slot_bytes)
        split = cached.memory_split()
        assert (split.kv_blocks, split.expert_slots, split.kv_cache_bytes) == (kv_blocks, slots, kv_blocks * block_bytes)
        assert cached.kv_cache.num_blocks == kv_blocks and cached.describe()["kv_cache_bytes"] == kv_blocks * block_bytes
        assert cached.expert_cache is cache and cached.model.embed is weights  # the weights and the store stay
        assert drive(cached, prompts, 8, chunk=5, seed=2)[0] == expected, (kv_blocks, slots)

    cached.execute(StepPlan(0, [Slice("held", 0, 3, [1, 2, 3], [0], sampling=GREEDY)]))
    with pytest.raises(ValueError, match="1 requests still hold the KV cache"):
        cached.resize_memory(kv_cache_bytes=64 * block_bytes)
    cached.release(["held"])
    with pytest.raises(ValueError, match="holds no KV block"):
        cached.resize_memory(kv_cache_bytes=block_bytes - 1, expert_cache_bytes=cache.experts * slot_bytes)
    assert (cached.num_blocks, cache.slots) == (48, 5)  # a refused split changes neither size
