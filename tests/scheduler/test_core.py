"""The scheduling state machine: batching, chunked prefill, pipelining, blocks, preemption, endings."""

from __future__ import annotations

import pytest

from services.scheduler.core import AdmissionError, Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.state_slots import SlotPool
from shared.frames import FinishReason, Grammar, GrammarKind, Sampled, SamplingParams, StepPlan, StepResult, Submit, TokenLogprobs


def make(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 16, max_waiting: int = 100, prefix_cache: bool = True, slots: int = 0
) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, block_size, prefix_cache), max_num_seqs, budget, max_waiting, SlotPool(slots) if slots else None)


def submit(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 4, **kw) -> None:
    s.submit(Submit(rid=rid, prompt_ids=list(range(1, prompt_len + 1)), max_tokens=max_tokens, stop_token_ids=[0], **kw))


def answer(s: Scheduler, plan: StepPlan, token: int = 7):
    return s.on_result(StepResult(step=plan.step, sampled=[Sampled(rid=x.rid, token_id=token) for x in plan.slices if x.sample]))


def test_long_prompt_is_chunked_and_decodes_share_the_step() -> None:
    s = make(budget=8)
    submit(s, "a", 3, max_tokens=10)
    p0 = s.plan(0)
    assert [(x.rid, x.start, x.num_tokens, x.sample) for x in p0.slices] == [("a", 0, 3, True)]
    answer(s, p0)
    submit(s, "b", 20)
    p1 = s.plan(1)
    # a's decode comes first (no token: the worker feeds back its own sample), then b's first chunk
    assert [(x.rid, x.start, x.num_tokens, x.token_ids, x.sample) for x in p1.slices] == [("a", 3, 1, [], True), ("b", 0, 7, list(range(1, 8)), False)]
    p2 = s.plan(2)  # pipelined: planned before p1's result is back
    assert [(x.rid, x.start, x.num_tokens) for x in p2.slices] == [("a", 4, 1), ("b", 7, 7)]
    assert p2.slices[1].sampling is None and p1.slices[1].sampling is not None  # sampling params travel once


def test_blocks_grow_with_the_sequence_and_are_not_reserved_for_max_tokens() -> None:
    s = make(num_blocks=64, block_size=4)
    submit(s, "a", 5, max_tokens=200)
    plan = s.plan(0)
    assert len(plan.slices[0].new_blocks) == 2 and s.pool.num_used == 2
    answer(s, plan)
    for step in range(1, 4):  # positions 5, 6, 7 fit in block 2; position 8 needs a third block
        plan = s.plan(step)
        answer(s, plan)
    assert s.pool.num_used == 2
    answer(s, s.plan(4))
    assert s.pool.num_used == 3


def test_finish_on_eos_and_length_frees_blocks_and_drops_the_pipelined_token() -> None:
    s = make()
    submit(s, "a", 4, max_tokens=3)
    submit(s, "b", 4, max_tokens=100)
    p0 = s.plan(0)
    s.plan(1)  # in flight together with p0
    out = answer(s, p0, token=5)
    assert [d.finish for d in out.deltas] == [None, None]
    out = s.on_result(StepResult(step=1, sampled=[Sampled(rid="a", token_id=5), Sampled(rid="b", token_id=0)]))  # b samples EOS
    assert {d.rid: d.finish for d in out.deltas} == {"a": None, "b": FinishReason.STOP}
    assert out.released == ["b"]
    p2 = s.plan(2)
    assert [x.rid for x in p2.slices] == ["a"]
    out = answer(s, p2)
    assert out.deltas[0].finish is FinishReason.LENGTH  # 3 tokens: max_tokens reached
    assert s.plan(3).slices == []  # never schedules past max_tokens
    assert s.pool.num_used == 0 and not s.requests
    assert s.on_result(StepResult(step=1, sampled=[Sampled(rid="b", token_id=9)])).deltas == []  # late token dropped


def test_ignore_eos_and_min_tokens() -> None:
    s = make()
    submit(s, "a", 2, max_tokens=3, ignore_eos=True)
    submit(s, "b", 2, max_tokens=3, min_tokens=2)
    finishes = {}
    for step in range(4):
        plan = s.plan(step)
        for d in answer(s, plan, token=0).deltas:
            finishes.setdefault(d.rid, []).append(d.finish)
    assert finishes["a"] == [None, None, FinishReason.LENGTH]
    assert finishes["b"] == [None, FinishReason.STOP]


def test_abort_frees_everything_at_once() -> None:
    s = make()
    submit(s, "a", 9, max_tokens=50)
    submit(s, "b", 2, max_tokens=50)
    answer(s, s.plan(0))
    out = s.finish("a", FinishReason.ABORT)
    assert out.released == ["a"] and out.deltas[0].finish == "abort"
    s.finish("b", FinishReason.ABORT)
    assert s.pool.num_used == 0 and not s.running and not s.waiting
    assert s.finish("a", FinishReason.ABORT).deltas == []  # twice is harmless


