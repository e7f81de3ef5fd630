"""The Llama decoder (RMSNorm, rotary, GQA attention over paged KV, SwiGLU MLP), eager torch.

q/k/v and gate/up are fused into one weight each at load time and the residual add rides on the
output projections: a decode layer is about thirty small kernels plus views.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.worker.attention import AttentionMetadata, KVCache, paged_attention
from services.worker.linear import Linear, RowSplitLinear
from services.worker.rmsnorm import RMSNorm
from services.worker.rotary import RotaryEmbedding, apply_rotary_, rope_config


class _Layer(NamedTuple):
    input_norm: RMSNorm
    qkv: Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o_proj: Linear
    post_norm: RMSNorm
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear


class LlamaForCausalLM:
    def __init__(self, config: dict, weights: dict[str, torch.Tensor]) -> None:
        for flag in ("attention_bias", "mlp_bias"):
            if config.get(flag):
                raise ValueError(f"llama checkpoints with {flag}=true are not supported")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"llama hidden_act {config['hidden_act']!r} is not supported (only silu)")
        self.hidden_size = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or self.hidden_size // self.num_heads
        self.num_layers = config["num_hidden_layers"]
        self.intermediate_size = config["intermediate_size"]
        self.vocab_size = config["vocab_size"]
        self.embed = weights["model.embed_tokens.weight"]
        self.dtype = self.embed.dtype
        theta, scaling = rope_config(config)
        self.rotary = RotaryEmbedding(self.head_dim, theta, scaling, config.get("max_position_embeddings", 2048), self.dtype)
        threads = torch.get_num_threads()
        eps = config.get("rms_norm_eps", 1e-6)
        self.layers = [self._load_layer(weights, f"model.layers.{i}.", eps, threads) for i in range(self.num_layers)]
        self.norm = RMSNorm(weights["model.norm.weight"], eps)
        if config.get("tie_word_embeddings", False):
            self.lm_head = RowSplitLinear(self.embed, threads)
        elif "lm_head.weight" in weights:
            self.lm_head = RowSplitLinear(weights["lm_head.weight"], threads)
        else:
            raise ValueError("the checkpoint has no lm_head.weight and tie_word_embeddings is false")

    @staticmethod
    def _load_layer(w: dict[str, torch.Tensor], p: str, eps: float, threads: int) -> _Layer:
        attn, mlp = p + "self_attn.", p + "mlp."
        return _Layer(
            input_norm=RMSNorm(w[p + "input_layernorm.weight"], eps),
            qkv=Linear(torch.cat([w[f"{attn}{x}_proj.weight"] for x in "qkv"]), threads),
            o_proj=Linear(w[attn + "o_proj.weight"], threads),
            post_norm=RMSNorm(w[p + "post_attention_layernorm.weight"], eps),
            gate_up=Linear(torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]]), threads),
            down=Linear(w[mlp + "down_proj.weight"], threads),
        )

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct parameter tensor (a tied lm_head counted once)."""
        tensors = [t.weight for layer in self.layers for t in layer] + [self.embed, self.norm.weight, self.lm_head.weight]
        return list({id(t): t for t in tensors}.values())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of a flat batch of T tokens from many requests."""
        total, heads, kv_heads, dim = input_ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        inter = self.intermediate_size
        cos, sin = self.rotary.lookup(positions, attn.max_position)
        h = F.embedding(input_ids, self.embed)
        for layer, cache in zip(self.layers, kv_cache.layers):
            x = layer.input_norm(h)
            qkv = layer.qkv(x).view(total, heads + 2 * kv_heads, dim)
            apply_rotary_(qkv[:, : heads + kv_heads], cos, sin)
            out = paged_attention(qkv[:, :heads], qkv[:, heads:].view(total, 2, kv_heads, dim), cache, attn)
            h = layer.o_proj(out, residual=h)
            gate_up = layer.gate_up(layer.post_norm(h))
            gate = F.silu(gate_up[:, :inter], inplace=True)
            h = layer.down(gate.mul_(gate_up[:, inter:]), residual=h)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
