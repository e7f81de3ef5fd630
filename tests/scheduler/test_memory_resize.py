"""A memory resize at the scheduler: every running request is preempted (never failed) and released on the worker
ahead of the resize frame; no plan is made until the worker answers; a second resize meanwhile is refused with 409;
the worker's answer sizes the block pool, the api hears the new split, and the preempted requests are recomputed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
import zmq

from services.scheduler.loop import SchedulerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import ApiAnnounce, Error, Heartbeat, MemoryResized, MemorySplit, Release, ResizeMemory, Sampled, StepPlan, StepResult, Submit
from shared.transport import Inbox

log = structlog.get_logger()
SPLIT = MemorySplit(kv_blocks=64, kv_block_bytes=1000, expert_cache_bytes=7000, expert_slots=2, expert_slot_bytes=3456, expert_top_k=2, experts=32)


def _frames(inbox: Inbox, kinds: tuple[type, ...] = (object,)) -> list:
    frames: list = []
    for _ in range(20):
        got = list(inbox.recv(50))
        frames += got
        if not got and frames:
            break
    return [f for f in frames if isinstance(f, kinds)]


@pytest.fixture
def stack(tmp_path) -> Iterator[tuple[SchedulerLoop, Inbox, Inbox]]:
    ctx = zmq.Context()
    config = StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run"), kv_cache_tokens=512, block_size=8, max_num_batched_tokens=64)
    worker, api = Inbox(ctx, config.worker_address, "worker"), Inbox(ctx, f"ipc://{tmp_path}/api.sock", "api")
    loop = SchedulerLoop(config, log)
    for process in loop.peers:
        loop._handle(Heartbeat(process=process, pid=100, state="ready", kv_blocks=64, memory=SPLIT if process == "worker" else None))
    loop._handle(ApiAnnounce(replica="api-a", address=api.address, engine="engine-0"))
    yield loop, worker, api
    loop.close()
    ctx.destroy(0)


def test_a_resize_preempts_the_running_requests_and_resumes_them_on_the_new_pool(stack) -> None:
    loop, worker, api = stack
    assert loop.instrumentation()["memory"] == {**{f: getattr(SPLIT, f) for f in SPLIT.__struct_fields__}, "kv_cache_bytes": 64_000}
    for i, rid in enumerate(("a", "b", "c")):
        loop._handle(Submit(rid=rid, prompt_ids=list(range(1 + 30 * i, 21 + 30 * i)), max_tokens=4, reply_to=api.address))
    assert loop._plan_and_send()  # a plan in flight whose prefills hold blocks
    plan = _frames(worker, (StepPlan,))[0]
    assert loop.core.pool.num_used > 0

    loop._handle(ResizeMemory(id="m1", kv_cache_bytes=32_000, expert_cache_bytes=4 * 3456, reply_to=api.address))
    release, resize = _frames(worker, (Release, ResizeMemory))
    assert sorted(release.rids) == ["a", "b", "c"] and (resize.id, resize.kv_cache_bytes, resize.expert_cache_bytes) == ("m1", 32_000, 4 * 3456)
    assert loop.core.pool.num_used == 0 and not loop.core.running and [r.rid for r in loop.core.waiting] == ["a", "b", "c"]
    assert not loop.can_plan and loop.instrumentation()["memory"]["applying"]

    loop._handle(ResizeMemory(id="m2", kv_cache_bytes=16_000, reply_to=api.address))  # while m1 applies
    (refused,) = _frames(api, (MemoryResized,))
    assert (refused.id, refused.status) == ("m2", 409) and "(m1) is still applying" in refused.error
    assert _frames(worker, (ResizeMemory,)) == []

    loop._handle(StepResult(step=plan.step, sampled=[Sampled(s.rid, 7) for s in plan.slices if s.sample]))  # the step in flight comes back
    loop._handle(MemoryResized(id="m1", split=MemorySplit(kv_blocks=32, kv_block_bytes=1000, expert_cache_bytes=4 * 3456, expert_slots=4)))
    (applied,) = _frames(api, (MemoryResized,))
    assert (applied.id, applied.status, applied.split.kv_blocks, applied.split.expert_slots, applied.split.applying) == ("m1", 200, 32, 4, False)
    assert loop.core.pool.num_blocks == 32 and loop.can_plan and loop.status().memory.kv_blocks == 32
    loop._handle(Heartbeat(process="worker", pid=100, state="ready", kv_blocks=64, memory=SPLIT))  # one sent before the resize, late
    assert loop.core.pool.num_blocks == 32 and loop.memory_split().expert_slots == 4

    assert loop._plan_and_send()
    (replan,) = _frames(worker, (StepPlan,))
    assert {s.rid: s.start for s in replan.slices} == {"a": 0, "b": 0, "c": 0}  # recomputed from their first token
    assert all(s.sampling is not None for s in replan.slices)
    assert not _frames(api, (Error,)) and loop.core.num_preemptions == 3


def test_a_refused_split_leaves_the_pool_and_the_worker_lost_meanwhile_answers_503(stack) -> None:
    loop, worker, api = stack
    loop._handle(ResizeMemory(id="m1", expert_cache_bytes=3456, reply_to=api.address))
    loop._handle(MemoryResized(id="m1", split=SPLIT, status=400, error="expert_cache_bytes 3456 holds 1 experts"))
    (answer,) = _frames(api, (MemoryResized,))
    assert (answer.status, answer.error) == (400, "expert_cache_bytes 3456 holds 1 experts") and loop.core.pool.num_blocks == 64 and loop.can_plan

    loop._handle(ResizeMemory(id="m2", kv_cache_bytes=32_000, reply_to=api.address))
    loop._handle(Heartbeat(process="worker", pid=101, state="ready"))  # restarted: the resize will never be answered
    (lost,) = _frames(api, (MemoryResized,))
    assert lost.id == "m2" and lost.status == 503 and "worker was lost" in lost.error and loop.resizing is None
