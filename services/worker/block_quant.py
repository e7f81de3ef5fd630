"""Block-quantized weights in llama.cpp's q4_0, q4_1 and q8_0 layouts: the codec, its exactness check,
and ``BlockQuantized``, a weight (or a stack of experts' weights) that travels in its blocks.

A weight [out, in] is cut along ``in`` into blocks of 32 features, each with fp16 scales (llama.cpp's
formats, laid out row by row with the codes first and the scales after them):

- ``q4_0``: 4-bit codes (block b's byte j: feature 32b + j in the low nibble, 32b + j + 16 in the high
  one), then one scale ``d`` per block; ``w = d * (q - 8)``. 18 bytes per 32 weights.
- ``q4_1``: 4-bit codes (block b's byte j: feature 32b + j in the low nibble, 32b + j + 16 in the high
  one), then one scale ``d`` and one minimum ``m`` per block; ``w = d * q + m``. 20 bytes per 32 weights.
- ``q8_0``: signed byte codes, then one scale ``d`` per block; ``w = d * q``. 34 bytes per 32 weights.

A model converted from a GGUF in these formats (the default model: q4_1 projections, a q8_0
embedding) round-trips exactly, so serving it in them loses nothing; ``is_exact`` tells.

``to_panels`` regroups the rows into panels of 8 output channels, what ``csrc/block_quant_gemm.cpp``
and ``csrc/grouped_moe.cpp`` multiply: per panel and block one record, the codes of all 8 channels (4
features of each per 32 bytes), then their 8 scales (and for q4_1 their 8 minimums). A panel is one
sequential stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
CODE_BYTES = {"q4_0": 16, "q4_1": 16, "q8_0": 32}  # per block, before the row's scales
PANEL = 8  # output channels per panel
PANEL_BLOCK_BYTES = {"q4_0": 144, "q4_1": 160, "q8_0": 272}  # one panel's record per block: 8 channels' codes, scales (and minimums)
CHUNK_BYTES = 1 << 20  # float32 bytes of a matrix quantized (or checked, or regrouped) at a time


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"block quantization needs in_features divisible by {BLOCK}, got {in_features}")
    return weight.float().reshape(out_features, in_features // BLOCK, BLOCK)


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """fp16 values [..., 1] as their two little-endian bytes [..., 2]."""
    return values.half().contiguous().view(torch.uint8)


def _safe_divisor(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def _check_format(fmt: str) -> None:
    if fmt not in BLOCK_BYTES:
        raise ValueError(f"unknown block format {fmt!r} (supported: {', '.join(BLOCK_BYTES)})")


def _chunk_rows(in_features: int, rows_per_chunk: int | None, multiple: int = 1) -> int:
    """How many rows of a matrix are taken at a time: ``rows_per_chunk`` (rounded up to a multiple of ``multiple``),
    by default as many as ``CHUNK_BYTES`` of float32 hold, so that every temporary is a few times that."""
    rows = rows_per_chunk or CHUNK_BYTES // (4 * max(in_features, 1))
    return max(multiple, -(-rows // multiple) * multiple)


def _quantize_rows(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    blocks = _blocks(weight)
    rows = weight.shape[0]
    if fmt == "q4_0":  # llama.cpp's choice: the value of largest magnitude is code 0, so d carries its sign
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        d = (extreme / -8).half().float()
        codes = torch.round(blocks / _safe_divisor(d) + 8).clamp_(0, 15).to(torch.uint8)
        parts = [codes[..., :16] | (codes[..., 16:] << 4), _half_bytes(d)]
    elif fmt == "q4_1":
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        d, m = ((high - low) / 15).half().float(), low.half().float()
        codes = torch.round((blocks - m) / _safe_divisor(d)).clamp_(0, 15).to(torch.uint8)
        nibbles = codes[..., :16] | (codes[..., 16:] << 4)
        parts = [nibbles, _half_bytes(d), _half_bytes(m)]
    elif fmt == "q8_0":
        d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
        codes = torch.round(blocks / _safe_divisor(d)).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
        parts = [codes, _half_bytes(d)]
    return torch.cat([part.reshape(rows, -1) for part in parts], dim=1)


def quantize(weight: torch.Tensor, fmt: str, rows_per_chunk: int | None = None) -> torch.Tensor:
    """``weight`` [out, in] (any strides) → uint8 [out, in / 32 * BLOCK_BYTES[fmt]] (scales rounded to fp16
    first, so the codes are chosen against the scales that will be stored), taken ``rows_per_chunk`` rows
    at a time (rows are independent: the result does not depend on it)."""
    _check_format(fmt)
    rows, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"block quantization needs in_features divisible by {BLOCK}, got {in_features}")
    packed = torch.empty(rows, in_features // BLOCK * BLOCK_BYTES[fmt], dtype=torch.uint8, device=weight.device)
    step = _chunk_rows(in_features, rows_per_chunk)
    for start in range(0, rows, step):
        packed[start : start + step] = _quantize_rows(weight[start : start + step], fmt)
    return packed


def quantize_panels(weight: torch.Tensor, fmt: str, rows_per_chunk: int | None = None) -> torch.Tensor:
    """``to_panels(quantize(weight, fmt), fmt)``, a chunk of rows at a time: no whole matrix of rows in blocks
    is made, only the panels."""
    _check_format(fmt)
    rows, in_features = weight.shape
    step = _chunk_rows(in_features, rows_per_chunk, PANEL)
    panels = torch.empty(-(-rows // PANEL), in_features // BLOCK, PANEL_BLOCK_BYTES[fmt], dtype=torch.uint8, device=weight.device)
    for start in range(0, rows, step):
        panels[start // PANEL : (start + step) // PANEL] = _rows_to_panels(quantize(weight[start : start + step], fmt, step), fmt)
    return panels


def dequantize(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """The float32 weight [out, in] that ``packed`` stands for (the kernels' reference)."""
    _check_format(fmt)
    rows, blocks = packed.shape[0], packed.shape[1] // BLOCK_BYTES[fmt]
    code_bytes = blocks * CODE_BYTES[fmt]
    scales = packed[:, code_bytes:].contiguous().view(torch.float16).float().reshape(rows, -1, blocks)
    d = scales[:, 0, :, None]
    if fmt in ("q4_0", "q4_1"):
        nibbles = packed[:, :code_bytes].reshape(rows, blocks, 16)
        codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
        restored = (codes - 8) * d if fmt == "q4_0" else codes * d + scales[:, 1, :, None]
        return restored.reshape(rows, -1)
    codes = packed[:, :code_bytes].contiguous().view(torch.int8).float().reshape(rows, blocks, BLOCK)
    return (codes * d).reshape(rows, -1)


def _tolerance(weight: torch.Tensor) -> torch.Tensor:
    return 1e-6 * torch.maximum(weight.amax(), -weight.amin()).float().clamp_min(1e-30)  # of the largest magnitude, no copy of ``weight``


def is_exact(weight: torch.Tensor, packed: torch.Tensor, fmt: str) -> bool:
    """``packed`` reproduces ``weight`` to within fp32 rounding of ``d * q + m`` (a checkpoint that was
    converted from this format: quantizing it again loses nothing). Compared a chunk of rows at a time."""
    tolerance, step = _tolerance(weight), _chunk_rows(weight.shape[1], None)
    return all(
        bool((dequantize(packed[start : start + step], fmt) - weight[start : start + step].float()).abs().amax() <= tolerance)
        for start in range(0, weight.shape[0], step)
    )


def round_trips(weight: torch.Tensor, fmt: str) -> bool:
    """``is_exact(weight, quantize(weight, fmt), fmt)``, quantized a chunk of rows at a time and stopping at the
    first chunk that does not round-trip: no whole matrix of blocks is made."""
    tolerance, step = _tolerance(weight), _chunk_rows(weight.shape[1], None)
    for start in range(0, weight.shape[0], step):
        rows = weight[start : start + step]
        if not bool((dequantize(quantize(rows, fmt, step), fmt) - rows.float()).abs().amax() <= tolerance):
            return False
    return True


def _rows_to_panels(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    rows, width = packed.shape
    blocks = width // BLOCK_BYTES[fmt]
    if rows % PANEL:
        packed = torch.cat([packed, packed.new_zeros(PANEL - rows % PANEL, width)])
    panels = packed.shape[0] // PANEL

    def halves(part: torch.Tensor) -> torch.Tensor:  # [out, blocks * 2] fp16 bytes → [panels, blocks, 8 * 2]
        return part.reshape(panels, PANEL, blocks, 2).permute(0, 2, 1, 3).reshape(panels, blocks, 2 * PANEL)

    if fmt in ("q4_0", "q4_1"):
        codes = packed[:, : blocks * 16].reshape(panels, PANEL, blocks, 4, 4).permute(0, 2, 3, 1, 4).reshape(panels, blocks, 128)
        parts = [codes, halves(packed[:, blocks * 16 : blocks * 18])] + ([halves(packed[:, blocks * 18 :])] if fmt == "q4_1" else [])
    else:
        groups = packed[:, : blocks * 32].reshape(panels, PANEL, blocks, 8, 4)[..., [0, 2, 1, 3]]
        parts = [groups.permute(0, 2, 3, 1, 4).reshape(panels, blocks, 256), halves(packed[:, blocks * 32 :])]
    return torch.cat(parts, dim=2)


def to_panels(packed: torch.Tensor, fmt: str = "q4_1") -> torch.Tensor:
    """Rows [out, in / 32 * BLOCK_BYTES[fmt]] → uint8 [ceil(out / 8), in / 32, PANEL_BLOCK_BYTES[fmt]].
    Per panel and block, 32 bytes per group j of 4 features: byte 4c + i belongs to channel c.

    - q4_0, q4_1: the row layout's byte 4j + i of channel c (features 4j + i and 16 + 4j + i), j < 4;
    - q8_0: channel c's features 4j, 4j + 2, 4j + 1, 4j + 3 (i = 0..3), j < 8, so a 16-bit lane's low
      bytes and high bytes are each a pair of adjacent features;

    then the channels' fp16 scales (and q4_1's minimums). Channels past ``out`` are zero (they add nothing).
    Regrouped a chunk of panels at a time."""
    _check_format(fmt)
    rows, width = packed.shape
    step = max(PANEL, CHUNK_BYTES // max(width, 1) // PANEL * PANEL)
    panels = torch.empty(-(-rows // PANEL), width // BLOCK_BYTES[fmt], PANEL_BLOCK_BYTES[fmt], dtype=torch.uint8, device=packed.device)
    for start in range(0, rows, step):
        panels[start // PANEL : (start + step) // PANEL] = _rows_to_panels(packed[start : start + step], fmt)
    return panels


@dataclass(frozen=True)
class BlockQuantized:
    """A weight [..., rows, in_features] held in ``fmt``'s blocks, each row in the row codec's layout above:
    ``data`` is uint8 [..., rows, in_features / 32 * BLOCK_BYTES[fmt]] (one matrix [rows, bytes], or a
    stack of experts' matrices [experts, rows, bytes]). A loader's pre-quantized tensor (a GGUF's Q4_0,
    Q4_1 or Q8_0 blocks, as they are stored) reaches the layers as this."""

    fmt: str
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        _check_format(self.fmt)
        if self.in_features <= 0 or self.in_features % BLOCK:
            raise ValueError(f"block quantization needs in_features divisible by {BLOCK}, got {self.in_features}")
        width = self.in_features // BLOCK * BLOCK_BYTES[self.fmt]
        if self.data.dtype != torch.uint8 or self.data.dim() < 2 or self.data.shape[-1] != width:
            raise ValueError(
                f"{self.fmt} data of {self.in_features} features must be uint8 [..., rows, {width}], got {self.data.dtype} {list(self.data.shape)}"
            )

    @classmethod
    def of(cls, weight: torch.Tensor, fmt: str) -> BlockQuantized:
        """``weight`` [..., rows, in] quantized to ``fmt``."""
        *lead, rows, in_features = weight.shape
        data = quantize(weight.reshape(-1, in_features), fmt)
        return cls(fmt, data.reshape(*lead, rows, -1), in_features)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the weight it stands for: [..., rows, in_features]."""
        return (*self.data.shape[:-1], self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [..., rows, in_features]."""
        return dequantize(self.data.reshape(-1, self.data.shape[-1]), self.fmt).reshape(self.shape)

    def panels(self) -> torch.Tensor:
        """The kernels' panels: [..., ceil(rows / 8), in / 32, PANEL_BLOCK_BYTES[fmt]]."""
        *lead, rows, width = self.data.shape
        if not lead:
            return to_panels(self.data.contiguous(), self.fmt)
        stacked = [to_panels(matrix.contiguous(), self.fmt) for matrix in self.data.reshape(-1, rows, width)]
        return torch.stack(stacked).reshape(*lead, *stacked[0].shape)
