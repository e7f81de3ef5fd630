"""Chat completions around a scripted engine, through the openai SDK: reasoning, tool calls, tool choice, usage."""

from __future__ import annotations

import json

import openai
import pytest

from shared.frames import GrammarKind
from tests.api.conftest import Api

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


async def test_reasoning_is_split_from_content_streamed_or_not(qwen: Api) -> None:
    pieces = ("<thi", "nk>\nThe capital", " is Paris.</th", "ink>\n\nParis.")
    client = qwen.openai()
    qwen.engine.script(*pieces)
    reply = await client.chat.completions.create(model=qwen.model, messages=ASK)
    message = reply.choices[0].message
    assert message.content == "Paris." and message.reasoning_content == "The capital is Paris."  # type: ignore[attr-defined]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 5  # "The capital is Paris." in SmolLM2's tokenizer
    qwen.engine.script(*pieces)
    chunks = [c async for c in await client.chat.completions.create(model=qwen.model, messages=ASK, stream=True)]
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == ("The capital is Paris.", "Paris.")
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_reasoning_effort_reaches_the_template(qwen: Api) -> None:
    client = qwen.openai()
    await client.chat.completions.create(model=qwen.model, messages=ASK, reasoning_effort="high")
    assert qwen.prompt().startswith("[effort=high]")
    await client.chat.completions.create(model=qwen.model, messages=ASK, reasoning_effort="none")
    assert qwen.prompt().endswith("<think>\n\n</think>\n\n")
    # explicit chat_template_kwargs win over the effort
    await client.chat.completions.create(
        model=qwen.model, messages=ASK, reasoning_effort="none", extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert qwen.prompt().endswith("<|im_start|>assistant\n")
    with pytest.raises(openai.BadRequestError) as error:
        await client.chat.completions.create(model=qwen.model, messages=ASK, reasoning_effort="extreme")  # type: ignore[arg-type]
    assert error.value.body["param"] == "reasoning_effort"


async def test_reasoning_opened_by_the_template_and_never_closed(qwen: Api) -> None:
    client = qwen.openai()
    qwen.engine.script("The user ", "asks.</think>", "Answer.")
    reply = await client.chat.completions.create(model=qwen.model, messages=ASK, extra_body={"chat_template_kwargs": {"open_think": True}})
    assert qwen.prompt().endswith("<think>\n")
    assert (reply.choices[0].message.reasoning_content, reply.choices[0].message.content) == ("The user asks.", "Answer.")  # type: ignore[attr-defined]
    qwen.engine.script("<think>Long thoughts", " cut short", finish="length")
    reply = await client.chat.completions.create(model=qwen.model, messages=ASK, max_tokens=2)
    assert reply.choices[0].message.reasoning_content == "Long thoughts cut short" and reply.choices[0].message.content == ""  # type: ignore[attr-defined]
    assert reply.choices[0].finish_reason == "length"


async def test_tool_call_answer_and_tools_in_the_prompt(qwen: Api) -> None:
    qwen.engine.script("<think>Need weather.</think>\n\n", CALL)
    reply = await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER, TIME])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    prompt = qwen.prompt()
    assert '"name": "get_weather"' in prompt and '"name": "get_time"' in prompt and "<tools>" in prompt


async def test_streamed_tool_call_sends_id_and_name_first(qwen: Api) -> None:
    pieces = ["Checking.", "\n<tool_", 'call>\n{"name": "get_weather", "argu', 'ments": {"ci', 'ty": "Pa', 'ris", "days": 3', "}}\n</tool_call>", "\n"]
    qwen.engine.script(*pieces)
    stream = await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER], stream=True)
    chunks = [c async for c in stream]
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in calls[1:])
    # as the model writes them (a number once it has ended)
    assert [d.function.arguments for d in calls[1:]] == ["{", '"city": "Pa', 'ris"', ', "days": 3}']
    assert json.loads("".join(d.function.arguments for d in calls)) == {"city": "Paris", "days": 3}
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]


async def test_earlier_calls_and_tool_results_reach_the_template(qwen: Api) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    ]
    qwen.engine.script("It is 22 C and sunny.")
    reply = await qwen.openai().chat.completions.create(model=qwen.model, messages=messages, tools=[WEATHER])
    assert reply.choices[0].message.content == "It is 22 C and sunny." and reply.choices[0].finish_reason == "stop"
    prompt = qwen.prompt()
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in prompt


async def test_tool_choice_modes(qwen: Api) -> None:
    client = qwen.openai()
    qwen.engine.script("I would rather not.")
    reply = await client.chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    assert "You must answer by calling one or more of the provided tools." in qwen.prompt()
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == "I would rather not."  # no call: returned as it came
    await client.chat.completions.create(
        model=qwen.model, messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert "calling the tool `get_time`" in qwen.prompt() and '"name": "get_weather"' not in qwen.prompt()
    qwen.engine.script(CALL)
    reply = await client.chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in qwen.prompt() and reply.choices[0].message.content == CALL and reply.choices[0].finish_reason == "stop"
    qwen.engine.script(CALL + "\n" + CALL.replace("Paris", "Rome"))
    reply = await client.chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER], parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in reply.choices[0].message.tool_calls] == ["Paris"]


