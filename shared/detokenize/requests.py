"""The detokenization of every open request: token batches in, text deltas and stop-string endings out.

One instance serves a process that detokenizes: the detokenizer process, or the api with
``--detokenize-in api``. The text maker's side of shared/stream_contract.py: tokens come from the worker,
each request's opening ahead of its first token; a request ends by the end rule (the scheduler applies it
to the same tokens), at a stop string (the caller then tells the scheduler, with the ``Finish`` this
returns), or when it is ended from outside (``end``, or a finishing delta from the scheduler). Deltas for
unknown or already finished requests are counted and ignored; they are normal (a token from a step that
was in flight when its request finished). An ending can overtake the opening it follows (they take
different paths), so a request ended before it opened is remembered, and its opening, when it comes, is
ignored.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import structlog
from prometheus_client import Counter, Gauge

from shared.detokenize.request import RequestDetokState
from shared.frames import Finish, FinishReason, StreamOpen, TextDelta, TextLogprobs, TokenBatch, TokenDelta, TokenLogprobs, TokenText
from shared.metrics import PREFIX
from shared.stream_contract import EndRule
from shared.token_texts import TokenTexts

STOP_MATCHES = Counter(f"{PREFIX}stop_string_matches", "Requests finished by a stop string")
IGNORED = Counter(f"{PREFIX}detokenizer_ignored_deltas", "Token deltas for unknown or finished requests")
TRACKED = Gauge(f"{PREFIX}detokenizer_requests", "Requests being detokenized")

ENDED_BEFORE_OPENED_KEPT = 4096  # rids remembered; an opening trails its ending by a step or two at most

log = structlog.get_logger()


class _Tracked:
    __slots__ = ("state", "opened", "generated", "end_rule")

    def __init__(self, state: RequestDetokState, opened: StreamOpen) -> None:
        self.state = state
        self.opened = opened
        self.generated = 0  # output tokens received, stop strings aside: what the end rule counts
        self.end_rule = EndRule.of(opened)


class Detokenized(NamedTuple):
    texts: list[tuple[str, TextDelta]]  # (the request's reply_to, its delta), in the batch's order
    stops: list[Finish]  # requests a stop string ended: the scheduler must be told


class Detokenization:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.requests: dict[str, _Tracked] = {}
        self.ended_before_opened: dict[str, None] = {}  # insertion-ordered, bounded
        requests = self.requests
        TRACKED.set_function(lambda: len(requests))  # read at scrape time, not set per token batch

    def take(self, batch: TokenBatch) -> Detokenized:
        for opened in batch.opened:
            if opened.rid in self.ended_before_opened:
                del self.ended_before_opened[opened.rid]
                log.info("request_ended_before_opened", rid=opened.rid)
                continue
            state = RequestDetokState(self.tokenizer, opened.stop, opened.skip_special_tokens)
            self.requests[opened.rid] = _Tracked(state, opened)
            log.info("request_opened", rid=opened.rid, stop_strings=len(opened.stop))
        out = Detokenized([], [])
        for delta in batch.deltas:
            tracked = self.requests.get(delta.rid)
            text = self._detokenize(delta, tracked, out.stops)
            if text is not None:
                out.texts.append((tracked.opened.reply_to, text))
        return out

    def end(self, rid: str) -> None:
        """The request ended from outside (aborted, failed): its state goes. (The api, the one caller, passes
        on no opening of a request it no longer streams, so none still on its way needs remembering.)"""
        self.requests.pop(rid, None)

    def _detokenize(self, delta: TokenDelta, tracked: _Tracked | None, stops: list[Finish]) -> TextDelta | None:
        """The delta's text for its request (``tracked``: None when unknown or already ended)."""
        if tracked is None:
            IGNORED.inc()
            if delta.finish:
                self._remember_ended(delta.rid)
            return None
        if delta.finish == FinishReason.ERROR:
            # The scheduler failed it and told its api why (an Error frame); a finishing delta from here
            # could overtake that frame and replace the reason with a generic one.
            del self.requests[delta.rid]
            log.info("request_failed", rid=delta.rid)
            return None
        token_ids, finish = self._take_until_end(tracked, delta.token_ids, delta.finish)
        before = tracked.state.completion_tokens
        update = tracked.state.push(token_ids)
        consumed = tracked.state.completion_tokens - before  # tokens after a matched stop string carry no logprobs
        text = update.text
        if update.finished_by_stop is not None:
            STOP_MATCHES.inc()
            finish = FinishReason.STOP
            stops.append(Finish(rid=delta.rid, matched=update.finished_by_stop))
        elif finish:
            text += tracked.state.finish()
        if finish:
            del self.requests[delta.rid]
            log.info("request_finished", rid=delta.rid, reason=finish, completion_tokens=tracked.state.completion_tokens, stop=update.finished_by_stop)
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
    def _take_until_end(tracked: _Tracked, token_ids: list[int], finish: FinishReason | None) -> tuple[list[int], FinishReason | None]:
        """The delta's tokens up to the one that ends the request by the end rule, and the ending (the
        delta's own, an abort, when the rule ends nothing)."""
        for i, token_id in enumerate(token_ids):
            tracked.generated += 1
            reason = tracked.end_rule.ends_at(token_id, tracked.generated)
            if reason is not None:
                return token_ids[: i + 1], reason
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
