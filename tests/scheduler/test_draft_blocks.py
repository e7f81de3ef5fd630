"""Property-based: with a draft model, random submits, pipelined steps whose verifies accept any number of
proposals, finishes, aborts and preemptions never leak a draft block nor hand one to two requests at once.

After every operation each draft block is free or held by exactly one live request, a request holds draft blocks
only while it runs and no more than its target blocks, and at quiescence none is held. A worker that runs the plans
in order, growing each request's draft table by its slices' ``draft_blocks``, cutting it after a verify as the
runner does and forgetting released requests, never finds a draft block in two live tables.
"""

from __future__ import annotations

import random
from collections import Counter, deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core import AdmissionError, Scheduler
from services.scheduler.draft_blocks import DraftBlocks
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.requests import Phase
from services.scheduler.speculation import Speculation, blocks_kept
from shared.frames import FinishReason, Sampled, StepPlan, StepResult, Submit

BLOCK_SIZE = 4

operation = st.one_of(
    st.tuples(st.just("submit"), st.lists(st.integers(1, 5), min_size=1, max_size=12), st.integers(1, 16)),
    st.tuples(st.just("plan")),
    st.tuples(st.just("result")),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


class WorkerView:
    """The worker's draft tables, fed plans and releases in the order the scheduler sends them; a verify keeps a
    random run of its proposals, decided when it runs, as the runner does."""

    def __init__(self, rng: random.Random) -> None:
        self.tables: dict[str, list[int]] = {}
        self.rng = rng

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.tables.pop(rid, None)

    def run(self, plan: StepPlan) -> StepResult:
        sampled = []
        for s in plan.slices:
            table = self.tables.setdefault(s.rid, [])
            table.extend(s.draft_blocks)
            if not s.sample:
                continue
            tokens = self.rng.randint(1, s.num_tokens) if not s.token_ids and s.num_tokens > 1 else plan.decode_steps
            if not s.token_ids and s.num_tokens > 1:
                del table[blocks_kept(s.start + tokens, BLOCK_SIZE) :]
            sampled += [Sampled(rid=s.rid, token_id=7) for _ in range(tokens)]
        held = Counter(b for table in self.tables.values() for b in table)
        assert all(n == 1 for n in held.values()), f"step {plan.step}: a draft block is in two live tables: {held}"
        return StepResult(step=plan.step, sampled=sampled)


def check_invariants(s: Scheduler) -> None:
    pool = s.draft_blocks.pool
    pool.check()
    holders = Counter(b for r in s.requests.values() for b in r.draft_blocks)
    for block in range(pool.num_blocks):
        assert pool._refs[block] == holders[block], f"draft block {block}: refs {pool._refs[block]} but {holders[block]} holders"
    for r in s.requests.values():
        assert r.phase is Phase.RUNNING or not r.draft_blocks, f"{r.rid} holds draft blocks while {r.phase.value}"
        assert len(r.draft_blocks) <= len(r.blocks), f"{r.rid} holds more draft blocks than blocks"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(operation, max_size=80),
    num_blocks=st.integers(4, 16),
    draft_blocks=st.integers(1, 16),
    budget=st.integers(2, 16),
    k=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
def test_no_draft_block_leaks_or_is_shared(ops: list[tuple], num_blocks: int, draft_blocks: int, budget: int, k: int, seed: int) -> None:
    s = Scheduler(
        BlockPool(num_blocks, BLOCK_SIZE),
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_waiting=16,
        speculation=Speculation(k, 4),
        draft_blocks=DraftBlocks(draft_blocks, BLOCK_SIZE),
    )
    worker = WorkerView(random.Random(seed))
    in_flight: deque[StepResult] = deque()
    submitted: list[str] = []
    step = 0

    def send_plan() -> None:
        nonlocal step
        plan = s.plan(step)
        worker.release(s.take_released())  # sent before the plan
        step += 1
        if plan.slices:
            in_flight.append(worker.run(plan))  # the worker runs plans in order; results come back later

    def deliver() -> None:
        worker.release(s.on_result(in_flight.popleft()).released)

    for op in ops:
        if op[0] == "submit":
            rid = f"r{len(submitted)}"
            try:
                s.submit(Submit(rid=rid, prompt_ids=op[1], max_tokens=op[2], ignore_eos=True))
                submitted.append(rid)
            except AdmissionError:
                pass
        elif op[0] == "plan" and len(in_flight) < 2:
            send_plan()
        elif op[0] == "result" and in_flight:
            deliver()
        elif op[0] == "abort" and submitted:
            worker.release(s.finish(submitted[op[1] % len(submitted)], FinishReason.ABORT).released)
        check_invariants(s)

    for _ in range(2000):  # drain: every request finishes and gives back every draft block
        if not s.requests and not in_flight:
            break
        if len(in_flight) < 2:
            send_plan()
        if in_flight:
            deliver()
        check_invariants(s)
    assert not s.requests, "requests never finished"
    assert s.draft_blocks.pool.num_used == 0 and s.pool.num_used == 0