async def test_malformed_call_is_plain_content(qwen: Api) -> None:
    broken = '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call>'
    qwen.engine.script(broken)
    reply = await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER])
    assert reply.choices[0].message.content == broken and not reply.choices[0].message.tool_calls and reply.choices[0].finish_reason == "stop"
    # cut off inside its arguments: the call still ends in valid JSON, and finish_reason stays length
    qwen.engine.script('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', finish="length")
    reply = await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER])
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"city": "Par"} and reply.choices[0].finish_reason == "length"


async def test_template_without_tools_gets_the_hermes_prompt(smol: Api) -> None:
    smol.engine.script(CALL)
    messages = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
    ]
    messages.append({"role": "tool", "tool_call_id": "c1", "content": "rain"})
    reply = await smol.openai().chat.completions.create(model=smol.model, messages=messages, tools=[WEATHER])
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    prompt = smol.prompt()
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    assert "<tool_response>\nrain\n</tool_response>" in prompt and '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>' in prompt


async def test_models_list_context_and_efforts(qwen: Api, smol: Api) -> None:
    (card,) = (await qwen.openai().models.list()).data
    assert card.context_length == card.max_model_len > 0  # type: ignore[attr-defined]
    assert card.reasoning_efforts == ["none", "minimal", "low", "medium", "high", "xhigh", "max"]  # type: ignore[attr-defined]
    (card,) = (await smol.openai().models.list()).data
    assert card.reasoning_efforts == ["none"]  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as error:
        await smol.openai().chat.completions.create(model=smol.model, messages=ASK, reasoning_effort="high")
    assert error.value.body["param"] == "reasoning_effort" and "does not reason" in error.value.body["message"]


async def test_refusals_name_the_field(qwen: Api) -> None:
    base = {"model": qwen.model, "messages": ASK}
    cases = [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "code_interpreter", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"999999": 2.0}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"logit_bias": {"dog": 1}}, "logit_bias"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),
    ]
    for extra, param in cases:
        status, body = await qwen.post("/v1/chat/completions", {**base, **extra})
        assert status == 400 and body["error"]["param"] == param, (extra, body)


async def test_continuous_usage_on_every_chunk(smol: Api) -> None:
    smol.engine.script("a", "b", "c")
    stream = await smol.openai().chat.completions.create(
        model=smol.model,
        messages=ASK,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks)
    assert [c.usage.completion_tokens for c in chunks] == [0, 1, 2, 3, 3, 3]  # role, a, b, c, finish, the closing usage chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens_details.reasoning_tokens == 0
    smol.engine.script("a", "b")
    stream = await smol.openai().completions.create(
        model=smol.model,
        prompt="x",
        stream=True,
        stream_options={"continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )
    assert [c.usage.completion_tokens async for c in stream] == [1, 2, 2]


async def test_each_choice_has_its_own_parser(qwen: Api) -> None:
    qwen.engine.script(CALL).script("No call.")
    reply = await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER], n=2)
    finishes = sorted((c.finish_reason, bool(c.message.tool_calls)) for c in reply.choices)
    assert finishes == [("stop", False), ("tool_calls", True)]


