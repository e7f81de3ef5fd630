"""Load a checkpoint's weights into one name→tensor mapping: a Hugging Face directory's safetensors, or a GGUF
file's tensors (``shared.gguf_model``) with its Q4_0 / Q4_1 / Q8_0 matrices kept in their blocks; in both, a
layer's tensors are read from the file only when that layer is built (``DeferredWeights``)."""

from __future__ import annotations

import functools
import glob
import json
import mmap
import os
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from services.worker.block_quant import BLOCK_BYTES, CODE_BYTES, BlockQuantized
from shared.gguf_model import GGUFModel, GGUFWeight, open_gguf

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


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsFile:
    """One safetensors file's tensors by name (``entries``), each read when asked (``read``) into memory of its own,
    its pages then dropped from the page cache (``POSIX_FADV_DONTNEED``): reading holds no mapping of the file, so
    neither the worker's resident memory nor the page cache keeps what was read."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        self.data_start = 8 + size
        self.entries: dict[str, dict[str, Any]] = header
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)

    def read(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """Tensor ``name`` on ``device``, in ``dtype`` where it is floating (else as stored)."""
        entry = self.entries[name]
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} is {entry['dtype']}, which this loader does not read ({', '.join(SAFETENSORS_DTYPES)})")
        begin, end = entry["data_offsets"]
        raw = torch.empty(end - begin, dtype=torch.uint8)
        view, offset = memoryview(raw.numpy()), self.data_start + begin
        while view:  # one read moves at most about 2 GiB
            if (n := os.preadv(self.fd, [view], offset)) == 0:
                raise OSError(f"{self.path} ends inside tensor {name!r}")
            view, offset = view[n:], offset + n
        os.posix_fadvise(self.fd, self.data_start + begin, end - begin, os.POSIX_FADV_DONTNEED)
        tensor = raw.view(SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        return tensor.to(device, dtype if tensor.is_floating_point() else tensor.dtype)


def load_weights(model_dir: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> DeferredWeights:
    """Every tensor of the checkpoint by name, in ``dtype`` (floating tensors only are cast), on ``device``, each in
    memory of its own (no mapping of the file stays behind it) and read when it is looked up (the embedding and
    lm_head at once: they are looked up more than once), as ``load_gguf``'s: a model that takes each tensor into its
    own layout holds each once, and one MoE layer's experts at a time."""
    weights = DeferredWeights()
    for path in weight_files(model_dir):
        file = SafetensorsFile(path)
        for name in file.entries:
            if name in weights:
                raise ValueError(f"tensor {name!r} appears in more than one shard of {model_dir}")
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                weights[name] = file.read(name, dtype, device)
            else:
                weights.defer(name, functools.partial(file.read, name, dtype, device))
    return weights


