"""Long prefills through the expert cache: each MoE layer's experts read whole and streamed under the layer before
(``--expert-cache-fill streamed``) against reading a layer's misses once its router has run (``on-demand``) and the
worker's own choice (``auto``). The MoE benchmark model with its experts in int4 blocks, in process, one ``ModelRunner``
per (cache size, fill), the fills taking turns prompt by prompt.

    .venv/bin/python -m bench.expert_stream --model models/moe-bench [--percents 50 25 12.5] [--fills on-demand streamed auto] \\
        [--prompt-tokens 512] [--prompts 3] [--decode-tokens 16] [--out bench/results/expert_stream.json]

Each prompt is prefilled in one step (a new request, nothing of it cached), then decoded ``--decode-tokens`` tokens
at c=1. Per setting it prints the prefill's tokens/s and its ratio to on-demand's at the same size and to all
experts resident (cache size 0), the bytes the prefill read from the store and the experts it evicted, and the
decode's hit rate after it: what the prefill left of the bank. Every setting's greedy tokens are checked against
the all-resident run's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.expert_cache import chat_prompts
from bench.report import write_results
from services.worker.runner import ModelRunner, RunnerConfig
from shared.choices import EXPERT_CACHE_FILLS
from shared.config import StackConfig
from shared.frames import SamplingParams, Slice, StepPlan

GREEDY = SamplingParams(temperature=0)


def long_prompt(prompts: list[list[int]], tokens: int, index: int) -> list[int]:
    """``tokens`` tokens of chat prompts, joined from the ``index``-th on: a prompt no other one shares a block with."""
    out: list[int] = []
    while len(out) < tokens:
        out += prompts[index % len(prompts)]
        index += 1
    return out[:tokens]


def run_prompt(runner: ModelRunner, rid: str, prompt: list[int], decode_tokens: int) -> dict[str, Any]:
    """One request: its prefill (one step) timed with the store reads and evictions it caused, then its decode's hit
    rate (all experts resident: no cache, none of these)."""
    cache = runner.expert_cache
    before = (cache.bytes_read, cache.evictions) if cache is not None else (0, 0)
    blocks = list(range(-(-(len(prompt) + decode_tokens + 1) // runner.block_size)))
    began = time.perf_counter()
    tokens = [runner.execute(StepPlan(0, [Slice(rid, 0, len(prompt), prompt, blocks, sampling=GREEDY)])).sampled[0].token_id]
    facts: dict[str, Any] = {"prefill_s": time.perf_counter() - began, "fill": "resident", "bytes_read": 0, "evicted": 0, "decode_hit_rate": None}
    if cache is not None:
        facts.update(fill=cache.last_fill, bytes_read=cache.bytes_read - before[0], evicted=cache.evictions - before[1])
        before = (cache.hits, cache.misses)
    for step in range(decode_tokens - 1):
        tokens.append(runner.execute(StepPlan(step + 1, [Slice(rid, len(prompt) + step, 1)])).sampled[0].token_id)
    runner.release([rid])
    if cache is not None and (lookups := cache.hits - before[0] + cache.misses - before[1]):
        facts["decode_hit_rate"] = (cache.hits - before[0]) / lookups
    return {**facts, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/moe-bench", help="the MoE benchmark model's HF directory (bench.moe_model)")
    parser.add_argument("--weight-quant", default="int4", help="--weight-quant of the worker (experts in blocks)")
    parser.add_argument(
        "--percents", type=float, nargs="+", default=[0.0, 50.0, 25.0, 12.5], help="cache sizes, percent of the experts (0: all resident, once)"
    )
    parser.add_argument(
        "--fills",
        nargs="+",
        choices=EXPERT_CACHE_FILLS,
        default=["on-demand", "streamed", "auto"],
        help="--expert-cache-fill settings (the first is the baseline)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--prompts", type=int, default=3, help="prompts timed per setting (after one untimed)")
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--out", default="bench/results/expert_stream.json")
    args = parser.parse_args(argv)
    prompts = chat_prompts(args.model)
    blocks = -(-(args.prompt_tokens + args.decode_tokens + 1) // StackConfig().block_size) + 1
    runners: dict[tuple[float, str], ModelRunner] = {}
    for percent in args.percents:
        for fill in args.fills[:1] if percent == 0 else args.fills:
            config = StackConfig(model=args.model, weight_quant=args.weight_quant, expert_cache_bytes=f"{percent:g}%", expert_cache_fill=fill)
            runners[(percent, fill)] = runner = ModelRunner(RunnerConfig.of(config, num_blocks=blocks))
            runner.warmup()
            run_prompt(runner, "warm", long_prompt(prompts, args.prompt_tokens, 0), args.decode_tokens)
    results: dict[tuple[float, str], list[dict[str, Any]]] = {key: [] for key in runners}
    for i in range(1, args.prompts + 1):
        prompt = long_prompt(prompts, args.prompt_tokens, 7 * i)
        for key, runner in runners.items():
            results[key].append(run_prompt(runner, f"p{i}", prompt, args.decode_tokens))
    print(
        f"{args.model}, {args.prompt_tokens}-token prefills in one step, {args.prompts} each; "
        f"{' / '.join(args.fills)} per cache size, ratios against {args.fills[0]} at the same size and against all resident"
    )
    print(
        f"{'cache':>6} {'fill':>10} {'ran':>18} {'prefill s':>9} {'tok/s':>7} {'ratio':>6} {'vs 0':>5} {'MB read':>8} {'evicted':>8} "
        f"{'decode hit':>10} {'same tokens':>11}"
    )
    rows = []
    resident = results.get((0.0, args.fills[0]))
    for (percent, fill), runs in results.items():
        base = results[(percent, args.fills[0])]  # the same size's first fill
        seconds, base_seconds = statistics.median(r["prefill_s"] for r in runs), statistics.median(r["prefill_s"] for r in base)
        resident_seconds = statistics.median(r["prefill_s"] for r in resident) if resident else None
        hits = [r["decode_hit_rate"] for r in runs if r["decode_hit_rate"] is not None]
        row = {
            "cache_percent": percent,
            "fill": fill,
            "ran": sorted({r["fill"] for r in runs}),
            "prefill_s": seconds,
            "prefill_tokens_per_s": args.prompt_tokens / seconds,
            "vs_baseline": base_seconds / seconds,
            "vs_resident": resident_seconds / seconds if resident_seconds else None,
            "bytes_read": statistics.median(r["bytes_read"] for r in runs),
            "evicted": statistics.median(r["evicted"] for r in runs),
            "decode_hit_rate": statistics.mean(hits) if hits else None,
            "same_tokens": [r["tokens"] for r in runs] == [r["tokens"] for r in resident or base],
            "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs],
        }
        rows.append(row)
        hit = f"{row['decode_hit_rate']:.3f}" if row["decode_hit_rate"] is not None else "-"
        vs_resident = f"{row['vs_resident']:>4.2f}x" if row["vs_resident"] else f"{'-':>5}"
        print(
            f"{percent:>5g}% {fill if percent else '-':>10} {'/'.join(row['ran']):>18} {seconds:>9.3f} {row['prefill_tokens_per_s']:>7.1f} {row['vs_baseline']:>5.2f}x {vs_resident} "
            f"{row['bytes_read'] / 1e6:>8.1f} {row['evicted']:>8.0f} {hit:>10} {str(row['same_tokens']):>11}",
            flush=True,
        )
    write_results(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
