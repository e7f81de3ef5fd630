"""Incremental detokenization: a request's output token ids in, text deltas out."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

REPLACEMENT = "\ufffd"
_LOOKBACK = 3  # a UTF-8 character has at most 4 bytes: 3 more settle any unfinished one


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas as they arrive.

    Invariant: the deltas of every ``add()`` plus ``flush()`` concatenate to
    ``tokenizer.decode(all_ids, skip_special_tokens=...)``, however the ids were split into
    calls, and no delta before ``flush()`` ends inside a multi-byte character. (One
    exception: a byte-fallback tokenizer's decode() turns a whole run of byte tokens into
    U+FFFD when the run is invalid UTF-8, even characters of it already streamed.)

    Each call decodes only a window of recent ids (vLLM's prefix/read offsets): ``_prefix``
    and ``_read`` are token boundaries where the text was complete, ids before ``_read`` are
    emitted, and ``ids[_prefix:_read]`` gives the decoder the context it needs (a
    SentencePiece leading space, for one). The cost of a call follows its new ids, not the
    length of the output.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._decode_ids = _decoder(tokenizer, skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        text = self._decode(self._prefix)
        if not text.endswith(REPLACEMENT):
            return self._emit(text, len(self._ids))
        # The tail is an unfinished character or a real U+FFFD. The text before the last 3 ids
        # is final once those ids carry text (so 3+ bytes follow it, enough to finish any
        # character) and decoding past it left it unchanged. This keeps the window short
        # when a model keeps producing U+FFFD.
        end = len(self._ids) - _LOOKBACK
        if end > self._read and all(self._decode(i, i + 1) for i in range(end, len(self._ids))):
            head = self._decode(self._prefix, end)
            if text.startswith(head):
                return self._emit(head, end)
        return ""

    def flush(self) -> str:
        """Everything still held back (an invalid byte sequence at the end becomes U+FFFD)."""
        return self._emit(self._decode(self._prefix), len(self._ids))

    def _emit(self, text: str, end: int) -> str:
        prefix_text = self._decode(self._prefix, self._read)
        if len(text) <= len(prefix_text):  # nothing new yet (e.g. only skipped special tokens)
            return ""
        self._prefix, self._read = self._read, end
        return text[len(prefix_text) :]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_ids(self._ids[start:end])


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode`` without clean-up of tokenization spaces (it looks across delta boundaries).

    A fast tokenizer's decode is its Rust backend's plus that clean-up, so the backend is called
    directly: two decodes per token, and transformers' wrapper cost more than the decoding.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
