"""Load a Hugging Face model directory's safetensors weights into one name→tensor dict."""

from __future__ import annotations

import glob
import json
import os

import torch
from safetensors.torch import load_file

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