class DeferredWeights(MutableMapping[str, Any]):
    """Tensors by name, some of them read only when looked up (``defer``): such an entry is read again at each
    lookup and kept by whoever looked it up, so a model that builds its layers in turn holds one layer's at a time."""

    def __init__(self) -> None:
        self._held: dict[str, Any] = {}
        self._deferred: dict[str, Callable[[], Any]] = {}

    def defer(self, name: str, read: Callable[[], Any]) -> None:
        self.pop(name, None)
        self._deferred[name] = read

    def __getitem__(self, name: str) -> Any:
        return self._deferred[name]() if name in self._deferred else self._held[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._deferred.pop(name, None)
        self._held[name] = value

    def __delitem__(self, name: str) -> None:
        if self._deferred.pop(name, None) is None:
            del self._held[name]

    def __contains__(self, name: object) -> bool:  # without reading a deferred entry
        return name in self._held or name in self._deferred

    def __iter__(self) -> Iterator[str]:
        yield from self._held
        yield from self._deferred

    def __len__(self) -> int:
        return len(self._held) + len(self._deferred)


def block_rows(weight: GGUFWeight) -> BlockQuantized:
    """A GGUF tensor's llama.cpp blocks (per block its fp16 scale(s), then its codes) rearranged, bit for bit,
    into block_quant's row layout (per row all its codes, then all its scales, then q4_1's minimums)."""
    fmt = weight.block_format
    *rows, width = weight.array.shape
    blocks = torch.from_numpy(np.array(weight.array)).view(*rows, width // BLOCK_BYTES[fmt], BLOCK_BYTES[fmt])
    scale_bytes = BLOCK_BYTES[fmt] - CODE_BYTES[fmt]  # d (and q4_1's m), two bytes each, ahead of the codes
    parts = [blocks[..., scale_bytes:], *(blocks[..., i : i + 2] for i in range(0, scale_bytes, 2))]
    return BlockQuantized(fmt, torch.cat([part.reshape(*rows, -1) for part in parts], dim=-1), weight.in_features)


def load_gguf(path: str, dtype: torch.dtype, device: torch.device | str, block_formats: tuple[str, ...]) -> tuple[dict[str, Any], DeferredWeights]:
    """A GGUF's config and every tensor by its Hugging Face name: a matrix (or a stack of experts' matrices) in a
    block format of ``block_formats`` as ``BlockQuantized`` (its blocks as stored), anything else in ``dtype``
    on ``device`` (blocks of other formats dequantized). A MoE layer's experts come fused as
    ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I] (gate and up in different
    formats: both dequantized). A tied embedding in blocks is also the lm_head's weight (the config then says
    untied): lookups read its float copy, the logits its blocks.

    A tensor is read from the file when it is looked up (the embedding's float copy at once: it is looked up
    more than once), copied out of the file's mapping, whose pages are then dropped from this process
    (``MADV_DONTNEED``: they stay in the page cache, not in the worker's resident memory): a model that takes
    each tensor into its own layout holds each once, and one MoE layer's experts at a time."""
    model = open_gguf(path)  # the process's reader of the file's metadata: a second one would cost as much again
    config = model.config
    read = functools.partial(_read_gguf, model, dtype, device, block_formats)
    stored = dict(model.weights())
    weights = DeferredWeights()
    for name in [n for n in stored if n.endswith(".experts.gate_proj.weight")]:
        prefix = name.removesuffix("gate_proj.weight")
        gate, up = stored.pop(name), stored.pop(prefix + "up_proj.weight")
        weights.defer(prefix + "gate_up_proj", lambda gate=gate, up=up: _cat_experts_rows(read(gate), read(up), dtype, device))
    if config["tie_word_embeddings"]:
        if stored["lm_head.weight"].block_format in block_formats:
            config = {**config, "tie_word_embeddings": False}
        else:
            del stored["lm_head.weight"]
    for name, weight in stored.items():
        name = name.removesuffix(".weight") if name.endswith((".experts.gate_up_proj.weight", ".experts.down_proj.weight")) else name
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # looked up more than once; the tables' transients before any layer's
            weights[name] = read(weight)
        else:
            weights.defer(name, functools.partial(read, weight))
    return config, weights


def _read_gguf(model: GGUFModel, dtype: torch.dtype, device: torch.device | str, block_formats: tuple[str, ...], weight: GGUFWeight) -> Any:
    """``weight`` of ``model``'s file, in its blocks where it is in one of ``block_formats``, else in ``dtype`` on ``device``."""
    if weight.block_format in block_formats:
        out = block_rows(weight)
    else:  # float32 values that ``weights()`` made (an embedding table) are already this process's own: no second copy
        owned = weight.ggml_type == GGMLQuantizationType.F32 and not np.may_share_memory(weight.array, model.reader.data)
        out = torch.from_numpy(weight.array if owned else weight.float32()).to(device, dtype)
    if (mapping := getattr(model.reader.data, "_mmap", None)) is not None:  # numpy's memmap of the whole file
        mapping.madvise(mmap.MADV_DONTNEED)
    return out


def _cat_experts_rows(
    gate: torch.Tensor | BlockQuantized, up: torch.Tensor | BlockQuantized, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | BlockQuantized:
    """Experts' gate [E, I, H] and up [E, I, H] as one stack [E, 2I, H]: blocks where both are in one format."""
    if isinstance(gate, BlockQuantized) and isinstance(up, BlockQuantized) and gate.fmt == up.fmt:
        return BlockQuantized(gate.fmt, torch.cat([gate.data, up.data], dim=1), gate.in_features)
    gate, up = (w.dequantize().to(device, dtype) if isinstance(w, BlockQuantized) else w for w in (gate, up))
    return torch.cat([gate, up], dim=1)
