"""Weight matrix products for the CPU that keep every core busy when a step has only a few rows.

MKL runs a GEMM of one to a few rows on one core, bound by how fast that core streams the
weight from memory. For such steps the weight is cut into one slice per thread and the slices
run as one batched GEMM (``bmm`` gives each core its own slice); many-row steps take plain GEMM.

Weight storage formats (``--weight-quant``), chosen per deployment:

- ``fp16`` (the default for fp32 models on a CPU with fbgemm): the weight rounded to fp16 and
  packed for fbgemm's fp16 GEMM, which converts it to fp32 in registers and multiplies in fp32.
  Half the bytes per step, and fbgemm's small-row kernels beat MKL's fp32 GEMM 2-4x on an AVX2
  CPU (``bench/quantization.py``); the rounding costs a relative logit error of ~1e-4.
- ``int8``: weights symmetric int8 with one scale per output channel; on the CPU in fp32, the C++
  kernel (``csrc/int8_linear.cpp``) also quantizes activations to int8 per block of 32 features
  and multiplies in integers: a quarter of fp32's weight bytes, +1.7 % perplexity and 93 % top-1
  agreement on the default model, so it is opt-in. Elsewhere activations stay in their dtype (aten's
  ``_weight_int8pack_mm``). fbgemm's dynamic int8 GEMM was rejected: its one activation scale per
  tensor (or even per token) costs +4 % perplexity or more.
- ``int4``: the dense projections in q4_1 blocks (``block_quant.py``: 4-bit codes, an fp16 scale and
  minimum per 32 input features), lm_head in q8_0 blocks (8-bit codes, an fp16 scale), both regrouped in
  panels of 8 output channels (``block_quant.to_panels``) and multiplied by ``csrc/block_quant_gemm.cpp``
  with activations rounded to int16 per block (error ~2e-5 of the block's largest value, below fp16's).
  A panel is one sequential stream of records, which the memory system feeds faster than rows read side
  by side: decode steps of 1 / 2 / 4 rows take 0.8 / 0.7 / 0.8x the time of a row kernel; at hundreds of
  rows the panels are ~1.1x (q4_1) and ~1.2x (q8_0) fbgemm's fp16 GEMM with a quarter or half of its
  bytes, so no fp16 packs are kept. A checkpoint converted from a q4_1 GGUF (the default model)
  round-trips exactly, so for it ``int4`` costs nothing and ``auto`` picks it; elsewhere it costs 4-bit
  weights.
- ``int4-a8`` (opt-in): ``int4``, but steps of more than ``BLOCK_QUANT_MAX_ROWS`` rows round activations to int8
  instead, lm_head's too (llama.cpp's q4_1 / q8_0 x q8 arithmetic; the 4-bit products 1.7-1.9x fbgemm's fp16 GEMM
  on an AVX2 CPU, q8_0's faster only where VNNI multiplies bytes). Costs what int8 activations cost: logit error
  6.8e-2, 94 % top-1 agreement with fp32 on the default model in many-row steps (``bench/quantization.py``).
- ``none``: the checkpoint's dtype as loaded.

A GGUF's Q4_0 / Q4_1 / Q8_0 weights arrive in their blocks (``block_quant.BlockQuantized``) and are
multiplied in them whatever the format chosen here, which applies to the float weights beside them;
under ``int4-a8`` the GGUF's blocks (llama.cpp's own q4 / q8_0 x q8 arithmetic) also take int8 activations
beyond ``BLOCK_QUANT_MAX_ROWS`` rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from services.worker import block_quant
from services.worker.block_quant import BlockQuantized
from services.worker.cpu_kernels import cpu_kernels
from shared.choices import WEIGHT_QUANTS

SPLIT_MAX_ROWS = 8  # measured: the split wins up to 8 rows, plain GEMM beyond
INT8_ACTIVATION_BLOCK = 32  # features per activation scale in csrc/int8_linear.cpp
BLOCK_QUANT_MAX_ROWS = 4  # "few rows": int4-a8 keeps int16 activations in steps of up to this many rows


def _slices(size: int, threads: int) -> int:
    return next(s for s in range(max(threads, 1), 0, -1) if size % s == 0)


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 values in -127..127 and one scale per output row: ``weight ≈ q * scale[:, None]``."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


def _int8_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (weight * scales[:, None]).T (+ bias)``: for fp32 on the CPU the C++ kernel, which also
    quantizes ``x`` per block of ``INT8_ACTIVATION_BLOCK`` features; else aten's weight-only kernel."""
    kernels, _ = cpu_kernels()
    if kernels is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] % INT8_ACTIVATION_BLOCK == 0:
        return kernels.int8_linear(x, weight, scales, bias)
    out = torch.ops.aten._weight_int8pack_mm(x, weight, scales)
    return out if bias is None else out.add_(bias)


