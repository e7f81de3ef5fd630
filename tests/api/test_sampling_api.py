"""Penalties, logit_bias and logprobs on chat and completions, through the openai SDK around a scripted engine:
the engine receives them as asked, logprobs come back in the OpenAI shapes, streamed or not."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import Api

pytestmark = pytest.mark.asyncio(loop_scope="module")

ASK = [{"role": "user", "content": "Count."}]


async def test_penalties_and_logit_bias_reach_the_engine(smol: Api) -> None:
    await smol.openai().chat.completions.create(
        model=smol.model,
        messages=ASK,
        presence_penalty=0.5,
        frequency_penalty=-1.25,
        logit_bias={"42": -100, "7": 3.5},
        extra_body={"repetition_penalty": 1.3},
    )
    sampling = smol.engine.submits[-1].sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty) == (0.5, -1.25, 1.3)
    assert sampling.logit_bias == {42: -100.0, 7: 3.5} and sampling.logprobs is None
    await smol.openai().completions.create(model=smol.model, prompt="x", frequency_penalty=2, logit_bias={"0": 1})
    assert smol.engine.submits[-1].sampling.frequency_penalty == 2 and smol.engine.submits[-1].sampling.logit_bias == {0: 1.0}


async def test_chat_logprobs_have_the_openai_shape(smol: Api) -> None:
    smol.engine.script("Hi", " there", "!")
    reply = await smol.openai().chat.completions.create(model=smol.model, messages=ASK, logprobs=True, top_logprobs=2)
    assert smol.engine.submits[-1].sampling.logprobs == 2
    content = reply.choices[0].logprobs.content
    assert [t.token for t in content] == ["Hi", " there", "!"]
    assert [t.logprob for t in content] == [-0.1, -0.2, -0.3]
    assert content[1].bytes == list(b" there")
    assert [[a.token for a in t.top_logprobs] for t in content] == [["Hi", "alt1"], [" there", "alt1"], ["!", "alt1"]]
    smol.engine.script("Hi")
    reply = await smol.openai().chat.completions.create(model=smol.model, messages=ASK, logprobs=True)
    assert smol.engine.submits[-1].sampling.logprobs == 0 and reply.choices[0].logprobs.content[0].top_logprobs == []
    reply = await smol.openai().chat.completions.create(model=smol.model, messages=ASK)
    assert reply.choices[0].logprobs is None


async def test_streamed_chat_logprobs_cover_every_token_even_when_a_parser_holds_text(qwen: Api) -> None:
    pieces = ("<thi", "nk>", "Hmm", "</think>", "Yes", ".")
    qwen.engine.script(*pieces)
    stream = await qwen.openai().chat.completions.create(model=qwen.model, messages=ASK, logprobs=True, top_logprobs=1, stream=True)
    chunks = [c async for c in stream]
    tokens = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == list(pieces)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Yes."


async def test_completion_logprobs_streamed_or_not(smol: Api) -> None:
    smol.engine.script("ab", "c", "de")
    reply = await smol.openai().completions.create(model=smol.model, prompt="x", logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == ["ab", "c", "de"] and logprobs.token_logprobs == [-0.1, -0.2, -0.3]
    assert logprobs.text_offset == [0, 2, 3]
    assert logprobs.top_logprobs[0] == {"ab": -0.1, "alt1": pytest.approx(-1.1)}
    smol.engine.script("ab", "c", "de")
    stream = await smol.openai().completions.create(model=smol.model, prompt="x", logprobs=0, stream=True)
    parts = [c.choices[0].logprobs for c in [c async for c in stream] if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == ["ab", "c", "de"]
    assert [o for p in parts for o in p.text_offset] == [0, 2, 3]
    assert all(top == {tok: lp} for p in parts for tok, lp, top in zip(p.tokens, p.token_logprobs, p.top_logprobs))


async def test_logprobs_refusals_name_the_field(smol: Api) -> None:
    cases = [
        ({"prompt": "x", "logprobs": True}, "logprobs"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": 1, "echo": True}, "logprobs"),
        ({"prompt": "x", "logit_bias": {"49152": 1}}, "logit_bias"),
        ({"prompt": "x", "presence_penalty": -2.1}, "presence_penalty"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            await smol.openai().completions.create(model=smol.model, **extra)
        assert error.value.body["param"] == param, extra
