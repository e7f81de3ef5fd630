"""A GGUF file served end to end: a tiny random qwen3moe written in llama.cpp's layout with Q4_0 projections and
experts (tests/worker/gguf_files.py) is the --model of every process; its experts run in their blocks in one
grouped call per layer, and the stack's greedy tokens are transformers' on the values the file holds."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker.linear import block_formats
from shared.devtools.stack import free_port_block
from tests.e2e.conftest import Stack, http_post, launched_stack, wait_healthy
from tests.worker.gguf_files import tiny_gguf
from tests.worker.harness import prompt_of, reference_greedy

pytestmark = pytest.mark.skipif(not block_formats(torch.device("cpu"), torch.float32), reason="the C++ CPU kernels are unavailable here")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Stack, object]]:
    tmp = tmp_path_factory.mktemp("gguf")
    path, reference = tiny_gguf("qwen3_moe", str(tmp), {"matrices": Q.Q4_0}, norm_topk_prob=True, num_hidden_layers=2)
    flags = ["--model", path, "--num-threads", "1", "--kv-cache-tokens", "1024", "--block-size", "8"]
    with launched_stack(free_port_block(), flags, str(tmp / "stack.log")) as stack:
        wait_healthy(stack, 300)
        yield stack, reference


def test_the_worker_serves_the_files_experts_in_their_blocks(served) -> None:
    stack, _ = served
    runner = stack.instrumentation("worker")["runner"]
    assert runner["family"] == "qwen3_moe" and runner["expert_weights"] == {"q4_0: grouped_moe (C++, one call per layer)": 2}


def test_greedy_tokens_are_transformers_on_the_files_values(served) -> None:
    stack, reference = served
    prompt = prompt_of(3, 12)
    body = {"model": "model.gguf", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    status, answer = http_post(f"{stack.base_url}/v1/completions", json.dumps(body).encode())
    assert status == 200, answer
    logprobs = json.loads(answer)["choices"][0]["logprobs"]
    theirs = reference_greedy(reference, prompt, 10, min_margin=1e-3)
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([prompt + theirs])).logits[0, len(prompt) - 1 : -1].float(), -1)
    expected = expected.gather(1, torch.tensor(theirs)[:, None])[:, 0].tolist()
    # the vocabulary is bytes: an ASCII token's text is its byte; every token's log-probability is transformers'
    assert [t for t, tid in zip(logprobs["tokens"], theirs) if tid < 128] == [chr(tid) for tid in theirs if tid < 128]
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-2)
