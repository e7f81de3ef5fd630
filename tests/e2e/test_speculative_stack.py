"""A stack that speculates (``--speculative-method ngram``): the flags reach the scheduler and the worker, whose
/instrumentation say so; a greedy reply is the same text whether its decodes verify proposals or not (a request
whose ``min_tokens`` are not out decodes plainly), streamed or whole; a stop string inside an accepted run ends
the text there; and the worker counts drafts and accepted tokens under vLLM's names."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import TINY_MODEL, Stack, metric_value, tiny_model_stack

K = 4


@pytest.fixture(scope="module")
def speculative_stack(tmp_path_factory) -> Stack:
    with tiny_model_stack(tmp_path_factory, "speculative", ["--speculative-method", "ngram", "--num-speculative-tokens", str(K), "--ngram-min", "1"]) as stack:
        yield stack


@pytest.fixture(scope="module")
def oai(speculative_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{speculative_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(oai: openai.OpenAI, min_tokens: int = 0, **kwargs):
    """40 greedy tokens (ignore_eos) of the random tiny model, which falls into loops that prompt lookup guesses."""
    return oai.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": "say something over and over"}],
        max_tokens=40,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": min_tokens},
        **kwargs,
    )


def test_greedy_replies_are_the_same_with_and_without_verified_proposals(speculative_stack: Stack, oai: openai.OpenAI) -> None:
    assert speculative_stack.instrumentation("scheduler")["speculative"] == {"method": "ngram", "num_speculative_tokens": K, "max_batch": 4}
    assert speculative_stack.instrumentation("worker")["runner"]["speculative"]["method"] == "ngram"
    before = metric_value(speculative_stack.metrics("worker"), "tokenyard:spec_decode_num_accepted_tokens_total", 0.0)
    speculated = ask(oai)
    plain = ask(oai, min_tokens=40)  # a stop token could not end it inside a run: it never speculates
    streamed = "".join(c.choices[0].delta.content or "" for c in ask(oai, stream=True) if c.choices)
    assert speculated.usage.completion_tokens == plain.usage.completion_tokens == 40
    assert speculated.choices[0].message.content == plain.choices[0].message.content == streamed
    metrics = speculative_stack.metrics("worker")
    assert metric_value(metrics, "tokenyard:spec_decode_num_accepted_tokens_total") > before
    assert metric_value(metrics, "tokenyard:spec_decode_num_drafts_total") > 0
    assert metric_value(metrics, "tokenyard:spec_decode_num_draft_tokens_total") >= metric_value(metrics, "tokenyard:spec_decode_num_accepted_tokens_total")


def test_a_stop_string_inside_an_accepted_run_ends_the_reply_at_its_token(oai: openai.OpenAI) -> None:
    text = ask(oai).choices[0].message.content
    assert text == "\n" * 40  # greedy, this random model repeats one token: every proposal is accepted
    whole = ask(oai, stop=["\n" * 6])
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason, whole.usage.completion_tokens) == ("", "stop", 6)
