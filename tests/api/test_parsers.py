"""Reasoning and tool-call parsers on recorded model outputs, fed whole and cut at every possible chunk boundary.

Streaming must never change the answer: for every split, the reasoning, the content and
the calls equal those of the unsplit output, and no markup reaches the client.
"""

from __future__ import annotations

import json

import pytest

from services.api.output_parsing import Content, OutputParser, Reasoning, ToolCall, ToolCallDelta, ToolCallStart, finish_reason
from services.api.reasoning import ReasoningSplitter, check_effort, effort_template_kwargs, opens_reasoning
from services.api.tool_parsers import TOOL_PARSERS, choose_tool_parser
from services.api.tools import ToolSpec

WEATHER = ToolSpec(
    "get_weather",
    "Current weather",
    {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}, "zip": {"type": "string"}}},
)
TIME = ToolSpec("get_time", "Local time", {"type": "object", "properties": {"tz": {"type": "string"}}})
MARKUP = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<function=", "<parameter=", "<|python_tag|>")


def _parser(tool_parser: str | None, reasoning: bool, in_reasoning: bool = False, parallel: bool = True) -> OutputParser:
    splitter = ReasoningSplitter(in_reasoning=in_reasoning) if reasoning else None
    tools = TOOL_PARSERS[tool_parser]([WEATHER, TIME], parallel) if tool_parser else None
    return OutputParser(splitter, tools)


def _run(make, chunks: list[str]) -> tuple[str, str, list[tuple[str, dict]], list[type]]:
    parser = make()
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    events += parser.finish()
    reasoning = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e.text for e in events if isinstance(e, Content))
    ends = [e for e in events if isinstance(e, ToolCall)]
    calls = [(e.name, json.loads(e.arguments)) for e in ends]
    assert [e.index for e in ends] == list(range(len(calls)))
    # Streamed: id and name first, then fragments that concatenate to the call's arguments; calls never interleave.
    open_call = None
    for event in events:
        if isinstance(event, ToolCallStart):
            assert open_call is None
            open_call, fragments = event, []
        elif isinstance(event, ToolCallDelta):
            assert open_call is not None and event.index == open_call.index
            fragments.append(event.arguments)
        elif isinstance(event, ToolCall):
            assert (event.index, event.id, event.name) == tuple(open_call) and "".join(fragments) == event.arguments
            open_call = None
        else:
            assert open_call is None, "text inside a call"
    assert open_call is None
    assert (reasoning, content) == (parser.reasoning, parser.content) and len(parser.calls) == len(calls)
    kinds: list[type] = []
    for event in events:  # the order of kinds, with runs collapsed (a call counts as its end)
        if isinstance(event, ToolCallStart | ToolCallDelta):
            continue
        if not kinds or kinds[-1] is not type(event) or type(event) is ToolCall:
            kinds.append(type(event))
    return reasoning, content, calls, kinds


def _splits(text: str):
    """Every two-piece split, and one piece per character."""
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def check(make, text: str, reasoning: str, content: str, calls: list[tuple[str, dict]], clean: bool = True) -> None:
    whole = _run(make, [text])
    assert whole[:3] == (reasoning, content, calls)
    if clean:
        assert not any(tag in whole[0] + whole[1] for tag in MARKUP), whole
    for chunks in _splits(text):
        assert _run(make, chunks) == whole, chunks


