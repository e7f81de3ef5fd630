"""A stack that speculates (``--speculative-method ngram``): the flags reach the scheduler and the worker, whose
/instrumentation say so; a greedy reply is the same text whether its decodes verify proposals or not (a request
whose ``min_tokens`` are not out decodes plainly), streamed or whole; a stop string inside an accepted run ends
the text there; and the worker counts drafts and accepted tokens under vLLM's names. A hybrid model (qwen3_next)
answers the same with and without speculation, by prompt lookup or its own MTP layer, one request at a time and
several side by side."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from shared.devtools.random_model import build_random_qwen3_next
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import TINY_MODEL, Stack, launched_stack, metric_value, tiny_model_stack, wait_healthy

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
    facts = speculative_stack.instrumentation("scheduler")["speculative"]
    assert {key: facts[key] for key in ("method", "num_speculative_tokens", "max_batch")} == {"method": "ngram", "num_speculative_tokens": K, "max_batch": 4}
    assert {"plain_step_ms", "position_ms", "position_cost"} <= facts.keys()
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


HYBRID = "tiny-qwen3-next"


@pytest.fixture(scope="module", params=["ngram", "mtp"])
def hybrid_stack(request, tmp_path_factory) -> Stack:
    """A tiny random qwen3_next that speculates by prompt lookup or with its own (random) MTP layer: its verifies roll
    its GDN state back past rejected tokens."""
    tmp = tmp_path_factory.mktemp(f"speculative_hybrid_{request.param}")
    # Greedy, it falls into runs of one token, and out of them.
    model = build_random_qwen3_next(str(tmp / HYBRID), initializer_range=0.055, mtp=request.param == "mtp")
    flags = ["--model", model, "--num-threads", "1", "--kv-cache-tokens", "4096", "--speculative-method", request.param, "--num-speculative-tokens", str(K)]
    with launched_stack(free_port_block(), [*flags, "--ngram-min", "1"], str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        yield stack


def test_a_hybrid_model_answers_the_same_with_and_without_verified_proposals_alone_and_side_by_side(hybrid_stack: Stack) -> None:
    oai = openai.OpenAI(base_url=f"{hybrid_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def answer(content: str, min_tokens: int = 0) -> str:
        # A seed fixes the cost the scheduler takes for a verified position, so which steps verify, and how many
        # positions, follow the tokens alone and not this machine's step times.
        reply = oai.chat.completions.create(
            model=HYBRID,
            messages=[{"role": "user", "content": content}],
            max_tokens=32,
            temperature=0,
            seed=0,
            extra_body={"ignore_eos": True, "min_tokens": min_tokens},
        )
        return reply.choices[0].message.content

    prompts = ["say something over and over", "count to ten, then back", "repeat after me: la la la"]
    plain = [answer(p, min_tokens=32) for p in prompts]  # a stop token could not end it inside a run: it never speculates
    assert [answer(p) for p in prompts] == plain
    with ThreadPoolExecutor(len(prompts)) as pool:  # verifies beside each other's prefills and decodes
        assert list(pool.map(answer, prompts)) == plain
    metrics = hybrid_stack.metrics("worker")
    drafted, accepted = (metric_value(metrics, f"tokenyard:spec_decode_num_{name}_total") for name in ("draft_tokens", "accepted_tokens"))
    if hybrid_stack.instrumentation("worker")["runner"]["speculative"]["method"] == "ngram":
        # Prompt lookup's guesses in this model's runs of one token hold, and may all hold: a run may reject nothing
        # (tests/scheduler/test_speculative_outputs.py rolls back rejected runs of every family for sure).
        assert 0 < accepted <= drafted, (accepted, drafted)
    else:
        assert accepted < drafted, (accepted, drafted)  # verifies rolled back past rejected tokens (a random MTP layer's guesses rarely hold)
