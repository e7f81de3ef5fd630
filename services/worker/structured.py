"""Structured outputs in the worker: each constrained request's place in its JSON grammar, and its sampled
token held to it.

A row's sampled token is kept when the grammar takes its bytes; otherwise the row is sampled again, with its
own parameters, from its logits with every token the grammar refuses masked out (as llama.cpp does). A greedy
row so takes the most likely token the grammar allows. The end-of-sequence tokens are allowed exactly where
the output is a whole JSON value, and are all that is allowed once nothing may follow it; special tokens are
never allowed as text. The masks are cached per grammar state, and grammars per schema.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from shared.json_grammar import JsonGrammar, Matcher, plain_string_bytes

_TOKENS = -1  # key of a trie node's list of the token ids that end there


class Vocabulary:
    """Every token's bytes as a byte trie, the tokens that may stand anywhere inside a plain string (a mask),
    the others with bytes (checked one by one there), and the end-of-sequence ids."""

    def __init__(self, token_bytes: Sequence[bytes | None], eos_ids: Sequence[int]) -> None:
        self.size = len(token_bytes)
        self.token_bytes = token_bytes
        self.eos_ids = [t for t in eos_ids if 0 <= t < self.size]
        self.trie: dict = {}
        plain, self.unplain_ids = [], []
        for token, data in enumerate(token_bytes):
            if not data:  # a special token: never text
                continue
            node = self.trie
            for byte in data:
                node = node.setdefault(byte, {})
            node.setdefault(_TOKENS, []).append(token)
            (plain if plain_string_bytes(data) else self.unplain_ids).append(token)
        self.plain = torch.zeros(self.size, dtype=torch.bool)
        self.plain[plain] = True

    @classmethod
    def of_model(cls, model_dir: str, vocab_size: int, eos_ids: Sequence[int]) -> Vocabulary:
        from shared.token_texts import TokenTexts
        from shared.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        texts = TokenTexts(tokenizer)
        special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        known = len(tokenizer)  # the embedding may have more rows than the tokenizer has tokens: those are never text
        return cls([None if i in special or i >= known else texts(i)[1] for i in range(vocab_size)], eos_ids)


class StructuredOutputs:
    """The worker's grammars (by schema text) and masks (by grammar state), over one vocabulary."""

    def __init__(self, vocabulary: Vocabulary, cache_size: int = 256) -> None:
        self.vocabulary = vocabulary
        self._grammars: OrderedDict[tuple[str, str, str], JsonGrammar] = OrderedDict()
        self._masks: OrderedDict[Matcher, torch.Tensor] = OrderedDict()
        self._cache_size = cache_size
        self.tokens_checked = self.tokens_resampled = self.masks_built = 0  # what /instrumentation reports
        self.mask_seconds = self.seconds = 0.0  # building masks; all grammar work (checks, masks, resampling, advancing)

    def describe(self) -> dict[str, int | float]:
        return {
            "tokens_checked": self.tokens_checked,
            "tokens_resampled": self.tokens_resampled,
            "masks_built": self.masks_built,
            "mask_seconds": round(self.mask_seconds, 3),
            "seconds": round(self.seconds, 3),
            "grammars_cached": len(self._grammars),
        }

    def grammar(self, schema_json: str, prefix: str = "", suffix: str = "") -> JsonGrammar:
        """The compiled schema, with the text around the value (cached); a ``ValueError`` for text that is no
        schema of the subset (the api refuses those, so only a frame from elsewhere carries one)."""
        key = (schema_json, prefix, suffix)
        grammar = self._grammars.pop(key, None)
        if grammar is None:
            try:
                grammar = JsonGrammar(json.loads(schema_json), prefix.encode(), suffix.encode())
            except RecursionError:
                raise ValueError("the schema nests too deeply to be compiled") from None
        self._grammars[key] = grammar
        if len(self._grammars) > 32:
            self._grammars.popitem(last=False)
        return grammar

    def after(self, matcher: Matcher, token: int) -> Matcher | None:
        """The matcher once ``token`` is output (an end-of-sequence token leaves it where it is); None: refused."""
        if token in self.vocabulary.eos_ids:
            return matcher if matcher.complete else None
        data = self.vocabulary.token_bytes[token] if 0 <= token < self.vocabulary.size else None
        return matcher.feed(data) if data else None

    def allows(self, matcher: Matcher, token: int) -> bool:
        return self.after(matcher, token) is not None

    def advance(self, matcher: Matcher, token: int) -> Matcher:
        """The matcher after a recomputed output ``token`` (one the grammar refuses leaves it where it is)."""
        return self.after(matcher, token) or matcher

    def mask(self, matcher: Matcher) -> torch.Tensor:
        """Which tokens the grammar allows next: bool [vocabulary]."""
        cached = self._masks.pop(matcher, None)
        if cached is None:
            began = time.perf_counter()
            cached = self._allowed(matcher)
            self.masks_built += 1
            self.mask_seconds += time.perf_counter() - began
        self._masks[matcher] = cached
        if len(self._masks) > self._cache_size:
            self._masks.popitem(last=False)
        return cached

    def _allowed(self, matcher: Matcher) -> torch.Tensor:
        vocabulary = self.vocabulary
        allowed = torch.zeros(vocabulary.size, dtype=torch.bool)
        if matcher.in_plain_string:  # every plain token keeps it there; only the others need trying
            allowed |= vocabulary.plain
            fits = [t for t in vocabulary.unplain_ids if matcher.feed(vocabulary.token_bytes[t]) is not None]
        else:
            fits, pending = [], [(vocabulary.trie, matcher)]
            while pending:
                node, at = pending.pop()
                for byte, child in node.items():
                    if byte == _TOKENS:
                        continue
                    after = at.feed((byte,))
                    if after is not None:
                        fits.extend(child.get(_TOKENS, ()))
                        pending.append((child, after))
        allowed[fits] = True
        if matcher.complete:
            allowed[vocabulary.eos_ids] = True
        return allowed

    def enforce(self, logits: torch.Tensor, chosen: list[int], rows: Sequence[int], matchers: Sequence[Matcher], resample) -> tuple[list[int], list[Matcher]]:
        """``chosen`` with each constrained row's token (``rows[i]``, under ``matchers[i]``) replaced, where the grammar
        refuses it, by ``resample(row, masked_logits)``: the row's own sampler over the allowed tokens alone; and each
        row's matcher once its token is output."""
        began = time.perf_counter()
        afters = []
        for row, matcher in zip(rows, matchers):
            self.tokens_checked += 1
            after = self.after(matcher, chosen[row])
            if after is None:
                self.tokens_resampled += 1
                mask = self.mask(matcher).to(logits.device)
                if bool(mask.any()):
                    chosen[row] = resample(row, logits[row : row + 1].masked_fill(~mask, float("-inf")))
                elif self.vocabulary.eos_ids:  # nothing fits (a vocabulary without the bytes it needs): end the output
                    chosen[row] = self.vocabulary.eos_ids[0]
                after = self.after(matcher, chosen[row]) or matcher
            afters.append(after)
        self.seconds += time.perf_counter() - began
        return chosen, afters
