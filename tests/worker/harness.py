"""Test harness of the worker: tiny random checkpoints of each model family, their transformers
reference, a miniature scheduler that drives a ``ModelRunner`` with ``StepPlan`` frames the way the
real one does, and the parity checks every family must pass against transformers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from unittest import mock

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from services.worker.attention import AttentionMetadata
from services.worker.fusions import FusionKernels
from services.worker.models import decoder
from services.worker.rmsnorm import RMSNorm
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import SamplingParams, Slice, StepPlan

GREEDY = SamplingParams(temperature=0.0)
MAX_NEW = 32


def kernel_rounded(x: torch.Tensor, max_code: int) -> torch.Tensor:
    """``x`` as the activation-quantizing kernels multiply it: per block of 32 features, codes
    round(x * (max_code / amax)) times amax / max_code, dequantized. ``max_code / amax`` is a true float32
    division, as in the kernels: torch's ``number / tensor`` multiplies by the reciprocal instead, which is an
    ulp off now and then and moves a product that lands near .5 to the other code."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    return (torch.round(blocks * (torch.full_like(amax, max_code) / amax)) * (amax / max_code)).view(x.shape)


def check_same_bits_at_every_thread_count(product: Callable[[], torch.Tensor]) -> None:
    """Asserts that ``product`` gives the same bits at 2, 3 and 5 threads as at 1. Its kernel's threads share
    groups of output channels (csrc/shared_items.h, and few-row calls on csrc/takeover_pool.h): each starts on
    its own share, then takes the others' remaining groups from their ends. Whichever thread computes a
    channel, the arithmetic is the same, so every bit must be, however the groups changed hands (threads
    start and finish at varying times, so repeated calls vary that)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = product()
        for count in (2, 3, 5):
            torch.set_num_threads(count)
            for _ in range(20):
                assert torch.equal(product(), alone)
    finally:
        torch.set_num_threads(threads)


# model_type -> transformers' config and model classes, and the tiny sizes that family adds.
FAMILIES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict[str, object]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "qwen3_next": (
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "head_dim": 32,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 24,
        },
    ),
}

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

TINY_QWEN3S = {
    "untied-bias": {"attention_bias": True, "head_dim": 32},  # head_dim != hidden / heads
    "tied-sharded": {"tie_word_embeddings": True},
}

TINY_QWEN3_MOES = {
    # three layers: MoE in 0 and 2, dense in 1; top-2 renormalised
    "renorm-dense-middle": {"norm_topk_prob": True, "mlp_only_layers": [1], "intermediate_size": 96},
    # MoE in layer 1 only; top-3 of the raw softmax; tied, sharded, head_dim != hidden / heads
    "sparse-step-tied": {"decoder_sparse_step": 2, "num_experts_per_tok": 3, "tie_word_embeddings": True, "head_dim": 32},
}

TINY_QWEN3_NEXTS = {
    # GDN, full attention, GDN, GDN; 2 key heads for 4 value heads; a dense MLP in layer 2; half of each head rotated
    "gqa-dense-layer": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "mlp_only_layers": [2],
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    # every second layer full attention; as many value heads as key heads; MoE in every second layer,
    # top-2 of the raw softmax; q/k/v/o biases; tied and sharded
    "interval-tied-bias": {
        "full_attention_interval": 2,
        "num_hidden_layers": 4,
        "linear_num_value_heads": 2,
        "linear_value_head_dim": 16,
        "decoder_sparse_step": 2,
        "norm_topk_prob": False,
        "attention_bias": True,
        "tie_word_embeddings": True,
    },
}


@dataclass(frozen=True)
class Checkpoint:
    path: str
    reference: PreTrainedModel  # transformers' model on the same weights, fp32, eval mode


def build_tiny(family: str, path: str, **overrides: object) -> PreTrainedModel:
    """A random ``family`` checkpoint saved at ``path`` by transformers; returns transformers' model on it."""
    config_class, model_class, family_defaults = FAMILIES[family]
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
    config = config_class(**{**defaults, **family_defaults, **overrides})
    torch.manual_seed(1234)
    model = model_class(config).eval()
    shard = "20KB" if config.tie_word_embeddings else "50GB"
    model.save_pretrained(path, max_shard_size=shard)
    return model


