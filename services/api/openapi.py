"""The api's OpenAPI document (``/openapi.json``): every route, with its request body's JSON schema taken from the
same msgspec structs that validate the body, so the document and the validation cannot disagree.

Each struct's fields carry the bounds their checks enforce (``services.api.protocol.schema``), its ``REQUIRED``
the fields the checks refuse to go without and its ``RULES`` the rules across fields; bounds that come from the
served model (its id, vocabulary, context, reasoning efforts) are filled in here from the running api's state.
What the document does not say is left to the checks and named in its description: the rendered prompt's
length in tokens against the context, ``min_tokens`` against ``max_tokens``, a completions batch times ``n``
(the batch alone is bounded: the exact rule, one per batch size, is more than schema-driven generators take),
tool names unique and a named tool among the tools, equal ``max_tokens`` and ``max_completion_tokens``, a
structured-output schema, regex or grammar that xgrammar parses, a
thinking budget below ``max_tokens``, what a chat template itself refuses, and the bounds of a memory split
(``/v1/admin/memory``), which come from the engine's current split.
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
from aiohttp import web

from services.api.admin_routes import MemoryRequest
from services.api.anthropic_protocol import CountTokensRequest, MessagesRequest, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock
from services.api.protocol import ChatCompletionRequest, CompletionRequest
from services.api.responses_protocol import FunctionCallItem, FunctionCallOutputItem, FunctionTool, InputText, MessageItem, ReasoningItem, ResponsesRequest
from services.api.state import API_STATE, ApiState
from services.api.tokenize_routes import DetokenizeRequest, TokenizeRequest

REQUEST_BODIES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/admin/memory": MemoryRequest,
}
# Parts the routes read from loosely typed JSON (a dispatch on ``type``); the bodies' rules refer to them.
PARTS: tuple[type[msgspec.Struct], ...] = (
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputText,
    MessageItem,
    ReasoningItem,
)

_OPENAI_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}}, "required": ["type", "message"]},
    },
    "required": ["type", "error"],
}


def _digits_below(n: int) -> str:
    """A regular expression for the decimal numbers 0 .. n-1 (leading zeros allowed, as ``int`` reads them)."""
    top = str(n - 1)
    alternatives = [f"[0-9]{{1,{len(top) - 1}}}"] if len(top) > 1 else []
    for i, digit in enumerate(top):  # as many digits as n-1: its first i digits, then a smaller one, then any
        low = 1 if i == 0 and len(top) > 1 else 0
        if int(digit) > low:
            alternatives.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    alternatives.append(top)
    return f"^0*(?:{'|'.join(alternatives)})$"


def _served(state: ApiState) -> dict[str, dict[str, Any]]:
    """The keywords each ``x-served`` bound stands for on this api."""
    vocab, context = state.model.vocab_size, state.max_model_len
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    token_ids = {"type": "array", "items": token_id}
    prompt_ids = token_ids | {"minItems": 1, "maxItems": context - 1}
    efforts = list(state.chat_format.efforts)
    return {
        "model": {"enum": [state.model_id]},
        "model_or_null": {"enum": [state.model_id, None]},
        "max_tokens": {"maximum": context - 1},
        "effort": {"enum": [*efforts, None]},
        "thinking": {"enum": ["disabled"]} if efforts == ["none"] else {},
        "token_id_keys": {"propertyNames": {"pattern": _digits_below(vocab)}},
        "token_ids": token_ids,
        "prompt": {  # text, token ids, or a batch of either (not mixed)
            "anyOf": [
                {"type": "string", "minLength": 1},
                prompt_ids,
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                {"type": "array", "items": prompt_ids, "minItems": 1},
            ]
        },
    }


def _resolve(node: Any, served: dict[str, dict[str, Any]]) -> Any:
    """``node`` with every ``x-served`` bound filled in."""
    if isinstance(node, list):
        return [_resolve(item, served) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _resolve(value, served) for key, value in node.items() if key != "x-served"}
    if "x-served" in node:
        bound = served[node["x-served"]]
        if "anyOf" in bound or "enum" in bound:  # it replaces the type the struct declares
            out = {key: value for key, value in out.items() if key not in ("anyOf", "default", "type")}
        out |= bound
    return out


def request_schemas(state: ApiState) -> tuple[dict[str, dict[str, str]], dict[str, Any]]:
    """The request bodies' references by path, and the components they refer to, with this api's bounds."""
    kinds = [*REQUEST_BODIES.values(), *PARTS]
    refs, schemas = msgspec.json.schema_components(kinds, ref_template="#/components/schemas/{name}")
    for name, component in schemas.items():
        _add_rules(_STRUCTS[name], component)
    return dict(zip(REQUEST_BODIES, refs)), _resolve(schemas, _served(state))


def _add_rules(struct: type[msgspec.Struct], component: dict[str, Any]) -> None:
    """The fields ``struct`` cannot go without (``REQUIRED``), and its rules across fields (``RULES``, all must hold)."""
    component["required"] = sorted(set(component.get("required", [])) | set(getattr(struct, "REQUIRED", ())))
    rules = [copy.deepcopy(rule) for rule in getattr(struct, "RULES", ())]
    if required := getattr(struct, "REQUIRED", ()):  # and not null: the checks refuse a null as they refuse an absence
        rules.insert(0, {"properties": {name: {"not": {"type": "null"}} for name in required}})
    if rules:
        component["allOf"] = rules


def _all_structs() -> dict[str, type[msgspec.Struct]]:
    """Every struct the request bodies nest, by its component name."""
    out: dict[str, type[msgspec.Struct]] = {}

    def visit(kind: Any) -> None:
        info = msgspec.inspect.type_info(kind)
        stack = [info]
        while stack:
            item = stack.pop()
            if isinstance(item, msgspec.inspect.StructType):
                if item.cls.__name__ in out:
                    continue
                out[item.cls.__name__] = item.cls
                stack += [f.type for f in item.fields]
            for attr in ("types", "item_type", "key_type", "value_type", "item_types"):
                value = getattr(item, attr, None)
                if isinstance(value, tuple):
                    stack += list(value)
                elif value is not None:
                    stack.append(value)
            if isinstance(item, msgspec.inspect.Metadata):
                stack.append(item.type)

    for kind in (*REQUEST_BODIES.values(), *PARTS):
        visit(kind)
    return out


_STRUCTS = _all_structs()


def openapi_document(app: web.Application, version: str) -> dict[str, Any]:
    body_refs, schemas = request_schemas(app[API_STATE])
    model_id = app[API_STATE].model_id
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path = route.resource.canonical
        error = _ANTHROPIC_ERROR if path.startswith("/v1/messages") else _OPENAI_ERROR
        error_response = {"description": "an error in the protocol's shape", "content": {"application/json": {"schema": error}}}
        operation: dict[str, Any] = {
            "operationId": f"{route.method.lower()}{path.replace('/', '_').replace('{', '').replace('}', '')}",
            "responses": {"200": {"description": "success"}, "4XX": error_response, "5XX": error_response},
        }
        if "{" in path:  # /v1/models/{model}: the one model served; any other is a 404
            operation["parameters"] = [
                {"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string", "enum": [model_id]}}
                for part in path.split("/")
                if part.startswith("{")
            ]
        if route.method == "POST" and path in body_refs:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_refs[path]}}}
        paths.setdefault(path, {})[route.method.lower()] = operation
    security = {"bearer": {"type": "http", "scheme": "bearer"}, "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenyard", "version": version, "description": __doc__.split("\n\n", 1)[1].replace("\n", " ").strip()},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": security},
    }
