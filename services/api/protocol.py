"""OpenAI request bodies as msgspec structs, and their validation into one internal request.

Unknown fields are refused (as the OpenAI API does) and every accepted field is honoured
or refused with a 400 that names it: nothing is silently ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar

import msgspec
from aiohttp import web

from services.api.chat import ChatTurn
from services.api.errors import ApiError, from_validation_error
from services.api.reasoning import check_effort
from services.api.structured_outputs import json_schema_of, structured_outputs_of
from services.api.tools import ToolChoice, ToolSpec, check_tools, template_call
from shared.frames import SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16
MAX_BATCH_CHOICES = MAX_CHOICES * 4  # prompts times n on one completions request
DEFAULT_COMPLETION_TOKENS = 16  # a completion's max_tokens when it sends none (OpenAI's default)
MAX_LOGPROBS = 20  # most alternatives per token (vLLM's default max_logprobs; OpenAI's chat limit)
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_LOGIT_BIAS = 1024  # entries; they travel with the request to the worker
INT64 = (-(2**63), 2**63 - 1)  # integers that travel to the engine: its frames carry no wider ones
MAX_TOOL_NAME = 128
# what check_tools accepts: no spaces (as str.isspace has them, which regular expressions' \s does not), quotes or angle brackets
TOOL_NAME = "^[^" + "".join(f"\\u{c:04x}" for c in range(0x10000) if chr(c).isspace()) + "<>\"']+$"
TOKEN_ID_KEY = re.compile(r"[0-9]+")  # a logit_bias key: a token id in decimal


def schema(served: str | None = None, **keywords: Any) -> msgspec.Meta:
    """The JSON Schema keywords /openapi.json states for a field: the bounds its check enforces. ``served`` names a
    bound that comes from the served model and configuration, filled in at start (see services.api.openapi)."""
    return msgspec.Meta(extra_json_schema=keywords | ({"x-served": served} if served else {}))


NULL_OR_FALSE = schema(enum=[False, None])  # a flag that asks for what this server does not do
MAX_TOKENS = schema("max_tokens", minimum=1)
METADATA = schema(
    maxProperties=MAX_METADATA_PAIRS,
    propertyNames={"maxLength": MAX_METADATA_KEY},
    additionalProperties={"type": "string", "maxLength": MAX_METADATA_VALUE},
)
SERVICE_TIER = schema(enum=["auto", "default", None])
LOGPROBS = schema(minimum=0, maximum=MAX_LOGPROBS)
TOOL_CHOICE_MODES = ["none", "auto", "required"]
_STRUCTURED_KINDS = {  # vLLM's structured_outputs: a kind left out or null is not asked for
    "json": {"type": ["object", "boolean", "string", "null"]},
    "regex": {"type": ["string", "null"], "minLength": 1},
    "choice": {"type": ["array", "null"], "minItems": 1, "items": {"type": "string", "minLength": 1}},
    "grammar": {"type": ["string", "null"], "minLength": 1},
    "json_object": {"enum": [True, None]},
    "structural_tag": {"type": ["object", "string", "null"]},
}
STRUCTURED_OUTPUTS = schema(  # exactly one kind not null; that it parses is xgrammar's check
    additionalProperties=False,
    properties=_STRUCTURED_KINDS,
    oneOf=[{"properties": {kind: {"not": {"type": "null"}}}, "required": [kind]} for kind in _STRUCTURED_KINDS],
)


def when(condition: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """``then`` holds wherever the fields in ``condition`` are present and match it."""
    return {"if": {"properties": condition, "required": sorted(condition)}, "then": then}


def present(name: str) -> dict[str, Any]:
    """A condition on ``name``: sent, and not null."""
    return {name: {"not": {"type": "null"}}}


class _Body(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A request body. ``REQUIRED`` and ``RULES`` are what /openapi.json says beyond the fields' own types: the fields
    the validation below refuses to go without, and the rules across fields it enforces (JSON Schema, all must hold)."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()
    RULES: ClassVar[tuple[dict[str, Any], ...]] = ()


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(_Body):
    """A message's content part. Only text is read; the other OpenAI kinds parse, to be refused by name."""

    type: Annotated[str, schema(const="text")]
    text: str = ""
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    refusal: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ChatToolCall(_Body):
    id: str
    function: FunctionCall
    type: Annotated[str, schema(const="function")] = "function"


