"""Rank 0 of a tensor-parallel worker whose step failed because another rank died: it reports
``failed`` with the reason ahead of the step's error, on the same socket, so the scheduler (and
the api, and /health) know why before any stream ends; it runs no more collectives after that."""

from __future__ import annotations

from types import SimpleNamespace

import structlog

from services.worker.loop import WorkerLoop
from shared.config import StackConfig
from shared.frames import Heartbeat, SamplingParams, Slice, StepPlan, StepResult
from shared.transport import Inbox

WHY = "tensor-parallel rank 1 (pid 4242 at 127.0.0.1:5000) is gone: it closed its connection (the process ended)"


class CollectiveFailsRunner:
    """Fails each step as gloo does when a rank's connection closes mid-collective."""

    def __init__(self) -> None:
        self.steps = 0

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer")


def test_a_step_failed_by_a_dead_rank_reports_failed_before_its_error(tmp_path, tiny_llamas) -> None:
    config = StackConfig(model=tiny_llamas["untied"].path, run_dir=str(tmp_path), worker_core="off")
    loop = WorkerLoop(config, structlog.get_logger())
    try:
        scheduler = Inbox(loop.ctx, config.scheduler_address, "scheduler")
        loop.runner = runner = CollectiveFailsRunner()
        loop.tp = SimpleNamespace(liveness=SimpleNamespace(dead_peer=lambda timeout_s: WHY))
        loop.state = "ready"
        plan = StepPlan(0, [Slice("a", 0, 3, [5, 6, 7], [0], sampling=SamplingParams(temperature=0))])
        loop.to_scheduler.send(loop._execute(plan))  # as the main loop sends a step's result
        frames = [f for _ in range(10) for f in scheduler.recv(100)][:2]
        beat, result = frames
        assert isinstance(beat, Heartbeat) and beat.state == "failed" and beat.detail.startswith(WHY), frames
        assert isinstance(result, StepResult) and result.error == WHY and not result.sampled
        assert loop._execute(StepPlan(1, [Slice("a", 3, 1)])).error == WHY and runner.steps == 1  # no more collectives
    finally:
        loop.ctx.destroy(0)
