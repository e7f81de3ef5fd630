"""Decoder forward backends: how a step runs through a model's layers (token ids → final-normed hidden
states), chosen once at load, as the attention backends are, so the step itself checks nothing.

Each backend declares what it runs (``why_not``: None, or why not this model) and the runner takes the
first of ``DECODER_BACKENDS`` that runs its model:

- ``one-call-cpp``: every layer in one C++ call (``csrc/dense_decoder.cpp``), without Python's per-layer
  glue: the fused forward's own kernel sequence, the same logits to the bit. It runs the shared dense
  decoder (no q/k norms, rotary over whole heads, SwiGLU MLPs) on the CPU kernels with int4 weights, not
  sharded. Its kernel rounds activations to int16 at every row count; under int4-a8, whose products round
  steps of more than ``BLOCK_QUANT_MAX_ROWS`` rows to int8, only few-row steps take it, the rest ``fused``.
- ``fused``: layer by layer, each residual add folded into the RMSNorm after it, where the fusion kernels are on.
- ``layers``: layer by layer, unfused: the reference, and every model's fallback.
"""

from __future__ import annotations

import sys
from typing import Protocol

import torch
import torch.nn.functional as F

from services.worker.attention import AttentionMetadata, KVCache
from services.worker.cpu_kernels import cpu_kernels
from services.worker.gdn_state import SlotMetadata
from services.worker.linear import BLOCK_QUANT_MAX_ROWS
from services.worker.models.decoder import DecoderForCausalLM


class DecoderBackend(Protocol):
    """A model's forward bound at load; ``one_call_rows``: the most rows of a step that runs all layers in one call (0: none)."""

    name: str
    one_call_rows: int

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor: ...


class Layers:
    name, one_call_rows = "layers", 0

    @staticmethod
    def why_not(model: DecoderForCausalLM, sharded: bool) -> str | None:
        return None

    def __init__(self, model: DecoderForCausalLM) -> None:
        self._forward = model.forward

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor:
        return self._forward(input_ids, positions, attn, kv_cache, slots)


class FusedLayers(Layers):
    name = "fused"

    @staticmethod
    def why_not(model: DecoderForCausalLM, sharded: bool) -> str | None:
        return None if model.fusions.add_rms_norm is not None else "no residual-add + RMSNorm fusion here"

    def __init__(self, model: DecoderForCausalLM) -> None:
        self._forward = model.forward_fused


class OneCallCpp:
    name = "one-call-cpp"

    @staticmethod
    def why_not(model: DecoderForCausalLM, sharded: bool) -> str | None:
        # On the CPU the only fusions are the C++ ones, and the cpp attention backend means the CPU.
        if model.attention_backend != "cpp" or None in (model.fusions.add_rms_norm, model.fusions.silu_and_mul, model.fusions.rotary):
            return "needs the C++ CPU kernels (attention and fusions)"
        if not model.DENSE_LAYERS or model.QK_NORM or model.rotary.head_dim != model.cfg.head_dim:
            return f"runs the dense decoder's layers only (no q/k norms, full rotary, SwiGLU MLPs), not {model.cfg.family}'s"
        if sharded:
            return "runs unsharded weights only"
        if any(p.panels is None for p in _projections(model)):
            return "needs int4 weights"
        return None

    def __init__(self, model: DecoderForCausalLM) -> None:
        self._model, self._larger = model, FusedLayers(model)
        self.one_call_rows = sys.maxsize if all(p.activation_bits == 16 for p in _projections(model)) else BLOCK_QUANT_MAX_ROWS
        layers = model.layers
        attn, mlp = [layer.attn for layer in layers], [layer.mlp for layer in layers]
        norms = [weight for layer in layers for weight in (layer.input_norm.weight, layer.post_norm.weight)] + [model.norm.weight]
        self._weights = (  # in the kernel's argument order: norms, qkv, qkv bias, o_proj, o bias, gate_up, down
            norms, [a.qkv.panels for a in attn], [a.qkv.bias for a in attn], [a.o_proj.panels for a in attn], [a.o_proj.bias for a in attn],
            [m.gate_up.panels for m in mlp], [m.down.panels for m in mlp],
        )  # fmt: skip

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor:
        if input_ids.shape[0] > self.one_call_rows:
            return self._larger(input_ids, positions, attn, kv_cache, slots)
        model = self._model
        cos, sin = model.rotary.lookup(positions, attn.max_position)
        return cpu_kernels()[0].dense_decoder_layers(
            F.embedding(input_ids, model.embed), *self._weights, kv_cache.layers, cos, sin, attn.write_slots,
            attn.row_block_tables, attn.row_context_lens, model.num_heads, model.num_kv_heads, model.head_dim, attn.block_size, model.cfg.eps,
        )  # fmt: skip


def _projections(model: DecoderForCausalLM) -> list:
    return [p for layer in model.layers for p in (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)]


DECODER_BACKENDS = {backend.name: backend for backend in (OneCallCpp, FusedLayers, Layers)}  # in order of preference


def select_decoder_backend(model: DecoderForCausalLM, sharded: bool) -> DecoderBackend:
    """The first backend that runs ``model`` in its final form (weights converted, and ``sharded`` under tensor parallelism)."""
    return next(backend(model) for backend in DECODER_BACKENDS.values() if backend.why_not(model, sharded) is None)
