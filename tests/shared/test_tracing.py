"""shared/tracing.py: the collector's URL picks the exporter, a traceparent survives the trip through Submit and a
Slice, and an untraced Submit or Slice costs one byte more on the wire than before the field existed (array_like
structs encode every field; an empty string is one byte)."""

from __future__ import annotations

import importlib.util

import msgspec
import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider

from shared import tracing
from shared.codec import decode, encode
from shared.frames import SamplingParams, Slice, StepPlan, StreamOpen, Submit


def test_an_http_endpoint_without_a_path_exports_to_v1_traces() -> None:
    assert tracing.span_exporter("http://collector:4318")._endpoint == "http://collector:4318/v1/traces"
    assert tracing.span_exporter("https://collector:4318/")._endpoint == "https://collector:4318/v1/traces"
    assert tracing.span_exporter("http://collector:4318/custom/traces")._endpoint == "http://collector:4318/custom/traces"
    assert isinstance(tracing.span_exporter("http://collector:4318"), OTLPSpanExporter)


def test_an_endpoint_it_cannot_use_stops_the_process_with_the_flag_named() -> None:
    for endpoint in ("collector:4318", "ftp://collector:21"):
        with pytest.raises(SystemExit, match="--otlp-traces-endpoint"):
            tracing.span_exporter(endpoint)
    if importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is None:
        with pytest.raises(SystemExit, match="opentelemetry-exporter-otlp-proto-grpc"):
            tracing.span_exporter("grpc://collector:4317")


def test_no_endpoint_no_tracer() -> None:
    assert tracing.tracer_for("", "tokenyard-api") is None


def test_a_spans_traceparent_travels_in_submit_and_parents_the_next_process() -> None:
    tracer = TracerProvider().get_tracer("test")
    span = tracer.start_span("llm_request")
    submit = decode(encode(Submit(rid="r", prompt_ids=[1], max_tokens=1, trace=tracing.traceparent(span))))
    child = tracer.start_span("engine_request", context=tracing.parent_context(submit.trace))
    assert child.context.trace_id == span.context.trace_id and child.parent.span_id == span.context.span_id


def _array_header_bytes(length: int) -> int:
    """msgpack's array header: fixarray below 16 elements, array16 below 65536."""
    return 1 if length < 16 else 3


def _trace_costs_one_byte(frame: msgspec.Struct, wire: bytes) -> None:
    """``wire`` (``frame`` as an array) is one byte longer than the same array without its empty ``trace`` (the
    array's header apart, which grows at 16 elements whatever the fields)."""
    elements = msgspec.msgpack.decode(wire)
    fields = type(frame).__struct_fields__
    at = len(elements) - len(fields) + fields.index("trace")  # a tagged frame's array starts with its tag
    assert elements[at] == ""
    header_growth = _array_header_bytes(len(elements)) - _array_header_bytes(len(elements) - 1)
    assert len(wire) == len(msgspec.msgpack.encode(elements[:at] + elements[at + 1 :])) + 1 + header_growth


def test_an_untraced_submit_costs_one_byte_on_the_wire() -> None:
    submit = Submit(rid="r", prompt_ids=[1, 2], max_tokens=4, arrival_time=1.5, reply_to="ipc://api")
    _trace_costs_one_byte(submit, encode(submit))


def test_a_prefill_chunks_traceparent_travels_in_its_slice() -> None:
    tracer = TracerProvider().get_tracer("test")
    span = tracer.start_span("prefill")
    chunk = Slice(rid="r", start=0, num_tokens=2, token_ids=[1, 2], trace=tracing.traceparent(span))
    (received, decode_slice) = decode(encode(StepPlan(step=3, slices=[chunk, Slice(rid="s", start=9, num_tokens=1)]))).slices
    child = tracer.start_span("prefill_forward", context=tracing.parent_context(received.trace))
    assert child.context.trace_id == span.context.trace_id and child.parent.span_id == span.context.span_id
    assert decode_slice.trace == ""


@pytest.mark.parametrize(
    "untraced",
    [
        Slice(rid="r", start=41, num_tokens=1, slot=2),  # a decode
        Slice(rid="r", start=0, num_tokens=3, token_ids=[1, 2, 3], new_blocks=[7], sampling=SamplingParams(seed=1), opened=StreamOpen("r", 3, 4)),
    ],
    ids=["decode", "first prefill chunk"],
)
def test_an_untraced_slice_costs_one_byte_on_the_wire(untraced: Slice) -> None:
    _trace_costs_one_byte(untraced, msgspec.msgpack.encode(untraced))
