"""Experts in q4_0 / q4_1 / q8_0 blocks through the grouped C++ MoE (csrc/grouped_moe.cpp): against the
fp32 torch path (``experts_torch``) on the blocks' own dequantized weights, over random routing with
experts that receive no token, decode batches of 1..32 tokens (the takeover pool) and more (OpenMP's
threads), a shared expert, int8 activations, the same bits at every thread count, and clear refusals."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from services.worker import block_quant
from services.worker.block_quant import BlockQuantized
from services.worker.cpu_kernels import cpu_kernels
from services.worker.moe import ExpertPanels, SharedExpert, SparseMoE, experts_torch, interleave_gate_up, route
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan

from .harness import GREEDY, Checkpoint, check_same_bits_at_every_thread_count, kernel_rounded, prompt_of

pytestmark = pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")

HIDDEN, INTER, EXPERTS, TOP_K = 96, 64, 12, 3


@pytest.fixture(params=[False, True], ids=["openmp", "takeover-pool"])
def pool(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Calls of up to 32 tokens on the takeover pool (as the worker runs its decode steps) or on OpenMP's threads."""
    cpu_kernels()[0].set_takeover_pool(request.param)
    yield request.param
    cpu_kernels()[0].set_takeover_pool(False)


def _experts(fmt_gate_up: str, fmt_down: str, seed: int, experts: int = EXPERTS, inter: int = INTER) -> tuple[BlockQuantized, BlockQuantized]:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, HIDDEN, generator=generator) / HIDDEN**0.5
    down = torch.randn(experts, HIDDEN, inter, generator=generator) / inter**0.5
    return BlockQuantized.of(gate_up, fmt_gate_up), BlockQuantized.of(down, fmt_down)


def _logits(tokens: int, seed: int, experts: int = EXPERTS) -> torch.Tensor:
    """Router logits that favour the first experts: the last ones receive no token in small batches."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=generator) + torch.linspace(3, -3, experts)


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm())


def _codes_and_minimums(w: BlockQuantized) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` dequantized as (its codes times their scales, its minimums): what multiplies rounded
    activations and what multiplies the blocks' sums of the activations themselves (q4_0's -8 d)."""
    if w.fmt == "q8_0":
        return w.dequantize().double(), torch.zeros(w.shape, dtype=torch.float64)
    minimums_only = w.data.clone()
    minimums_only[..., : w.in_features // block_quant.BLOCK * 16] = 0
    minimums = BlockQuantized(w.fmt, minimums_only, w.in_features).dequantize().double()
    return w.dequantize().double() - minimums, minimums


def _kernel_reference(x: torch.Tensor, gate_up: BlockQuantized, down: BlockQuantized, weights: torch.Tensor, ids: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """The grouped kernel's arithmetic in float64: x rounded per block of 32, then silu(gate) * up rounded
    likewise, each times the experts' codes, plus the minimums times the unrounded blocks' sums."""
    max_code = 127 if bits == 8 else 32767
    (gate_up_codes, gate_up_mins), (down_codes, down_mins) = _codes_and_minimums(gate_up), _codes_and_minimums(down)
    inter, rounded = down.in_features, kernel_rounded(x, max_code).double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t, j in ((t, j) for t in range(ids.shape[0]) for j in range(ids.shape[1])):
        e = int(ids[t, j])
        both = gate_up_codes[e] @ rounded[t] + gate_up_mins[e] @ x[t].double()
        act = (F.silu(both[:inter]) * both[inter:]).float()[None]
        out[t] += float(weights[t, j]) * (down_codes[e] @ kernel_rounded(act, max_code)[0].double() + down_mins[e] @ act[0].double())
    return out.float()


def test_interleaving_puts_each_group_of_eight_gate_channels_before_its_up_channels() -> None:
    rows = torch.arange(2 * 16).float()[:, None]  # gate 0..15, up 16..31
    order = interleave_gate_up(rows[None])[0, :, 0].long().tolist()
    assert order == [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]


@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 17, 32, 45])  # up to 32: the takeover pool's decode steps; 45: OpenMP
@pytest.mark.parametrize("formats", [("q4_0", "q4_0"), ("q4_1", "q4_1"), ("q8_0", "q8_0"), ("q4_0", "q8_0")])
def test_grouped_kernel_equals_the_torch_path_on_the_dequantized_experts(tokens: int, formats: tuple[str, str], pool: bool) -> None:
    gate_up, down = _experts(*formats, seed=tokens)
    generator = torch.Generator().manual_seed(100 + tokens)
    x, residual = torch.randn(tokens, HIDDEN, generator=generator), torch.randn(tokens, HIDDEN, generator=generator)
    logits = _logits(tokens, tokens)
    weights, ids = route(logits, TOP_K, renormalize=tokens % 2 == 0)
    if tokens <= 8:
        assert (torch.bincount(ids.flatten(), minlength=EXPERTS) == 0).any()
    reference = experts_torch(x, gate_up.dequantize(), down.dequantize(), weights, ids, residual) - residual
    panels = ExpertPanels.of(gate_up, down)
    kernel = cpu_kernels()[0].grouped_moe
    into = residual.clone()
    out = kernel(x, logits, TOP_K, tokens % 2 == 0, panels.gate_up, panels.down, residual=into)
    assert out.data_ptr() == into.data_ptr()  # the weighted sum lands in the residual
    # The products are the rounded activations' (x, then silu(gate) * up, per block of 32 to int16) times the
    # codes: against that arithmetic only fp32 summation order and an activation on a rounding tie differ
    # (measured <= 2e-5; a wrong row, expert or weight is ~1). Against fp32 activations the rounding itself
    # shows: measured 5e-5 (q8_0) to 1.5e-4 (q4: its codes times d are 0..15, not centred), as the dense
    # block kernels' int16 bound (3e-4).
    assert _relative_error(out - residual, _kernel_reference(x, gate_up, down, weights, ids)) < 5e-5
    assert _relative_error(out - residual, reference) < 3e-4
    assert torch.equal(kernel(x, logits, TOP_K, tokens % 2 == 0, panels.gate_up, panels.down) + residual, out)  # no residual: zeros


