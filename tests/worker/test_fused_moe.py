"""The Triton MoE kernels on the CPU under ``TRITON_INTERPRET=1`` against the torch path: the
token-to-expert alignment exactly, the fused MoE within fp32 / fp16 rounding, on routings with idle
experts, fewer pairs than a row block, several chunks of pairs, and uneven top-k > 1.

``triton.jit`` reads ``TRITON_INTERPRET`` when a function is decorated, triton's own library
(``tl.zeros``, ``tl.cumsum``, ...) included, and the rest of the suite may have imported triton
already. So the kernels run in one child process started with the variable set; this process and
the rest of the suite never see it.
"""

from __future__ import annotations

from multiprocessing.pool import Pool

import pytest
import torch

from services.worker.moe import experts_torch, route

pytest.importorskip("triton")

from services.worker.kernels.fused_moe import MoEConfig, fused_moe  # noqa: E402  (run in the child, interpreted)
from services.worker.kernels.moe_align import max_padded_size, moe_align_torch, moe_align_triton  # noqa: E402


def _uneven_routing(tokens: int, experts: int, top_k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router output skewed towards the first experts, so the last ones tend to receive no token."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=generator) + torch.linspace(3, -3, experts)
    return route(logits.to(dtype), top_k, renormalize=seed % 2 == 0)


ALIGN_CASES = {  # tokens, experts, top_k, block size
    "fewer-pairs-than-a-block": (3, 8, 2, 16),
    "uneven-top4": (40, 16, 4, 16),
    "several-chunks-top1": (300, 6, 1, 32),
    "many-experts-wide-block": (45, 64, 8, 64),
}


@pytest.mark.parametrize("case", list(ALIGN_CASES))
def test_alignment_matches_the_reference_and_groups_pairs_by_expert(interpreter: Pool, case: str) -> None:
    tokens, experts, top_k, block = ALIGN_CASES[case]
    _, ids = _uneven_routing(tokens, experts, top_k, torch.float32, seed=len(case))
    expected = moe_align_torch(ids, experts, block)
    sorted_ids, expert_ids, num_padded = interpreter.apply(moe_align_triton, (ids, experts, block))
    assert all(torch.equal(ours, theirs) for ours, theirs in zip((sorted_ids, expert_ids, num_padded), expected))

    pairs = tokens * top_k
    used = int(num_padded)
    assert used % block == 0 and sorted_ids.numel() == max_padded_size(pairs, experts, block)
    real = sorted_ids[:used][sorted_ids[:used] < pairs]
    assert torch.equal(real.sort().values, torch.arange(pairs, dtype=torch.int32))  # every pair exactly once
    assert bool((sorted_ids[used:] == pairs).all()) and bool((expert_ids[used // block :] == -1).all())
    for b in range(used // block):
        members = sorted_ids[b * block : (b + 1) * block]
        members = members[members < pairs].long()
        assert members.numel() > 0 and bool((ids.flatten()[members] == expert_ids[b]).all())


FUSED_CASES = {  # tokens, hidden, intermediate, experts, top_k, config (None: the default for the shape)
    "fewer-tokens-than-a-block": (3, 40, 24, 8, 2, (16, 16, 16, 1)),
    "uneven-top4-idle-experts": (24, 32, 48, 16, 4, (16, 32, 16, 2)),
    "top1-default-config": (20, 32, 32, 4, 1, None),
}


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 1e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_moe_matches_the_torch_path(interpreter: Pool, case: str, dtype: torch.dtype, tolerance: float) -> None:
    tokens, hidden, inter, experts, top_k, config = FUSED_CASES[case]
    generator = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=generator) / inter**0.5).to(dtype)
    residual = torch.randn(tokens, hidden, generator=generator).to(dtype) if top_k > 1 else None
    weights, ids = _uneven_routing(tokens, experts, top_k, dtype, seed=tokens)
    assert (torch.bincount(ids.flatten(), minlength=experts) == 0).any()  # an idle expert

    ours = interpreter.apply(fused_moe, (x, w_gate_up, w_down, weights, ids, residual, MoEConfig(*config) if config else None))
    # The torch path in fp32 on the same (fp16-representable) values: its own fp16 rounding would add ~5e-4.
    moe_only = experts_torch(x.float(), w_gate_up.float(), w_down.float(), weights.float(), ids)
    expected = moe_only if residual is None else moe_only + residual.float()
    assert ours.dtype == dtype
    assert ((ours.float() - expected).norm() / expected.norm()).item() < tolerance
    if residual is not None:  # the residual must not hide the experts' part
        assert ((ours.float() - residual.float() - moe_only).norm() / moe_only.norm()).item() < 4 * tolerance


@pytest.mark.parametrize("formats", [("q4_0", "q4_0"), ("q4_1", "q8_0"), ("q8_0", "q4_1")])
def test_fused_moe_dequantizes_experts_in_blocks_in_its_k_loop(interpreter: Pool, formats: tuple[str, str]) -> None:
    """Experts in blocks against the torch path on their dequantized weights: the same fp32 products."""
    from services.worker.block_quant import BlockQuantized

    tokens, hidden, inter, experts, top_k = 5, 64, 32, 6, 2
    generator = torch.Generator().manual_seed(len(formats[0]) + ord(formats[1][1]))
    x, residual = torch.randn(tokens, hidden, generator=generator), torch.randn(tokens, hidden, generator=generator)
    gate_up = BlockQuantized.of(torch.randn(experts, 2 * inter, hidden, generator=generator) / hidden**0.5, formats[0])
    down = BlockQuantized.of(torch.randn(experts, hidden, inter, generator=generator) / inter**0.5, formats[1])
    weights, ids = _uneven_routing(tokens, experts, top_k, torch.float32, seed=3)
    ours = interpreter.apply(fused_moe, (x, gate_up, down, weights, ids, residual, MoEConfig(16, 16, 32, 1)))
    expected = experts_torch(x, gate_up.dequantize(), down.dequantize(), weights, ids, residual)
    assert ((ours - expected).norm() / (expected - residual).norm()).item() < 1e-5
