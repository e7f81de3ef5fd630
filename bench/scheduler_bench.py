"""What the scheduler's features buy, each measured against its own off switch in one run.

1. Pipelined steps (two plans in flight) vs strictly alternating plan/result: decode tok/s
   of 8 streams through the whole stack.
2. Prefix cache on vs off: time to first token of requests that share a long system prompt.
3. Chunked vs unchunked prefill: inter-token latency p99 of 8 running streams while long
   prompts arrive.

    python -m bench.scheduler_bench [--model DIR] [--out bench/results/scheduler.json]
"""

from __future__ import annotations

import argparse
import asyncio

from bench.report import percentile, write_results
from shared.config import DEFAULT_MODEL_DIR
from shared.devtools.sse import stream_chat
from shared.devtools.stack import running_stack, served_model

SYSTEM = " ".join(f"Rule {i}: always answer politely, precisely and briefly, citing the relevant rule number." for i in range(40))
LONG_PROMPT = " ".join(f"Paragraph {i} of a long document about the history of lighthouses and their keepers." for i in range(60))


async def _decode_throughput(url: str, model: str, streams: int = 8, tokens: int = 96) -> dict:
    await stream_chat(url, model, [{"role": "user", "content": "warm up"}], 4)
    runs = await asyncio.gather(*(stream_chat(url, model, [{"role": "user", "content": f"Tell story number {i}."}], tokens) for i in range(streams)))
    start, end = min(r.start for r in runs), max(r.end for r in runs)
    total = sum(r.usage["completion_tokens"] for r in runs)
    return {"output_tok_s": total / (end - start), "itl_p50_ms": 1000 * percentile([b - a for r in runs for a, b in zip(r.chunk_times, r.chunk_times[1:])], 50)}


async def _shared_prefix_ttft(url: str, model: str, requests: int = 6) -> dict:
    ttfts, cached = [], []
    for i in range(requests):  # one after another: each can reuse what the previous ones computed
        run = await stream_chat(url, model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}: what is rule {i}?"}], 4)
        ttfts.append(run.chunk_times[0] - run.start)
        cached.append(run.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
    return {
        "ttft_first_ms": 1000 * ttfts[0],
        "ttft_rest_p50_ms": 1000 * percentile(ttfts[1:], 50),
        "prompt_tokens": run.usage["prompt_tokens"],
        "cached_tokens": cached,
    }


async def _itl_under_long_prompts(url: str, model: str, streams: int = 8, long_prompts: int = 3) -> dict:
    running = [asyncio.create_task(stream_chat(url, model, [{"role": "user", "content": f"Count slowly, story {i}."}], 120)) for i in range(streams)]
    await asyncio.sleep(1.0)
    longs = [asyncio.create_task(stream_chat(url, model, [{"role": "user", "content": f"{LONG_PROMPT} Summary {j}:"}], 4)) for j in range(long_prompts)]
    runs = await asyncio.gather(*running)
    await asyncio.gather(*longs)
    gaps = [b - a for r in runs for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {"itl_p50_ms": 1000 * percentile(gaps, 50), "itl_p99_ms": 1000 * percentile(gaps, 99), "itl_max_ms": 1000 * max(gaps)}


def _measure(model: str, flags: list[str], probe) -> dict:
    with running_stack(model, *flags) as url:
        return asyncio.run(probe(url, served_model(url)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", default="bench/results/scheduler.json")
    args = parser.parse_args()
    runs = {
        "pipelined": (["--pipeline-depth", "2"], _decode_throughput),
        "alternating": (["--pipeline-depth", "1"], _decode_throughput),
        "prefix_cache_on": (["--enable-prefix-cache", "true"], _shared_prefix_ttft),
        "prefix_cache_off": (["--enable-prefix-cache", "false"], _shared_prefix_ttft),
        "chunked_256": (["--max-num-batched-tokens", "256"], _itl_under_long_prompts),
        "unchunked": (["--max-num-batched-tokens", "2048"], _itl_under_long_prompts),  # the long prompts are ~1,000 tokens
    }
    results: dict = {}
    for name, (flags, probe) in runs.items():
        results[name] = _measure(args.model, flags, probe)
        write_results(args.out, results)  # after each stack, so an interrupted run keeps what it measured
    p, a = results["pipelined"], results["alternating"]
    print(
        f"decode, 8 streams: pipelined {p['output_tok_s']:.1f} tok/s vs alternating {a['output_tok_s']:.1f} tok/s (x{p['output_tok_s'] / a['output_tok_s']:.2f})"
    )
    on, off = results["prefix_cache_on"], results["prefix_cache_off"]
    print(
        f"shared {on['prompt_tokens']}-token prompt, TTFT p50 after the first: cache on {on['ttft_rest_p50_ms']:.0f} ms vs off {off['ttft_rest_p50_ms']:.0f} ms "
        f"(x{off['ttft_rest_p50_ms'] / on['ttft_rest_p50_ms']:.2f} faster); cached tokens {on['cached_tokens']}"
    )
    c, u = results["chunked_256"], results["unchunked"]
    print(
        f"ITL p99 of running streams while long prompts arrive: chunked {c['itl_p99_ms']:.0f} ms vs unchunked {u['itl_p99_ms']:.0f} ms (max {c['itl_max_ms']:.0f} vs {u['itl_max_ms']:.0f} ms)"
    )
    write_results(args.out, results)


if __name__ == "__main__":
    main()
