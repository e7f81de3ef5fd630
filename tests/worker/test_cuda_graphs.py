"""Graphed decode without a GPU: bucket choice, padding with dummy requests, static-buffer staging, and
replay N equal to eager step N. The capture is ``eager_capture``, so a 'replay' runs the recorded step
through the same staging path and static buffers as a CUDA graph would; the real graphs are checked
by ``bench/gpu_check.sh`` (tests marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from services.worker.cuda_graphs import StaticDecodeInputs, bucket_for, eager_capture, graph_buckets
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import SamplingParams, Slice, StepPlan

from .harness import MAX_NEW, Checkpoint, drive, prompt_of, rel_err


@pytest.fixture
def untied(tiny_llamas: dict[str, Checkpoint]) -> Checkpoint:
    return tiny_llamas["untied"]


def test_buckets_are_powers_of_two_to_8_then_multiples_of_8() -> None:
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_buckets(20) == [1, 2, 4, 8, 16]
    assert graph_buckets(6) == [1, 2, 4]
    assert graph_buckets(0) == []
    buckets = graph_buckets(32)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 24, 25, 32)] == [1, 2, 4, 8, 8, 16, 24, 24, 32, 32]
    assert bucket_for(33, buckets) is None and bucket_for(0, buckets) is None


def test_staging_rewrites_every_row_of_the_bucket_and_pads_with_the_dummy_block() -> None:
    inputs = StaticDecodeInputs(max_batch=8, table_width=4, dummy_block=9, device=torch.device("cpu"), dummy_slot=6)
    inputs.stage([11, 12, 13, 14], [5, 6, 7, 8], [[0, 1], [2, 3], [4, 5], [6, 7, 8]], bucket=4, slots=[3, 0, 5, 1])
    inputs.stage([21, 22], [3, 9], [[1], [2, 3, 4]], bucket=4, slots=[4, 2])  # fewer requests in the same bucket
    assert inputs.input_ids[:4].tolist() == [21, 22, 0, 0]
    assert inputs.positions[:4].tolist() == [3, 9, 0, 0]
    # Rows 2..3 were real a step ago: now dummy requests, whose every table entry is the dummy block
    # and whose GDN state slot is the dummy slot.
    assert inputs.block_tables[:4].tolist() == [[1, 9, 9, 9], [2, 3, 4, 9], [9, 9, 9, 9], [9, 9, 9, 9]]
    assert inputs.slots[:4].tolist() == [4, 2, 6, 6]


def _prefill(runner: ModelRunner, rid: str, prompt: list[int], blocks: list[int]) -> int:
    plan = StepPlan(0, [Slice(rid, 0, len(prompt), prompt, blocks, sampling=SamplingParams(temperature=0))])
    return runner.execute(plan).sampled[0].token_id


def test_padding_rows_write_only_the_dummy_block(untied: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 16, 4, cuda_graph_max_batch=8), capture=eager_capture)
    runner.capture_graphs()
    assert runner.graphs.captured == [1, 2, 4, 8] and runner.kv_cache.num_blocks == 17  # 16 + the dummy
    tables = {"a": [3, 7], "b": [12], "c": [0, 5]}
    lengths = {"a": 6, "b": 2, "c": 5}
    for rid, table in tables.items():
        _prefill(runner, rid, prompt_of(len(rid) + lengths[rid], lengths[rid]), table)
    before = runner.kv_cache.tensor.clone()
    result = runner.execute(StepPlan(1, [Slice(rid, lengths[rid], 1) for rid in tables]))  # 3 requests in bucket 4
    assert runner.last_step_graphed and len(result.sampled) == 3
    changed = (runner.kv_cache.tensor != before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    written = sorted(tables[rid][lengths[rid] // 4] * 4 + lengths[rid] % 4 for rid in tables)
    assert changed == sorted(written + [16 * 4])  # each request's new slot, and slot 0 of dummy block 16


def test_graphed_decode_equals_eager_decode_as_requests_join_and_leave(untied: Checkpoint) -> None:
    """Four requests arriving at different steps and finishing at different steps: the decode-only
    steps replay (batch sizes shrinking inside a bucket leave stale rows behind), the rest run
    eagerly; every token equals the ungraphed runner's, and so do the logits of a replayed step."""
    prompts = {f"r{i}": prompt_of(20 + i, n) for i, n in enumerate((3, 9, 6, 13))}
    arrivals = {"r0": 0, "r1": 0, "r2": 4, "r3": 9}
    sampling = {"r2": SamplingParams(temperature=0.9, top_k=40, seed=5)}  # sampled rows too
    graphed = ModelRunner(RunnerConfig(untied.path, 64, 4, cuda_graph_max_batch=4), capture=eager_capture)
    graphed.capture_graphs()
    eager = ModelRunner(RunnerConfig(untied.path, 64, 4))
    ours, stats = drive(graphed, prompts, MAX_NEW, chunk=5, seed=2, arrivals=arrivals, sampling=sampling)
    theirs, _ = drive(eager, prompts, MAX_NEW, chunk=5, seed=2, arrivals=arrivals, sampling=sampling)
    assert ours == theirs
    counts = graphed.graphs.describe()
    assert counts["replayed_steps"] >= MAX_NEW // 2 and counts["replayed_steps"] + stats.mixed_steps <= stats.steps
    assert eager.graphs is None

    for runner in (graphed, eager):
        _prefill(runner, "x", prompt_of(40, 7), [50, 51])
        _prefill(runner, "y", prompt_of(41, 10), [60, 61, 62])
    plan = StepPlan(2, [Slice("x", 7, 1), Slice("y", 10, 1)])
    assert rel_err(graphed.logits(plan)["x"], eager.logits(plan)["x"]) < 1e-5
    assert graphed.last_step_graphed


