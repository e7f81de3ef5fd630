"""Server-sent events: OpenAI chunks (``data: {json}`` lines closed by ``data: [DONE]``), and named events
(``event: name`` then ``data: {json}``) as the Responses and Anthropic Messages APIs stream them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec
from aiohttp import web

_encode = msgspec.json.encode
_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


class SseWriter:
    def __init__(self, request: web.Request, with_usage_field: bool) -> None:
        self.request = request
        self.with_usage_field = with_usage_field  # stream_options: every chunk carries "usage" (null, or the usage so far)
        self.response = web.StreamResponse(headers=_HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, payload: dict[str, Any], usage: dict[str, Any] | None = None) -> None:
        if self.with_usage_field:
            payload["usage"] = usage
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


class EventWriter:
    """Named events; with ``sequence`` every payload gets a contiguous ``sequence_number`` from 0."""

    def __init__(self, request: web.Request, sequence: bool = False) -> None:
        self.request = request
        self.sequence = 0 if sequence else None
        self.response = web.StreamResponse(headers=_HEADERS)

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, event: str, payload: dict[str, Any]) -> None:
        if self.sequence is not None:
            payload["sequence_number"] = self.sequence
            self.sequence += 1
        await self.response.write(b"event: " + event.encode() + b"\ndata: " + _encode(payload) + b"\n\n")

    async def close(self) -> None:
        await self.response.write_eof()


async def with_keepalive(items: AsyncIterator[T], interval_s: float) -> AsyncIterator[T | None]:
    """The items, with a None each time ``interval_s`` passes without one (the caller's cue to ping)."""
    pending: asyncio.Future[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({pending}, timeout=interval_s)
            if not done:
                yield None
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
