"""Optional API keys: ``Authorization: Bearer <key>`` (OpenAI) or ``x-api-key: <key>`` (Anthropic) on every route
but the open ones (``/health`` and ``/metrics`` unless configured otherwise, and ``/openapi.json``)."""

from __future__ import annotations

import hmac

from aiohttp import web

from services.api.errors import ApiError


def presented_key(request: web.Request) -> str | None:
    authorization = request.headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def auth_middleware(keys: tuple[str, ...], open_paths: frozenset[str]):
    """A middleware that answers 401 unless the request presents one of ``keys``; ``keys`` empty: everything is open."""
    encoded = [key.encode() for key in keys]

    def accepted(key: str | None) -> bool:
        # compare_digest against every key, so the time taken says nothing about which key came close
        return key is not None and sum(hmac.compare_digest(key.encode(), candidate) for candidate in encoded) > 0

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if encoded and request.path not in open_paths:
            key = presented_key(request)
            if not accepted(key):
                anthropic = request.path.startswith("/v1/messages")
                what = "x-api-key" if anthropic else "API key"
                message = f"invalid {what}" if key is not None else f"missing {what}: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
                raise ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return check_key
