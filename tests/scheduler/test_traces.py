"""The scheduler's spans of traced requests: a request whose Submit carries a traceparent gets an ``engine_request``
span under the api's span, with its queueing, one span per prefill chunk and its decode beneath, and each chunk's
slice carries the traceparent of its span to the worker; a request without one, or a scheduler without
``--otlp-traces-endpoint``, makes none."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.scheduler.loop import SchedulerLoop
from services.scheduler.traces import RequestTraces
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import Abort, Heartbeat, Sampled, StepPlan, StepResult, Submit

TRACE_ID, API_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
CHUNK = 16


class _Recorder:
    def __init__(self) -> None:
        self.frames: list = []

    def send(self, frame) -> None:
        self.frames.append(frame)

    def close(self) -> None:
        pass


@pytest.fixture
def traced(tmp_path) -> Iterator[tuple[SchedulerLoop, InMemorySpanExporter]]:
    loop = SchedulerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path / "run"), max_num_batched_tokens=CHUNK), structlog.get_logger())
    assert loop.traces is None  # no --otlp-traces-endpoint: no tracer at all
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    loop.traces = RequestTraces(provider.get_tracer("test"))
    loop.to_worker = _Recorder()
    for process in loop.peers:
        loop._handle(Heartbeat(process=process, pid=100, state="ready"))
    yield loop, exporter
    loop.close()


def _submit(rid: str, traced: bool = True, prompt_len: int = 40) -> Submit:
    trace = f"00-{TRACE_ID}-{API_SPAN}-01" if traced else ""
    return Submit(rid=rid, prompt_ids=list(range(1, prompt_len + 1)), max_tokens=3, trace=trace)


def _step(loop: SchedulerLoop) -> None:
    """Plans a step and answers it: a token for every slice that samples."""
    assert loop._plan_and_send()
    plan = [f for f in loop.to_worker.frames if isinstance(f, StepPlan)][-1]
    loop._handle(StepResult(step=plan.step, sampled=[Sampled(rid=s.rid, token_id=7) for s in plan.slices if s.sample], forward_s=0.001))


def test_a_traced_request_gets_its_queueing_prefill_chunks_and_decode_under_the_apis_span(traced) -> None:
    loop, exporter = traced
    loop._handle(_submit("traced"))
    loop._handle(_submit("untraced", traced=False))
    while loop.core.requests:
        _step(loop)
    spans = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    (engine,) = spans["engine_request"]
    assert engine.context.trace_id == int(TRACE_ID, 16) and engine.parent.span_id == int(API_SPAN, 16)
    assert {s.context.trace_id for ss in spans.values() for s in ss} == {int(TRACE_ID, 16)}  # nothing of the untraced request
    assert all(s.parent.span_id == engine.context.span_id for name in ("queued", "prefill", "decode") for s in spans[name])
    chunks = sorted(spans["prefill"], key=lambda s: s.attributes["tokenyard.prefill.start"])
    assert [(c.attributes["tokenyard.prefill.start"], c.attributes["tokenyard.prefill.tokens"]) for c in chunks] == [(0, 16), (16, 16), (32, 8)]
    a = engine.attributes
    assert (a["gen_ai.request.id"], a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"], a["gen_ai.request.max_tokens"]) == ("traced", 40, 3, 3)
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.latency.time_in_queue"] >= 0 and a["gen_ai.latency.time_in_model_prefill"] > 0 and a["gen_ai.latency.time_in_model_decode"] >= 0
    (queued,), (decode,) = spans["queued"], spans["decode"]
    assert queued.end_time <= chunks[0].start_time and chunks[-1].end_time <= decode.start_time <= decode.end_time == engine.end_time
    assert not loop.traces.open and not loop.traces.prefills


def test_a_traced_requests_prefill_chunks_carry_their_spans_traceparent_to_the_worker(traced) -> None:
    loop, exporter = traced
    loop._handle(_submit("traced"))
    loop._handle(_submit("untraced", traced=False))
    while loop.core.requests:
        _step(loop)
    carried = [(plan.step, s) for plan in loop.to_worker.frames if isinstance(plan, StepPlan) for s in plan.slices if s.trace]
    chunks = {span.context.span_id: span for span in exporter.get_finished_spans() if span.name == "prefill"}
    assert len(carried) == len(chunks) == 3  # the traced request's prefill chunks; no decode, nothing of the untraced request
    for step, s in carried:
        _, trace_id, span_id, flags = s.trace.split("-")
        chunk = chunks[int(span_id, 16)]
        assert (s.rid, int(trace_id, 16), flags) == ("traced", chunk.context.trace_id, "01")
        assert (chunk.attributes["tokenyard.step"], chunk.attributes["tokenyard.prefill.start"], chunk.attributes["tokenyard.prefill.tokens"]) == (
            step,
            s.start,
            s.num_tokens,
        )


def test_a_request_aborted_while_waiting_ends_its_spans_with_its_reason(traced) -> None:
    loop, exporter = traced
    loop._handle(_submit("first", prompt_len=CHUNK))
    loop._handle(_submit("waiting"))
    loop._plan_and_send()  # the first takes the whole step's budget; the second waits
    loop._handle(Abort(rid="waiting"))
    (engine,) = [s for s in exporter.get_finished_spans() if s.name == "engine_request"]
    assert engine.attributes["gen_ai.request.id"] == "waiting" and engine.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert "gen_ai.latency.time_in_queue" not in engine.attributes  # never admitted
    under = [s.name for s in exporter.get_finished_spans() if s.parent.span_id == engine.context.span_id]
    assert under == ["queued"]  # no prefill, no decode


def test_requests_failed_by_a_lost_worker_end_their_spans_in_error(traced) -> None:
    loop, exporter = traced
    loop._handle(_submit("running"))
    loop._plan_and_send()
    loop._handle(Heartbeat(process="worker", pid=101, state="ready"))  # a new pid: the worker restarted
    (engine,) = [s for s in exporter.get_finished_spans() if s.name == "engine_request"]
    assert engine.status.status_code is StatusCode.ERROR and "worker" in engine.status.description
    (chunk,) = [s for s in exporter.get_finished_spans() if s.name == "prefill"]  # in flight: it ends in error too
    assert chunk.status.status_code is StatusCode.ERROR and chunk.parent.span_id == engine.context.span_id
    assert not loop.traces.open and not loop.traces.prefills
