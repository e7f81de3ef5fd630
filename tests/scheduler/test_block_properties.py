"""Property-based: random submits, pipelined steps, finishes, aborts and preemptions never leak a block
or a GDN state slot.

After every operation each block is exactly one of free, held or idle-cached, its
reference count equals the number of live requests holding it, and at quiescence no
block is held. With state slots (a hybrid model), each running request holds exactly one
slot, no two live requests share one, and a worker that sees plans and releases in the order
they were sent never finds a slice in a slot that another request it still knows holds.
"""

from __future__ import annotations

from collections import Counter, deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core import AdmissionError, Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.state_slots import SlotPool
from shared.frames import FinishReason, Sampled, StepPlan, StepResult, Submit

EOS = 0
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9]]

operation = st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(PREFIXES) - 1), st.lists(st.integers(1, 5), min_size=1, max_size=12), st.integers(1, 12)),
    st.tuples(st.just("plan")),
    st.tuples(st.just("result"), st.lists(st.integers(0, 6), min_size=8, max_size=8)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("stop"), st.integers(0, 40)),
)


def check_invariants(s: Scheduler) -> None:
    s.pool.check()
    holders = Counter(b for r in s.requests.values() for b in r.blocks)
    for block in range(s.pool.num_blocks):
        assert s.pool._refs[block] == holders[block], f"block {block}: refs {s.pool._refs[block]} but {holders[block]} holders"
    for r in s.running:
        assert len(r.blocks) * s.pool.block_size >= r.num_scheduled
    if s.slots is not None:
        s.slots.check()
        held = [r.slot for r in s.running]
        assert all(slot >= 0 for slot in held), "a running request holds no slot"
        assert len(set(held)) == len(held), f"two running requests share a slot: {held}"
        assert all(r.slot == -1 for r in s.waiting), "a waiting request holds a slot"
        assert s.slots.num_used == len(held), "a slot is held by no live request"


class WorkerView:
    """The worker's slot table, fed plans and releases in the order the scheduler sends them."""

    def __init__(self) -> None:
        self.holder: dict[int, str] = {}

    def release(self, rids: list[str]) -> None:
        self.holder = {slot: rid for slot, rid in self.holder.items() if rid not in rids}

    def run(self, plan: StepPlan) -> None:
        slots = [x.slot for x in plan.slices]
        assert len(set(slots)) == len(slots), f"step {plan.step} puts two slices in one slot"
        for x in plan.slices:
            assert self.holder.get(x.slot, x.rid) == x.rid, f"{x.rid} computes in slot {x.slot}, which {self.holder[x.slot]} still holds"
            self.holder[x.slot] = x.rid


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(operation, max_size=80), num_blocks=st.integers(3, 12), budget=st.integers(1, 16), prefix_cache=st.booleans())
def test_no_block_or_slot_leaks_or_double_frees(ops: list[tuple], num_blocks: int, budget: int, prefix_cache: bool, hybrid: bool) -> None:
    # A hybrid model runs without the prefix cache, with one slot per request that may run.
    slots = SlotPool(4) if hybrid else None
    s = Scheduler(BlockPool(num_blocks, 4, prefix_cache and not hybrid), max_num_seqs=4, max_num_batched_tokens=budget, max_waiting=16, slots=slots)
    worker = WorkerView()
    in_flight: deque[StepPlan] = deque()
    submitted: list[str] = []
    step = 0

    def deliver(tokens: list[int]) -> None:
        plan = in_flight.popleft()
        sampled = [Sampled(rid=x.rid, token_id=tokens[i % len(tokens)]) for i, x in enumerate(plan.slices) if x.sample]
        worker.release(s.on_result(StepResult(step=plan.step, sampled=sampled)).released)

    def send_plan() -> None:
        nonlocal step
        plan = s.plan(step)
        worker.release(s.take_released())  # sent before the plan
        step += 1
        if plan.slices:
            if hybrid:
                worker.run(plan)  # the worker runs plans in order; results come back later
            in_flight.append(plan)

    for op in ops:
        if op[0] == "submit":
            rid = f"r{len(submitted)}"
            try:
                s.submit(Submit(rid=rid, prompt_ids=PREFIXES[op[1]] + op[2], max_tokens=op[3], stop_token_ids=[EOS]))
                submitted.append(rid)
            except AdmissionError:
                pass
        elif op[0] == "plan" and len(in_flight) < 2:
            send_plan()
        elif op[0] == "result" and in_flight:
            deliver(op[1])
        elif op[0] in ("abort", "stop") and submitted:
            worker.release(s.finish(submitted[op[1] % len(submitted)], FinishReason.ABORT if op[0] == "abort" else FinishReason.STOP).released)
        check_invariants(s)

    # Drain: run to completion, every request must finish and free everything.
    for _ in range(2000):
        if not s.requests and not in_flight:
            break
        if len(in_flight) < 2:
            send_plan()
        if in_flight:
            deliver([3])
        check_invariants(s)
    assert not s.requests, "requests never finished"
    assert s.pool.num_used == 0
    assert slots is None or slots.num_used == 0
