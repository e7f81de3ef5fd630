"""The worker's time per unit of work (a token, a decode step), averaged over the plans that make a fair sample.

The scheduler marks a plan as a sample when it sends it, with the units of work it holds, and takes the
worker's ``StepResult.forward_s`` when the result comes back; an exponential average follows a context
that grows. step_cost.py averages per token over large steps, decode_runs.py per step over plans of
decodes alone.
"""

from __future__ import annotations

SMOOTHING = 0.25  # weight of the newest sample in the average
_MAX_PENDING = 64  # plans remembered awaiting their result (pipelining keeps ~2; results of lost steps never come)


class TimePerUnit:
    def __init__(self) -> None:
        self.seconds: float | None = None  # None until a sample came back
        self._pending: dict[int, tuple[int, int]] = {}  # step -> (units of work, tokens its result must hold)

    def expect(self, step: int, units: int, samples: int = 0) -> None:
        """Plan ``step`` holds ``units`` of work; its timing counts if its result holds at least ``samples`` tokens."""
        if len(self._pending) >= _MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        self._pending[step] = (units, samples)

    def observed(self, step: int, forward_s: float, samples: int) -> None:
        """The worker's time for a plan (0 when it did not time it, or the plan failed) and the tokens it returned."""
        units, expected = self._pending.pop(step, (0, 0))
        if not units or forward_s <= 0 or samples < expected:
            return
        sample = forward_s / units
        self.seconds = sample if self.seconds is None else self.seconds + SMOOTHING * (sample - self.seconds)
