"""The scheduler's side of speculative decoding: which requests speculate (the batch-size rule, their end rules,
structured outputs, the proposal length that pays), the positions a verify plans, and the blocks of its rejected
positions given back when its result comes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.loop import SchedulerLoop
from services.scheduler.speculation import Speculation, best_draft
from shared.config import StackConfig
from shared.frames import FinishReason, Grammar, GrammarKind, Sampled, SamplingParams, StepPlan, StepResult, Submit

STOP = 0


def make(k: int = 3, max_batch: int = 4, num_blocks: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, 4, False), max_num_seqs=8, max_num_batched_tokens=64, max_waiting=100, speculation=Speculation(k, max_batch))


def submit(s: Scheduler, rid: str, prompt_len: int = 6, max_tokens: int = 50, **kw) -> None:
    s.submit(Submit(rid=rid, prompt_ids=list(range(1, prompt_len + 1)), max_tokens=max_tokens, stop_token_ids=[STOP], **kw))


def answer(s: Scheduler, plan: StepPlan, tokens: dict[str, list[int]] | None = None):
    """Each sampling slice's tokens (one each unless given), in the order the worker sends them."""
    tokens = tokens or {x.rid: [7] for x in plan.slices if x.sample}
    return s.on_result(StepResult(step=plan.step, sampled=[Sampled(rid, t) for rid, run in tokens.items() for t in run]))


def decoding(s: Scheduler, *rids: str, **kw) -> None:
    for rid in rids:
        submit(s, rid, **kw)
    answer(s, s.plan(0))  # the prompts and the first tokens


def test_a_verify_plans_k_plus_one_positions_and_gives_back_the_blocks_of_rejected_ones() -> None:
    s = make(k=3)
    decoding(s, "a")  # 6 prompt positions in 2 blocks of 4, one output
    plan = s.plan(1)
    (x,) = plan.slices
    assert (x.start, x.num_tokens, x.token_ids, len(x.new_blocks)) == (6, 4, [], 1)  # positions 6..9: a third block
    assert s.pool.num_used == 3 and s.plan(2).slices == []  # nothing more for it while its verify is in flight
    outcome = answer(s, plan, {"a": [9]})  # every proposal rejected: the target's own token alone
    assert [(d.rid, d.token_ids) for d in outcome.deltas] == [("a", [9])]
    request = s.requests["a"]
    assert request.num_scheduled == 7 and request.output_ids == [7, 9]  # position 7 (token 9) is fed next
    assert s.pool.num_used == 2 and len(request.blocks) == 2 and request.blocks_sent == 2  # the third went back
    x = s.plan(3).slices[0]
    assert x.start == 7


def test_an_accepted_run_keeps_its_positions_and_its_tokens_arrive_in_one_delta() -> None:
    s = make(k=3)
    decoding(s, "a")
    outcome = answer(s, s.plan(1), {"a": [3, 4, 5, 6]})  # all three accepted, and the target's token after them
    assert [(d.rid, d.token_ids) for d in outcome.deltas] == [("a", [3, 4, 5, 6])]
    request = s.requests["a"]
    assert request.num_scheduled == 10 and request.output_ids == [7, 3, 4, 5, 6] and len(request.blocks) == 3
    assert s.plan(2).slices[0].start == 10


def test_a_stop_token_inside_an_accepted_run_ends_the_request_and_frees_its_blocks() -> None:
    s = make(k=3)
    decoding(s, "a")
    outcome = answer(s, s.plan(1), {"a": [3, STOP, 5]})  # the worker cuts its run at the stop token; if not, the rest is dropped
    assert [(d.rid, d.token_ids, d.finish) for d in outcome.deltas] == [("a", [3, STOP], FinishReason.STOP)]
    assert outcome.released == ["a"] and s.pool.num_used == 0 and not s.requests


def test_a_run_never_passes_max_tokens_nor_speculates_before_min_tokens() -> None:
    s = make(k=3)
    decoding(s, "a", max_tokens=3)
    assert s.plan(1).slices[0].num_tokens == 2  # one output out, two to go: one proposal and the target's own token
    s = make(k=3)
    decoding(s, "b", min_tokens=3)
    plan = s.plan(1)
    assert plan.slices[0].num_tokens == 1  # a stop token before min_tokens does not end it: runs could not stop there
    answer(s, plan)
    plan = s.plan(2)
    assert plan.slices[0].num_tokens == 1
    answer(s, plan)
    assert s.plan(3).slices[0].num_tokens == 4


