"""A hybrid model's prefix cache: prefills save GDN state checkpoints at the interval's and the anchors' blocks,
an admission resumes at the longest cached prefix that ends at one, and checkpoints go with their KV prefix."""

from __future__ import annotations

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.state_slots import CheckpointPool, SlotPool
from shared.frames import Sampled, StepPlan, StepResult, Submit


def make(num_blocks: int = 64, checkpoints: int = 8, interval: int = 16, budget: int = 64) -> Scheduler:
    return Scheduler(BlockPool(num_blocks, 4), 4, budget, 100, SlotPool(4), checkpoints=CheckpointPool(checkpoints), checkpoint_interval=interval)


def submit(s: Scheduler, rid: str, prompt: list[int], anchors: list[int] = (), max_tokens: int = 2) -> None:
    s.submit(Submit(rid=rid, prompt_ids=prompt, max_tokens=max_tokens, stop_token_ids=[0], anchors=list(anchors)))


def answer(s: Scheduler, plan: StepPlan, token: int = 7) -> None:
    s.on_result(StepResult(step=plan.step, sampled=[Sampled(rid=x.rid, token_id=token) for x in plan.slices if x.sample]))


def run(s: Scheduler, step: int) -> int:
    """Plans and answers until nothing is left; returns the next step."""
    while s.requests:
        answer(s, s.plan(step))
        step += 1
    return step


HISTORY = list(range(1, 23))  # 22 tokens: messages end at 9 and 17, the prompt at 22


def test_a_prefill_saves_checkpoints_at_the_interval_and_at_each_anchor_rounded_down_to_a_block() -> None:
    s = make(interval=16)
    submit(s, "a", HISTORY, anchors=[9, 17, 22])
    (chunk,) = s.plan(0).slices
    # anchors 9, 17, 22 → blocks end at 8, 16 (also the interval's), 20
    assert [p for p, _ in chunk.checkpoints] == [8, 16, 20]
    assert len({c for _, c in chunk.checkpoints}) == 3 and chunk.restore == -1


def test_a_follow_up_turn_resumes_at_the_last_anchor_it_shares_and_recomputes_only_what_follows() -> None:
    s = make()
    submit(s, "turn1", HISTORY, anchors=[9, 17, 22])
    step = run(s, 0)
    submit(s, "turn2", [*HISTORY, 50, 51, 52, 53, 54, 55], anchors=[9, 17, 22, 28])
    (chunk,) = s.plan(step).slices
    assert chunk.start == 20 and chunk.restore >= 0  # the checkpoint after block 5, saved by turn 1
    assert chunk.token_ids == [21, 22, 50, 51, 52, 53, 54, 55]
    assert chunk.opened.cached_tokens == 20
    assert [p for p, _ in chunk.checkpoints] == [28]  # its new message's end (the interval's 32 is past the prompt)
    assert s.checkpoints.restored == 1 and s.pool.hits == 20


def test_an_edited_message_resumes_at_the_anchor_before_it() -> None:
    s = make()
    submit(s, "turn1", HISTORY, anchors=[9, 17, 22])
    step = run(s, 0)
    edited = [*HISTORY[:17], 99, 98, 97, 96, 95]  # the message after 17 differs from its second token
    submit(s, "edit", edited, anchors=[9, 17, 22])
    (chunk,) = s.plan(step).slices
    assert chunk.start == 16 and chunk.restore >= 0  # cached blocks reach 17, but the last checkpoint there is at 16


def test_a_cached_prefix_without_a_checkpoint_at_its_end_is_not_a_hit() -> None:
    s = make(interval=64)
    submit(s, "a", HISTORY)  # a checkpoint at 20 only (the prompt's end)
    step = run(s, 0)
    submit(s, "b", [*HISTORY[:14], 90, 91, 92])  # 3 cached blocks, none ending at a checkpoint
    (chunk,) = s.plan(step).slices
    assert chunk.start == 0 and chunk.restore == -1
    assert s.pool.queries > 0 and s.pool.hits == 0


def test_a_checkpoint_saved_by_a_plan_is_restored_only_by_later_plans() -> None:
    s = make(budget=64)
    submit(s, "a", HISTORY, anchors=[9])
    submit(s, "b", HISTORY, anchors=[9])  # admitted in the same plan: a's checkpoints are not written yet
    p0 = s.plan(0)
    assert [(x.rid, x.start, x.restore) for x in p0.slices] == [("a", 0, -1), ("b", 0, -1)]
    assert not p0.slices[1].checkpoints  # a saves them; b computes the same prefix without saving it twice
    submit(s, "c", HISTORY)
    p1 = s.plan(1)
    (c,) = [x for x in p1.slices if x.rid == "c"]
    assert c.start == 20 and c.restore >= 0


