"""A GPU worker's expert cache (services/worker/device_expert_cache.py), run here on the CPU as its own device: the
experts' kernel over the bank gives the all-resident output at every bank size from one layer's top-k up, a step
routing to more experts than the bank holds included, to the bit (the torch path, and the fused Triton MoE under the
interpreter);
the bank holds what the slot maps say and its zero slot stays zeros; the co-execution rule chooses the CPU below
``cpu_rate / copy_rate`` tokens an expert, as injected rates say, and the experts it sends there take no slot and
add the same products; a MoE layer loaded into the spill keeps no experts of its own and runs from the bank."""

from __future__ import annotations

from multiprocessing.pool import Pool
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from prometheus_client import REGISTRY

from services.worker.device_expert_cache import CoExecution, DeviceExpertCache, DeviceExpertSpill
from services.worker.moe import EXPERT_SINK, SparseMoE, experts_torch, route
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan
from shared.metrics import exposition

from .harness import GREEDY, Checkpoint, drive, prompt_of, rel_err

LAYERS, EXPERTS, TOP_K, HIDDEN, INTER = 3, 8, 2, 32, 16


def _layers(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=generator).to(dtype) / 4, torch.randn(EXPERTS, HIDDEN, INTER, generator=generator).to(dtype) / 4)
        for _ in range(LAYERS)
    ]


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=generator), TOP_K, renormalize=True)
    return x, weights, ids


def _steps() -> list[tuple[int, int, int]]:
    """(layer, tokens, seed) of a few decode-sized and prefill-sized layer-steps, every layer in turn."""
    return [(layer, tokens, 10 * step + layer) for step, tokens in enumerate((1, 3, 1, 9, 2, 1)) for layer in range(LAYERS)]


@pytest.mark.parametrize("slots", [TOP_K, TOP_K + 1, EXPERTS, LAYERS * EXPERTS])
def test_the_bank_gives_the_resident_output_at_every_size_and_holds_what_its_slot_maps_say(slots: int) -> None:
    layers = _layers()
    cache = DeviceExpertCache(layers, slots, TOP_K, 0, torch.device("cpu"), "lfu")
    for layer, tokens, seed in _steps():
        x, weights, ids = _routing(tokens, seed)
        residual = torch.randn(tokens, HIDDEN)
        expected = experts_torch(x, *layers[layer], weights, ids, residual)
        out = cache.run(layer, x, weights, ids, residual, experts_torch)
        if len(ids.unique()) <= slots:  # each expert's rows from its slot, in the same order
            assert torch.equal(out, expected)
        else:  # in groups of tokens: the torch GEMMs round by their row count
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for (held_layer, expert), slot in cache.policy.held.items():
            assert cache.slot_of[held_layer][expert] == slot
            assert torch.equal(cache.gate_up[slot], layers[held_layer][0][expert]) and torch.equal(cache.down[slot], layers[held_layer][1][expert])
    assert len(cache.policy.held) <= slots and not cache.gate_up[cache.zero_slot].any() and not cache.down[cache.zero_slot].any()
    assert cache.misses > 0 and (cache.evictions > 0) == (slots < LAYERS * EXPERTS)
    assert cache.bytes_copied == cache.misses * cache.expert_bytes and cache.describe()["cpu_experts"] == "off"