def test_batches_past_the_largest_bucket_and_prefills_run_eagerly(untied: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(untied.path, 32, 4, cuda_graph_max_batch=2), capture=eager_capture)
    runner.capture_graphs()
    for i, rid in enumerate("abc"):
        _prefill(runner, rid, prompt_of(i, 3), [i, i + 10])
        assert not runner.last_step_graphed
    runner.execute(StepPlan(1, [Slice(rid, 3, 1) for rid in "abc"]))
    assert not runner.last_step_graphed and runner.graphs.eager == 1
    runner.execute(StepPlan(2, [Slice(rid, 4, 1) for rid in "ab"]))
    assert runner.last_step_graphed and runner.graphs.replayed == 1


# Hybrid (Qwen3-Next) models: GDN state slots staged like the block tables, padding in a dummy slot. ------


@pytest.fixture
def hybrid(tiny_qwen3_nexts: dict[str, Checkpoint]) -> Checkpoint:
    return tiny_qwen3_nexts["gqa-dense-layer"]


def test_the_hybrid_pool_has_one_dummy_slot_past_the_schedulers(hybrid: Checkpoint) -> None:
    graphed = ModelRunner(RunnerConfig(hybrid.path, 16, 4, max_num_seqs=6, cuda_graph_max_batch=4), capture=eager_capture)
    eager = ModelRunner(RunnerConfig(hybrid.path, 16, 4, max_num_seqs=6))
    assert graphed.num_slots == eager.num_slots == 6  # what the scheduler's SlotPool(max_num_seqs) hands out
    assert graphed.states.num_slots == 7 and eager.states.num_slots == 6
    assert graphed.describe()["gdn_state"]["dummy_slot"] == 6 and graphed.graphs.describe()["dummy_gdn_slot"] == 6
    with pytest.raises(ValueError, match="outside 0..5"):  # the dummy slot is never a request's
        graphed.execute(StepPlan(0, [Slice("x", 0, 3, [5, 6, 7], [0], slot=6)]))


def _states(runner: ModelRunner) -> tuple[torch.Tensor, torch.Tensor]:
    return runner.states.conv_tensor.clone(), runner.states.recurrent_tensor.clone()


def _changed_slots(before: tuple[torch.Tensor, torch.Tensor], runner: ModelRunner) -> list[int]:
    """Slots whose conv or recurrent state changed in any GDN layer."""
    changed = set()
    for old, new in zip(before, _states(runner)):
        changed |= set((old != new).flatten(2).any(-1).any(0).nonzero().flatten().tolist())
    return sorted(changed)


