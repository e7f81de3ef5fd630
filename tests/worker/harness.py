"""Test harness of the worker: tiny random Llama checkpoints, their transformers reference, and a
miniature scheduler that drives a ``ModelRunner`` with ``StepPlan`` frames the way the real one does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.runner import ModelRunner
from shared.frames import SamplingParams, Slice, StepPlan

GREEDY = SamplingParams(temperature=0.0)

TINY_LLAMAS = {
    "untied": {},
    "llama3-rope": {
        "rope_theta": 50000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    },
    "tied-sharded": {"tie_word_embeddings": True, "head_dim": 32},
}


@dataclass(frozen=True)
class Checkpoint:
    path: str
    reference: LlamaForCausalLM  # transformers' model on the same weights, fp32, eval mode


def build_tiny_llama(path: str, **overrides: object) -> LlamaForCausalLM:
    # initializer_range 0.2: at the default 0.02 a tiny model's top logits are nearly tied.
    defaults: dict[str, object] = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=256,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = LlamaConfig(**{**defaults, **overrides})
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    shard = "20KB" if config.tie_word_embeddings else "50GB"
    model.save_pretrained(path, max_shard_size=shard)
    return model


def reference_greedy(model: LlamaForCausalLM, prompt: list[int], max_new: int, min_margin: float = 1e-4) -> list[int]:
    """transformers' greedy continuation; fails if a step's top-1/top-2 gap is so small that rounding could flip it.

    Our fp32 logits differ from transformers' by ~1e-5 absolute here, so a 1e-4 gap is safe.
    """
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == max_new
    top2 = torch.cat(out.scores).topk(2, dim=-1).values
    margin = (top2[:, 0] - top2[:, 1]).min().item()
    assert margin > min_margin, f"reference has a near-tie (top-1/top-2 margin {margin:.2e}): pick another prompt"
    return tokens


@dataclass
class _Req:
    prompt: list[int]
    arrival: int
    sampling: SamplingParams
    computed: int = 0
    table: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)


@dataclass
class DriveStats:
    steps: int = 0
    mixed_steps: int = 0  # steps holding both a prefill chunk and a decode slice
    multi_prefill_steps: int = 0


def drive(
    runner: ModelRunner,
    prompts: dict[str, list[int]],
    max_new: int,
    chunk: int,
    seed: int = 0,
    arrivals: dict[str, int] | None = None,
    sampling: dict[str, SamplingParams] | None = None,
) -> tuple[dict[str, list[int]], DriveStats]:
    """Run requests to ``max_new`` tokens each as a scheduler would: chunked prefill, mixed steps,
    shuffled non-contiguous blocks that are freed and reused, slices in shuffled order."""
    rng = random.Random(seed)
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    reqs = {rid: _Req(p, (arrivals or {}).get(rid, 0), (sampling or {}).get(rid, GREEDY)) for rid, p in prompts.items()}
    done: dict[str, list[int]] = {}
    stats = DriveStats()
    bs = runner.block_size

    def grow(r: _Req, end: int) -> list[int]:
        new = [free.pop() for _ in range(-(-end // bs) - len(r.table))]
        r.table += new
        return new

    while len(done) < len(reqs):
        slices = []
        for rid, r in reqs.items():
            if rid in done or r.arrival > stats.steps:
                continue
            if r.computed < len(r.prompt):
                n = min(chunk, len(r.prompt) - r.computed)
                last = r.computed + n == len(r.prompt)
                first = r.computed == 0
                ids = r.prompt[r.computed : r.computed + n]
                slices.append(Slice(rid, r.computed, n, ids, grow(r, r.computed + n), last, r.sampling if first else None))
                r.computed += n
            else:
                pos = len(r.prompt) + len(r.out) - 1  # where the last sampled token goes
                slices.append(Slice(rid, pos, 1, new_blocks=grow(r, pos + 1)))
        rng.shuffle(slices)
        kinds = [bool(s.token_ids) for s in slices]
        stats.mixed_steps += any(kinds) and not all(kinds)
        stats.multi_prefill_steps += sum(kinds) > 1
        result = runner.execute(StepPlan(stats.steps, slices))
        assert not result.error
        assert {x.rid for x in result.sampled} == {s.rid for s in slices if s.sample}
        for x in result.sampled:
            r = reqs[x.rid]
            r.out.append(x.token_id)
            if len(r.out) == max_new:
                done[x.rid] = r.out
                runner.release([x.rid])
                at = rng.randrange(len(free) + 1)
                free[at:at] = r.table
        stats.steps += 1
    return done, stats