QWEN3_THINK_THEN_CALL = (
    "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)


def test_qwen3_reasoning_then_hermes_call() -> None:
    check(
        lambda: _parser("hermes", True),
        QWEN3_THINK_THEN_CALL,
        "The user wants the weather in Paris. I should call get_weather.\n",
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
    )


def test_hermes_text_then_two_parallel_calls() -> None:
    text = (
        "Let me check both.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>\n'
    )
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    check(lambda: _parser("hermes", False), text, "", "Let me check both.", calls)
    check(lambda: _parser("hermes", False, parallel=False), text, "", "Let me check both.", calls[:1])


def test_hermes_malformed_call_comes_back_as_text() -> None:
    """A call that is malformed before its arguments begin is text; the call starts streaming once they do."""
    for broken in (
        '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    ):
        check(lambda: _parser("hermes", False), "Sure. " + broken, "", "Sure. " + broken, [], clean=False)


def test_hermes_call_broken_after_its_arguments_began_ends_with_valid_json() -> None:
    one_brace_short = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    check(lambda: _parser("hermes", False), one_brace_short, "", "", [("get_weather", {"city": "Paris"})])
    garbled = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": two}}\n</tool_call> Done.'
    check(lambda: _parser("hermes", False), garbled, "", "Done.", [("get_weather", {"city": "Paris"})])


def test_hermes_unclosed_call_is_cut_into_valid_json() -> None:
    check(lambda: _parser("hermes", False), '<tool_call>\n{"name": "get_time", "arguments": {}}\n', "", "", [("get_time", {})])
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    check(lambda: _parser("hermes", False), cut, "", "", [("get_weather", {"city": "Par"})])
    truncated = '<tool_call>\n{"name": "get_time", "argu'  # cut before the arguments began: text
    check(lambda: _parser("hermes", False), truncated, "", truncated, [], clean=False)


def test_hermes_other_key_orders_and_string_arguments_are_parsed_whole() -> None:
    text = '<tool_call>{"arguments": {"tz": "UTC"}, "name": "get_time"}</tool_call><tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>'
    check(lambda: _parser("hermes", False), text, "", "", [("get_time", {"tz": "UTC"}), ("get_time", {})])


def test_streamed_arguments_are_normalised_json_with_escapes_and_nesting() -> None:
    args = '{"city":"S\\u00e3o \\"Paulo\\"\\n\\ud83d\\ude00","days":1e2,"tags":[ "a" ,{"b":null}],"ok":false}'
    text = f'<tool_call>{{"name": "get_weather", "arguments": {args}}}</tool_call>'
    check(lambda: _parser("hermes", False), text, "", "", [("get_weather", json.loads(args))])
    parser = _parser("hermes", False)
    events = parser.feed(text) + parser.finish()
    assert parser.calls[0].arguments == json.dumps(json.loads(args), ensure_ascii=False)
    assert sum(isinstance(e, ToolCallDelta) for e in events) >= 1


def test_hermes_plain_answer_passes_through_unchanged() -> None:
    text = "  No tools needed: 2 < 3 and <tool is not a tag.\n\n"
    check(lambda: _parser("hermes", False), text, "", text, [])


QWEN3_CODER = (
    "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=zip>\n01000\n</parameter>\n"
    "</function>\n</tool_call>"
)


def test_qwen3_coder_xml_with_schema_typed_values() -> None:
    args = {"city": "São Paulo", "days": 3, "metric": True, "zip": "01000"}
    check(lambda: _parser("qwen3_coder", True), QWEN3_CODER, "", "I'll look it up.", [("get_weather", args)])
    bare = "<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>"
    check(lambda: _parser("qwen3_coder", False), bare, "", "", [("get_time", {"tz": "UTC"})])


def test_qwen3_coder_malformed_call_comes_back_as_text() -> None:
    broken = "<tool_call>\n<function get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    check(lambda: _parser("qwen3_coder", False), broken, "", broken, [], clean=False)


def test_qwen3_coder_unclosed_parameter_keeps_its_text() -> None:
    unclosed = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    check(lambda: _parser("qwen3_coder", False), unclosed, "", "", [("get_weather", {"city": "Paris"})])
    cut = "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<parameter=city>\nPar"
    check(lambda: _parser("qwen3_coder", False), cut, "", "", [("get_weather", {"days": 2, "city": "Par"})])


def test_llama3_json_calls() -> None:
    single = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    check(lambda: _parser("llama3_json", False), single, "", "", [("get_weather", {"city": "Paris"})])
    tagged = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_time", "parameters": {"tz": "CET"}}'
    check(lambda: _parser("llama3_json", False), tagged, "", "", [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "CET"})])
    listed = '<|python_tag|>[{"name": "get_time", "parameters": {"tz": "CET"}}]'  # another shape: parsed whole at the end
    check(lambda: _parser("llama3_json", False), listed, "", "", [("get_time", {"tz": "CET"})])