@pytest.mark.parametrize("tokens", [1, 6, 40])
def test_int8_activations_of_4_bit_experts_cost_what_int8_costs(tokens: int) -> None:
    gate_up, down = _experts("q4_1", "q4_0", seed=7)
    x, logits = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)), _logits(tokens, 3)
    weights, ids = route(logits, TOP_K, renormalize=True)
    reference = experts_torch(x, gate_up.dequantize(), down.dequantize(), weights, ids)
    panels = ExpertPanels.of(gate_up, down)
    out = cpu_kernels()[0].grouped_moe(x, logits, TOP_K, True, panels.gate_up, panels.down, activation_bits=8)
    assert _relative_error(out, _kernel_reference(x, gate_up, down, weights, ids, bits=8)) < 1e-5  # the int8 products, exactly
    assert 1e-3 < _relative_error(out, reference) < 6e-2  # int8's rounding (measured 2-4.5e-2), as the dense kernels' int8


@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_the_shared_expert_joins_the_call_scaled_by_its_gate(tokens: int, pool: bool) -> None:
    gate_up, down = _experts("q4_0", "q4_0", seed=11)
    shared_gate_up, shared_down = (t.data[0] for t in _experts("q8_0", "q4_1", seed=12, experts=1, inter=96))
    shared = SharedExpert(BlockQuantized("q8_0", shared_gate_up, HIDDEN), BlockQuantized("q4_1", shared_down, 96), torch.randn(1, HIDDEN))
    router = torch.randn(EXPERTS, HIDDEN)
    moe = SparseMoE(router, gate_up, down, TOP_K, renormalize=True, backend="torch")
    assert moe.backend == "grouped-cpp" and moe.w_gate_up.is_meta  # the blocks alone
    moe.add_shared_expert(shared)
    generator = torch.Generator().manual_seed(tokens)
    x, residual = torch.randn(tokens, HIDDEN, generator=generator), torch.randn(tokens, HIDDEN, generator=generator)
    weights, ids = route(F.linear(x, router), TOP_K, renormalize=True)
    shared_weight, shared_id = torch.sigmoid(x @ shared.gate.T), torch.zeros(tokens, 1, dtype=torch.long)
    shared_gate_up, shared_down = (BlockQuantized(w.fmt, w.data[None], w.in_features) for w in (shared.gate_up, shared.down))
    shared_out = experts_torch(x, shared_gate_up.dequantize(), shared_down.dequantize(), shared_weight, shared_id)
    reference = experts_torch(x, gate_up.dequantize(), down.dequantize(), weights, ids) + shared_out
    ours = moe(x, residual.clone()) - residual
    rounded = _kernel_reference(x, gate_up, down, weights, ids) + _kernel_reference(x, shared_gate_up, shared_down, shared_weight, shared_id)
    assert _relative_error(ours, rounded) < 5e-5  # the routed experts' and the shared expert's int16 products
    assert _relative_error(ours, reference) < 3e-4