def _bank_and_resident(layers: list[tuple[torch.Tensor, torch.Tensor]], slots: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    from services.worker.kernels.fused_moe import fused_moe  # imported in the interpreter's process

    cache = DeviceExpertCache(layers, slots, TOP_K, 0, torch.device("cpu"), "lru")
    x, weights, ids = _routing(tokens, seed=tokens)
    return cache.run(1, x, weights, ids, None, fused_moe), fused_moe(x, *layers[1], weights, ids)


@pytest.mark.parametrize("slots,tokens", [(TOP_K, 1), (TOP_K + 1, 6), (LAYERS * EXPERTS, 6)])
def test_the_fused_triton_moe_over_the_bank_gives_the_resident_bits(interpreter: Pool, slots: int, tokens: int) -> None:
    pytest.importorskip("triton")
    cached, resident = interpreter.apply(_bank_and_resident, (_layers(seed=3), slots, tokens))
    assert torch.equal(cached, resident)  # each pair's expert read from its slot; the top-k sum in the same order


@pytest.mark.parametrize(
    "copy_rate,cpu_rate,most",
    [(1e9, 1e8, 0), (1e9, 1e9, 0), (1e9, 1.5e9, 1), (1e9, 4e9, 3), (1e9, 4.5e9, 4), (12e9, 50e9, 4)],
)
def test_an_expert_runs_on_the_cpu_below_cpu_rate_over_copy_rate_tokens(copy_rate: float, cpu_rate: float, most: int) -> None:
    rule = CoExecution(copy_rate, cpu_rate)
    assert [rule.runs_on_cpu(tokens) for tokens in range(1, 8)] == [tokens <= most for tokens in range(1, 8)]
    assert rule.most_cpu_tokens == most


def test_the_rates_follow_what_copies_and_cpu_products_measure_and_must_be_positive() -> None:
    rule = CoExecution(1e9, 1e9)
    for _ in range(40):
        rule.copied(1_000_000, 1e-4)  # 10 GB/s over the bus
        rule.computed(3_000_000, 1e-4)  # 30 GB/s through the CPU
    assert rule.copy_rate == pytest.approx(1e10, rel=1e-3) and rule.cpu_rate == pytest.approx(3e10, rel=1e-3)
    assert rule.most_cpu_tokens == 2
    with pytest.raises(ValueError, match="positive"):
        CoExecution(0, 1e9)


def test_experts_few_tokens_route_to_run_on_the_cpu_take_no_slot_and_add_the_same_products() -> None:
    layers = _layers(seed=5)
    cache = DeviceExpertCache(layers, EXPERTS, TOP_K, 0, torch.device("cpu"), "lfu", cpu=CoExecution(copy_rate=1e9, cpu_rate=2.5e9))  # up to 2 tokens
    x, weights, ids = _routing(12, seed=7)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS)
    counted = REGISTRY.get_sample_value("tokenyard:expert_cache_cpu_experts_total")
    residual = torch.randn(12, HIDDEN)
    out = cache.run(0, x, weights, ids, residual, experts_torch)
    torch.testing.assert_close(out, experts_torch(x, *layers[0], weights, ids, residual), rtol=1e-5, atol=1e-5)
    on_cpu = {e for e in range(EXPERTS) if 0 < counts[e] <= 2}
    assert on_cpu and cache.cpu_expert_steps == len(on_cpu) and cache.cpu_pairs == sum(int(counts[e]) for e in on_cpu)
    assert {expert for _, expert in cache.policy.held} == {e for e in range(EXPERTS) if counts[e] > 2}
    assert not cache.gate_up[cache.zero_slot].any()
    described = cache.describe()["cpu_experts"]
    assert described["expert_layer_steps"] == len(on_cpu) and described["most_tokens_on_cpu"] >= 0
    assert f"tokenyard:expert_cache_cpu_experts_total {float(counted + len(on_cpu))}" in exposition({}).decode()


