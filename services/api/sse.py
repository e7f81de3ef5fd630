"""Server-sent events in the OpenAI style: ``data: {json}`` lines, closed by ``data: [DONE]``."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

_encode = msgspec.json.encode


class SseWriter:
    def __init__(self, request: web.Request, with_usage_field: bool) -> None:
        self.request = request
        self.with_usage_field = with_usage_field  # stream_options.include_usage: every chunk carries "usage": null
        self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict[str, Any]) -> None:
        if self.with_usage_field:
            payload["usage"] = None
        await self.response.write(b"data: " + _encode(payload) + b"\n\n")

    async def send_usage(self, usage: dict[str, Any], template: dict[str, Any]) -> None:
        """The closing usage chunk: the stream's envelope with no choices."""
        payload = {**template, "choices": [], "usage": usage}
        await self.response.write(b"data: " + _encode(payload) + b"\n\n")

    async def send_error(self, error: dict[str, Any]) -> None:
        await self.response.write(b"data: " + _encode(error) + b"\n\n")

    async def close(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
