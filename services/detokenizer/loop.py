"""The detokenizer process: token batches in, text batches out, stop strings reported back.

Tokens come from the worker, each request's opening ahead of its first token; a request ends at
its stop token or max_tokens (the scheduler's rule, shared/stop_rule.py, applied here to the same
tokens), at a stop string (then the scheduler is told), or when the scheduler ends it from outside
(aborted, failed). Frames for unknown or already finished requests are counted and ignored; they
are normal (a token from a step that was in flight when its request finished). An ending can
overtake the opening it follows (they take different paths), so a request ended before it opened
is remembered, and its opening, when it comes, is ignored.
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
from shared.frames import DetokOpen, Finish, FinishReason, Heartbeat, TextBatch, TextDelta, TextLogprobs, TokenBatch, TokenDelta, TokenLogprobs, TokenText
from shared.metrics import FRAMES_UNEXPECTED, PREFIX, PROCESS_UP, start_metrics_server
from shared.stop_rule import finish_for_token
from shared.token_texts import TokenTexts
from shared.tokenizer import load_tokenizer
from shared.transport import Curve, Inbox, Outbox, ReplyOutboxes

BATCH_TIME = Histogram(f"{PREFIX}detokenize_batch_seconds", "Time to detokenize one token batch", buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1))
STOP_MATCHES = Counter(f"{PREFIX}stop_string_matches", "Requests finished by a stop string")
IGNORED = Counter(f"{PREFIX}detokenizer_ignored_deltas", "Token deltas for unknown or finished requests")
TRACKED = Gauge(f"{PREFIX}detokenizer_requests", "Requests being detokenized")


ENDED_BEFORE_OPENED_KEPT = 4096  # rids remembered; an opening trails its ending by a step or two at most


class _Tracked:
    __slots__ = ("state", "opened", "generated", "stop_token_ids")

    def __init__(self, state: RequestDetokState, opened: DetokOpen) -> None:
        self.state = state
        self.opened = opened
        self.generated = 0  # output tokens received, stop strings aside: what the stop rule counts
        self.stop_token_ids = frozenset(opened.stop_token_ids)


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
        self.ended_before_opened: dict[str, None] = {}  # insertion-ordered, bounded
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
            if opened.rid in self.ended_before_opened:
                del self.ended_before_opened[opened.rid]
                self.log.info("request_ended_before_opened", rid=opened.rid)
                continue
            state = RequestDetokState(self.tokenizer, opened.stop, opened.skip_special_tokens)
            self.requests[opened.rid] = _Tracked(state, opened)
            self.log.info("request_opened", rid=opened.rid, stop_strings=len(opened.stop))
        by_owner: dict[str, list[TextDelta]] = {}
        for delta in batch.deltas:
            tracked = self.requests.get(delta.rid)
            text = self._detokenize(delta, tracked)
            if text is not None:
                by_owner.setdefault(tracked.opened.reply_to, []).append(text)
        for reply_to, out in by_owner.items():
            self.to_api.send(reply_to, TextBatch(deltas=out))
        BATCH_TIME.observe(time.perf_counter() - started)

    def _detokenize(self, delta: TokenDelta, tracked: _Tracked | None) -> TextDelta | None:
        """The delta's text for its request (``tracked``: None when unknown or already ended)."""
        if tracked is None:
            IGNORED.inc()
            if delta.finish:
                self._remember_ended(delta.rid)
            return None
        if delta.finish == FinishReason.ERROR.value:
            # The scheduler failed it and told its api why (an Error frame); a finishing delta from here
            # could overtake that frame and replace the reason with a generic one.
            del self.requests[delta.rid]
            self.log.info("request_failed", rid=delta.rid)
            return None
        token_ids, finish = self._take_until_end(tracked, delta.token_ids, delta.finish)
        before = tracked.state.completion_tokens
        update = tracked.state.push(token_ids)
        consumed = tracked.state.completion_tokens - before  # tokens after a matched stop string carry no logprobs
        text = update.text
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
            cached_tokens=tracked.opened.cached_tokens if finish else 0,
            matched=update.finished_by_stop or "",
            logprobs=[self._text_logprobs(token_id, lp) for token_id, lp in zip(token_ids[:consumed], delta.logprobs)],
        )

    @staticmethod
    def _take_until_end(tracked: _Tracked, token_ids: list[int], finish: str) -> tuple[list[int], str]:
        """The delta's tokens up to the one that ends the request by the stop rule, and the ending (the
        delta's own, an abort, when the rule ends nothing)."""
        opened = tracked.opened
        for i, token_id in enumerate(token_ids):
            tracked.generated += 1
            reason = finish_for_token(token_id, tracked.generated, tracked.stop_token_ids, opened.min_tokens, opened.max_tokens)
            if reason is not None:
                return token_ids[: i + 1], reason.value
        return token_ids, finish

    def _remember_ended(self, rid: str) -> None:
        self.ended_before_opened[rid] = None
        if len(self.ended_before_opened) > ENDED_BEFORE_OPENED_KEPT:
            del self.ended_before_opened[next(iter(self.ended_before_opened))]

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
