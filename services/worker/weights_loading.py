"""A checkpoint → its family's model in the serving format: loaded in the serving dtype onto the device,
sharded for tensor parallelism, its linears converted to the weight format. A GGUF file's Q4_0 / Q4_1 /
Q8_0 matrices go to their linears in their blocks, as stored. With an expert cache (``ExpertSpill``), each MoE
layer's experts are read as the layer is built (a checkpoint's quantized then) and go to its store."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

import torch

from services.worker.expert_cache import ExpertSpill
from services.worker.linear import block_formats, convert_weights, linears_of
from services.worker.models import CausalLM, model_family
from services.worker.moe import EXPERT_QUANT, EXPERT_SINK
from services.worker.tensor_parallel import TensorParallelGroup, parallelize, shard_config, shard_weights
from services.worker.weights import load_gguf, load_weights
from shared.model_info import is_gguf


class LoadedModel(NamedTuple):
    config: dict[str, Any]  # config.json, or a GGUF's metadata as one (this rank's shard of it under tensor parallelism)
    model: CausalLM
    weight_quant: str  # the format the float linears took ("none": as loaded)
    quantized_linears: int  # linears in blocks or another quantized format


def load_model(
    model_path: str, dtype: torch.dtype, device: torch.device, weight_quant: str, tp: TensorParallelGroup | None, spill: ExpertSpill | None = None
) -> LoadedModel:
    """``weight_quant`` resolved (``linear.resolve_weight_quant``); with ``tp``, this rank's shard, each layer's
    attention and MLP wrapped in their all_reduce; with ``spill``, the experts in its store (``spill.attach`` runs
    the model from it)."""
    with torch.inference_mode():
        if is_gguf(model_path):
            if tp is not None:
                raise ValueError("a GGUF model is served unsharded: leave --tensor-parallel-size at 1")
            config, weights = load_gguf(model_path, dtype, device, block_formats(device, dtype))
        else:
            with open(os.path.join(model_path, "config.json")) as f:
                config = json.load(f)
            weights = load_weights(model_path, dtype, device)
        if tp is not None:
            config, weights = shard_config(config, tp.size), shard_weights(weights, tp.rank, tp.size)
        family = model_family(config.get("model_type", "llama"))
        if spill is not None:
            spill.begin(config)
        sink, quant = EXPERT_SINK.set(spill), EXPERT_QUANT.set(weight_quant)
        try:
            model = family(config, weights)
            del weights
            if weight_quant != "none":
                weight_quant, quantized = convert_weights(model, weight_quant)
            else:  # a GGUF's linears hold their blocks whatever the format
                quantized = sum(linear.panels is not None for linear in linears_of(model))
        finally:
            EXPERT_SINK.reset(sink)
            EXPERT_QUANT.reset(quant)
        if tp is not None:  # after quantization, which finds the layers' linears unwrapped
            parallelize(model, tp)
    return LoadedModel(config, model, weight_quant, quantized)
