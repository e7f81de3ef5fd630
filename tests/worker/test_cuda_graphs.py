"""Graphed decode without a GPU: bucket choice, padding with dummy requests, static-buffer staging, and
replay N equal to eager step N. The capture is ``eager_capture``, so a 'replay' runs the recorded step
through the same staging path and static buffers as a CUDA graph would; the real graphs are checked
by ``bench/gpu_check.sh`` (tests marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

from services.worker.cuda_graphs import StaticDecodeInputs, bucket_for, eager_capture, graph_buckets
from services.worker.runner import ModelRunner
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
    inputs = StaticDecodeInputs(max_batch=8, table_width=4, dummy_block=9, device=torch.device("cpu"))
    inputs.stage([11, 12, 13, 14], [5, 6, 7, 8], [[0, 1], [2, 3], [4, 5], [6, 7, 8]], bucket=4)
    inputs.stage([21, 22], [3, 9], [[1], [2, 3, 4]], bucket=4)  # fewer requests in the same bucket
    assert inputs.input_ids[:4].tolist() == [21, 22, 0, 0]
    assert inputs.positions[:4].tolist() == [3, 9, 0, 0]
    # Rows 2..3 were real a step ago: now dummy requests, whose every table entry is the dummy block.
    assert inputs.block_tables[:4].tolist() == [[1, 9, 9, 9], [2, 3, 4, 9], [9, 9, 9, 9], [9, 9, 9, 9]]


def _prefill(runner: ModelRunner, rid: str, prompt: list[int], blocks: list[int]) -> int:
    plan = StepPlan(0, [Slice(rid, 0, len(prompt), prompt, blocks, sampling=SamplingParams(temperature=0))])
    return runner.execute(plan).sampled[0].token_id


def test_padding_rows_write_only_the_dummy_block(untied: Checkpoint) -> None:
    runner = ModelRunner(untied.path, 16, 4, cuda_graph_max_batch=8, capture=eager_capture)
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
    graphed = ModelRunner(untied.path, 64, 4, cuda_graph_max_batch=4, capture=eager_capture)
    graphed.capture_graphs()
    eager = ModelRunner(untied.path, 64, 4)
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
    runner = ModelRunner(untied.path, 32, 4, cuda_graph_max_batch=2, capture=eager_capture)
    runner.capture_graphs()
    for i, rid in enumerate("abc"):
        _prefill(runner, rid, prompt_of(i, 3), [i, i + 10])
        assert not runner.last_step_graphed
    runner.execute(StepPlan(1, [Slice(rid, 3, 1) for rid in "abc"]))
    assert not runner.last_step_graphed and runner.graphs.eager == 1
    runner.execute(StepPlan(2, [Slice(rid, 4, 1) for rid in "ab"]))
    assert runner.last_step_graphed and runner.graphs.replayed == 1
