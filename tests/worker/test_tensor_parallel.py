"""Tensor parallelism on the CPU (gloo): a worker of 2 ranks gives the greedy tokens of 1 rank.

The ranks are spawned processes; rank 0 drives them with the harness's scheduler (chunked
prefill, mixed batches, blocks freed and reused) while rank 1 follows its broadcast plans.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.worker.runner import ModelRunner
from services.worker.tensor_parallel import init_group, shard_config

from .harness import MAX_NEW, Checkpoint, drive, prompt_of

PROMPTS = {f"r{i}": prompt_of(10 + i, n) for i, n in enumerate((3, 9, 14, 22))}
ARRIVALS = {"r0": 0, "r1": 0, "r2": 2, "r3": 5}


def _greedy(runner: ModelRunner) -> dict[str, list[int]]:
    out, stats = drive(runner, PROMPTS, MAX_NEW, chunk=5, seed=3, arrivals=ARRIVALS)
    assert stats.mixed_steps >= 4
    return out


def _rank(rank: int, size: int, path: str, init_method: str, result_path: str) -> None:
    torch.set_num_threads(1)
    group = init_group(rank, size, init_method, timeout_s=120)
    try:
        runner = ModelRunner(path, num_blocks=64, block_size=4, tp=group)
        if group.leader:
            out = _greedy(runner)
            runner.close()
            with open(result_path, "w") as f:
                json.dump({"tokens": out, "kv_heads": runner.model.num_kv_heads}, f)
        else:
            runner.follow()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _two_ranks(path: str, tmp_path) -> dict:
    result = tmp_path / "rank0.json"
    mp.spawn(_rank, args=(2, path, f"tcp://127.0.0.1:{_free_port()}", str(result)), nprocs=2, join=True)
    return json.loads(result.read_text())


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_two_ranks_give_the_greedy_tokens_of_one(family: str, tiny_llamas: dict[str, Checkpoint], tiny_qwen3_moes: dict[str, Checkpoint], tmp_path) -> None:
    tiny = tiny_llamas["untied"] if family == "llama" else tiny_qwen3_moes["renorm-dense-middle"]
    one_rank = ModelRunner(tiny.path, num_blocks=64, block_size=4)
    expected = _greedy(one_rank)
    two_ranks = _two_ranks(tiny.path, tmp_path)
    assert two_ranks["kv_heads"] == one_rank.model.num_kv_heads // 2  # each rank caches half the heads
    assert two_ranks["tokens"] == expected


def test_unsupported_family_and_uneven_split_are_refused() -> None:
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}
    with pytest.raises(ValueError, match="model_type 'qwen3_next' is not supported with tensor parallelism"):
        shard_config({**config, "model_type": "qwen3_next"}, 2)
    with pytest.raises(ValueError, match="must divide num_key_value_heads=2"):
        shard_config(config, 4)
    assert shard_config(config, 2) | {} == {**config, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64, "head_dim": 16}
