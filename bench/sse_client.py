"""A lean streaming chat client for bench.stack_throughput: HTTP/1.1 on an asyncio protocol, chunked bodies,
server-sent events, msgspec's JSON decoder.

That benchmark sets the stack against the worker driven in process, on the same two cores; the client's CPU
is charged to the stack alone (the in-process run has none), and a real client runs on another machine.
Through aiohttp's response reader one stream cost the client ~0.2 ms of CPU per token here, as much as the
detokenizer; this client reads the same stream for about half that. It keeps what the benchmark needs: the
time each content chunk arrived, the usage, and a clear error for an HTTP error, an error event or a stream
that ends without ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

import msgspec

from bench.stack_client import chat_body

_decode = msgspec.json.Decoder().decode


class StreamError(RuntimeError):
    """The server answered with an error status or an error event, or the stream broke off."""


class _SseProtocol(asyncio.Protocol):
    """One request's response: the status line and headers, then a chunked (or connection-delimited) body of
    SSE events, each ``data: {json}`` or ``data: [DONE]``."""

    def __init__(self, finished: asyncio.Future) -> None:
        self.finished = finished
        self.buffer = b""
        self.status = 0
        self.chunked = False
        self.events = b""  # body bytes not yet split into events
        self.stamps: list[float] = []
        self.usage: dict = {}
        self.done = False  # data: [DONE] seen
        self.body_complete = False  # the last chunk seen
        self.error_body = b""

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.buffer += data
        try:
            if not self.status and not self._read_head():
                return
            body = self._read_body()
            if self.status == 200:
                self.events += body
                *complete, self.events = self.events.split(b"\n\n")
                for event in complete:
                    self._on_event(event, now)
            else:
                self.error_body += body
            if self.body_complete:
                self._finish(None)
        except (StreamError, ValueError) as exc:  # msgspec's DecodeError is a ValueError
            self._finish(exc if isinstance(exc, StreamError) else StreamError(f"a malformed event: {exc}"))

    def _read_head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        status_line, *headers = self.buffer[:end].decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        self.chunked = any(h.lower().replace(" ", "") == "transfer-encoding:chunked" for h in headers)
        self.buffer = self.buffer[end + 4 :]
        return True

    def _read_body(self) -> bytes:
        if not self.chunked:  # delimited by the connection's end (Connection: close)
            body, self.buffer = self.buffer, b""
            return body
        parts = []
        while (line_end := self.buffer.find(b"\r\n")) >= 0:
            size = int(self.buffer[:line_end].split(b";")[0], 16)
            if len(self.buffer) < line_end + 2 + size + 2:
                break  # the rest of this chunk is still on its way
            parts.append(self.buffer[line_end + 2 : line_end + 2 + size])
            self.buffer = self.buffer[line_end + 4 + size :]
            if size == 0:
                self.body_complete = True
                break
        return b"".join(parts)

    def _on_event(self, event: bytes, now: float) -> None:
        if not event.startswith(b"data: "):
            return  # a comment (keep-alive) or another field
        payload = event[6:]
        if payload == b"[DONE]":
            self.done = True
            return
        chunk = _decode(payload)
        if "error" in chunk:
            raise StreamError(f"error event: {json.dumps(chunk['error'])}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        choices = chunk.get("choices")
        if choices and choices[0].get("delta", {}).get("content"):
            self.stamps.append(now)

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc)

    def _finish(self, exc: BaseException | None) -> None:
        if self.finished.done():
            return
        if exc is not None:
            self.finished.set_exception(exc)
        elif self.status != 200:
            self.finished.set_exception(StreamError(f"HTTP {self.status}: {self.error_body[:500].decode(errors='replace')}"))
        elif not self.done:
            self.finished.set_exception(StreamError("the stream ended without data: [DONE]"))
        else:
            self.finished.set_result(None)


async def stream_chat(url: str, model: str, messages: list[dict], output_tokens: int) -> dict:
    """One greedy streamed chat request with ignore_eos and usage; returns its start, the arrival time of each
    chunk with content, its end and the usage (as bench.stack_client.stream_chat, whose request it sends)."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise StreamError(f"bench.sse_client speaks plain http only, not {url!r}")
    body = msgspec.json.encode(chat_body(model, messages, output_tokens))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    started = time.perf_counter()
    transport, protocol = await loop.create_connection(lambda: _SseProtocol(finished), parts.hostname, parts.port or 80)
    try:
        transport.write(head + body)
        await finished
    finally:
        transport.close()
    return {"start": started, "stamps": protocol.stamps, "end": time.perf_counter(), "usage": protocol.usage}
