"""Output tokens/s of copy-heavy requests (c=1, greedy) with prompt lookup speculation off and at each k, in process.

    .venv/bin/python -m bench.speculative_ngram [--model DIR] [--workload FILE] [--k 3 5 8] [--requests 16] [--repeats 1]

The scheduler and the runner run in one process (shared/devtools/inprocess_engine.py), pipelined as the stack
runs them, on the prompts of a frozen workload (default: bench/workloads/copy-edit.json), each request to its
own end of turn (at most the workload's output_tokens). Per prompt the settings take turns (off, then each k),
so a busy machine's drift falls on all of them. It prints each setting's output tokens/s and its ratio to
speculation off, the acceptance rate, the tokens each verify gave, the median forward time of a step by its
largest slice (a plain decode: 1; a verify: k + 1), and whether every setting gave the same tokens (they must).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict

from bench.serve.workload import load_workload
from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.speculation import Speculation
from services.worker.runner import ModelRunner, RunnerConfig
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.devtools.inprocess_engine import InProcessEngine
from shared.frames import SamplingParams, StepPlan, StepResult, Submit
from shared.tokenizer import load_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_BLOCKS = 512


def _timed(runner: ModelRunner, forward_s: dict[int, list[float]]):
    """``runner.execute`` that records each step's forward time by its largest slice's positions."""
    execute = runner.execute

    def timed(plan: StepPlan) -> StepResult:
        result = execute(plan)
        if not any(s.token_ids for s in plan.slices):  # decodes and verifies, not prefill
            forward_s[max(s.num_tokens for s in plan.slices)].append(result.forward_s)
        return result

    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--workload", default=os.path.join(REPO, "bench", "workloads", "copy-edit.json"))
    parser.add_argument("--k", type=int, nargs="+", default=[3, 5, 8], help="proposed tokens a verify checks, one setting each")
    parser.add_argument("--requests", type=int, default=None, help="the workload's first N prompts (default: all)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    workload = load_workload(args.workload)
    tokenizer = load_tokenizer(args.model)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        for p in workload.prompts[: args.requests]
    ]
    stop = [] if workload.ignore_eos or tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    settings = [0, *args.k]
    # The stack's own worker settings (int4 weights and an fp16 KV cache on the CPU), as the launcher gives them.
    configs = {k: StackConfig(model=args.model, speculative_method="ngram" if k else "", num_speculative_tokens=max(k, 1)) for k in settings}
    runners = {k: ModelRunner(RunnerConfig.of(config, num_blocks=NUM_BLOCKS)) for k, config in configs.items()}
    forward_s: dict[int, dict[int, list[float]]] = {k: defaultdict(list) for k in settings}
    for k, runner in runners.items():
        runner.warmup()
        runner.execute = _timed(runner, forward_s[k])
    tokens, seconds, outputs = dict.fromkeys(settings, 0), dict.fromkeys(settings, 0.0), defaultdict(list)
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            for k, runner in runners.items():
                speculation = Speculation(k, 4) if k else None
                scheduler = Scheduler(BlockPool(NUM_BLOCKS, configs[k].block_size), 8, 512, 100, decode_plan_s=0.02, speculation=speculation)
                submit = Submit(
                    rid=f"r{repeat}-{i}", prompt_ids=prompt, max_tokens=workload.output_tokens, sampling=SamplingParams(temperature=0),
                    ignore_eos=workload.ignore_eos, stop_token_ids=stop,
                )  # fmt: skip
                began = time.perf_counter()
                run = InProcessEngine(scheduler, runner).run([submit])
                seconds[k] += time.perf_counter() - began
                tokens[k] += len(run.outputs[submit.rid])
                outputs[k].append(run.outputs[submit.rid])
    print(f"{workload.name}: {len(prompts)} prompts x {args.repeats}, greedy, c=1")
    for k in settings:
        rate = tokens[k] / seconds[k]
        line = f"{'off' if k == 0 else f'ngram k={k}':>12}: {tokens[k]} tokens in {seconds[k]:.2f} s = {rate:.1f} tokens/s ({rate / (tokens[0] / seconds[0]):.2f}x off)"
        spec = runners[k].speculator
        if spec is not None:
            line += f", acceptance {spec.accepted_tokens}/{spec.draft_tokens} = {spec.accepted_tokens / max(spec.draft_tokens, 1):.2f}"
            line += f", {(spec.drafts + spec.accepted_tokens) / max(spec.drafts, 1):.2f} tokens a verify"
        steps = ", ".join(f"{rows}: {statistics.median(times) * 1000:.2f} ms" for rows, times in sorted(forward_s[k].items()))
        print(f"{line}; forward by positions {steps}", flush=True)
    print("outputs identical:", all(outputs[k] == outputs[0] for k in settings))


if __name__ == "__main__":
    main()