@pytest.mark.parametrize("tokens", [3, 37])
def test_grouped_results_do_not_depend_on_how_the_threads_share_the_items(tokens: int, pool: bool) -> None:
    gate_up, down = _experts("q4_1", "q8_0", seed=5)
    panels, x, logits = ExpertPanels.of(gate_up, down), torch.randn(tokens, HIDDEN), _logits(tokens, 5)
    check_same_bits_at_every_thread_count(lambda: cpu_kernels()[0].grouped_moe(x, logits, TOP_K, False, panels.gate_up, panels.down))


@pytest.mark.parametrize("tokens", [1, 3, 8, 37])
def test_two_panels_per_tile_change_no_bit_of_the_experts_products(tokens: int, pool: bool) -> None:
    kernel = cpu_kernels()[0]
    gate_up, down = _experts("q4_1", "q8_0", seed=tokens)  # an item's gate and up panels share a tile with pairs on
    panels, x, logits = ExpertPanels.of(gate_up, down), torch.randn(tokens, HIDDEN) + 1, _logits(tokens, tokens)
    before = kernel.block_quant_pair_min_rows()
    try:
        results = []
        for pairs_from in (0, 1):  # never, always (a build without VNNI takes one panel either way)
            kernel.set_block_quant_pair_min_rows(pairs_from)
            results.append(kernel.grouped_moe(x, logits, TOP_K, True, panels.gate_up, panels.down))
    finally:
        kernel.set_block_quant_pair_min_rows(before)
    assert torch.equal(*results)


@pytest.mark.parametrize("hidden, experts", [(96, 12), (576, 64), (100, 7), (17, 1)])
def test_router_logits_are_the_float64_products_with_the_same_bits_at_every_row_count(hidden: int, experts: int, pool: bool) -> None:
    """Rows and experts in the kernel's tiles of 4 and their remainders, a hidden size off its 16-float steps, on
    the takeover pool (experts shared out in groups of 8) or not: each logit close to the float64 product and,
    whatever rows share its call, bit for bit the same."""
    generator = torch.Generator().manual_seed(hidden + experts)
    x, weight = torch.randn(37, hidden, generator=generator), torch.randn(experts, hidden, generator=generator)
    logits = cpu_kernels()[0].router_logits(x, weight)
    torch.testing.assert_close(logits.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-4)
    for rows in (1, 2, 3, 4, 5, 9, 32):
        assert torch.equal(cpu_kernels()[0].router_logits(x[:rows], weight), logits[:rows])
        assert torch.equal(cpu_kernels()[0].router_logits(x[rows : rows + 1], weight), logits[rows : rows + 1])


def test_bad_shapes_are_refused_with_what_was_expected() -> None:
    gate_up, down = _experts("q4_0", "q4_0", seed=1)
    panels, x, kernel = ExpertPanels.of(gate_up, down), torch.randn(2, HIDDEN), cpu_kernels()[0].grouped_moe
    with pytest.raises(RuntimeError, match="router_logits must be"):
        kernel(x, torch.randn(2, EXPERTS + 1), TOP_K, False, panels.gate_up, panels.down)
    with pytest.raises(RuntimeError, match="a panel record is"):
        kernel(x, torch.randn(2, EXPERTS), TOP_K, False, panels.gate_up[..., :-2].contiguous(), panels.down)
    with pytest.raises(RuntimeError, match="top_k must be"):
        kernel(x, torch.randn(2, EXPERTS), EXPERTS + 1, False, panels.gate_up, panels.down)
    with pytest.raises(RuntimeError, match="gate_up panels"):
        kernel(x[:, :64].contiguous(), torch.randn(2, EXPERTS), TOP_K, False, panels.gate_up, panels.down)