def test_abort_of_a_waiting_request() -> None:
    s = make(max_num_seqs=1)
    submit(s, "a", 2)
    submit(s, "b", 2)
    s.plan(0)
    assert [r.rid for r in s.waiting] == ["b"]
    out = s.finish("b", FinishReason.ABORT)
    assert out.released == [] and not s.waiting


def test_preemption_of_the_newest_under_kv_pressure_and_recompute() -> None:
    s = make(num_blocks=4, block_size=4, budget=64)
    submit(s, "old", 4, max_tokens=8)
    submit(s, "new", 4, max_tokens=8)
    answer(s, s.plan(0))  # both prefilled: 1 block each, 1 token out each
    tokens = {"old": 1, "new": 1}
    preempted = False
    for step in range(1, 40):
        plan = s.plan(step)
        released = s.take_released()
        if released:
            assert released == ["new"]
            preempted = True
        out = answer(s, plan)
        for d in out.deltas:
            tokens[d.rid] += len(d.token_ids)
        if not s.requests:
            break
    assert preempted and s.num_preemptions >= 1
    assert tokens == {"old": 8, "new": 8}  # both finish with all their tokens despite the preemption
    assert s.pool.num_used == 0


def test_recomputed_request_resends_prompt_and_outputs() -> None:
    s = make(num_blocks=2, block_size=4, budget=64, max_num_seqs=4, prefix_cache=False)
    submit(s, "a", 3, max_tokens=5)
    submit(s, "b", 3, max_tokens=5)
    answer(s, s.plan(0), token=11)
    answer(s, s.plan(1), token=12)  # both at 5 tokens
    plan = s.plan(2)  # both need position 5 in a second block, and there is none: b is preempted
    assert s.take_released() == ["b"]
    answer(s, plan, token=13)
    s.finish("a", FinishReason.ABORT)
    plan = s.plan(3)
    (b,) = plan.slices
    assert b.rid == "b" and b.start == 0 and b.token_ids == [1, 2, 3, 11, 12] and b.sample and b.sampling is not None


def test_admission_errors() -> None:
    s = make(num_blocks=4, block_size=4, max_waiting=1)
    with pytest.raises(AdmissionError) as exc:
        submit(s, "big", 10, max_tokens=10)
    assert exc.value.status == 400 and "16" in exc.value.message
    submit(s, "a", 2)
    with pytest.raises(AdmissionError) as exc:
        submit(s, "a", 2)
    assert exc.value.status == 400
    with pytest.raises(AdmissionError) as exc:
        submit(s, "b", 2)
    assert exc.value.status == 429


def test_max_num_seqs_bounds_the_batch() -> None:
    s = make(max_num_seqs=2, budget=100)
    for i in range(4):
        submit(s, f"r{i}", 2, sampling=SamplingParams(temperature=0))
    plan = s.plan(0)
    assert [x.rid for x in plan.slices] == ["r0", "r1"] and len(s.waiting) == 2


def test_prefix_cache_reuses_full_blocks_and_reports_cached_tokens() -> None:
    s = make(num_blocks=16, block_size=4, budget=64)
    system = [9, 8, 7, 6, 5, 4, 3, 2, 1]  # two full blocks and one token
    s.submit(Submit(rid="a", prompt_ids=system + [100], max_tokens=2, stop_token_ids=[0]))
    (a,) = s.plan(0).slices
    assert (a.start, a.num_tokens) == (0, 10)
    s.submit(Submit(rid="b", prompt_ids=system + [200, 201], max_tokens=2, stop_token_ids=[0]))
    plan = s.plan(1)  # planned before a's result: a's blocks are already scheduled, so b may reuse them
    b = next(x for x in plan.slices if x.rid == "b")
    assert (b.start, b.num_tokens, b.token_ids) == (8, 3, [1, 200, 201])
    assert b.new_blocks[:2] == a.new_blocks[:2] and len(b.new_blocks) == 3  # the worker's table gets the shared blocks
    assert (a.opened.cached_tokens, b.opened.cached_tokens) == (0, 8)  # the detokenizer reports them in the usage
    s.on_result(StepResult(step=1, sampled=[Sampled(rid="a", token_id=5), Sampled(rid="b", token_id=5)]))
    assert (s.pool.queries, s.pool.hits) == (9 + 10, 8)
    s.finish("a", FinishReason.ABORT)
    s.finish("b", FinishReason.ABORT)
    s.pool.check()
    assert s.pool.num_used == 0 and s.pool.num_cached >= 2  # idle but still cached


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    s = make(num_blocks=16, block_size=4)
    prompt = list(range(10, 18))  # exactly two blocks
    s.submit(Submit(rid="a", prompt_ids=prompt, max_tokens=1, stop_token_ids=[0]))
    answer(s, s.plan(0))
    s.submit(Submit(rid="b", prompt_ids=prompt, max_tokens=1, stop_token_ids=[0]))
    (b,) = s.plan(1).slices
    assert (b.start, b.num_tokens, b.sample) == (4, 4, True)  # the last block is recomputed, not shared


