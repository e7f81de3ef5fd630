"""The GGUF -> Hugging Face conversion: files, tokenizer, generation and the weights themselves."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from gguf import GGUFReader
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.launcher.prepare_model import (
    FILES,
    MARKER,
    default_gguf_path,
    prepare_default_model,
    prepare_model,
)
from shared.config import DEFAULT_MODEL_DIR

ROUND_TRIP = [
    "Hello, world! It's a test.",
    "Digits 0123456789 and 3.14159, -42, 1e10",
    "  leading spaces, tabs\t\tand\n\n\nnewlines   trailing   ",
    "emoji 😀🎉👍🏽 done",
    "中文测试，日本語のテキスト、한국어",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    if os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, MARKER)):
        return prepare_default_model()  # returns at once when already converted
    return prepare_model(default_gguf_path(), str(tmp_path_factory.mktemp("models") / "SmolLM2"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: str):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()


def test_directory_layout_and_config(model_dir: str) -> None:
    assert all(os.path.isfile(os.path.join(model_dir, name)) for name in FILES + (MARKER,))
    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    reader = GGUFReader(default_gguf_path())
    assert config["num_hidden_layers"] == reader.get_field("llama.block_count").contents()
    assert config["hidden_size"] == reader.get_field("llama.embedding_length").contents()
    assert config["max_position_embeddings"] == reader.get_field("llama.context_length").contents()
    assert config["rope_theta"] == 100000.0 and config["rms_norm_eps"] == 1e-05
    assert config["tie_word_embeddings"] is True
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.norm.weight").get_dtype() == "F32"
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys
    assert len(keys) == 2 + 9 * config["num_hidden_layers"]


def test_eos_is_im_end(model_dir: str, tokenizer) -> None:
    with open(os.path.join(model_dir, "generation_config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    assert eos[0] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in eos
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trip(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_like_smollm2(tokenizer) -> None:
    assert tokenizer.encode("Hello world") == [19556, 905]  # no BOS prepended
    assert len(tokenizer.encode("2024")) == 4  # the "smollm" pre-tokenizer splits every digit
    assert tokenizer.encode("<|im_start|>") == [tokenizer.convert_tokens_to_ids("<|im_start|>")]
    assert tokenizer.decode(tokenizer.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_answers_capital_of_france(tokenizer, model) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    output = model.generate(input_ids, max_new_tokens=20, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_weights_match_transformers_gguf_loader(model_dir: str, model) -> None:
    # transformers' own GGUF loader dequantizes the same data and undoes the q/k permutation itself.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reference = load_gguf_checkpoint(default_gguf_path(), return_tensors=True, model_to_load=model)["tensors"]
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(reference) - {"lm_head.weight"}
        for name in f.keys():
            assert torch.equal(f.get_tensor(name), reference[name]), name


def test_second_call_is_a_no_op(model_dir: str) -> None:
    weights = os.path.join(model_dir, "model.safetensors")
    before = os.stat(weights).st_mtime_ns
    start = time.monotonic()
    assert prepare_model(default_gguf_path(), model_dir) == model_dir
    assert time.monotonic() - start < 5 and os.stat(weights).st_mtime_ns == before
    assert not [n for n in os.listdir(os.path.dirname(model_dir)) if ".tmp-" in n]


def test_refuses_to_replace_a_foreign_directory(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileExistsError):
        prepare_model(default_gguf_path(), str(tmp_path))
