"""Structured outputs at the api: OpenAI's ``response_format`` (chat and completions), the Responses API's
``text.format`` and Anthropic's ``output_config.format``, turned into the JSON Schema text the worker's grammar
decodes under (``SamplingParams.json_schema``).

``json_object`` is any JSON object; ``json_schema`` is the client's schema, compiled here so that one outside the
grammar's subset is a 400 naming the keyword, before anything is queued. With tools or reasoning, the grammar would
hold the tool calls or the thinking to the schema too, so those combinations are refused.

The same grammar holds ``tool_choice`` required or named to a call (``tool_call_grammar``): one call of an offered
tool in the tool parser's format, its arguments following the tool's parameters.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.api.errors import ApiError
from services.api.reasoning import thinks
from services.api.tools import ToolChoice, ToolSpec
from shared.json_grammar import JsonGrammar, SchemaError

FORMATS = ("text", "json_object", "json_schema")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JSON_OBJECT = '{"type":"object"}'


def json_schema_of(kind: str, schema_spec: dict[str, Any] | None, param: str, spec_param: str) -> str | None:
    """The schema the output must follow (JSON text), or None for plain text. ``schema_spec`` (at ``spec_param``)
    holds ``name``, ``schema`` (and ``description``, ``strict``) for ``json_schema``: nested on chat, the format
    itself on Responses."""
    if kind not in FORMATS:
        raise ApiError(400, f"{param}.type must be one of {', '.join(FORMATS)}, got {kind!r}", param=f"{param}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if not isinstance(schema_spec, dict):
        raise ApiError(400, f"{param} of type 'json_schema' needs its json_schema: a name and a schema", param=spec_param)
    name = schema_spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"{spec_param}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", param=f"{spec_param}.name")
    strict = schema_spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{spec_param}.strict must be true or false", param=f"{spec_param}.strict")
    return schema_text(schema_spec.get("schema", {}), f"{spec_param}.schema")  # OpenAI's default when none is given: any JSON value


def schema_text(schema: Any, param: str) -> str:
    """``schema`` as the worker takes it (JSON text), once it compiles; a 400 naming what does not."""
    try:
        JsonGrammar(schema)
    except SchemaError as exc:
        raise ApiError(400, f"{exc} (structured outputs follow a subset of JSON Schema)", param=param) from None
    except RecursionError:
        raise ApiError(400, "the schema nests too deeply to be compiled", param=param) from None
    return json.dumps(schema, separators=(",", ":"))


def anthropic_output_format(output_format: dict[str, Any] | None, param: str = "output_config.format") -> str | None:
    """Anthropic's ``output_config.format`` (``{"type": "json_schema", "schema": ...}``) as schema text; None without one."""
    if output_format is None:
        return None
    if output_format.get("type") != "json_schema":
        raise ApiError(400, f"{param}.type must be 'json_schema', got {output_format.get('type')!r}", param=f"{param}.type")
    unknown = sorted(set(output_format) - {"type", "schema"})
    if unknown:
        raise ApiError(400, f"{param}: Extra inputs are not permitted: {', '.join(unknown)}", param=f"{param}.{unknown[0]}")
    if "schema" not in output_format:
        raise ApiError(400, f"{param}.schema: Field required", param=f"{param}.schema")
    return schema_text(output_format["schema"], f"{param}.schema")


def check_structured_combination(json_schema: str | None, tool_choice: str, effort: str | None, efforts: tuple[str, ...], param: str) -> None:
    """Refuses structured outputs where the grammar would also bind tool calls or a reasoning model's thinking."""
    if json_schema is None:
        return
    if tool_choice != "none":
        raise ApiError(400, f"{param} with tools is not supported by this server yet (send tool_choice 'none' or no tools)", param=param)
    if thinks(effort, efforts):
        raise ApiError(400, f"{param} with a reasoning model is not supported by this server yet unless its reasoning effort is 'none'", param=param)


# A tool parser's text around one call's JSON, and the name of the call's arguments member.
TOOL_CALL_FORMATS = {"hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"), "llama3_json": ("", "", "parameters")}


def tool_call_grammar(tools: list[ToolSpec], choice: ToolChoice, tool_parser: str, thinks: bool) -> tuple[str, str, str] | None:
    """For ``tool_choice`` required or named: (schema, prefix, suffix) of one call of an offered tool in the tool
    parser's format, so the answer is that call. None where that cannot be held, and the choice stays the
    instruction it was: another parser's format, a model that thinks before it answers, or a tool whose
    parameters fall outside the grammar's subset."""
    if choice.mode not in ("required", "named") or tool_parser not in TOOL_CALL_FORMATS or thinks or not tools:
        return None
    prefix, suffix, arguments = TOOL_CALL_FORMATS[tool_parser]
    calls = []
    for tool in tools:
        parameters = tool.parameters or {}
        if parameters.get("type") != "object" and "properties" not in parameters:
            parameters = {"type": "object"}  # the parsers take arguments that are an object
        members = {"name": {"const": tool.name}, arguments: parameters}
        calls.append({"type": "object", "properties": members, "additionalProperties": False, "propertyOrdering": list(members)})
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        JsonGrammar(schema)
    except (SchemaError, RecursionError):
        return None
    return json.dumps(schema, separators=(",", ":")), prefix, suffix
