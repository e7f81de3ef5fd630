"""Decoder forward backends: how a step runs through a model's layers (token ids → final-normed hidden
states), chosen once at load, as the attention backends are, so the step itself checks nothing.

Each backend declares what it runs (``why_not``: None, or why not this model) and the runner takes the
first of ``DECODER_BACKENDS`` that runs its model:

- ``one-call-cpp``: every layer in one C++ call (``csrc/decoder_layers.cpp``, its weights held from load),
  without Python's per-layer glue: the fused forward's own kernel sequence, the same logits to the bit. It
  runs the shared decoder's attention layers (q/k norms or none, rotary over whole heads) with SwiGLU or
  sparse MoE MLPs (experts in blocks, resident or in an expert cache, no shared expert: Llama, Qwen3, Qwen3-MoE) on
  the CPU kernels with weights in blocks (int4, or a GGUF's), not sharded, at every row count. A cached MoE layer
  runs in the call when the bank holds every expert it routes to or its ``ExpertBank`` reads its misses (a store
  read by native AIO), and calls back into the cache (``run_cached``) to stream, to run more experts than the bank
  holds, or where Python fills; the layer-steps that ran in C++ are replayed into the cache's policy after the call. It rounds each projection's
  activations as the per-layer path does: to int16 in steps of up to ``BLOCK_QUANT_MAX_ROWS`` rows, beyond
  them to int8 where int4-a8 says so.
- ``fused``: layer by layer, each residual add folded into the RMSNorm after it, where the fusion kernels are on.
- ``layers``: layer by layer, unfused: the reference, and every model's fallback.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from services.worker.attention import AttentionMetadata, KVCache
from services.worker.cpu_kernels import cpu_kernels
from services.worker.gdn_state import SlotMetadata
from services.worker.linear import BLOCK_QUANT_MAX_ROWS
from services.worker.models.decoder import Attention, DecoderForCausalLM, DecoderLayer, DenseMLP
from services.worker.moe import SparseMoE


class DecoderBackend(Protocol):
    """A model's forward bound at load; ``one_call``: whether every step runs all layers in one C++ call."""

    name: str
    one_call: bool

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor: ...


