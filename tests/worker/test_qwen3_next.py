"""The qwen3_next hybrid family against transformers on tiny random checkpoints (Gated DeltaNet and gated
full-attention layers, grouped and equal GDN heads, partial rotary, MoE with a shared expert and dense
layers, tied and biased variants): logits and greedy continuations through paged KV and GDN state
slots, prompts longer than a delta-rule chunk prefilled in pieces cut off the chunk grid, mixed
batches, slot reuse after an abort, and recomputation after a preemption."""

from __future__ import annotations

import pytest
import torch

from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan
from shared.model_info import FULL_ATTENTION, LINEAR_ATTENTION, layer_types, load_model_info

from .harness import (
    GREEDY,
    MAX_NEW,
    Checkpoint,
    check_logits_after_chunked_prefill_and_in_decode,
    drive,
    prompt_of,
    reference_greedy,
    rel_err,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def _prefill(runner: ModelRunner, rid: str, prompt: list[int], cuts: list[int], slot: int, first_block: int = 0) -> StepPlan:
    """Send the prompt's pieces between ``cuts`` but the last (blocks of 4 from ``first_block`` on); return the last piece's plan."""
    bounds = [0, *cuts, len(prompt)]
    for i, (start, end) in enumerate(zip(bounds[:-2], bounds[1:-1])):
        blocks = list(range(first_block + -(-start // 4), first_block + -(-end // 4)))
        plan = StepPlan(i, [Slice(rid, start, end - start, prompt[start:end], blocks, sample=False, sampling=GREEDY if i == 0 else None, slot=slot)])
        assert runner.execute(plan).sampled == []
    start, end = bounds[-2], bounds[-1]
    blocks = list(range(first_block + -(-start // 4), first_block + -(-end // 4)))
    return StepPlan(len(bounds), [Slice(rid, start, end - start, prompt[start:end], blocks, sampling=GREEDY if start == 0 else None, slot=slot)])


def test_logits_match_transformers_after_chunked_prefill_and_in_decode(tiny_qwen3_next: Checkpoint) -> None:
    check_logits_after_chunked_prefill_and_in_decode(tiny_qwen3_next)


@pytest.mark.parametrize("cuts", [[], [37, 101], [64, 65, 149]], ids=["one-slice", "off-grid", "on-and-around-the-grid"])
def test_logits_of_a_prompt_longer_than_a_chunk_match_transformers_however_it_is_cut(tiny_qwen3_nexts: dict[str, Checkpoint], cuts: list[int]) -> None:
    tiny = tiny_qwen3_nexts["gqa-dense-layer"]
    prompt = prompt_of(5, 150)
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=40, block_size=4))
    ours = runner.logits(_prefill(runner, "r", prompt, cuts, slot=7))["r"]
    with torch.no_grad():
        theirs = tiny.reference(torch.tensor([prompt])).logits[0, -1]
    assert rel_err(ours, theirs) <= 1e-4


def test_greedy_matches_transformers_generate_alone_prefilled_in_off_grid_chunks(tiny_qwen3_next: Checkpoint) -> None:
    prompt = prompt_of(1, 150)
    runner = ModelRunner(RunnerConfig(tiny_qwen3_next.path, num_blocks=64, block_size=4, max_num_seqs=4))
    out, stats = drive(runner, {"solo": prompt}, MAX_NEW, chunk=57)  # pieces of 57, 57, 36: none on the 64-token grid
    assert stats.steps == 3 + MAX_NEW - 1
    assert out["solo"] == reference_greedy(tiny_qwen3_next.reference, prompt, MAX_NEW)


def test_greedy_matches_transformers_generate_in_a_mixed_batch_of_four(tiny_qwen3_next: Checkpoint) -> None:
    """Four prompts of 3 to 130 tokens arriving at different steps: chunked prefills beside decodes, each in its own slot."""
    prompts = {f"r{i}": prompt_of(20 + i, n) for i, n in enumerate((3, 41, 90, 130))}
    runner = ModelRunner(RunnerConfig(tiny_qwen3_next.path, num_blocks=128, block_size=4, max_num_seqs=6))
    arrivals = {"r0": 0, "r1": 0, "r2": 1, "r3": 4}
    out, stats = drive(runner, prompts, MAX_NEW, chunk=50, seed=5, arrivals=arrivals)
    assert stats.mixed_steps >= 4 and stats.multi_prefill_steps >= 1
    for rid, prompt in prompts.items():
        assert out[rid] == reference_greedy(tiny_qwen3_next.reference, prompt, MAX_NEW), rid


def test_a_slot_reused_after_an_abort_starts_from_a_clean_state(tiny_qwen3_nexts: dict[str, Checkpoint]) -> None:
    tiny = tiny_qwen3_nexts["gqa-dense-layer"]
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=64, block_size=4, max_num_seqs=2))
    runner.execute(_prefill(runner, "aborted", prompt_of(6, 70), [33], slot=1))
    runner.execute(StepPlan(10, [Slice("aborted", 70, 1, new_blocks=[], slot=1)]))
    runner.release(["aborted"])  # the scheduler aborts it and hands slot 1 to the next request
    prompt = prompt_of(7, 40)
    ours = runner.logits(_prefill(runner, "next", prompt, [], slot=1, first_block=20))["next"]
    with torch.no_grad():
        theirs = tiny.reference(torch.tensor([prompt])).logits[0, -1]
    assert rel_err(ours, theirs) <= 1e-4


def test_a_preempted_request_recomputed_in_another_slot_continues_as_if_uninterrupted(tiny_qwen3_nexts: dict[str, Checkpoint]) -> None:
    tiny = tiny_qwen3_nexts["interval-tied-bias"]
    prompt = prompt_of(8, 60)
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=64, block_size=4, max_num_seqs=3))
    out = [runner.execute(_prefill(runner, "r", prompt, [25], slot=2)).sampled[0].token_id]
    for i in range(9):
        pos = len(prompt) + i
        out.append(runner.execute(StepPlan(20 + i, [Slice("r", pos, 1, new_blocks=[pos // 4] if pos % 4 == 0 else [], slot=2)])).sampled[0].token_id)
    runner.release(["r"])  # preempted: its blocks and slot are gone; readmission recomputes prompt + outputs
    known = prompt + out
    out.append(runner.execute(_prefill(runner, "r", known, [50], slot=0, first_block=30)).sampled[0].token_id)
    while len(out) < MAX_NEW:
        pos = len(prompt) + len(out) - 1
        plan = StepPlan(100 + len(out), [Slice("r", pos, 1, new_blocks=[30 + pos // 4] if pos % 4 == 0 else [], slot=0)])
        out.append(runner.execute(plan).sampled[0].token_id)
    assert out == reference_greedy(tiny.reference, prompt, MAX_NEW)


def test_slices_naming_bad_or_shared_slots_are_refused_and_leave_state_untouched(tiny_qwen3_nexts: dict[str, Checkpoint]) -> None:
    runner = ModelRunner(RunnerConfig(tiny_qwen3_nexts["gqa-dense-layer"].path, num_blocks=16, block_size=4, max_num_seqs=2))
    runner.execute(StepPlan(0, [Slice("a", 0, 3, [5, 6, 7], [0], sampling=GREEDY, slot=0)]))
    bad = {
        "outside": [Slice("b", 0, 2, [5, 6], [1], slot=2)],
        "missing": [Slice("b", 0, 2, [5, 6], [1])],
        "held by a": [Slice("b", 0, 2, [5, 6], [1], slot=0)],
        "changed": [Slice("a", 3, 1, slot=1)],
        "shared in a step": [Slice("b", 0, 2, [5, 6], [1], slot=1), Slice("c", 0, 2, [5, 6], [2], slot=1)],
        "state gone": [Slice("b", 4, 2, [5, 6], [1], slot=1)],
    }
    for case, slices in bad.items():
        with pytest.raises(ValueError, match="slot|GDN state"):
            runner.execute(StepPlan(1, slices))
        assert runner.describe()["gdn_state"]["slots_used"] == 1, case


def test_describe_reports_slots_kernels_layers_the_prefix_cache_and_every_parameter_once(tiny_qwen3_nexts: dict[str, Checkpoint]) -> None:
    for tiny, (full, gdn, moe) in zip(tiny_qwen3_nexts.values(), ((1, 3, 3), (2, 2, 2))):
        runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=4, block_size=4, max_num_seqs=5))
        runner.execute(StepPlan(0, [Slice("a", 0, 3, [5, 6, 7], [0], sampling=GREEDY, slot=4)]))
        facts = runner.describe()
        assert facts["family"] == "qwen3_next" and facts["param_count"] == tiny.reference.num_parameters()
        assert (facts["full_attention_layers"], facts["gdn_layers"], facts["moe_layers"]) == (full, gdn, moe)
        assert facts["gdn_kernels"] == {"delta_rule": "torch", "conv1d": "torch"}
        assert facts["gdn_state"]["slots_total"] == 5 and facts["gdn_state"]["slots_used"] == 1
        assert facts["prefix_cache"]["enabled"] is False and "Gated DeltaNet" in facts["prefix_cache"]["reason"]
        assert runner.kv_cache.tensor.shape[0] == full  # KV only for the full-attention layers
        runner.release(["a"])
        assert runner.describe()["gdn_state"]["slots_used"] == 0


def test_layer_kinds_and_kv_size_come_from_layer_types_or_the_full_attention_interval(tiny_qwen3_nexts: dict[str, Checkpoint]) -> None:
    assert layer_types({"model_type": "qwen3_next", "num_hidden_layers": 4, "full_attention_interval": 2}) == (LINEAR_ATTENTION, FULL_ATTENTION) * 2
    assert layer_types({"model_type": "qwen3_next", "num_hidden_layers": 8}) == ((LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)) * 2
    assert layer_types({"model_type": "llama", "num_hidden_layers": 2}) == (FULL_ATTENTION,) * 2
    info = load_model_info(tiny_qwen3_nexts["gqa-dense-layer"].path)
    assert (info.num_kv_layers, info.num_gdn_layers, info.uses_state_slots) == (1, 3, True)
    assert info.kv_bytes_per_token("float32") == 1 * 2 * 2 * 32 * 4
    assert info.prefix_cache_unsupported


def test_greedy_matches_transformers_through_the_scheduler_with_runs_of_decode_steps(tiny_qwen3_next: Checkpoint) -> None:
    """The scheduler's own plans, state slots and plans of several decode steps (each step moving every
    request's GDN state on by one token) give transformers' continuations."""
    from services.scheduler.core import Scheduler
    from services.scheduler.kv_blocks import BlockPool
    from services.scheduler.state_slots import SlotPool
    from shared.devtools.inprocess_engine import InProcessEngine
    from shared.frames import Submit

    prompts = {f"r{i}": prompt_of(40 + i, n) for i, n in enumerate((5, 37, 70))}
    runner = ModelRunner(RunnerConfig(tiny_qwen3_next.path, num_blocks=128, block_size=4, max_num_seqs=6))
    scheduler = Scheduler(BlockPool(128, 4, False), 6, 50, 100, SlotPool(6), decode_plan_s=1.0)
    submits = [Submit(rid=rid, prompt_ids=prompt, max_tokens=MAX_NEW, sampling=GREEDY, ignore_eos=True) for rid, prompt in prompts.items()]
    result = InProcessEngine(scheduler, runner).run(submits)
    assert scheduler.decode_runs.steps() > 1 and result.steps < MAX_NEW, "plans of several decode steps were meant to run"
    for rid, prompt in prompts.items():
        assert result.outputs[rid] == reference_greedy(tiny_qwen3_next.reference, prompt, MAX_NEW), rid
