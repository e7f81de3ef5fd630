"""The decoder every dense and MoE family shares: embed → layers of (attention, MLP) → norm → lm_head.

Attention fuses q/k/v into one weight (with the optional bias, and Qwen3's per-head q/k RMSNorm
applied in place before rotary); the SwiGLU MLP fuses gate/up; the residual add rides on the output
projections. A family subclasses ``DecoderForCausalLM`` and says only what differs: ``QK_NORM``, how a
layer's MLP is built, and (Qwen3-Next) zero-centred norms, partial rotary and its own layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F

from services.worker.attention import ATTENTION_BACKENDS, AttentionFn, AttentionMetadata, KVCache, paged_attention, select_attention_backend
from services.worker.block_quant import BlockQuantized
from services.worker.fusions import select_fusion_kernels
from services.worker.gdn_state import GDNShape, SlotMetadata
from services.worker.linear import Linear, RowSplitLinear, cat_rows
from services.worker.rmsnorm import RMSNorm
from services.worker.rotary import RotaryEmbedding, apply_rotary_, rope_config

Weights = dict[str, torch.Tensor | BlockQuantized]  # a projection may come in its blocks (a GGUF's); other tensors are float
RotateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]  # apply_rotary_ or its fusion: (q/k heads, cos, sin), in place
NormHeadsFn = Callable[[torch.Tensor, torch.Tensor, float], None]  # the q/k norms' fusion: (q/k heads, weight [heads, dim], eps), in place


@dataclass(frozen=True)
class DecoderConfig:
    """The config.json fields the shared decoder reads, with transformers' defaults."""

    family: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_positions: int
    threads: int

    @classmethod
    def read(cls, config: dict) -> DecoderConfig:
        family = config.get("model_type", "llama")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{family} hidden_act {config['hidden_act']!r} is not supported (only silu)")
        if config.get("use_sliding_window") or "sliding_attention" in (config.get("layer_types") or []):
            raise ValueError(f"{family} checkpoints with sliding-window attention are not supported")
        heads = config["num_attention_heads"]
        return cls(
            family=family,
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            num_layers=config["num_hidden_layers"],
            vocab_size=config["vocab_size"],
            eps=config.get("rms_norm_eps", 1e-6),
            attention_bias=bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            max_positions=config.get("max_position_embeddings", 2048),
            threads=torch.get_num_threads(),
        )


class Attention:
    """Input-normed hidden states → ``residual + o_proj(attention)`` over the paged KV cache."""

    def __init__(
        self,
        w: Weights,
        prefix: str,
        cfg: DecoderConfig,
        qk_norm: bool,
        attend: AttentionFn = paged_attention,
        rotate: RotateFn = apply_rotary_,
        norm_heads: NormHeadsFn | None = None,
    ) -> None:
        p = prefix + "self_attn."
        self.attend, self.rotate = attend, rotate
        self.heads, self.kv_heads, self.dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_bias = torch.cat([w[f"{p}{x}_proj.bias"] for x in "qkv"]) if cfg.attention_bias else None
        self.qkv = Linear(cat_rows([w[f"{p}{x}_proj.weight"] for x in "qkv"]), cfg.threads, qkv_bias)  # hidden -> (heads + 2 kv_heads) * dim
        self.o_proj = Linear(w[p + "o_proj.weight"], cfg.threads, w[p + "o_proj.bias"] if cfg.attention_bias else None)
        self.head_norms: torch.Tensor | None = None  # [heads + kv_heads, dim]: row j is head j's own q_norm or k_norm
        self.norm_qk: Callable[[torch.Tensor], None] | None = None  # q and k heads normed in place, in one call
        self._norm_weights = []
        if qk_norm:
            q_norm, k_norm = w[p + "q_norm.weight"], w[p + "k_norm.weight"]
            self.head_norms = torch.cat([q_norm.expand(self.heads, -1), k_norm.expand(self.kv_heads, -1)])
            self.norm_qk = RMSNorm(self.head_norms, cfg.eps).norm_ if norm_heads is None else functools.partial(norm_heads, weight=self.head_norms, eps=cfg.eps)
            self._norm_weights = [q_norm, k_norm]

    def tensors(self) -> list[torch.Tensor]:
        parts = [self.qkv.weight, self.qkv.bias, self.o_proj.weight, self.o_proj.bias, *self._norm_weights]
        return [t for t in parts if t is not None]

    def __call__(
        self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor
    ) -> torch.Tensor:
        total, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.dim
        qkv = self.qkv(x).view(total, heads + 2 * kv_heads, dim)
        qk = qkv[:, : heads + kv_heads]
        if self.norm_qk is not None:
            self.norm_qk(qk)
        self.rotate(qk, cos, sin)
        out = self.attend(qkv[:, :heads], qkv[:, heads:].view(total, 2, kv_heads, dim), cache, meta)
        return self.o_proj(out, residual=residual)


