"""A tiny OpenAI-compatible streaming server for bench.serve's tests, run in a background thread.

It streams ``max_tokens`` tokens (``tokens_per_chunk`` per SSE chunk, as llama.cpp may), closes with a usage
chunk and ``[DONE]``, and can be told to fail given requests (by arrival order) in the ways a real server does.
Told to, its /metrics counts one verify per finished request as a speculating worker's would.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class FakeBehaviour:
    tokens_per_chunk: int = 1
    http_error_on: set[int] = field(default_factory=set)  # arrival indices answered with HTTP 500
    short_on: set[int] = field(default_factory=set)  # arrival indices that stop 2 tokens early
    stream_error_on: set[int] = field(default_factory=set)  # arrival indices that send an error event mid-stream
    no_done_on: set[int] = field(default_factory=set)  # arrival indices whose stream ends without [DONE]
    usage: bool = True
    verify: tuple[int, int] | None = None  # (proposed, accepted) tokens each finished request adds to /metrics' speculation counters


class FakeOpenAI:
    def __init__(self, behaviour: FakeBehaviour | None = None, model: str = "fake-model", port: int = 0) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        self.model = model
        self.port = port
        self.bodies: list[tuple[str, dict]] = []  # (path, body) in arrival order
        self.finished = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.behaviour.verify is None:
            return web.Response(text="")
        proposed, accepted = self.behaviour.verify
        counts = {"drafts": self.finished, "draft_tokens": proposed * self.finished, "accepted_tokens": accepted * self.finished}
        return web.Response(
            text="".join(f"# TYPE tokenyard:spec_decode_num_{name} counter\ntokenyard:spec_decode_num_{name}_total {value}\n" for name, value in counts.items())
        )

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        arrival = len(self.bodies)
        self.bodies.append((request.path, body))
        b = self.behaviour
        if arrival in b.http_error_on:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        chat = request.path.endswith("chat/completions")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload: dict) -> None:
            await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

        total = body["max_tokens"] - (2 if arrival in b.short_on else 0)
        sent = 0
        while sent < total:
            n = min(b.tokens_per_chunk, total - sent)
            text = "".join(f" t{sent + i}" for i in range(n))
            sent += n
            finish = ("length" if body.get("ignore_eos") or sent == body["max_tokens"] else "stop") if sent == total else None
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat else {"index": 0, "text": text, "finish_reason": finish}
            await send({"object": "chat.completion.chunk", "model": self.model, "choices": [choice]})
            if arrival in b.stream_error_on and sent >= 1:
                await send({"error": {"message": "engine failed", "code": 503}})
                break
            await asyncio.sleep(0.001)
        if b.usage and arrival not in b.stream_error_on:
            await send({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": sent, "total_tokens": 7 + sent}})
        if arrival not in b.no_done_on:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        self.finished += 1
        return response
