"""A MoE model served through the whole stack from a bank of two expert slots (``--expert-cache-bytes``, one
layer's top-k of 16 experts): a tiny random qwen3moe GGUF with Q4_0 experts, four greedy requests at once
(chunked prefills beside decodes), each equal to transformers on the file's values; the worker's
/instrumentation and /metrics show the cache at work."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker.linear import block_formats
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, http_post, launched_stack, metric_value, wait_healthy
from tests.worker.gguf_files import tiny_gguf
from tests.worker.harness import prompt_of, reference_greedy

pytestmark = pytest.mark.skipif(not block_formats(torch.device("cpu"), torch.float32), reason="the C++ CPU kernels are unavailable here")

SLOT_BYTES = 4096  # Q4_0 gate_up [64, 64] and down [64, 32] (18 bytes per block of 32: 3456) padded to a page


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Stack, object]]:
    tmp = tmp_path_factory.mktemp("experts")
    path, reference = tiny_gguf("qwen3_moe", str(tmp), {"matrices": Q.Q4_0}, norm_topk_prob=True, num_hidden_layers=2)
    flags = ["--model", path, "--num-threads", "1", "--kv-cache-tokens", "1024", "--block-size", "8", "--max-num-batched-tokens", "16"]
    flags += ["--expert-cache-bytes", "12.5%", "--expert-cache-dir", str(tmp / "store")]
    with launched_stack(free_port_block(), flags, str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        yield stack, reference


def test_concurrent_greedy_requests_from_two_expert_slots_are_transformers_tokens(served) -> None:
    stack, reference = served
    prompts = [prompt_of(20 + i, n) for i, n in enumerate((5, 12, 19, 30))]

    def complete(prompt: list[int]) -> list[int]:
        body = {"model": "model.gguf", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        status, answer = http_post(f"{stack.base_url}/v1/completions", json.dumps(body).encode())
        assert status == 200, answer
        return json.loads(answer)["choices"][0]["logprobs"]["tokens"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(complete, prompts))
    for prompt, tokens in zip(prompts, answers):
        theirs = reference_greedy(reference, prompt, 12, min_margin=1e-3)
        # the vocabulary is bytes: an ASCII token's text is its byte
        assert [t for t, tid in zip(tokens, theirs) if tid < 128] == [chr(tid) for tid in theirs if tid < 128]
        assert len(tokens) == 12

    cache = stack.instrumentation("worker")["runner"]["expert_cache"]
    assert (cache["slots"], cache["slot_bytes"], cache["experts"], cache["fill_policy"], cache["policy"]) == (2, SLOT_BYTES, 16, "auto", "lfu")
    assert cache["streamed_prefill"].startswith("off (the bank's 2 slots") and cache["layer_steps"]["streamed"] == 0
    assert cache["misses"] > 16 and cache["evictions"] > 0 and 0 <= cache["hit_rate"] < 1
    assert cache["store_reads"] == "O_DIRECT" or cache["store_reads"].startswith("buffered + DONTNEED (")
    assert cache["fills"] == ("in C++ (the one-call decoder's without Python)" if cache["reads_in_flight"] == "native AIO" else "in Python")
    assert "expert_cache" in stack.log() and cache["store_reads"] in stack.log()  # the worker says at start how it reads its store
    metrics = stack.metrics("worker")
    assert metric_value(metrics, "tokenyard:expert_cache_misses_total") == cache["misses"]
    assert metric_value(metrics, "tokenyard:expert_cache_bytes_read_total") == cache["misses"] * SLOT_BYTES
    assert metric_value(metrics, "tokenyard:expert_cache_slots_total") == 2
