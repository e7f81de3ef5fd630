"""The whole stack (launcher, api, scheduler, worker, detokenizer) serving from a CUDA device, with no network.

A random 2-layer Llama with SmolLM2's vocabulary (``shared/devtools/random_model.py``, wide logit margins) is served in
float32 with CUDA graphs on. Eight concurrent greedy completions, whose prompts (token ids) and lengths differ so
that they join and leave the batch at different steps, must equal Hugging Face transformers' greedy decoding on
the same GPU, text and token counts; two completions held to a JSON schema (greedy and sampled) must end in a
JSON value the schema allows; then one streamed chat completion must arrive as SSE chunks ending in ``[DONE]``
with its usage. Prints the worker's /instrumentation (device, graphs). Exit status 1 on a mismatch;
skips with a message when there is no CUDA device.

    python -m bench.gpu_stack_check [--tokenizer DIR] [--dtype float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from shared.config import DEFAULT_MODEL_DIR
from shared.devtools.random_model import build_random_smollm
from shared.devtools.sse import StreamError, stream_chat
from shared.devtools.stack import running_stack, served_model

PROMPT_LENGTHS = (5, 17, 33, 64, 100, 3, 250, 9)
OUTPUT_LENGTHS = (24, 8, 40, 16, 32, 12, 20, 36)


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def greedy_reference(model_dir: str, prompts: list[list[int]], lengths: tuple[int, ...], device: str) -> list[list[int]]:
    """transformers' greedy tokens for each prompt on ``device`` in float32, never stopping at EOS (as ``ignore_eos``)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outputs = []
    with torch.no_grad():
        for prompt, length in zip(prompts, lengths):
            tokens = list(prompt)
            for _ in range(length):
                tokens.append(int(model(torch.tensor([tokens], device=device)).logits[0, -1].argmax()))
            outputs.append(tokens[len(prompt) :])
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL_DIR, help="directory holding SmolLM2's tokenizer files")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the same check on this machine's CPU (dry run)")
    parser.add_argument("--out", help="also write the worker's /instrumentation JSON here")
    parser.add_argument("--log", help="the launcher's and its children's output (default: dropped)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_stack_check: no CUDA device here; skipped (run it on a GPU host)")
        return 0
    from transformers import AutoTokenizer

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in PROMPT_LENGTHS]
    failures = []
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = build_random_smollm(f"{scratch}/tiny-smollm", "tiny", initializer_range=0.2, dtype=args.dtype, tokenizer_dir=args.tokenizer)
        expected = greedy_reference(model_dir, prompts, OUTPUT_LENGTHS, args.device)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        # a KV cache of fixed size: sized by the GPU's free memory, 2 layers of 64 would get millions of blocks
        flags = ("--device", args.device, "--dtype", args.dtype, "--cuda-graph-max-batch", "8", "--gpu-memory-utilization", "0", "--kv-cache-tokens", "65536")
        with running_stack(model_dir, *flags, timeout_s=300, log_path=args.log) as url:
            model = served_model(url)
            bodies = [{"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True} for prompt, n in zip(prompts, OUTPUT_LENGTHS)]
            with ThreadPoolExecutor(len(bodies)) as pool:
                replies = list(pool.map(lambda body: post(f"{url}/v1/completions", body), bodies))
            for i, (reply, tokens) in enumerate(zip(replies, expected)):
                text, want = reply["choices"][0]["text"], tokenizer.decode(tokens, skip_special_tokens=True)
                count = reply["usage"]["completion_tokens"]
                ok = text == want and count == len(tokens)
                print(f"request {i}: prompt {len(prompts[i]):>3} tokens, {count:>2} generated: {'equal to transformers' if ok else 'DIFFERS'}")
                if not ok:
                    failures.append(f"request {i}: ours {text!r} ({count} tokens), transformers {want!r} ({len(tokens)})")
            schema = {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["n", "ok"],
                "additionalProperties": False,
            }
            for temperature in (0, 1.0):  # greedy, then the device sampler's resampling over the allowed tokens
                body = {"model": model, "prompt": prompts[0], "max_tokens": 64, "temperature": temperature, "seed": 1}
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "check", "schema": schema}}
                reply = post(f"{url}/v1/completions", body)["choices"][0]
                try:
                    value = json.loads(reply["text"])
                    ok = reply["finish_reason"] == "stop" and set(value) == {"n", "ok"}
                except ValueError:
                    ok = False
                print(f"structured output at temperature {temperature}: {reply['text']!r} ({reply['finish_reason']})")
                if not ok:
                    failures.append(f"structured output at temperature {temperature}: {reply['text']!r}, finish {reply['finish_reason']}")
            try:  # a stream that does not end in [DONE] is a StreamError
                streamed = asyncio.run(stream_chat(url, model, [{"role": "user", "content": "Name three rivers."}], 16))
                print(f"streamed chat: {len(streamed.chunk_times)} content chunks, usage {streamed.usage}")
                if streamed.usage.get("completion_tokens") != 16 or not streamed.chunk_times:
                    failures.append(f"streamed chat: {len(streamed.chunk_times)} chunks, usage {streamed.usage}")
            except StreamError as exc:
                failures.append(f"streamed chat: {exc}")
            port = int(url.rsplit(":", 1)[1])
            with urllib.request.urlopen(f"http://127.0.0.1:{port + 2}/instrumentation", timeout=10) as response:
                instrumentation = json.load(response)
            print("worker /instrumentation:", json.dumps(instrumentation)[:2000])
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(instrumentation, f, indent=2)
    for failure in failures:
        print("gpu_stack_check: FAILED:", failure)
    print("gpu_stack_check:", "FAILED" if failures else f"the stack on {args.device} serves transformers' greedy tokens")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
