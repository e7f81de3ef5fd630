"""A stack whose worker gathers tokens over a stream interval (``--stream-interval 4``): the stream says
the same as the whole reply, token for token with logprobs, in chunks of at most four tokens whose first
is the first token alone, and a stop string found inside a gathered chunk ends the text where it ends
the whole reply."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import Stack, ask_tiny, tiny_model_stack

INTERVAL = 4


@pytest.fixture(scope="module")
def gathering_stack(tmp_path_factory) -> Stack:
    with tiny_model_stack(tmp_path_factory, "stream_interval", ["--stream-interval", str(INTERVAL)]) as stack:
        yield stack


@pytest.fixture(scope="module")
def oai(gathering_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gathering_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_gathered_stream_says_what_the_whole_reply_says_in_chunks_of_at_most_the_interval(gathering_stack: Stack, oai: openai.OpenAI) -> None:
    assert gathering_stack.instrumentation("worker")["stream_interval"] == INTERVAL
    whole = ask_tiny(oai, logprobs=True)
    chunks = [c for c in ask_tiny(oai, logprobs=True, stream=True) if c.choices and c.choices[0].logprobs]
    per_chunk = [c.choices[0].logprobs.content for c in chunks]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [t.token for tokens in per_chunk for t in tokens] == [t.token for t in whole.choices[0].logprobs.content]
    sizes = [len(tokens) for tokens in per_chunk]
    assert sum(sizes) == whole.usage.completion_tokens == 40
    assert sizes[0] == 1 and max(sizes) <= INTERVAL, sizes  # the first token at once; none waits a whole interval
    assert max(sizes) > 1, sizes  # gathered: fewer chunks than tokens


def test_a_stop_string_inside_a_gathered_chunk_ends_the_text_where_it_ends_the_whole_reply(oai: openai.OpenAI) -> None:
    seeded = {"temperature": 1.0, "seed": 7}  # varied text (greedy, this random model repeats one token)
    text = ask_tiny(oai, **seeded).choices[0].message.content
    stop = next(text[i : i + 3] for i in range(len(text) // 2, len(text) - 3) if text.find(text[i : i + 3]) == i and text[i : i + 3].strip())
    whole = ask_tiny(oai, stop=[stop], **seeded)
    streamed = list(ask_tiny(oai, stop=[stop], stream=True, **seeded))
    assert whole.choices[0].message.content == text[: text.find(stop)] and whole.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == ["stop"]