class ChatMessage(_Body):
    RULES = (
        {"if": {"properties": {"role": {"const": "assistant"}}}, "else": {"properties": {"tool_calls": {"type": ["array", "null"], "maxItems": 0}}}},
        {"if": {"properties": {"role": {"const": "assistant"}}}, "else": {"properties": {"reasoning_content": {"type": "null"}}}},
        {
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {"properties": {"tool_call_id": {"type": "string", "minLength": 1}}, "required": ["tool_call_id"]},
            "else": {"properties": {"tool_call_id": {"type": "null"}}},
        },
    )

    role: Annotated[str, schema(enum=["system", "developer", "user", "assistant", "tool"])]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ChatToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: which call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that show it


class FunctionDef(_Body):
    name: Annotated[str, schema(minLength=1, maxLength=MAX_TOOL_NAME, pattern=TOOL_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # true: a call's arguments are held to the parameters


class ChatTool(_Body):
    type: Annotated[str, schema(const="function")]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Annotated[str, schema(const="function")]
    function: NamedFunction


JSON_SCHEMA_SPEC = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,64}$"},
        "strict": {"type": ["boolean", "null"]},
        "schema": {"type": ["object", "boolean"]},
    },
    "required": ["name"],
}


class ResponseFormat(_Body):
    RULES = (when({"type": {"const": "json_schema"}}, {"properties": {"json_schema": JSON_SCHEMA_SPEC}, "required": ["json_schema"]}),)

    type: Annotated[str, schema(enum=["text", "json_object", "json_schema"])]
    json_schema: dict[str, Any] | None = None  # parsed so that the type is what a refusal names


