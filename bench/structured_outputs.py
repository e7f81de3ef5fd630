"""What structured outputs cost: the worker driven in-process on the default model, 128 output tokens a request
(ignoring EOS, so both modes decode the same number of steps) at concurrency 1 and 8, plain text against a moderate
``json_schema``, the modes taking turns round by round. Prints each mode's output tokens/s and its ratio to plain
text's at each concurrency, the grammar's own mask time per constrained token, and xgrammar's compile time (p50 / p99,
each compiled fresh) over the schema set of ``tests/e2e/structured_schemas.json``.

    .venv/bin/python -m bench.structured_outputs [--model DIR] [--rounds 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.structured import StructuredOutputs
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import Grammar, GrammarKind, SamplingParams, Slice, StepPlan
from shared.model_info import load_model_info
from shared.tokenizer import load_tokenizer

CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
        "districts": {"type": "array", "items": {"type": "string", "maxLength": 30}},
        "coastal": {"type": "boolean"},
    },
    "required": ["name", "country", "population", "districts", "coastal"],
    "additionalProperties": False,
}
SCHEMAS = os.path.join(os.path.dirname(__file__), "..", "tests", "e2e", "structured_schemas.json")


def decode_batch(runner: ModelRunner, tag: str, prompt: list[int], params: SamplingParams, concurrency: int, max_tokens: int) -> float:
    """Seconds to prefill ``concurrency`` copies of ``prompt`` and decode ``max_tokens`` tokens each, as one batch."""
    per = -(-(len(prompt) + max_tokens + 1) // runner.block_size)
    rids = [f"{tag}-{i}" for i in range(concurrency)]
    began = time.perf_counter()
    for i, rid in enumerate(rids):
        runner.execute(StepPlan(0, [Slice(rid, 0, len(prompt), prompt, list(range(i * per, (i + 1) * per)), sampling=params)]))
    for step in range(max_tokens - 1):
        runner.execute(StepPlan(step + 1, [Slice(rid, len(prompt) + step, 1) for rid in rids]))
    elapsed = time.perf_counter() - began
    runner.release(rids)
    return elapsed


def compile_times(model: str, vocab_size: int) -> list[float]:
    """Each schema of the set compiled by a fresh compiler (no cache), in seconds."""
    specs = json.load(open(SCHEMAS, encoding="utf-8"))
    times = []
    for spec in specs:
        structured = StructuredOutputs.of_model(model, vocab_size, load_model_info(model).eos_token_ids)
        began = time.perf_counter()
        structured.compile(Grammar(GrammarKind.JSON_SCHEMA, json.dumps(spec["schema"]), strict=True))
        times.append(time.perf_counter() - began)
        structured.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    config = StackConfig()
    concurrencies = (1, 8)
    blocks = max(concurrencies) * (-(-(256 + args.max_tokens) // config.block_size))
    runner = ModelRunner(RunnerConfig(args.model, blocks + 8, config.block_size, "float32", max(concurrencies), config.weight_quant))
    tokenizer = load_tokenizer(args.model)
    messages = [{"role": "user", "content": "Describe Paris as JSON: name, country, population, districts and whether it is coastal."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    began = time.perf_counter()
    runner.structured  # noqa: B018 - the tokenizer info, built once
    print(f"structured_outputs: {args.model} ({config.weight_quant} weights); tokenizer info built in {time.perf_counter() - began:.2f} s")
    modes = {"plain": None, "json_schema": Grammar(GrammarKind.JSON_SCHEMA, json.dumps(CITY), strict=True)}
    seconds: dict[tuple[str, int], list[float]] = {(m, c): [] for m in modes for c in concurrencies}
    masks_before = runner.structured.describe()
    for round_ in range(args.rounds):
        for concurrency in concurrencies:
            for mode, grammar in modes.items():
                params = SamplingParams(temperature=0, grammar=grammar)
                seconds[(mode, concurrency)].append(decode_batch(runner, f"{mode}-{concurrency}-{round_}", prompt, params, concurrency, args.max_tokens))
    masks = runner.structured.describe()
    filled = masks["masks_filled"] - masks_before["masks_filled"]
    mask_ms = (masks["mask_seconds"] - masks_before["mask_seconds"]) / max(1, filled) * 1e3
    print(f"{'concurrency':>11} {'plain tok/s':>12} {'schema tok/s':>13} {'ratio':>6}")
    for concurrency in concurrencies:
        rates = {m: concurrency * args.max_tokens / statistics.median(seconds[(m, concurrency)]) for m in modes}
        print(f"{concurrency:>11} {rates['plain']:>12.1f} {rates['json_schema']:>13.1f} {rates['json_schema'] / rates['plain']:>6.2f}")
    print(f"mask: {mask_ms:.3f} ms per constrained token ({filled} masks filled and applied)")
    times = sorted(compile_times(args.model, runner.structured.vocab_size))
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    print(f"compile over {len(times)} schemas: p50 {statistics.median(times) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {times[-1] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
