"""RequestDetokState: text, stop strings and completion_tokens of one request."""

from __future__ import annotations

from shared.detokenize.request import RequestDetokState, Update

from .conftest import UNSEEN


def first_token_completing(tokenizer, ids: list[int], stop: str) -> int:
    return next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))


def test_completion_tokens_count_up_to_the_token_that_completed_the_stop(tokenizer):
    text = f"Crabs {UNSEEN} everywhere, and more after"
    ids = tokenizer.encode(text, add_special_tokens=False)
    crab = UNSEEN[0]
    completed_at = first_token_completing(tokenizer, ids, crab)
    assert completed_at < len(ids) - 3

    state = RequestDetokState(tokenizer, stop=[crab])
    first = state.push(ids[:2])
    rest = state.push(ids[2:])
    assert first.text + rest.text == "Crabs "
    assert (rest.finished_by_stop, rest.completion_tokens) == (crab, completed_at)
    assert state.push(ids[:5]) == Update("", None, completed_at)
    assert state.finish() == ""


def test_stop_split_across_pushes_and_tokens(byte_level):
    ids = byte_level.encode("Hello world! The quick brown fox", add_special_tokens=False)
    state = RequestDetokState(byte_level, stop=["quick", "world! The"])
    updates = [state.push([i]) for i in ids]
    assert "".join(u.text for u in updates) == "Hello "
    done = [u for u in updates if u.finished_by_stop]
    assert len(done) == 1 and done[0].finished_by_stop == "world! The"
    assert done[0].completion_tokens == first_token_completing(byte_level, ids, "world! The")


def test_without_a_stop_every_token_counts_and_finish_flushes(tokenizer):
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)[:-1]
    state = RequestDetokState(tokenizer, stop=["never"])
    texts = [state.push(ids[:3]).text, state.push(ids[3:]).text, state.finish()]
    assert "".join(texts) == tokenizer.decode(ids)
    assert state.completion_tokens == len(ids) and state.stopped is None


def test_special_tokens_are_kept_when_asked(byte_level):
    ids = byte_level.encode("Hi<|im_end|>", add_special_tokens=False)
    state = RequestDetokState(byte_level, skip_special_tokens=False)
    assert state.push(ids).text + state.finish() == "Hi<|im_end|>"