class _SamplingBody(_Body):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI plus vLLM extras)."""

    REQUIRED = ("model",)
    RULES = (when(present("stream_options"), {"properties": {"stream": {"const": True}}, "required": ["stream"]}),)

    model: Annotated[str | None, schema("model")] = None
    max_tokens: Annotated[int | None, MAX_TOKENS] = None
    temperature: Annotated[float | None, schema(minimum=0, maximum=2)] = None
    top_p: Annotated[float | None, schema(exclusiveMinimum=0, maximum=1)] = None
    top_k: Annotated[int | None, schema(minimum=-1, maximum=INT64[1])] = None
    min_p: Annotated[float | None, schema(minimum=0, maximum=1)] = None
    seed: Annotated[int | None, schema(minimum=INT64[0], maximum=INT64[1] - MAX_CHOICES)] = None
    stop: Annotated[str | list[str] | None, schema(minLength=1, maxItems=MAX_STOP_STRINGS, items={"minLength": 1})] = None
    stop_token_ids: Annotated[list[int] | None, schema(items={"minimum": INT64[0], "maximum": INT64[1]})] = None
    n: Annotated[int, schema(minimum=1, maximum=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, schema(minimum=0, maximum=INT64[1])] = 0
    skip_special_tokens: bool = True
    presence_penalty: Annotated[float, schema(minimum=-2, maximum=2)] = 0.0
    frequency_penalty: Annotated[float, schema(minimum=-2, maximum=2)] = 0.0
    repetition_penalty: Annotated[float, schema(exclusiveMinimum=0)] = 1.0
    logprobs: bool | int | None = None
    logit_bias: Annotated[
        dict[str, float] | None, schema("token_id_keys", maxProperties=MAX_LOGIT_BIAS, additionalProperties={"minimum": -100, "maximum": 100})
    ] = None
    user: str | None = None
    structured_outputs: Annotated[dict[str, Any] | None, STRUCTURED_OUTPUTS] = None  # vLLM's extension


class ChatCompletionRequest(_SamplingBody):
    REQUIRED = ("model", "messages")
    RULES = (
        *_SamplingBody.RULES,
        {"properties": {"logprobs": {"type": ["boolean", "null"]}}},  # alternatives are top_logprobs here
        when(present("top_logprobs"), {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}),
        when({"tool_choice": {"enum": ["required"]}}, {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}),
        when({"tool_choice": {"type": "object"}}, {"properties": {"tools": {"type": "array", "minItems": 1}}, "required": ["tools"]}),
    )

    messages: Annotated[list[ChatMessage], schema(minItems=1)] = []
    max_completion_tokens: Annotated[int | None, MAX_TOKENS] = None
    top_logprobs: Annotated[int | None, LOGPROBS] = None
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Annotated[str | NamedToolChoice | None, schema(**{"if": {"type": "string"}, "then": {"enum": TOOL_CHOICE_MODES}})] = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Annotated[str | None, schema("effort")] = None
    chat_template_kwargs: dict[str, Any] | None = None
    store: Annotated[bool | None, NULL_OR_FALSE] = None
    metadata: Annotated[dict[str, str] | None, METADATA] = None
    service_tier: Annotated[str | None, SERVICE_TIER] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionRequest(_SamplingBody):
    REQUIRED = ("model", "prompt")
    RULES = (
        *_SamplingBody.RULES,
        {"properties": {"logprobs": {"type": ["integer", "null"], **LOGPROBS.extra_json_schema}}},  # alternatives per token
        when({"logprobs": {"type": "integer"}}, {"properties": {"echo": {"const": False}}}),
        {"if": {"properties": {"max_tokens": {"type": "null"}}}, "then": {"properties": {"min_tokens": {"maximum": DEFAULT_COMPLETION_TOKENS}}}},
        # a batch of at most MAX_BATCH_CHOICES prompts (texts or token-id lists); times n, too, which schemathesis
        # cannot generate from once it is written as rules (one per batch size where the most n allowed drops)
        {"properties": {"prompt": {"anyOf": [{"items": {"type": "integer"}}, {"maxItems": MAX_BATCH_CHOICES}]}}},
    )

    prompt: Annotated[str | list[str | int | list[int]] | None, schema("prompt")] = None
    response_format: ResponseFormat | None = None  # vLLM's extension: structured outputs on completions too
    echo: bool = False
    suffix: Annotated[str | None, schema(type="null")] = None
    best_of: Annotated[int | None, schema(enum=[1, None])] = None


@dataclass
class Generation:
    """A validated request: everything the route needs besides the prompt(s)."""

    model: str
    n: int
    stream: bool
    include_usage: bool  # a closing chunk with the usage
    max_tokens: int | None  # None: whatever the context leaves
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    continuous_usage: bool = False  # usage so far on every chunk
    max_tokens_param: str = "max_tokens"
    grammar_param: str = ""  # the field that asked for ``sampling.grammar``: a grammar that does not parse is a 400 naming it


def decode_body(data: bytes, kind: type[msgspec.Struct]) -> Any:
    return msgspec.json.decode(data, type=kind)


async def read_body(request: web.Request, kind: type[msgspec.Struct]) -> Any:
    """The request body as ``kind``, or a 400 naming the field that does not fit."""
    body = await request.read()
    try:
        return decode_body(body, kind)
    except msgspec.MsgspecError as exc:
        raise from_validation_error(exc) from exc
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply to be read") from None


def convert_part(value: Any, kind: type[msgspec.Struct], where: str) -> Any:
    """One decoded JSON value (e.g. an item of a polymorphic list) as ``kind``; errors name the field under ``where``."""
    try:
        return msgspec.convert(value, type=kind)
    except msgspec.MsgspecError as exc:
        error = from_validation_error(exc)
        param = f"{where}.{error.param}" if error.param else where
        message = error.message.replace(str(error.param), param) if error.param else f"{error.message} (in {where})"
        raise ApiError(400, message, param=param) from exc


def check(condition: bool, param: str, message: str) -> None:
    if not condition:
        raise ApiError(400, message, param=param)


def check_model(model: str | None, served_model: str) -> None:
    check(model is not None, "model", "you must provide a model parameter")
    if model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves `{served_model}`.", param="model", code="model_not_found")


def check_sampling(temperature: float | None, top_p: float | None, top_k: int | None, min_p: float | None = None, seed: int | None = None) -> SamplingParams:
    temperature = 1.0 if temperature is None else temperature
    check(0.0 <= temperature <= 2.0, "temperature", f"temperature must be between 0 and 2, got {temperature}")
    top_p_value = 1.0 if top_p is None else top_p
    check(0.0 < top_p_value <= 1.0, "top_p", f"top_p must be in (0, 1], got {top_p_value}")
    top_k_value = 0 if top_k is None or top_k == -1 else top_k
    check(0 <= top_k_value <= INT64[1], "top_k", f"top_k must be -1 (disabled) or between 0 and {INT64[1]}, got {top_k}")
    # n seeded samples take seed, seed + 1, ...: all must fit the engine's frames
    check(seed is None or INT64[0] <= seed <= INT64[1] - MAX_CHOICES, "seed", f"seed must be between {INT64[0]} and {INT64[1] - MAX_CHOICES}, got {seed}")
    min_p = 0.0 if min_p is None else min_p
    check(0.0 <= min_p <= 1.0, "min_p", f"min_p must be between 0 and 1, got {min_p}")
    return SamplingParams(temperature=temperature, top_p=top_p_value, top_k=top_k_value, min_p=min_p, seed=seed)


def check_penalties(sampling: SamplingParams, presence: float, frequency: float, repetition: float) -> SamplingParams:
    check(-2.0 <= presence <= 2.0, "presence_penalty", f"presence_penalty must be between -2 and 2, got {presence}")
    check(-2.0 <= frequency <= 2.0, "frequency_penalty", f"frequency_penalty must be between -2 and 2, got {frequency}")
    check(repetition > 0.0, "repetition_penalty", f"repetition_penalty must be greater than 0, got {repetition}")
    return msgspec.structs.replace(sampling, presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition)


def check_logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``{"token id": bias}`` with ids in the vocabulary and biases in [-100, 100] (the OpenAI range)."""
    out: dict[int, float] = {}
    check(len(bias or {}) <= MAX_LOGIT_BIAS, "logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias or {})}")
    for key, value in (bias or {}).items():
        token = int(key) if TOKEN_ID_KEY.fullmatch(key) else None  # ASCII digits: str.isdigit takes '²', which int refuses
        check(token is not None, "logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        check(0 <= token < vocab_size, "logit_bias", f"logit_bias names token id {token}, outside the vocabulary [0, {vocab_size})")  # type: ignore[operator]
        check(-100.0 <= value <= 100.0, "logit_bias", f"logit_bias values must be between -100 and 100, got {value} for token {token}")
        out[token] = float(value)  # type: ignore[index]
    return out


def check_logprobs(count: int | None, param: str) -> int | None:
    check(count is None or 0 <= count <= MAX_LOGPROBS, param, f"{param} must be between 0 and {MAX_LOGPROBS}, got {count}")
    return count


def check_stops(stop: str | list[str] | None, param: str) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    check(len(stops) <= MAX_STOP_STRINGS, param, f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    check(all(stops), param, "stop strings must not be empty")
    return stops


def check_max_tokens(max_tokens: int | None, param: str) -> None:
    check(max_tokens is None or max_tokens >= 1, param, f"{param} must be at least 1, got {max_tokens}")


def validate_sampling(
    body: _SamplingBody, served_model: str, max_tokens: int | None, max_tokens_param: str, vocab_size: int, logprobs: int | None
) -> Generation:
    check_model(body.model, served_model)
    check_max_tokens(max_tokens, max_tokens_param)
    sampling = check_sampling(body.temperature, body.top_p, body.top_k, body.min_p, body.seed)
    sampling = check_penalties(sampling, body.presence_penalty, body.frequency_penalty, body.repetition_penalty)
    sampling = msgspec.structs.replace(sampling, logit_bias=check_logit_bias(body.logit_bias, vocab_size), logprobs=logprobs)
    check(1 <= body.n <= MAX_CHOICES, "n", f"n must be between 1 and {MAX_CHOICES}, got {body.n}")
    check(0 <= body.min_tokens <= INT64[1], "min_tokens", f"min_tokens must be between 0 and {INT64[1]}, got {body.min_tokens}")
    check(all(INT64[0] <= t <= INT64[1] for t in body.stop_token_ids or []), "stop_token_ids", f"stop_token_ids must lie between {INT64[0]} and {INT64[1]}")
    check(
        max_tokens is None or body.min_tokens <= max_tokens, "min_tokens", f"min_tokens ({body.min_tokens}) must not exceed {max_tokens_param} ({max_tokens})"
    )
    stops = check_stops(body.stop, "stop")
    include_usage = continuous_usage = False
    if body.stream_options is not None:
        check(body.stream, "stream_options", "stream_options is only allowed when stream is true")
        include_usage, continuous_usage = body.stream_options.include_usage, body.stream_options.continuous_usage_stats
    return Generation(
        model=served_model,
        n=body.n,
        stream=body.stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=stops,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        continuous_usage=continuous_usage,
        max_tokens_param=max_tokens_param,
    )


def with_grammar(generation: Generation, response_format: ResponseFormat | None, structured_outputs: dict[str, Any] | None) -> Generation:
    """``generation`` whose sampling carries the grammar that ``response_format`` or vLLM's ``structured_outputs`` asks
    the output to follow (at most one of them)."""
    grammar, param = structured_outputs_of(structured_outputs)
    if response_format is not None:
        if grammar is not None:
            raise ApiError(400, "send response_format or structured_outputs, not both", param="structured_outputs")
        grammar, param = json_schema_of(response_format.type, response_format.json_schema, "response_format", "response_format.json_schema")
    if grammar is None:
        return generation
    return replace(generation, sampling=msgspec.structs.replace(generation.sampling, grammar=grammar), grammar_param=param)


def unsupported(condition: bool, param: str, what: str) -> None:
    if not condition:
        raise ApiError(400, f"{what} is not supported by this server yet", param=param)


def validate_chat(body: ChatCompletionRequest, served_model: str, efforts: tuple[str, ...], vocab_size: int) -> tuple[Generation, ChatTurn]:
    check(len(body.messages) > 0, "messages", "messages must be a non-empty list")
    if body.max_tokens is not None and body.max_completion_tokens is not None and body.max_tokens != body.max_completion_tokens:
        raise ApiError(400, "max_tokens and max_completion_tokens disagree; send one of them", param="max_completion_tokens")
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    check(
        body.logprobs is None or isinstance(body.logprobs, bool),
        "logprobs",
        "logprobs must be true or false on chat completions (use top_logprobs for alternatives)",
    )
    check(body.top_logprobs is None or bool(body.logprobs), "top_logprobs", "top_logprobs requires logprobs: true")
    logprobs = check_logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens  # 0 is refused, not unset
    generation = validate_sampling(body, served_model, max_tokens, param, vocab_size, logprobs)
    unsupported(body.store is not True, "store", "store: true (this server stores no completions; send store: false or leave it out)")
    check_metadata(body.metadata)
    check_service_tier(body.service_tier)
    tools = [chat_tool(tool, i) for i, tool in enumerate(body.tools or [])]
    choice = _chat_tool_choice(body.tool_choice, bool(tools), body.parallel_tool_calls)
    check_tools(tools, choice, "tools", "tool_choice", name_field="function.name")
    effort = check_effort(body.reasoning_effort, efforts, "reasoning_effort")
    generation = with_grammar(generation, body.response_format, body.structured_outputs)
    turn = ChatTurn(
        messages=[chat_message(message, i) for i, message in enumerate(body.messages)],
        tools=tools,
        tool_choice=choice,
        effort=effort,
        template_kwargs=dict(body.chat_template_kwargs or {}),
        add_generation_prompt=body.add_generation_prompt,
        continue_final=body.continue_final_message,
    )
    return generation, turn


def chat_tool(tool: ChatTool, index: int) -> ToolSpec:
    check(tool.type == "function", f"tools[{index}].type", f"tools of type {tool.type!r} are not supported; only 'function'")
    return ToolSpec(tool.function.name, tool.function.description or "", tool.function.parameters, strict=bool(tool.function.strict))


def _chat_tool_choice(choice: str | NamedToolChoice | None, has_tools: bool, parallel: bool | None) -> ToolChoice:
    parallel = True if parallel is None else parallel
    if choice is None:
        return ToolChoice("auto" if has_tools else "none", parallel=parallel)
    if isinstance(choice, NamedToolChoice):
        check(choice.type == "function", "tool_choice.type", f"tool_choice of type {choice.type!r} is not supported; only 'function'")
        return ToolChoice("named", choice.function.name, parallel)
    check(choice in ("none", "auto", "required"), "tool_choice", f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}")
    return ToolChoice(choice, parallel=parallel)  # type: ignore[arg-type]


_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_message(message: ChatMessage, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    check(message.role in _CHAT_ROLES, f"{where}.role", f"unknown role {message.role!r} in {where}; expected {', '.join(_CHAT_ROLES)}")
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role, "content": _content_text(message.content, i)}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        check(message.role == "assistant", f"{where}.tool_calls", "only assistant messages carry tool_calls")
        for j, call in enumerate(message.tool_calls):
            check(call.type == "function", f"{where}.tool_calls[{j}].type", f"tool calls of type {call.type!r} are not supported; only 'function'")
        out["tool_calls"] = [template_call(call.id, call.function.name, call.function.arguments) for call in message.tool_calls]
    if message.role == "tool":
        check(bool(message.tool_call_id), f"{where}.tool_call_id", f"{where} has role 'tool' but no tool_call_id")
        out["tool_call_id"] = message.tool_call_id
    else:
        check(message.tool_call_id is None, f"{where}.tool_call_id", "only tool messages carry a tool_call_id")
    if message.reasoning_content is not None:
        check(message.role == "assistant", f"{where}.reasoning_content", "only assistant messages carry reasoning_content")
        out["reasoning_content"] = message.reasoning_content
    return out


def check_metadata(metadata: dict[str, str] | None) -> None:
    """OpenAI's bounds on a request's metadata (which tags what it makes; this server stores nothing to tag)."""
    if metadata is None:
        return
    check(len(metadata) <= MAX_METADATA_PAIRS, "metadata", f"metadata holds at most {MAX_METADATA_PAIRS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        check(len(key) <= MAX_METADATA_KEY, "metadata", f"metadata keys are at most {MAX_METADATA_KEY} characters, got {len(key)} in {key[:20]!r}...")
        check(len(value) <= MAX_METADATA_VALUE, "metadata", f"metadata values are at most {MAX_METADATA_VALUE} characters, got {len(value)} for {key!r}")


def check_service_tier(tier: str | None) -> None:
    unsupported(tier in (None, "auto", "default"), "service_tier", f"service_tier {tier!r} (one tier here: 'auto' or 'default')")


def _content_text(content: str | list[ContentPart] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        check(
            part.type == "text", f"messages[{index}].content[{j}].type", f"content parts of type {part.type!r} are not supported (this server reads text only)"
        )
    return "".join(part.text for part in content)


PromptInput = str | list[int]


def validate_completion(body: CompletionRequest, served_model: str, vocab_size: int) -> tuple[Generation, list[PromptInput]]:
    check(body.prompt is not None, "prompt", "you must provide a prompt")
    check(not isinstance(body.logprobs, bool), "logprobs", "logprobs must be an integer on completions: how many alternatives per token (0 to 20)")
    logprobs = check_logprobs(body.logprobs, "logprobs")  # type: ignore[arg-type]
    unsupported(logprobs is None or not body.echo, "logprobs", "logprobs with echo (prompt logprobs)")
    generation = validate_sampling(
        body, served_model, DEFAULT_COMPLETION_TOKENS if body.max_tokens is None else body.max_tokens, "max_tokens", vocab_size, logprobs
    )
    generation = with_grammar(generation, body.response_format, body.structured_outputs)
    unsupported(body.suffix is None, "suffix", "suffix")
    unsupported(body.best_of in (None, 1), "best_of", "best_of other than 1")
    prompts = _prompts(body.prompt)
    check(len(prompts) * generation.n <= MAX_BATCH_CHOICES, "prompt", f"too many choices: {len(prompts)} prompts x n={generation.n}")
    for i, prompt in enumerate(prompts):
        check(len(prompt) > 0, "prompt", f"prompt {i} is empty")
        if isinstance(prompt, list):
            check(all(0 <= t < vocab_size for t in prompt), "prompt", f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
    return generation, prompts


def _prompts(prompt: str | list[str | int | list[int]]) -> list[PromptInput]:
    """One prompt (text or token ids) or a batch of them; mixed lists are refused."""
    if isinstance(prompt, str):
        return [prompt]
    check(len(prompt) > 0, "prompt", "prompt must not be an empty list")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[list-item]
    check(
        all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt),
        "prompt",
        "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists",
    )
    return list(prompt)  # type: ignore[arg-type]
