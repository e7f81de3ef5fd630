"""The scheduler's spans of traced requests (a ``Submit`` with a ``trace``, and ``--otlp-traces-endpoint`` set).

Each such request gets an ``engine_request`` span, a child of the api's span, from its arrival here to its end,
with the GenAI attributes and vLLM's timings; under it a ``queued`` span (arrival to admission), one ``prefill``
span per prefill chunk (the plan that carries it sent, to its result) and one ``decode`` span (first token to
the end): no span per token. A chunk's slice carries its span's traceparent (``Slice.trace``), the parent of the
worker's span of the forward pass. The loop calls in only while one of these requests is open.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from shared import tracing
from shared.frames import FinishReason, StepPlan, StepResult, Submit, TokenDelta


@dataclass
class _Trace:
    span: Span  # engine_request
    context: Context  # engine_request's: the parent of the others
    queued: Span | None  # until admitted
    submitted_ns: int
    admitted_ns: int = 0
    first_token_ns: int = 0
    decode: Span | None = None
    output_tokens: int = 0


class RequestTraces:
    def __init__(self, tracer: trace.Tracer) -> None:
        self.tracer = tracer
        self.open: dict[str, _Trace] = {}
        self.prefills: dict[int, list[tuple[str, Span]]] = {}  # step -> (rid, prefill span) of its traced chunks, open until its result

    def __bool__(self) -> bool:
        return bool(self.open)

    def submitted(self, submit: Submit) -> None:
        now = tracing.now_ns()
        sampling = submit.sampling
        span = self.tracer.start_span(
            "engine_request",
            context=tracing.parent_context(submit.trace),
            start_time=now,
            attributes={
                tracing.REQUEST_ID: submit.rid,
                tracing.INPUT_TOKENS: len(submit.prompt_ids),
                tracing.MAX_TOKENS: submit.max_tokens,
                tracing.TEMPERATURE: sampling.temperature,
                tracing.TOP_P: sampling.top_p,
            },
        )
        context = trace.set_span_in_context(span)
        queued = self.tracer.start_span("queued", context=context, start_time=now)
        self.open[submit.rid] = _Trace(span=span, context=context, queued=queued, submitted_ns=now)

    def planned(self, plan: StepPlan, preempted: list[str]) -> None:
        now = tracing.now_ns()
        for rid in preempted:
            if (t := self.open.get(rid)) is not None:
                t.span.add_event("preempted", timestamp=now)
        for i, s in enumerate(plan.slices):
            t = self.open.get(s.rid)
            if t is None:
                continue
            if s.sampling is not None:  # the first slice since (re)admission
                if t.queued is not None:
                    t.admitted_ns = now
                    t.queued.set_attribute("tokenyard.cached_tokens", s.start)
                    t.queued.end(now)
                    t.queued = None
                else:
                    t.span.add_event("readmitted", {"tokenyard.cached_tokens": s.start}, timestamp=now)
            if s.token_ids:  # a prefill chunk (a decode slice carries no token)
                span = self.tracer.start_span(
                    "prefill",
                    context=t.context,
                    start_time=now,
                    attributes={"tokenyard.step": plan.step, "tokenyard.prefill.start": s.start, "tokenyard.prefill.tokens": s.num_tokens},
                )
                self.prefills.setdefault(plan.step, []).append((s.rid, span))
                if span.is_recording():  # the worker's span of the chunk goes under this one
                    plan.slices[i] = msgspec.structs.replace(s, trace=tracing.traceparent(span))

    def stepped(self, result: StepResult, deltas: list[TokenDelta]) -> None:
        """A step's result: its traced prefill chunks end, and a request's first token starts its decode."""
        now = tracing.now_ns()
        for _, span in self.prefills.pop(result.step, ()):
            span.set_attribute("tokenyard.step.forward_s", result.forward_s)
            span.end(now)
        for delta in deltas:
            t = self.open.get(delta.rid)
            if t is None or not delta.token_ids:
                continue
            t.output_tokens += len(delta.token_ids)
            if t.decode is None:
                t.first_token_ns = now
                t.decode = self.tracer.start_span("decode", context=t.context, start_time=now)

    def ended(self, deltas: list[TokenDelta]) -> None:
        now = tracing.now_ns()
        for delta in deltas:
            if delta.finish is not None and (t := self.open.pop(delta.rid, None)) is not None:
                self._end(t, delta.finish, now)
        self._forget_steps(now)

    def failed(self, rids: list[str], message: str) -> None:
        now = tracing.now_ns()
        failed = set(rids)
        for step in list(self.prefills):  # their chunks in steps that will not answer
            kept = []
            for rid, span in self.prefills[step]:
                if rid in failed:
                    span.set_status(Status(StatusCode.ERROR, message))
                    span.end(now)
                else:
                    kept.append((rid, span))
            if kept:
                self.prefills[step] = kept
            else:
                del self.prefills[step]
        for rid in rids:
            if (t := self.open.pop(rid, None)) is not None:
                t.span.set_status(Status(StatusCode.ERROR, message))
                self._end(t, FinishReason.ERROR, now)
        self._forget_steps(now)

    def _forget_steps(self, now: int) -> None:
        if not self.open:  # chunks in flight of ended requests: the loop calls in no more, so they end now
            for chunks in self.prefills.values():
                for _, span in chunks:
                    span.end(now)
            self.prefills.clear()

    def _end(self, t: _Trace, reason: FinishReason, now: int) -> None:
        if t.queued is not None:  # ended while waiting
            t.queued.end(now)
        span = t.span
        span.set_attribute(tracing.OUTPUT_TOKENS, t.output_tokens)
        span.set_attribute(tracing.FINISH_REASONS, [str(reason)])
        if t.admitted_ns:
            span.set_attribute(tracing.TIME_IN_QUEUE, tracing.seconds(t.submitted_ns, t.admitted_ns))
        if t.decode is not None:
            span.set_attribute(tracing.TIME_IN_MODEL_PREFILL, tracing.seconds(t.admitted_ns, t.first_token_ns))
            span.set_attribute(tracing.TIME_IN_MODEL_DECODE, tracing.seconds(t.first_token_ns, now))
            t.decode.set_attribute(tracing.OUTPUT_TOKENS, t.output_tokens)
            t.decode.end(now)
        span.end(now)