def test_penalised_and_structured_requests_tell_the_worker_their_prompt_length_and_cached_tokens() -> None:
    s = make(budget=64)
    penalised = SamplingParams(frequency_penalty=0.5, logprobs=2)
    submit(s, "first", 9)
    answer(s, s.plan(0))  # its 8 leading prompt tokens (2 blocks) are now in the prefix cache
    submit(s, "plain", 9)
    submit(s, "pen", 9, sampling=penalised)
    submit(s, "json", 9, sampling=SamplingParams(grammar=Grammar(GrammarKind.JSON_SCHEMA, '{"type":"object"}')))  # its grammar resumes after recomputed outputs
    plan = s.plan(1)
    by_rid = {x.rid: x for x in plan.slices}
    assert (by_rid["plain"].start, by_rid["plain"].prompt_len, by_rid["plain"].prefix_ids) == (8, 0, [])  # frames stay small
    assert (by_rid["pen"].start, by_rid["pen"].prompt_len, by_rid["pen"].prefix_ids) == (8, 9, list(range(1, 9)))
    assert (by_rid["json"].start, by_rid["json"].prompt_len, by_rid["json"].prefix_ids) == (8, 9, list(range(1, 9)))
    out = s.on_result(StepResult(step=1, sampled=[Sampled("pen", 7, TokenLogprobs(-0.5, [7, 3], [-0.5, -1.0])), Sampled("plain", 7)]))
    logprobs = {d.rid: d.logprobs for d in out.deltas}
    assert logprobs == {"pen": [TokenLogprobs(-0.5, [7, 3], [-0.5, -1.0])], "plain": []}


def test_a_request_whose_grammar_compiles_waits_while_the_requests_behind_it_are_admitted() -> None:
    s = make(budget=64)
    grammar = SamplingParams(grammar=Grammar(GrammarKind.REGEX, "[a-z]+"))
    s.submit(Submit(rid="slow", prompt_ids=[1, 2, 3], max_tokens=4, stop_token_ids=[0], sampling=grammar), compiling=True)
    submit(s, "plain", 3)
    first = s.plan(0)
    assert [x.rid for x in first.slices] == ["plain"] and [r.rid for r in s.waiting] == ["slow"]
    answer(s, first)
    s.compiled("slow")
    assert [(x.rid, x.start, x.num_tokens) for x in s.plan(1).slices] == [("plain", 3, 1), ("slow", 0, 3)] and not s.waiting
    s.compiled("gone")  # a request that ended meanwhile: nothing to do


def test_hybrid_requests_hold_one_state_slot_from_admission_to_their_end() -> None:
    s = make(budget=64, max_num_seqs=2, slots=2, prefix_cache=False)
    for rid in "abc":
        submit(s, rid, 5, max_tokens=3)
    p0 = s.plan(0)
    assert [(x.rid, x.slot) for x in p0.slices] == [("a", 0), ("b", 1)]  # c waits: both slots are held
    answer(s, p0)
    p1 = s.plan(1)
    assert [(x.rid, x.slot) for x in p1.slices] == [("a", 0), ("b", 1)]  # every slice names its slot
    s.finish("a", FinishReason.ABORT)  # the abort gives slot 0 back at once
    assert s.slots.num_used == 1
    answer(s, p1)
    p2 = s.plan(2)
    assert {x.rid: x.slot for x in p2.slices} == {"b": 1, "c": 0}
    answer(s, p2)
    for step in range(3, 10):
        answer(s, s.plan(step))
    assert not s.requests
    assert s.slots.num_used == 0


def test_a_preempted_hybrid_request_gives_its_slot_back_and_takes_one_again_when_readmitted() -> None:
    s = make(num_blocks=2, block_size=4, budget=64, max_num_seqs=4, prefix_cache=False, slots=4)
    submit(s, "a", 3, max_tokens=5)
    submit(s, "b", 3, max_tokens=5)
    answer(s, s.plan(0))
    answer(s, s.plan(1))
    plan = s.plan(2)  # b is preempted for a's second block
    assert s.take_released() == ["b"] and s.slots.num_used == 1
    answer(s, plan)
    s.finish("a", FinishReason.ABORT)
    (b,) = s.plan(3).slices
    assert b.rid == "b" and b.start == 0 and b.slot >= 0 and s.slots.num_used == 1


def test_plain_models_send_no_slot() -> None:
    s = make()
    submit(s, "a", 5)
    assert s.plan(0).slices[0].slot == -1
