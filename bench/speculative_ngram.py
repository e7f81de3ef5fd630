"""Output tokens/s of one copy-heavy request (c=1, greedy) with prompt lookup speculation on and off, in process.

    .venv/bin/python -m bench.speculative_ngram [--model DIR] [--tokens 160] [--repeats 2] [--k 3]

The scheduler and the runner run in one process (shared/devtools/inprocess_engine.py), pipelined as the
stack runs them; the runs alternate off/on so a busy machine's drift falls on both. It prints each run's
tokens/s, the acceptance rate, and whether the outputs of both are the same tokens (they must be).
"""

from __future__ import annotations

import argparse
import time

from services.scheduler.core import Scheduler
from services.scheduler.kv_blocks import BlockPool
from services.scheduler.speculation import Speculation
from services.worker.runner import ModelRunner, RunnerConfig
from shared.config import DEFAULT_MODEL_DIR, StackConfig
from shared.devtools.inprocess_engine import InProcessEngine
from shared.frames import SamplingParams, Submit
from shared.tokenizer import load_tokenizer

TEXT = (
    "The scheduler plans every step: it admits waiting requests while their KV blocks fit, splits long prompts "
    "into chunks that share the step with the running decodes, and preempts the newest request when the cache "
    "runs out. The worker runs the step's forward pass over all of its slices at once, samples one token for "
    "every slice that ends a prompt or decodes, and sends the tokens back to the scheduler, which ends the "
    "requests that reached a stop token or their max_tokens and frees their blocks for the next ones."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_DIR)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args()
    tokenizer = load_tokenizer(args.model)
    messages = [{"role": "user", "content": f"Repeat this text word for word:\n\n{TEXT}"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    # The stack's own worker settings (int4 weights and an fp16 KV cache on the CPU), as the launcher gives them.
    configs = {k: StackConfig(model=args.model, speculative_method="ngram" if k else "", num_speculative_tokens=max(k, 1)) for k in (0, args.k)}
    runners = {k: ModelRunner(RunnerConfig.of(config, num_blocks=256)) for k, config in configs.items()}
    for runner in runners.values():
        runner.warmup()
    outputs = {}
    for repeat in range(args.repeats):
        for k, runner in runners.items():
            scheduler = Scheduler(BlockPool(256, configs[k].block_size), 8, 512, 100, decode_plan_s=0.02, speculation=Speculation(k, 4) if k else None)
            submit = Submit(rid=f"r{repeat}", prompt_ids=prompt, max_tokens=args.tokens, sampling=SamplingParams(temperature=0), ignore_eos=True)
            before = (runner.speculator.draft_tokens, runner.speculator.accepted_tokens) if k else (0, 0)
            began = time.perf_counter()
            run = InProcessEngine(scheduler, runner).run([submit])
            seconds = time.perf_counter() - began
            outputs[k] = run.outputs[submit.rid]
            line = f"ngram k={k}" if k else "speculation off"
            if k:
                drafted, accepted = runner.speculator.draft_tokens - before[0], runner.speculator.accepted_tokens - before[1]
                line += f", acceptance {accepted}/{drafted} = {accepted / max(drafted, 1):.2f}, {run.steps} steps"
            print(f"repeat {repeat}: {line}: {len(outputs[k])} tokens in {seconds:.2f} s = {len(outputs[k]) / seconds:.1f} tokens/s", flush=True)
    print("outputs identical:", outputs[0] == outputs[args.k])
    print("continuation:", repr(tokenizer.decode(outputs[0])[:200]))


if __name__ == "__main__":
    main()
