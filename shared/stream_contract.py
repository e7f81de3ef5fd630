"""The contract of a request's token stream among the scheduler, the worker and the process that makes its text
(the api with ``--detokenize-in api``, or the detokenizer): what the stream's opening carries, when a token ends
it, and who tells whom. Each process keeps only its own bookkeeping beside it.

- The opening (``open_stream``, a ``StreamOpen``): the scheduler attaches it to the request's first slice of its
  first admission; the worker sends it to the text maker (to its ``reply_to`` with ``--detokenize-in api``) in the
  ``TokenBatch`` ahead of the request's first token, on the path its tokens take. A preempted request that is
  readmitted does not open again.
- The end rule (``EndRule.ends_at``): the scheduler (which frees the request's blocks) and the text maker (which
  ends its text) apply it to the same tokens in the same order, so both end the request at the same token with no
  frame between them. Tokens of steps planned before the end are dropped by both.
- Runs of decode steps: the worker ends a request inside a run at any of its stop tokens (``ends_run``; they come
  with the first slice since each admission, ``Slice.stop_token_ids``), and the scheduler plans a run only where
  the end rule says the same (``EndRule.run_limit``); it ends the request itself when the run's result arrives.
- Stop strings are the text maker's alone: it tells the scheduler with a ``Finish``, sent ahead of the text, so the
  scheduler stops the request's steps at once.
- Endings from outside (an abort, a failed step, a lost process) are the scheduler's: it releases the request on
  the worker and tells a detokenizer with a finishing ``TokenDelta`` (an api that makes the text knows them
  itself). Such an ending can overtake the opening it follows, so the text maker ignores the opening of a request
  it already ended.
"""

from __future__ import annotations

from collections.abc import Container
from typing import NamedTuple

from shared.frames import FinishReason, StreamOpen, Submit


def stop_token_ids(submit: Submit) -> list[int]:
    """The tokens that end the request once its ``min_tokens`` are out: none with ``ignore_eos``."""
    return [] if submit.ignore_eos else submit.stop_token_ids


def open_stream(submit: Submit, cached_tokens: int) -> StreamOpen:
    """The request's opening, built at its first slice (``cached_tokens``: prompt tokens the prefix cache held)."""
    return StreamOpen(
        rid=submit.rid,
        prompt_tokens=len(submit.prompt_ids),
        max_tokens=submit.max_tokens,
        stop_token_ids=stop_token_ids(submit),
        min_tokens=submit.min_tokens,
        stop=submit.stop,
        skip_special_tokens=submit.skip_special_tokens,
        cached_tokens=cached_tokens,
        reply_to=submit.reply_to,
    )


class EndRule(NamedTuple):
    """When a request's newest token ends it: a stop token once ``min_tokens`` outputs are out (before that it is
    an ordinary token), else ``max_tokens``."""

    stop_token_ids: frozenset[int]  # empty with ignore_eos
    min_tokens: int
    max_tokens: int

    @classmethod
    def of(cls, opening: StreamOpen) -> EndRule:
        return cls(frozenset(opening.stop_token_ids), opening.min_tokens, opening.max_tokens)

    @classmethod
    def of_submit(cls, submit: Submit) -> EndRule:
        return cls(frozenset(stop_token_ids(submit)), submit.min_tokens, submit.max_tokens)

    def ends_at(self, token_id: int, generated: int) -> FinishReason | None:
        """Why the request ends at its ``generated``-th output token ``token_id``, or None if it goes on."""
        if token_id in self.stop_token_ids and generated >= self.min_tokens:
            return FinishReason.STOP
        if generated >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def run_limit(self, promised: int) -> int:
        """The most decode steps one plan may run for the request with ``promised`` outputs sampled or planned:
        never past ``max_tokens``, and 1 while ``min_tokens`` are not out (a run ends at any stop token)."""
        if promised < self.min_tokens:
            return 1
        return max(self.max_tokens - promised, 1)


def ends_run(token_id: int, run_stop_token_ids: Container[int]) -> bool:
    """Whether the worker ends the request's run of decode steps at ``token_id``: at any of its stop tokens, which
    the scheduler lets a run reach only where they end the request (``EndRule.run_limit``)."""
    return token_id in run_stop_token_ids
