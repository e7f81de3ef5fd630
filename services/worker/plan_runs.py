"""Running a step plan: one step, or with ``StepPlan.decode_steps > 1`` a run of decode steps.

A run executes the plan's decodes again and again, each step feeding back the tokens the previous one
sampled (the runner keeps every request's last token), at positions one further each time. A request
that samples one of its stop tokens leaves the run (``ends_run``, shared/stream_contract.py): the
scheduler plans runs only where such a token ends the request, so it will end it too when the result
arrives. A speculative step's run of tokens for one request ends there too. Until then its request id is remembered and later plans skip it: with plans pipelined, the next plan may already
hold its decodes, whose tokens nobody would read.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from shared.frames import Sampled, Slice, StepPlan, StepResult
from shared.stream_contract import ends_run


class PlanRuns:
    def __init__(self, execute: Callable[[StepPlan], StepResult]) -> None:
        self.execute = execute  # one step
        self.stop_token_ids: dict[str, frozenset[int]] = {}  # from each request's first slice since admission
        self.ended: set[str] = set()  # stopped inside a run, not yet released

    def run(self, plan: StepPlan, on_step: Callable[[StepPlan, StepResult], None]) -> StepResult:
        """Runs the plan, calling ``on_step`` after each step; returns the whole plan's result."""
        for s in plan.slices:
            if s.sampling is not None:
                self.stop_token_ids[s.rid] = frozenset(s.stop_token_ids)
        if self.ended and any(s.rid in self.ended for s in plan.slices):
            plan = StepPlan(step=plan.step, slices=[s for s in plan.slices if s.rid not in self.ended], decode_steps=plan.decode_steps)
            if not plan.slices:
                return StepResult(step=plan.step, sampled=[])
        result = self.execute(plan)
        if len(result.sampled) > len(plan.slices):  # speculative steps' runs of tokens: each ends at its first stop token
            result = msgspec.structs.replace(result, sampled=self._through_stops(result.sampled))
        on_step(plan, result)
        if plan.decode_steps == 1 or result.error:
            return result
        sampled, forward_s = list(result.sampled), result.forward_s
        guessless = dict.fromkeys(result.no_guess, True)  # by rid, as its last step in the run left it
        running = self._still_running(plan.slices, result)
        for i in range(1, plan.decode_steps):
            if not running:
                break
            step = StepPlan(step=plan.step, slices=[Slice(s.rid, s.start + i, 1, slot=s.slot) for s in running])
            result = self.execute(step)
            on_step(step, result)
            if result.error:
                return result  # the scheduler fails the plan's requests; the tokens already sent stay sent
            sampled += result.sampled
            forward_s += result.forward_s
            guessless.update({x.rid: x.rid in result.no_guess for x in result.sampled})
            running = self._still_running(running, result)
        return StepResult(step=plan.step, sampled=sampled, forward_s=forward_s, no_guess=[rid for rid, none in guessless.items() if none])

    def _through_stops(self, sampled: list[Sampled]) -> list[Sampled]:
        ended: set[str] = set()
        kept = []
        for x in sampled:
            if x.rid not in ended:
                kept.append(x)
                if ends_run(x.token_id, self.stop_token_ids.get(x.rid, ())):
                    ended.add(x.rid)
        return kept

    def _still_running(self, slices: list[Slice], result: StepResult) -> list[Slice]:
        tokens = {x.rid: x.token_id for x in result.sampled}
        running = []
        for s in slices:
            if s.rid in tokens and ends_run(tokens[s.rid], self.stop_token_ids.get(s.rid, ())):
                self.ended.add(s.rid)
            else:
                running.append(s)
        return running

    def release(self, rids: list[str]) -> None:
        for rid in rids:
            self.stop_token_ids.pop(rid, None)
            self.ended.discard(rid)
