"""Tensor parallelism on the CPU (gloo): a worker of 2 ranks gives the greedy tokens of 1 rank.

A 1-rank runner is driven by the harness's scheduler (chunked prefill, mixed batches, blocks freed
and reused) and its frames are recorded; two spawned ranks replay them, rank 0 broadcasting each
plan to rank 1, and must sample the same tokens at every step.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp

from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.tensor_parallel import shard_config
from shared.codec import encode
from shared.frames import Release, StepPlan

from .harness import MAX_NEW, Checkpoint, drive, prompt_of
from .tp_ranks import replay_rank

PROMPTS = {f"r{i}": prompt_of(10 + i, n) for i, n in enumerate((3, 9, 14, 22))}
ARRIVALS = {"r0": 0, "r1": 0, "r2": 2, "r3": 5}


class RecordingRunner(ModelRunner):
    """A 1-rank runner that keeps every frame it ran and the tokens each step sampled."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.frames: list[str] = []
        self.sampled: list[list[list]] = []

    def execute(self, plan: StepPlan):
        self.frames.append(encode(plan).hex())
        result = super().execute(plan)
        self.sampled.append([[s.rid, s.token_id] for s in result.sampled])
        return result

    def release(self, rids: list[str]) -> None:
        self.frames.append(encode(Release(rids=rids)).hex())
        super().release(rids)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_ranks_give_the_greedy_tokens_of_one(tiny_llamas: dict[str, Checkpoint], tiny_qwen3_moes: dict[str, Checkpoint], tmp_path) -> None:
    checkpoints = {"llama": tiny_llamas["untied"], "qwen3_moe": tiny_qwen3_moes["renorm-dense-middle"]}
    one_rank = {}
    for family, tiny in checkpoints.items():
        runner = one_rank[family] = RecordingRunner(RunnerConfig(tiny.path, num_blocks=64, block_size=4))
        _, stats = drive(runner, PROMPTS, MAX_NEW, chunk=5, seed=3, arrivals=ARRIVALS)
        assert stats.mixed_steps >= 4
    jobs = [{"path": tiny.path, "num_blocks": 64, "block_size": 4, "frames": one_rank[family].frames} for family, tiny in checkpoints.items()]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(replay_rank, args=(2, init_method, str(tmp_path / "jobs.json"), str(tmp_path / "rank0.json")), nprocs=2, join=True)
    results = json.loads((tmp_path / "rank0.json").read_text())
    for (family, runner), result in zip(one_rank.items(), results):
        assert result["kv_heads"] == runner.model.num_kv_heads // 2, family  # each rank caches half the kv heads
        assert result["sampled"] == runner.sampled, family


def test_unsupported_family_and_uneven_split_are_refused() -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    with pytest.raises(ValueError, match="model_type 'qwen3_next' is not supported with tensor parallelism"):
        shard_config({**config, "model_type": "qwen3_next"}, 2)
    with pytest.raises(ValueError, match="must divide num_key_value_heads=2"):
        shard_config(config, 4)
    assert shard_config(config, 2) == {**config, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64, "head_dim": 16}