async def test_openai_bookkeeping_fields_are_taken_and_what_cannot_be_honoured_is_refused_by_name(smol: Api) -> None:
    smol.engine.script("Hi")
    reply = await smol.openai().chat.completions.create(
        model=smol.model, messages=ASK, store=False, metadata={"team": "search"}, service_tier="auto", user="u-1"
    )
    assert reply.choices[0].message.content == "Hi"
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "string", "pattern": "^a(b"}}}
    cases = [
        ({"store": True}, "store", "store: true"),
        ({"service_tier": "flex"}, "service_tier", "service_tier 'flex'"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
        ({"metadata": {"k": "v" * 513}}, "metadata", "at most 512 characters"),
        ({"response_format": schema}, "response_format.json_schema.schema", "The parenthesis is not closed"),
        ({"messages": [{"role": "user", "content": [image]}]}, "messages[0].content[0].type", "'image_url' are not supported"),
    ]
    for extra, param, message in cases:
        with pytest.raises(openai.BadRequestError) as error:
            await smol.openai().chat.completions.create(**{"model": smol.model, "messages": ASK, **extra})
        assert error.value.body["param"] == param and message in error.value.body["message"], (extra, error.value.body)


def grammar_of(api: Api) -> tuple[GrammarKind, object, bool] | None:
    """The last engine request's grammar: its kind, its text (parsed where it is JSON) and strict."""
    grammar = api.engine.submits[-1].sampling.grammar
    if grammar is None:
        return None
    return grammar.kind, grammar.text if grammar.kind in (GrammarKind.REGEX, GrammarKind.EBNF) else json.loads(grammar.text), grammar.strict


async def test_response_format_carries_the_schema_the_output_must_follow_and_refuses_what_cannot_be_followed(smol: Api) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0}}, "required": ["answer"], "additionalProperties": False}
    smol.engine.script('{"answer": 4}')
    reply = await smol.openai().chat.completions.create(
        model=smol.model, messages=ASK, response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema, "strict": True}}
    )
    assert reply.choices[0].message.content == '{"answer": 4}'
    assert grammar_of(smol) == (GrammarKind.JSON_SCHEMA, schema, True)
    smol.engine.script("{}")
    await smol.openai().chat.completions.create(model=smol.model, messages=ASK, response_format={"type": "json_object"})
    assert grammar_of(smol) == (GrammarKind.JSON_SCHEMA, {"type": "object"}, False)
    smol.engine.script("x")
    await smol.openai().completions.create(model=smol.model, prompt="2+2=", extra_body={"response_format": {"type": "json_object"}})
    assert grammar_of(smol) == (GrammarKind.JSON_SCHEMA, {"type": "object"}, False)
    smol.engine.script("plain")
    await smol.openai().chat.completions.create(model=smol.model, messages=ASK, response_format={"type": "text"})
    assert grammar_of(smol) is None
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    smol.engine.script("{}")
    await smol.openai().chat.completions.create(model=smol.model, messages=ASK, response_format={"type": "json_object"}, tools=[tool])
    kind, tag, _ = grammar_of(smol)  # a call of the tool, or the answer under the format
    assert kind == GrammarKind.STRUCTURAL_TAG and tag["format"]["elements"][-1] == {
        "type": "json_schema",
        "json_schema": {"type": "object"},
        "max_whitespace_cnt": 1,
    }
    cases = [
        ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of text, json_object, json_schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs its json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": schema}}}, "response_format.json_schema.name", "1 to 64 letters"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/x"}}}},
            "response_format.json_schema.schema",
            "$defs",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "integer", "minimum": 5, "maximum": 2}}}},
            "response_format.json_schema.schema",
            "minimum greater than maximum",
        ),
    ]
    for extra, param, message in cases:
        with pytest.raises(openai.BadRequestError) as error:
            await smol.openai().chat.completions.create(**{"model": smol.model, "messages": ASK, **extra})
        assert error.value.body["param"] == param and message in error.value.body["message"], (extra, error.value.body)


async def test_bodies_and_schemas_that_nest_too_deeply_are_refused(smol: Api) -> None:
    deep = b'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"a": ' + b"[" * 100000 + b"]" * 100000 + b"}}"
    response = await smol.client.post("/v1/chat/completions", data=deep, headers={"Content-Type": "application/json"})
    assert response.status == 400 and "nests too deeply" in (await response.json())["error"]["message"]
    body = '{"model": "%s", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": %s}}}'
    text = body % (smol.model, '{"type": "array", "items": ' * 600 + '{"type": "string"}' + "}" * 600)  # a body that reads, a schema too deep to compile
    response = await smol.client.post("/v1/chat/completions", data=text.encode(), headers={"Content-Type": "application/json"})
    error = (await response.json())["error"]
    assert response.status == 400 and error["param"] == "response_format.json_schema.schema" and "nests too deeply" in error["message"]


