"""Plans of decodes alone run several steps once the worker's step time is known: as many as the target
fits, only while nothing waits or prefills, never past a request's max_tokens or before its min_tokens,
and only with blocks for every position of the run."""

from __future__ import annotations

import structlog
from prometheus_client import REGISTRY

from services.scheduler.core import Scheduler
from services.scheduler.decode_runs import MAX_DECODE_STEPS, DecodeRuns
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.loop import SchedulerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import Abort, FinishReason, Sampled, StepPlan, StepResult, Submit

STOP = 0


def make(num_blocks: int = 64, target_s: float = 0.02) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, 4, False), max_num_seqs=8, max_num_batched_tokens=64, max_waiting=100, decode_plan_s=target_s)


def submit(s: Scheduler, rid: str, max_tokens: int = 50, prompt: list[int] | None = None, **kw) -> None:
    s.submit(Submit(rid=rid, prompt_ids=prompt or [5, 6, 7], max_tokens=max_tokens, stop_token_ids=[STOP], **kw))


def answer(s: Scheduler, plan: StepPlan, tokens: dict[str, list[int]] | None = None, forward_s: float = 0.0):
    """Each sampling slice's tokens, one per step of the plan, ordered step by step as the worker sends them."""
    tokens = tokens or {x.rid: [7] * plan.decode_steps for x in plan.slices if x.sample}
    steps = max(len(t) for t in tokens.values())
    sampled = [Sampled(rid, t[i]) for i in range(steps) for rid, t in tokens.items() if i < len(t)]
    return s.on_result(StepResult(step=plan.step, sampled=sampled, forward_s=forward_s))


def decoding(s: Scheduler, *rids: str, step_s: float = 0.005) -> int:
    """Admits these (and earlier submitted) requests and answers a first plan of decodes alone taking step_s:
    the estimate exists. Returns the next step's number."""
    for rid in rids:
        submit(s, rid)
    answer(s, s.plan(0))  # the prompts and the first tokens
    plan = s.plan(1)
    assert plan.decode_steps == 1  # nothing measured yet
    answer(s, plan, forward_s=step_s)
    return 2


def test_the_estimate_sets_the_run_length_within_bounds() -> None:
    runs = DecodeRuns(0.02)
    assert runs.steps() == 1  # nothing measured
    runs.planned(0, 1, 2)
    runs.observed(0, 0.005, samples=2)
    assert runs.steps() == 4
    runs.planned(1, 4, 2)
    runs.observed(1, 4 * 0.0001, samples=7)  # a row left the run early: not a sample
    assert runs.steps() == 4
    runs.observed(1, 4 * 0.0001, samples=8)  # not pending any more: ignored
    runs.planned(2, 4, 2)
    runs.observed(2, 4 * 0.0001, samples=8)
    assert runs.steps() == round(0.02 / (0.005 + 0.25 * (0.0001 - 0.005)))
    runs.timing.seconds = 1e-6
    assert runs.steps() == MAX_DECODE_STEPS
    assert DecodeRuns(0.0).steps() == 1


def test_a_run_covers_its_positions_and_its_tokens_arrive_in_order() -> None:
    s = make()
    step = decoding(s, "a", "b")
    a = s.requests["a"]
    before = a.num_scheduled
    plan = s.plan(step)
    assert plan.decode_steps == 4 and [x.rid for x in plan.slices] == ["a", "b"]
    first = plan.slices[0]
    assert (first.start, first.num_tokens) == (before, 1) and a.num_scheduled == before + 4 and a.pending_samples == 4
    assert len(a.blocks) * 4 >= before + 4 and a.blocks_sent == len(a.blocks)  # the slice's new blocks cover the whole run
    out = answer(s, plan, {"a": [11, 12, 13, 14], "b": [21, 22, 23, 24]})
    assert [d.token_ids[0] for d in out.deltas if d.rid == "a"] == [11, 12, 13, 14]
    assert a.output_ids[-4:] == [11, 12, 13, 14] and a.pending_samples == 0


