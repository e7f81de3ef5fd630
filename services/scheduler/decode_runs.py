"""How many decode steps one plan of decodes alone may run: the worker's measured step time against a target.

Each plan costs every process a wake-up: the scheduler plans it and takes its result, the worker decodes
the plan and encodes the result. Where a step is short (one stream on a CPU: ~5 ms) those passes are a
visible share of the machine, beside the text maker's, which streaming needs per token anyway.
A plan of decodes alone can instead run several steps in a row: the worker feeds each step's samples to
the next, streams each step's tokens to the text maker as before, and answers the scheduler once. The
scheduler wakes once per run instead of once per token.

The run's length is a time (``--decode-plan-ms``) rather than a count: a run delays whatever the scheduler
would decide meanwhile, an admission above all, by up to its whole length (twice that with a plan queued
behind it), so the delay stays bounded wherever a step is long (a large batch) and runs grow only where
steps are short. Runs happen only when nothing waits and nothing prefills (core.py decides). Until a
decode plan's time has come back there is no estimate and each plan runs one step.
"""

from __future__ import annotations

from services.scheduler.plan_timing import TimePerUnit

MAX_DECODE_STEPS = 16  # at most this many steps in one plan, however short a step


class DecodeRuns:
    def __init__(self, target_s: float) -> None:
        self.target_s = target_s  # 0: one step per plan
        self.timing = TimePerUnit()  # seconds per decode step

    @property
    def seconds_per_step(self) -> float | None:
        return self.timing.seconds

    def planned(self, step: int, decode_steps: int, rows: int) -> None:
        """A plan of ``rows`` decodes alone was sent, running ``decode_steps`` steps. A run that rows left early
        (stop tokens) says little about a step's time: only a result with every token is a sample."""
        if self.target_s > 0:
            self.timing.expect(step, decode_steps, samples=decode_steps * rows)

    def observed(self, step: int, forward_s: float, samples: int) -> None:
        """The worker's time for a plan (0 when it did not time it, or the plan failed) and the tokens it returned."""
        self.timing.observed(step, forward_s, samples)

    def steps(self) -> int:
        """How many decode steps the next plan of decodes alone should run."""
        if self.target_s <= 0 or self.seconds_per_step is None:
            return 1
        return max(1, min(MAX_DECODE_STEPS, round(self.target_s / self.seconds_per_step)))
