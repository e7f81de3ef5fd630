"""The body of a tensor-parallel rank in the tests, kept free of transformers so a spawned rank
starts fast: it replays recorded frames (plans and releases) through a sharded ``ModelRunner``."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.tensor_parallel import init_group
from shared.codec import decode
from shared.frames import Release


def replay_rank(rank: int, size: int, init_method: str, jobs_path: str, result_path: str) -> None:
    """Each job is a checkpoint and the frames a 1-rank run executed; rank 0 writes the tokens each step sampled."""
    torch.set_num_threads(1)
    with open(jobs_path) as f:
        jobs = json.load(f)
    group = init_group(rank, size, init_method, timeout_s=120)
    results = []
    try:
        for job in jobs:
            runner = ModelRunner(RunnerConfig(job["path"], num_blocks=job["num_blocks"], block_size=job["block_size"]), tp=group)
            if not group.leader:
                runner.follow()
                continue
            sampled = []
            for frame in map(decode, map(bytes.fromhex, job["frames"])):
                if isinstance(frame, Release):
                    runner.release(frame.rids)
                else:
                    sampled.append([[s.rid, s.token_id] for s in runner.execute(frame).sampled])
            runner.close()
            results.append({"sampled": sampled, "kv_heads": runner.model.num_kv_heads})
        if group.leader:
            with open(result_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()