async def test_structured_outputs_extension_carries_json_regex_choice_and_grammar_and_refuses_malformed_ones(smol: Api) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    asks = [
        ({"json": schema}, (GrammarKind.JSON_SCHEMA, schema, False)),
        ({"json": json.dumps(schema)}, (GrammarKind.JSON_SCHEMA, schema, False)),
        ({"regex": r"\d{3}"}, (GrammarKind.REGEX, r"\d{3}", False)),
        ({"choice": ["yes", 'a "quoted" no']}, (GrammarKind.EBNF, 'root ::= "yes" | "a \\"quoted\\" no"', False)),
        ({"grammar": 'root ::= "a"+'}, (GrammarKind.EBNF, 'root ::= "a"+', False)),
        ({"json_object": True}, (GrammarKind.JSON_SCHEMA, {"type": "object"}, False)),
        ({"choice": ["a"], "regex": None, "json_object": None}, (GrammarKind.EBNF, 'root ::= "a"', False)),  # null: not asked for
    ]
    for structured, expected in asks:
        smol.engine.script("x")
        await smol.openai().chat.completions.create(model=smol.model, messages=ASK, extra_body={"structured_outputs": structured})
        assert grammar_of(smol) == expected, structured
        smol.engine.script("x")
        await smol.openai().completions.create(model=smol.model, prompt="2+2=", extra_body={"structured_outputs": structured})
        assert grammar_of(smol) == expected, structured
    submitted = len(smol.engine.submits)
    cases = [
        ({"regex": "a(b"}, "structured_outputs.regex", "The parenthesis is not closed"),
        ({"grammar": "root ::= missing"}, "structured_outputs.grammar", 'Rule "missing" is not defined'),
        ({"json": {"type": "strin"}}, "structured_outputs.json", 'Unsupported type "strin"'),
        ({"json": "{not json"}, "structured_outputs.json", "not valid JSON"),
        ({"choice": []}, "structured_outputs.choice", "non-empty list"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
        ({"regex": None}, "structured_outputs", "exactly one"),
        ({"json_object": False}, "structured_outputs.json_object", "must be true"),
        ({"whitespace_pattern": " "}, "structured_outputs.whitespace_pattern", "not supported"),
    ]
    for structured, param, message in cases:
        for call in (
            smol.openai().chat.completions.create(model=smol.model, messages=ASK, extra_body={"structured_outputs": structured}),
            smol.openai().completions.create(model=smol.model, prompt="x", extra_body={"structured_outputs": structured}),
        ):
            with pytest.raises(openai.BadRequestError) as error:
                await call
            assert error.value.body["param"] == param and message in error.value.body["message"], (structured, error.value.body)
    with pytest.raises(openai.BadRequestError) as error:
        await smol.openai().chat.completions.create(
            model=smol.model, messages=ASK, response_format={"type": "json_object"}, extra_body={"structured_outputs": {"regex": "a"}}
        )
    assert error.value.body["param"] == "structured_outputs"
    assert len(smol.engine.submits) == submitted  # nothing was queued


async def test_tool_choice_required_or_named_holds_the_answer_to_one_call_and_strict_tools_their_arguments(smol: Api, qwen: Api) -> None:
    clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
    strict_clock = {"type": "function", "function": {**clock["function"], "strict": True}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    smol.engine.script(call)
    reply = await smol.openai().chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, strict_clock], tool_choice="required")
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    kind, tag, _ = grammar_of(smol)  # SmolLM2 is prompted in Hermes' format
    assert kind == GrammarKind.STRUCTURAL_TAG and tag["format"]["type"] == "or"
    weather, clock_call = tag["format"]["elements"]
    assert weather["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": ' and weather["end"] == "}\n</tool_call>"
    assert weather["content"]["json_schema"] == {"type": "object"}  # not strict: any object
    assert clock_call["content"]["json_schema"] == clock["function"]["parameters"]  # strict: its parameters
    smol.engine.script(call)
    await smol.openai().chat.completions.create(
        model=smol.model, messages=ASK, tools=[WEATHER, clock], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert grammar_of(smol)[1]["format"]["begin"] == '<tool_call>\n{"name": "get_time", "arguments": '
    smol.engine.script("Sunny.")
    await smol.openai().chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, clock], tool_choice="auto")
    assert grammar_of(smol) is None  # auto, nothing strict: free text
    smol.engine.script("Sunny.")
    await smol.openai().chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, strict_clock], tool_choice="auto")
    kind, tag, _ = grammar_of(smol)  # auto with a strict tool: text stays free, a call follows its tool
    assert tag["format"]["type"] == "triggered_tags" and tag["format"]["triggers"] == ['<tool_call>\n{"name": ']
    qwen.engine.script(call)
    await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER], tool_choice="required")
    sampling = qwen.engine.submits[-1].sampling  # it thinks first: the call is held from the end of its reasoning on
    assert sampling.grammar.kind == GrammarKind.STRUCTURAL_TAG and sampling.grammar_after == qwen.state.prompts.tokenizer.encode(
        "</think>", add_special_tokens=False
    )
    qwen.engine.script(call)
    await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, tools=[WEATHER], tool_choice="required", reasoning_effort="none")
    assert qwen.engine.submits[-1].sampling.grammar is not None and qwen.engine.submits[-1].sampling.grammar_after == []
    bad = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as error:
        await smol.openai().chat.completions.create(model=smol.model, messages=ASK, tools=[WEATHER, bad])
    assert error.value.body["param"] == "tools[1]" and 'Unsupported type "strin"' in error.value.body["message"]


async def test_response_format_with_a_reasoning_model_holds_the_answer_after_its_reasoning(qwen: Api) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    qwen.engine.script('<think>hmm</think>{"a": 1}')
    reply = await qwen.openai().chat.completions.create(
        model=qwen.model, messages=ASK, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    )
    assert reply.choices[0].message.content == '{"a": 1}'
    assert qwen.engine.submits[-1].sampling.grammar_after == qwen.state.prompts.tokenizer.encode("</think>", add_special_tokens=False)