class Layers:
    name, one_call = "layers", False

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
        fusions = model.fusions
        if model.attention_backend != "cpp" or None in (fusions.add_rms_norm, fusions.silu_and_mul, fusions.rotary, fusions.norm_heads):
            return "needs the C++ CPU kernels (attention and fusions)"
        if any(type(layer.attn) is not Attention for layer in model.layers) or model.rotary.head_dim != model.cfg.head_dim:
            return f"runs attention layers with rotary over whole heads only, not {model.cfg.family}'s"
        if sharded:
            return "runs unsharded weights only"
        for layer in model.layers:
            mlp = layer.mlp
            if isinstance(mlp, SparseMoE):
                if mlp.panels is None or mlp.shared_panels is not None:
                    return "runs MoE layers whose experts are in blocks, without a shared expert"
            elif not isinstance(mlp, DenseMLP):
                return f"runs SwiGLU and sparse MoE MLPs only, not {type(mlp).__name__}"
        if any(p.panels is None for p in _projections(model)):
            return "needs weights in blocks (int4 or a GGUF's)"
        return None

    def __init__(self, model: DecoderForCausalLM) -> None:
        self._model = model
        self.one_call = True
        layers = model.layers
        attn, mlp = [layer.attn for layer in layers], [layer.mlp for layer in layers]
        moe = [m for m in mlp if isinstance(m, SparseMoE)]
        self._cached = {i: m for i, m in enumerate(mlp) if isinstance(m, SparseMoE) and m.cache is not None}  # decoder layer -> its MoE
        self._cache = next(iter(self._cached.values())).cache if self._cached else None  # one per model
        self._layers = cpu_kernels()[0].DecoderLayers(
            norms=[weight for layer in layers for weight in (layer.input_norm.weight, layer.post_norm.weight)] + [model.norm.weight],
            qkv=[a.qkv.panels for a in attn], qkv_bias=[a.qkv.bias for a in attn], head_norms=[a.head_norms for a in attn],
            o_proj=[a.o_proj.panels for a in attn], o_bias=[a.o_proj.bias for a in attn],
            routers=[m.router if isinstance(m, SparseMoE) else None for m in mlp],
            gate_up=[m.panels.gate_up if isinstance(m, SparseMoE) else m.gate_up.panels for m in mlp],
            down=[m.panels.down if isinstance(m, SparseMoE) else m.down.panels for m in mlp],
            slot_maps=[m.cache.slot_of[m.cache_layer] if i in self._cached else None for i, m in enumerate(mlp)],
            many_row_bits=[_many_row_bits(layer) for layer in layers], few_rows=BLOCK_QUANT_MAX_ROWS,
            top_k=moe[0].top_k if moe else 1, renormalize=bool(moe and moe[0].renormalize),
            heads=model.num_heads, kv_heads=model.num_kv_heads, head_dim=model.head_dim, eps=model.cfg.eps,
            predictors=[m.predictor if i in self._cached else None for i, m in enumerate(mlp)],
            predicted_maps=[m.cache.slot_of[m.cache_layer + 1] if i in self._cached and m.predictor is not None else None for i, m in enumerate(mlp)],
            predicted_k=moe[0].read_ahead_k if moe else 0,
            cache_layers=[m.cache_layer if i in self._cached else -1 for i, m in enumerate(mlp)],
        )  # fmt: skip

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor:
        model = self._model
        cos, sin = model.rotary.lookup(positions, attn.max_position)
        args = (F.embedding(input_ids, model.embed), kv_cache.layers, cos, sin, attn.write_slots, attn.row_block_tables, attn.row_context_lens, attn.block_size)
        if (cache := self._cache) is None:
            return self._layers.forward(*args)
        rows = input_ids.shape[0]
        cache.begin_step(rows)
        bank = None if cache.streaming else (cache.gate_up, cache.down)  # a streamed step runs every cached layer in Python

        def cached_layer(layer: int, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
            cache.replay(cache.expert_bank.take_log(), rows)  # the policy must hear of the layers before this one first
            return self._cached[layer].run_cached(x, logits)

        try:
            return self._layers.forward(*args, bank=bank, cached_layer=cached_layer, read_ahead=cache.reads_ahead(rows), expert_bank=cache.expert_bank)
        finally:
            cache.replay(cache.expert_bank.take_log(), rows)


def _many_row_bits(layer: DecoderLayer) -> list[int]:
    """The activation bits of a layer's qkv, o_proj, gate_up and down in steps of more than ``BLOCK_QUANT_MAX_ROWS``
    rows, as its per-layer path rounds them (a MoE layer: its experts' at gate_up and down)."""
    mlp = layer.mlp
    mlp_bits = [8 if mlp.int8_activations else 16] * 2 if isinstance(mlp, SparseMoE) else [mlp.gate_up.activation_bits, mlp.down.activation_bits]
    return [layer.attn.qkv.activation_bits, layer.attn.o_proj.activation_bits, *mlp_bits]


def _projections(model: DecoderForCausalLM) -> list:
    """The attention projections and dense MLPs' weights of ``model``'s layers."""
    out = []
    for layer in model.layers:
        out += [layer.attn.qkv, layer.attn.o_proj]
        if isinstance(layer.mlp, DenseMLP):
            out += [layer.mlp.gate_up, layer.mlp.down]
    return out


DECODER_BACKENDS = {backend.name: backend for backend in (OneCallCpp, FusedLayers, Layers)}  # in order of preference


def select_decoder_backend(model: DecoderForCausalLM, sharded: bool) -> DecoderBackend:
    """The first backend that runs ``model`` in its final form (weights converted, and ``sharded`` under tensor parallelism)."""
    return next(backend(model) for backend in DECODER_BACKENDS.values() if backend.why_not(model, sharded) is None)
