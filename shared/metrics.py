"""Metrics every process exports, and the small HTTP server of the non-api processes.

Each process is its own OS process with its own default registry; names carry the
``tokenyard:`` prefix. The server runs in a daemon thread, so a process whose main loop
is busy computing still answers ``/metrics``, ``/instrumentation`` and ``/health``.
"""

from __future__ import annotations

import json
import platform
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Info, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PREFIX = "tokenyard:"
VERSION = "0.1.0"


class FrameCounts(Collector):
    """``tokenyard:frames_total`` and ``tokenyard:frame_bytes_total`` by socket and direction, kept as plain ints.

    A socket adds to its name's pair for every frame without prometheus_client's per-increment lock (at one
    stream that lock and its bookkeeping were a measurable share of a service's pass per token). So sockets
    that share a name must be used from one thread, as each ZeroMQ socket already is (a process's other
    threads, its heartbeats for one, send on sockets of their own names); a scrape only reads.
    """

    def __init__(self) -> None:
        self.pairs: dict[tuple[str, str], list[int]] = {}

    def pair(self, socket: str, direction: str) -> list[int]:
        """The socket's [frames, bytes] in that direction, to add to in place."""
        return self.pairs.setdefault((socket, direction), [0, 0])

    def collect(self):
        frames = CounterMetricFamily(f"{PREFIX}frames", "Frames sent or received", labels=["socket", "direction"])
        data = CounterMetricFamily(f"{PREFIX}frame_bytes", "Frame bytes sent or received", labels=["socket", "direction"])
        for labels, (count, size) in list(self.pairs.items()):
            frames.add_metric(labels, count)
            data.add_metric(labels, size)
        yield frames
        yield data


FRAME_COUNTS = FrameCounts()
REGISTRY.register(FRAME_COUNTS)
FRAME_DECODE_ERRORS = Counter(f"{PREFIX}frame_decode_errors", "Frames that failed to decode", ["socket"])
FRAMES_UNEXPECTED = Counter(f"{PREFIX}frames_unexpected", "Well-formed frames of a type this socket never receives (dropped)", ["socket"])
PROCESS_UP = Gauge(f"{PREFIX}process_up", "1 once the process is ready to serve", ["process"])
BUILD_INFO = Info(f"{PREFIX}build", "tokenyard build information")
BUILD_INFO.info({"version": VERSION, "python": platform.python_version()})

Instrumentation = Callable[[], dict[str, Any]]


class _ProcessLabelled(Collector):
    """The default registry seen with labels every sample of this process shares (``model_name``,
    and ``replica`` where several engines run) added to each sample that does not set them itself."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels

    def collect(self):
        for family in REGISTRY.collect():
            family.samples = [s._replace(labels={**self.labels, **s.labels}) for s in family.samples]
            yield family


def exposition(labels: dict[str, str]) -> bytes:
    """The process's metrics in the Prometheus text format, each sample carrying ``labels``."""
    return generate_latest(_ProcessLabelled(labels))


Health = Callable[[], tuple[int, dict[str, Any]]]


class _Handler(BaseHTTPRequestHandler):
    instrumentation: Instrumentation
    health: Health
    labels: dict[str, str]

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, exposition(self.labels), CONTENT_TYPE_LATEST)
        elif path == "/instrumentation":
            self._send_json(200, self.instrumentation())
        elif path == "/health":
            self._send_json(*self.health())
        else:
            self._send_json(404, {"error": {"message": f"no route {path}", "type": "not_found_error"}})

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, json.dumps(body, default=str).encode(), "application/json")

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # silence per-request stderr lines
        pass


def start_metrics_server(host: str, port: int, instrumentation: Instrumentation, health: Health, labels: dict[str, str]) -> ThreadingHTTPServer:
    """Serves ``/metrics`` (every sample labelled with ``labels``), ``/instrumentation`` and ``/health``."""
    handler = type("Handler", (_Handler,), {"instrumentation": staticmethod(instrumentation), "health": staticmethod(health), "labels": labels})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
