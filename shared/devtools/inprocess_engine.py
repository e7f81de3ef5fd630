"""The scheduler's state machine and a ModelRunner in one process, with no sockets.

It speaks the same protocol as the real stack, including pipelining: with depth 2, plan
N+1 is made before result N is applied, exactly the order the scheduler process sees.
Benchmarks use it as the "worker alone" baseline; tests use it to compare outputs
across scheduler settings.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from services.scheduler.core import Scheduler
from services.worker.plan_runs import PlanRuns
from shared.frames import StepPlan, StepResult, Submit


@dataclass
class EngineRun:
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    token_times: dict[str, list[float]] = field(default_factory=dict)
    token_steps: dict[str, list[int]] = field(default_factory=dict)  # the step whose result carried each token
    steps: int = 0
    wall_s: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs.values())


class InProcessEngine:
    def __init__(self, scheduler: Scheduler, runner, pipeline_depth: int = 2) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.plan_runs = PlanRuns(runner.execute)  # plans of several decode steps, as the worker runs them
        self.depth = pipeline_depth
        self.step = 0

    def run(self, submits: list[Submit], arrivals: dict[int, list[Submit]] | None = None) -> EngineRun:
        """Runs until every request has finished; ``arrivals`` adds requests before given steps."""
        run = EngineRun()
        arrivals = dict(arrivals or {})
        for submit in submits:
            self.scheduler.submit(submit)
        in_flight: deque[StepResult] = deque()
        started = time.perf_counter()
        first_step = self.step
        while self.scheduler.requests or in_flight or arrivals:
            for submit in arrivals.pop(self.step - first_step, []):
                self.scheduler.submit(submit)
            plan = self._plan(run)
            if plan.slices:
                in_flight.append(self.plan_runs.run(plan, lambda *_: None))
            elif not in_flight and self.scheduler.requests:
                raise RuntimeError("the scheduler planned nothing with requests pending and no step in flight")
            if in_flight and (len(in_flight) >= self.depth or not plan.slices):
                self._apply(in_flight.popleft(), run)
        run.wall_s = time.perf_counter() - started
        run.steps = self.step - first_step
        return run

    def _plan(self, run: EngineRun) -> StepPlan:
        plan = self.scheduler.plan(self.step)
        self.step += 1
        for s in plan.slices:
            if s.opened is not None and s.opened.cached_tokens:
                run.cached_tokens[s.rid] = s.opened.cached_tokens
        released = self.scheduler.take_released()
        if released:
            self._release(released)
        return plan

    def _apply(self, result: StepResult, run: EngineRun) -> None:
        outcome = self.scheduler.on_result(result)
        now = time.perf_counter()
        for delta in outcome.deltas:
            run.outputs.setdefault(delta.rid, []).extend(delta.token_ids)
            run.token_times.setdefault(delta.rid, []).extend([now] * len(delta.token_ids))
            run.token_steps.setdefault(delta.rid, []).extend([result.step] * len(delta.token_ids))
            if delta.finish:
                run.finish[delta.rid] = delta.finish
        if outcome.released:
            self._release(outcome.released)

    def _release(self, rids: list[str]) -> None:
        self.plan_runs.release(rids)
        self.runner.release(rids)
