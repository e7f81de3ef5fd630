"""Errors with an HTTP status, in the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``
or, on the Anthropic routes, ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from aiohttp import web

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> web.Response:
        return web.json_response(self.anthropic_body() if anthropic else self.body(), status=self.status, headers=self.headers)


def from_validation_error(exc: msgspec.MsgspecError) -> ApiError:
    """A 400 naming the offending field, from msgspec's ``... - at `$.field[0]` `` messages."""
    text = str(exc)
    match = re.search(r" - at `\$\.?([^`]*)`$", text)
    param = match.group(1) if match else None
    message = text[: match.start()] if match else text
    unknown = re.match(r"Object contains unknown field `([^`]+)`", message)
    if unknown:
        field = f"{param}.{unknown.group(1)}" if param else unknown.group(1)
        return ApiError(400, f"Unrecognized request argument supplied: {field}", param=field)
    missing = re.match(r"Object missing required field `([^`]+)`", message)
    if missing:
        field = f"{param}.{missing.group(1)}" if param else missing.group(1)
        return ApiError(400, f"Missing required argument: {field}", param=field)
    if not isinstance(exc, msgspec.ValidationError) and param is None:
        return ApiError(400, f"The request body is not valid JSON: {message}")
    where = f" for '{param}'" if param else ""
    return ApiError(400, f"Invalid value{where}: {message}", param=param or None)