def build_tiny_llama(path: str, **overrides: object) -> PreTrainedModel:
    return build_tiny("llama", path, **overrides)


def reference_greedy(model: PreTrainedModel, prompt: list[int], max_new: int, min_margin: float = 1e-4) -> list[int]:
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
    free_slots = list(range(runner.num_slots))  # GDN state slots, as the scheduler hands them out
    rng.shuffle(free_slots)
    slot_of: dict[str, int] = {}
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
                if first and free_slots:
                    slot_of[rid] = free_slots.pop()
                slot = slot_of.get(rid, -1)
                slices.append(Slice(rid, r.computed, n, ids, grow(r, r.computed + n), last, r.sampling if first else None, slot=slot))
                r.computed += n
            else:
                pos = len(r.prompt) + len(r.out) - 1  # where the last sampled token goes
                slices.append(Slice(rid, pos, 1, new_blocks=grow(r, pos + 1), slot=slot_of.get(rid, -1)))
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
                if x.rid in slot_of:
                    free_slots.insert(rng.randrange(len(free_slots) + 1), slot_of.pop(x.rid))
        stats.steps += 1
    return done, stats


def prompt_of(seed: int, length: int) -> list[int]:
    return random.Random(seed).choices(range(3, 256), k=length)


def rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).norm() / theirs.norm()).item()


def _chunked_prefill(runner: ModelRunner, prompt: list[int], blocks: list[int]) -> StepPlan:
    """Send every chunk of 5 but the last (they sample nothing); return the plan of the last. Blocks of 4."""
    for i, start in enumerate(range(0, len(prompt) - 5, 5)):
        new = blocks[-(-start // 4) : -(-(start + 5) // 4)]
        plan = StepPlan(i, [Slice("r", start, 5, prompt[start : start + 5], new, sample=False, sampling=GREEDY if i == 0 else None, slot=0)])
        assert runner.execute(plan).sampled == []
    start = len(prompt) - len(prompt) % 5
    return StepPlan(9, [Slice("r", start, len(prompt) - start, prompt[start:], blocks[-(-start // 4) : -(-len(prompt) // 4)], slot=0)])


def check_logits_after_chunked_prefill_and_in_decode(tiny: Checkpoint, max_rel_err: float = 1e-4) -> None:
    """Last-position logits of a 23-token prompt prefilled in chunks of 5 on shuffled blocks, then of one decode step."""
    prompt, blocks = prompt_of(0, 23), [11, 3, 7, 0, 14, 5, 9]
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=16, block_size=4))
    ours = runner.logits(_chunked_prefill(runner, prompt, blocks))["r"]
    with torch.no_grad():
        theirs = tiny.reference(torch.tensor([prompt])).logits[0, -1]
    assert rel_err(ours, theirs) <= max_rel_err

    # A decode slice feeds back the last sampled token: sample it, then check the next logits.
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=16, block_size=4))
    token = runner.execute(_chunked_prefill(runner, prompt, blocks)).sampled[0].token_id
    assert token == int(theirs.argmax())
    ours = runner.logits(StepPlan(10, [Slice("r", 23, 1, new_blocks=blocks[6:7], slot=0)]))["r"]
    with torch.no_grad():
        theirs = tiny.reference(torch.tensor([prompt + [token]])).logits[0, -1]
    assert rel_err(ours, theirs) <= max_rel_err


def mixed_step_logits(path: str, fusions: FusionKernels) -> tuple[dict[str, torch.Tensor], ModelRunner]:
    """Logits of a mixed step (a decode beside a prefill chunk that continues a cached prefix), after a
    prefill step, on a runner whose decoder fuses with ``fusions`` in place of its own choice."""
    with mock.patch.object(decoder, "select_fusion_kernels", lambda device, dtype: fusions):
        runner = ModelRunner(RunnerConfig(path, 16, 4, max_num_seqs=4))
    distinct_norms(runner.model)
    a, b = prompt_of(1, 9), prompt_of(2, 6)
    first = [Slice("a", 0, 9, a, [0, 1, 2], sampling=GREEDY, slot=0), Slice("b", 0, 4, b[:4], [5], sample=False, sampling=GREEDY, slot=1)]
    runner.execute(StepPlan(0, first))
    return runner.logits(StepPlan(1, [Slice("a", 9, 1, slot=0), Slice("b", 4, 2, b[4:], [6], slot=1)])), runner


def distinct_norms(model: decoder.DecoderForCausalLM) -> None:
    """A fresh checkpoint's RMSNorm weights are all ones: give each norm its own (seeded), so a fused
    forward that applied one norm's weight in another's place would show."""
    generator = torch.Generator().manual_seed(7)

    def norm(old: RMSNorm) -> RMSNorm:
        return RMSNorm(old.weight * (1 + 0.5 * torch.rand(old.weight.shape, generator=generator)), model.cfg.eps)

    model.layers = [layer._replace(input_norm=norm(layer.input_norm), post_norm=norm(layer.post_norm)) for layer in model.layers]
    model.norm = norm(model.norm)


def check_greedy_alone(tiny: Checkpoint) -> None:
    """32 greedy tokens of one request, prefilled in three chunks, equal transformers' generate."""
    prompt = prompt_of(1, 11)
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=32, block_size=4))
    out, stats = drive(runner, {"solo": prompt}, MAX_NEW, chunk=5)
    assert stats.steps == 3 + MAX_NEW - 1  # three prefill chunks, the last one samples
    assert out["solo"] == reference_greedy(tiny.reference, prompt, MAX_NEW)


def check_greedy_in_mixed_batches(tiny: Checkpoint) -> None:
    """Four requests arriving at different steps, batched with chunked prefills beside decodes, each equal generate."""
    prompts = {f"r{i}": prompt_of(10 + i, n) for i, n in enumerate((3, 9, 14, 22))}
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=64, block_size=4))
    arrivals = {"r0": 0, "r1": 0, "r2": 2, "r3": 5}  # later prompts are prefilled beside earlier decodes
    out, stats = drive(runner, prompts, MAX_NEW, chunk=5, seed=3, arrivals=arrivals)
    assert stats.mixed_steps >= 4 and stats.multi_prefill_steps >= 1
    for rid, prompt in prompts.items():
        assert out[rid] == reference_greedy(tiny.reference, prompt, MAX_NEW), rid


