"""OpenTelemetry traces of requests across the processes (``--otlp-traces-endpoint``): the tracer of a process,
the W3C ``traceparent`` that carries a request's trace from the client through ``Submit``, and the names of the
GenAI attributes the spans carry.

A process asks for its tracer once, at start-up; without the flag it gets ``None`` and makes no tracer call
at all (the SDK is not even imported). Spans leave through a ``BatchSpanProcessor``: a bounded queue that a
thread of its own exports, with a short timeout, so a slow or dead collector drops spans and never holds up
a request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from collections.abc import Mapping

    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter

EXPORT_TIMEOUT_S = 2.0  # one export's limit: a collector that does not answer costs the export thread this, never a request
MAX_QUEUED_SPANS = 4096  # spans waiting for export beyond this are dropped
EXPORT_DELAY_MS = 1000
MAX_EXPORT_BATCH = 512

# The GenAI semantic conventions, and vLLM's names of the request's timings.
MODEL = "gen_ai.request.model"
REQUEST_ID = "gen_ai.request.id"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
E2E = "gen_ai.latency.e2e"

_PROPAGATOR = TraceContextTextMapPropagator()


def tracer_for(endpoint: str, service: str) -> trace.Tracer | None:
    """The tracer of a process named ``service`` (its ``service.name``), exporting to ``endpoint``; None without one."""
    if not endpoint:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    exporter = span_exporter(endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))  # flushed at exit
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter,
            max_queue_size=MAX_QUEUED_SPANS,
            schedule_delay_millis=EXPORT_DELAY_MS,
            max_export_batch_size=MAX_EXPORT_BATCH,
            export_timeout_millis=EXPORT_TIMEOUT_S * 1000,
        )
    )
    return provider.get_tracer("tokenyard")


def span_exporter(endpoint: str) -> SpanExporter:
    """OTLP over HTTP for ``http(s)://host:port[/path]`` (the path defaults to ``/v1/traces``), over gRPC for
    ``grpc://host:port`` (``grpcs://`` with TLS) where ``opentelemetry-exporter-otlp-proto-grpc`` is installed."""
    url = urlparse(endpoint)
    if url.scheme in ("grpc", "grpcs"):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        except ImportError:
            raise SystemExit(f"--otlp-traces-endpoint {endpoint}: gRPC needs opentelemetry-exporter-otlp-proto-grpc installed") from None
        return GrpcExporter(endpoint=url.netloc, insecure=url.scheme == "grpc", timeout=EXPORT_TIMEOUT_S)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise SystemExit(f"--otlp-traces-endpoint: expected http(s)://host:port or grpc://host:port, got {endpoint!r}")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    path = url.path if url.path.strip("/") else "/v1/traces"
    return OTLPSpanExporter(endpoint=url._replace(path=path).geturl(), timeout=EXPORT_TIMEOUT_S)


def context_of(headers: Mapping[str, str]) -> Context:
    """The trace context of W3C ``traceparent`` (and ``tracestate``) headers; an empty one (a new trace) without them."""
    return _PROPAGATOR.extract(headers)


def parent_context(traceparent: str) -> Context:
    """The context a ``Submit.trace`` names, the parent of the spans made downstream."""
    return _PROPAGATOR.extract({"traceparent": traceparent})


def traceparent(span: trace.Span) -> str:
    """The W3C ``traceparent`` of ``span``: what ``Submit.trace`` carries."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def now_ns() -> int:
    """Wall-clock nanoseconds, the spans' time base."""
    return time.time_ns()


def seconds(start_ns: int, end_ns: int) -> float:
    return (end_ns - start_ns) / 1e9
