"""Penalties, logit_bias and logprobs through the whole stack with the official openai SDK: accepted,
honoured by the worker, and shaped as the OpenAI API shapes them, streamed or not."""

from __future__ import annotations

import openai
import pytest

from shared.config import DEFAULT_MODEL_DIR
from shared.tokenizer import load_tokenizer
from tests.e2e.conftest import Stack

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def oai(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_logprobs_streamed_and_not(oai: openai.OpenAI) -> None:
    reply = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    assert b"".join(bytes(t.bytes) for t in content).decode() == reply.choices[0].message.content
    for token in content:
        assert [a.logprob for a in token.top_logprobs] == sorted((a.logprob for a in token.top_logprobs), reverse=True)
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        # greedy picks the most likely token of the distribution the logprobs describe
        assert (token.token, token.logprob) == (token.top_logprobs[0].token, token.top_logprobs[0].logprob)
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.bytes) for t in streamed] == [(t.token, t.bytes) for t in content]
    # The second run reads its prompt from the prefix cache, so its steps have other row counts: GEMM
    # summation order (and the fp16 KV rounding of cached positions) moves logprobs by ~3e-4, no more.
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=2e-3)


def test_completion_logprobs(oai: openai.OpenAI) -> None:
    reply = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text and len(logprobs.tokens) == 5
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == logprob and max(top.values()) == logprob and 2 <= len(top) <= 3


def test_logit_bias_forces_and_bans_tokens(oai: openai.OpenAI) -> None:
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    reply = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0.8, seed=1, logit_bias={str(forced): 100})
    assert reply.choices[0].text == tokenizer.decode([forced] * 4)
    greedy = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logprobs=0)
    first = tokenizer.encode(greedy.choices[0].text, add_special_tokens=False)[0]
    banned = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1, temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text != greedy.choices[0].text


def test_penalties_apply_to_the_tokens_they_document(oai: openai.OpenAI) -> None:
    def first_logprob(**penalties: float) -> tuple[str, float, str]:
        reply = oai.completions.create(
            model=MODEL, prompt="one two one two one two one", max_tokens=12, temperature=0, logprobs=0, extra_body=penalties or None
        )
        return reply.choices[0].logprobs.tokens[0], reply.choices[0].logprobs.token_logprobs[0], reply.choices[0].text

    token, logprob, plain = first_logprob()
    # presence and frequency count output tokens only: the first token is not penalised
    assert first_logprob(presence_penalty=2.0, frequency_penalty=2.0)[:2] == (token, pytest.approx(logprob, abs=1e-4))
    assert first_logprob(presence_penalty=2.0, frequency_penalty=2.0)[2] != plain  # later tokens are
    # the repetition penalty counts the prompt too: the prompt's words are already penalised at the first token
    repeated = first_logprob(repetition_penalty=1.8)
    assert (repeated[0], repeated[1]) != (token, pytest.approx(logprob, abs=1e-4))


def test_responses_output_text_logprobs(oai: openai.OpenAI) -> None:
    response = oai.responses.create(
        model=MODEL, input="Name three colours.", max_output_tokens=8, temperature=0, include=["message.output_text.logprobs"], top_logprobs=2
    )
    logprobs = response.output[0].content[0].logprobs
    assert b"".join(bytes(t.bytes) for t in logprobs).decode() == response.output_text and len(logprobs) == 8
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == t.logprob for t in logprobs)