ATTENTION_CASES = {  # heads, kv_heads, head_dim, block size, decode contexts (start of each), prefill chunks (start, length)
    "decode-only-gqa4": (8, 2, 32, 4, [0, 6, 13, 21], []),
    "prefill-only-mha": (4, 4, 16, 8, [], [(0, 11), (0, 3)]),
    "mixed-gqa3-cached-prefix": (6, 2, 24, 4, [9, 2], [(7, 10), (0, 5), (16, 1)]),
    "long-prefix-wide-block": (4, 1, 64, 16, [70], [(45, 30)]),
    "smollm2-shaped-decodes": (9, 3, 64, 16, [0, 15, 16, 17, 250, 511], [(100, 7)]),
}


def attention_step(case: str, dtype: torch.dtype, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A cache holding every request's earlier keys, this step's q and new kv, and the step's metadata."""
    heads, kv_heads, dim, block_size, decodes, prefills = ATTENTION_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    starts = decodes + [start for start, _ in prefills]
    lens = [1] * len(decodes) + [n for _, n in prefills]
    blocks_needed = [-(-(s + n) // block_size) for s, n in zip(starts, lens)]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(num_blocks))
    random.Random(len(case)).shuffle(free)  # tables out of order, interleaved between requests
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    cache = (torch.randn(num_blocks * block_size, 2, kv_heads, dim, generator=generator) / 2).to(dtype)
    total = sum(lens)
    q = torch.randn(total, heads, dim, generator=generator).to(dtype)
    kv = torch.randn(total, 2, kv_heads, dim, generator=generator).to(dtype)
    meta = AttentionMetadata.build(starts, lens, tables, len(decodes), block_size, dtype, backend=backend)
    return q, kv, cache, meta
