"""The decoder's GPU fusions (fused residual-add + RMSNorm, SiLU-and-mul): the Triton kernels on the CPU under
``TRITON_INTERPRET=1`` against their torch references and against torch's own ``F.rms_norm`` / ``F.silu``, at
odd row counts and widths that are not powers of two (576, 1408 over two column blocks, 11); then the
decoder's fused forward, with those kernels, against the unfused one for a dense, an MoE and a hybrid family.

Tolerances: fp32 within 1e-5 relative (a different summation order of the mean square); fp16 within one
fp16 rounding of the output (2⁻¹⁰ relative, 1e-3 here), the rounded residual exactly. As in
``test_fused_moe``, the kernels run in one child process started with the interpreter variable set.
"""

from __future__ import annotations

from multiprocessing.pool import Pool

import pytest
import torch
import torch.nn.functional as F

from services.worker.fusions import UNFUSED, FusionKernels, add_rms_norm_torch, silu_and_mul_torch
from services.worker.models.decoder import FusedDenseMLP

from .harness import Checkpoint, mixed_step_logits, rel_err

pytest.importorskip("triton")

from services.worker.kernels import fusions as kernels  # noqa: E402  (run in the child, interpreted)

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3}
NORM_SHAPES = [(1, 64), (7, 576), (33, 100)]  # rows, hidden
SILU_SHAPES = [(1, 11), (5, 1408), (17, 96)]  # rows, intermediate


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def _close(ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> None:
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_add_rms_norm_matches_its_reference_and_torchs_rms_norm(interpreter: Pool, dtype: torch.dtype) -> None:
    for i, (rows, hidden) in enumerate(NORM_SHAPES):
        x, residual = _inputs((rows, hidden), dtype, i), _inputs((rows, hidden), dtype, 10 + i)
        weight = (1 + 0.3 * _inputs((hidden,), torch.float32, 20 + i)).to(dtype)
        out, updated = interpreter.apply(kernels.add_rms_norm, (x, residual, weight, 1e-6))
        ref_out, ref_updated = add_rms_norm_torch(x, residual, weight, 1e-6)
        assert torch.equal(updated, ref_updated) and torch.equal(ref_updated, x + residual)  # the sum, rounded once
        _close(out, ref_out, TOLERANCE[dtype])
        torchs = F.rms_norm((x + residual).float(), (hidden,), weight.float(), 1e-6).to(dtype)
        _close(out, torchs, TOLERANCE[dtype])

        alone, same = interpreter.apply(kernels.add_rms_norm, (x, None, weight, 1e-6))  # no residual: a plain RMSNorm
        assert torch.equal(same, x)
        _close(alone, add_rms_norm_torch(x, None, weight, 1e-6)[0], TOLERANCE[dtype])


def test_add_rms_norm_reads_strided_rows_and_refuses_misfits(interpreter: Pool) -> None:
    wide = _inputs((6, 200), torch.float32, 0)
    x, residual, weight = wide[:, :96], _inputs((6, 96), torch.float32, 1), _inputs((96,), torch.float32, 2)  # x: row stride 200
    out, updated = interpreter.apply(kernels.add_rms_norm, (x, residual, weight, 1e-5))
    ref_out, ref_updated = add_rms_norm_torch(x, residual, weight, 1e-5)
    _close(out, ref_out, 1e-5)
    assert torch.equal(updated, ref_updated)
    with pytest.raises(ValueError, match="does not fit rows of 96"):
        interpreter.apply(kernels.add_rms_norm, (x, residual, weight[:64], 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_silu_and_mul_matches_its_reference_and_torchs_silu(interpreter: Pool, dtype: torch.dtype) -> None:
    for i, (rows, inter) in enumerate(SILU_SHAPES):
        gate_up = _inputs((rows, 2 * inter), dtype, 30 + i)
        ours = interpreter.apply(kernels.silu_and_mul, (gate_up,))
        _close(ours, silu_and_mul_torch(gate_up), TOLERANCE[dtype])
        gate, up = gate_up.float()[:, :inter], gate_up.float()[:, inter:]
        _close(ours, (F.silu(gate) * up).to(dtype), TOLERANCE[dtype])
    with pytest.raises(ValueError, match="even width"):
        interpreter.apply(kernels.silu_and_mul, (torch.zeros(2, 7),))


# The decoder's fused forward. -----------------------------------------------------------------------------

TORCH_FUSIONS = FusionKernels(add_rms_norm_torch, silu_and_mul_torch, None, None, {"add_rms_norm": "torch reference", "silu_and_mul": "torch reference"})


def _triton_logits(path: str) -> tuple[dict[str, torch.Tensor], dict, bool]:
    logits, runner = mixed_step_logits(path, FusionKernels(kernels.add_rms_norm, kernels.silu_and_mul, None, None, {"add_rms_norm": "triton"}))
    return logits, runner.describe()["fusion_kernels"], runner.decoder.name == "fused"


@pytest.fixture
def checkpoints(tiny_llamas: dict[str, Checkpoint], tiny_qwen3_moes: dict[str, Checkpoint], tiny_qwen3_nexts: dict[str, Checkpoint]) -> list[Checkpoint]:
    """A dense model; an MoE with a dense middle layer; a hybrid with a dense layer and shared experts."""
    return [tiny_llamas["untied"], tiny_qwen3_moes["renorm-dense-middle"], tiny_qwen3_nexts["gqa-dense-layer"]]


def test_unfused_the_decoder_keeps_its_own_forward(checkpoints: list[Checkpoint]) -> None:
    for checkpoint in checkpoints:
        _, runner = mixed_step_logits(checkpoint.path, UNFUSED)
        assert runner.decoder.name == "layers"  # the decoder backend of the unfused forward
        assert set(runner.describe()["fusion_kernels"].values()) == {"none (torch, unfused)"}
        assert not any(isinstance(layer.mlp, FusedDenseMLP) for layer in runner.model.layers)


def test_the_fused_forward_equals_the_unfused_one(checkpoints: list[Checkpoint]) -> None:
    for checkpoint in checkpoints:
        unfused, _ = mixed_step_logits(checkpoint.path, UNFUSED)
        fused, runner = mixed_step_logits(checkpoint.path, TORCH_FUSIONS)
        assert runner.decoder.name == "fused" and any(isinstance(layer.mlp, FusedDenseMLP) for layer in runner.model.layers)
        for rid in unfused:
            assert rel_err(fused[rid], unfused[rid]) < 1e-5, (checkpoint.path, rid)


def test_the_fused_forward_with_the_triton_kernels_equals_the_unfused_one(interpreter: Pool, tiny_qwen3_nexts: dict[str, Checkpoint]) -> None:
    path = tiny_qwen3_nexts["gqa-dense-layer"].path
    unfused, _ = mixed_step_logits(path, UNFUSED)
    fused, names, bound = interpreter.apply(_triton_logits, (path,))
    assert bound and names["add_rms_norm"] == "triton"
    for rid in unfused:
        assert rel_err(fused[rid], unfused[rid]) < 1e-5, rid
