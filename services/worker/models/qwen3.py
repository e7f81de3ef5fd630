"""The dense Qwen3 decoder: Llama's, plus an RMSNorm over each q and k head before rotary.

``head_dim`` comes from the config (it may differ from hidden / heads); q/k/v/o may carry a bias
(``attention_bias``); embeddings tied or not.
"""

from __future__ import annotations

from services.worker.models.decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    QK_NORM = True
