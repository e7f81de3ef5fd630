"""The Triton paged-attention kernel on the CPU under ``TRITON_INTERPRET=1`` against the torch path of
``services.worker.attention``: decodes and prefill chunks over cached prefixes in one flat batch, GQA
(groups of 1, 3 and 4 heads), block tables out of order, lengths that are not multiples of the block size.

As in ``test_fused_moe``, the kernels run in one child process started with the variable set.
"""

from __future__ import annotations

import random
from multiprocessing.pool import Pool

import pytest
import torch

from services.worker.attention import AttentionMetadata, paged_attention
from shared.frames import SamplingParams, Slice, StepPlan

from .harness import ATTENTION_CASES, attention_step

pytest.importorskip("triton")

from services.worker.attention import paged_attention_triton  # noqa: E402

GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_triton_paged_attention_matches_the_torch_path(interpreter: Pool, case: str, dtype: torch.dtype, tolerance: float) -> None:
    q, kv, cache, meta = attention_step(case, dtype)
    cache_ours = cache.clone()
    ours = interpreter.apply(_run_triton, (q, kv, cache_ours, meta))
    # The torch path in fp32 on the same (fp16-representable) values.
    expected_cache = cache.float()
    expected = paged_attention(q.float(), kv.float(), expected_cache, _as_float(meta))
    assert ours.dtype == dtype and ours.shape == expected.shape
    assert ((ours.float() - expected).norm() / expected.norm()).item() < tolerance
    rows = ((ours.float() - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()  # no row may hide in the total
    assert rows < 10 * tolerance


def test_triton_backend_stores_this_steps_keys_in_the_cache(interpreter: Pool) -> None:
    q, kv, cache, meta = attention_step("mixed-gqa3-cached-prefix", torch.float32)
    _, cache_after = interpreter.apply(_run_triton_with_cache, (q, kv, cache.clone(), meta))
    expected = cache.clone()
    paged_attention(q, kv, expected, meta)
    assert torch.equal(cache_after, expected)


def _as_float(meta: AttentionMetadata) -> AttentionMetadata:
    def cast(mask: torch.Tensor | None) -> torch.Tensor | None:
        return None if mask is None else mask.float()

    from dataclasses import replace

    prefills = tuple(replace(c, mask=cast(c.mask)) for c in meta.prefills)
    return replace(meta, decode_mask=cast(meta.decode_mask), prefills=prefills)


def _run_triton(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    return paged_attention_triton(q, kv, cache, meta)


def _run_triton_with_cache(q: torch.Tensor, kv: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_attention_triton(q, kv, cache, meta), cache


def _greedy(runner, prompts: dict[str, list[int]], arrivals: dict[str, int], max_new: int) -> dict[str, list[int]]:
    """A scheduler in miniature (without the harness, whose transformers import the interpreter child
    would pay for): prefill chunks of 5 beside decodes, blocks of 4 handed out in a shuffled order."""
    free = list(range(runner.num_blocks))
    random.Random(1).shuffle(free)
    done, out, computed, tables = {}, {rid: [] for rid in prompts}, dict.fromkeys(prompts, 0), {rid: [] for rid in prompts}
    step = 0
    while len(done) < len(prompts):
        slices = []
        for rid, prompt in prompts.items():
            if rid in done or arrivals[rid] > step:
                continue
            start = computed[rid]
            n = min(5, len(prompt) - start) if start < len(prompt) else 1
            new = [free.pop() for _ in range(-(-(start + n) // 4) - len(tables[rid]))]
            tables[rid] += new
            if start < len(prompt):
                slices.append(Slice(rid, start, n, prompt[start : start + n], new, start + n == len(prompt), GREEDY if start == 0 else None))
            else:
                slices.append(Slice(rid, start, 1, new_blocks=new))
            computed[rid] += n
        for sampled in runner.execute(StepPlan(step, slices)).sampled:
            out[sampled.rid].append(sampled.token_id)
            if len(out[sampled.rid]) == max_new:
                done[sampled.rid] = out[sampled.rid]
                runner.release([sampled.rid])
                free += tables[sampled.rid]
        step += 1
    return done


def _greedy_with_triton_attention(path: str, prompts: dict[str, list[int]], arrivals: dict[str, int]) -> dict[str, list[int]]:
    """In the interpreter: a runner whose every layer attends through the Triton backend, as on CUDA,
    decode-only steps through the graph staging path."""
    from services.worker.cuda_graphs import eager_capture
    from services.worker.runner import ModelRunner, RunnerConfig

    runner = ModelRunner(RunnerConfig(path, 48, 4, cuda_graph_max_batch=4, max_model_len=64), capture=eager_capture)
    for layer in runner.model.layers:
        layer.attn.attend = paged_attention_triton
    runner._attention_backend = "triton"  # the metadata the Triton backend gets on CUDA: no torch-path masks
    runner.capture_graphs()
    out = _greedy(runner, prompts, arrivals, 8)
    assert runner.graphs.replayed > 0 and runner.graphs.eager == 0
    return out


def test_a_model_attending_through_the_triton_kernel_decodes_as_the_torch_path(interpreter: Pool, tiny_llamas) -> None:
    """Prefill chunks over cached prefixes and mixed steps (eager), decode-only steps padded to a bucket
    (the staging path a CUDA graph replays): the same greedy tokens as the torch path."""
    from services.worker.runner import ModelRunner, RunnerConfig

    untied = tiny_llamas["untied"]
    prompts = {f"r{i}": random.Random(60 + i).choices(range(3, 256), k=n) for i, n in enumerate((4, 11, 7))}
    arrivals = {"r0": 0, "r1": 0, "r2": 3}
    theirs = _greedy(ModelRunner(RunnerConfig(untied.path, 48, 4)), prompts, arrivals, 8)
    assert interpreter.apply(_greedy_with_triton_attention, (untied.path, prompts, arrivals)) == theirs
