"""The stream contract: a request's opening carries what its text maker needs, and one end rule tells the
scheduler, the text maker and the worker's runs where a request ends."""

from __future__ import annotations

import pytest

from shared.frames import FinishReason, SamplingParams, Submit
from shared.stream_contract import EndRule, ends_run, open_stream


@pytest.mark.parametrize(
    ("token", "generated", "stop_ids", "min_tokens", "max_tokens", "expected"),
    [
        (2, 1, [2], 0, 10, FinishReason.STOP),
        (2, 1, [2], 2, 10, None),  # a stop token before min_tokens is an ordinary token
        (2, 2, [2], 2, 10, FinishReason.STOP),
        (2, 10, [], 0, 10, FinishReason.LENGTH),
        (5, 9, [2], 0, 10, None),
        (2, 10, [2], 0, 10, FinishReason.STOP),  # both: a stop token is a stop
    ],
)
def test_the_end_rule(token, generated, stop_ids, min_tokens, max_tokens, expected) -> None:
    assert EndRule(frozenset(stop_ids), min_tokens, max_tokens).ends_at(token, generated) is expected


def test_the_opening_carries_what_the_text_maker_needs_and_ignore_eos_lists_no_stop_token() -> None:
    submit = Submit(
        rid="r",
        prompt_ids=[1, 2, 3],
        max_tokens=7,
        sampling=SamplingParams(temperature=0),
        stop_token_ids=[2],
        stop=["\n\n"],
        min_tokens=2,
        skip_special_tokens=False,
        reply_to="ipc://api-1",
    )
    opening = open_stream(submit, cached_tokens=2)
    assert (opening.rid, opening.prompt_tokens, opening.cached_tokens, opening.reply_to) == ("r", 3, 2, "ipc://api-1")
    assert (opening.stop_token_ids, opening.min_tokens, opening.max_tokens, opening.stop, opening.skip_special_tokens) == ([2], 2, 7, ["\n\n"], False)
    assert EndRule.of(opening) == EndRule.of_submit(submit) == EndRule(frozenset([2]), 2, 7)
    ignoring = Submit(rid="i", prompt_ids=[1], max_tokens=3, stop_token_ids=[2], ignore_eos=True)
    assert open_stream(ignoring, 0).stop_token_ids == [] and EndRule.of_submit(ignoring).ends_at(2, 1) is None


def test_a_run_of_decode_steps_reaches_a_stop_token_only_where_it_ends_the_request() -> None:
    rule = EndRule(frozenset([2]), min_tokens=3, max_tokens=10)
    assert [rule.run_limit(promised) for promised in (0, 2, 3, 8, 9, 10)] == [1, 1, 7, 2, 1, 1]
    assert ends_run(2, rule.stop_token_ids) and not ends_run(5, rule.stop_token_ids) and not ends_run(2, frozenset())
