"""shared.devtools.sse: the streaming client reads each chunk's text, the usage and the finish reason of chat and
completions streams, and records (or, through stream_chat, raises) every failure clearly."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from shared.devtools import sse
from tests.bench.fake_openai import FakeBehaviour, FakeOpenAI

ASK = [{"role": "user", "content": "hi"}]


def _chat(behaviour: FakeBehaviour, tokens: int) -> sse.Stream:
    with FakeOpenAI(behaviour) as server:
        return asyncio.run(sse.stream_chat(server.url, "fake-model", ASK, tokens))


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_it_times_each_chunk_with_text_and_keeps_the_usage_and_finish_reason(per_chunk: int) -> None:
    run = _chat(FakeBehaviour(tokens_per_chunk=per_chunk), 40)
    assert len(run.chunk_times) == len(run.chunk_chars) == -(-40 // per_chunk)
    assert sum(run.chunk_chars) == len("".join(f" t{i}" for i in range(40)))
    assert run.usage == {"prompt_tokens": 7, "completion_tokens": 40, "total_tokens": 47}
    assert (run.status, run.finish_reason, run.error) == (200, "length", None)
    assert run.start <= run.chunk_times[0] and run.chunk_times == sorted(run.chunk_times) and run.chunk_times[-1] <= run.end


def test_a_completions_stream_under_a_path_prefix_is_read_as_a_chat_one() -> None:
    with FakeOpenAI() as server:
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
        run = asyncio.run(sse.stream(server.url + "/v1/", "/completions", body))
        assert server.bodies == [("/v1/completions", body)]
    assert len(run.chunk_times) == 5 and run.usage["completion_tokens"] == 5 and run.error is None


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        (FakeBehaviour(http_error_on={0}), "HTTP 500: .*boom"),
        (FakeBehaviour(stream_error_on={0}), "stream error: .*engine failed"),
        (FakeBehaviour(no_done_on={0}), r"ended without \[DONE\]"),
    ],
    ids=["http-error", "error-event", "no-done"],
)
def test_a_failed_stream_is_a_clear_error(behaviour: FakeBehaviour, message: str) -> None:
    with pytest.raises(sse.StreamError, match=message):
        _chat(behaviour, 8)


def test_a_refused_connection_and_a_timeout_are_recorded_not_raised() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"  # bound, never listening: refused
    refused = asyncio.run(sse.stream(closed, "/v1/chat/completions", sse.chat_body("m", ASK, 4)))
    assert refused.status is None and refused.error.startswith("ConnectionRefusedError")

    async def run() -> sse.Stream:
        answer = asyncio.Event()

        async def silent(request: web.Request) -> web.Response:
            await answer.wait()
            return web.Response()

        app = web.Application()
        app.router.add_post("/v1/chat/completions", silent)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            url = f"http://127.0.0.1:{runner.addresses[0][1]}"
            return await sse.stream(url, "/v1/chat/completions", sse.chat_body("m", ASK, 4), timeout_s=0.2)
        finally:
            answer.set()
            await runner.cleanup()

    slow = asyncio.run(run())
    assert slow.status is None and slow.error.startswith("TimeoutError") and slow.end - slow.start < 5


def test_only_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="http or https"):
        asyncio.run(sse.stream("ftp://127.0.0.1:1", "/v1/chat/completions", {}))
