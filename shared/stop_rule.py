"""When a request's newest token ends it: one rule, applied by the scheduler (which frees the request's
blocks) and by the detokenizer (which ends its text) to the same tokens in the same order, so both end
it at the same token without telling each other. Stop strings are the detokenizer's alone (it tells
the scheduler with a ``Finish``)."""

from __future__ import annotations

from collections.abc import Container

from shared.frames import FinishReason


def finish_for_token(token_id: int, generated: int, stop_token_ids: Container[int], min_tokens: int, max_tokens: int) -> FinishReason | None:
    """Why the request ends at its ``generated``-th output token ``token_id``, or None if it goes on.

    ``stop_token_ids`` is empty for a request that ignores EOS; a stop token before ``min_tokens``
    outputs is an ordinary token.
    """
    if token_id in stop_token_ids and generated >= min_tokens:
        return FinishReason.STOP
    if generated >= max_tokens:
        return FinishReason.LENGTH
    return None
