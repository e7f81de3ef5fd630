"""What every process needs to know about the served model, read from its directory's config.json (or a
GGUF file's metadata).

The scheduler sizes the KV cache from it, the api its context limit and stop tokens, the
worker its shapes. All of them compute the KV block count with ``kv_cache_blocks`` so
they agree on it without talking. Hybrid models (``qwen3_next``) mix full-attention layers,
which hold KV, with Gated DeltaNet layers, which hold a fixed-size state per request instead.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.config import StackConfig

# "auto" counts as float32, its CPU meaning; on CUDA the worker sizes the cache itself and reports the count.
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "auto": 4}
KV_Q8_BLOCK = 32  # an int8 KV cache's elements per fp16 scale


def q8_row_width(head_dim: int) -> int:
    """Bytes of one head vector in an int8 KV cache (services/worker/csrc/kv_q8.h, llama.cpp's q8_0): head_dim
    int8 codes, then an fp16 scale per 32 of them; element i is code[i] * scale[i // 32]."""
    return head_dim + head_dim // KV_Q8_BLOCK * 2


FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
_KV_LAYER_TYPES = (FULL_ATTENTION, "sliding_attention")
HYBRID_PREFIX_CACHE_OFF = "prefix cache off: the model's Gated DeltaNet layers keep a recurrent state per request that cached KV blocks cannot restore"
_DEFAULT_FULL_ATTENTION_INTERVAL = {"qwen3_next": 4}  # transformers' default when a config names no layer types


def layer_types(config: dict) -> tuple[str, ...]:
    """Each layer's token mixer, from ``layer_types`` or, failing that, ``full_attention_interval``
    (every n-th layer full attention, the rest Gated DeltaNet); plain decoders are all full attention."""
    num_layers = config["num_hidden_layers"]
    if config.get("layer_types"):
        kinds = tuple(config["layer_types"])
        if len(kinds) != num_layers:
            raise ValueError(f"config.json layer_types names {len(kinds)} layers but num_hidden_layers is {num_layers}")
        return kinds
    interval = config.get("full_attention_interval", _DEFAULT_FULL_ATTENTION_INTERVAL.get(config.get("model_type", "")))
    if interval is None:
        return (FULL_ATTENTION,) * num_layers
    return tuple(FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(num_layers))


@dataclass(frozen=True)
class ModelInfo:
    path: str
    family: str  # config.json "model_type"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    layer_types: tuple[str, ...] = ()
    gdn_dims: tuple[int, ...] = ()  # Gated DeltaNet: key heads, key dim, value heads, value dim, conv kernel

    @property
    def num_kv_layers(self) -> int:
        """Layers that keep keys and values per token (all of them in a plain decoder)."""
        return sum(kind in _KV_LAYER_TYPES for kind in self.layer_types) if self.layer_types else self.num_layers

    @property
    def num_gdn_layers(self) -> int:
        """Gated DeltaNet layers: each running request holds one state slot for all of them."""
        return sum(kind == LINEAR_ATTENTION for kind in self.layer_types)

    @property
    def uses_state_slots(self) -> bool:
        return self.num_gdn_layers > 0

    @property
    def prefix_cache_unsupported(self) -> str:
        """Why the prefix cache must stay off for this model ("" if it may be on)."""
        if self.uses_state_slots:
            return HYBRID_PREFIX_CACHE_OFF
        return ""

    def kv_bytes_per_token(self, dtype: str) -> int:
        # At least one layer's worth, so a byte budget still bounds the positions of a model without attention layers.
        if dtype == "int8":
            return max(self.num_kv_layers, 1) * 2 * self.num_kv_heads * q8_row_width(self.head_dim)
        return max(self.num_kv_layers, 1) * 2 * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[dtype]

    def gdn_state_bytes(self, dtype: str) -> int:
        """One request's GDN state (a running slot or a checkpoint): per GDN layer its conv history in the model's
        dtype and its recurrent state in fp32, as ``services/worker/gdn_state.GDNStateCache`` holds them."""
        if not self.uses_state_slots:
            return 0
        key_heads, key_dim, value_heads, value_dim, kernel = self.gdn_dims
        conv = (2 * key_heads * key_dim + value_heads * value_dim) * (kernel - 1) * _DTYPE_BYTES[dtype]
        return self.num_gdn_layers * (conv + value_heads * key_dim * value_dim * 4)

    def revision(self) -> str:
        """A short hash of config.json and the weight files' names and sizes (a GGUF: its name, size and metadata's config)."""
        digest = hashlib.sha256()
        if is_gguf(self.path):
            from shared.gguf_model import open_gguf

            digest.update(f"{os.path.basename(self.path)}:{os.path.getsize(self.path)}".encode())
            digest.update(json.dumps(open_gguf(self.path).config, sort_keys=True).encode())
            return digest.hexdigest()[:16]
        for name in sorted(os.listdir(self.path)):
            if name == "config.json" or name.endswith(".safetensors"):
                digest.update(f"{name}:{os.path.getsize(os.path.join(self.path, name))}".encode())
        with open(os.path.join(self.path, "config.json"), "rb") as f:
            digest.update(f.read())
        return digest.hexdigest()[:16]


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def is_gguf(path: str) -> bool:
    """``path`` names a single-file GGUF model (rather than a Hugging Face directory)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


def read_config(path: str) -> tuple[dict, dict]:
    """config.json and generation_config.json ({} if absent) of a model directory, or their equivalents from a
    GGUF file's metadata (checked whole: a file the stack cannot serve raises ``GGUFError``, one line)."""
    if is_gguf(path):
        from shared.gguf_model import open_gguf  # imports gguf and numpy: only for GGUF models

        model = open_gguf(path)
        return model.config, model.generation_config
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} is not a model directory: it has no config.json")
    with open(config_path) as f:
        config = json.load(f)
    generation: dict = {}
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            generation = json.load(f)
    return config, generation


def load_model_info(path: str) -> ModelInfo:
    config, generation = read_config(path)
    eos = _as_ids(generation.get("eos_token_id", config.get("eos_token_id")))
    num_heads = config["num_attention_heads"]
    return ModelInfo(
        path=os.path.abspath(path),
        family=config.get("model_type", "llama"),
        num_layers=config["num_hidden_layers"],
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
        vocab_size=config["vocab_size"],
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        eos_token_ids=eos,
        bos_token_id=generation.get("bos_token_id", config.get("bos_token_id")),
        layer_types=layer_types(config),
        gdn_dims=gdn_dims(config),
    )


def gdn_dims(config: dict) -> tuple[int, ...]:
    """``ModelInfo.gdn_dims`` of a hybrid model's config (empty for a model without Gated DeltaNet layers)."""
    if LINEAR_ATTENTION not in layer_types(config):
        return ()
    defaults = {"linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
    return tuple(config.get(key, default) for key, default in defaults.items())  # transformers' Qwen3NextConfig defaults


def gdn_checkpoints(info: ModelInfo, config: StackConfig) -> int:
    """GDN state checkpoints of a hybrid model's prefix cache: from ``--gdn-checkpoint-bytes`` when given, else
    ``--gdn-checkpoint-slots`` (0 for a model without GDN layers); every process computes it alike."""
    if not info.uses_state_slots:
        return 0
    if config.gdn_checkpoint_bytes:
        return config.gdn_checkpoint_bytes // info.gdn_state_bytes(config.dtype)
    return config.gdn_checkpoint_slots


KV_CACHE_DTYPES = ("auto", "model", "float16", "int8")


def resolve_kv_cache_dtype(kv_cache_dtype: str, device_type: str, dtype: str) -> str:
    """The KV cache's storage dtype for a model computing in ``dtype`` (resolved) on ``device_type``.

    ``auto``: float16 for a float32 model on the CPU (keys and values rounded to fp16: half the bytes
    that decode attention streams per step; the C++ kernel widens them in registers), else the
    model's dtype (``model``). ``float16`` elsewhere only where the model computes in it: the GPU's
    Triton kernel reads the cache in the model's dtype. ``int8`` (opt-in): llama.cpp's q8_0 per head
    vector (int8 codes, an fp16 scale per 32), 0.53x fp16's bytes, for a float32 model on the CPU,
    whose C++ kernels alone read it."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported (supported: {', '.join(KV_CACHE_DTYPES)})")
    if kv_cache_dtype == "int8":
        if device_type != "cpu" or dtype != "float32":
            raise ValueError(f"kv_cache_dtype 'int8' needs a float32 model on the CPU (got {dtype} on {device_type})")
        return "int8"
    if kv_cache_dtype == "model" or (kv_cache_dtype == "auto" and not (device_type == "cpu" and dtype == "float32")):
        return dtype
    if device_type != "cpu" and dtype != "float16":
        raise ValueError(f"kv_cache_dtype 'float16' with a {dtype} model needs the CPU (on {device_type} the cache holds the model's dtype)")
    return "float16"


def kv_cache_blocks(info: ModelInfo, kv_cache_tokens: int, kv_cache_bytes: int, block_size: int, dtype: str) -> int:
    """Number of KV blocks: from a byte budget when one is given, else from a token count."""
    if kv_cache_bytes:
        return kv_cache_bytes // (info.kv_bytes_per_token(dtype) * block_size)
    return kv_cache_tokens // block_size
