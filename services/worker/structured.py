"""Structured outputs in the worker, on xgrammar: the model's tokenizer info (built once, in warm-up), grammars
compiled once per distinct request grammar (off the step's path, on a thread, into xgrammar's bounded cache), one
matcher per constrained request, and the batch's token bitmask filled for its constrained rows and applied to the
logits in one call before sampling (so a greedy row takes the most likely token its grammar allows).

A request whose grammar starts after a reasoning block (``SamplingParams.grammar_after``: the end-of-reasoning
tokens) thinks unconstrained; its matcher starts at the token after them.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from shared.frames import Grammar, GrammarKind, SamplingParams

_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its complaint

# xgrammar (0.2.8-0.2.9) lowers a JSON string with minLength/maxLength to repetitions of this class, which lets raw
# control characters into the string (invalid JSON) and keeps escapes out (mlc-ai/xgrammar#800). Each repetition
# is mended into one JSON string character: an unescaped one, or an escape.
_BOUNDED_STRING_CLASS = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r'([^\0-\x1f\"\\] | "\\" ([\"\\/bfnrt] | "u" [A-Fa-f0-9]{4}))'


def complaint(exc: Exception) -> str:
    """xgrammar's error without the C++ source location it opens with."""
    return _LOCATION.sub("", str(exc).strip()) or type(exc).__name__


@functools.lru_cache(maxsize=1024)
def mended_json_grammar(kind: GrammarKind, text: str, strict: bool) -> str | None:
    """The EBNF of a JSON schema or structural tag with its length-bounded strings mended; None where it has none
    (it then compiles as it is). Converting costs ~0.1-0.4 ms, hence the cache: every request start asks."""
    if kind is GrammarKind.JSON_SCHEMA:
        ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict))
    elif kind is GrammarKind.STRUCTURAL_TAG:
        ebnf = str(xgr.Grammar.from_structural_tag(text))
    else:
        return None
    return ebnf.replace(_BOUNDED_STRING_CLASS, _JSON_STRING_CHARACTER) if _BOUNDED_STRING_CLASS in ebnf else None


class GrammarState:
    """One constrained request's place in its grammar: waiting for the end of its reasoning (``after``), then
    its xgrammar matcher. ``rollback`` undoes accepted tokens (rejected speculative tokens)."""

    def __init__(self, compiled: xgr.CompiledGrammar, after: Sequence[int]) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self._after = list(after)
        self._seen: list[int] = []  # while reasoning: the latest outputs, as long as ``after``
        self.reasoning = bool(self._after)
        self.accepted = 0  # tokens the matcher took: what rollback may undo

    @property
    def constrains(self) -> bool:
        """Whether the next token is held to the grammar (not while reasoning; once it ended, to its stop tokens)."""
        return not self.reasoning

    def accept(self, token: int) -> bool:
        """Moves past an output token; False where the grammar refuses it (the state is then unchanged)."""
        if self.reasoning:
            self._seen = (self._seen + [token])[-len(self._after) :]
            self.reasoning = self._seen != self._after
            return True
        if self.matcher.is_terminated() or not self.matcher.accept_token(token):
            return False
        self.accepted += 1
        return True

    def rollback(self, tokens: int) -> None:
        tokens = min(tokens, self.accepted)
        if tokens:
            self.matcher.rollback(tokens)
            self.accepted -= tokens


