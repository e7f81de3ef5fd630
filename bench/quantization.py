"""Weight formats (fp16 packs, int8, int4 blocks, int4 with int8 activations) against fp32 on the same checkpoint: what each costs in accuracy, what it buys in speed.

Accuracy: perplexity of a fixed text (teacher-forced, every position's logits) and the relative
error of those logits against fp32; top-1 agreement. Twice: as one prefill chunk (many rows per
product) and token by token (one row per product), since a format may multiply few-row steps in
another kernel or precision than many-row ones (int4-a8: int16 activations for few rows, int8 beyond). Speed: in-process decode step time at a few
batch sizes, every format measured alternately in the same run.

    .venv/bin/python -m bench.quantization --model models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from bench.report import write_results
from services.worker.attention import AttentionMetadata
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import SamplingParams, Slice, StepPlan
from shared.tokenizer import load_tokenizer

TEXT = (
    "The river rises in the hills to the north of the town and runs south through farmland for "
    "most of its length. In the spring the meltwater swells it until the lower fields flood, and the "
    "farmers move their animals to higher ground. By midsummer it is shallow enough to wade across at "
    "the old ford, where a stone bridge was built two hundred years ago. The bridge has three arches; "
    "the middle one was rebuilt after a flood carried it away. Children fish from the bank below the "
    "mill, and in the evenings the swallows skim the water for insects. Further south the river widens, "
    "slows, and finally joins the estuary, where the tide pushes salt water several miles inland twice a day."
)


def teacher_forced_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids`` as one prefill chunk: [len(ids), vocab]."""
    blocks = list(range(-(-len(ids) // runner.block_size)))
    meta = AttentionMetadata.build([0], [len(ids)], [blocks], 0, runner.block_size, runner.model.dtype, backend=runner.model.attention_backend)
    with torch.inference_mode():
        hidden = runner.decoder(torch.tensor(ids), meta.positions, meta, runner.kv_cache)
        return runner.model.compute_logits(hidden).float()


def token_by_token_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """The same logits, each position a step of its own (one row per product, as in a decode)."""
    blocks = list(range(-(-len(ids) // runner.block_size)))
    rows = []
    with torch.inference_mode():
        for position, token in enumerate(ids):
            meta = AttentionMetadata.build([position], [1], [blocks], 0, runner.block_size, runner.model.dtype, backend=runner.model.attention_backend)
            hidden = runner.decoder(torch.tensor([token]), meta.positions, meta, runner.kv_cache)
            rows.append(runner.model.compute_logits(hidden).float())
    return torch.cat(rows)


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(float(nll))


def accuracy_against(runners: dict[str, ModelRunner], reference: str, ids: list[int]) -> dict[str, dict[str, dict[str, float]]]:
    """Per mode (``ids`` as one prefill, and token by token) and runner: perplexity on ``ids``, and the
    relative logit error and top-1 agreement against ``runners[reference]``; printed as they come."""
    results = {}
    for mode, run in (("prefill", teacher_forced_logits), ("token_by_token", token_by_token_logits)):
        logits = {name: run(runner, ids) for name, runner in runners.items()}
        exact = logits[reference]
        results[mode] = {
            name: {
                "perplexity": perplexity(value, ids),
                "logit_relative_error": float((value - exact).norm() / exact.norm()),
                "top1_agreement": float((value.argmax(-1) == exact.argmax(-1)).float().mean()),
            }
            for name, value in logits.items()
        }
        for name, facts in results[mode].items():
            print(
                f"{mode:14s} {name:7s}: perplexity {facts['perplexity']:.3f}, logit rel. error {facts['logit_relative_error']:.2e}, "
                f"top-1 agreement {facts['top1_agreement']:.3f}"
            )
    return results


def decode_step_s(runner: ModelRunner, batch: int, context: int, steps: int) -> float:
    runner.apply_kernel_settings()  # the C++ kernels' settings are the process's: this runner's, not the last loaded one's
    greedy = SamplingParams(temperature=0.0)
    per_request = -(-(context + steps + 8) // runner.block_size)
    for i in range(batch):
        blocks = list(range(i * per_request, (i + 1) * per_request))
        runner.execute(StepPlan(0, [Slice(f"b{i}", 0, context, [(31 * j + i) % 1000 for j in range(context)], blocks, sampling=greedy)]))
    position = context
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        runner.execute(StepPlan(0, [Slice(f"b{i}", position, 1) for i in range(batch)]))
        times.append(time.perf_counter() - began)
        position += 1
    runner.release([f"b{i}" for i in range(batch)])
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="bench/results/quantization.json")
    args = parser.parse_args()

    ids = load_tokenizer(args.model).encode(TEXT)
    formats = ("none", "fp16", "int8", "int4", "int4-a8")
    runners = {quant: ModelRunner(RunnerConfig(args.model, num_blocks=1024, block_size=16, weight_quant=quant)) for quant in formats}
    results: dict = {"model": args.model, "text_tokens": len(ids), "decode_step_ms": {}}
    results.update(accuracy_against(runners, "none", ids))
    for quant, runner in runners.items():
        facts = runner.describe()
        results.setdefault("weight_bytes", {})[quant] = facts["param_bytes"] + facts["block_quant_bytes"]
        print(f"{quant:5s}: weights held {results['weight_bytes'][quant] / 1e6:.0f} MB")
    for batch in args.batches:
        times = {quant: [] for quant in runners}
        for _ in range(3):  # alternate, so a burst of load elsewhere hits all of them
            for quant, runner in runners.items():
                times[quant].append(decode_step_s(runner, batch, context=128, steps=args.steps))
        step = {quant: 1e3 * min(values) for quant, values in times.items()}
        results["decode_step_ms"][batch] = step
        print(f"batch {batch:3d}: " + ", ".join(f"{quant} {ms:.1f} ms ({step['none'] / ms:.2f}x)" for quant, ms in step.items()))
    write_results(args.out, results)


if __name__ == "__main__":
    main()
