"""Device placement and the device memory budget, without a GPU: ``--device`` / ``--dtype`` resolution,
the KV cache / GDN state-pool arithmetic, the CPU identity the worker reports, and the scheduler adopting
the block count the worker sized."""

from __future__ import annotations

import pytest
import structlog
import torch

from services.worker.device import describe_device, device_memory, resolve_device, resolve_dtype
from services.worker.device_memory import GRAPH_POOL_RESERVE, activation_reserve, plan_memory
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


def test_the_kv_cache_gets_what_the_weights_and_the_reserve_leave() -> None:
    # 80 GiB device, 2 GiB used by others before load, weights take 16 GiB; 90% of it is ours.
    total, before, after = 80 * GIB, 78 * GIB, 62 * GIB
    per_token, block = 2 * 28 * 8 * 128 * 2, 16  # Llama-8B-shaped bf16 KV: 114688 bytes a token
    plan = plan_memory(total, before, after, 0.9, 2 * GIB, per_token, block)
    available = int(0.9 * total) - (total - after) - 2 * GIB  # 72 - 18 - 2 = 52 GiB
    assert plan.num_blocks == available // (per_token * block) and plan.num_blocks == 30427
    assert plan.kv_cache_bytes <= available < plan.kv_cache_bytes + per_token * block
    assert plan.weights_bytes == 16 * GIB and plan.describe()["kv_cache_tokens"] == plan.num_blocks * block


def test_the_state_pool_comes_out_of_the_budget_before_the_kv_cache() -> None:
    total, after, per_token, block = 24 * GIB, 20 * GIB, 4096, 16
    without = plan_memory(total, total, after, 0.8, GIB, per_token, block)
    slot = 32 << 20  # a GDN layer stack's recurrent + conv state: 32 MiB a request
    with_states = plan_memory(total, total, after, 0.8, GIB, per_token, block, state_bytes_per_slot=slot, state_slots=65)
    assert with_states.state_pool_bytes == 65 * slot
    assert with_states.num_blocks == (int(0.8 * total) - 4 * GIB - GIB - 65 * slot) // (per_token * block)
    assert without.num_blocks - with_states.num_blocks in (65 * slot // (per_token * block), 65 * slot // (per_token * block) + 1)


def test_a_budget_with_no_room_names_the_flag() -> None:
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        plan_memory(16 * GIB, 16 * GIB, 2 * GIB, 0.9, GIB, 4096, 16)  # weights took 14 of 14.4 GiB
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        plan_memory(16 * GIB, 16 * GIB, 8 * GIB, 1.5, GIB, 4096, 16)


def test_the_reserve_covers_a_full_step_and_the_graph_pool() -> None:
    reserve = activation_reserve(max_num_batched_tokens=2048, max_num_seqs=64, hidden_size=4096, vocab_size=151936, dtype_bytes=2)
    assert reserve > GRAPH_POOL_RESERVE + 2048 * 4096 * 2 * 4 + 64 * 151936 * 4


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
        for socket in (loop.inbox, loop.to_worker, loop.to_detokenizer, loop.to_api):
            socket.close()


def test_the_cpu_worker_reports_its_device_backends_and_eager_decodes(tmp_path, tiny_llamas) -> None:
    from prometheus_client import REGISTRY

    from services.worker.loop import WorkerLoop
    from shared.frames import Slice, StepPlan

    config = StackConfig(model=tiny_llamas["untied"].path, run_dir=str(tmp_path), kv_cache_tokens=256, block_size=4, max_num_batched_tokens=8)
    loop = WorkerLoop(config, structlog.get_logger())
    try:
        loop.load()
        info = loop.instrumentation()
        assert info["state"] == "ready" and info["device"]["type"] == "cpu" and info["device"]["cores"] >= 1
        runner = info["runner"]
        assert (runner["device"], runner["dtype"], runner["attention_backend"], runner["sampler"]) == ("cpu", "float32", "torch", "torch")
        assert runner["cuda_graphs"] is None and info["memory_plan"] is None  # no graphs and no device budget on the CPU

        def eager_decodes() -> float:
            return REGISTRY.get_sample_value("tokenyard:worker_decode_steps_total", {"mode": "eager"})

        before = eager_decodes()
        loop._execute(StepPlan(0, [Slice("a", 0, 3, [5, 6, 7], [0], sampling=SamplingParams(temperature=0))]))
        loop._execute(StepPlan(1, [Slice("a", 3, 1)]))
        assert eager_decodes() == before + 1
        assert REGISTRY.get_sample_value("tokenyard:worker_decode_steps_total", {"mode": "graph"}) == 0
    finally:
        for socket in (loop.inbox, loop.to_scheduler):
            socket.close()


def test_the_state_bytes_per_slot_are_what_the_state_cache_allocates() -> None:
    from services.worker.device_memory import gdn_bytes_per_slot
    from services.worker.gdn_state import GDNShape, GDNStateCache

    shape = GDNShape(num_layers=3, conv_channels=96, conv_history=3, num_v_heads=4, key_dim=16, value_dim=8)
    assert gdn_bytes_per_slot(shape, torch.bfloat16) * 5 == GDNStateCache(shape, 5, torch.bfloat16).nbytes
    assert gdn_bytes_per_slot(None, torch.bfloat16) == 0
