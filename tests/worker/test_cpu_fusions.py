"""The decoder's CPU fusions (``csrc/decoder_fusions.cpp``): each C++ kernel against its torch reference
(``add_rms_norm_torch``, ``silu_and_mul_torch``, ``apply_rotary_``) and torch's own ``F.rms_norm`` /
``F.silu``, at odd row counts and widths (100, 11: vector loops with scalar tails), on views such as
the q/k heads inside a fused qkv output; then the choice of backend, and the decoder's forward with the
kernels against its unfused forward for every family (dense, Qwen3's q/k norm, MoE, hybrid with partial
rotary).

Tolerance: 1e-5 relative (fp32, a different summation order and exp approximation); the residual sum
exactly.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from services.worker import fusions
from services.worker.cpu_kernels import cpu_kernels
from services.worker.fusions import UNFUSED, add_rms_norm_torch, select_fusion_kernels, silu_and_mul_torch
from services.worker.models.decoder import FusedDenseMLP
from services.worker.rmsnorm import RMSNorm
from services.worker.rotary import RotaryEmbedding, apply_rotary_

from .harness import Checkpoint, mixed_step_logits, rel_err

KERNELS, WHY = cpu_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason=f"the CPU kernels did not build: {WHY}")

TOLERANCE = 1e-5
ROWS = (1, 3, 37)


def _randn(*shape: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("hidden", [576, 100])
def test_add_rms_norm_matches_its_reference_and_torchs_rms_norm(hidden: int) -> None:
    weight = 1 + 0.3 * _randn(hidden, seed=0, scale=1)
    for rows in ROWS:
        x, residual = _randn(rows, hidden, seed=rows), _randn(rows, hidden, seed=100 + rows)
        ref_out, ref_h = add_rms_norm_torch(x, residual, weight, 1e-6)
        mine = x.clone()
        out, h = KERNELS.add_rms_norm(mine, residual, weight, 1e-6)
        assert torch.equal(h, ref_h) and h.data_ptr() == mine.data_ptr()  # the sum, exact, written over x
        _close(out, ref_out)
        _close(out, F.rms_norm(x + residual, (hidden,), weight, 1e-6))

        before = x.clone()
        alone, same = KERNELS.add_rms_norm(x, None, weight, 1e-6)  # no residual: a plain RMSNorm, x untouched
        assert same is x and torch.equal(x, before)
        _close(alone, add_rms_norm_torch(x, None, weight, 1e-6)[0])


def test_add_rms_norm_reads_strided_rows_and_refuses_misfits() -> None:
    wide, residual, weight = _randn(6, 200, seed=1), _randn(6, 96, seed=2), _randn(96, seed=3)
    x = wide[:, 50:146]  # rows of 96 at a stride of 200
    ref_out, ref_h = add_rms_norm_torch(x, residual, weight, 1e-5)
    out, h = KERNELS.add_rms_norm(x, residual, weight, 1e-5)
    _close(out, ref_out)
    assert torch.equal(h, ref_h) and torch.equal(wide[:, 50:146], ref_h)  # written over x's own rows
    transposed = _randn(96, 6, seed=4).t()  # columns of unit stride: summed into a copy, the input left alone
    before = transposed.clone()
    out, h = KERNELS.add_rms_norm(transposed, residual, weight, 1e-5)
    _close(out, add_rms_norm_torch(before, residual, weight, 1e-5)[0])
    assert torch.equal(transposed, before) and torch.equal(h, before + residual)
    with pytest.raises(RuntimeError, match="does not fit rows of 96"):
        KERNELS.add_rms_norm(x, residual, weight[:64], 1e-5)
    with pytest.raises(RuntimeError, match="does not match"):
        KERNELS.add_rms_norm(x, residual[:3], weight, 1e-5)
    with pytest.raises(RuntimeError, match="float32"):
        KERNELS.add_rms_norm(x.half(), None, weight, 1e-5)


@pytest.mark.parametrize("inter", [1536, 100, 11])
def test_silu_and_mul_matches_its_reference_and_torchs_silu(inter: int) -> None:
    for rows in ROWS:
        gate_up = _randn(rows, 2 * inter, seed=rows, scale=4)
        gate_up[0, :4] = torch.tensor([-120.0, -60.0, 60.0, 120.0])  # far tails: exp(-|g|) underflows, never overflows
        ours = KERNELS.silu_and_mul(gate_up)
        _close(ours, silu_and_mul_torch(gate_up))
        _close(ours, F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
        assert torch.isfinite(ours).all()
    wide = _randn(5, 2 * inter + 7, seed=9)[:, 3 : 3 + 2 * inter]  # rows at a stride wider than [gate | up]
    _close(KERNELS.silu_and_mul(wide), silu_and_mul_torch(wide))
    with pytest.raises(RuntimeError, match="even width"):
        KERNELS.silu_and_mul(torch.zeros(2, 7))


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "rotary_dim"), [(9, 3, 64, 64), (4, 2, 36, 36), (4, 2, 32, 8)])
def test_rotary_rotates_the_q_and_k_heads_inside_qkv_like_apply_rotary(heads: int, kv_heads: int, head_dim: int, rotary_dim: int) -> None:
    """Full rotary on SmolLM2's shape, a half width (18) that is no multiple of 8, and Qwen3-Next's partial rotary."""
    rotary = RotaryEmbedding(rotary_dim, 10000.0, {}, 64, torch.float32)
    for rows in ROWS:
        positions = torch.randint(0, 3000, (rows,), generator=torch.Generator().manual_seed(rows))  # past the table: it grows
        cos, sin = rotary.lookup(positions, int(positions.max()))
        qkv = _randn(rows, heads + 2 * kv_heads, head_dim, seed=rows)
        theirs, ours = qkv.clone(), qkv.clone()
        apply_rotary_(theirs[:, : heads + kv_heads, :rotary_dim], cos, sin)
        KERNELS.rotary_(ours[:, : heads + kv_heads, :rotary_dim], cos, sin)
        _close(ours, theirs)
        assert torch.equal(ours[:, heads + kv_heads :], qkv[:, heads + kv_heads :]) and torch.equal(ours[..., rotary_dim:], qkv[..., rotary_dim:])
        assert not torch.equal(ours[:, : heads + kv_heads, :rotary_dim], qkv[:, : heads + kv_heads, :rotary_dim]) or positions.eq(0).all()
    with pytest.raises(RuntimeError, match="do not fit"):
        KERNELS.rotary_(qkv[:, :heads, :rotary_dim], cos[:1], sin[:1])
    with pytest.raises(RuntimeError, match="unit stride"):
        KERNELS.rotary_(torch.zeros(rows, heads, 2 * rotary_dim)[..., ::2], cos, sin)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 2, 11)])
def test_rms_norm_heads_norms_the_q_and_k_heads_inside_qkv_like_rmsnorm(heads: int, kv_heads: int, head_dim: int) -> None:
    """Each q and k head normed in place by its own weight row (a Qwen3 layer's q_norm rows, then its k_norm
    rows), the v heads after them untouched, as ``RMSNorm.norm_`` and torch's ``F.rms_norm`` do it."""
    q_norm, k_norm = 1 + 0.3 * _randn(head_dim, seed=1, scale=1), 1 + 0.3 * _randn(head_dim, seed=2, scale=1)
    weight = torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)])
    for rows in ROWS:
        qkv = _randn(rows, heads + 2 * kv_heads, head_dim, seed=rows)
        theirs, ours = qkv.clone(), qkv.clone()
        RMSNorm(weight, 1e-6).norm_(theirs[:, : heads + kv_heads])
        KERNELS.rms_norm_heads_(ours[:, : heads + kv_heads], weight, 1e-6)
        _close(ours, theirs)
        _close(ours[:, :heads], F.rms_norm(qkv[:, :heads], (head_dim,), q_norm, 1e-6))
        assert torch.equal(ours[:, heads + kv_heads :], qkv[:, heads + kv_heads :])
    with pytest.raises(RuntimeError, match="must be \\[heads, head_dim\\]"):
        KERNELS.rms_norm_heads_(qkv[:, :heads], weight, 1e-6)
    with pytest.raises(RuntimeError, match="unit stride"):
        KERNELS.rms_norm_heads_(torch.zeros(rows, heads + kv_heads, 2 * head_dim)[..., ::2], weight, 1e-6)


