"""A plan of several decode steps runs as the scheduler planned it: each step one position further, every
step's tokens reported as they come and all of them, in order, in one result; a request that samples its
stop token leaves the run, and later plans skip it until it is released."""

from __future__ import annotations

from services.worker.plan_runs import PlanRuns
from shared.frames import Sampled, SamplingParams, Slice, StepPlan, StepResult

EOS = 2


class ScriptedSteps:
    """A stand-in for the runner: each request samples its script's tokens in turn."""

    def __init__(self, scripts: dict[str, list[int]], fail_at: int = -1) -> None:
        self.scripts = {rid: iter(tokens) for rid, tokens in scripts.items()}
        self.steps: list[list[tuple[str, int]]] = []  # (rid, start) of each step's slices
        self.fail_at = fail_at

    def __call__(self, plan: StepPlan) -> StepResult:
        self.steps.append([(s.rid, s.start) for s in plan.slices])
        if len(self.steps) - 1 == self.fail_at:
            return StepResult(step=plan.step, sampled=[], error="boom")
        return StepResult(step=plan.step, sampled=[Sampled(s.rid, next(self.scripts[s.rid])) for s in plan.slices], forward_s=0.001)


def first(rid: str, start: int, stop: list[int]) -> Slice:
    return Slice(rid, start, 1, sampling=SamplingParams(temperature=0), stop_token_ids=stop)


def test_a_run_steps_each_request_one_position_further_and_returns_every_token_in_order() -> None:
    steps = ScriptedSteps({"a": [10, 11, 12], "b": [20, 21, 22]})
    runs, reported = PlanRuns(steps), []
    result = runs.run(StepPlan(7, [first("a", 5, [EOS]), first("b", 9, [])], decode_steps=3), lambda plan, r: reported.append(r.sampled))
    assert steps.steps == [[("a", 5), ("b", 9)], [("a", 6), ("b", 10)], [("a", 7), ("b", 11)]]
    assert [(x.rid, x.token_id) for x in result.sampled] == [("a", 10), ("b", 20), ("a", 11), ("b", 21), ("a", 12), ("b", 22)]
    assert result.step == 7 and abs(result.forward_s - 0.003) < 1e-9
    assert [[x.token_id for x in sampled] for sampled in reported] == [[10, 20], [11, 21], [12, 22]]


def test_a_stop_token_ends_the_request_in_the_run_and_later_plans_skip_it_until_released() -> None:
    steps = ScriptedSteps({"a": [10, EOS], "b": [20, 21, EOS, 23, 24]})
    runs = PlanRuns(steps)
    result = runs.run(StepPlan(1, [first("a", 5, [EOS]), first("b", 9, [])], decode_steps=3), lambda *_: None)
    assert steps.steps == [[("a", 5), ("b", 9)], [("a", 6), ("b", 10)], [("b", 11)]]  # b ignores EOS (no stop tokens)
    assert [(x.rid, x.token_id) for x in result.sampled] == [("a", 10), ("b", 20), ("a", EOS), ("b", 21), ("b", EOS)]
    runs.run(StepPlan(2, [Slice("a", 8, 1), Slice("b", 12, 1)]), lambda *_: None)  # pipelined before the scheduler saw a's end
    assert steps.steps[-1] == [("b", 12)]
    assert runs.run(StepPlan(3, [Slice("a", 9, 1)]), lambda *_: None) == StepResult(step=3, sampled=[])
    runs.release(["a"])
    assert not runs.ended and "a" not in runs.stop_token_ids


def test_a_single_step_plan_ends_nobody() -> None:
    """Without a run the scheduler may not have ruled the token an ending (min_tokens): nothing is skipped."""
    steps = ScriptedSteps({"a": [EOS, 11]})
    runs = PlanRuns(steps)
    runs.run(StepPlan(1, [first("a", 5, [EOS])]), lambda *_: None)
    runs.run(StepPlan(2, [Slice("a", 6, 1)]), lambda *_: None)
    assert steps.steps == [[("a", 5)], [("a", 6)]] and not runs.ended


def test_a_failed_step_ends_the_run_with_its_error() -> None:
    steps = ScriptedSteps({"a": [10, 11, 12]}, fail_at=1)
    result = PlanRuns(steps).run(StepPlan(4, [first("a", 5, [EOS])], decode_steps=3), lambda *_: None)
    assert result.error == "boom" and result.step == 4 and len(steps.steps) == 2
