"""The llama family against transformers on tiny random checkpoints: logits and greedy continuations
through paged KV, chunked prefill and mixed batches."""

from __future__ import annotations

from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan

from .harness import (
    GREEDY,
    MAX_NEW,
    Checkpoint,
    check_greedy_alone,
    check_greedy_in_mixed_batches,
    check_logits_after_chunked_prefill_and_in_decode,
    prompt_of,
    reference_greedy,
)


def test_logits_match_transformers_after_chunked_prefill_and_in_decode(tiny: Checkpoint) -> None:
    check_logits_after_chunked_prefill_and_in_decode(tiny)


def test_greedy_matches_transformers_generate_alone(tiny: Checkpoint) -> None:
    check_greedy_alone(tiny)


def test_greedy_matches_transformers_generate_in_mixed_batches(tiny: Checkpoint) -> None:
    check_greedy_in_mixed_batches(tiny)


def test_a_first_slice_may_start_on_shared_prefix_blocks(tiny_llamas: dict[str, Checkpoint]) -> None:
    """A prefix-cache hit: the second request's first slice starts at 8 on the first request's blocks."""
    tiny = tiny_llamas["untied"]
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=32, block_size=4))
    first, second = prompt_of(20, 12), prompt_of(20, 8) + prompt_of(21, 6)
    runner.execute(StepPlan(0, [Slice("a", 0, 12, first, [9, 2, 30], sampling=GREEDY)]))
    tokens = [runner.execute(StepPlan(1, [Slice("b", 8, 6, second[8:], [9, 2, 17, 5], sampling=GREEDY)])).sampled[0].token_id]
    for step in range(MAX_NEW - 1):
        new = [20 + step // 4] if (14 + step) % 4 == 0 else []
        tokens += [runner.execute(StepPlan(2 + step, [Slice("b", 14 + step, 1, new_blocks=new)])).sampled[0].token_id]
    assert tokens == reference_greedy(tiny.reference, second, MAX_NEW)
