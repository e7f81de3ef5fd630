"""Structured outputs at the api: OpenAI's ``response_format`` (chat and completions) and the Responses API's
``text.format``, turned into the JSON Schema text the worker's grammar decodes under (``SamplingParams.json_schema``).

``json_object`` is any JSON object; ``json_schema`` is the client's schema, compiled here so that one outside the
grammar's subset is a 400 naming the keyword, before anything is queued. With tools or reasoning, the grammar would
hold the tool calls or the thinking to the schema too, so those combinations are refused.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.api.errors import ApiError
from shared.json_grammar import JsonGrammar, SchemaError

FORMATS = ("text", "json_object", "json_schema")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JSON_OBJECT = '{"type":"object"}'


def json_schema_of(kind: str, schema_spec: dict[str, Any] | None, param: str) -> str | None:
    """The schema the output must follow (JSON text), or None for plain text. ``schema_spec`` holds ``name``,
    ``schema`` (and ``description``, ``strict``) for ``json_schema``: nested on chat, the format itself on Responses."""
    if kind not in FORMATS:
        raise ApiError(400, f"{param}.type must be one of {', '.join(FORMATS)}, got {kind!r}", param=f"{param}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if not isinstance(schema_spec, dict):
        raise ApiError(400, f"{param} of type 'json_schema' needs its json_schema: a name and a schema", param=param)
    name = schema_spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"{param} needs a name of 1 to 64 letters, digits, '_' or '-', got {name!r}", param=f"{param}.name")
    strict = schema_spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{param}.strict must be true or false", param=f"{param}.strict")
    schema = schema_spec.get("schema", {})  # OpenAI's default when none is given: any JSON value
    try:
        JsonGrammar(schema)
    except SchemaError as exc:
        raise ApiError(400, f"{exc} (structured outputs follow a subset of JSON Schema)", param=f"{param}.schema") from None
    return json.dumps(schema, separators=(",", ":"))


def check_structured_combination(json_schema: str | None, tool_choice: str, effort: str | None, efforts: tuple[str, ...], param: str) -> None:
    """Refuses structured outputs where the grammar would also bind tool calls or a reasoning model's thinking."""
    if json_schema is None:
        return
    if tool_choice != "none":
        raise ApiError(400, f"{param} with tools is not supported by this server yet (send tool_choice 'none' or no tools)", param=param)
    if efforts != ("none",) and effort != "none":  # ("none",): a model that does not reason
        raise ApiError(400, f"{param} with a reasoning model is not supported by this server yet unless its reasoning effort is 'none'", param=param)
