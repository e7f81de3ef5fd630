"""Request traces (``--otlp-traces-endpoint``): a chat request that carries a W3C ``traceparent`` leaves one trace,
the client's, in an OTLP/HTTP receiver: the api's spans, the scheduler's under them and the worker's under the
scheduler's prefill chunks, each parent in the trace (or the client's span), with the GenAI attributes whose token
counts are the response's usage. A stack whose collector is not there serves requests as before."""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest, ExportTraceServiceResponse

from tests.e2e.conftest import TINY_MODEL, Stack, tiny_model_stack

CHUNK = 16  # --max-num-batched-tokens: the prompt is prefilled in several chunks


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span it is sent, as a dict, with its process's service.name."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                export = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    receiver.spans += [span for resource in export.resource_spans for span in _spans(resource)]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [span for span in self.spans if span["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(any_value) -> object:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def _spans(resource) -> Iterator[dict]:
    service = {a.key: _value(a.value) for a in resource.resource.attributes}["service.name"]
    for scope in resource.scope_spans:
        for span in scope.spans:
            yield {
                "service": service,
                "name": span.name,
                "trace_id": span.trace_id.hex(),
                "span_id": span.span_id.hex(),
                "parent": span.parent_span_id.hex(),
                "start": span.start_time_unix_nano,
                "end": span.end_time_unix_nano,
                "attributes": {a.key: _value(a.value) for a in span.attributes},
                "events": [e.name for e in span.events],
            }


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory, receiver: Receiver) -> Iterator[Stack]:
    flags = ["--otlp-traces-endpoint", receiver.url, "--max-num-batched-tokens", str(CHUNK)]
    with tiny_model_stack(tmp_path_factory, "tracing", flags) as stack:
        yield stack