class StructuredOutputs:
    """The worker's xgrammar compiler over the model's vocabulary, its compilations in flight, and the bitmask."""

    def __init__(self, info: xgr.TokenizerInfo, cache_bytes: int = 256 << 20) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True, cache_limit_bytes=cache_bytes)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._compiling: dict[str, tuple[Grammar, Future[xgr.CompiledGrammar]]] = {}
        self._bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        self._stops_only = torch.zeros_like(self._bitmask[0])  # a mask row for a grammar that ended: its stop tokens
        for token in info.stop_token_ids:
            self._stops_only[token // 32] |= 1 << (token % 32)
        self.grammars_compiled = self.masks_filled = 0  # what /instrumentation reports
        self.compile_seconds = self.mask_seconds = 0.0

    @classmethod
    def of_model(cls, model_dir: str, vocab_size: int, eos_ids: Sequence[int]) -> StructuredOutputs:
        from shared.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids) or None))

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "xgrammar",
            "grammars_compiled": self.grammars_compiled,
            "compile_seconds": round(self.compile_seconds, 3),
            "compiling": len(self._compiling),
            "masks_filled": self.masks_filled,
            "mask_seconds": round(self.mask_seconds, 3),
            "cache_bytes": self.compiler.get_cache_size_bytes(),
        }

    def compile(self, grammar: Grammar) -> xgr.CompiledGrammar:
        """The compiled grammar (xgrammar's cache answers a grammar seen before); a ``ValueError`` with xgrammar's
        complaint for one that does not compile."""
        began = time.perf_counter()
        try:
            mended = mended_json_grammar(grammar.kind, grammar.text, grammar.strict)
            if mended is not None:
                compiled = self.compiler.compile_grammar(mended)
            elif grammar.kind is GrammarKind.JSON_SCHEMA:
                compiled = self.compiler.compile_json_schema(grammar.text, any_whitespace=False, strict_mode=grammar.strict)
            elif grammar.kind is GrammarKind.REGEX:
                compiled = self.compiler.compile_regex(grammar.text)
            elif grammar.kind is GrammarKind.EBNF:
                compiled = self.compiler.compile_grammar(grammar.text)
            else:
                compiled = self.compiler.compile_structural_tag(grammar.text)
        except Exception as exc:
            raise ValueError(complaint(exc)) from None
        self.grammars_compiled += 1
        self.compile_seconds += time.perf_counter() - began
        return compiled

    # Compiling ahead, for the scheduler (its CompileGrammar frames). ------------------------------------------

    def compile_ahead(self, rid: str, grammar: Grammar) -> None:
        """Starts compiling a queued request's grammar on the compile thread."""
        self._compiling[rid] = (grammar, self._pool.submit(self.compile, grammar))

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    def compiled(self) -> list[tuple[str, str]]:
        """(rid, error: "" when it compiled) of each grammar compiled ahead since the last call."""
        done = [rid for rid, (_, future) in self._compiling.items() if future.done()]
        out = []
        for rid in done:
            _, future = self._compiling.pop(rid)
            error = future.exception()
            out.append((rid, str(error) if error is not None else ""))
        return out

    # Requests. --------------------------------------------------------------------------------------------------

    def check(self, params: SamplingParams) -> None:
        if params.grammar is not None:
            self.compile(params.grammar)

    def start(self, params: SamplingParams) -> GrammarState:
        assert params.grammar is not None
        return GrammarState(self.compile(params.grammar), params.grammar_after)

    def advance(self, state: GrammarState, token: int) -> GrammarState:
        """The state after a recomputed output ``token`` (one the grammar refuses leaves it where it is)."""
        state.accept(token)
        return state

    def apply(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """Masks, in place, every token that a row's grammar refuses next (rows with no state, or reasoning, stay free;
        a grammar that ended allows only its stop tokens)."""
        rows = [i for i, s in enumerate(states) if s is not None and s.constrains]
        if not rows:
            return
        began = time.perf_counter()
        if self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        for row in rows:
            matcher = states[row].matcher  # type: ignore[union-attr]
            if matcher.is_terminated():  # past its stop token (ignore_eos, min_tokens): only stop tokens follow
                self._bitmask[row] = self._stops_only
            else:
                matcher.fill_next_token_bitmask(self._bitmask, row)
        bitmask = self._bitmask[: logits.shape[0]]
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows)
        self.masks_filled += len(rows)
        self.mask_seconds += time.perf_counter() - began

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
