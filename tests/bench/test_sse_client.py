"""bench.sse_client: the lean client reads what aiohttp's does, and fails as clearly."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from bench import sse_client
from bench.stack_client import stream_chat
from tests.bench.fake_openai import FakeBehaviour, FakeOpenAI

ASK = [{"role": "user", "content": "hi"}]


def _both(behaviour: FakeBehaviour, tokens: int) -> tuple[dict, dict]:
    async def run(url: str) -> tuple[dict, dict]:
        lean = await sse_client.stream_chat(url, "fake-model", ASK, tokens)
        async with aiohttp.ClientSession() as session:
            reference = await stream_chat(session, url, "fake-model", ASK, tokens)
        return lean, reference

    with FakeOpenAI(behaviour) as server:
        return asyncio.run(run(server.url))


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_it_reads_the_chunks_with_content_and_the_usage_as_aiohttp_does(per_chunk: int) -> None:
    lean, reference = _both(FakeBehaviour(tokens_per_chunk=per_chunk), 40)
    assert len(lean["stamps"]) == len(reference["stamps"]) == -(-40 // per_chunk)
    assert lean["usage"] == reference["usage"] == {"prompt_tokens": 7, "completion_tokens": 40, "total_tokens": 47}
    assert lean["start"] <= lean["stamps"][0] and lean["stamps"] == sorted(lean["stamps"]) and lean["stamps"][-1] <= lean["end"]


@pytest.mark.parametrize(
    ("behaviour", "message"),
    [
        (FakeBehaviour(http_error_on={0}), "HTTP 500: .*boom"),
        (FakeBehaviour(stream_error_on={0}), "error event: .*engine failed"),
        (FakeBehaviour(no_done_on={0}), r"ended without data: \[DONE\]"),
    ],
    ids=["http-error", "error-event", "no-done"],
)
def test_a_failed_stream_is_a_clear_error(behaviour: FakeBehaviour, message: str) -> None:
    async def run(url: str) -> None:
        await sse_client.stream_chat(url, "fake-model", ASK, 8)

    with FakeOpenAI(behaviour) as server, pytest.raises(sse_client.StreamError, match=message):
        asyncio.run(run(server.url))


def test_only_plain_http_is_spoken() -> None:
    with pytest.raises(sse_client.StreamError, match="plain http only"):
        asyncio.run(sse_client.stream_chat("https://127.0.0.1:1", "fake-model", ASK, 8))
