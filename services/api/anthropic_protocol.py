"""Anthropic Messages request bodies, and their validation into a ``Generation`` and a ``ChatTurn``.

Content blocks map onto chat-template messages: text joins the turn's content, a
``tool_use`` becomes an assistant tool call, a ``tool_result`` a ``tool`` message, a
``thinking`` block the assistant's ``reasoning_content``. A final assistant message is a
prefill that the answer continues.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, ClassVar

import msgspec

from services.api.chat import ChatTurn
from services.api.errors import ApiError
from services.api.protocol import (
    INT64,
    MAX_STOP_STRINGS,
    MAX_TOKENS,
    MAX_TOOL_NAME,
    TOOL_NAME,
    Generation,
    check,
    check_max_tokens,
    check_model,
    check_sampling,
    check_stops,
    convert_part,
    schema,
    unsupported,
    when,
)
from services.api.reasoning import check_effort
from services.api.structured_outputs import anthropic_output_format
from services.api.tools import ToolChoice, ToolSpec, check_tools, template_call


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    REQUIRED: ClassVar[tuple[str, ...]] = ()  # see services.api.protocol._Body
    RULES: ClassVar[tuple[dict[str, Any], ...]] = ()


class CacheControl(_Body):
    type: str
    ttl: str | None = None


class TextBlock(_Body):
    type: Annotated[str, schema(const="text")]
    text: str
    cache_control: CacheControl | None = None  # accepted: the prefix cache is automatic
    citations: Annotated[list[Any] | None, schema(maxItems=0)] = None


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


class ToolUseBlock(_Body):
    type: Annotated[str, schema(const="tool_use")]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Body):
    type: Annotated[str, schema(const="tool_result")]
    tool_use_id: str
    content: Annotated[str | list[dict[str, Any]] | None, schema(items=_ref("TextBlock"))] = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Body):
    type: Annotated[str, schema(const="thinking")]
    thinking: str
    signature: str | None = None


class AnthropicMessage(_Body):
    RULES = (  # the blocks each role may send
        {
            "if": {"properties": {"role": {"const": "user"}}},
            "then": {"properties": {"content": {"items": {"anyOf": [_ref("TextBlock"), _ref("ToolResultBlock")]}}}},
            "else": {"properties": {"content": {"items": {"anyOf": [_ref("TextBlock"), _ref("ThinkingBlock"), _ref("ToolUseBlock")]}}}},
        },
    )

    role: Annotated[str, schema(enum=["user", "assistant"])]
    content: str | list[dict[str, Any]]


class AnthropicTool(_Body):
    name: Annotated[str, schema(minLength=1, maxLength=MAX_TOOL_NAME, pattern=TOOL_NAME)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Annotated[str | None, schema(enum=["custom", None])] = None
    cache_control: CacheControl | None = None
    strict: bool | None = None  # true: a call's input is held to input_schema


class AnthropicToolChoice(_Body):
    RULES = (when({"type": {"const": "tool"}}, {"properties": {"name": {"type": "string", "minLength": 1}}, "required": ["name"]}),)

    type: Annotated[str, schema(enum=["auto", "any", "tool", "none"])]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Body):
    RULES = (when({"type": {"const": "enabled"}}, {"properties": {"budget_tokens": {"type": "integer", "minimum": 1024}}, "required": ["budget_tokens"]}),)

    type: Annotated[str, schema("thinking", enum=["enabled", "disabled", "adaptive"])]
    budget_tokens: int | None = None
    display: Annotated[str | None, schema(enum=["summarized", "omitted", None])] = None


_OUTPUT_FORMAT = {"properties": {"type": {"const": "json_schema"}, "schema": {}}, "required": ["type", "schema"], "additionalProperties": False}


class OutputConfig(_Body):
    effort: Annotated[str | None, schema("effort")] = None
    format: Annotated[dict[str, Any] | None, schema(**_OUTPUT_FORMAT)] = None


class Metadata(_Body):
    user_id: str | None = None


_NEEDS_TOOLS = {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}


class _MessagesBody(_Body):
    REQUIRED = ("model", "messages")
    RULES = (
        when({"tool_choice": {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}}}, _NEEDS_TOOLS),
        {
            "anyOf": [
                {"properties": {"system": {"minLength": 1, "minItems": 1, "type": ["string", "array"]}}, "required": ["system"]},
                {"properties": {"messages": {"contains": {"not": {"properties": {"role": {"const": "user"}, "content": {"maxItems": 0}}}}}}},
            ]
        },
    )

    model: Annotated[str | None, schema("model")] = None
    # something for the template to render: a system prompt, or a message that is more than an empty list of blocks
    messages: Annotated[list[AnthropicMessage], schema(minItems=1)] = []
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class MessagesRequest(_MessagesBody):
    REQUIRED = ("model", "messages", "max_tokens")

    max_tokens: Annotated[int | None, MAX_TOKENS] = None
    stop_sequences: Annotated[list[str] | None, schema(maxItems=MAX_STOP_STRINGS, items={"minLength": 1})] = None
    temperature: Annotated[float | None, schema(minimum=0, maximum=1)] = None
    top_p: Annotated[float | None, schema(exclusiveMinimum=0, maximum=1)] = None
    top_k: Annotated[int | None, schema(minimum=-1, maximum=INT64[1])] = None
    metadata: Metadata | None = None
    service_tier: Annotated[str | None, schema(enum=["auto", "standard_only", None])] = None
    stream: bool = False


class CountTokensRequest(_MessagesBody):
    pass


_BUDGET_EFFORTS = ((4096, "low"), (16384, "medium"))  # budget_tokens up to each bound -> effort; above: high


def validate_messages(body: MessagesRequest, served_model: str, efforts: tuple[str, ...]) -> tuple[Generation, ChatTurn]:
    check_model(body.model, served_model)
    check(body.max_tokens is not None, "max_tokens", "max_tokens: Field required")
    check_max_tokens(body.max_tokens, "max_tokens")
    check(
        body.service_tier in (None, "auto", "standard_only"),
        "service_tier",
        f"service_tier must be auto or standard_only, got {body.service_tier!r}",
    )  # both are served at the one (standard) tier here
    check(body.temperature is None or 0.0 <= body.temperature <= 1.0, "temperature", f"temperature must be between 0 and 1, got {body.temperature}")
    generation = Generation(
        model=served_model,
        n=1,
        stream=body.stream,
        include_usage=False,
        max_tokens=body.max_tokens,
        sampling=check_sampling(body.temperature, body.top_p, body.top_k),
        stop=check_stops(body.stop_sequences, "stop_sequences"),
    )
    turn = turn_of(body, efforts)
    grammar, param = anthropic_output_format(body.output_config.format if body.output_config else None)
    if grammar is None:
        return generation, turn
    return replace(generation, sampling=msgspec.structs.replace(generation.sampling, grammar=grammar), grammar_param=param), turn


def turn_of(body: _MessagesBody, efforts: tuple[str, ...]) -> ChatTurn:
    """The chat turn of a messages or count_tokens request."""
    check(len(body.messages) > 0, "messages", "messages: at least one message is required")
    tools = [_tool(tool, i) for i, tool in enumerate(body.tools or [])]
    choice = _tool_choice(body.tool_choice, bool(tools))
    check_tools(tools, choice, "tools", "tool_choice")
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _system_text(body.system)
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages += _messages(message, f"messages[{i}]")
    last = body.messages[-1]
    prefill = last.role == "assistant" and not messages[-1].get("tool_calls")
    effort = _effort(body, efforts)
    anthropic_output_format(body.output_config.format if body.output_config else None)  # count_tokens refuses a format that messages would refuse, too
    return ChatTurn(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        effort=effort,
        add_generation_prompt=not prefill,
        continue_final=prefill,
    )


def _effort(body: _MessagesBody, efforts: tuple[str, ...]) -> str | None:
    """The reasoning effort: ``output_config.effort`` if given, else from ``thinking``.

    ``disabled`` is effort ``none``; ``enabled`` maps ``budget_tokens`` to an effort (a hint
    to the template, not a hard cap: only ``max_tokens`` bounds the answer); ``adaptive``
    lets the model decide, at ``medium``. ``display: omitted`` withholds the thinking text
    (the route sends empty thinking blocks); ``summarized`` shows it whole, since nothing
    summarizes it.
    """
    effort = body.output_config.effort if body.output_config else None
    thinking = body.thinking
    if thinking is None:
        return check_effort(effort, efforts, "output_config.effort")
    check(thinking.type in ("enabled", "disabled", "adaptive"), "thinking.type", f"thinking.type must be enabled, disabled or adaptive, got {thinking.type!r}")
    check(thinking.display in (None, "summarized", "omitted"), "thinking.display", f"thinking.display must be summarized or omitted, got {thinking.display!r}")
    if thinking.type == "disabled":
        return check_effort("none", efforts, "thinking")
    if efforts == ("none",):  # not an effort this model lacks: it has no thinking at all
        raise ApiError(
            400,
            f"this model does not reason, so thinking of type {thinking.type!r} cannot be honoured; send type 'disabled' or leave thinking out",
            param="thinking",
        )
    if thinking.type == "enabled":
        check(thinking.budget_tokens is not None, "thinking.budget_tokens", "thinking.budget_tokens: Field required")
        budget = thinking.budget_tokens or 0
        check(budget >= 1024, "thinking.budget_tokens", f"thinking.budget_tokens must be at least 1024, got {budget}")
        max_tokens = getattr(body, "max_tokens", None)
        check(
            max_tokens is None or budget < max_tokens,
            "thinking.budget_tokens",
            f"thinking.budget_tokens ({budget}) must be less than max_tokens ({max_tokens})",
        )
        effort = effort or next((name for bound, name in _BUDGET_EFFORTS if budget <= bound), "high")
    return check_effort(effort or "medium", efforts, "thinking")


def _tool(tool: AnthropicTool, index: int) -> ToolSpec:
    where = f"tools[{index}]"
    check(tool.type in (None, "custom"), f"{where}.type", f"tools of type {tool.type!r} are not supported; only custom tools")
    return ToolSpec(tool.name, tool.description or "", tool.input_schema, strict=bool(tool.strict))


def _tool_choice(choice: AnthropicToolChoice | None, has_tools: bool) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if has_tools else "none")
    parallel = not choice.disable_parallel_tool_use
    modes = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
    check(choice.type in modes, "tool_choice.type", f"tool_choice.type must be auto, any, tool or none, got {choice.type!r}")
    if choice.type == "tool":
        check(bool(choice.name), "tool_choice.name", "tool_choice of type 'tool' needs a name")
    return ToolChoice(modes[choice.type], choice.name or "", parallel)  # type: ignore[arg-type]


def _system_text(blocks: list[TextBlock]) -> str:
    for j, block in enumerate(blocks):
        check(block.type == "text", f"system[{j}].type", f"system blocks must be text, got {block.type!r}")
        unsupported(not block.citations, f"system[{j}].citations", "citations")
    return "\n\n".join(block.text for block in blocks)


def _messages(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as one or more template messages (tool results become tool messages)."""
    check(message.role in ("user", "assistant"), f"{where}.role", f"role must be user or assistant, got {message.role!r}")
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        return [_assistant(message.content, where)]
    out: list[dict[str, Any]] = []
    for j, raw in enumerate(message.content):
        at, kind = f"{where}.content[{j}]", _block_type(raw, f"{where}.content[{j}]")
        if kind == "text":
            text = _text(raw, at)
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n\n" + text
            else:
                out.append({"role": "user", "content": text})
        elif kind == "tool_result":
            result: ToolResultBlock = convert_part(raw, ToolResultBlock, at)
            content = result.content if isinstance(result.content, str) or result.content is None else _texts(result.content, f"{at}.content")
            content = content or ""
            out.append({"role": "tool", "tool_call_id": result.tool_use_id, "content": f"Error: {content}" if result.is_error else content})
        else:
            raise ApiError(400, f"{at}: blocks of type {kind!r} are not supported in user messages; use text or tool_result", param=f"{at}.type")
    return out


