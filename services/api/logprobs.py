"""Token logprobs in the OpenAI shapes: chat's ``logprobs.content`` and the legacy completions object.

The engine's logprobs are the processed ones (after logit_bias and penalties, before
temperature and truncation; see services/worker/sampling.py). A logprob of -inf (a token the
model cannot produce) is shown as -9999.0, as vLLM does, since JSON has no infinity.
"""

from __future__ import annotations

from typing import Any

from shared.frames import TextLogprobs, TokenText

FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, FLOOR)


def _token(entry: TokenText) -> dict[str, Any]:
    return {"token": entry.token, "logprob": _finite(entry.logprob), "bytes": list(entry.raw)}


def chat_logprobs(entries: list[TextLogprobs]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk)."""
    return {"content": [{**_token(e.chosen), "top_logprobs": [_token(t) for t in e.top]} for e in entries], "refusal": None}


def completion_logprobs(entries: list[TextLogprobs], offset: int = 0) -> dict[str, Any]:
    """``choices[i].logprobs`` of a completion: parallel lists, alternatives as {token: logprob} (the chosen token included,
    as vLLM does); ``text_offset`` counts characters of the token texts from ``offset``."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.chosen.token)
    return {
        "tokens": [e.chosen.token for e in entries],
        "token_logprobs": [_finite(e.chosen.logprob) for e in entries],
        "top_logprobs": [{t.token: _finite(t.logprob) for t in [*e.top, e.chosen]} for e in entries],
        "text_offset": offsets,
    }
