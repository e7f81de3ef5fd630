"""How many tokens a step that carries decodes may hold: the worker's measured time per token against a target.

A step that carries both decodes and a prefill chunk delays every running stream's next token by the
whole step. On a GPU a 512-token chunk takes milliseconds; on two CPU cores it takes ~0.5 s, so each new
long prompt stalls every stream for that long. With a target step time, a step with decodes holds at
most ``target / seconds per token`` tokens (at least its decodes and ``MIN_PREFILL_TOKENS`` of prefill,
so admissions always progress); a step without decodes keeps the whole ``max_num_batched_tokens``,
where a larger chunk delays nobody. Where a token is cheap (a GPU), the cap exceeds the budget and
changes nothing. The target (``--mixed-step-target-ms``, 250 ms by default) trades a little throughput
for the worst inter-token latency; smaller targets trade more (docs/configuration.md, "Step size").

Seconds per token come from the worker's own step timings (``StepResult.forward_s``) over the steps of
at least ``MIN_SAMPLE_TOKENS`` tokens, where the per-step fixed cost (reading every weight once, the
step's glue) is small beside the tokens' (plan_timing.py averages them).
Until the first such step has come back there is no estimate and no cap.
"""

from __future__ import annotations

from services.scheduler.plan_timing import TimePerUnit

MIN_SAMPLE_TOKENS = 64  # steps smaller than this say more about the fixed per-step cost than about tokens
MIN_PREFILL_TOKENS = 16  # a step with decodes still takes this much prefill when the decodes alone fill the target


class StepCost:
    def __init__(self, target_s: float) -> None:
        self.target_s = target_s  # 0: no cap
        self.timing = TimePerUnit()  # seconds per token

    @property
    def seconds_per_token(self) -> float | None:
        return self.timing.seconds

    def planned(self, step: int, tokens: int) -> None:
        """A step was planned with this many tokens."""
        if self.target_s > 0 and tokens >= MIN_SAMPLE_TOKENS:
            self.timing.expect(step, tokens)

    def observed(self, step: int, forward_s: float) -> None:
        """The worker's time for a step (0 when it did not time it, or the step failed)."""
        self.timing.observed(step, forward_s, samples=0)

    def token_cap(self) -> int | None:
        """The most tokens a step with decodes should hold, or None while there is no cap."""
        if self.target_s <= 0 or self.seconds_per_token is None:
            return None
        return int(self.target_s / self.seconds_per_token)

    def prefill_budget(self, budget: int, decodes: int) -> int:
        """What is left of ``budget`` for prefill in a step that already holds ``decodes`` decode tokens."""
        cap = self.token_cap() if decodes else None
        if cap is None:
            return budget
        return min(budget, max(cap - decodes, MIN_PREFILL_TOKENS))