def _snap(source: str, target: Path, fmt: str) -> None:
    """A copy of the checkpoint whose experts (and shared experts) lie on ``fmt``'s grid, its other
    projections on q4_1's and its embedding / lm_head on q8_0's: what a GGUF in these formats holds."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    for file in target.glob("*.safetensors"):
        tensors = safetensors.torch.load_file(file)
        for name, tensor in tensors.items():
            grid = None
            if ".experts." in name or ".shared_expert." in name:
                grid = fmt
            elif name.endswith("_proj.weight") or name.endswith("in_proj_qkvz.weight") or name.endswith("in_proj_ba.weight"):
                grid = "q4_1"
            elif name in ("lm_head.weight", "model.embed_tokens.weight") and (config.get("tie_word_embeddings") or name == "lm_head.weight"):
                grid = "q8_0"
            if grid is not None and tensor.dim() == 2 and tensor.shape[1] % 32 == 0:
                tensors[name] = block_quant.dequantize(block_quant.quantize(tensor, grid), grid)
        safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "q4_0"), ("qwen3_moe", "q4_1"), ("qwen3_moe", "q8_0"), ("qwen3_next", "q4_0")])
def test_experts_on_a_block_grid_are_served_in_their_blocks_at_the_fp32_models_logits(
    family: str, fmt: str, tiny_qwen3_moes: dict[str, Checkpoint], tiny_qwen3_nexts: dict[str, Checkpoint], tmp_path: Path
) -> None:
    """The fp32 reference runs the same (dequantized) weights; the blocks differ from it only by the int16
    rounding of activations, the experts' and the other projections' (q4_1 linears). Measured relative logit
    error: ~1.7e-4 on the tiny qwen3_moe; 2.7e-3 on the tiny qwen3_next, 2.4e-3 of it with the experts in
    fp32 (its GDN layers' q4_1 projections: the recurrence carries their rounding through the prompt)."""
    tiny = tiny_qwen3_moes["renorm-dense-middle"] if family == "qwen3_moe" else tiny_qwen3_nexts["gqa-dense-layer"]
    _snap(tiny.path, tmp_path / "snapped", fmt)
    prompt = prompt_of(5, 20)
    exact = ModelRunner(RunnerConfig(str(tmp_path / "snapped"), num_blocks=16, block_size=4))
    served = ModelRunner(RunnerConfig(str(tmp_path / "snapped"), num_blocks=16, block_size=4, weight_quant="auto"))
    facts = served.describe()
    shared = ""  # the tiny qwen3_next's shared expert is 48 wide: no blocks of 32, so it stays a dense MLP beside the call
    assert facts["moe_backend"] == "grouped-cpp" and facts["expert_weights"] == {f"{fmt}: grouped_moe (C++, one call per layer){shared}": facts["moe_layers"]}
    assert exact.describe()["expert_weights"] == {"float32: grouped torch GEMMs": facts["moe_layers"]}
    slot = 0 if family == "qwen3_next" else -1  # the hybrid model's GDN state slot
    prefill = StepPlan(0, [Slice("p", 0, len(prompt), prompt, list(range(8)), sampling=GREEDY, slot=slot)])  # 20 rows: OpenMP's threads
    start = StepPlan(0, [Slice("d", 0, len(prompt), prompt, list(range(8, 16)), sampling=GREEDY, slot=slot + 1)])
    decode = StepPlan(1, [Slice("d", len(prompt), 1, slot=slot + 1)])  # one row: the takeover pool
    relative = []
    theirs, ours = exact.logits(prefill)["p"], served.logits(prefill)["p"]
    relative.append(float((ours - theirs).norm() / theirs.norm()))
    assert exact.execute(start).sampled[0].token_id == served.execute(start).sampled[0].token_id
    theirs, ours = exact.logits(decode)["d"], served.logits(decode)["d"]
    relative.append(float((ours - theirs).norm() / theirs.norm()))
    bound = 1e-3 if family == "qwen3_moe" else 5e-3
    assert all(0 < r < bound for r in relative), relative


@pytest.mark.parametrize(("experts", "top_k", "renormalize"), [(12, 3, True), (64, 8, True), (64, 8, False), (60, 4, True), (5, 5, False)])
def test_the_kernel_routes_as_the_softmax_top_k(experts: int, top_k: int, renormalize: bool) -> None:
    logits = _logits(40, experts, experts)
    logits[1] = 0.5  # all tied: the lowest experts win
    logits[2, ::2] = logits[2, 1]  # ties across the k-th place
    weights, ids = cpu_kernels()[0].route_experts(logits, top_k, renormalize)
    reference_ids = route(logits, top_k, renormalize)[1]
    assert torch.equal(ids.long()[3:], reference_ids[3:])
    assert ids[1].tolist() == list(range(top_k))
    ties = sorted(range(experts), key=lambda e: (-float(logits[2, e]), e))[:top_k]  # ties: the lower expert first
    assert ids[2].tolist() == ties
    expected = torch.softmax(logits, dim=-1).gather(1, ids.long())
    if renormalize:
        expected /= expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens", [1, 5, 33, 70])
def test_a_bank_of_slots_and_a_precomputed_routing_give_the_all_resident_bits(tokens: int, pool: bool) -> None:
    gate_up, down = _experts("q4_1", "q8_0", seed=tokens)
    panels, kernel = ExpertPanels.of(gate_up, down), cpu_kernels()[0]
    generator = torch.Generator().manual_seed(tokens)
    x, logits = torch.randn(tokens, HIDDEN, generator=generator), _logits(tokens, tokens)
    resident = kernel.grouped_moe(x, logits, TOP_K, True, panels.gate_up, panels.down)
    weights, ids = kernel.route_experts(logits, TOP_K, True)
    assert torch.equal(ids.long(), route(logits, TOP_K, True)[1])  # the kernel's routing is moe.route's
    slots = torch.full((EXPERTS,), -1, dtype=torch.int32)
    routed = ids.unique()
    slots[routed] = torch.randperm(len(routed), generator=generator, dtype=torch.int32) + 1  # slot 0 holds garbage
    bank_gate_up = torch.randint(0, 255, (len(routed) + 1, *panels.gate_up.shape[1:]), dtype=torch.uint8, generator=generator)
    bank_down = torch.randint(0, 255, (len(routed) + 1, *panels.down.shape[1:]), dtype=torch.uint8, generator=generator)
    bank_gate_up[slots[routed].long()], bank_down[slots[routed].long()] = panels.gate_up[routed], panels.down[routed]
    banked = kernel.grouped_moe(x, logits, TOP_K, True, bank_gate_up, bank_down, topk_weights=weights, topk_ids=ids, expert_slots=slots)
    assert torch.equal(banked, resident)
    assert torch.equal(kernel.grouped_moe(x, logits, TOP_K, True, bank_gate_up, bank_down, expert_slots=slots), resident)
    one_by_one = torch.cat([kernel.grouped_moe(x[t : t + 1], logits[t : t + 1], TOP_K, True, panels.gate_up, panels.down) for t in range(tokens)])
    assert torch.equal(one_by_one, resident)  # a token's bits do not depend on the others in its call: a step may run in groups of tokens


def test_a_routed_expert_outside_the_bank_is_refused() -> None:
    gate_up, down = _experts("q4_0", "q4_0", seed=2)
    panels, kernel, x, logits = ExpertPanels.of(gate_up, down), cpu_kernels()[0], torch.randn(4, HIDDEN), _logits(4, 2)
    weights, ids = kernel.route_experts(logits, TOP_K, False)
    slots = torch.arange(EXPERTS, dtype=torch.int32)
    slots[int(ids[2, 1])] = -1
    with pytest.raises(RuntimeError, match=f"expert {int(ids[2, 1])} is routed but its slot is -1"):
        kernel.grouped_moe(x, logits, TOP_K, False, panels.gate_up, panels.down, topk_weights=weights, topk_ids=ids, expert_slots=slots)
    with pytest.raises(RuntimeError, match="topk_ids must be in 0..11"):
        kernel.grouped_moe(x, logits, TOP_K, False, panels.gate_up, panels.down, topk_weights=weights, topk_ids=ids + EXPERTS, expert_slots=slots)
    with pytest.raises(RuntimeError, match="needs both topk_weights and topk_ids"):
        kernel.grouped_moe(x, logits, TOP_K, False, panels.gate_up, panels.down, topk_ids=ids)
