"""A stack that speculates with a draft model (``--speculative-method draft --draft-model DIR``): the flags reach the
scheduler and the worker, whose /instrumentation say so; greedy replies through the api are the same text whether
their decodes verify the draft's proposals or not, alone or side by side; the draft here is the model itself, so
nearly every proposal is accepted; and once the replies are done no draft block is held. The KV cache is sized in
bytes: the draft's pool holds as many blocks as the target's, on the scheduler and the worker alike."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from shared.devtools.random_model import build_random_smollm
from shared.model_info import load_model_info
from tests.e2e.conftest import TINY_MODEL, Stack, metric_value, tiny_model_stack

K = 3
KV_TOKENS = 1536  # the KV cache's size in fp32 tokens, given in bytes


@pytest.fixture(scope="module")
def draft_stack(tmp_path_factory) -> Stack:
    draft = build_random_smollm(str(tmp_path_factory.mktemp("draft") / "draft"))  # seeded: the served model's weights and tokenizer
    kv_cache_bytes = KV_TOKENS * load_model_info(draft).kv_bytes_per_token("auto")  # the served model has the draft's shapes
    flags = ["--speculative-method", "draft", "--draft-model", draft, "--num-speculative-tokens", str(K), "--kv-cache-bytes", str(kv_cache_bytes)]
    with tiny_model_stack(tmp_path_factory, "draft", flags) as stack:
        yield stack


@pytest.fixture(scope="module")
def oai(draft_stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{draft_stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(oai: openai.OpenAI, content: str, min_tokens: int = 0):
    """30 greedy tokens (ignore_eos); with ``min_tokens`` 30 a stop token could not end a run: it never speculates."""
    return oai.chat.completions.create(
        model=TINY_MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": min_tokens},
    )


def test_greedy_replies_are_the_same_with_and_without_the_drafts_proposals(draft_stack: Stack, oai: openai.OpenAI) -> None:
    scheduler = draft_stack.instrumentation("scheduler")
    speculative, draft = scheduler["speculative"], draft_stack.instrumentation("worker")["runner"]["speculative"]["draft"]
    assert speculative["method"] == "draft" and speculative["num_speculative_tokens"] == K
    assert draft["model"].endswith("draft")
    # the worker's KV count from the byte budget (its cache's dtype sets the tokens per byte), not --kv-cache-tokens' 4096 // 8
    assert speculative["draft_kv_blocks_total"] == draft["kv_blocks"] == scheduler["kv_blocks_total"] != 4096 // 8
    before = {name: metric_value(draft_stack.metrics("worker"), f"tokenyard:spec_decode_num_{name}_total", 0.0) for name in ("draft_tokens", "accepted_tokens")}
    prompts = ["tell me a story", "count to ten", "what is a draft model"]
    plain = [ask(oai, prompt, min_tokens=30).choices[0].message.content for prompt in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:  # side by side: verifies in mixed batches
        speculated = [reply.choices[0].message.content for reply in pool.map(lambda prompt: ask(oai, prompt), prompts)]
    assert speculated == plain
    metrics = draft_stack.metrics("worker")
    proposed = metric_value(metrics, "tokenyard:spec_decode_num_draft_tokens_total") - before["draft_tokens"]
    accepted = metric_value(metrics, "tokenyard:spec_decode_num_accepted_tokens_total") - before["accepted_tokens"]
    assert proposed > 0 and accepted >= 0.9 * proposed  # the model as its own draft proposes its own tokens
    assert draft_stack.instrumentation("scheduler")["speculative"]["draft_kv_blocks_used"] == 0
