"""Device placement and the device memory budget, without a GPU: ``--device`` / ``--dtype`` resolution,
the KV cache / GDN state-pool arithmetic, the CPU identity the worker reports, and the scheduler adopting
the block count the worker sized."""

from __future__ import annotations

import pytest
import structlog
import torch

from services.worker.device import describe_device, device_memory, resolve_device, resolve_dtype
from services.worker.device_memory import ActivationProfile, plan_memory
from shared.config import StackConfig
from shared.frames import Heartbeat, SamplingParams

GIB = 1 << 30


def test_auto_is_the_cpu_in_float32_here_and_bfloat16_on_cuda() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="device 'cuda' was asked for"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device 'tpu' is not supported"):
        resolve_device("tpu")
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_dtype("auto", torch.device("cuda", 0)) == "bfloat16"
    assert resolve_dtype("float16", torch.device("cuda", 0)) == "float16"


def test_cpu_identity_has_model_and_cores_and_no_device_memory() -> None:
    info = describe_device(torch.device("cpu"))
    assert info["type"] == "cpu" and info["cores"] >= 1 and info["name"]
    assert device_memory(torch.device("cpu")) == {}


def _profile(activations: int, weights: int = 16 * GIB, scratch: int = GIB // 2) -> ActivationProfile:
    """What a profile step reports: the allocator held ``weights`` before it and ``weights + scratch`` once
    its scratch KV blocks and slots existed; the step's peak sat ``activations`` above that."""
    return ActivationProfile(tokens=2048, sequences=64, weights_bytes=weights, scratch_bytes=scratch, peak_bytes=weights + scratch + activations)


def test_the_kv_cache_gets_what_the_weights_the_measured_activations_and_the_graph_pool_leave() -> None:
    # 80 GiB device, 2 GiB used by others before load, weights take 16 GiB; 90% of it is ours.
    total, before, after = 80 * GIB, 78 * GIB, 62 * GIB
    per_token, block = 2 * 28 * 8 * 128 * 2, 16  # Llama-8B-shaped bf16 KV: 114688 bytes a token
    profile = _profile(activations=3 * GIB // 2)
    assert profile.activation_bytes == 3 * GIB // 2  # the peak less the weights and the profile's own scratch cache
    plan = plan_memory(total, before, after, 0.9, profile, GIB // 2, per_token, block)
    available = int(0.9 * total) - (total - after) - 3 * GIB // 2 - GIB // 2  # 72 - 18 - 1.5 - 0.5 = 52 GiB
    assert plan.num_blocks == available // (per_token * block) and plan.num_blocks == 30427
    assert plan.kv_cache_bytes <= available < plan.kv_cache_bytes + per_token * block
    assert plan.weights_bytes == 16 * GIB and plan.reserve_bytes == 2 * GIB
    shown = plan.describe()  # /instrumentation's memory arithmetic, the measured figures included
    assert shown["kv_cache_tokens"] == plan.num_blocks * block and shown["budget_bytes"] == int(0.9 * total)
    assert shown["activation_peak_bytes"] == 3 * GIB // 2 and shown["graph_pool_bytes"] == GIB // 2
    assert shown["activation_profile"] == {
        "tokens": 2048, "sequences": 64, "weights_bytes": 16 * GIB, "scratch_bytes": GIB // 2,
        "peak_bytes": 18 * GIB, "activation_peak_bytes": 3 * GIB // 2,
    }  # fmt: skip
    # A heavier step leaves fewer blocks, byte for byte; no graphs, no pool.
    heavier = plan_memory(total, before, after, 0.9, _profile(activations=5 * GIB // 2), 0, per_token, block)
    assert heavier.num_blocks == (available - GIB + GIB // 2) // (per_token * block)


def test_the_state_pool_comes_out_of_the_budget_before_the_kv_cache() -> None:
    total, after, per_token, block = 24 * GIB, 20 * GIB, 4096, 16
    profile = _profile(activations=GIB // 2, weights=4 * GIB)
    without = plan_memory(total, total, after, 0.8, profile, GIB // 2, per_token, block)
    slot = 32 << 20  # a GDN layer stack's recurrent + conv state: 32 MiB a request
    with_states = plan_memory(total, total, after, 0.8, profile, GIB // 2, per_token, block, state_bytes_per_slot=slot, state_slots=65)
    assert with_states.state_pool_bytes == 65 * slot
    assert with_states.num_blocks == (int(0.8 * total) - 4 * GIB - GIB - 65 * slot) // (per_token * block)
    assert without.num_blocks - with_states.num_blocks in (65 * slot // (per_token * block), 65 * slot // (per_token * block) + 1)


def test_a_budget_with_no_room_names_the_flags() -> None:
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization, lower --max-num-batched-tokens"):
        plan_memory(16 * GIB, 16 * GIB, 2 * GIB, 0.9, _profile(GIB, weights=14 * GIB), 0, 4096, 16)  # weights took 14 of 14.4 GiB
    with pytest.raises(ValueError, match="activation peak of 2.00 GiB"):
        plan_memory(16 * GIB, 16 * GIB, 4 * GIB, 0.9, _profile(2 * GIB, weights=12 * GIB), GIB // 2, 4096, 16)  # 14.4 - 12 - 2 - 0.5 < 0
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        plan_memory(16 * GIB, 16 * GIB, 8 * GIB, 1.5, None, 0, 4096, 16)


class FakeProbe:
    """Injected allocator numbers: ``weights`` before the profile, ``+ scratch`` once its scratch exists, and
    a peak ``activations`` above that; records the calls, so the test sees when the step ran."""

    def __init__(self, weights: int, scratch: int, activations: int) -> None:
        self.values = [weights, weights + scratch]
        self.peak_bytes = weights + scratch + activations
        self.calls: list[str] = []

    def allocated(self) -> int:
        self.calls.append("allocated")
        return self.values[len([c for c in self.calls if c == "allocated"]) - 1]

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def peak(self) -> int:
        self.calls.append("peak")
        return self.peak_bytes

    def release(self) -> None:
        self.calls.append("release")


def test_the_runner_profiles_the_largest_step_before_it_sizes_the_cache(tiny_qwen3_nexts, monkeypatch) -> None:
    """Profile first (one step of max_num_batched_tokens tokens over max_num_seqs sequences, between the
    peak's reset and its reading), then the budget with that profile and the state pool with the dummy slot,
    then a cache of what fits: the dummy block past the scheduler's share."""
    from services.worker.cuda_graphs import eager_capture
    from services.worker.device_memory import KVBudget, gdn_bytes_per_slot
    from services.worker.models.qwen3_next import Qwen3NextForCausalLM
    from services.worker.runner import ModelRunner, RunnerConfig

    probe = FakeProbe(weights=3 * GIB, scratch=GIB, activations=GIB // 4)
    steps: list[tuple[int, list[str]]] = []

    def spy(forward):
        def step(self, input_ids, *args, **kwargs):
            steps.append((input_ids.numel(), list(probe.calls)))
            return forward(self, input_ids, *args, **kwargs)

        return step

    for name in ("forward", "forward_fused"):  # whichever the decoder backend binds (fused where select_fusion_kernels found kernels)
        monkeypatch.setattr(Qwen3NextForCausalLM, name, spy(getattr(Qwen3NextForCausalLM, name)))
    asked = []

    def size(model, profile, state_slots: int) -> int:
        asked.append((profile, state_slots, list(probe.calls)))
        plan = plan_memory(
            64 * GIB, 64 * GIB, 60 * GIB, 0.5, profile, GIB // 2, 64 * 1024, 4, gdn_bytes_per_slot(model.gdn_shape, model.dtype), state_slots
        )  # fmt: skip
        return min(plan.num_blocks, 40)  # the budget's arithmetic, capped: this is a CPU test of the wiring

    config = RunnerConfig(tiny_qwen3_nexts["gqa-dense-layer"].path, 1, 4, max_num_seqs=3, cuda_graph_max_batch=2)
    runner = ModelRunner(config, budget=KVBudget(size, profile_tokens=10, probe=probe), capture=eager_capture)
    assert steps == [(10, ["allocated", "allocated", "reset_peak"])]  # 10 tokens (4 + 3 + 3), after the reset
    ((profile, state_slots, calls_then),) = asked
    assert calls_then == ["allocated", "allocated", "reset_peak", "peak", "release"]  # memory handed back first
    assert (profile.tokens, profile.sequences, profile.activation_bytes) == (10, 3, GIB // 4)
    assert state_slots == 4  # max_num_seqs slots and the graphs' dummy slot
    assert runner.num_blocks == 39 and runner.kv_cache.num_blocks == 40  # the dummy block is the worker's
    assert runner.states.num_slots == 4 and runner.describe()["requests"] == 0 and not runner.requests.slot_holders
    assert runner.activation_profile is profile


def test_the_scheduler_adopts_the_workers_block_count(tmp_path) -> None:
    from services.scheduler.loop import SchedulerLoop

    config = StackConfig(run_dir=str(tmp_path), kv_cache_tokens=1024, block_size=16)
    loop = SchedulerLoop(config, structlog.get_logger())
    try:
        assert loop.core.pool.num_blocks == 64
        loop._handle(Heartbeat(process="worker", pid=1, state="warming", kv_blocks=5000))
        assert loop.core.pool.num_blocks == 5000 and loop.instrumentation()["kv_blocks_total"] == 5000
        loop._handle(Heartbeat(process="worker", pid=1, state="ready"))  # 0: not said, nothing changes
        assert loop.core.pool.num_blocks == 5000
    finally:
        loop.close()


def test_the_cpu_worker_reports_its_device_backends_and_eager_decodes(tmp_path, tiny_llamas) -> None:
    from prometheus_client import REGISTRY

    from services.worker.loop import WorkerLoop
    from shared.frames import Slice, StepPlan

    # worker_core off: load() would otherwise pin this test process's threads (--worker-core auto) for every later test
    config = StackConfig(
        model=tiny_llamas["untied"].path, run_dir=str(tmp_path), kv_cache_tokens=256, block_size=4, max_num_batched_tokens=8, worker_core="off"
    )
    loop = WorkerLoop(config, structlog.get_logger())
    try:
        loop.load()
        info = loop.instrumentation()
        assert info["state"] == "ready" and info["device"]["type"] == "cpu" and info["device"]["cores"] >= 1
        runner = info["runner"]
        assert (runner["device"], runner["dtype"], runner["attention_backend"], runner["sampler"]) == ("cpu", "float32", "cpp", "torch")
        assert runner["decoder_backend"] == "fused"  # fp16 weights (auto here): layer by layer, with the C++ fusions
        assert runner["cuda_graphs"] is None and info["memory_plan"] is None  # no graphs and no device budget on the CPU

        def eager_decodes() -> float:
            return REGISTRY.get_sample_value("tokenyard:worker_decode_steps_total", {"mode": "eager"})

        before = eager_decodes()
        loop._execute(StepPlan(0, [Slice("a", 0, 3, [5, 6, 7], [0], sampling=SamplingParams(temperature=0))]))
        loop._execute(StepPlan(1, [Slice("a", 3, 1)]))
        assert eager_decodes() == before + 1
        assert REGISTRY.get_sample_value("tokenyard:worker_decode_steps_total", {"mode": "graph"}) == 0
    finally:
        loop.ctx.destroy(0)  # every socket of the loop's


def test_the_state_bytes_per_slot_are_what_the_state_cache_allocates() -> None:
    from services.worker.device_memory import gdn_bytes_per_slot
    from services.worker.gdn_state import GDNShape, GDNStateCache

    shape = GDNShape(num_layers=3, conv_channels=96, conv_history=3, num_v_heads=4, key_dim=16, value_dim=8)
    assert gdn_bytes_per_slot(shape, torch.bfloat16) * 5 == GDNStateCache(shape, 5, torch.bfloat16).nbytes
    assert gdn_bytes_per_slot(None, torch.bfloat16) == 0


def test_the_worker_shows_the_measured_figures_in_its_memory_arithmetic(tmp_path, tiny_llamas, monkeypatch) -> None:
    """The worker's budget (what it hands the runner as ``size_kv_cache``) with the device's numbers injected:
    /instrumentation's memory plan carries the profile's measured peak and the graph pool estimate."""
    from services.worker.device_memory import GRAPH_POOL_RESERVE
    from services.worker.loop import WorkerLoop
    from services.worker.runner import ModelRunner, RunnerConfig

    config = StackConfig(model=tiny_llamas["untied"].path, run_dir=str(tmp_path), block_size=16, gpu_memory_utilization=0.5, cuda_graph_max_batch=8)
    loop = WorkerLoop(config, structlog.get_logger())
    try:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (7 * GIB, 8 * GIB))  # free after load, total
        model = ModelRunner(RunnerConfig(config.model, 4, 16)).model
        profile = _profile(activations=GIB // 4, weights=GIB // 2, scratch=GIB // 8)
        blocks = loop._kv_budget(free_before_load=15 * GIB // 2)(model, profile, 0)
        per_token = model.num_kv_layers * 2 * model.num_kv_heads * model.head_dim * 4
        assert blocks == (4 * GIB - GIB - GIB // 4 - GRAPH_POOL_RESERVE) // (per_token * 16)
        shown = loop.instrumentation()["memory_plan"]
        assert shown["num_blocks"] == blocks and shown["weights_bytes"] == GIB // 2 and shown["in_use_after_load_bytes"] == GIB
        assert shown["activation_peak_bytes"] == GIB // 4 and shown["activation_profile"]["peak_bytes"] == GIB // 2 + GIB // 8 + GIB // 4
        assert shown["graph_pool_bytes"] == GRAPH_POOL_RESERVE and shown["reserve_bytes"] == GIB // 4 + GRAPH_POOL_RESERVE
    finally:
        loop.ctx.destroy(0)  # every socket of the loop's
