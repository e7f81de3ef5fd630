"""Weight formats: int8's per-channel codec bound, fp16 packs equal to fp16-rounded weights in fp32
arithmetic, the logit error each costs a whole model against the same checkpoint in fp32 — through
the runner — and which format ``auto`` picks where."""

from __future__ import annotations

import pytest
import torch

from services.worker.cpu_kernels import cpu_kernels
from services.worker.linear import Linear, RowSplitLinear, int8_per_channel, resolve_weight_quant
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan
from shared.model_info import load_model_info, resolve_kv_cache_dtype

from .harness import GREEDY, Checkpoint, check_same_bits_at_every_thread_count, kernel_rounded, prompt_of


def test_codec_error_is_at_most_half_a_step_per_element() -> None:
    w = torch.randn(48, 40) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different magnitude
    q, scales = int8_per_channel(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.all((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 33])
@pytest.mark.parametrize("out_features", [24, 30])  # 30: a tail of output channels past the 4-channel tiles
def test_int8_products_equal_block_quantized_activations_times_the_dequantized_weight(rows: int, out_features: int) -> None:
    # Fixed data: a value within an ulp of a rounding tie may quantize one level apart here and in the kernel.
    generator = torch.Generator().manual_seed(rows * 100 + out_features)
    w, bias, x, residual = (torch.randn(*shape, generator=generator) for shape in ((out_features, 64), (out_features,), (rows, 64), (rows, out_features)))
    q, scales = int8_per_channel(w)
    dequantized = q.float() * scales[:, None]
    linear = Linear(w.clone(), threads=2, bias=bias)
    linear.quantize_int8()
    ours = linear(x, residual=residual.clone())
    # Integer block products are exact; only fp32 summation order differs from this reference.
    torch.testing.assert_close(ours, kernel_rounded(x, 127) @ dequantized.T + bias + residual, rtol=1e-5, atol=1e-5)
    assert (ours - (x @ dequantized.T + bias + residual)).abs().max() > 1e-6  # activations really are quantized
    head = RowSplitLinear(w.clone(), threads=2)
    head.quantize_int8()
    torch.testing.assert_close(head(x), kernel_rounded(x, 127) @ dequantized.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_kernels()[0] is None, reason=f"CPU kernels unavailable: {cpu_kernels()[1]}")
@pytest.mark.parametrize("rows", [1, 33])
def test_int8_products_do_not_depend_on_how_the_threads_share_the_channels(rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    w, x = torch.randn(299, 64, generator=generator), torch.randn(rows, 64, generator=generator)
    q, scales = int8_per_channel(w)  # 75 tiles of 4 channels: 10 groups
    check_same_bits_at_every_thread_count(lambda: cpu_kernels()[0].int8_linear(x, q, scales, None))


def test_int8_products_are_exact_for_activations_on_the_int8_grid() -> None:
    """Activations that are whole multiples of their block's step quantize losslessly: what is left is
    the integer products and the scales, which must then equal the dequantized weight's product."""
    x = torch.randint(-127, 128, (6, 96), generator=torch.Generator().manual_seed(3)).float() / 64
    x.view(6, 3, 32)[:, :, 0] = 127 / 64  # every block's largest magnitude, so its step is exactly 1/64
    w = torch.randn(12, 96)
    q, scales = int8_per_channel(w)
    linear = Linear(w.clone(), threads=2)
    linear.quantize_int8()
    torch.testing.assert_close(linear(x), x @ (q.float() * scales[:, None]).T, rtol=1e-5, atol=1e-5)


def test_int8_keeps_activations_whole_where_features_are_not_whole_blocks() -> None:
    w, x = torch.randn(8, 40), torch.randn(3, 40)
    q, scales = int8_per_channel(w)
    linear = Linear(w.clone(), threads=2)
    linear.quantize_int8()
    torch.testing.assert_close(linear(x), x @ (q.float() * scales[:, None]).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 8, 33])
def test_fp16_packs_compute_in_fp32_with_fp16_rounded_weights(rows: int) -> None:
    w, bias, x, residual = torch.randn(24, 16), torch.randn(24), torch.randn(rows, 16), torch.randn(rows, 24)
    rounded = w.half().float()
    linear = Linear(w.clone(), threads=2, bias=bias)
    linear.pack_fp16()
    assert linear.weight.device.type == "meta" and linear.weight.dtype == torch.float16  # accounted, not stored
    torch.testing.assert_close(linear(x, residual=residual.clone()), x @ rounded.T + bias + residual, rtol=1e-5, atol=1e-5)
    head = RowSplitLinear(w.clone(), threads=2)
    head.pack_fp16()
    torch.testing.assert_close(head(x), x @ rounded.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(x @ rounded.T, x @ w.T, rtol=1e-6, atol=0)  # the rounding is real, so the check above could fail


def test_auto_weight_format_is_decided_at_conversion_for_fp32_on_the_cpu_only() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_quant("auto", cpu, torch.float32) == "auto"  # int4 where lossless, else fp16 (test_block_quant.py)
    assert resolve_weight_quant("auto", cpu, torch.bfloat16) == "none"
    assert resolve_weight_quant("auto", cuda, torch.bfloat16) == "none"
    assert resolve_weight_quant("int8", cpu, torch.float32) == "int8"
    for fmt in ("fp16", "int4", "int4-a8"):
        with pytest.raises(ValueError, match="needs a float32 model on a CPU"):
            resolve_weight_quant(fmt, cpu, torch.bfloat16)


@pytest.mark.parametrize(
    "weight_quant, checkpoint, resolved, bound",
    [
        # fp16 keeps 11 significant bits: ~1e-4 here (the real model: 6.6e-4, perplexity +0.03 %).
        ("auto", "tied-sharded", "fp16", 2e-3),
        # int8 weights and block-int8 activations: measured 5.8e-2, while a wrong scale or layout gives
        # ~1 (the real model's figures, perplexity +1.7 %, are in bench/reference/quantization/quantization.json).
        ("int8", "untied", "int8", 0.1),
    ],
)
def test_model_logit_error_of_each_weight_format_is_bounded(
    tiny_llamas: dict[str, Checkpoint], weight_quant: str, checkpoint: str, resolved: str, bound: float
) -> None:
    tiny = tiny_llamas[checkpoint]
    prompt = prompt_of(5, 20)
    plan = StepPlan(0, [Slice("q", 0, len(prompt), prompt, list(range(8)), sampling=GREEDY)])
    exact = ModelRunner(RunnerConfig(tiny.path, num_blocks=8, block_size=4)).logits(plan)["q"]
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=8, block_size=4, weight_quant=weight_quant))
    converted = runner.logits(plan)["q"]
    facts = runner.describe()
    assert facts["weight_quant"] == resolved and facts["quantized_linears"] == 4 * tiny.reference.config.num_hidden_layers + 1
    relative = float((converted - exact).norm() / exact.norm())
    assert 0 < relative < bound, relative  # zero would mean nothing was converted


