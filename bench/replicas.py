"""Throughput of 1 engine replica against 2 at the same total cores.

Configurations (``--cores C``, default 2): one replica whose worker has C torch threads, and
two replicas whose workers have C/2 threads each, behind one api (``--router-policy``). The
workload is ``--requests`` greedy streamed chats of ``--output-tokens`` each (ignore_eos), all
sent at once; reported per configuration: output tokens/s, TTFT and inter-token percentiles,
and how the router spread the requests.

    python -m bench.replicas [--model DIR] [--cores 2] [--requests 16] [--output-tokens 64] [--out bench/results/replicas.json]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.report import percentile, write_results
from bench.stack_throughput import PROMPTS
from shared.config import DEFAULT_MODEL_DIR
from shared.devtools.sse import stream_chat
from shared.devtools.stack import running_stack, served_model


async def _load(url: str, model: str, requests: int, output_tokens: int) -> dict:
    await stream_chat(url, model, [{"role": "user", "content": "Hello"}], 4)  # warm-up, not counted
    started = time.perf_counter()
    messages = [[{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (variant {i})"}] for i in range(requests)]
    runs = await asyncio.gather(*(stream_chat(url, model, m, output_tokens) for m in messages))
    wall = time.perf_counter() - started
    tokens = sum(r.usage.get("completion_tokens", 0) for r in runs)
    gaps = [b - a for r in runs for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2),
        "ttft_p50_s": percentile([r.chunk_times[0] - r.start for r in runs if r.chunk_times], 50),
        "ttft_p90_s": percentile([r.chunk_times[0] - r.start for r in runs if r.chunk_times], 90),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p90_s": percentile(gaps, 90),
    }


def _routed(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    return {
        sample.labels["replica"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tokenyard:router_requests_total"
    }


def run(model: str, replicas: int, threads: int, policy: str, requests: int, output_tokens: int, kv_cache_tokens: int, step_tokens: int) -> dict:
    flags = ["--replicas", str(replicas), "--num-threads", str(threads), "--router-policy", policy]
    flags += ["--kv-cache-tokens", str(kv_cache_tokens), "--max-num-batched-tokens", str(step_tokens)]
    with running_stack(model, *flags, timeout_s=1800) as url:
        result = asyncio.run(_load(url, served_model(url), requests, output_tokens))
        result["routed"] = _routed(url)
    return {"replicas": replicas, "threads_per_worker": threads, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--cores", type=int, default=2, help="total worker threads, split evenly between the replicas")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--router-policy", default="load")
    parser.add_argument("--kv-cache-tokens", type=int, default=8192)
    parser.add_argument("--step-tokens", type=int, default=256, help="--max-num-batched-tokens (also caps the workers' warm-up ladder)")
    parser.add_argument("--out", default="bench/results/replicas.json")
    args = parser.parse_args()
    if args.cores < 2 or args.cores % 2:
        parser.error("--cores must be even and at least 2 (two replicas get half each)")
    runs = []
    for replicas in (1, 2):
        threads = args.cores // replicas
        print(f"{replicas} replica(s) x {threads} thread(s) ...", flush=True)
        runs.append(run(args.model, replicas, threads, args.router_policy, args.requests, args.output_tokens, args.kv_cache_tokens, args.step_tokens))
        print(runs[-1], flush=True)
    write_results(
        args.out,
        {
            "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()},
            "workload": {
                "requests": args.requests,
                "output_tokens": args.output_tokens,
                "cores": args.cores,
                "router_policy": args.router_policy,
                "step_tokens": args.step_tokens,
            },
            "runs": runs,
            "speedup_2_over_1": round(runs[1]["output_tok_s"] / runs[0]["output_tok_s"], 3),
        },
    )


if __name__ == "__main__":
    main()
