"""The worker's spans of traced requests (``--otlp-traces-endpoint``): one ``prefill_forward`` span per traced
prefill chunk (a slice with a ``trace``) per step, under the scheduler's span of that chunk, timing the step's
forward pass. Decode slices carry no trace, so decodes make none; tensor-parallel followers make none (only
rank 0 runs the loop that calls in).
"""

from __future__ import annotations

from opentelemetry import trace

from shared import tracing
from shared.frames import StepPlan


class ForwardSpans:
    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer

    def stepped(self, plan: StepPlan, kind: str, forward_s: float) -> None:
        """A step that ran in ``forward_s``, ending now: a span for each of its traced chunks."""
        traced = [s for s in plan.slices if s.trace]
        if not traced:
            return
        end = tracing.now_ns()
        start = end - int(forward_s * 1e9)
        for s in traced:
            span = self.tracer.start_span(
                "prefill_forward",
                context=tracing.parent_context(s.trace),
                start_time=start,
                attributes={
                    tracing.REQUEST_ID: s.rid,
                    "tokenyard.step": plan.step,
                    "tokenyard.step.kind": kind,
                    "tokenyard.step.batch_size": len(plan.slices),
                    "tokenyard.step.forward_s": forward_s,
                    "tokenyard.prefill.start": s.start,
                    "tokenyard.prefill.tokens": s.num_tokens,
                },
            )
            span.end(end)
