"""Load a checkpoint's weights into one name→tensor dict: a Hugging Face directory's safetensors, or a GGUF
file's tensors (``shared.gguf_model``) with its Q4_0 / Q4_1 / Q8_0 matrices kept in their blocks."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from services.worker.block_quant import BLOCK_BYTES, CODE_BYTES, BlockQuantized
from shared.gguf_model import GGUFModel, GGUFWeight

_INDEX = "model.safetensors.index.json"


def weight_files(model_dir: str) -> list[str]:
    """The safetensors files of ``model_dir``: those its shard index names, else every one."""
    index_path = os.path.join(model_dir, _INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in names]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no *.safetensors weights")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"{index_path} names shards that are missing: {missing}")
    return files


def load_weights(model_dir: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name, in ``dtype`` (floating tensors only are cast), on ``device``."""
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        for name, tensor in load_file(path).items():
            if name in weights:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {model_dir}")
            # An owned copy: a tensor still backed by the file's mapping would keep every page of
            # the file resident beside the layouts the model builds from it.
            weights[name] = tensor.to(device, dtype if tensor.is_floating_point() else tensor.dtype, copy=True)
    return weights


def block_rows(weight: GGUFWeight) -> BlockQuantized:
    """A GGUF tensor's llama.cpp blocks (per block its fp16 scale(s), then its codes) rearranged, bit for bit,
    into block_quant's row layout (per row all its codes, then all its scales, then q4_1's minimums)."""
    fmt = weight.block_format
    *rows, width = weight.array.shape
    blocks = torch.from_numpy(np.array(weight.array)).view(*rows, width // BLOCK_BYTES[fmt], BLOCK_BYTES[fmt])
    scale_bytes = BLOCK_BYTES[fmt] - CODE_BYTES[fmt]  # d (and q4_1's m), two bytes each, ahead of the codes
    parts = [blocks[..., scale_bytes:], *(blocks[..., i : i + 2] for i in range(0, scale_bytes, 2))]
    return BlockQuantized(fmt, torch.cat([part.reshape(*rows, -1) for part in parts], dim=-1), weight.in_features)


def load_gguf(
    path: str, dtype: torch.dtype, device: torch.device | str, block_formats: tuple[str, ...]
) -> tuple[dict[str, Any], dict[str, torch.Tensor | BlockQuantized]]:
    """A GGUF's config and every tensor by its Hugging Face name: a matrix (or a stack of experts' matrices) in a
    block format of ``block_formats`` as ``BlockQuantized`` (its blocks as stored), anything else in ``dtype``
    on ``device`` (blocks of other formats dequantized). A MoE layer's experts come fused as
    ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I] (gate and up in different
    formats: both dequantized). A tied embedding in blocks is also the lm_head's weight (the config then
    says untied): lookups read its float copy, the logits its blocks."""
    model = GGUFModel(path)
    config = model.config
    weights: dict[str, torch.Tensor | BlockQuantized] = {}
    for name, weight in model.weights():
        if weight.block_format in block_formats:
            weights[name] = block_rows(weight)
        else:
            weights[name] = torch.from_numpy(weight.float32()).to(device, dtype)
    for name in [n for n in weights if n.endswith(".experts.gate_proj.weight")]:
        prefix = name.removesuffix("gate_proj.weight")
        weights[prefix + "gate_up_proj"] = _cat_experts_rows(weights.pop(name), weights.pop(prefix + "up_proj.weight"), dtype, device)
    for name in [n for n in weights if n.endswith(".experts.gate_up_proj.weight") or n.endswith(".experts.down_proj.weight")]:
        weights[name.removesuffix(".weight")] = weights.pop(name)
    if config["tie_word_embeddings"]:
        if isinstance(weights["lm_head.weight"], BlockQuantized):
            config = {**config, "tie_word_embeddings": False}
        else:
            del weights["lm_head.weight"]
    return config, weights


def _cat_experts_rows(
    gate: torch.Tensor | BlockQuantized, up: torch.Tensor | BlockQuantized, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | BlockQuantized:
    """Experts' gate [E, I, H] and up [E, I, H] as one stack [E, 2I, H]: blocks where both are in one format."""
    if isinstance(gate, BlockQuantized) and isinstance(up, BlockQuantized) and gate.fmt == up.fmt:
        return BlockQuantized(gate.fmt, torch.cat([gate.data, up.data], dim=1), gate.in_features)
    gate, up = (w.dequantize().to(device, dtype) if isinstance(w, BlockQuantized) else w for w in (gate, up))
    return torch.cat([gate, up], dim=1)
