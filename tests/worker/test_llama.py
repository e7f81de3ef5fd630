"""The llama family against transformers on tiny random checkpoints: logits and greedy continuations
through paged KV, chunked prefill and mixed batches."""

from __future__ import annotations

import random

import torch

from services.worker.runner import ModelRunner
from shared.frames import Slice, StepPlan

from .harness import GREEDY, Checkpoint, drive, reference_greedy

MAX_NEW = 32


def _prompt(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(3, 256), k=length)


def _rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).norm() / theirs.norm()).item()


def test_logits_match_transformers_after_chunked_prefill_and_in_decode(tiny: Checkpoint) -> None:
    prompt = _prompt(0, 23)
    runner = ModelRunner(tiny.path, num_blocks=16, block_size=4)
    blocks = [11, 3, 7, 0, 14, 5, 9]
    for i, start in enumerate(range(0, 20, 5)):  # four chunks of 5 that do not sample, then 3 that do
        new = blocks[-(-start // 4) : -(-(start + 5) // 4)]
        plan = StepPlan(i, [Slice("r", start, 5, prompt[start : start + 5], new, sample=False, sampling=GREEDY if i == 0 else None)])
        assert runner.execute(plan).sampled == []
    last_chunk = StepPlan(4, [Slice("r", 20, 3, prompt[20:], blocks[5:6])])
    ours = runner.logits(last_chunk)["r"]
    with torch.no_grad():
        theirs = tiny.reference(torch.tensor([prompt])).logits[0, -1]
    assert _rel_err(ours, theirs) <= 1e-4

    # A decode slice feeds back the last sampled token: sample it, then check the next logits.
    token = runner.execute(StepPlan(5, [Slice("r", 20, 3, prompt[20:])])).sampled[0].token_id
    assert token == int(theirs.argmax())
    ours = runner.logits(StepPlan(6, [Slice("r", 23, 1, new_blocks=blocks[6:7])]))["r"]
    with torch.no_grad():
        theirs = tiny.reference(torch.tensor([prompt + [token]])).logits[0, -1]
    assert _rel_err(ours, theirs) <= 1e-4


def test_greedy_matches_transformers_generate_alone(tiny: Checkpoint) -> None:
    prompt = _prompt(1, 11)
    runner = ModelRunner(tiny.path, num_blocks=32, block_size=4)
    out, stats = drive(runner, {"solo": prompt}, MAX_NEW, chunk=5)
    assert stats.steps == 3 + MAX_NEW - 1  # three prefill chunks, the last one samples
    assert out["solo"] == reference_greedy(tiny.reference, prompt, MAX_NEW)


def test_greedy_matches_transformers_generate_in_mixed_batches(tiny: Checkpoint) -> None:
    prompts = {f"r{i}": _prompt(10 + i, n) for i, n in enumerate((3, 9, 14, 22))}
    runner = ModelRunner(tiny.path, num_blocks=64, block_size=4)
    arrivals = {"r0": 0, "r1": 0, "r2": 2, "r3": 5}  # later prompts are prefilled beside earlier decodes
    out, stats = drive(runner, prompts, MAX_NEW, chunk=5, seed=3, arrivals=arrivals)
    assert stats.mixed_steps >= 4 and stats.multi_prefill_steps >= 1
    for rid, prompt in prompts.items():
        assert out[rid] == reference_greedy(tiny.reference, prompt, MAX_NEW), rid