def test_a_stop_token_inside_a_run_ends_the_request_there() -> None:
    s = make()
    step = decoding(s, "a", "b")
    plan = s.plan(step)
    out = answer(s, plan, {"a": [11, STOP], "b": [21, 22, 23, 24]})  # the worker left a out after its stop token
    assert [(d.rid, d.finish) for d in out.deltas if d.finish] == [("a", FinishReason.STOP.value)]
    assert "a" not in s.requests and out.released == ["a"]
    assert s.requests["b"].output_ids[-4:] == [21, 22, 23, 24]
    s.pool.check()


def test_a_waiting_request_or_a_prefill_keeps_plans_to_one_step() -> None:
    s = make()
    step = decoding(s, "a")
    submit(s, "late", prompt=list(range(10, 110)))  # longer than a step's budget of 64
    plan = s.plan(step)
    assert plan.decode_steps == 1 and [(x.rid, x.num_tokens) for x in plan.slices] == [("a", 1), ("late", 63)]
    assert s.plan(step + 1).decode_steps == 1  # late still prefills
    assert s.plan(step + 2).decode_steps == 4  # late's prompt is all scheduled: decodes alone again


def test_the_run_stops_at_the_nearest_max_tokens_and_waits_for_min_tokens() -> None:
    s = make()
    submit(s, "short", max_tokens=4)
    step = decoding(s, "a")
    assert s.requests["short"].outputs_promised == 2
    plan = s.plan(step)
    assert plan.decode_steps == 2 and s.requests["short"].outputs_promised == 4  # its last two tokens, no more

    s = make()
    submit(s, "picky", min_tokens=10)
    step = decoding(s, "a")
    assert s.plan(step).decode_steps == 1  # a stop token before min_tokens would not end picky: no run


def test_without_free_blocks_for_the_whole_run_a_plan_runs_one_step() -> None:
    s = make(num_blocks=16)
    submit(s, "a", prompt=[5, 6, 7, 8])
    step = decoding(s)
    assert s.requests["a"].num_scheduled == 5 and len(s.requests["a"].blocks) == 2  # room up to position 8
    s.pool.allocate(s.pool.num_free)  # a run of 4 would need a third block
    plan = s.plan(step)
    assert plan.decode_steps == 1 and [x.rid for x in plan.slices] == ["a"]


def test_slices_tell_the_worker_the_stop_tokens_that_end_a_run() -> None:
    s = make()
    submit(s, "a")
    submit(s, "b", ignore_eos=True)
    plan = s.plan(0)
    assert {x.rid: x.stop_token_ids for x in plan.slices} == {"a": [STOP], "b": []}
    assert all(x.stop_token_ids == [] for x in s.plan(1).slices)  # sent with the sampling params only


def test_the_flag_reaches_the_scheduler_process_which_reports_the_run_length(tmp_path) -> None:
    argv = ["--model", DEFAULT_MODEL_DIR, "--run-dir", str(tmp_path), "--decode-plan-ms", "30", "--detokenize-in", "detokenizer"]
    config = StackConfig.from_argv(argv)
    loop = SchedulerLoop(config, structlog.get_logger())
    sent = []
    loop.to_detokenizer.send = sent.append
    try:
        for peer in loop.peers.values():
            peer.state, peer.seen, peer.serving = "ready", 1e18, True
        assert REGISTRY.get_sample_value("tokenyard:scheduler_decode_steps_per_plan") == 1  # nothing measured yet
        loop._handle(Submit(rid="r1", prompt_ids=[1, 2, 3], max_tokens=100))
        for _ in range(2):  # the prompt, then a plan of decodes alone
            loop._plan_and_send()
            step = min(loop.in_flight)
            loop._handle(StepResult(step=step, sampled=[Sampled(rid="r1", token_id=7)], forward_s=0.01))
        assert loop.instrumentation()["decode_plan"] == {"target_ms": 30.0, "ms_per_step": 10.0, "steps": 3}
        assert REGISTRY.get_sample_value("tokenyard:scheduler_decode_steps_per_plan") == 3
        assert sent == []  # the tokens reach the detokenizer from the worker, not from here
        loop._handle(Abort(rid="r1"))
        assert [(d.rid, d.finish) for batch in sent for d in batch.deltas] == [("r1", "abort")]  # an ending from outside does
    finally:
        loop.close()