def test_llama3_json_that_is_not_a_call_is_text() -> None:
    for text in ('{"answer": 42}', 'The answer is {"name": 1}.', " <|python", ' <|python_tag|>[{"name": 1}]'):
        check(lambda: _parser("llama3_json", False), text, "", text, [], clean=False)
    text = '{"name": "get_time", "parameters": {}} and more'  # text after a streamed call stays text
    check(lambda: _parser("llama3_json", False), text, "", "and more", [("get_time", {})])
    cut = '{"name": "get_time", "parameters": {"tz": "U'
    check(lambda: _parser("llama3_json", False), cut, "", "", [("get_time", {"tz": "U"})])


def test_reasoning_opened_by_the_prompt() -> None:
    text = "Hmm, 2 + 2 = 4.\n</think>\n\nThe answer is 4."
    check(lambda: _parser(None, True, in_reasoning=True), text, "Hmm, 2 + 2 = 4.\n", "The answer is 4.", [])


def test_reasoning_without_a_closing_tag_is_all_reasoning() -> None:
    check(lambda: _parser(None, True), "<think>\nStill weighing the options, maybe </thin", "Still weighing the options, maybe </thin", "", [], clean=False)
    check(lambda: _parser(None, True, in_reasoning=True), "Never closed", "Never closed", "", [])


def test_text_that_does_not_open_with_the_tag_is_content() -> None:
    for text in ("Hello <think> world</think>", "<thinking>is not the tag</thinking>", "\n\n<thi", "Plain answer."):
        check(lambda: _parser(None, True), text, "", text, [], clean=False)


def test_tool_markup_inside_reasoning_stays_reasoning() -> None:
    text = '<think>I could write <tool_call>{"name": "get_time", "arguments": {}}</tool_call> here.</think>Done.'
    check(lambda: _parser("hermes", True), text, 'I could write <tool_call>{"name": "get_time", "arguments": {}}</tool_call> here.', "Done.", [], clean=False)


def test_event_order_reasoning_content_calls() -> None:
    *_, kinds = _run(lambda: _parser("hermes", True), [QWEN3_THINK_THEN_CALL])
    assert kinds == [Reasoning, ToolCall]
    assert finish_reason("stop", True) == "tool_calls" and finish_reason("length", True) == "length" and finish_reason("stop", False) == "stop"


def test_prompt_tail_and_efforts() -> None:
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert effort_template_kwargs("none") == {"enable_thinking": False}
    assert effort_template_kwargs("high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert check_effort("max", ("none", "max"), "reasoning_effort") == "max"
    with pytest.raises(Exception, match="unknown reasoning_effort 'extreme'"):
        check_effort("extreme", ("none",), "reasoning_effort")


def test_parser_choice_by_setting_template_and_family() -> None:
    assert choose_tool_parser("llama3_json", "qwen3", "{{ tools }}") == "llama3_json"
    assert choose_tool_parser("", "qwen3_moe", "{% for tool in tools %}<function=x><parameter=y>{% endfor %}") == "qwen3_coder"
    assert choose_tool_parser("", "qwen3", "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert choose_tool_parser("", "llama", "{% if tools %}{{ '<|python_tag|>' }}{% endif %}") == "llama3_json"
    assert choose_tool_parser("", "llama", "{{ messages }}") == "hermes"  # no tools in the template: our Hermes prompt
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        choose_tool_parser("bogus", "llama", "")
