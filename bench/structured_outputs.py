"""What structured outputs cost per decode step: the worker driven in-process on the default model, one greedy
request at a time, plain text against ``json_object`` and against a three-member ``json_schema``, the modes taking
turns round by round. Prints each mode's median decode step, its ratio to plain text's, the tokens generated, and
the grammar's work (its milliseconds per constrained token; tokens checked, resampled, masks built and their time),
plus the one-time vocabulary build. Steps differ in context length between modes (outputs differ), so the step
ratio carries that as well as noise; the grammar's own time is measured directly.

    .venv/bin/python -m bench.structured_outputs [--model DIR] [--rounds 3] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from services.worker.runner import ModelRunner, RunnerConfig
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.frames import SamplingParams, Slice, StepPlan
from shared.tokenizer import load_tokenizer

CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
MODES = {"plain": None, "json_object": '{"type":"object"}', "json_schema": json.dumps(CITY)}


def generate(runner: ModelRunner, rid: str, prompt: list[int], params: SamplingParams, max_tokens: int, eos: set[int]) -> tuple[list[int], list[float]]:
    """One request's tokens (to EOS or ``max_tokens``) and the seconds of each decode step."""
    blocks = list(range(-(-(len(prompt) + max_tokens + 1) // runner.block_size)))
    result = runner.execute(StepPlan(0, [Slice(rid, 0, len(prompt), prompt, blocks, sampling=params)]))
    tokens, steps, position = [result.sampled[0].token_id], [], len(prompt)
    while tokens[-1] not in eos and len(tokens) < max_tokens:
        began = time.perf_counter()
        result = runner.execute(StepPlan(position, [Slice(rid, position, 1)]))
        steps.append(time.perf_counter() - began)
        tokens.append(result.sampled[0].token_id)
        position += 1
    runner.release([rid])
    return tokens, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    config = StackConfig()
    runner = ModelRunner(RunnerConfig(args.model, 256, config.block_size, "float32", 8, config.weight_quant))
    tokenizer = load_tokenizer(args.model)
    messages = [{"role": "user", "content": "Describe Paris as JSON with its name, country and population."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    eos = {tokenizer.eos_token_id}
    began = time.perf_counter()
    runner.structured.grammar(MODES["json_object"])
    print(f"structured_outputs: {args.model} ({config.weight_quant} weights); vocabulary and trie built in {time.perf_counter() - began:.2f} s")
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    texts: dict[str, str] = {}
    work: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    for round_ in range(args.rounds):
        for mode, schema in MODES.items():
            before = runner.structured.describe()
            tokens, times = generate(runner, f"{mode}-{round_}", prompt, SamplingParams(temperature=0, json_schema=schema), args.max_tokens, eos)
            after = runner.structured.describe()
            steps[mode] += times
            texts[mode] = tokenizer.decode(tokens, skip_special_tokens=True)
            for key in ("tokens_checked", "tokens_resampled", "masks_built", "mask_seconds", "seconds"):
                work[mode][key] = work[mode].get(key, 0) + after[key] - before[key]
            work[mode]["tokens"] = len(tokens)
    plain = statistics.median(steps["plain"])
    print(f"{'mode':>12} {'step ms':>8} {'vs plain':>9} {'grammar ms':>11} {'tokens':>7} {'checked':>8} {'resampled':>10} {'masks':>6} {'mask s':>7}")
    for mode in MODES:
        median, w = statistics.median(steps[mode]), work[mode]
        per_step = w["seconds"] / max(1, w["tokens_checked"]) * 1e3  # grammar work per constrained token
        print(
            f"{mode:>12} {median * 1e3:>8.2f} {median / plain:>8.2f}x {per_step:>11.3f} {w['tokens']:>7.0f} {w['tokens_checked']:>8.0f} "
            f"{w['tokens_resampled']:>10.0f} {w['masks_built']:>6.0f} {w['mask_seconds']:>7.3f}"
        )
    for mode, text in texts.items():
        print(f"{mode}: {text[:200]!r}")


if __name__ == "__main__":
    main()
