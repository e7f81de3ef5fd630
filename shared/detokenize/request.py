"""One request's detokenization: incremental text, stop strings and the output token count."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from shared.detokenize.incremental import IncrementalDetokenizer
from shared.detokenize.stop_strings import StopStringMatcher


class Update(NamedTuple):
    text: str  # the new text to send
    finished_by_stop: str | None  # the stop string matched by this push, if any
    completion_tokens: int  # output tokens so far, up to the one that completed a stop string


class RequestDetokState:
    """Detokenizes one request and stops it at its first stop string.

    Once a stop string matched, its text and everything after it are dropped,
    ``completion_tokens`` stays at the token that completed the match, and further
    tokens are ignored.
    """

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self._stops = StopStringMatcher(list(stop))
        self._check_each_token = any(stop)
        self.completion_tokens = 0
        self.stopped: str | None = None  # the matched stop string

    def push(self, token_ids: list[int]) -> Update:
        if self.stopped is not None:
            return Update("", None, self.completion_tokens)
        if not self._check_each_token:
            self.completion_tokens += len(token_ids)
            return Update(self._detok.add(token_ids), None, self.completion_tokens)
        parts = []
        for token_id in token_ids:  # one at a time, to know which token completed a match
            self.completion_tokens += 1
            text, self.stopped = self._stops.feed(self._detok.add([token_id]))
            parts.append(text)
            if self.stopped is not None:
                break
        return Update("".join(parts), self.stopped, self.completion_tokens)

    def finish(self) -> str:
        """The text still held back, at the end of a request that no stop string ended."""
        if self.stopped is not None:
            return ""
        text, self.stopped = self._stops.feed(self._detok.flush())
        return text + self._stops.flush()
