"""A hybrid model's prefix cache (GDN state checkpoints) on against off, through the whole stack, on a tiny-but-long
random qwen3_next (SmolLM2's tokenizer, ``BENCH_SHAPE``: large enough that a long prefill costs what a prefill
of a real model's history does relative to a decode step, unlike the tests' tiny one):

1. TTFT of the next turn of a conversation whose history is ~2,000 tokens (the turn before it served, so its history
   is cached where the cache is on);
2. output tokens/s of 16 streams, each a multi-turn conversation over its own ~2,000-token history.

Rounds alternate the two stacks (both stay up), reversing their order every other round.

    python -m bench.hybrid_prefix [--model DIR] [--rounds 3] [--out bench/results/hybrid_prefix.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
from contextlib import ExitStack

from bench.report import write_results
from shared.devtools.random_model import build_random_qwen3_next
from shared.devtools.sse import stream_chat
from shared.devtools.stack import running_stack, served_model

# 8 layers (6 Gated DeltaNet, 2 full attention) of width 256, 8 experts: ~1/4 s for a 2,000-token prefill on 2 cores.
BENCH_SHAPE: dict[str, object] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
)
FLAGS = ["--kv-cache-tokens", "131072", "--max-num-batched-tokens", "2048", "--max-num-seqs", "16"]


def history(seed: int, facts: int = 190) -> list[dict]:
    """A conversation of ~2,000 tokens whatever the seed: a long system prompt (distinct per ``seed`` from its first
    tokens on) and a few turns."""
    text = " ".join(f"fact {i} about lighthouses and tides" for i in range(facts))
    return [
        {"role": "system", "content": f"Conversation {seed}. {text}"},
        {"role": "user", "content": "Summarise the facts."},
        {"role": "assistant", "content": "They are about lighthouses and tides."},
    ]


async def next_turn_ttft(url: str, model: str, seed: int, conversations: int = 4) -> dict:
    """Per conversation: one turn (which caches its history), then the next turn's TTFT."""
    ttfts, cached, prompt = [], [], 0
    for c in range(conversations):
        messages = [*history(seed + c), {"role": "user", "content": "First question?"}]
        await stream_chat(url, model, messages, 8)
        messages += [{"role": "assistant", "content": "An answer."}, {"role": "user", "content": "Next question?"}]
        run = await stream_chat(url, model, messages, 8)
        ttfts.append(run.chunk_times[0] - run.start)
        cached.append(run.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0))
        prompt = run.usage["prompt_tokens"]
    return {"ttft_ms": 1000 * statistics.median(ttfts), "prompt_tokens": prompt, "cached_tokens": cached}


async def multi_turn_throughput(url: str, model: str, seed: int, streams: int = 16, turns: int = 3, output_tokens: int = 32) -> dict:
    async def conversation(i: int) -> tuple[float, float, int, int, int]:
        messages = history(seed + i)
        start = end = None
        tokens = prompt = cached = 0
        for t in range(turns):
            messages = [*messages, {"role": "user", "content": f"Question {t}?"}]
            run = await stream_chat(url, model, messages, output_tokens)
            start = run.start if start is None else start
            end = run.end
            tokens += run.usage["completion_tokens"]
            prompt += run.usage["prompt_tokens"]
            cached += run.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            messages = [*messages, {"role": "assistant", "content": f"Answer {t}."}]
        return start, end, tokens, prompt, cached

    runs = await asyncio.gather(*(conversation(i) for i in range(streams)))
    start, end = min(r[0] for r in runs), max(r[1] for r in runs)
    cached = sum(r[4] for r in runs) / sum(r[3] for r in runs)
    return {"output_tok_s": sum(r[2] for r in runs) / (end - start), "wall_s": end - start, "cached_fraction": cached}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a hybrid model directory (default: a tiny random qwen3_next built in a temp dir)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="bench/results/hybrid_prefix.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stacks:
        model = args.model or build_random_qwen3_next(os.path.join(tmp, "bench-qwen3-next"), **BENCH_SHAPE)
        urls = {
            "on": stacks.enter_context(running_stack(model, *FLAGS)),
            "off": stacks.enter_context(running_stack(model, *FLAGS, "--enable-prefix-cache", "false")),
        }
        name = served_model(urls["on"])
        rounds = []
        for r in range(args.rounds):
            order = ["on", "off"] if r % 2 == 0 else ["off", "on"]
            result = {}
            for which in order:  # each round's conversations are new to both stacks: distinct seeds per round
                ttft = asyncio.run(next_turn_ttft(urls[which], name, 1000 * r))
                throughput = asyncio.run(multi_turn_throughput(urls[which], name, 1000 * r + 100))
                result[which] = {"next_turn": ttft, "multi_turn": throughput}
            result["ttft_speedup"] = result["off"]["next_turn"]["ttft_ms"] / result["on"]["next_turn"]["ttft_ms"]
            result["throughput_ratio"] = result["on"]["multi_turn"]["output_tok_s"] / result["off"]["multi_turn"]["output_tok_s"]
            rounds.append(result)
            print(
                f"round {r}: next-turn TTFT on {result['on']['next_turn']['ttft_ms']:.1f} ms, off {result['off']['next_turn']['ttft_ms']:.1f} ms "
                f"({result['ttft_speedup']:.1f}x, cached {result['on']['next_turn']['cached_tokens']} of {result['on']['next_turn']['prompt_tokens']}); "
                f"16-stream multi-turn on {result['on']['multi_turn']['output_tok_s']:.1f} tok/s, off {result['off']['multi_turn']['output_tok_s']:.1f} "
                f"({result['throughput_ratio']:.2f}x, {result['on']['multi_turn']['cached_fraction']:.0%} of prompt tokens cached)"
            )
    summary = {
        "ttft_speedup_median": statistics.median(r["ttft_speedup"] for r in rounds),
        "throughput_ratio_median": statistics.median(r["throughput_ratio"] for r in rounds),
        "rounds": rounds,
    }
    print(f"median: next-turn TTFT {summary['ttft_speedup_median']:.1f}x faster, 16-stream output {summary['throughput_ratio_median']:.2f}x")
    write_results(args.out, summary)


if __name__ == "__main__":
    main()
