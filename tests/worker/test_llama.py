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


def _chunked_prefill(runner: ModelRunner, prompt: list[int], blocks: list[int]) -> StepPlan:
    """Send every chunk of 5 but the last (they sample nothing); return the plan of the last."""
    for i, start in enumerate(range(0, len(prompt) - 5, 5)):
        new = blocks[-(-start // 4) : -(-(start + 5) // 4)]
        plan = StepPlan(i, [Slice("r", start, 5, prompt[start : start + 5], new, sample=False, sampling=GREEDY if i == 0 else None)])
        assert runner.execute(plan).sampled == []
    start = len(prompt) - len(prompt) % 5
    return StepPlan(9, [Slice("r", start, len(prompt) - start, prompt[start:], blocks[-(-start // 4) : -(-len(prompt) // 4)])])


def test_logits_match_transformers_after_chunked_prefill_and_in_decode(tiny: Checkpoint) -> None:
    prompt, blocks = _prompt(0, 23), [11, 3, 7, 0, 14, 5, 9]
    runner = ModelRunner(tiny.path, num_blocks=16, block_size=4)
    ours = runner.logits(_chunked_prefill(runner, prompt, blocks))["r"]
    with torch.no_grad():
        theirs = tiny.reference(torch.tensor([prompt])).logits[0, -1]
    assert _rel_err(ours, theirs) <= 1e-4

    # A decode slice feeds back the last sampled token: sample it, then check the next logits.
    runner = ModelRunner(tiny.path, num_blocks=16, block_size=4)
    token = runner.execute(_chunked_prefill(runner, prompt, blocks)).sampled[0].token_id
    assert token == int(theirs.argmax())
    ours = runner.logits(StepPlan(10, [Slice("r", 23, 1, new_blocks=blocks[6:7])]))["r"]
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


def test_a_first_slice_may_start_on_shared_prefix_blocks(tiny_llamas: dict[str, Checkpoint]) -> None:
    """A prefix-cache hit: the second request's first slice starts at 8 on the first request's blocks."""
    tiny = tiny_llamas["untied"]
    runner = ModelRunner(tiny.path, num_blocks=32, block_size=4)
    first, second = _prompt(20, 12), _prompt(20, 8) + _prompt(21, 6)
    runner.execute(StepPlan(0, [Slice("a", 0, 12, first, [9, 2, 30], sampling=GREEDY)]))
    tokens = [runner.execute(StepPlan(1, [Slice("b", 8, 6, second[8:], [9, 2, 17, 5], sampling=GREEDY)])).sampled[0].token_id]
    for step in range(MAX_NEW - 1):
        new = [20 + step // 4] if (14 + step) % 4 == 0 else []
        tokens += [runner.execute(StepPlan(2 + step, [Slice("b", 14 + step, 1, new_blocks=new)])).sampled[0].token_id]
    assert tokens == reference_greedy(tiny.reference, second, MAX_NEW)
