"""The detokenizer process: token batches in, text batches out, stop strings reported back.

What it does to the tokens is shared/detokenize/requests.py's (the api runs the same with
``--detokenize-in api``); this loop carries the frames: token batches from the worker (and the
scheduler's endings of requests from outside), text batches to each request's api, stop strings' endings
to the scheduler.
"""

from __future__ import annotations

import os
import signal
import time

import structlog
import zmq
from prometheus_client import Histogram

from shared.config import StackConfig
from shared.cpu_placement import keep_off_worker_core
from shared.detokenize.requests import Detokenization
from shared.frames import Heartbeat, Process, ProcessState, TextBatch, TextDelta, TokenBatch
from shared.metrics import FRAMES_UNEXPECTED, PREFIX, PROCESS_UP, start_metrics_server
from shared.tokenizer import load_tokenizer
from shared.transport import Curve, Inbox, Outbox, ReplyOutboxes

BATCH_TIME = Histogram(f"{PREFIX}detokenize_batch_seconds", "Time to detokenize one token batch", buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))


class DetokenizerLoop:
    def __init__(self, config: StackConfig, log: structlog.stdlib.BoundLogger) -> None:
        self.config = config
        self.log = log
        ctx = zmq.Context()
        curve = Curve.from_file(config.curve_key_file)
        self.inbox = Inbox(ctx, config.detokenizer_address, "detokenizer_inbox", curve)
        self.to_api = ReplyOutboxes(ctx, config.api_address, "detokenizer_to_api", curve)  # by each request's reply_to
        self.to_scheduler = Outbox(ctx, config.scheduler_address, "detokenizer_to_scheduler", curve)
        self.tokenizer = None
        self.detokenization: Detokenization | None = None
        self.state = ProcessState.LOADING
        self.stopping = False

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self._heartbeat()
        self.load_tokenizer()
        self.state = ProcessState.READY
        PROCESS_UP.labels("detokenizer").set(1)
        next_beat = 0.0
        while not self.stopping:
            for frame in self.inbox.recv(int(self.config.heartbeat_s * 1000)):
                if isinstance(frame, TokenBatch):
                    self.handle(frame)
                else:
                    self.log.warning("unexpected_frame", frame=type(frame).__name__)
                    FRAMES_UNEXPECTED.labels(self.inbox.name).inc()
            if time.monotonic() >= next_beat:
                self._heartbeat()
                next_beat = time.monotonic() + self.config.heartbeat_s

    def load_tokenizer(self) -> None:
        self.tokenizer = load_tokenizer(self.config.model)
        self.detokenization = Detokenization(self.tokenizer)

    def _heartbeat(self) -> None:
        self.to_scheduler.send(Heartbeat(process=Process.DETOKENIZER, pid=os.getpid(), state=self.state))

    def handle(self, batch: TokenBatch) -> None:
        started = time.perf_counter()
        out = self.detokenization.take(batch)
        for stop in out.stops:  # ahead of the text: the scheduler stops the request's steps at once
            self.to_scheduler.send(stop)
        by_owner: dict[str, list[TextDelta]] = {}
        for reply_to, text in out.texts:
            by_owner.setdefault(reply_to, []).append(text)
        for reply_to, deltas in by_owner.items():
            self.to_api.send(reply_to, TextBatch(deltas=deltas))
        BATCH_TIME.observe(time.perf_counter() - started)

    def instrumentation(self) -> dict:
        return {
            "process": "detokenizer",
            "pid": os.getpid(),
            "state": self.state,
            "model": self.config.model,
            "tokenizer": type(self.tokenizer).__name__ if self.tokenizer is not None else None,
            "requests": len(self.detokenization.requests) if self.detokenization else 0,
            "addresses": {"inbox": self.inbox.address, "api": self.to_api.default.address, "scheduler": self.to_scheduler.address},
        }

    def health(self) -> tuple[int, dict]:
        return (200 if self.state is ProcessState.READY else 503), {"state": self.state}


def main(argv: list[str] | None = None) -> None:
    from shared.logging import setup_logging

    config = StackConfig.from_argv(argv, "tokenyard detokenizer")
    log = setup_logging("detokenizer", config.log_level, config.log_format)
    if (cpus := keep_off_worker_core(config)) is not None:
        log.info("cpu_placement", cpus=sorted(cpus))
    loop = DetokenizerLoop(config, log)
    start_metrics_server(config.metrics_host, config.metrics_port("detokenizer"), loop.instrumentation, loop.health, config.metric_labels)
    log.info("detokenizer_started", inbox=loop.inbox.address)
    loop.run()
