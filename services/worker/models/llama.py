"""The Llama decoder (RMSNorm, rotary with Llama 3 scaling, GQA attention over paged KV, SwiGLU MLP).

It is the shared decoder as it stands; only an MLP bias is refused.
"""

from __future__ import annotations

import torch

from services.worker.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    def __init__(self, config: dict, weights: dict[str, torch.Tensor]) -> None:
        if config.get("mlp_bias"):
            raise ValueError("llama checkpoints with mlp_bias=true are not supported")
        super().__init__(config, weights)