def test_beyond_max_batch_nothing_speculates() -> None:
    s = make(k=2, max_batch=2)
    decoding(s, "a", "b", "c")
    assert [x.num_tokens for x in s.plan(1).slices] == [1, 1, 1]
    s = make(k=2, max_batch=3)
    decoding(s, "a", "b", "c")
    assert [x.num_tokens for x in s.plan(1).slices] == [3, 3, 3]


def test_a_structured_output_decodes_plainly() -> None:
    s = make()
    grammar = SamplingParams(grammar=Grammar(GrammarKind.REGEX, "[a-z]+"), frequency_penalty=0.5)
    decoding(s, "json", sampling=grammar)
    assert s.plan(1).slices[0].num_tokens == 1


def test_the_proposal_length_is_the_one_with_the_most_tokens_per_unit_of_step_time() -> None:
    assert best_draft(0.05, 0.0, 7) == 7  # verified positions cost nothing (a GPU's small batch): propose all k
    assert best_draft(0.15, 0.2, 7) == 0  # a position holds less often than it costs: a plain decode
    assert best_draft(0.5, 0.3, 7) == 1  # 1.5 tokens in 1.3 steps; 1.75 in 1.6 is worse
    assert best_draft(0.9, 0.15, 7) == 7  # a copy: 5.7 tokens in 2.05 steps, more per step than any shorter one
    lengths = [[best_draft(rate / 20, cost / 20, 8) for cost in range(21)] for rate in range(21)]
    assert all(row == sorted(row, reverse=True) for row in lengths)  # never longer where a position costs more
    assert all(list(column) == sorted(column) for column in zip(*lengths))  # never shorter where positions hold more often


def timed(s: Scheduler, plan: StepPlan, seconds: float, tokens: dict[str, list[int]] | None = None, proposed: dict[str, int] | None = None):
    tokens = tokens or {x.rid: [7] * plan.decode_steps for x in plan.slices}
    sampled = [Sampled(rid, t) for rid, run in tokens.items() for t in run]
    return s.on_result(StepResult(step=plan.step, sampled=sampled, forward_s=seconds, proposed=proposed or {}))


def test_a_verified_positions_cost_is_measured_against_a_plain_decode_step() -> None:
    s = make(k=3)
    decoding(s, "a", min_tokens=2)
    assert s.speculation.position_cost.share == 0.0  # nothing timed: every proposal as long as k
    plan = s.plan(1)
    assert plan.slices[0].num_tokens == 1  # before min_tokens: a plain decode, 5 ms
    timed(s, plan, 0.005)
    plan = s.plan(2)
    assert plan.slices[0].num_tokens == 4
    timed(s, plan, 0.008, {"a": [3, 4, 5]}, {"a": 3})  # 3 ms more for 3 proposed positions
    assert s.speculation.position_cost.share == pytest.approx(0.2)
    assert s.speculation.describe() == {"plain_step_ms": 5.0, "position_ms": 1.0, "position_cost": 0.2}
    plan = s.plan(3)
    timed(s, plan, 0.008, {"a": [3, 9]}, {"a": 1})  # a proposer that had only one guess: 3 ms for 1 position
    assert s.speculation.position_cost.position_s == pytest.approx(0.001 + 0.25 * 0.002)


def test_a_request_whose_proposals_stop_holding_decodes_plainly_and_tries_again_later() -> None:
    s = make(k=3, num_blocks=128)
    decoding(s, "a", max_tokens=500)
    s.speculation.position_cost.plain_s, s.speculation.position_cost.position_s = 0.005, 0.001  # a position: 0.2 of a step
    step, proposals = 1, []
    while len(proposals) < 40:
        plan = s.plan(step)
        step += 1
        proposed = plan.slices[0].num_tokens - 1
        proposals.append(proposed)
        answer(s, plan, {"a": [9] * max(plan.decode_steps, 1)})  # a verify's proposals all rejected
    first_plain = proposals.index(0)
    assert proposals[0] == 2 and 0 < first_plain < 10  # two in three hold at first: 2 of k = 3; then fewer, then none
    assert 1 in proposals[first_plain:]  # as the evidence fades it tries again, with one token
    assert proposals[first_plain:].count(0) > 3 * proposals[first_plain:].count(1)  # mostly plain while nothing holds
    for _ in range(4):  # then its proposals hold
        while (plan := s.plan(step)).slices[0].num_tokens == 1:
            step += 1
            answer(s, plan)
        step += 1
        draft = plan.slices[0].num_tokens - 1
        answer(s, plan, {"a": [3] * (draft + 1)})
    assert draft == 3  # back to k