def test_evicting_kv_blocks_drops_the_checkpoints_over_them() -> None:
    s = make(num_blocks=8, interval=8)
    submit(s, "a", list(range(1, 18)))  # checkpoints at 8 and 16; 5 blocks
    step = run(s, 0)
    assert len(s.checkpoints) == 2
    submit(s, "b", list(range(100, 125)))  # 25 tokens + 2 outputs: 7 blocks, evicting a's idle blocks
    step = run(s, step)
    for checkpoint in s.checkpoints:
        assert all(s.pool.is_cached(h) for h in checkpoint.chain)
    assert all(c.chain[0] != s.pool.block_hash(None, (1, 2, 3, 4)) for c in s.checkpoints)
    submit(s, "a2", list(range(1, 18)))
    (chunk,) = s.plan(step).slices
    assert chunk.start == 0 and chunk.restore == -1


def test_a_full_checkpoint_pool_evicts_its_least_recent_checkpoint_and_sends_its_blocks_first() -> None:
    s = make(checkpoints=2, interval=64)
    submit(s, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # checkpoint at 8
    step = run(s, 0)
    submit(s, "b", [11, 12, 13, 14, 15, 16, 17, 18, 19])
    step = run(s, step)
    submit(s, "c", [21, 22, 23, 24, 25, 26, 27, 28, 29])  # the pool is full: a's checkpoint goes
    step = run(s, step)
    s.checkpoints.check()
    assert len(s.checkpoints) == 2
    submit(s, "a2", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    (chunk,) = s.plan(step).slices
    assert chunk.start == 0  # a's blocks may still be cached, but no checkpoint ends there any more
    # a's blocks lost their checkpoint: they are first in the LRU, before b's and c's
    first_idle = next(iter(s.pool._idle))
    assert s.pool._hash_of.get(first_idle) not in {h for c in s.checkpoints for h in c.chain}


def test_a_preempted_request_resumes_from_its_own_checkpoint() -> None:
    s = make(num_blocks=9, interval=8, budget=64)
    submit(s, "old", list(range(1, 17)), max_tokens=16)  # checkpoints at 8 and 16
    answer(s, s.plan(0))
    submit(s, "new", list(range(40, 56)), max_tokens=16)
    step = 1
    while not s.num_preemptions:
        answer(s, s.plan(step))
        step += 1
    (victim,) = s.waiting
    assert victim.slot == -1 and victim.restore is None  # a preempted request holds no slot
    readmitted = None
    while readmitted is None:
        plan = s.plan(step)
        answer(s, plan)
        step += 1
        readmitted = next((x for x in plan.slices if x.rid == victim.rid and x.token_ids), None)
    assert readmitted.start > 0 and readmitted.restore >= 0


def test_a_lost_worker_empties_the_cache_of_blocks_and_checkpoints() -> None:
    s = make()
    submit(s, "a", HISTORY, anchors=[9, 17])
    step = run(s, 0)
    s.clear_prefix_cache()
    assert len(s.checkpoints) == 0 and s.pool.num_cached == 0
    submit(s, "b", HISTORY)
    (chunk,) = s.plan(step).slices
    assert chunk.start == 0 and chunk.restore == -1


def test_a_failed_request_takes_the_checkpoints_it_saved_with_it() -> None:
    s = make()
    submit(s, "a", HISTORY, anchors=[9, 17])
    s.plan(0)
    assert len(s.checkpoints) == 3
    s.fail(["a"])
    assert len(s.checkpoints) == 0
    s.checkpoints.check()


def test_a_full_pool_evicts_a_checkpoint_that_a_longer_one_extends_before_a_conversations_end() -> None:
    s = make(checkpoints=3, interval=4)
    submit(s, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # checkpoints at 4 (interior) and 8 (a's end)
    step = run(s, 0)
    submit(s, "c", [1, 2, 3, 4, 50, 51, 52, 53, 54])  # resumes at 4 (now the most recent) and saves c's end at 8
    step = run(s, step)
    submit(s, "b", [11, 12, 13, 14, 15])  # the pool is full: the interior 4 goes, not a's older end
    step = run(s, step)
    s.checkpoints.check()
    assert sorted((c.position, c.owner) for c in s.checkpoints) == [(4, "b"), (8, "a"), (8, "c")]
    submit(s, "a2", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # a's follow-up resumes at a's end
    (chunk,) = s.plan(step).slices
    assert chunk.start == 8
