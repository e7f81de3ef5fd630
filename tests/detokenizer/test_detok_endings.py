"""The detokenizer ends a request where the scheduler does, from the tokens alone: at a stop token once
min_tokens are out (never with ignore_eos, whose opening lists none), or at max_tokens; tokens after
the ending are dropped, even within one delta. An ending from outside (an abort) ends it too, and one
that overtakes the request's opening keeps that opening from starting it."""

from __future__ import annotations

import pytest
import structlog

from services.detokenizer.loop import DetokenizerLoop
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import StreamOpen, TextDelta, TokenBatch, TokenDelta

EOS = 2  # SmolLM2's <|im_end|>


@pytest.fixture
def loop(tmp_path):
    loop = DetokenizerLoop(StackConfig(model=DEFAULT_MODEL_DIR, run_dir=str(tmp_path)), structlog.get_logger())
    loop.load_tokenizer()
    loop.sent = []  # (reply_to, frame) the api would get
    loop.to_api.send = lambda reply_to, frame: loop.sent.append(frame)
    loop.to_scheduler.send = lambda frame: loop.sent.append(frame)
    yield loop
    loop.to_api.close()
    loop.to_scheduler.close()
    loop.inbox.close()


def _texts(loop) -> list[TextDelta]:
    return [delta for frame in loop.sent for delta in getattr(frame, "deltas", [])]


def _words(loop, text: str) -> list[int]:
    return loop.tokenizer.encode(text)


def test_a_stop_token_ends_the_request_and_later_tokens_are_dropped(loop) -> None:
    hello = _words(loop, "Hello there")
    loop.handle(TokenBatch(opened=[StreamOpen(rid="r", prompt_tokens=3, max_tokens=50, stop_token_ids=[EOS])]))
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="r", token_ids=[*hello, EOS, *hello])]))  # one delta past the end
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="r", token_ids=hello)]))  # the pipelined step's token
    (delta,) = _texts(loop)
    assert (delta.text, delta.finish, delta.completion_tokens) == ("Hello there", "stop", len(hello) + 1)
    assert not loop.detokenization.requests


def test_a_stop_token_before_min_tokens_is_an_ordinary_token(loop) -> None:
    hello = _words(loop, "Hello")
    loop.handle(TokenBatch(opened=[StreamOpen(rid="r", prompt_tokens=3, max_tokens=50, stop_token_ids=[EOS], min_tokens=3)]))
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="r", token_ids=[EOS]), TokenDelta(rid="r", token_ids=[*hello, EOS])]))
    first, second = _texts(loop)
    assert (first.finish, second.finish, second.completion_tokens) == (None, "stop", len(hello) + 2)


def test_max_tokens_ends_the_request_where_no_stop_token_does(loop) -> None:
    loop.handle(TokenBatch(opened=[StreamOpen(rid="r", prompt_tokens=3, max_tokens=3)]))  # ignore_eos: no stop tokens
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="r", token_ids=[EOS, EOS])]))
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="r", token_ids=[EOS, EOS])]))
    first, second = _texts(loop)
    assert (first.finish, second.finish, second.completion_tokens) == (None, "length", 3)


def test_an_abort_ends_an_open_request_and_one_that_overtook_its_opening(loop) -> None:
    loop.handle(TokenBatch(opened=[StreamOpen(rid="open", prompt_tokens=3, max_tokens=10)]))
    loop.handle(TokenBatch(deltas=[TokenDelta(rid="open", finish="abort"), TokenDelta(rid="unopened", finish="abort")]))
    assert [(d.rid, d.finish) for d in _texts(loop)] == [("open", "abort")]
    loop.handle(TokenBatch(opened=[StreamOpen(rid="unopened", prompt_tokens=3, max_tokens=10)], deltas=[TokenDelta(rid="unopened", token_ids=[5])]))
    assert len(_texts(loop)) == 1 and not loop.detokenization.requests and not loop.detokenization.ended_before_opened


def test_the_usage_reports_the_cached_tokens_of_the_opening(loop) -> None:
    loop.handle(TokenBatch(opened=[StreamOpen(rid="r", prompt_tokens=30, max_tokens=1, cached_tokens=16)], deltas=[TokenDelta(rid="r", token_ids=[5])]))
    (delta,) = _texts(loop)
    assert (delta.finish, delta.prompt_tokens, delta.cached_tokens) == ("length", 30, 16)
