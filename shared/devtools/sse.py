"""The streaming client of the tests and the benchmarks: one streamed OpenAI-compatible request over HTTP/1.1 on
an asyncio protocol (chunked or connection-delimited bodies, server-sent events, msgspec's JSON decoder), with
the arrival time of each chunk that carries text.

It is lean because the benchmarks run it on the cores of the stack they measure: it reads a stream for about
half the CPU of aiohttp's response reader. ``stream`` records any failure in its result (an HTTP error status,
an error event, a malformed event, a stream that ends without ``[DONE]``, a connection refused or lost, a
timeout); ``stream_chat`` raises it as a ``StreamError``.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

_decode = msgspec.json.Decoder().decode


class StreamError(RuntimeError):
    """The server answered with an error status or an error event, or the stream broke off."""


@dataclass
class Stream:
    """One streamed request as the client saw it; times are ``time.perf_counter()`` seconds."""

    start: float  # when the request was sent (connecting included)
    end: float | None = None  # when it ended, answered or not
    status: int | None = None  # the HTTP status; None when no answer arrived
    chunk_times: list[float] = field(default_factory=list)  # the arrival of each chunk that carried text
    chunk_chars: list[int] = field(default_factory=list)  # how many characters of text each of those carried
    usage: dict = field(default_factory=dict)  # the last usage reported (stream_options.include_usage)
    finish_reason: str | None = None
    error: str | None = None  # why the request failed; None when the stream ended with [DONE]


def _text(choice: dict) -> str:
    delta = choice.get("delta")
    if delta is not None:  # chat
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class _SseProtocol(asyncio.Protocol):
    """One request's response: the status line and headers, then a chunked (or connection-delimited) body of
    SSE lines, each ``data: {json}`` or ``data: [DONE]``."""

    def __init__(self, stream: Stream, finished: asyncio.Future) -> None:
        self.stream = stream
        self.finished = finished
        self.buffer = b""
        self.chunked = False
        self.lines = b""  # body bytes not yet split into lines
        self.done = False  # data: [DONE] seen
        self.body_complete = False  # the last chunk seen
        self.error_body = b""

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if self.finished.done():
            return
        self.buffer += data
        try:
            if self.stream.status is None and not self._read_head():
                return
            body = self._read_body()
            if self.stream.status == 200:
                self.lines += body
                *complete, self.lines = self.lines.split(b"\n")
                for line in complete:
                    self._on_line(line, now)
                    if self.finished.done():  # an error event ends the request
                        return
            else:
                self.error_body += body
        except (ValueError, TypeError, AttributeError, IndexError) as exc:  # msgspec's DecodeError is a ValueError
            self._fail(f"a malformed response: {exc}"[:300])
            return
        if self.body_complete:
            self._finish(None)

    def _read_head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            return False
        status_line, *headers = self.buffer[:end].decode("latin-1").split("\r\n")
        self.stream.status = int(status_line.split()[1])
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

    def _on_line(self, line: bytes, now: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return  # the blank line between events, a comment (keep-alive) or another field
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return
        chunk = _decode(payload)
        if chunk.get("error"):
            self._fail(f"stream error: {json.dumps(chunk['error'])}"[:300])
            return
        stream = self.stream
        if chunk.get("usage"):
            stream.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            text = _text(choice)
            if text:
                stream.chunk_times.append(now)
                stream.chunk_chars.append(len(text))
            if choice.get("finish_reason"):
                stream.finish_reason = choice["finish_reason"]

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(exc)

    def _fail(self, error: str) -> None:
        if not self.finished.done():
            self.stream.error = error
            self.finished.set_result(None)

    def _finish(self, exc: BaseException | None) -> None:
        if self.finished.done():
            return
        status = self.stream.status
        if exc is not None:
            self.stream.error = f"{type(exc).__name__}: {exc}"[:300]
        elif status is None:
            self.stream.error = "the connection closed before an answer"
        elif status != 200:
            self.stream.error = f"HTTP {status}: {self.error_body[:300].decode(errors='replace')}"
        elif not self.done:
            self.stream.error = "the stream ended without [DONE]"
        self.finished.set_result(None)


async def stream(url: str, path: str, body: dict, timeout_s: float | None = None) -> Stream:
    """POSTs ``body`` (a streamed request) to ``url`` + ``path`` on a connection of its own and reads the stream;
    every failure, ``timeout_s`` passing included, ends up in the result's ``error``, never raised."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"an http or https URL, not {url!r}")
    tls = ssl.create_default_context() if parts.scheme == "https" else None
    payload = msgspec.json.encode(body)
    head = (
        f"POST {parts.path.rstrip('/')}{path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    ).encode()
    loop = asyncio.get_running_loop()
    finished = loop.create_future()
    result = Stream(start=time.perf_counter())
    transport = None
    try:
        async with asyncio.timeout(timeout_s):
            transport, _ = await loop.create_connection(lambda: _SseProtocol(result, finished), parts.hostname, parts.port or (443 if tls else 80), ssl=tls)
            transport.write(head + payload)
            await finished
    except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        if transport is not None:
            transport.close()
    result.end = time.perf_counter()
    return result


def chat_body(model: str, messages: list[dict], output_tokens: int) -> dict:
    """The benchmarks' chat request: greedy, ``output_tokens`` with ignore_eos, streamed with usage."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(url: str, model: str, messages: list[dict], output_tokens: int) -> Stream:
    """One greedy streamed chat request of ``output_tokens`` with ignore_eos and usage (``chat_body``); raises
    ``StreamError`` if it failed."""
    result = await stream(url, "/v1/chat/completions", chat_body(model, messages, output_tokens))
    if result.error is not None:
        raise StreamError(result.error)
    return result
