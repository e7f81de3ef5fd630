"""Weight matrix products for the CPU that keep every core busy when a step has only a few rows.

MKL runs a GEMM of one to a few rows on one core, bound by how fast that core streams the
weight from memory. For such steps the weight is cut into one slice per thread and the slices
run as one batched GEMM (``bmm`` gives each core its own slice); many-row steps take plain GEMM.

A deployment may also store the weights as int8 (``--weight-quant int8``): symmetric, one scale
per output channel, activations kept in their own dtype (aten's ``_weight_int8pack_mm``). On the
default model it costs +0.1 % perplexity (``bench/quantization.py``). Measured on an AVX2-only
CPU, that kernel is slower than the fp32 GEMM (0.4x at one row), so it stays off by default;
fbgemm's dynamic int8 GEMM was 1.5-3.5x faster there but its per-tensor activation quantization
tripled the perplexity (98.5 vs 32.7), so it is not offered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SPLIT_MAX_ROWS = 8  # measured: the split wins up to 8 rows, plain GEMM beyond


def _slices(size: int, threads: int) -> int:
    return next(s for s in range(max(threads, 1), 0, -1) if size % s == 0)


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] as int8 values in -127..127 and one scale per output row: ``weight ≈ q * scale[:, None]``."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(weight.dtype)


class Linear:
    """``x @ weight.T (+ bias) (+ residual)``.

    fp32: stored transposed ([in, out]) and, for steps of few rows, split along ``in`` (the
    slices' partial products are summed). bf16/fp16: kept as [out, in] for oneDNN, whose
    AMX/AVX-512 kernels are fast at every row count, while its bf16 ``bmm`` is not. int8:
    [out, in] values and per-row scales for ``_weight_int8pack_mm``.
    """

    def __init__(self, weight: torch.Tensor, threads: int, bias: torch.Tensor | None = None) -> None:
        out_features, in_features = weight.shape
        self.bias = bias
        self.scales: torch.Tensor | None = None
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

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if self.scales is not None:
            out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
            if self.bias is not None:
                out.add_(self.bias)
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

    def __init__(self, weight: torch.Tensor, threads: int) -> None:
        out_features, in_features = weight.shape
        self.weight = weight
        self.scales: torch.Tensor | None = None
        self.slices = _slices(out_features, threads) if weight.dtype == torch.float32 else 1
        self._sliced_t = weight.view(self.slices, out_features // self.slices, in_features).transpose(1, 2)

    def quantize_int8(self) -> None:
        """An int8 copy for the products; a tied embedding table keeps its float original for lookups."""
        if self.scales is None:
            self.weight, self.scales = int8_per_channel(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.scales is not None:
            return torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        if rows > SPLIT_MAX_ROWS or self.slices == 1:
            return F.linear(x, self.weight)
        out = torch.bmm(x.expand(self.slices, *x.shape), self._sliced_t)  # [slices, rows, out / slices]
        return out.transpose(0, 1).reshape(rows, -1)


def quantize_int8(model: object) -> int:
    """Every ``Linear`` and ``RowSplitLinear`` reachable from ``model``'s attributes (lists and tuples
    included) switches to int8 weights; returns how many. Expert weights (grouped GEMMs) stay as they are."""
    seen: set[int] = set()
    count = 0

    def visit(obj: object) -> None:
        nonlocal count
        if id(obj) in seen or isinstance(obj, torch.Tensor | str | int | float | bool | type(None)):
            return
        seen.add(id(obj))
        if isinstance(obj, Linear | RowSplitLinear):
            obj.quantize_int8()
            count += 1
        elif isinstance(obj, list | tuple):
            for item in obj:
                visit(item)
        elif hasattr(obj, "__dict__"):
            for value in vars(obj).values():
                visit(value)

    visit(model)
    return count
