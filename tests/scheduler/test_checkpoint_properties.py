"""Property-based: a hybrid model's prefix cache under random submits, pipelined steps, finishes, aborts and
preemptions. No checkpoint is shared by two running requests' state slots, none outlives its KV prefix, the
pool's bound holds, and a worker that runs the plans in order restores every request from a checkpoint that
holds exactly the state of the tokens before its first slice.
"""

from __future__ import annotations

from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.core import AdmissionError, Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.state_slots import CheckpointPool, SlotPool
from shared.frames import FinishReason, Sampled, StepPlan, StepResult, Submit

EOS = 0
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 7, 8, 5, 5, 5, 5, 6]]

operation = st.one_of(
    st.tuples(
        st.just("submit"),
        st.integers(0, len(PREFIXES) - 1),
        st.lists(st.integers(1, 5), min_size=1, max_size=12),
        st.integers(1, 10),
        st.lists(st.integers(1, 25), max_size=3),
    ),
    st.tuples(st.just("plan")),
    st.tuples(st.just("result"), st.lists(st.integers(0, 6), min_size=8, max_size=8)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


class Worker:
    """What the worker's state pools hold, as token prefixes: each running slot the tokens it has computed,
    each checkpoint the tokens its state is after. Fed plans and releases in the order they are sent."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.slot_of: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.checkpoint: dict[int, tuple[int, ...]] = {}

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.slot_of.pop(rid, None)
            self.computed.pop(rid, None)

    def run(self, plan: StepPlan) -> None:
        slots = [x.slot for x in plan.slices]
        assert len(set(slots)) == len(slots), f"step {plan.step} puts two slices in one slot"
        restored = {x.rid: self.checkpoint.get(x.restore) for x in plan.slices if x.restore >= 0}  # before any save
        for x in plan.slices:
            tokens = self.s.requests[x.rid].tokens
            if x.rid not in self.slot_of:
                self.slot_of[x.rid] = x.slot
                if x.restore >= 0:
                    assert restored[x.rid] == tuple(tokens[: x.start]), f"{x.rid} resumes at {x.start} from a checkpoint of another prefix"
                else:
                    assert x.start == 0, f"{x.rid} starts at {x.start} with no state"
            else:
                assert x.restore < 0 and self.computed[x.rid] == x.start
            assert x.slot not in [slot for rid, slot in self.slot_of.items() if rid != x.rid], "two running requests share a slot"
            for position, checkpoint in x.checkpoints:
                assert x.start < position <= x.start + x.num_tokens
                self.checkpoint[checkpoint] = tuple(tokens[:position])
            self.computed[x.rid] = x.start + x.num_tokens


def check_invariants(s: Scheduler) -> None:
    s.pool.check()
    s.slots.check()
    s.checkpoints.check()
    assert len(s.checkpoints) <= s.checkpoints.num_slots
    for checkpoint in s.checkpoints:
        assert all(s.pool.is_cached(h) for h in checkpoint.chain), "a checkpoint outlives a block of its KV prefix"
        assert checkpoint.position == len(checkpoint.chain) * s.pool.block_size
    held = [r.slot for r in s.running]
    assert all(slot >= 0 for slot in held) and len(set(held)) == len(held), f"running requests' slots: {held}"
    assert all(r.slot == -1 and r.restore is None for r in s.waiting)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(operation, max_size=80),
    num_blocks=st.integers(4, 14),
    budget=st.integers(1, 16),
    num_checkpoints=st.integers(1, 4),
    interval=st.sampled_from([4, 8, 12]),
)
def test_checkpoints_follow_their_kv_prefix_and_restore_only_their_own_tokens(
    ops: list[tuple], num_blocks: int, budget: int, num_checkpoints: int, interval: int
) -> None:
    s = Scheduler(BlockPool(num_blocks, 4), 4, budget, 16, SlotPool(4), checkpoints=CheckpointPool(num_checkpoints), checkpoint_interval=interval)
    worker = Worker(s)
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
            worker.run(plan)
            in_flight.append(plan)

    for op in ops:
        if op[0] == "submit":
            rid = f"r{len(submitted)}"
            prompt = PREFIXES[op[1]] + op[2]
            try:
                s.submit(Submit(rid=rid, prompt_ids=prompt, max_tokens=op[3], stop_token_ids=[EOS], anchors=sorted(a for a in op[4] if a <= len(prompt))))
                submitted.append(rid)
            except AdmissionError:
                pass
        elif op[0] == "plan" and len(in_flight) < 2:
            send_plan()
        elif op[0] == "result" and in_flight:
            deliver(op[1])
        elif op[0] == "abort" and submitted:
            worker.release(s.finish(submitted[op[1] % len(submitted)], FinishReason.ABORT).released)
        check_invariants(s)

    for _ in range(2000):
        if not s.requests and not in_flight:
            break
        if len(in_flight) < 2:
            send_plan()
        if in_flight:
            deliver([3])
        check_invariants(s)
    assert not s.requests, "requests never finished"
    assert s.pool.num_used == 0 and s.slots.num_used == 0
