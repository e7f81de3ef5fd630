"""The default model (SmolLM2-135M-Instruct, fp32) against transformers: logits of a prompt and 32
greedy tokens, alone and four requests batched with chunked prefill and mixed steps."""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaForCausalLM

from services.worker.runner import ModelRunner, RunnerConfig
from shared.config import DEFAULT_MODEL_DIR
from shared.frames import Slice, StepPlan

from .harness import GREEDY, drive, reference_greedy

MAX_NEW = 32
PROMPTS = {
    "capital": "The capital of France is",
    "recipe": "To bake bread you need flour, water,",
    "code": "def fibonacci(n):",
    "story": "Once upon a time, in a small village by the sea, there lived",
}


class SmolLM2:
    """transformers' model on the default checkpoint, the test prompts, and their greedy references (memoised)."""

    def __init__(self) -> None:
        tokenizer = Tokenizer.from_file(os.path.join(DEFAULT_MODEL_DIR, "tokenizer.json"))
        self.prompts = {rid: tokenizer.encode(text).ids for rid, text in PROMPTS.items()}
        self.reference = LlamaForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
        self._greedy: dict[str, list[int]] = {}

    def greedy(self, rid: str) -> list[int]:
        if rid not in self._greedy:
            self._greedy[rid] = reference_greedy(self.reference, self.prompts[rid], MAX_NEW)
        return self._greedy[rid]


@pytest.fixture(scope="module")
def smollm2() -> SmolLM2:
    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
        pytest.fail(f"the default model is missing at {DEFAULT_MODEL_DIR}: run `make setup` to convert it")
    return SmolLM2()


def test_logits_and_greedy_tokens_match_transformers_alone(smollm2: SmolLM2) -> None:
    prompt = smollm2.prompts["capital"]
    runner = ModelRunner(RunnerConfig(DEFAULT_MODEL_DIR, num_blocks=32, block_size=4))
    blocks = [17, 4, 29, 0, 11, 8]
    ours = runner.logits(StepPlan(0, [Slice("l", 0, len(prompt), prompt, blocks[: -(-len(prompt) // 4)], sampling=GREEDY)]))["l"]
    with torch.no_grad():
        theirs = smollm2.reference(torch.tensor([prompt])).logits[0, -1]
    assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-4
    runner.release(["l"])

    out, _ = drive(runner, {"capital": prompt}, MAX_NEW, chunk=3)
    assert out["capital"] == smollm2.greedy("capital")


def test_greedy_tokens_match_transformers_in_a_mixed_batch(smollm2: SmolLM2) -> None:
    runner = ModelRunner(RunnerConfig(DEFAULT_MODEL_DIR, num_blocks=96, block_size=4))
    arrivals = {"capital": 0, "recipe": 0, "code": 2, "story": 4}
    out, stats = drive(runner, smollm2.prompts, MAX_NEW, chunk=4, seed=5, arrivals=arrivals)
    assert stats.mixed_steps >= 2
    for rid in PROMPTS:
        assert out[rid] == smollm2.greedy(rid), rid
