"""A llama.cpp GGUF file read as the model the stack serves: config.json-style hyperparameters, generation
settings, the tokenizer and chat template from its metadata, and its tensors under Hugging Face names in
Hugging Face layout (llama.cpp's reorderings undone). Every process that needs the model reads it here.

Architectures: ``llama``, ``qwen3``, ``qwen3moe`` and ``qwen3next``, as llama.cpp's converter writes them.
Tensor types: Q4_0, Q4_1 and Q8_0 stay in their blocks (``GGUFWeight.ggml_type``; every reordering here
moves whole rows, so a row's blocks are untouched), F32, F16 and BF16 as stored. A file that cannot be
served (another architecture or tensor type, a truncated file, tensors that disagree with the metadata)
is refused on opening with ``GGUFError``, one line that names what is wrong.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, TokenType
from gguf.quants import dequantize

FAMILIES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen3next": "qwen3_next"}  # GGUF architecture -> model_type
BLOCK_TYPES = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
ACCEPTED_TYPES = ", ".join(t.name for t in (*BLOCK_TYPES, *FLOAT_TYPES))
PRE_TOKENIZERS = ("gpt2", "smollm", "qwen2", "llama-bpe")

# GPT-2's split with single digits (qwen2) or runs of up to three (llama-bpe), as llama.cpp's pre-tokenizers define them.
_QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_LAYER_NAMES = {  # blk.N.<name> -> model.layers.N.<name>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",  # qwen3next's GDN projection, rebuilt into in_proj_qkvz
    "attn_gate": "linear_attn.in_proj_z",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_MATRICES = {"token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps"}
_MATRICES |= {"ffn_down_exps", "ffn_gate_up_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "ssm_in", "ssm_ba", "ssm_out", "attn_qkv", "attn_gate"}


class GGUFError(ValueError):
    """A GGUF file the stack cannot serve; the message is one line naming why."""


@dataclass(frozen=True)
class GGUFWeight:
    """One tensor in Hugging Face layout: F32/F16 values of the tensor's shape, or its bytes as stored, uint8
    [..., rows, bytes per row] (Q4_0/Q4_1/Q8_0: llama.cpp's blocks, in_features / 32 of them per row; BF16)."""

    ggml_type: GGMLQuantizationType
    array: np.ndarray
    in_features: int

    @property
    def block_format(self) -> str | None:
        return BLOCK_TYPES.get(self.ggml_type)

    def float32(self, rows: int = 4096) -> np.ndarray:
        """The values as float32 (blocks dequantized ``rows`` rows at a time: a table's temporaries stay small)."""
        if self.ggml_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return self.array.astype(np.float32)
        flat = self.array.reshape(-1, self.array.shape[-1])
        out = np.empty((flat.shape[0], self.in_features), dtype=np.float32)
        for start in range(0, flat.shape[0], rows):
            out[start : start + rows] = dequantize(flat[start : start + rows], self.ggml_type)
        return out.reshape(*self.array.shape[:-1], self.in_features)

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> GGUFWeight:
        """``fn`` applied to the rows ([rows, width] -> [rows', width]): a reordering that keeps each row whole."""
        return GGUFWeight(self.ggml_type, fn(self.array), self.in_features)


@functools.cache
def _open(path: str, mtime_ns: int, size: int) -> GGUFModel:
    return GGUFModel(path)


def open_gguf(path: str) -> GGUFModel:
    """``GGUFModel(path)``, read once per process for its metadata (the tokenizer, the config)."""
    stat = os.stat(path) if os.path.isfile(path) else None
    return _open(os.path.abspath(path), stat.st_mtime_ns, stat.st_size) if stat else GGUFModel(path)


def _f32(value: float) -> float:
    return float(str(np.float32(value)))  # GGUF floats are float32: 9.99999974e-06 -> 1e-05


class GGUFModel:
    """The GGUF file at ``path``, checked on opening: its architecture, every tensor's type and shape against
    the hyperparameters, and that the file holds every byte its tensors claim."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        if not os.path.isfile(path):
            raise GGUFError(f"{path} does not exist")
        try:
            self.reader = GGUFReader(path)
        except Exception as exc:  # the reader raises whatever numpy does on a short or corrupt file
            with open(path, "rb") as f:
                magic = f.read(4)
            what = "is truncated or corrupt" if magic == b"GGUF" else "is not a GGUF file"
            raise GGUFError(f"the file {what} ({type(exc).__name__}: {exc})") from None
        size = os.path.getsize(path)
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
                raise GGUFError(f"the file is truncated: tensor {t.name} needs bytes up to {t.data_offset + t.n_bytes}, the file has {size}")
        self.arch = self._field("general.architecture")
        if self.arch not in FAMILIES:
            raise GGUFError(f"GGUF architecture {self.arch!r} is not supported (supported: {', '.join(FAMILIES)})")
        self.family = FAMILIES[self.arch]
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.tensor_type not in BLOCK_TYPES and t.tensor_type not in FLOAT_TYPES:
                raise GGUFError(f"tensor {t.name} is {t.tensor_type.name}, a type this stack does not serve (accepted: {ACCEPTED_TYPES})")
        self.tokens: list[str] = list(self._field("tokenizer.ggml.tokens", None) or [])
        if not self.tokens:
            raise GGUFError("the file has no tokenizer (tokenizer.ggml.tokens)")
        try:
            self.config = self._config()
            self._check_shapes()
        except GGUFError:
            raise
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:  # a metadata value of the wrong type or range
            raise GGUFError(f"the file has malformed metadata ({type(exc).__name__}: {exc})") from None

    # Metadata. -----------------------------------------------------------------------------------------

    def _field(self, key: str, default: Any = ...) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"the file lacks the metadata key {key}")
            return default
        return field.contents()

    def _meta(self, key: str, default: Any = ...) -> Any:
        return self._field(f"{self.arch}.{key}", default)

    @cached_property
    def special_ids(self) -> dict[str, Any]:
        """bos, eos (a list: generation stops at any), pad and unk token ids."""

        def gguf_id(key: str) -> int | None:
            return self._field(f"tokenizer.ggml.{key}_token_id", None)

        tokens, template = self.tokens, self._field("tokenizer.chat_template", "") or ""
        # Not the GGUF's eos id alone (SmolLM2 exports disagree on it, some say <|im_start|>): a chat reply ends
        # at <|im_end|> when the template uses it, and generation also stops at <|endoftext|>.
        eos = [tokens.index(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokens and (t != "<|im_end|>" or t in template)]
        if gguf_id("eos") is not None and gguf_id("eos") not in eos and not eos:
            eos = [gguf_id("eos")]
        eos_extra = gguf_id("eot")
        if eos_extra is not None and eos_extra not in eos:
            eos.append(eos_extra)
        if not eos:
            raise GGUFError("the file names no end-of-sequence token (tokenizer.ggml.eos_token_id)")
        pad = gguf_id("padding")
        return {"bos": gguf_id("bos"), "eos": eos, "pad": eos[0] if pad is None else pad, "unk": gguf_id("unknown")}

    def _config(self) -> dict[str, Any]:
        meta = self._meta
        hidden, heads = meta("embedding_length"), meta("attention.head_count")
        head_dim = meta("attention.key_length", hidden // heads)
        scaling = meta("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise GGUFError(f"rope scaling {scaling!r} ({self.arch}.rope.scaling.type) is not supported")
        if "rope_freqs.weight" in self.tensors:
            raise GGUFError("tensor rope_freqs.weight (Llama 3 rope scaling) is not supported")
        ids = self.special_ids
        vocab = meta("vocab_size", len(self.tokens))
        config: dict[str, Any] = {
            "architectures": [
                {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}.get(self.family, "Qwen3NextForCausalLM")
            ],
            "model_type": self.family,
            "hidden_size": hidden,
            "intermediate_size": meta("feed_forward_length", 0),
            "num_hidden_layers": meta("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": meta("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": meta("context_length"),
            "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
            "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
            "vocab_size": vocab,
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "bos_token_id": ids["bos"],
            "eos_token_id": ids["eos"][0],
            "pad_token_id": ids["pad"],
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in self.tensors or "blk.3.attn_q.bias" in self.tensors,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.family in ("qwen3_moe", "qwen3_next"):
            # llama.cpp renormalises the top-k router weights of both (build_moe_ffn's norm_w) and puts a MoE in every layer.
            config.update(
                num_experts=meta("expert_count"),
                num_experts_per_tok=meta("expert_used_count"),
                moe_intermediate_size=meta("expert_feed_forward_length", 0),
                norm_topk_prob=bool(meta("expert_weights_norm", True)),
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
        if self.family == "qwen3_next":
            value_heads = meta("ssm.time_step_rank")
            config.update(
                linear_conv_kernel_dim=meta("ssm.conv_kernel"),
                linear_key_head_dim=meta("ssm.state_size"),
                linear_num_key_heads=meta("ssm.group_count"),
                linear_num_value_heads=value_heads,
                linear_value_head_dim=meta("ssm.inner_size") // value_heads,
                shared_expert_intermediate_size=meta("expert_shared_feed_forward_length", 0),
                partial_rotary_factor=meta("rope.dimension_count", head_dim // 4) / head_dim,
                layer_types=self._layer_types(config["num_hidden_layers"]),
            )
        return config

    def _layer_types(self, num_layers: int) -> list[str]:
        recurrent = self._meta("attention.recurrent_layers", None)
        if recurrent is None:
            interval = self._meta("full_attention_interval", 4)
            recurrent = [(i + 1) % interval != 0 for i in range(num_layers)]
        return ["linear_attention" if r else "full_attention" for r in recurrent]

    @property
    def generation_config(self) -> dict[str, Any]:
        ids = self.special_ids
        return {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]}

    @property
    def chat_template(self) -> str | None:
        return self._field("tokenizer.chat_template", None)

    @property
    def add_bos_token(self) -> bool:
        return bool(self._field("tokenizer.ggml.add_bos_token", False))

    # Tokenizer. ----------------------------------------------------------------------------------------

    def tokenizer(self):
        """The byte-level BPE tokenizer of the metadata (a ``tokenizers.Tokenizer``)."""
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

        model = self._field("tokenizer.ggml.model")
        if model != "gpt2":
            raise GGUFError(f"tokenizer model {model!r} is not supported (only byte-level BPE, tokenizer.ggml.model = gpt2)")
        pre = self._field("tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_TOKENIZERS:
            raise GGUFError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
        tokens, ids = self.tokens, self.special_ids
        merges = [tuple(m.split(" ", 1)) for m in self._field("tokenizer.ggml.merges", None) or []]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        if pre in ("gpt2", "smollm"):  # llama.cpp's smollm: the GPT-2 regex after splitting off every digit
            byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) if pre == "smollm" else byte_level
        else:
            split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        if self.add_bos_token and ids["bos"] is not None:
            bos = tokens[ids["bos"]]
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])])
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        types = self._field("tokenizer.ggml.token_type")
        special = (TokenType.CONTROL, TokenType.USER_DEFINED)
        tok.add_tokens([AddedToken(tokens[i], special=t == TokenType.CONTROL, normalized=False) for i, t in enumerate(types) if t in special])
        return tok

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos/eos/pad/unk as token strings (those the file names)."""
        ids, tokens = self.special_ids, self.tokens
        named = {"bos_token": ids["bos"], "eos_token": ids["eos"][0], "pad_token": ids["pad"], "unk_token": ids["unk"]}
        return {key: tokens[i] for key, i in named.items() if i is not None}

    def hf_tokenizer(self):
        """The tokenizer as transformers' ``PreTrainedTokenizerFast``, with the chat template (what the api and detokenizer use)."""
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(
            tokenizer_object=self.tokenizer(),
            chat_template=self.chat_template,
            model_max_length=self.config["max_position_embeddings"],
            clean_up_tokenization_spaces=False,
            **self.special_tokens,
        )

    # Tensors. ------------------------------------------------------------------------------------------

    def _torch_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape.tolist()))

    def _expected_shapes(self, layer: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Each tensor of layer ``layer`` by its GGUF name's part, with the shapes (PyTorch order) it may have."""
        c = self.config
        hidden, heads, kv_heads, dim = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q_rows = (2 if self.family == "qwen3_next" else 1) * heads * dim  # qwen3next: each head's query and its output gate
        shapes: dict[str, tuple[tuple[int, ...], ...]] = {"attn_norm": ((hidden,),)}
        recurrent = self.family == "qwen3_next" and c["layer_types"][layer] == "linear_attention"
        if recurrent:
            hk, hv, dk, dv = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]
            conv = 2 * hk * dk + hv * dv
            shapes |= {
                "attn_qkv": ((conv, hidden),),
                "attn_gate": ((hv * dv, hidden),),
                "ssm_in": ((conv + hv * dv, hidden),),
                "ssm_ba": ((2 * hv, hidden),),
                "ssm_conv1d": ((conv, c["linear_conv_kernel_dim"]),),
                "ssm_dt.bias": ((hv,),),
                "ssm_a": ((hv,),),
                "ssm_norm": ((dv,),),
                "ssm_out": ((hidden, hv * dv),),
            }
        else:
            shapes |= {
                "attn_q": ((q_rows, hidden),),
                "attn_k": ((kv_heads * dim, hidden),),
                "attn_v": ((kv_heads * dim, hidden),),
                "attn_output": ((hidden, heads * dim),),
                "attn_q.bias": ((q_rows,),),
                "attn_k.bias": ((kv_heads * dim,),),
                "attn_v.bias": ((kv_heads * dim,),),
                "attn_output.bias": ((hidden,),),
            }
            if self.family != "llama":
                shapes |= {"attn_q_norm": ((dim,),), "attn_k_norm": ((dim,),)}
        shapes["post_attention_norm" if self.family == "qwen3_next" else "ffn_norm"] = ((hidden,),)
        if self.family in ("qwen3_moe", "qwen3_next"):
            experts, inter = c["num_experts"], c["moe_intermediate_size"]
            shapes |= {
                "ffn_gate_inp": ((experts, hidden),),
                "ffn_gate_exps": ((experts, inter, hidden),),
                "ffn_up_exps": ((experts, inter, hidden),),
                "ffn_gate_up_exps": ((experts, 2 * inter, hidden),),
                "ffn_down_exps": ((experts, hidden, inter),),
            }
            if self.family == "qwen3_next":
                shared = c["shared_expert_intermediate_size"]
                shapes |= {
                    "ffn_gate_inp_shexp": ((hidden,), (1, hidden)),
                    "ffn_gate_shexp": ((shared, hidden),),
                    "ffn_up_shexp": ((shared, hidden),),
                    "ffn_down_shexp": ((hidden, shared),),
                }
        else:
            inter = c["intermediate_size"]
            shapes |= {"ffn_gate": ((inter, hidden),), "ffn_up": ((inter, hidden),), "ffn_down": ((hidden, inter),)}
        return shapes

    def _required(self, layer: int) -> list[str]:
        if self.family == "qwen3_next" and self.config["layer_types"][layer] == "linear_attention":
            mixer = ["ssm_ba", "ssm_conv1d", "ssm_dt.bias", "ssm_a", "ssm_norm", "ssm_out"]
            mixer += ["ssm_in"] if f"blk.{layer}.ssm_in.weight" in self.tensors else ["attn_qkv", "attn_gate"]
        else:
            mixer = ["attn_q", "attn_k", "attn_v", "attn_output"] + (["attn_q_norm", "attn_k_norm"] if self.family != "llama" else [])
        ffn = ["ffn_gate", "ffn_up", "ffn_down"]
        if self.family in ("qwen3_moe", "qwen3_next"):
            gate_up = ["ffn_gate_up_exps"] if f"blk.{layer}.ffn_gate_up_exps.weight" in self.tensors else ["ffn_gate_exps", "ffn_up_exps"]
            ffn = ["ffn_gate_inp", *gate_up, "ffn_down_exps"]
            if self.family == "qwen3_next":
                ffn += ["ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]
        post = "post_attention_norm" if self.family == "qwen3_next" else "ffn_norm"
        return ["attn_norm", post, *mixer, *ffn]

    def _check_shapes(self) -> None:
        c = self.config
        top = {"token_embd.weight": (c["vocab_size"], c["hidden_size"]), "output_norm.weight": (c["hidden_size"],)}
        if not c["tie_word_embeddings"]:
            top["output.weight"] = (c["vocab_size"], c["hidden_size"])
        if len(self.tokens) > c["vocab_size"]:
            raise GGUFError(f"the tokenizer has {len(self.tokens)} tokens but {self.arch}.vocab_size is {c['vocab_size']}")
        seen = set()
        for name, shape in top.items():
            self._check_one(name, (shape,))
            seen.add(name)
        for layer in range(c["num_hidden_layers"]):
            expected = self._expected_shapes(layer)
            for part in self._required(layer):
                name = f"blk.{layer}.{part}" + ("" if part.endswith(".bias") or part == "ssm_a" else ".weight")
                if name not in self.tensors:
                    raise GGUFError(f"tensor {name} is missing ({self.arch} with {c['num_hidden_layers']} layers needs it)")
            for name in self.tensors:
                if name.startswith(f"blk.{layer}."):
                    part = name[len(f"blk.{layer}.") :].removesuffix(".weight")
                    if part not in expected:
                        raise GGUFError(f"tensor {name} is not one a {self.arch} layer has")
                    self._check_one(name, expected[part])
                    seen.add(name)
        extra = sorted(set(self.tensors) - seen)
        if extra:
            raise GGUFError(f"tensor {extra[0]} is not one a {self.arch} model has" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))

    def _check_one(self, name: str, shapes: tuple[tuple[int, ...], ...]) -> None:
        if name not in self.tensors:
            raise GGUFError(f"tensor {name} is missing")
        shape = self._torch_shape(name)
        if shape not in shapes:
            want = " or ".join(str(list(s)) for s in shapes)
            raise GGUFError(f"tensor {name} has shape {list(shape)} but the metadata ({self.arch}.*) implies {want}")

    def _weight(self, name: str) -> GGUFWeight:
        t = self.tensors[name]
        shape = self._torch_shape(name)
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            return GGUFWeight(t.tensor_type, t.data.reshape(shape), shape[-1])
        return GGUFWeight(t.tensor_type, t.data.reshape(*shape[:-1], -1), shape[-1])

    def weights(self) -> Iterator[tuple[str, GGUFWeight]]:
        """Every tensor under its Hugging Face name, in Hugging Face layout; tensors that are not matrix
        products' weights (norms, conv, router, embedding lookups aside) come as float32. The embedding
        table is yielded twice when tied: ``model.embed_tokens.weight`` (float32, for lookups) and
        ``lm_head.weight`` (as stored)."""
        c = self.config
        shift_norms = self.family == "qwen3_next"  # llama.cpp stores its zero-centred norms as 1 + w
        for name in self.tensors:
            base, _, suffix = name.rpartition(".")
            if name == "ssm_a" or name.endswith(".ssm_a"):
                base, suffix = name, ""
            parts = base.split(".")
            weight = self._weight(name)
            if parts[0] == "blk":
                layer, part = int(parts[1]), parts[2]
                hf = f"model.layers.{layer}.{_LAYER_NAMES[part]}"
            else:
                part, hf = parts[0], _TOP_NAMES[parts[0]]
            if part not in _MATRICES or part == "token_embd":
                weight = GGUFWeight(GGMLQuantizationType.F32, weight.float32(), weight.in_features)
            if part == "token_embd":
                yield "model.embed_tokens.weight", weight
                if c["tie_word_embeddings"]:
                    yield "lm_head.weight", self._weight(name)
                continue
            if part in ("attn_q", "attn_k") and self.family == "llama":  # undo the converter's rotary interleave
                heads = c["num_attention_heads"] if part == "attn_q" else c["num_key_value_heads"]
                weight = weight.map_rows(lambda rows, n=heads: _unpermute(rows, n))
            elif part.endswith("norm") and part != "ssm_norm" and shift_norms:
                weight = GGUFWeight(weight.ggml_type, weight.array - np.float32(1), weight.in_features)
            elif part == "ssm_a":  # stored as -exp(A_log)
                weight = GGUFWeight(weight.ggml_type, np.log(-weight.array), weight.in_features)
                yield hf, weight
                continue
            elif part == "ssm_dt":
                yield f"model.layers.{layer}.linear_attn.dt_bias", weight
                continue
            elif part == "ssm_conv1d":
                weight = GGUFWeight(weight.ggml_type, weight.array[:, None, :], weight.in_features)
            elif part == "ffn_gate_inp_shexp":
                weight = GGUFWeight(weight.ggml_type, weight.array.reshape(1, -1), weight.in_features)
            elif part == "attn_gate":
                continue  # joins attn_qkv below
            elif part == "attn_qkv":
                z = self._weight(f"blk.{layer}.attn_gate.weight")
                yield f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight", _qkvz(weight, z, c)
                continue
            yield f"{hf}.{suffix}" if suffix else hf, weight


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of each llama head's q/k rows, (head, half, i) ->
    # (head, i, half), for its rope kernel; Hugging Face's rotate_half wants them back.
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(rows.shape)


def _qkvz(qkv: GGUFWeight, z: GGUFWeight, c: dict[str, Any]) -> GGUFWeight:
    """llama.cpp's [q | k | v] (all heads) and [z] back into Hugging Face's in_proj_qkvz, grouped by key head:
    per head [q, k, v of its value heads, z of its value heads]."""
    if qkv.ggml_type != z.ggml_type:
        qkv, z = (GGUFWeight(GGMLQuantizationType.F32, w.float32(), w.in_features) for w in (qkv, z))
    hk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    group = c["linear_num_value_heads"] // hk * c["linear_value_head_dim"]
    width = qkv.array.shape[-1]
    q, k, v = np.split(qkv.array, [hk * dk, 2 * hk * dk])
    parts = [q.reshape(hk, dk, width), k.reshape(hk, dk, width), v.reshape(hk, group, width), z.array.reshape(hk, group, width)]
    return GGUFWeight(qkv.ggml_type, np.concatenate(parts, axis=1).reshape(-1, width), qkv.in_features)
