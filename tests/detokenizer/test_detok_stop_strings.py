"""StopStringMatcher: stop strings are found across deltas, and nothing from them on leaks out."""

from __future__ import annotations

import random

from shared.detokenize.stop_strings import StopStringMatcher


def feed_all(stops: list[str], parts: list[str]) -> tuple[str, str | None]:
    matcher = StopStringMatcher(stops)
    emitted, matched = [], None
    for part in parts:
        text, hit = matcher.feed(part)
        emitted.append(text)
        matched = matched or hit
    return "".join(emitted) + matcher.flush(), matched


def test_without_stops_text_passes_through():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", None)
    assert matcher.feed("") == ("", None)
    assert matcher.flush() == ""


def test_stop_string_spanning_two_deltas():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("hello ST") == ("hello ", None)
    assert matcher.feed("OP and more") == ("", "STOP")


def test_stop_string_at_the_very_start():
    assert StopStringMatcher(["STOP"]).feed("STOPxyz") == ("", "STOP")


def test_overlapping_candidates_first_completed_wins():
    matcher = StopStringMatcher(["abcd", "bc"])
    assert matcher.feed("ab") == ("", None)
    assert matcher.feed("c") == ("a", "bc")


def test_text_after_the_stop_is_dropped():
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("line\n\nnext line") == ("line", "\n\n")
    assert matcher.feed("even more") == ("", None)
    assert matcher.flush() == ""


def test_earliest_match_in_the_text_wins():
    assert StopStringMatcher(["world", "hello"]).feed("say hello world") == ("say ", "hello")
    assert StopStringMatcher(["b", "abc"]).feed("xabc") == ("xa", "b")


def test_held_back_only_while_it_could_still_match():
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("done </ans") == ("done ", None)
    assert matcher.feed("wer") == ("", None)
    assert matcher.feed("!") == ("</answer!", None)
    assert matcher.feed("<<<<<<<<<<<") == ("<<<<<<<<<<", None)  # holds at most len - 1 = 8; here 1
    assert matcher.flush() == "<"


def test_unmatched_tail_is_released_by_flush():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("the end ST") == ("the end ", None)
    assert matcher.flush() == "ST"


def test_result_does_not_depend_on_how_text_is_split():
    rng = random.Random(5)
    stops = ["abcd", "bc", "cab", "dd", "😀!"]
    for _ in range(300):
        text = "".join(rng.choice("abcd😀! ") for _ in range(rng.randrange(20)))
        whole = feed_all(stops, [text])
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randrange(len(text) + 1)))
        parts = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert feed_all(stops, parts) == whole, (text, parts)
        assert feed_all(stops, list(text)) == whole