def test_kv_cache_dtype_auto_is_fp16_for_fp32_on_the_cpu_only(tiny_llamas: dict[str, Checkpoint]) -> None:
    assert resolve_kv_cache_dtype("auto", "cpu", "float32") == "float16"
    assert resolve_kv_cache_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_kv_cache_dtype("model", "cpu", "float32") == "float32"
    with pytest.raises(ValueError, match="needs the CPU"):
        resolve_kv_cache_dtype("float16", "cuda", "bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8'"):
        resolve_kv_cache_dtype("fp8", "cpu", "float32")
    tiny = tiny_llamas["untied"]
    prompt = prompt_of(7, 20)
    plan = StepPlan(0, [Slice("q", 0, len(prompt), prompt, list(range(8)), sampling=GREEDY)])
    exact, rounded = (
        ModelRunner(RunnerConfig(tiny.path, num_blocks=8, block_size=4)),
        ModelRunner(RunnerConfig(tiny.path, num_blocks=8, block_size=4, kv_cache_dtype="auto")),
    )
    assert rounded.describe()["kv_cache_dtype"] == "float16" and rounded.describe()["dtype"] == "float32"
    token = exact.execute(plan).sampled[0].token_id
    assert rounded.execute(plan).sampled[0].token_id == token
    decode = StepPlan(1, [Slice("q", len(prompt), 1)])
    theirs, ours = exact.logits(decode)["q"], rounded.logits(decode)["q"]
    relative = float((ours - theirs).norm() / theirs.norm())
    assert 0 < relative < 2e-3, relative  # the decode reads the fp16-rounded prompt keys and values


def test_an_int8_kv_cache_is_opt_in_bounded_and_sized_as_the_scheduler_sizes_it(tiny_llamas: dict[str, Checkpoint]) -> None:
    """``--kv-cache-dtype int8`` (llama.cpp's q8_0 per head vector): a float32 model on the CPU only, with the
    C++ attention kernel and a head_dim divisible by 32; the decode's logits within int8's rounding of the
    fp32 cache's; its bytes per token those ``ModelInfo`` sizes a byte budget with."""
    assert resolve_kv_cache_dtype("int8", "cpu", "float32") == "int8"
    for device, dtype in (("cuda", "float32"), ("cpu", "bfloat16")):
        with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs a float32 model on the CPU"):
            resolve_kv_cache_dtype("int8", device, dtype)
    with pytest.raises(ValueError, match="head_dim divisible by 32"):
        ModelRunner(RunnerConfig(tiny_llamas["untied"].path, num_blocks=8, block_size=4, kv_cache_dtype="int8"))  # head_dim 16
    tiny = tiny_llamas["tied-sharded"]  # head_dim 32
    prompt = prompt_of(11, 20)
    plan = StepPlan(0, [Slice("q", 0, len(prompt), prompt, list(range(8)), sampling=GREEDY)])
    exact, q8 = (
        ModelRunner(RunnerConfig(tiny.path, num_blocks=8, block_size=4)),
        ModelRunner(RunnerConfig(tiny.path, num_blocks=8, block_size=4, kv_cache_dtype="int8")),
    )
    facts, config = q8.describe(), tiny.reference.config
    assert facts["kv_cache_dtype"] == "int8"
    assert facts["kv_bytes_per_token"] == config.num_hidden_layers * 2 * config.num_key_value_heads * (32 + 2)
    assert facts["kv_bytes_per_token"] == load_model_info(tiny.path).kv_bytes_per_token("int8")
    assert q8.execute(plan).sampled[0].token_id == exact.execute(plan).sampled[0].token_id
    decode = StepPlan(1, [Slice("q", len(prompt), 1)])
    theirs, ours = exact.logits(decode)["q"], q8.logits(decode)["q"]
    relative = float((ours - theirs).norm() / theirs.norm())
    # Measured 2.2e-2 here (the default model: 1.0e-2, top-1 agreement 98.6 %); a wrong scale or layout gives ~1.
    assert 0 < relative < 5e-2, relative


def test_unknown_weight_quant_is_refused(tiny_llamas: dict[str, Checkpoint]) -> None:
    with pytest.raises(ValueError, match="weight_quant 'int3'"):
        ModelRunner(RunnerConfig(tiny_llamas["untied"].path, num_blocks=8, block_size=4, weight_quant="int3"))
