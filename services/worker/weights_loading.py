"""A checkpoint → its family's model in the serving format: loaded in the serving dtype onto the device,
sharded for tensor parallelism, its linears converted to the weight format."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import torch

from services.worker.linear import convert_weights
from services.worker.models import CausalLM, model_family
from services.worker.tensor_parallel import TensorParallelGroup, parallelize, shard_config, shard_weights
from services.worker.weights import load_weights


class LoadedModel(NamedTuple):
    config: dict[str, Any]  # config.json (this rank's shard of it under tensor parallelism)
    model: CausalLM
    weight_quant: str  # the format the linears hold ("none": as loaded)
    quantized_linears: int


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, weight_quant: str, tp: TensorParallelGroup | None) -> LoadedModel:
    """``weight_quant`` resolved (``linear.resolve_weight_quant``); with ``tp``, this rank's shard, each layer's
    attention and MLP wrapped in their all_reduce."""
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    family = model_family(config.get("model_type", "llama"))
    with torch.inference_mode():
        weights = load_weights(model_dir, dtype, device)
        if tp is not None:
            config, weights = shard_config(config, tp.size), shard_weights(weights, tp.rank, tp.size)
        model = family(config, weights)
        weight_quant, quantized = convert_weights(model, weight_quant) if weight_quant != "none" else ("none", 0)
        if tp is not None:  # after quantization, which finds the layers' linears unwrapped
            parallelize(model, tp)
    return LoadedModel(config, model, weight_quant, quantized)