def test_the_cpu_chooses_the_cpp_kernels_for_fp32_models_and_says_why_not() -> None:
    cpu = torch.device("cpu")
    chosen = select_fusion_kernels(cpu, torch.float32)
    assert chosen.add_rms_norm is KERNELS.add_rms_norm and chosen.silu_and_mul is KERNELS.silu_and_mul and chosen.rotary is KERNELS.rotary_
    assert chosen.norm_heads is KERNELS.rms_norm_heads_
    assert chosen.names == {"add_rms_norm": "cpp", "silu_and_mul": "cpp", "rotary": "cpp", "norm_heads": "cpp"}
    bf16 = select_fusion_kernels(cpu, torch.bfloat16)
    assert bf16[:4] == (None, None, None, None) and bf16.names["rotary"] == "none (the C++ kernels are fp32, the model is bfloat16)"
    with mock.patch.object(fusions, "cpu_kernels", lambda: (None, "disabled by TOKENYARD_CPU_KERNELS=0")):
        off = select_fusion_kernels(cpu, torch.float32)
    assert off[:4] == (None, None, None, None) and off.names["add_rms_norm"] == "none (C++ kernels unavailable: disabled by TOKENYARD_CPU_KERNELS=0)"


@pytest.fixture
def every_family(
    tiny_llamas: dict[str, Checkpoint], tiny_qwen3s: dict[str, Checkpoint], tiny_qwen3_moes: dict[str, Checkpoint], tiny_qwen3_nexts: dict[str, Checkpoint]
) -> list[Checkpoint]:
    """Dense with Llama 3 rope; Qwen3 with q/k norm and biases; MoE with a dense middle layer; hybrid with partial rotary."""
    return [tiny_llamas["llama3-rope"], next(iter(tiny_qwen3s.values())), tiny_qwen3_moes["renorm-dense-middle"], tiny_qwen3_nexts["gqa-dense-layer"]]


def test_the_decoder_with_the_cpp_kernels_equals_its_unfused_forward(every_family: list[Checkpoint]) -> None:
    for checkpoint in every_family:
        unfused, _ = mixed_step_logits(checkpoint.path, UNFUSED)
        fused, runner = mixed_step_logits(checkpoint.path, select_fusion_kernels(torch.device("cpu"), torch.float32))
        assert runner.decoder.name == "fused" and any(isinstance(layer.mlp, FusedDenseMLP) for layer in runner.model.layers)
        assert runner.describe()["fusion_kernels"] == {"add_rms_norm": "cpp", "silu_and_mul": "cpp", "rotary": "cpp", "norm_heads": "cpp"}
        assert set(unfused) == set(fused) == {"a", "b"}  # a decode and a prefill chunk, in one step
        for rid in unfused:
            assert rel_err(fused[rid], unfused[rid]) < TOLERANCE, (checkpoint.path, rid)
