"""The api's OpenAPI document (``/openapi.json``): every route, with its request body's JSON schema taken from the
same msgspec structs that validate the body, so the document and the validation cannot disagree."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from services.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from services.api.protocol import ChatCompletionRequest, CompletionRequest
from services.api.responses_protocol import ResponsesRequest
from services.api.tokenize_routes import DetokenizeRequest, TokenizeRequest

REQUEST_BODIES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

_ERROR = {"description": "an error in the protocol's shape", "content": {"application/json": {"schema": {"type": "object"}}}}


def openapi_document(app: web.Application, version: str) -> dict[str, Any]:
    refs, schemas = msgspec.json.schema_components(list(REQUEST_BODIES.values()), ref_template="#/components/schemas/{name}")
    body_refs = dict(zip(REQUEST_BODIES, refs))
    paths: dict[str, dict[str, Any]] = {}
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        path = route.resource.canonical
        operation: dict[str, Any] = {
            "operationId": f"{route.method.lower()}{path.replace('/', '_').replace('{', '').replace('}', '')}",
            "responses": {"200": {"description": "success"}, "4XX": _ERROR, "5XX": _ERROR},
        }
        if "{" in path:
            operation["parameters"] = [
                {"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string"}} for part in path.split("/") if part.startswith("{")
            ]
        if route.method == "POST" and path in body_refs:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_refs[path]}}}
        paths.setdefault(path, {})[route.method.lower()] = operation
    security = {"bearer": {"type": "http", "scheme": "bearer"}, "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenyard", "version": version},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": security},
    }
