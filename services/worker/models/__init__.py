"""Model families by config.json ``model_type``, and the contract each family implements.

Adding a family is one module under ``models/`` and one entry in ``MODEL_FAMILIES``.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from services.worker.attention import AttentionMetadata, KVCache
from services.worker.gdn_state import GDNShape, SlotMetadata
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.qwen3 import Qwen3ForCausalLM
from services.worker.models.qwen3_moe import Qwen3MoeForCausalLM
from services.worker.models.qwen3_next import Qwen3NextForCausalLM


class CausalLM(Protocol):
    """A decoder built from config.json and its checkpoint's tensors (already in the serving dtype).

    ``forward`` writes the step's keys and values into ``kv_cache`` (which has ``num_kv_layers``
    layers) and returns final-normed hidden states, one row per input token; ``compute_logits`` maps
    chosen rows to the vocabulary. A hybrid family (``gdn_shape`` not None) also reads and writes
    each request's GDN state in the slot that ``slots`` names.
    """

    num_layers: int
    num_kv_layers: int
    gdn_shape: GDNShape | None
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype: torch.dtype

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]) -> None: ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, slots: SlotMetadata | None = None
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def tensors(self) -> list[torch.Tensor]: ...

    def describe(self) -> dict[str, Any]:
        """Family-specific facts for the instrumentation endpoint, e.g. the kernel backends chosen at load."""
        ...


MODEL_FAMILIES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
}


def model_family(model_type: str) -> type[CausalLM]:
    try:
        return MODEL_FAMILIES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(MODEL_FAMILIES))})") from None
