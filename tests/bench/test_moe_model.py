"""bench.moe_model: the MoE benchmark checkpoint is the same bytes for the same seed, loads in transformers,
writes printable text, and its skewed routers send most routed slots to the hot experts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bench.moe_model import SHAPES, MoeSpec, make_weights, muted_tokens, write_hf
from shared.config import DEFAULT_MODEL_DIR


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("moe") / "tiny")
    write_hf(path, MoeSpec("tiny", seed=0))
    return path


def _bytes(path: str) -> dict[str, bytes]:
    return {name: open(os.path.join(path, name), "rb").read() for name in sorted(os.listdir(path))}


def test_the_same_seed_writes_the_same_bytes_and_another_seed_other_weights(tiny, tmp_path) -> None:
    write_hf(str(tmp_path / "again"), MoeSpec("tiny", seed=0))
    assert _bytes(str(tmp_path / "again")) == _bytes(tiny)
    muted = muted_tokens(DEFAULT_MODEL_DIR)
    seed0, seed1 = make_weights(MoeSpec("tiny", seed=0), muted), make_weights(MoeSpec("tiny", seed=1), muted)
    assert not torch.equal(seed0["model.layers.0.mlp.experts.0.up_proj.weight"], seed1["model.layers.0.mlp.experts.0.up_proj.weight"])


def test_the_benchmark_shape_is_the_default_models_attention_and_depth() -> None:
    with open(os.path.join(DEFAULT_MODEL_DIR, "config.json")) as f:
        dense = json.load(f)
    shape = SHAPES["a135m"]
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps"):
        assert getattr(shape, key) == dense[key], key
    assert (shape.num_experts, shape.num_experts_per_tok, shape.moe_intermediate_size) == (64, 8, 192)
    assert shape.num_experts_per_tok * shape.moe_intermediate_size == dense["intermediate_size"]  # the same active MLP


def test_transformers_loads_it_and_greedy_text_is_printable_and_varied(tiny) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_experts == SHAPES["tiny"].num_experts
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about lighthouses."}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)[0, ids["input_ids"].shape[1] :]
    assert len(out) == 24  # no end of turn
    muted = muted_tokens(DEFAULT_MODEL_DIR)
    assert not muted[out].any()
    assert len(set(out.tolist())) > 4, tokenizer.decode(out)


def test_hot_experts_take_most_routed_slots(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    write_hf(str(tmp_path / "hot"), MoeSpec("tiny", seed=0, hot_experts=2, hot_bias=3.0))
    with open(tmp_path / "hot" / "moe_bench.json") as f:
        record = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hot"), dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=generator)
    router_logits = model(ids, output_router_logits=True).router_logits  # one [tokens, experts] per layer
    hits = sum(int(torch.isin(logits.topk(2).indices, torch.tensor(hot)).sum()) for logits, hot in zip(router_logits, record["hot_sets"]))
    share = hits / (len(router_logits) * 64 * 2)
    assert share > 0.6  # 2 of 8 experts: 0.25 without skew
    assert record["hot_share"] > 0.6
