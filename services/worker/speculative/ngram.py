"""Prompt lookup: a request's next tokens guessed from its own earlier tokens, with no weights.

The longest n-gram (``max_n`` down to ``min_n`` tokens) that ends the request's tokens is looked up among its
earlier tokens, prompt and output; the tokens that followed its most recent earlier occurrence are the
proposal. An index from each n-gram to the end of its latest occurrence grows by ``max_n - min_n + 1``
entries per token, so a lookup costs the same however long the request.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """One request's tokens and the index of their n-grams."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the end of its latest occurrence that a token follows

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens = self.tokens
        for token in token_ids:
            # Every n-gram that ends at the last token is now followed by one: index it before appending.
            last = len(tokens) - 1
            for n in range(self.min_n, min(self.max_n, len(tokens)) + 1):
                self._ends[tuple(tokens[last - n + 1 :])] = last
            tokens.append(token)

    def propose(self, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens that followed the longest n-gram that ends the tokens, where it last occurred."""
        tokens = self.tokens
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            end = self._ends.get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + max_tokens]
        return []


class NgramProposer:
    """Prompt lookup for every running request; it proposes for a batch at once, as a model proposer would."""

    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram needs 1 <= ngram_min <= ngram_max, got {min_n} and {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._requests: dict[str, PromptLookup] = {}

    def extend(self, rid: str, token_ids: Sequence[int]) -> None:
        """Tokens the request now has beyond those given before (prompt, recomputed outputs, sampled tokens)."""
        lookup = self._requests.get(rid)
        if lookup is None:
            lookup = self._requests[rid] = PromptLookup(self.min_n, self.max_n)
        lookup.extend(token_ids)

    def propose(self, wanted: dict[str, int]) -> dict[str, list[int]]:
        """Each request's proposal of up to ``wanted[rid]`` tokens; a request without one is left out."""
        out = {}
        for rid, count in wanted.items():
            lookup = self._requests.get(rid)
            proposal = lookup.propose(count) if lookup is not None else []
            if proposal:
                out[rid] = proposal
        return out

    def has_guess(self, rid: str) -> bool:
        """Whether the request's next tokens have a proposal (an n-gram ending its tokens occurred before)."""
        lookup = self._requests.get(rid)
        return lookup is not None and bool(lookup.propose(1))

    def release(self, rid: str) -> None:
        self._requests.pop(rid, None)
