"""GPU decode benchmark: one decode step's time replayed from a CUDA graph vs run eagerly, at batch
sizes 1/8/32, on the worker's own runner (bf16, Triton attention, device sampling); and the
device-to-device copy bandwidth of this GPU, the yardstick of the kernels' GB/s.

The model is ``--model`` when that directory exists, else a random Llama-shaped checkpoint built here
(no network). Skips with a message when there is no CUDA device.

    .venv/bin/python -m bench.gpu_decode [--model DIR] [--batches 1,8,32] [--context 512]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from services.worker.runner import ModelRunner, RunnerConfig
from shared.config import DEFAULT_MODEL_DIR
from shared.frames import SamplingParams, Slice, StepPlan


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    began, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    return 2 * nbytes * reps / (time.perf_counter() - began) / 1e9


def synthetic_llama(path: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def step_time(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    """Mean seconds of a decode step of ``batch`` requests at ``context`` tokens each (sampling included)."""
    blocks_each = -(-(context + steps + 1) // runner.block_size)
    rids = [f"b{batch}-{i}" for i in range(batch)]
    greedy = SamplingParams(temperature=0)
    for i, rid in enumerate(rids):
        blocks = list(range(i * blocks_each, (i + 1) * blocks_each))
        runner.execute(StepPlan(0, [Slice(rid, 0, context, [7] * context, blocks, sampling=greedy)]))
    position = context
    for _ in range(3):  # warm
        runner.execute(StepPlan(1, [Slice(rid, position, 1) for rid in rids]))
        position += 1
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        runner.execute(StepPlan(2, [Slice(rid, position, 1) for rid in rids]))  # .tolist() of the tokens syncs each step
        position += 1
    elapsed = (time.perf_counter() - began) / steps
    runner.release(rids)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode: no CUDA device here; skipped (run it on a GPU host)")
        return
    device = torch.device("cuda")
    print(f"gpu_decode: {torch.cuda.get_device_name()}; device-to-device copy {copy_bandwidth(device):.0f} GB/s")
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model if os.path.isfile(os.path.join(args.model, "config.json")) else synthetic_llama(os.path.join(scratch, "llama"))
        blocks = max(batches) * (-(-(args.context + args.steps + 8) // 16))
        runners = {
            "eager": ModelRunner(RunnerConfig(model, blocks, 16, "bfloat16", max(batches), device="cuda")),
            "graph": ModelRunner(RunnerConfig(model, blocks, 16, "bfloat16", max(batches), device="cuda", cuda_graph_max_batch=max(batches))),
        }
        runners["graph"].capture_graphs()
        print(f"model {model} ({runners['eager'].family}), context {args.context}, bf16")
        print(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'speed-up':>9} {'graph tok/s':>12}")
        for batch in batches:
            eager = step_time(runners["eager"], batch, args.context, args.steps)
            graph = step_time(runners["graph"], batch, args.context, args.steps)
            assert runners["graph"].last_step_graphed
            print(f"{batch:>6} {eager * 1e3:>9.2f} {graph * 1e3:>9.2f} {eager / graph:>8.2f}x {batch / graph:>12.0f}")


if __name__ == "__main__":
    main()
