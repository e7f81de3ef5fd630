"""The int4 block products' instruction variants against each other, on decode steps of the default model.

On a CPU whose build has AVX-512 VNNI (``block_quant_gemm_isa() == "avx512-vnni"``) three variants of
``csrc/block_quant_gemm.cpp`` give the same bits at different speeds:

- ``avx2``: maddubs / madd pairs, 4-row tiles (``TOKENYARD_CPU_VNNI=0``; what an AVX2-only CPU runs);
- ``vnni``: vpdpwssd / vpdpbusd on 256-bit vectors, 8-row tiles, one panel per tile;
- ``vnni-pairs``: the default, calls of enough rows (the worker's ``pair_tiles`` setting) take two panels per 512-bit tile.

Each round runs two processes, one per build setting (``TOKENYARD_CPU_VNNI`` is read once per process);
the VNNI process alternates its two variants (A B B A, ``set_block_quant_pair_min_rows``), each process
measures its variants twice per batch and takes the mean. The runner has the stack's settings (int4
weights, the KV cache dtype ``auto`` picks). The report gives each variant's median decode step time per
batch and the ratios against ``avx2`` measured in the same run.

    .venv/bin/python -m bench.block_quant_isa [--batches 1 8 16 32] [--context 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from bench.quantization import decode_step_s
from bench.report import write_results
from services.worker.cpu_kernels import cpu_kernels
from services.worker.runner import ModelRunner, RunnerConfig
from shared.config import DEFAULT_MODEL_DIR, StackConfig

VNNI_VARIANTS = ("vnni", "vnni-pairs")  # one panel per tile; two from the runner's pair_min_rows on


def measure(args: argparse.Namespace) -> dict[str, dict[int, float]]:
    """This process's variants: decode step seconds per batch (the mean of two measurements, A B B A)."""
    kernels = cpu_kernels()[0]
    config = StackConfig(model=args.model)
    blocks = max(args.batches) * -(-(args.context + args.steps + 8) // config.block_size)
    runner = ModelRunner(RunnerConfig(args.model, num_blocks=blocks, block_size=config.block_size, weight_quant="int4", kv_cache_dtype=config.kv_cache_dtype))
    pairs_from = runner.kernel_settings.pair_min_rows
    variants = {"avx2": None} if kernels.block_quant_gemm_isa() == "avx2" else {"vnni": 0, "vnni-pairs": pairs_from}  # variant -> pair tiles from
    seconds: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in variants}
    for batch in args.batches:
        for name in [*variants, *reversed(variants)]:  # A B B A: neither variant always goes first
            if variants[name] is not None:
                kernels.set_block_quant_pair_min_rows(variants[name])
            seconds[name][batch].append(decode_step_s(runner, batch, args.context, args.steps))
    kernels.set_block_quant_pair_min_rows(pairs_from)
    return {name: {b: statistics.mean(ts) for b, ts in per.items()} for name, per in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--context", type=int, default=128, help="tokens of context per request")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per measurement (their median counts)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench/results/block_quant_isa.json")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # a round's child process
    args = parser.parse_args()
    kernels, why = cpu_kernels()
    if args.measure:
        print(json.dumps(measure(args)))
        return
    if kernels is None or kernels.block_quant_gemm_isa() != "avx512-vnni":
        print(f"block_quant_isa: this build has no AVX-512 VNNI products to compare ({why or kernels.block_quant_gemm_isa()}); nothing measured")
        return
    child = [sys.executable, "-m", "bench.block_quant_isa", "--measure", "--model", args.model, "--context", str(args.context), "--steps", str(args.steps)]
    child += ["--batches", *map(str, args.batches)]
    times: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batches} for name in ("avx2", *VNNI_VARIANTS)}
    for round_ in range(args.rounds):
        settings = [{"TOKENYARD_CPU_VNNI": "0"}, {}]
        for extra in settings if round_ % 2 == 0 else settings[::-1]:
            out = subprocess.run(child, env={**os.environ, **extra}, check=True, capture_output=True, text=True).stdout
            for name, per_batch in json.loads(out.strip().splitlines()[-1]).items():
                for batch, seconds in per_batch.items():
                    times[name][int(batch)].append(seconds)
        print(f"round {round_ + 1}: " + ", ".join(f"{name} b{b} {ts[-1] * 1e3:.2f} ms" for name, per in times.items() for b, ts in per.items()))
    medians = {name: {b: statistics.median(ts) for b, ts in per.items()} for name, per in times.items()}
    print(f"\ndecode step, {args.context}-token contexts, medians of {args.rounds} rounds (ms; in brackets: speed against avx2)")
    print(f"{'batch':>6} " + " ".join(f"{name:>18}" for name in medians))
    for b in args.batches:
        cells = [f"{medians[name][b] * 1e3:8.2f} ({medians['avx2'][b] / medians[name][b]:4.2f}x)" for name in medians]
        print(f"{b:>6} " + " ".join(f"{cell:>18}" for cell in cells))
    write_results(
        args.out,
        {
            "model": args.model,
            "context": args.context,
            "rounds": args.rounds,
            "decode_step_ms": {name: {str(b): round(s * 1e3, 3) for b, s in per.items()} for name, per in medians.items()},
        },
    )


if __name__ == "__main__":
    main()