def _assistant(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for j, raw in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", _block_type(raw, f"{where}.content[{j}]")
        if kind == "text":
            texts.append(_text(raw, at))
        elif kind == "thinking":
            reasoning.append(convert_part(raw, ThinkingBlock, at).thinking)
        elif kind == "tool_use":
            use: ToolUseBlock = convert_part(raw, ToolUseBlock, at)
            calls.append(template_call(use.id, use.name, use.input))
        else:
            raise ApiError(400, f"{at}: blocks of type {kind!r} are not supported in assistant messages; use text, thinking or tool_use", param=f"{at}.type")
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        out["reasoning_content"] = "\n".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _block_type(raw: Any, where: str) -> str:
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ApiError(400, f"{where} must be a content block with a type", param=where)
    return raw["type"]


def _text(raw: dict[str, Any], where: str) -> str:
    block: TextBlock = convert_part(raw, TextBlock, where)
    unsupported(not block.citations, f"{where}.citations", "citations")
    return block.text


def _texts(blocks: list[dict[str, Any]], where: str) -> str:
    parts = []
    for j, raw in enumerate(blocks):
        kind = _block_type(raw, f"{where}[{j}]")
        check(kind == "text", f"{where}[{j}].type", f"tool results may hold text blocks only, got {kind!r}")
        parts.append(_text(raw, f"{where}[{j}]"))
    return "\n\n".join(parts)
