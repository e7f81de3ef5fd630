"""The Qwen3 Mixture-of-Experts decoder: Qwen3's attention, and a sparse MoE MLP in the layers that
``decoder_sparse_step`` selects and ``mlp_only_layers`` does not exclude (a dense SwiGLU elsewhere).

The MoE kernel backend (grouped torch GEMMs, or fused Triton on CUDA) is chosen once at load; experts
in blocks (a GGUF's, or ``--weight-quant``'s) run as one grouped C++ call per layer on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from services.worker.models.decoder import MLP, DecoderForCausalLM
from services.worker.moe import SparseMoE, describe_experts, routed_experts, select_moe_backend


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    QK_NORM = True
    DENSE_LAYERS = False
    NORM_TOPK_PROB = False  # transformers' default when config.json omits norm_topk_prob

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]) -> None:
        # transformers writes num_experts as num_local_experts (an attribute_map alias); published configs say num_experts.
        self.num_experts = config.get("num_experts", config.get("num_local_experts", 0))
        self.top_k = config["num_experts_per_tok"]
        self.renormalize = bool(config.get("norm_topk_prob", self.NORM_TOPK_PROB))
        self.sparse_step = config.get("decoder_sparse_step", 1)
        self.mlp_only_layers = set(config.get("mlp_only_layers") or [])
        self.moe_backend = select_moe_backend(weights["model.embed_tokens.weight"].device)
        super().__init__(config, weights)

    def is_sparse(self, index: int) -> bool:
        return index not in self.mlp_only_layers and self.num_experts > 0 and (index + 1) % self.sparse_step == 0

    def mlp(self, w: dict[str, torch.Tensor], prefix: str, index: int) -> MLP:
        if not self.is_sparse(index):
            return super().mlp(w, prefix, index)
        moe = SparseMoE.load(w, prefix + "mlp.", self.top_k, self.renormalize, self.moe_backend)
        if moe.router.shape[0] != self.num_experts:
            raise ValueError(f"layer {index} has {moe.router.shape[0]} experts but the config says num_experts={self.num_experts}")
        return moe

    def describe(self) -> dict[str, Any]:
        return {
            "moe_backend": "/".join(sorted({moe.backend for moe in routed_experts(self)})) or self.moe_backend,
            "expert_weights": describe_experts(self),  # "<format>: <kernel>" -> how many layers
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_layers": sum(map(self.is_sparse, range(self.num_layers))),
        }