def test_hybrid_padding_rows_touch_only_the_dummy_slot_and_block(hybrid: Checkpoint) -> None:
    runner = ModelRunner(RunnerConfig(hybrid.path, 16, 4, max_num_seqs=6, cuda_graph_max_batch=8), capture=eager_capture)
    runner.capture_graphs()
    assert runner.graphs.captured == [1, 2, 4]  # up to max_num_seqs
    tables = {"a": [3, 7], "b": [12], "c": [0, 5], "idle": [9, 10]}
    lengths = {"a": 6, "b": 2, "c": 5, "idle": 7}
    slots = {"a": 4, "b": 0, "c": 2, "idle": 1}
    for rid, table in tables.items():
        prompt = prompt_of(len(rid) + lengths[rid], lengths[rid])
        runner.execute(StepPlan(0, [Slice(rid, 0, len(prompt), prompt, table, sampling=SamplingParams(temperature=0), slot=slots[rid])]))
    live = ["a", "b", "c"]  # "idle" holds slot 1 and blocks 9, 10 but sits this step out
    with torch.inference_mode():  # stale dummy state, as an earlier replay could leave it
        runner.states.conv_tensor[:, 6] = 7.0
        runner.states.recurrent_tensor[:, 6] = 7.0
    states, cache = _states(runner), runner.kv_cache.tensor.clone()
    runner.execute(StepPlan(1, [Slice(rid, lengths[rid], 1, slot=slots[rid]) for rid in live]))  # 3 requests in bucket 4
    assert runner.last_step_graphed
    assert _changed_slots(states, runner) == sorted([slots[rid] for rid in live] + [6])
    changed = (runner.kv_cache.tensor != cache).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    assert changed == sorted([tables[rid][lengths[rid] // 4] * 4 + lengths[rid] % 4 for rid in live] + [16 * 4])
    # The replay zeroed the dummy slot before the padding row stepped it: its conv history is that
    # row's one input behind zeros, not the stale 7s.
    assert bool((runner.states.conv_tensor[:, 6, :, :-1] == 0).all()) and bool((runner.states.conv_tensor[:, 6, :, -1] != 7.0).all())


def test_hybrid_graphed_decode_equals_eager_decode_as_requests_join_and_leave(hybrid: Checkpoint) -> None:
    """As for the attention-only model: requests joining (chunked prefills beside decodes) and leaving,
    so slots are freed and reused and batches shrink inside a bucket; every token equals the eager
    runner's, over more steps than any request lives, and so do the logits of a replayed step."""
    prompts = {f"r{i}": prompt_of(50 + i, n) for i, n in enumerate((3, 9, 6, 13, 4))}
    arrivals = {"r0": 0, "r1": 0, "r2": 4, "r3": 9, "r4": 30}
    sampling = {"r2": SamplingParams(temperature=0.9, top_k=40, seed=5)}
    graphed = ModelRunner(RunnerConfig(hybrid.path, 64, 4, max_num_seqs=8, cuda_graph_max_batch=4), capture=eager_capture)
    graphed.capture_graphs()
    eager = ModelRunner(RunnerConfig(hybrid.path, 64, 4, max_num_seqs=8))
    ours, stats = drive(graphed, prompts, MAX_NEW, chunk=5, seed=3, arrivals=arrivals, sampling=sampling)
    theirs, _ = drive(eager, prompts, MAX_NEW, chunk=5, seed=3, arrivals=arrivals, sampling=sampling)
    assert ours == theirs
    assert graphed.graphs.replayed >= MAX_NEW and stats.mixed_steps >= 2 and stats.steps > MAX_NEW + 20
    assert eager.graphs is None

    for runner in (graphed, eager):
        for rid, seed, n, blocks, slot in (("x", 40, 7, [50, 51], 3), ("y", 41, 10, [60, 61, 62], 5)):
            prompt = prompt_of(seed, n)
            runner.execute(StepPlan(0, [Slice(rid, 0, n, prompt, blocks, sampling=SamplingParams(temperature=0), slot=slot)]))
    plan = StepPlan(2, [Slice("x", 7, 1, slot=3), Slice("y", 10, 1, slot=5)])
    ours, theirs = graphed.logits(plan), eager.logits(plan)
    assert graphed.last_step_graphed
    assert max(rel_err(ours[rid], theirs[rid]) for rid in "xy") < 1e-5
    assert torch.allclose(graphed.states.recurrent_tensor[:, :8], eager.states.recurrent_tensor, atol=1e-5)
