"""Structured outputs at the api: OpenAI's ``response_format`` (chat and completions), the Responses API's
``text.format``, Anthropic's ``output_config.format`` and vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``grammar``) turned into the ``Grammar`` the worker compiles with xgrammar; strict tools and
``tool_choice`` required or named turned into an xgrammar structural tag in the tool parser's format.

Every grammar is parsed here by xgrammar (``check_grammar``, run in the api's thread pool) so that a malformed
one is a 400 naming the field and xgrammar's complaint, before anything is queued; the worker compiles it
against the vocabulary. With reasoning, the grammar holds the answer from the end of the reasoning block on.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.api.errors import ApiError
from services.api.tools import ToolChoice, ToolSpec
from shared.frames import Grammar, GrammarKind

FORMATS = ("text", "json_object", "json_schema")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
JSON_OBJECT = Grammar(GrammarKind.JSON_SCHEMA, '{"type":"object"}')
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its complaint


def check_grammar(grammar: Grammar, param: str) -> None:
    """A 400 naming ``param`` and xgrammar's complaint where ``grammar`` does not parse (it needs no vocabulary:
    the worker compiles it against the model's). xgrammar (and torch under it) is imported at the first one."""
    import xgrammar as xgr

    try:
        if grammar.kind is GrammarKind.JSON_SCHEMA:
            xgr.Grammar.from_json_schema(grammar.text, any_whitespace=False, strict_mode=grammar.strict)
        elif grammar.kind is GrammarKind.REGEX:
            xgr.Grammar.from_regex(grammar.text)
        elif grammar.kind is GrammarKind.EBNF:
            xgr.Grammar.from_ebnf(grammar.text)
        else:
            xgr.Grammar.from_structural_tag(grammar.text)
    except RecursionError:
        raise ApiError(400, f"{param} nests too deeply to be compiled", param=param) from None
    except Exception as exc:  # RuntimeError, ValueError, xgrammar's own, pydantic's for a structural tag
        why = _LOCATION.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ApiError(400, f"{param} is not a valid {grammar.kind.value.replace('_', ' ')}: {why}", param=param) from None


MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a schema: deeper ones take xgrammar minutes to convert


def _depth(value: Any) -> int:
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            pending.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _schema_text(schema: Any, param: str) -> str:
    if not isinstance(schema, dict | bool):
        raise ApiError(400, f"{param} must be a JSON Schema (an object or a boolean)", param=param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise ApiError(400, f"{param} nests too deeply to be compiled (more than {MAX_SCHEMA_DEPTH} levels)", param=param)
    try:
        return json.dumps(schema, separators=(",", ":"))
    except (ValueError, RecursionError):
        raise ApiError(400, f"{param} nests too deeply to be compiled", param=param) from None


def json_schema_of(kind: str, schema_spec: dict[str, Any] | None, param: str, spec_param: str) -> tuple[Grammar | None, str]:
    """The grammar the output must follow and the field that names it (for ``check_grammar``); None for plain
    text. ``schema_spec`` (at ``spec_param``) holds ``name``, ``schema`` (and ``description``, ``strict``) for
    ``json_schema``: nested on chat, the format itself on Responses."""
    if kind not in FORMATS:
        raise ApiError(400, f"{param}.type must be one of {', '.join(FORMATS)}, got {kind!r}", param=f"{param}.type")
    if kind == "text":
        return None, ""
    if kind == "json_object":
        return JSON_OBJECT, param
    if not isinstance(schema_spec, dict):
        raise ApiError(400, f"{param} of type 'json_schema' needs its json_schema: a name and a schema", param=spec_param)
    name = schema_spec.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(400, f"{spec_param}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}", param=f"{spec_param}.name")
    strict = schema_spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"{spec_param}.strict must be true or false", param=f"{spec_param}.strict")
    param = f"{spec_param}.schema"
    return Grammar(GrammarKind.JSON_SCHEMA, _schema_text(schema_spec.get("schema", {}), param), strict=bool(strict)), param


def anthropic_output_format(output_format: dict[str, Any] | None, param: str = "output_config.format") -> tuple[Grammar | None, str]:
    """Anthropic's ``output_config.format`` (``{"type": "json_schema", "schema": ...}``): its grammar (objects closed,
    as Anthropic's structured outputs are) and the field that names it; None without one."""
    if output_format is None:
        return None, ""
    if output_format.get("type") != "json_schema":
        raise ApiError(400, f"{param}.type must be 'json_schema', got {output_format.get('type')!r}", param=f"{param}.type")
    unknown = sorted(set(output_format) - {"type", "schema"})
    if unknown:
        raise ApiError(400, f"{param}: Extra inputs are not permitted: {', '.join(unknown)}", param=f"{param}.{unknown[0]}")
    if "schema" not in output_format:
        raise ApiError(400, f"{param}.schema: Field required", param=f"{param}.schema")
    return Grammar(GrammarKind.JSON_SCHEMA, _schema_text(output_format["schema"], f"{param}.schema"), strict=True), f"{param}.schema"


STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def structured_outputs_of(spec: dict[str, Any] | None, param: str = "structured_outputs") -> tuple[Grammar | None, str]:
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, or its text), ``regex``, ``choice`` (strings,
    one of which is the output), ``grammar`` (EBNF/GBNF as xgrammar reads it), ``json_object`` or ``structural_tag``."""
    if spec is None:
        return None, ""
    unknown = sorted(set(spec) - set(STRUCTURED_OUTPUTS_KINDS))
    if unknown:
        raise ApiError(400, f"{param}.{unknown[0]} is not supported; send one of {', '.join(STRUCTURED_OUTPUTS_KINDS)}", param=f"{param}.{unknown[0]}")
    given = [k for k in STRUCTURED_OUTPUTS_KINDS if spec.get(k) is not None]  # null: not asked for, as in vLLM
    if len(given) != 1:
        raise ApiError(400, f"{param} takes exactly one of {', '.join(STRUCTURED_OUTPUTS_KINDS)}, got {len(given)}", param=param)
    kind = given[0]
    value, where = spec[kind], f"{param}.{kind}"
    if kind == "json":
        return Grammar(GrammarKind.JSON_SCHEMA, _schema_text(_json_value(value, where), where)), where
    if kind == "json_object":
        if value is not True:
            raise ApiError(400, f"{where} must be true", param=where)
        return JSON_OBJECT, where
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise ApiError(400, f"{where} must be a non-empty list of non-empty strings", param=where)
        return Grammar(GrammarKind.EBNF, "root ::= " + " | ".join(_ebnf_literal(c) for c in dict.fromkeys(value))), where
    if kind == "structural_tag":
        return Grammar(GrammarKind.STRUCTURAL_TAG, _schema_text(_json_value(value, where), where)), where
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"{where} must be a non-empty string", param=where)
    return Grammar(GrammarKind.REGEX if kind == "regex" else GrammarKind.EBNF, value), where


def _json_value(value: Any, param: str) -> Any:
    """A value sent as itself or as its JSON text."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"{param} is not valid JSON: {exc}", param=param) from None


def _ebnf_literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes, which xgrammar's EBNF reads)."""
    return json.dumps(text, ensure_ascii=False)


def tool_parameters_grammar(tool: ToolSpec, param: str) -> Grammar:
    """A strict tool's parameters as the grammar its call's arguments follow (``check_grammar`` checks it)."""
    return Grammar(GrammarKind.JSON_SCHEMA, _schema_text(tool.parameters or {"type": "object"}, param), strict=True)


# A tool parser's text around one call's arguments: (before the name, between the name and the arguments, after them).
TOOL_CALL_FORMATS = {
    "hermes": ('<tool_call>\n{"name": ', ', "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": ', ', "parameters": ', "}"),
}


def _call_tag(tool: ToolSpec, tool_parser: str, hold_arguments: bool) -> dict[str, Any]:
    before, between, after = TOOL_CALL_FORMATS[tool_parser]
    parameters = tool.parameters if hold_arguments and tool.parameters else {}
    if parameters.get("type") != "object" and "properties" not in parameters:
        parameters = {**parameters, "type": "object"}  # the parsers take arguments that are an object
    return {"type": "tag", "begin": f"{before}{json.dumps(tool.name)}{between}", "content": _json_content(parameters), "end": after}


def _json_content(schema: Any) -> dict[str, Any]:
    """A structural tag's JSON under ``schema``, its whitespace bounded as a ``json_schema`` answer's is (one
    character between tokens: unbounded, a model may pad it forever)."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def tool_call_grammar(tools: list[ToolSpec], choice: ToolChoice, tool_parser: str, answer: Grammar | None) -> Grammar | None:
    """The structural tag that holds tool calls, in the tool parser's format: for ``tool_choice`` required or named,
    the answer is one call of an offered tool (its arguments held to its parameters where the tool is strict, else
    any object); for ``auto`` with strict tools (or with a JSON ``answer`` grammar), text stays free (or the answer
    follows ``answer``) and a call, once it starts, follows its tool. None where nothing needs holding, or the
    tool parser's format is not one a grammar is written for (the choice then stays an instruction)."""
    if not tools or choice.mode == "none" or tool_parser not in TOOL_CALL_FORMATS:
        return None
    if choice.mode in ("required", "named"):
        calls = [_call_tag(t, tool_parser, hold_arguments=t.strict) for t in tools]
        return _structural_tag(calls[0] if len(calls) == 1 else {"type": "or", "elements": calls})
    if answer is None and not any(t.strict for t in tools):
        return None  # auto, and nothing strict: free text and calls as the model writes them
    calls = [_call_tag(t, tool_parser, hold_arguments=t.strict) for t in tools]
    if answer is not None and answer.kind is GrammarKind.JSON_SCHEMA:  # a call, or the answer under its schema
        return _structural_tag({"type": "or", "elements": [*calls, _json_content(json.loads(answer.text))]})
    if answer is not None:
        return None  # a regex or grammar answer beside tools: the caller keeps the answer's grammar
    trigger = TOOL_CALL_FORMATS[tool_parser][0]
    return _structural_tag({"type": "triggered_tags", "triggers": [trigger], "tags": calls})


def _structural_tag(format_: dict[str, Any]) -> Grammar:
    return Grammar(GrammarKind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": format_}, separators=(",", ":")))
