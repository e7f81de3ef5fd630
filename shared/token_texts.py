"""Token ids as the OpenAI logprobs show them, each token's own text and its exact UTF-8 bytes: for the
text maker's logprobs, and for the worker's structured outputs, which match tokens' bytes against a grammar.

A token may hold part of a character (byte-level BPE splits multi-byte characters), so its
bytes are read off the vocabulary, not off ``decode``: for byte-level tokenizers through the
GPT-2 byte-to-character table, for byte-fallback tokens (``<0xE2>``) from the hex. Its text is
those bytes decoded with U+FFFD for an unfinished character.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's reversible map from bytes to printable characters, inverted: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", [])]
    return "ByteLevel" in kinds


class TokenTexts:
    """Token id -> (text, bytes), cached per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._byte_level = _byte_level_table() if _is_byte_level(tokenizer) else None
        self._added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._bytes(token_id)
            cached = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return cached

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if match := _BYTE_FALLBACK.fullmatch(piece):
            return bytes([int(match.group(1), 16)])
        if piece.startswith("▁") or "▁" in piece:  # SentencePiece word boundary
            return piece.replace("▁", " ").encode()
        return self._tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False).encode()
