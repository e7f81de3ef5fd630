"""The worker's spans of traced requests: one ``prefill_forward`` span per traced prefill chunk of a step, under
the scheduler's span of that chunk, lasting the step's forward pass; untraced slices and decodes make none."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.worker.traces import ForwardSpans
from shared.frames import Slice, StepPlan

TRACE_ID, CHUNK_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


@pytest.fixture
def spans() -> tuple[ForwardSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return ForwardSpans(provider.get_tracer("test")), exporter


def test_a_traced_chunk_gets_a_span_of_its_steps_forward_pass_under_the_schedulers_span(spans) -> None:
    forward_spans, exporter = spans
    plan = StepPlan(
        step=5,
        slices=[
            Slice(rid="traced", start=16, num_tokens=8, token_ids=list(range(8)), trace=f"00-{TRACE_ID}-{CHUNK_SPAN}-01"),
            Slice(rid="untraced", start=0, num_tokens=4, token_ids=[1, 2, 3, 4]),
            Slice(rid="decoding", start=30, num_tokens=1),
        ],
    )
    forward_spans.stepped(plan, "mixed", 0.25)
    (span,) = exporter.get_finished_spans()
    assert span.name == "prefill_forward"
    assert span.context.trace_id == int(TRACE_ID, 16) and span.parent.span_id == int(CHUNK_SPAN, 16)
    assert span.end_time - span.start_time == 250_000_000
    assert dict(span.attributes) == {
        "gen_ai.request.id": "traced",
        "tokenyard.step": 5,
        "tokenyard.step.kind": "mixed",
        "tokenyard.step.batch_size": 3,
        "tokenyard.step.forward_s": 0.25,
        "tokenyard.prefill.start": 16,
        "tokenyard.prefill.tokens": 8,
    }


def test_steps_without_a_traced_chunk_make_no_span(spans) -> None:
    forward_spans, exporter = spans
    forward_spans.stepped(StepPlan(step=1, slices=[Slice(rid="a", start=0, num_tokens=2, token_ids=[1, 2])]), "prefill", 0.01)
    forward_spans.stepped(StepPlan(step=2, slices=[Slice(rid="a", start=2, num_tokens=1)]), "decode", 0.01)
    assert exporter.get_finished_spans() == ()


def test_an_unsampled_parent_exports_nothing(spans) -> None:
    forward_spans, exporter = spans
    chunk = Slice(rid="r", start=0, num_tokens=1, token_ids=[1], trace=f"00-{TRACE_ID}-{CHUNK_SPAN}-00")
    forward_spans.stepped(StepPlan(step=1, slices=[chunk]), "prefill", 0.01)
    assert exporter.get_finished_spans() == ()