def test_a_moe_layer_loaded_into_the_spill_keeps_no_experts_and_runs_from_the_bank() -> None:
    config = {"model_type": "qwen3_moe", "num_experts_per_tok": TOP_K, "num_hidden_layers": LAYERS, "num_experts": EXPERTS}
    spill = DeviceExpertSpill.plan("50%", "lfu", "off", torch.device("cpu"), sharded=False)
    assert spill is not None and DeviceExpertSpill.plan("0", "lfu", "auto", torch.device("cpu"), sharded=False) is None
    spill.begin(config)
    layers, routers = _layers(seed=9), [torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(LAYERS)]
    resident = [SparseMoE(router, gate_up, down, TOP_K, True, "torch") for router, (gate_up, down) in zip(routers, layers)]
    token = EXPERT_SINK.set(spill)
    try:
        cached = [SparseMoE(router, gate_up.clone(), down.clone(), TOP_K, True, "torch") for router, (gate_up, down) in zip(routers, layers)]
    finally:
        EXPERT_SINK.reset(token)
    assert all(moe.w_gate_up.is_meta and moe.w_down.is_meta for moe in cached)  # the experts live in host memory only
    cache = spill.attach(SimpleNamespace(layers=[SimpleNamespace(mlp=moe) for moe in cached]))
    assert cache.slots == LAYERS * EXPERTS // 2 and cache.cpu is None
    for _ in range(4):
        for layer in range(LAYERS):
            x, residual = torch.randn(3, HIDDEN), torch.randn(3, HIDDEN)
            assert torch.equal(cached[layer](x, residual), resident[layer](x, residual))
    assert cache.hits > 0 and cache.misses > 0 and "from the expert cache" in cached[0].describe()


def test_what_the_device_cache_cannot_serve_is_refused_naming_why() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="tensor parallelism"):
        DeviceExpertSpill.plan("50%", "lfu", "auto", cpu, sharded=True)
    with pytest.raises(ValueError, match="cpu-experts"):
        DeviceExpertSpill.plan("50%", "lfu", "sometimes", cpu, sharded=False)
    spill = DeviceExpertSpill.plan("50%", "lfu", "auto", cpu, sharded=False)
    with pytest.raises(ValueError, match="serves qwen3_moe and qwen3_next models, not llama"):
        spill.begin({"model_type": "llama"})
    with pytest.raises(ValueError, match="fewer than one layer's top-k"):
        DeviceExpertCache(_layers(), TOP_K - 1, TOP_K, 0, cpu)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])
def test_a_runner_serving_from_the_bank_decodes_the_resident_tokens(
    family: str, tiny_qwen3_moes: dict[str, Checkpoint], tiny_qwen3_nexts: dict[str, Checkpoint]
) -> None:
    path = tiny_qwen3_moes["renorm-dense-middle"].path if family == "qwen3_moe" else tiny_qwen3_nexts["interval-tied-bias"].path
    prompts = {f"r{i}": prompt_of(20 + i, n) for i, n in enumerate((4, 11, 19))}
    prompt = prompt_of(90, 13)
    plan = StepPlan(0, [Slice("l", 0, len(prompt), prompt, list(range(60, 64)), sampling=GREEDY, slot=0 if family == "qwen3_next" else -1)])

    def serve(spec: str, cpu: CoExecution | None = None) -> tuple[dict[str, list[int]], torch.Tensor, ModelRunner]:
        plan_on_device = lambda spec, directory, policy, device, sharded, fill, prefetch: DeviceExpertSpill.plan(spec, policy, "off", device, sharded)  # noqa: E731
        with mock.patch("services.worker.runner.ExpertSpill.plan", plan_on_device):  # the CPU as the cache's device
            runner = ModelRunner(RunnerConfig(path, num_blocks=64, block_size=4, weight_quant="none", expert_cache_bytes=spec))
        if cpu is not None:
            runner.expert_cache.cpu = cpu
        out, _ = drive(runner, prompts, 8, chunk=6, seed=2)
        return out, runner.logits(plan)["l"], runner

    resident_out, resident_logits, _ = serve("0")
    for spec, cpu in (("30%", None), ("100%", None), ("30%", CoExecution(copy_rate=1e9, cpu_rate=3.5e9))):
        out, logits, runner = serve(spec, cpu)
        cache = runner.expert_cache
        assert isinstance(cache, DeviceExpertCache) and cache.misses > 0 and (cache.cpu_pairs > 0) == (cpu is not None)
        assert out == resident_out, spec
        # bitwise where every step fits the bank (a step in groups of tokens runs the torch GEMMs on fewer rows, which round otherwise)
        assert torch.equal(logits, resident_logits) if spec == "100%" else rel_err(logits, resident_logits) < 1e-5, spec
        assert runner.describe()["expert_cache"]["slots"] == cache.slots