def fp16_packing_available() -> bool:
    """fbgemm's fp16-weight GEMM is built into this torch (x86 CPUs)."""
    return "fbgemm" in torch.backends.quantized.supported_engines


BLOCK_QUANTS = ("int4", "int4-a8")  # the formats that keep q4_1 / q8_0 blocks
KERNEL_BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0")  # the block formats csrc/block_quant_gemm.cpp and grouped_moe.cpp multiply


def block_formats(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """The block formats a linear or a stack of experts can hold and multiply on ``device`` in ``dtype`` (a
    pre-quantized weight of another format is dequantized at load)."""
    runs = device.type == "cpu" and dtype == torch.float32 and cpu_kernels()[0] is not None
    return KERNEL_BLOCK_FORMATS if runs else ()


def cat_rows(weights: list[torch.Tensor | BlockQuantized]) -> torch.Tensor | BlockQuantized:
    """The weights' rows one after another (fusing projections that share their input): blocks stay blocks
    where all are of one format, else every part is dequantized."""
    if not any(isinstance(w, BlockQuantized) for w in weights):
        return torch.cat(weights)
    formats = {w.fmt if isinstance(w, BlockQuantized) else None for w in weights}
    if len(formats) == 1:
        return BlockQuantized(weights[0].fmt, torch.cat([w.data for w in weights]), weights[0].in_features)
    return torch.cat([w.dequantize() if isinstance(w, BlockQuantized) else w.float() for w in weights])


def map_rows(weight: torch.Tensor | BlockQuantized, reorder: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | BlockQuantized:
    """``reorder`` ([rows, width] -> [rows', width], whole rows moved) applied to a weight, in blocks or not."""
    if isinstance(weight, BlockQuantized):
        return BlockQuantized(weight.fmt, reorder(weight.data), weight.in_features)
    return reorder(weight)


def resolve_weight_quant(weight_quant: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: fp16 packs for an fp32 model on a CPU with fbgemm (``convert_weights`` upgrades it to
    int4 where that is lossless), else the dtype's own weights. Refuses a format the device or dtype
    cannot run, naming why."""
    if weight_quant not in WEIGHT_QUANTS:
        raise ValueError(f"weight_quant {weight_quant!r} is not supported (supported: {', '.join(WEIGHT_QUANTS)})")
    fp16_runs = device.type == "cpu" and dtype == torch.float32 and fp16_packing_available()
    if weight_quant == "auto":
        return "auto" if fp16_runs else "none"
    if weight_quant in ("fp16", *BLOCK_QUANTS) and not fp16_runs:
        raise ValueError(f"weight_quant {weight_quant!r} needs a float32 model on a CPU whose torch has fbgemm (x86)")
    if weight_quant in BLOCK_QUANTS and cpu_kernels()[0] is None:
        raise ValueError(f"weight_quant {weight_quant!r} needs the CPU kernels, which are unavailable: {cpu_kernels()[1]}")
    return weight_quant


def _packed_placeholder(out_features: int, in_features: int) -> torch.Tensor:
    """Stands in for a weight that lives only in an fbgemm pack or in blocks: it has the weight's shape
    (the parameter count) and no storage, so any other use fails loudly; ``held_bytes`` counts what
    the linear really holds."""
    return torch.empty(out_features, in_features, dtype=torch.float16, device="meta")


class Linear:
    """``x @ weight.T (+ bias) (+ residual)``.

    fp32: stored transposed ([in, out]) and, for steps of few rows, split along ``in`` (the
    slices' partial products are summed). bf16/fp16: kept as [out, in] for oneDNN, whose
    AMX/AVX-512 kernels are fast at every row count, while its bf16 ``bmm`` is not. int8:
    [out, in] values and per-row scales for ``_weight_int8pack_mm``. fp16: an fbgemm pack (bias inside).
    """

    def __init__(self, weight: torch.Tensor | BlockQuantized, threads: int, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        self.bias = bias
        self.scales: torch.Tensor | None = None
        self.packed: Any = None
        self.panels: torch.Tensor | None = None  # int4 or a GGUF's blocks, regrouped in panels of 8 output channels
        if isinstance(weight, BlockQuantized):
            self.hold_blocks(weight)
            return
        self.split = weight.dtype == torch.float32
        if not self.split:
            self.weight, self.slices = weight.contiguous(), 1
            return
        self.weight = weight.t().contiguous()
        self.slices = _slices(in_features, threads)
        self._sliced = self.weight.view(self.slices, in_features // self.slices, out_features)

    def quantize_int8(self) -> None:
        """From now on the weight is int8 with per-output-channel scales (the float weight is dropped)."""
        if self.scales is not None:
            return
        self.weight, self.scales = int8_per_channel(self.weight.t() if self.split else self.weight)
        self.split, self._sliced = False, None

    def float_weight(self) -> torch.Tensor:
        """The weight as [out, in] float32 (before any conversion)."""
        return self.weight_rows().float().contiguous()

    def weight_rows(self) -> torch.Tensor:
        """The weight as [out, in] in its dtype, without a copy (before any conversion)."""
        return self.weight.t() if self.split else self.weight

    def pack_fp16(self) -> None:
        """From now on the weight is fp16 in an fbgemm pack (the float weight is dropped)."""
        if self.packed is not None or self.scales is not None:
            return
        weight = self.float_weight()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight, None if self.bias is None else self.bias.float())
        self.weight, self.split, self._sliced = _packed_placeholder(*weight.shape), False, None

    def quantize_int4(self, blocks: torch.Tensor, int8_activations: bool = False) -> None:
        """From now on the panels of ``blocks`` (``block_quant.quantize(float_weight(), "q4_1")``) serve
        every step, with activations rounded to int16 or, with ``int8_activations``, to int8 in steps of
        more than ``BLOCK_QUANT_MAX_ROWS`` rows (the float weight and the rows are dropped)."""
        in_features = blocks.shape[1] // block_quant.BLOCK_BYTES["q4_1"] * block_quant.BLOCK
        self.hold_blocks(BlockQuantized("q4_1", blocks, in_features), int8_activations)

    def hold_blocks(self, blocks: BlockQuantized, int8_activations: bool = False) -> None:
        """From now on the panels of ``blocks`` serve every step (``int8_activations``: see ``round_activations_to_int8``)."""
        self.hold_panels(blocks.panels(), blocks.shape, int8_activations)

    def hold_panels(self, panels: torch.Tensor, shape: tuple[int, ...], int8_activations: bool = False) -> None:
        """From now on ``panels`` (``block_quant.to_panels`` of an [out, in] weight of ``shape``, any block format) serve every step."""
        self.panels, self._gemm_kernel = panels, cpu_kernels()[0].block_quant_gemm
        self.activation_bits = 16  # in steps of more than BLOCK_QUANT_MAX_ROWS rows
        if int8_activations:
            self.round_activations_to_int8()
        self.weight, self.split, self._sliced, self.slices = _packed_placeholder(*shape), False, None, 1

    def round_activations_to_int8(self) -> None:
        """Steps of more than ``BLOCK_QUANT_MAX_ROWS`` rows round activations to int8."""
        self.activation_bits = 8

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if self.panels is not None:  # int4 runs only fp32 models on the CPU
            bits = 16 if rows <= BLOCK_QUANT_MAX_ROWS else self.activation_bits
            return self._gemm_kernel(x, self.panels, self.weight.shape[0], self.bias, residual, bits)
        if self.packed is not None:
            out = torch.ops.quantized.linear_dynamic_fp16(x, self.packed)  # the bias is in the pack
            return out if residual is None else out.add_(residual)
        if self.scales is not None:
            out = _int8_mm(x, self.weight, self.scales, self.bias)
            return out if residual is None else out.add_(residual)
        if not self.split:
            out = F.linear(x, self.weight, self.bias)
            return out if residual is None else out.add_(residual)
        if rows > SPLIT_MAX_ROWS or self.slices == 1:
            out = x @ self.weight if residual is None else torch.addmm(residual, x, self.weight)
        else:
            sliced_x = x.view(self.slices, 1, -1) if rows == 1 else x.view(rows, self.slices, -1).transpose(0, 1)
            out = torch.bmm(sliced_x, self._sliced).sum(0)
            if residual is not None:
                out.add_(residual)
        return out if self.bias is None else out.add_(self.bias)


class RowSplitLinear:
    """``x @ weight.T`` for a weight kept as it is ([out, in], e.g. an embedding table shared with
    the input), split along ``out``: each slice computes its own columns of the result."""

    def __init__(self, weight: torch.Tensor | BlockQuantized, threads: int) -> None:
        out_features, in_features = weight.shape
        self.scales: torch.Tensor | None = None
        self.packed: Any = None
        self.panels: torch.Tensor | None = None  # int4's q8_0 blocks or a GGUF's, regrouped in panels of 8 output channels
        self.activation_bits = 16  # with panels, in steps of more than BLOCK_QUANT_MAX_ROWS rows
        if isinstance(weight, BlockQuantized):
            self.hold_panels(weight.panels(), tuple(weight.shape))
            return
        self.weight = weight
        self.slices = _slices(out_features, threads) if weight.dtype == torch.float32 else 1
        self._sliced_t = weight.view(self.slices, out_features // self.slices, in_features).transpose(1, 2)

    def quantize_int8(self) -> None:
        """An int8 copy for the products; a tied embedding table keeps its float original for lookups."""
        if self.scales is None:
            self.weight, self.scales = int8_per_channel(self.weight)
            self._sliced_t = None

    def pack_fp16(self) -> None:
        """An fp16 fbgemm pack for the products; a tied embedding table keeps its float original for lookups."""
        if self.packed is None and self.scales is None:
            self.packed = torch.ops.quantized.linear_prepack_fp16(self.weight.float().contiguous(), None)
            self.weight, self._sliced_t = _packed_placeholder(*self.weight.shape), None

    def float_weight(self) -> torch.Tensor:
        return self.weight.float().contiguous()

    def weight_rows(self) -> torch.Tensor:
        return self.weight

    def quantize_int4(self, blocks: torch.Tensor) -> None:
        """From now on the panels of ``blocks`` (``block_quant.quantize(float_weight(), "q8_0")``) serve every
        step, with int16 activations; a tied embedding keeps its float original for lookups."""
        self.hold_panels(block_quant.to_panels(blocks, "q8_0"), tuple(self.weight.shape))

    def hold_panels(self, panels: torch.Tensor, shape: tuple[int, ...], int8_activations: bool = False) -> None:
        """From now on ``panels`` (q8_0: ``block_quant.to_panels``) serve every step (``int8_activations``: see
        ``round_activations_to_int8``); a tied embedding keeps its float original for lookups."""
        self.panels, self._gemm_kernel = panels, cpu_kernels()[0].block_quant_gemm
        self.weight, self._sliced_t, self.slices = _packed_placeholder(*shape), None, 1
        if int8_activations:
            self.round_activations_to_int8()

    def round_activations_to_int8(self) -> None:
        """Steps of more than ``BLOCK_QUANT_MAX_ROWS`` rows round activations to int8."""
        self.activation_bits = 8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.panels is not None:
            return self._gemm_kernel(x, self.panels, self.weight.shape[0], None, None, 16 if rows <= BLOCK_QUANT_MAX_ROWS else self.activation_bits)
        if self.packed is not None:
            return torch.ops.quantized.linear_dynamic_fp16(x, self.packed)
        if self.scales is not None:
            return _int8_mm(x, self.weight, self.scales, None)
        if rows > SPLIT_MAX_ROWS or self.slices == 1:
            return F.linear(x, self.weight)
        out = torch.bmm(x.expand(self.slices, *x.shape), self._sliced_t)  # [slices, rows, out / slices]
        return out.transpose(0, 1).reshape(rows, -1)


def held_bytes(linear: Linear | RowSplitLinear) -> dict[str, int]:
    """The bytes of a linear's converted weight: its fp16 pack (fbgemm's pack is not a tensor: two bytes a
    weight) and its int4 panels."""
    panels = linear.panels.nbytes if linear.panels is not None else 0
    return {"packed": 2 * linear.weight.numel() if linear.packed is not None else 0, "panels": panels}


def linears_of(model: object) -> list[Linear | RowSplitLinear]:
    """Every ``Linear`` and ``RowSplitLinear`` reachable from ``model``'s attributes (lists and tuples
    included), each once. Expert weights (grouped GEMMs) are not among them."""
    seen: set[int] = set()
    found: list[Linear | RowSplitLinear] = []

    def visit(obj: object) -> None:
        if id(obj) in seen or isinstance(obj, torch.Tensor | str | int | float | bool | type(None)):
            return
        seen.add(id(obj))
        if isinstance(obj, Linear | RowSplitLinear):
            found.append(obj)
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                visit(value)

    visit(model)
    return found


def _int4_format(linear: Linear | RowSplitLinear) -> str | None:
    """The block format int4 gives the linear (q4_1 for projections, q8_0 for lm_head); None when its
    in_features do not split into blocks."""
    if linear.weight_rows().shape[1] % block_quant.BLOCK:
        return None
    return "q8_0" if isinstance(linear, RowSplitLinear) else "q4_1"


def _quantize_to_panels(linear: Linear | RowSplitLinear, fmt: str, int8_activations: bool) -> None:
    weight = linear.weight_rows()
    linear.hold_panels(block_quant.quantize_panels(weight, fmt), tuple(weight.shape), int8_activations)


def convert_weights(model: object, weight_quant: str) -> tuple[str, int]:
    """Every linear of ``model`` switches to ``weight_quant``'s format; returns the format it took and
    how many. ``auto`` (as resolved on a CPU): int4 when every weight round-trips through its blocks
    exactly and the kernels are built, else fp16. A weight whose in_features do not split into
    blocks of 32 keeps an fp16 pack under int4 and int4-a8. Linears that already hold blocks (a GGUF's)
    keep them. MoE experts convert first (``moe.convert_experts``).

    The linears convert one at a time, a weight's float copy let go as its own converted form exists (a
    tied lm_head's table stays the embedding's), and a weight is quantized a chunk of rows at a time: beyond
    what is converted, one linear's float weight and converted form, and a few MB, are held at once."""
    from services.worker.moe import convert_experts  # moe imports this module

    convert_experts(model, weight_quant)  # first: a shared expert that joins the experts' call leaves its linears behind
    if weight_quant == "int4-a8":  # a GGUF's blocks too
        for linear in linears_of(model):
            if linear.panels is not None:
                linear.round_activations_to_int8()
    linears = [linear for linear in linears_of(model) if linear.panels is None]
    if weight_quant == "auto":
        lossless = cpu_kernels()[0] is not None and all(
            (fmt := _int4_format(linear)) is not None and block_quant.round_trips(linear.weight_rows(), fmt) for linear in linears
        )
        weight_quant = "int4" if lossless else "fp16"
    if weight_quant in BLOCK_QUANTS:
        int8_activations = weight_quant == "int4-a8"
        for linear in linears:
            fmt = _int4_format(linear)
            if fmt is None:
                linear.pack_fp16()
            else:
                _quantize_to_panels(linear, fmt, int8_activations)
        return weight_quant, len(linears_of(model))
    convert = {"fp16": "pack_fp16", "int8": "quantize_int8"}[weight_quant]
    for linear in linears:
        getattr(linear, convert)()
    return weight_quant, len(linears_of(model))