def chat(stack: Stack, headers: dict[str, str], **settings) -> dict:
    body = {
        "model": TINY_MODEL,
        "messages": [{"role": "user", "content": f"tell me about the {secrets.token_hex(4)} things you know of, in a few words please"}],
        "max_tokens": 12,
        "ignore_eos": True,
        **settings,
    }
    request = urllib.request.Request(
        f"{stack.base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
        return json.loads(response.read())


def wait_for_trace(
    receiver: Receiver, trace_id: str, names: set[str], timeout: float = 30, complete: Callable[[list[dict]], bool] = lambda spans: True
) -> list[dict]:
    """The trace's spans once it holds each of ``names`` (a process's spans end, and are sent, before those named here)
    and is ``complete`` (for spans of a process none of ``names`` ends after)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = receiver.trace(trace_id)
        if names <= {span["name"] for span in spans} and complete(spans):
            return spans
        time.sleep(0.2)
    pytest.fail(f"trace {trace_id} holds {sorted({s['service'] + ': ' + s['name'] for s in receiver.trace(trace_id)})}, not all of {sorted(names)}")


def _every_chunk_forwarded(spans: list[dict]) -> bool:
    """The worker's spans are sent apart from the scheduler's: the trace holds them all once one per chunk is there."""
    names = [span["name"] for span in spans]
    return names.count("prefill_forward") == names.count("prefill")


def test_a_chat_request_leaves_one_trace_across_the_api_the_scheduler_and_the_worker(traced_stack: Stack, receiver: Receiver) -> None:
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    reply = chat(traced_stack, {"traceparent": f"00-{trace_id}-{client_span}-01"}, temperature=0.5, top_p=0.9)
    usage = reply["usage"]
    wanted = {"POST /v1/chat/completions", "preprocess", "llm_request", "engine_request", "queued", "prefill", "decode", "prefill_forward"}
    spans = wait_for_trace(receiver, trace_id, wanted, complete=_every_chunk_forwarded)
    by_name: dict[str, list[dict]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)

    # One trace, the client's, across the three services; every parent in it or the client's span.
    assert {span["service"] for span in spans} == {"tokenyard-api", "tokenyard-scheduler", "tokenyard-worker"}
    ids = {span["span_id"] for span in spans}
    assert all(span["parent"] in ids or span["parent"] == client_span for span in spans), spans
    (server,) = by_name["POST /v1/chat/completions"]
    assert server["parent"] == client_span and server["service"] == "tokenyard-api"
    assert server["attributes"]["http.response.status_code"] == 200

    (preprocess,) = by_name["preprocess"]
    (llm,) = by_name["llm_request"]
    (engine,) = by_name["engine_request"]
    (queued,) = by_name["queued"]
    (decode,) = by_name["decode"]
    assert preprocess["parent"] == llm["parent"] == server["span_id"]
    assert "chat_template_applied" in preprocess["events"]
    assert engine["parent"] == llm["span_id"] and engine["service"] == "tokenyard-scheduler"
    assert queued["parent"] == decode["parent"] == engine["span_id"]
    assert all(p["parent"] == engine["span_id"] for p in by_name["prefill"])

    # The GenAI attributes, their counts those of the response's usage.
    for span in (llm, engine):
        attributes = span["attributes"]
        assert attributes["gen_ai.request.id"] == llm["attributes"]["gen_ai.request.id"]
        assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 12
        assert attributes["gen_ai.request.max_tokens"] == 12
        assert attributes["gen_ai.request.temperature"] == pytest.approx(0.5)
        assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
        assert attributes["gen_ai.response.finish_reasons"] == [reply["choices"][0]["finish_reason"]] == ["length"]
    assert llm["attributes"]["gen_ai.request.model"] == server["attributes"]["gen_ai.request.model"] == TINY_MODEL
    e2e, ttft = llm["attributes"]["gen_ai.latency.e2e"], llm["attributes"]["gen_ai.latency.time_to_first_token"]
    assert 0 < ttft <= e2e <= (llm["end"] - llm["start"]) / 1e9 + 0.01
    in_queue, prefill = engine["attributes"]["gen_ai.latency.time_in_queue"], engine["attributes"]["gen_ai.latency.time_in_model_prefill"]
    assert 0 <= in_queue and 0 < prefill and in_queue + prefill < ttft + 0.01  # the scheduler's part of the time to the first token

    # One span per prefill chunk, covering the prompt in order; one decode span, no span per token.
    chunks = sorted(by_name["prefill"], key=lambda p: p["attributes"]["tokenyard.prefill.start"])
    assert len(chunks) == -(-usage["prompt_tokens"] // CHUNK) > 1
    assert sum(p["attributes"]["tokenyard.prefill.tokens"] for p in chunks) == usage["prompt_tokens"]
    assert [p["attributes"]["tokenyard.prefill.start"] for p in chunks] == list(range(0, usage["prompt_tokens"], CHUNK))
    assert queued["end"] <= chunks[0]["start"] and chunks[-1]["end"] <= decode["start"] <= decode["end"] <= engine["end"]
    assert decode["attributes"]["gen_ai.usage.output_tokens"] == 12

    # The worker's span of each chunk's forward pass, under the scheduler's span of that chunk, within it.
    forwards = {f["parent"]: f for f in by_name["prefill_forward"]}
    assert len(forwards) == len(chunks) and {f["service"] for f in forwards.values()} == {"tokenyard-worker"}
    for chunk in chunks:
        forward = forwards[chunk["span_id"]]
        attributes = forward["attributes"]
        assert attributes["gen_ai.request.id"] == engine["attributes"]["gen_ai.request.id"]
        assert attributes["tokenyard.step"] == chunk["attributes"]["tokenyard.step"]
        assert attributes["tokenyard.prefill.start"] == chunk["attributes"]["tokenyard.prefill.start"]
        assert attributes["tokenyard.prefill.tokens"] == chunk["attributes"]["tokenyard.prefill.tokens"]
        assert attributes["tokenyard.step.kind"] in ("prefill", "mixed") and attributes["tokenyard.step.batch_size"] >= 1
        assert attributes["tokenyard.step.forward_s"] > 0
        assert forward["end"] - forward["start"] == pytest.approx(attributes["tokenyard.step.forward_s"] * 1e9, abs=1e3)
        assert chunk["start"] - 1e6 <= forward["start"] <= forward["end"] <= chunk["end"] + 1e6  # plan sent, forward pass, result
    assert len(spans) == len(wanted) - 2 + 2 * len(chunks)


def test_a_request_without_a_traceparent_starts_a_trace_of_its_own(traced_stack: Stack, receiver: Receiver) -> None:
    before = {span["trace_id"] for span in receiver.spans}
    reply = chat(traced_stack, {})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        roots = [s for s in receiver.spans if s["name"] == "POST /v1/chat/completions" and s["trace_id"] not in before]
        if roots:
            break
        time.sleep(0.2)
    (root,) = roots
    assert root["parent"] == ""
    spans = wait_for_trace(receiver, root["trace_id"], {"llm_request", "engine_request", "decode"})
    (engine,) = [s for s in spans if s["name"] == "engine_request"]
    assert engine["attributes"]["gen_ai.usage.output_tokens"] == reply["usage"]["completion_tokens"]


def test_an_unsampled_traceparent_traces_nothing(traced_stack: Stack, receiver: Receiver) -> None:
    trace_id = secrets.token_hex(16)
    chat(traced_stack, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00"})
    time.sleep(2.5)  # more than the export delay
    assert receiver.trace(trace_id) == []


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_requests_succeed_when_the_collector_is_not_there(tmp_path_factory) -> None:
    flags = ["--otlp-traces-endpoint", f"http://127.0.0.1:{_closed_port()}"]
    with tiny_model_stack(tmp_path_factory, "tracing_no_collector", flags) as stack:
        for _ in range(3):
            trace_id = secrets.token_hex(16)
            reply = chat(stack, {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
            assert reply["usage"]["completion_tokens"] == 12
        time.sleep(2.5)  # an export has failed by now; requests still complete
        assert chat(stack, {})["usage"]["completion_tokens"] == 12
        assert stack.process.poll() is None
