"""OpenAI Responses request bodies (stateless), and their validation into a ``Generation`` and a ``ChatTurn``.

Nothing is stored: ``store`` may be false or left out, and whatever needs a stored
response (``previous_response_id``, ``background``, ``conversation``, item references)
is refused with a 400 that names the field.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from services.api.chat import ChatTurn
from services.api.errors import ApiError
from services.api.protocol import (
    JSON_SCHEMA_SPEC,
    LOGPROBS,
    MAX_TOKENS,
    MAX_TOOL_NAME,
    METADATA,
    NULL_OR_FALSE,
    SERVICE_TIER,
    TOOL_CHOICE_MODES,
    TOOL_NAME,
    Generation,
    check,
    check_logprobs,
    check_max_tokens,
    check_metadata,
    check_model,
    check_sampling,
    check_service_tier,
    convert_part,
    schema,
    unsupported,
    when,
)
from services.api.reasoning import check_effort
from services.api.structured_outputs import json_schema_of
from services.api.tools import ToolChoice, ToolSpec, check_tools, template_call

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` item served: logprobs on output text


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    REQUIRED: ClassVar[tuple[str, ...]] = ()  # see services.api.protocol._Body
    RULES: ClassVar[tuple[dict[str, Any], ...]] = ()


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _typed(kind: str, name: str) -> dict[str, Any]:
    """An item of type ``kind`` (a dispatch on ``type``) has the shape of the struct ``name``."""
    return {"if": {"type": "object", "properties": {"type": {"const": kind}}, "required": ["type"]}, "then": _ref(name)}


_ITEM_TYPES = ["message", "function_call", "function_call_output", "reasoning"]
_INPUT_ITEM = {
    "type": "object",
    "properties": {"type": {"enum": _ITEM_TYPES}},
    "allOf": [
        {"if": {"not": {"required": ["type"]}}, "then": _ref("MessageItem")},
        _typed("message", "MessageItem"),
        _typed("function_call", "FunctionCallItem"),
        _typed("function_call_output", "FunctionCallOutputItem"),
        _typed("reasoning", "ReasoningItem"),
    ],
}
_NOT_REASONING = {"not": {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}}


class ReasoningConfig(_Body):
    effort: Annotated[str | None, schema("effort")] = None
    summary: str | None = None  # accepted; no summary is generated (the reasoning item carries the full text)


class TextFormat(_Body):
    # as on chat, but a null schema is the default one here
    RULES = (
        when(
            {"type": {"const": "json_schema"}},
            JSON_SCHEMA_SPEC | {"properties": JSON_SCHEMA_SPEC["properties"] | {"schema": {"type": ["object", "boolean", "null"]}}},
        ),
    )

    type: Annotated[str, schema(enum=["text", "json_object", "json_schema"])]
    name: str | None = None  # json_schema: the schema's name, the schema, and whether to follow it strictly
    schema: dict[str, Any] | bool | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Annotated[str | None, schema(type="null")] = None


class ResponsesRequest(_Body):
    REQUIRED = ("model", "input")
    RULES = (
        when({"tool_choice": {"enum": ["required"]}}, {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}),
        when({"tool_choice": {"type": "object"}}, {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}),
        {  # something to answer: instructions, or an input item that is more than reasoning
            "anyOf": [
                {"properties": {"instructions": {"type": "string", "minLength": 1}}, "required": ["instructions"]},
                {"properties": {"input": {"anyOf": [{"type": "string"}, {"type": "array", "contains": _NOT_REASONING}]}}},
            ]
        },
    )

    model: Annotated[str | None, schema("model")] = None
    input: Annotated[str | list[dict[str, Any]] | None, schema(items=_INPUT_ITEM)] = None
    instructions: str | None = None
    max_output_tokens: Annotated[int | None, MAX_TOKENS] = None
    temperature: Annotated[float | None, schema(minimum=0, maximum=2)] = None
    top_p: Annotated[float | None, schema(exclusiveMinimum=0, maximum=1)] = None
    tools: Annotated[list[dict[str, Any]] | None, schema(items=_ref("FunctionTool"))] = None
    tool_choice: Annotated[
        str | dict[str, Any] | None,
        schema(
            **{"if": {"type": "string"}, "then": {"enum": TOOL_CHOICE_MODES}},
            properties={"type": {"const": "function"}, "name": {"type": "string"}},
            required=["type", "name"],
            additionalProperties=False,
        ),
    ] = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: Annotated[bool | None, NULL_OR_FALSE] = None
    previous_response_id: Annotated[str | None, schema(maxLength=0)] = None
    background: Annotated[bool | None, NULL_OR_FALSE] = None
    conversation: Annotated[str | dict[str, Any] | None, schema(type="null")] = None
    include: Annotated[list[str] | None, schema(items={"const": OUTPUT_LOGPROBS})] = None
    metadata: Annotated[dict[str, str] | None, METADATA] = None
    service_tier: Annotated[str | None, SERVICE_TIER] = None
    text: TextConfig | None = None
    truncation: Annotated[str | None, schema(enum=["disabled", None])] = None
    top_logprobs: Annotated[int | None, LOGPROBS] = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a hint; the prefix cache is automatic


class InputText(_Body):
    type: Annotated[str, schema(enum=["input_text", "output_text"])]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


_TEXT_PART = {"if": {"type": "object", "properties": {"type": {"const": "refusal"}}, "required": ["type"]}, "else": _ref("InputText")}


class MessageItem(_Body):
    RULES = (  # the content parts each role may send
        {
            "if": {"properties": {"role": {"const": "assistant"}}},
            "then": {
                "properties": {
                    "content": {"items": {"type": "object", "properties": {"type": {"enum": ["output_text", "refusal"]}}, "required": ["type"], **_TEXT_PART}}
                }
            },
            "else": {
                "properties": {"content": {"items": {"type": "object", "properties": {"type": {"const": "input_text"}}, "required": ["type"], **_TEXT_PART}}}
            },
        },
    )

    role: Annotated[str, schema(enum=["user", "system", "developer", "assistant"])]
    content: str | list[dict[str, Any]]
    type: Annotated[str, schema(const="message")] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(_Body):
    type: Annotated[str, schema(const="function_call")]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Annotated[str, schema(const="function_call_output")]
    call_id: str
    output: Annotated[str | list[dict[str, Any]], schema(items=_ref("InputText") | {"properties": {"type": {"const": "input_text"}}})]
    id: str | None = None
    status: str | None = None


class ReasoningItem(_Body):
    type: Annotated[str, schema(const="reasoning")]
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    id: str | None = None
    encrypted_content: Annotated[str | None, schema(type="null")] = None
    status: str | None = None


class FunctionTool(_Body):
    type: Annotated[str, schema(const="function")]
    name: Annotated[str, schema(minLength=1, maxLength=MAX_TOOL_NAME, pattern=TOOL_NAME)]
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # true: a call's arguments are held to the parameters


_PART_TYPES = {"user": ("input_text",), "system": ("input_text",), "developer": ("input_text",), "assistant": ("output_text", "refusal")}


def validate_responses(body: ResponsesRequest, served_model: str, efforts: tuple[str, ...]) -> tuple[Generation, ChatTurn]:
    check_model(body.model, served_model)
    check(body.input is not None, "input", "you must provide an input")
    unsupported(not body.previous_response_id, "previous_response_id", "previous_response_id (this server stores no responses; send the whole conversation)")
    unsupported(not body.background, "background", "background responses (this server stores no responses)")
    unsupported(body.store is not True, "store", "store: true (this server stores no responses; send store: false or leave it out)")
    unsupported(body.conversation is None, "conversation", "conversations (this server stores no responses)")
    unsupported(all(item == OUTPUT_LOGPROBS for item in body.include or []), "include", f"include {body.include} (only {OUTPUT_LOGPROBS!r})")
    check_logprobs(body.top_logprobs, "top_logprobs")
    logprobs = (body.top_logprobs or 0) if OUTPUT_LOGPROBS in (body.include or []) or body.top_logprobs is not None else None
    unsupported(body.truncation in (None, "disabled"), "truncation", f"truncation {body.truncation!r}")
    check_metadata(body.metadata)
    check_service_tier(body.service_tier)
    grammar, grammar_param = None, ""
    if body.text is not None:
        if (text_format := body.text.format) is not None:
            spec = {"name": text_format.name, "strict": text_format.strict} | ({} if text_format.schema is None else {"schema": text_format.schema})
            grammar, grammar_param = json_schema_of(text_format.type, spec, "text.format", "text.format")
        unsupported(body.text.verbosity is None, "text.verbosity", "text.verbosity")
    check_max_tokens(body.max_output_tokens, "max_output_tokens")
    generation = Generation(
        model=served_model,
        n=1,
        stream=body.stream,
        include_usage=False,
        max_tokens=body.max_output_tokens,
        sampling=msgspec.structs.replace(check_sampling(body.temperature, body.top_p, None), logprobs=logprobs, grammar=grammar),
        max_tokens_param="max_output_tokens",
        grammar_param=grammar_param,
    )
    tools = [_tool(tool, i) for i, tool in enumerate(body.tools or [])]
    choice = _tool_choice(body.tool_choice, bool(tools), body.parallel_tool_calls)
    check_tools(tools, choice, "tools", "tool_choice")
    messages = _input_messages(body.input)  # type: ignore[arg-type]
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    check(bool(messages), "input", "input must not be empty")
    effort = check_effort(body.reasoning.effort if body.reasoning else None, efforts, "reasoning.effort")
    return generation, ChatTurn(messages=messages, tools=tools, tool_choice=choice, effort=effort)


def _tool(raw: dict[str, Any], index: int) -> ToolSpec:
    where = f"tools[{index}]"
    check(raw.get("type") == "function", f"{where}.type", f"tools of type {raw.get('type')!r} are not supported; only 'function'")
    tool: FunctionTool = convert_part(raw, FunctionTool, where)
    return ToolSpec(tool.name, tool.description or "", tool.parameters, strict=bool(tool.strict))


def _tool_choice(raw: str | dict[str, Any] | None, has_tools: bool, parallel: bool | None) -> ToolChoice:
    parallel = True if parallel is None else parallel
    if raw is None:
        return ToolChoice("auto" if has_tools else "none", parallel=parallel)
    if isinstance(raw, dict):
        check(
            raw.get("type") == "function" and isinstance(raw.get("name"), str),
            "tool_choice",
            'tool_choice must name a function: {"type": "function", "name": ...}',
        )
        check(set(raw) <= {"type", "name"}, "tool_choice", f"unknown fields in tool_choice: {sorted(set(raw) - {'type', 'name'})}")
        return ToolChoice("named", raw["name"], parallel)
    check(raw in ("none", "auto", "required"), "tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, got {raw!r}")
    return ToolChoice(raw, parallel=parallel)  # type: ignore[arg-type]


def tool_choice_echo(choice: ToolChoice) -> str | dict[str, str]:
    return {"type": "function", "name": choice.name} if choice.mode == "named" else choice.mode


def _input_messages(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat-template messages; calls join the assistant turn before them, reasoning the one after."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            message: MessageItem = convert_part(item, MessageItem, where)
            messages.append(_message(message, where, reasoning))
            reasoning = []
        elif kind == "function_call":
            call: FunctionCallItem = convert_part(item, FunctionCallItem, where)
            entry = template_call(call.call_id, call.name, call.arguments)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(entry)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [entry]} | _reasoning(reasoning))
                reasoning = []
        elif kind == "function_call_output":
            output: FunctionCallOutputItem = convert_part(item, FunctionCallOutputItem, where)
            text = output.output if isinstance(output.output, str) else _parts_text(output.output, ("input_text",), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": output.call_id, "content": text})
        elif kind == "reasoning":
            item_reasoning: ReasoningItem = convert_part(item, ReasoningItem, where)
            unsupported(item_reasoning.encrypted_content is None, f"{where}.encrypted_content", "encrypted reasoning")
            parts = item_reasoning.content or item_reasoning.summary
            reasoning.append("".join(str(p.get("text", "")) for p in parts))
        else:
            raise ApiError(
                400, f"input items of type {kind!r} are not supported; use message, function_call, function_call_output or reasoning", param=f"{where}.type"
            )
    return messages


def _reasoning(parts: list[str]) -> dict[str, str]:
    return {"reasoning_content": "\n".join(parts)} if parts else {}


def _message(message: MessageItem, where: str, reasoning: list[str]) -> dict[str, Any]:
    check(message.role in _PART_TYPES, f"{where}.role", f"unknown role {message.role!r}; expected user, system, developer or assistant")
    content = message.content if isinstance(message.content, str) else _parts_text(message.content, _PART_TYPES[message.role], f"{where}.content")
    out = {"role": "system" if message.role == "developer" else message.role, "content": content}
    if message.role == "assistant":
        out |= _reasoning(reasoning)
    return out


def _parts_text(parts: list[dict[str, Any]], accepted: tuple[str, ...], where: str) -> str:
    texts = []
    for j, raw in enumerate(parts):
        kind = raw.get("type") if isinstance(raw, dict) else None
        check(kind in accepted, f"{where}[{j}].type", f"content parts of type {kind!r} are not supported here; expected {' or '.join(accepted)}")
        if kind == "refusal":
            texts.append(str(raw.get("refusal", "")))
            continue
        part: InputText = convert_part(raw, InputText, f"{where}[{j}]")
        texts.append(part.text)
    return "".join(texts)