def test_a_seeded_requests_proposal_length_does_not_follow_measured_times() -> None:
    s = make(k=3)
    decoding(s, "plain", sampling=SamplingParams(temperature=1.0))
    decoding(s, "seeded", sampling=SamplingParams(temperature=1.0, seed=7))
    s.speculation.position_cost.plain_s, s.speculation.position_cost.position_s = 0.005, 0.005  # a position as dear as a step
    assert s.speculation.drafts(s.running) == {"seeded": 2}  # its draws repeat only if its lengths depend on its tokens alone


def test_a_verify_whose_proposer_had_no_guess_says_nothing_of_acceptance() -> None:
    s = make(k=2, num_blocks=128)
    decoding(s, "a", max_tokens=500)
    rate = s.requests["a"].acceptance.rate
    for step in range(1, 6):  # the worker proposed nothing: one token each time
        plan = s.plan(step)
        assert plan.slices[0].num_tokens == 3
        s.on_result(StepResult(step=plan.step, sampled=[Sampled("a", 9)], proposed={"a": 0}))
    assert s.requests["a"].acceptance.rate == rate
    plan = s.plan(6)
    s.on_result(StepResult(step=plan.step, sampled=[Sampled("a", 9)], proposed={"a": 2}))  # a guess, rejected
    assert s.requests["a"].acceptance.rate < rate


def test_a_request_whose_proposer_has_no_guess_decodes_plainly_a_step_a_plan_until_it_has_one() -> None:
    s = make(k=3)
    s.decode_runs.steps = lambda: 4  # runs of 4 decode steps wherever a plan of decodes alone may run them
    submit(s, "a")
    plan = s.plan(0)
    s.on_result(StepResult(step=0, sampled=[Sampled("a", 7)], no_guess=["a"]))  # prompt lookup found no n-gram after it
    plan = s.plan(1)
    assert plan.slices[0].num_tokens == 1 and plan.decode_steps == 1  # a plain decode, alone: a guess must not wait for a run
    pipelined = s.plan(2)  # planned while it is in flight
    assert pipelined.slices and pipelined.slices[0].num_tokens == 1
    s.on_result(StepResult(step=1, sampled=[Sampled("a", 7)]))  # a guess after its token
    assert s.plan(3).slices == []  # the verify waits for the token in flight
    s.on_result(StepResult(step=2, sampled=[Sampled("a", 7)]))
    assert s.plan(4).slices[0].num_tokens == 4
    s = make(k=3, max_batch=1)
    s.decode_runs.steps = lambda: 4
    decoding(s, "a", "b")  # more requests than may speculate: plain decodes in runs, as without speculation
    assert s.plan(1).decode_steps == 4
    s = make(k=3)
    s.decode_runs.steps = lambda: 4
    decoding(s, "json", sampling=SamplingParams(grammar=Grammar(GrammarKind.REGEX, "[a-z]+")))  # never speculates
    assert s.plan(1).decode_steps == 4


def test_a_verify_of_a_request_preempted_meanwhile_keeps_no_blocks() -> None:
    s = make(k=3)
    decoding(s, "a")
    plan = s.plan(1)
    s._preempt(s.requests["a"])  # as a request admitted later would make it
    answer(s, plan, {"a": [3, 4]})
    assert s.pool.num_used == 0
    s.pool.check()


def loop_for(tmp_path: Path, model_type: str, extra: dict | None = None, **flags: object) -> SchedulerLoop:
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": model_type, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_size": 64}
    (model / "config.json").write_text(json.dumps({**config, **(extra or {}), "vocab_size": 256, "max_position_embeddings": 256}))
    stack = StackConfig(model=str(model), run_dir=str(tmp_path / "run"), kv_cache_tokens=1024, **flags)
    return SchedulerLoop(stack, structlog.get_logger())


def test_the_scheduler_process_reports_the_method_and_k(tmp_path: Path) -> None:
    loop = loop_for(tmp_path, "qwen3", speculative_method="ngram", num_speculative_tokens=5, speculative_max_batch=2)
    facts = loop.instrumentation()["speculative"]
    assert facts == {"method": "ngram", "num_speculative_tokens": 5, "max_batch": 2, "plain_step_ms": None, "position_ms": None, "position_cost": 0.0}
    assert (loop.core.speculation.num_tokens, loop.core.speculation.max_batch) == (5, 2)


def test_without_a_method_nothing_speculates(tmp_path: Path) -> None:
    loop = loop_for(tmp_path, "qwen3")
    assert loop.instrumentation()["speculative"] is None and not loop.core.speculation.enabled


def test_a_hybrid_model_speculates_with_its_state_slots(tmp_path: Path) -> None:
    gdn = {"linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_num_value_heads": 4, "linear_value_head_dim": 16}
    loop = loop_for(tmp_path, "qwen3_next", gdn, speculative_method="ngram")
    assert loop.core.speculation.enabled and loop.core.slots is not None
