"""Tokenizer loading, shared by the api (templating, tokenization) and the detokenizer."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def load_tokenizer(model_path: str):
    """The model directory's fast tokenizer (with its chat template), or one built from a GGUF file's metadata;
    never touches a hub."""
    from shared.model_info import is_gguf

    if is_gguf(model_path):
        from shared.gguf_model import open_gguf

        return open_gguf(model_path).hf_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)