class MLP(Protocol):
    """A layer's feed-forward block: post-attention-normed ``x`` → ``residual + mlp(x)``."""

    def __call__(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]: ...


class DenseMLP:
    """SwiGLU ``down(silu(gate(x)) * up(x))``, gate and up fused into one weight; ``prefix`` names the
    MLP's own module (``model.layers.3.mlp.``, or a shared expert's ``...mlp.shared_expert.``)."""

    def __init__(self, w: Weights, prefix: str, threads: int) -> None:
        p = prefix
        self.intermediate = w[p + "gate_proj.weight"].shape[0]
        self.gate_up = Linear(cat_rows([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]]), threads)
        self.down = Linear(w[p + "down_proj.weight"], threads)

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate_up.weight, self.down.weight]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        gate_up = self.gate_up(x)
        gate = F.silu(gate_up[:, : self.intermediate], inplace=True)
        return self.down(gate.mul_(gate_up[:, self.intermediate :]), residual=residual)


class FusedDenseMLP(DenseMLP):
    """``DenseMLP`` with ``silu(gate) · up`` as one kernel (where ``select_fusion_kernels`` found one)."""

    def __init__(self, w: Weights, prefix: str, threads: int, silu_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(w, prefix, threads)
        self.silu_and_mul = silu_and_mul

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.down(self.silu_and_mul(self.gate_up(x)), residual=residual)


class DecoderLayer(NamedTuple):
    input_norm: RMSNorm
    attn: Attention
    post_norm: RMSNorm
    mlp: MLP


class DecoderForCausalLM:
    """Implements ``CausalLM`` for the Llama-shaped decoders; subclasses override ``QK_NORM`` and ``mlp``."""

    QK_NORM = False  # Qwen3: RMSNorm over each q and k head before rotary
    DENSE_LAYERS = True  # every layer is ``Attention`` and a SwiGLU MLP (MoE families: False)
    ZERO_CENTRED_NORMS = False  # Qwen3-Next: every RMSNorm weight is stored as w - 1 (scales by 1 + w)
    gdn_shape: GDNShape | None = None  # hybrid families: the GDN state each request's slot holds

    def __init__(self, config: dict, weights: Weights) -> None:
        cfg = self.cfg = DecoderConfig.read(config)
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.num_kv_layers = self.num_layers
        self.vocab_size = cfg.vocab_size
        self.embed = weights["model.embed_tokens.weight"]
        self.dtype = self.embed.dtype
        theta, scaling = rope_config(config)
        self.rotary = RotaryEmbedding(self.rotary_dim(config), theta, scaling, cfg.max_positions, self.dtype, self.embed.device)
        self.attention_backend = select_attention_backend(self.embed.device, self.dtype)
        self.fusions = select_fusion_kernels(self.embed.device, self.dtype)
        self.rotate: RotateFn = self.fusions.rotary or apply_rotary_
        self.layers = [self._layer(weights, i) for i in range(cfg.num_layers)]
        self.norm = self.rms_norm(weights["model.norm.weight"])
        if cfg.tie_word_embeddings:
            self.lm_head = RowSplitLinear(self.embed, cfg.threads)
        elif "lm_head.weight" in weights:
            self.lm_head = RowSplitLinear(weights["lm_head.weight"], cfg.threads)
        else:
            raise ValueError("the checkpoint has no lm_head.weight and tie_word_embeddings is false")

    def rotary_dim(self, config: dict) -> int:
        """Leading dims of each q/k head that rotary rotates: all of them unless a family says otherwise."""
        return self.cfg.head_dim

    def rms_norm(self, weight: torch.Tensor) -> RMSNorm:
        return RMSNorm(1 + weight if self.ZERO_CENTRED_NORMS else weight, self.cfg.eps)

    def _layer(self, w: Weights, index: int) -> DecoderLayer:
        p = f"model.layers.{index}."
        return DecoderLayer(
            input_norm=self.rms_norm(w[p + "input_layernorm.weight"]),
            attn=Attention(w, p, self.cfg, self.QK_NORM, ATTENTION_BACKENDS[self.attention_backend], self.rotate, self.fusions.norm_heads),
            post_norm=self.rms_norm(w[p + "post_attention_layernorm.weight"]),
            mlp=self.mlp(w, p, index),
        )

    def mlp(self, w: Weights, prefix: str, index: int) -> MLP:
        """The feed-forward block of layer ``index`` (weights under ``prefix``): dense SwiGLU by default."""
        return self.dense_mlp(w, prefix + "mlp.")

    def dense_mlp(self, w: Weights, prefix: str) -> DenseMLP:
        """A SwiGLU MLP under ``prefix``, its activation one kernel where the fusion is on."""
        if self.fusions.silu_and_mul is None:
            return DenseMLP(w, prefix, self.cfg.threads)
        return FusedDenseMLP(w, prefix, self.cfg.threads, self.fusions.silu_and_mul)

    def describe(self) -> dict[str, Any]:
        """Family-specific facts for the instrumentation endpoint (e.g. the kernel backends chosen at load)."""
        return {}

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct parameter tensor (a tied lm_head counted once)."""
        tensors = [self.embed, self.norm.weight, self.lm_head.weight]
        for layer in self.layers:
            tensors += [layer.input_norm.weight, layer.post_norm.weight, *layer.attn.tensors(), *layer.mlp.tensors()]
        return list({id(t): t for t in tensors}.values())

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flat batch of T tokens from many requests (``slots``: hybrid families only)."""
        cos, sin = self.rotary.lookup(positions, attn.max_position)
        h = F.embedding(input_ids, self.embed)
        for layer, cache in zip(self.layers, kv_cache.layers):
            h = layer.attn(layer.input_norm(h), h, cos, sin, attn, cache)
            h = layer.mlp(layer.post_norm(h), h)
        return self.norm(h)

    def _mix(
        self, index: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None
    ) -> torch.Tensor:
        """Layer ``index``'s token mixer on normed ``x``, without the residual (``forward_fused``'s step)."""
        return self.layers[index].attn(x, None, cos, sin, attn, kv_cache.layers[index])

    def forward_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor:
        """``forward`` with each residual add folded into the RMSNorm after it (``add_rms_norm``): only where the fusions are on."""
        add_norm, eps = self.fusions.add_rms_norm, self.cfg.eps
        cos, sin = self.rotary.lookup(positions, attn.max_position)
        x, residual = add_norm(F.embedding(input_ids, self.embed), None, self.layers[0].input_norm.weight, eps)
        next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, next_norms)):
            x, residual = add_norm(self._mix(i, x, cos, sin, attn, kv_cache, slots), residual, layer.post_norm.weight, eps)
            x, residual = add_norm(layer.mlp(x, None), residual, next_norm.weight, eps)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
