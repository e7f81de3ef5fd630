"""The detokenizer process: token batches in, text batches out, stop strings reported back.

Frames for unknown or already finished requests are counted and ignored; they are
normal (a token from a step that was in flight when its request finished).
"""

from __future__ import annotations

import os
import signal
import time

import structlog
import zmq
from prometheus_client import Counter, Gauge, Histogram

from services.detokenizer.request import RequestDetokState
from shared.config import StackConfig
from shared.cpu_placement import keep_off_worker_core
from shared.frames import DetokOpen, Finish, FinishReason, Heartbeat, TextBatch, TextDelta, TextLogprobs, TokenBatch, TokenLogprobs, TokenText
from shared.metrics import FRAMES_UNEXPECTED, PREFIX, PROCESS_UP, start_metrics_server
from shared.token_texts import TokenTexts
from shared.tokenizer import load_tokenizer
from shared.transport import Curve, Inbox, Outbox, ReplyOutboxes

BATCH_TIME = Histogram(f"{PREFIX}detokenize_batch_seconds", "Time to detokenize one token batch", buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))
STOP_MATCHES = Counter(f"{PREFIX}stop_string_matches", "Requests finished by a stop string")
IGNORED = Counter(f"{PREFIX}detokenizer_ignored_deltas", "Token deltas for unknown or finished requests")
TRACKED = Gauge(f"{PREFIX}detokenizer_requests", "Requests being detokenized")


class _Tracked:
    __slots__ = ("state", "opened", "cached_tokens")

    def __init__(self, state: RequestDetokState, opened: DetokOpen) -> None:
        self.state = state
        self.opened = opened
        self.cached_tokens = 0


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
        self.token_texts: TokenTexts | None = None
        self.requests: dict[str, _Tracked] = {}
        requests = self.requests
        TRACKED.set_function(lambda: len(requests))  # read at scrape time, not set per token batch
        self.state = "loading"
        self.stopping = False

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stopping", True))
        self._heartbeat()
        self.tokenizer = load_tokenizer(self.config.model)
        self.token_texts = TokenTexts(self.tokenizer)
        self.state = "ready"
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

    def _heartbeat(self) -> None:
        self.to_scheduler.send(Heartbeat(process="detokenizer", pid=os.getpid(), state=self.state))

    def handle(self, batch: TokenBatch) -> None:
        started = time.perf_counter()
        for opened in batch.opened:
            state = RequestDetokState(self.tokenizer, opened.stop, opened.skip_special_tokens)
            self.requests[opened.rid] = _Tracked(state, opened)
            self.log.info("request_opened", rid=opened.rid, stop_strings=len(opened.stop))
        by_owner: dict[str, list[TextDelta]] = {}
        for delta in batch.deltas:
            tracked = self.requests.get(delta.rid)
            text = self._detokenize(delta)
            if text is not None:
                by_owner.setdefault(tracked.opened.reply_to, []).append(text)
        for reply_to, out in by_owner.items():
            self.to_api.send(reply_to, TextBatch(deltas=out))
        BATCH_TIME.observe(time.perf_counter() - started)

    def _detokenize(self, delta) -> TextDelta | None:
        tracked = self.requests.get(delta.rid)
        if tracked is None:
            IGNORED.inc()
            return None
        if delta.finish == FinishReason.ERROR.value:
            # The scheduler failed it and told its api why (an Error frame); a finishing delta from here
            # could overtake that frame and replace the reason with a generic one.
            del self.requests[delta.rid]
            self.log.info("request_failed", rid=delta.rid)
            return None
        tracked.cached_tokens = max(tracked.cached_tokens, delta.cached_tokens)
        before = tracked.state.completion_tokens
        update = tracked.state.push(delta.token_ids)
        consumed = tracked.state.completion_tokens - before  # tokens after a matched stop string carry no logprobs
        text, finish = update.text, delta.finish
        if update.finished_by_stop is not None:
            STOP_MATCHES.inc()
            finish = FinishReason.STOP.value
            self.to_scheduler.send(Finish(rid=delta.rid, matched=update.finished_by_stop))
        elif finish:
            text += tracked.state.finish()
        if finish:
            del self.requests[delta.rid]
            self.log.info("request_finished", rid=delta.rid, reason=finish, completion_tokens=tracked.state.completion_tokens, stop=update.finished_by_stop)
        return TextDelta(
            rid=delta.rid,
            text=text,
            completion_tokens=tracked.state.completion_tokens,
            finish=finish,
            prompt_tokens=tracked.opened.prompt_tokens,
            cached_tokens=tracked.cached_tokens if finish else 0,
            matched=update.finished_by_stop or "",
            logprobs=[self._text_logprobs(token_id, lp) for token_id, lp in zip(delta.token_ids[:consumed], delta.logprobs)],
        )

    def _text_logprobs(self, token_id: int, logprobs: TokenLogprobs) -> TextLogprobs:
        def text(token: int, logprob: float) -> TokenText:
            token_text, raw = self.token_texts(token)
            return TokenText(token_text, raw, logprob)

        return TextLogprobs(text(token_id, logprobs.logprob), [text(t, lp) for t, lp in zip(logprobs.top_ids, logprobs.top_logprobs)])

    def instrumentation(self) -> dict:
        return {
            "process": "detokenizer",
            "pid": os.getpid(),
            "state": self.state,
            "model": self.config.model,
            "tokenizer": type(self.tokenizer).__name__ if self.tokenizer is not None else None,
            "requests": len(self.requests),
            "addresses": {"inbox": self.inbox.address, "api": self.to_api.default.address, "scheduler": self.to_scheduler.address},
        }

    def health(self) -> tuple[int, dict]:
        return (200 if self.state == "ready" else 503), {"state": self.state}


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
