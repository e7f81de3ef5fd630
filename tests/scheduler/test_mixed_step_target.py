"""A step that carries decodes keeps to a target time: its prefill is cut to what the measured time per token fits."""

from __future__ import annotations

import itertools

import structlog
from prometheus_client import REGISTRY

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.loop import SchedulerLoop
from services.scheduler.step_cost import MIN_PREFILL_TOKENS, MIN_SAMPLE_TOKENS, StepCost
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import Sampled, StepPlan, StepResult, Submit

_prompts = itertools.count(1)


def make(target_s: float, budget: int = 512) -> Scheduler:
    return Scheduler(BlockPool(1024, 8), max_num_seqs=16, max_num_batched_tokens=budget, max_waiting=100, mixed_step_target_s=target_s)


def submit(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 100) -> None:
    first = 1000 * next(_prompts)  # prompts share no prefix: no prefix-cache hit shortens one
    s.submit(Submit(rid=rid, prompt_ids=list(range(first, first + prompt_len)), max_tokens=max_tokens, stop_token_ids=[0]))


def answer(s: Scheduler, plan: StepPlan, forward_s: float) -> None:
    s.on_result(StepResult(step=plan.step, sampled=[Sampled(rid=x.rid, token_id=7) for x in plan.slices if x.sample], forward_s=forward_s))


def shape(plan: StepPlan) -> list[tuple[str, int]]:
    return [(x.rid, x.num_tokens) for x in plan.slices]


def test_a_step_with_decodes_holds_what_the_target_fits_and_a_step_without_keeps_the_budget() -> None:
    s = make(target_s=0.1)
    submit(s, "a", 300)
    p0 = s.plan(0)
    assert shape(p0) == [("a", 300)]  # no estimate yet, and no decodes: the whole prompt
    answer(s, p0, forward_s=300 * 0.002)  # 2 ms per token
    assert s.step_cost.token_cap() == 50
    submit(s, "b", 400)
    p1 = s.plan(1)
    assert shape(p1) == [("a", 1), ("b", 49)]  # a's decode and 49 prompt tokens: 50 tokens, ~100 ms
    p2 = s.plan(2)
    assert shape(p2) == [("a", 1), ("b", 49)]


def test_without_decodes_the_prefill_takes_the_whole_budget_whatever_the_estimate() -> None:
    s = make(target_s=0.1)
    submit(s, "a", 300, max_tokens=1)
    p0 = s.plan(0)
    answer(s, p0, forward_s=300 * 0.002)  # a finishes with its one token
    submit(s, "b", 600)
    assert shape(s.plan(1)) == [("b", 512)]


def test_decodes_that_fill_the_target_still_leave_the_minimum_prefill() -> None:
    s = make(target_s=0.1)
    for i in range(8):
        submit(s, f"r{i}", 10)
    p0 = s.plan(0)
    assert sum(x.num_tokens for x in p0.slices) == 80 >= MIN_SAMPLE_TOKENS
    answer(s, p0, forward_s=80 * 0.05)  # 50 ms per token: the target fits 2 tokens, fewer than the 8 decodes
    submit(s, "long", 100)
    p1 = s.plan(1)
    assert shape(p1) == [(f"r{i}", 1) for i in range(8)] + [("long", MIN_PREFILL_TOKENS)]


def test_no_target_means_no_cap() -> None:
    s = make(target_s=0.0)
    submit(s, "a", 300)
    p0 = s.plan(0)
    answer(s, p0, forward_s=300 * 0.002)
    assert s.step_cost.token_cap() is None
    submit(s, "b", 400)
    assert shape(s.plan(1)) == [("a", 1), ("b", 400)]


def test_the_estimate_learns_from_large_steps_only_and_follows_the_newest() -> None:
    cost = StepCost(target_s=0.1)
    cost.planned(0, MIN_SAMPLE_TOKENS - 1)  # a small step: mostly the fixed per-step cost
    cost.observed(0, 0.5)
    assert cost.seconds_per_token is None
    cost.planned(1, 100)
    cost.observed(1, 0.1)  # 1 ms per token
    assert cost.token_cap() == 100
    cost.planned(2, 100)
    cost.observed(2, 0.0)  # an untimed step (or a failed one) is no sample
    cost.observed(99, 1.0)  # nor is the result of a step it never saw planned
    assert cost.seconds_per_token == 0.001
    cost.planned(3, 100)
    cost.observed(3, 0.3)  # 3 ms per token: the average moves a quarter of the way
    assert abs(cost.seconds_per_token - 0.0015) < 1e-12


def test_steps_whose_results_never_come_are_not_remembered_forever() -> None:
    cost = StepCost(target_s=0.1)
    for step in range(1000):
        cost.planned(step, 100)
    assert len(cost.timing._pending) <= 64
    cost.observed(999, 0.1)
    assert cost.seconds_per_token == 0.001


def test_the_flag_reaches_the_scheduler_process_and_its_results_feed_the_estimate_it_reports(tmp_path) -> None:
    config = StackConfig.from_argv(["--model", DEFAULT_MODEL_DIR, "--run-dir", str(tmp_path), "--mixed-step-target-ms", "100"])
    loop = SchedulerLoop(config, structlog.get_logger())
    try:
        for peer in loop.peers.values():
            peer.state, peer.seen, peer.serving = "ready", 1e18, True
        loop._handle(Submit(rid="r1", prompt_ids=list(range(1, 201)), max_tokens=8))
        loop._plan_and_send()
        (step,) = loop.in_flight
        loop._handle(StepResult(step=step, sampled=[Sampled(rid="r1", token_id=7)], forward_s=0.2))  # 1 ms per token
        assert loop.instrumentation()["mixed_step"] == {"target_ms": 100.0, "ms_per_token": 1.0, "token_cap": 100}
    finally:
        loop.close()


def test_prometheus_reads_the_cap_and_the_time_per_token_when_it_scrapes(tmp_path) -> None:
    config = StackConfig.from_argv(["--model", DEFAULT_MODEL_DIR, "--run-dir", str(tmp_path), "--mixed-step-target-ms", "50"])
    loop = SchedulerLoop(config, structlog.get_logger())
    try:
        assert REGISTRY.get_sample_value("tokenyard:scheduler_mixed_step_token_cap") == 0  # nothing measured yet
        assert REGISTRY.get_sample_value("tokenyard:scheduler_step_seconds_per_token") == 0
        loop.core.step_cost.planned(0, 100)
        loop.core.step_cost.observed(0, 0.1)  # 1 ms per token
        assert REGISTRY.get_sample_value("tokenyard:scheduler_mixed_step_token_cap") == 50
        assert REGISTRY.get_sample_value("tokenyard:scheduler_step_seconds_per_token") == 0.001
    finally:
        loop.close()
