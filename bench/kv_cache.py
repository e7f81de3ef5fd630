"""What each KV cache storage costs on the CPU (``--kv-cache-dtype``): accuracy and speed, in one run.

Formats, each with the default int4 weights: ``model`` (fp32, the reference), ``float16`` (the default,
``auto``) and ``int8`` (llama.cpp's q8_0 per head vector: int8 codes and an fp16 scale per 32).

- Accuracy on bench/quantization.py's fixed text, against the fp32 cache: perplexity, relative logit
  error and top-1 agreement, as one prefill and token by token.
- The attention kernel alone, per layer, on a 32-row decode step whose 30 layers' caches are called in
  turn (cold, as a model step reads them), at three context spans; the formats alternate.
- The model's decode step at a few batch sizes and contexts: the best of three alternating runs' medians.

    python -m bench.kv_cache [--model models/SmolLM2-135M-Instruct] [--out bench/results/kv_cache.json]
"""

from __future__ import annotations

import argparse
import functools
import random

import torch

from bench.attention_kernel import DIM, KV_HEADS, call_layers, per_call_s, step
from bench.quantization import TEXT, accuracy_against, decode_step_s
from bench.report import write_results
from services.worker.cpu_kernels import cpu_kernels
from services.worker.runner import ModelRunner, RunnerConfig
from shared.model_info import q8_row_width
from shared.tokenizer import load_tokenizer

FORMATS = ("model", "float16", "int8")


def kernel_ms_per_layer(spans: list[tuple[int, int]], repeats: int) -> dict[str, dict[str, float]]:
    """Per span of context lengths: each storage's best time per layer of a cold 32-row decode step."""
    kernels, _ = cpu_kernels()
    results = {}
    for low, high in spans:
        rng = random.Random(low)
        lens = [rng.randint(low, high) for _ in range(32)]
        layers = 30 if high <= 400 else 8  # longer contexts: fewer layers still overflow every cache
        q, half_caches, tables, context = step(lens, list(range(32)), layers=layers)
        caches = {"model": [c.float() for c in half_caches], "float16": half_caches, "int8": []}
        for c in half_caches:
            q8 = torch.zeros(c.shape[0], 2, KV_HEADS, q8_row_width(DIM), dtype=torch.int8)
            kernels.store_kv_(q8, c.float(), torch.arange(c.shape[0]))
            caches["int8"].append(q8)
        best = {fmt: float("inf") for fmt in FORMATS}
        for _ in range(repeats):
            for fmt in FORMATS:
                best[fmt] = min(best[fmt], per_call_s(functools.partial(call_layers, kernels, q, caches[fmt], tables, context), 0.3) / layers)
        results[f"{low}-{high}"] = {fmt: 1e3 * s for fmt, s in best.items()}
        print(f"kernel, 32 rows, contexts {low}-{high}: " + ", ".join(f"{fmt} {1e3 * s:.3f} ms/layer" for fmt, s in best.items()))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="bench/results/kv_cache.json")
    args = parser.parse_args()

    ids = load_tokenizer(args.model).encode(TEXT)
    blocks = max(args.batches) * -(-(max(args.contexts) + args.steps + 8) // 16)  # decode_step_s's requests at once, blocks of 16
    runners = {fmt: ModelRunner(RunnerConfig(args.model, num_blocks=blocks, block_size=16, weight_quant="int4", kv_cache_dtype=fmt)) for fmt in FORMATS}
    results: dict = {"model": args.model, "weight_quant": "int4", "text_tokens": len(ids), "decode_step_ms": {}}
    results.update(accuracy_against(runners, "model", ids))
    results["kv_bytes_per_token"] = {fmt: runner.describe()["kv_bytes_per_token"] for fmt, runner in runners.items()}
    results["kernel_ms_per_layer"] = kernel_ms_per_layer([(60, 200), (100, 300), (900, 1100)], repeats=3)
    for context in args.contexts:
        for batch in args.batches:
            times = {fmt: [] for fmt in FORMATS}
            for _ in range(3):  # alternate, so a burst of load elsewhere hits all of them
                for fmt, runner in runners.items():
                    times[fmt].append(decode_step_s(runner, batch, context=context, steps=args.steps))
            step_ms = {fmt: 1e3 * min(values) for fmt, values in times.items()}
            results["decode_step_ms"][f"batch {batch}, context {context}"] = step_ms
            print(f"decode step, batch {batch:3d}, context {context}: " + ", ".join(f"{fmt} {ms:.1f} ms" for fmt, ms in step_ms.items()))
    write_results(args.out, results)


if __name__ == "__main__":
    main()
