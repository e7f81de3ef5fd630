"""A scheduler and runner driven step by step with two plans in flight, some requests aborted mid-run: the
speculative tests' check that an abort with a verify (or its pipelined decodes) in flight loses nothing."""

from __future__ import annotations

from collections import deque

from services.scheduler.core import Scheduler
from services.worker.runner import ModelRunner
from shared.devtools.inprocess_engine import InProcessEngine
from shared.frames import FinishReason, StepResult, Submit


def run_with_aborts(
    run_engine: InProcessEngine, scheduler: Scheduler, runner: ModelRunner, submits: list[Submit], aborted: tuple[str, ...], abort_at: int = 8
) -> dict[str, list[int]]:
    """Each request's streamed tokens, ``aborted`` ones aborted as plan ``abort_at`` is made."""
    for submit in submits:
        scheduler.submit(submit)
    in_flight: deque[StepResult] = deque()
    outputs: dict[str, list[int]] = {}
    step = 0
    while scheduler.requests or in_flight:
        plan = scheduler.plan(step)
        step += 1
        if plan.slices:
            in_flight.append(run_engine.plan_runs.run(plan, lambda *_: None))
        if step == abort_at:  # after the plan went out, as the worker gets a Release after the plans before it
            for rid in aborted:
                runner.release(scheduler.finish(rid, FinishReason.ABORT).released)
        if in_flight and (len(in_flight) >= 2 or not plan.slices):
            outcome = scheduler.on_result(in_flight.popleft())
            for delta in outcome.deltas:
                outputs.setdefault(delta.rid, []).extend(delta.token_ids)
            runner.release(outcome.released)
    return outputs
