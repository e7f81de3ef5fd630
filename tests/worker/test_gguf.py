"""GGUF files served as they are: a tiny file of each architecture (llama, qwen3, qwen3moe, qwen3next), written
in llama.cpp's layout with Q4_0 / Q4_1 / Q8_0 / F16 tensors, against transformers on the weights the file
holds; its blocks reach the linears bit for bit; its tokenizer and chat template come from the metadata; and
files the stack cannot serve are refused on opening, in one line."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from services.worker.block_quant import BlockQuantized
from services.worker.linear import block_formats, linears_of
from services.worker.moe import routed_experts
from services.worker.runner import ModelRunner, RunnerConfig
from services.worker.weights import block_rows, load_gguf
from shared.frames import Slice, StepPlan
from shared.gguf_model import GGUFError, GGUFModel
from shared.model_info import load_model_info
from shared.tokenizer import load_tokenizer

from .gguf_files import tiny_gguf
from .harness import GREEDY, Checkpoint, check_logits_after_chunked_prefill_and_in_decode, drive, prompt_of, reference_greedy

CPU, F32 = torch.device("cpu"), torch.float32

# Per architecture: the tensor types of its file (a part of a GGUF tensor name, or every matrix) and the
# transformers overrides of its tiny model.
CASES = {
    # SmolLM2's mix: q4_1 projections, a tied q8_0 embedding (the lm_head multiplies its blocks)
    "llama": ({"matrices": Q.Q4_1, "token_embd": Q.Q8_0}, {"tie_word_embeddings": True}),
    # q8_0 everywhere, an fp16 lm_head, q/k/v/o biases, head_dim != hidden / heads
    "qwen3": ({"matrices": Q.Q8_0, "output": Q.F16}, {"attention_bias": True, "head_dim": 32}),
    # q4_0 projections and experts, every layer MoE, top-2 renormalised (llama.cpp's qwen3moe)
    "qwen3_moe": ({"matrices": Q.Q4_0}, {"norm_topk_prob": True, "num_hidden_layers": 2}),
    # full attention every second layer, 2 key heads for 4 value heads, shared expert in fp16
    "qwen3_next": (
        {"matrices": Q.Q8_0, "ffn_gate_shexp": Q.F16, "ffn_up_shexp": Q.F16, "ffn_down_shexp": Q.F16},
        {"num_hidden_layers": 4, "full_attention_interval": 2, "norm_topk_prob": True},
    ),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Checkpoint]:
    out = {}
    for family, (types, overrides) in CASES.items():
        path, reference = tiny_gguf(family, str(tmp_path_factory.mktemp(family)), types, **overrides)
        out[family] = Checkpoint(path, reference)
    return out


@pytest.mark.parametrize("family", list(CASES))
def test_logits_match_transformers_on_the_stored_weights(tiny_ggufs: dict[str, Checkpoint], family: str) -> None:
    # Products of blocks round activations to int16 per block of 32: ~2e-5 of a block's largest value.
    check_logits_after_chunked_prefill_and_in_decode(tiny_ggufs[family], max_rel_err=1e-3)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_greedy_matches_transformers_generate(tiny_ggufs: dict[str, Checkpoint], family: str) -> None:
    tiny, prompt = tiny_ggufs[family], prompt_of(3, 20)
    runner = ModelRunner(RunnerConfig(tiny.path, num_blocks=32, block_size=4, max_num_seqs=2))
    out, _ = drive(runner, {"r": prompt}, 16, chunk=7)
    assert out["r"] == reference_greedy(tiny.reference, prompt, 16, min_margin=1e-3)


def test_the_files_blocks_reach_the_loader_bit_for_bit(tiny_ggufs: dict[str, Checkpoint]) -> None:
    model = GGUFModel(tiny_ggufs["llama"].path)
    config, weights = load_gguf(model.path, F32, CPU, ("q4_1", "q8_0"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, BlockQuantized) and q.fmt == "q4_1"
    # block_rows moves bytes only: each row's codes, then its scales, then its minimums, as stored in the file
    raw = model.tensors["blk.0.attn_v.weight"].data.reshape(-1, 2, 20)  # rows, blocks, (d, m, 16 code bytes)
    v = weights["model.layers.0.self_attn.v_proj.weight"].data.reshape(raw.shape[0], -1)
    assert v[:, :32].numpy().tobytes() == raw[:, :, 4:].tobytes()
    assert v[:, 32:36].numpy().tobytes() == raw[:, :, 0:2].tobytes() and v[:, 36:].numpy().tobytes() == raw[:, :, 2:4].tobytes()
    # the tied q8_0 embedding: lookups read its float values, the lm_head its blocks
    assert config["tie_word_embeddings"] is False and weights["lm_head.weight"].fmt == "q8_0"
    assert torch.equal(weights["lm_head.weight"].dequantize(), weights["model.embed_tokens.weight"])


@pytest.mark.skipif(not block_formats(CPU, F32), reason="the C++ CPU kernels (block products) are unavailable here")
def test_the_linears_multiply_the_files_blocks(tiny_ggufs: dict[str, Checkpoint]) -> None:
    runner = ModelRunner(RunnerConfig(tiny_ggufs["llama"].path, num_blocks=8, block_size=4))
    facts = runner.describe()
    assert facts["block_quant_bytes"] > 0 and facts["quantized_linears"] == 4 * 3 + 1
    assert all(linear.panels is not None for linear in linears_of(runner.model))


@pytest.mark.skipif(not block_formats(CPU, F32), reason="the C++ CPU kernels (block products) are unavailable here")
def test_the_experts_run_in_the_files_blocks_in_one_call_per_layer(tiny_ggufs: dict[str, Checkpoint]) -> None:
    moe = ModelRunner(RunnerConfig(tiny_ggufs["qwen3_moe"].path, num_blocks=8, block_size=4)).describe()
    assert moe["expert_weights"] == {"q4_0: grouped_moe (C++, one call per layer)": 2} and moe["quantized_linears"] == 2 * 2 + 1  # qkv, o; the lm_head
    hybrid = ModelRunner(RunnerConfig(tiny_ggufs["qwen3_next"].path, num_blocks=8, block_size=4)).describe()
    assert hybrid["expert_weights"] == {"q8_0: grouped_moe (C++, one call per layer)": 4}  # the fp16 shared expert: a dense MLP beside


@pytest.mark.skipif(not block_formats(CPU, F32), reason="the C++ CPU kernels (block products) are unavailable here")
def test_int4_a8_rounds_activations_of_the_files_4_bit_blocks_to_int8_in_many_row_steps(tiny_ggufs: dict[str, Checkpoint]) -> None:
    """Under --weight-quant int4-a8 a GGUF's q4_0 projections and experts and its lm_head take llama.cpp's q4 / q8_0
    x q8 arithmetic in steps of more than BLOCK_QUANT_MAX_ROWS rows (all layers still in one call); few-row steps
    keep int16."""
    path = tiny_ggufs["qwen3_moe"].path
    exact, a8 = (ModelRunner(RunnerConfig(path, num_blocks=16, block_size=4, weight_quant=quant)) for quant in ("auto", "int4-a8"))
    assert a8.decoder.name == exact.decoder.name == "one-call-cpp"
    assert all(moe.int8_activations for moe in routed_experts(a8.model)) and not any(moe.int8_activations for moe in routed_experts(exact.model))
    assert {linear.activation_bits for linear in linears_of(a8.model)} == {8} and {linear.activation_bits for linear in linears_of(exact.model)} == {16}
    prompt = prompt_of(5, 20)
    theirs, ours = (runner.logits(StepPlan(0, [Slice("p", 0, len(prompt), prompt, list(range(8)), sampling=GREEDY)]))["p"] for runner in (exact, a8))
    relative = float((ours - theirs).norm() / theirs.norm())
    assert 1e-4 < relative < 0.25, relative  # measured 0.12 on this tiny random model (int8 rounding); a wrong layout gives ~1
    short = prompt[:4]
    theirs, ours = (runner.logits(StepPlan(0, [Slice("s", 0, len(short), short, list(range(8, 16)), sampling=GREEDY)]))["s"] for runner in (exact, a8))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)  # 4 rows: int16 in both


def test_block_rows_is_the_row_codec_of_the_same_weight(tiny_ggufs: dict[str, Checkpoint]) -> None:
    model = GGUFModel(tiny_ggufs["qwen3_moe"].path)
    for name, weight in model.weights():
        if weight.block_format:
            blocks = block_rows(weight)
            assert torch.equal(blocks.dequantize(), torch.from_numpy(weight.float32())), name


def test_config_and_model_info_come_from_the_metadata(tiny_ggufs: dict[str, Checkpoint]) -> None:
    for family, tiny in tiny_ggufs.items():
        info, ref = load_model_info(tiny.path), tiny.reference.config
        assert info.family == family and info.num_layers == ref.num_hidden_layers and info.vocab_size == 256
        assert info.num_kv_heads == ref.num_key_value_heads and info.eos_token_ids == (2,) and info.bos_token_id == 1
    assert load_model_info(tiny_ggufs["qwen3_next"].path).layer_types == ("linear_attention", "full_attention") * 2


def test_tokenizer_and_chat_template_come_from_the_metadata(tiny_ggufs: dict[str, Checkpoint]) -> None:
    tokenizer = load_tokenizer(tiny_ggufs["qwen3"].path)
    text = "héllo wörld 42\n"
    assert tokenizer.encode(text) == list(text.encode()) and tokenizer.decode(tokenizer.encode(text)) == text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<user>hi\n<assistant>"


def test_the_default_models_tokenizer_from_its_gguf_matches_its_directory() -> None:
    from services.launcher.prepare_model import default_gguf_path
    from shared.config import DEFAULT_MODEL_DIR

    if not os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "tokenizer.json")):
        pytest.skip("the default model directory is not prepared")
    ours, theirs = load_tokenizer(default_gguf_path()), load_tokenizer(DEFAULT_MODEL_DIR)
    for text in ("Digits 0123456789, 3.14", "<|im_start|>user\nhi<|im_end|>", "  tabs\t\tand\n\nemoji 😀 中文"):
        assert ours.encode(text) == theirs.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert (ours.eos_token, ours.pad_token, ours.bos_token) == (theirs.eos_token, theirs.pad_token, theirs.bos_token)


# Refusals: one line, naming what is wrong; the launcher exits 2 before starting anything.


def _refused(path: str) -> str:
    with pytest.raises(GGUFError) as caught:
        load_model_info(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_tensor_type_the_stack_does_not_serve_is_refused_by_name(tmp_path) -> None:
    path, _ = tiny_gguf("llama", str(tmp_path), {"matrices": Q.Q8_0}, tweak={"blk.1.ffn_down.weight": Q.Q5_0}, num_hidden_layers=2)
    message = _refused(path)
    assert "blk.1.ffn_down.weight" in message and "Q5_0" in message and "Q4_0, Q4_1, Q8_0, F32, F16, BF16" in message


def test_a_truncated_file_is_refused(tiny_ggufs: dict[str, Checkpoint], tmp_path) -> None:
    path = str(tmp_path / "short.gguf")
    with open(tiny_ggufs["qwen3"].path, "rb") as f:
        data = f.read()
    for cut in (len(data) - 1000, 200):  # in the tensor data; in the header
        with open(path, "wb") as f:
            f.write(data[:cut])
        message = _refused(path)
        assert "truncated" in message or "not a readable GGUF" in message


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path) -> None:
    path, _ = tiny_gguf("qwen3", str(tmp_path), {"matrices": Q.Q8_0}, tweak={"qwen3.attention.head_count_kv": 4}, num_hidden_layers=2)
    message = _refused(path)
    assert "blk.0.attn_k.weight" in message and "shape" in message


def test_the_launcher_refuses_a_bad_gguf_in_one_line_with_exit_2(tiny_ggufs: dict[str, Checkpoint], tmp_path, capsys) -> None:
    from services.launcher.__main__ import main

    path = str(tmp_path / "cut.gguf")
    shutil.copyfile(tiny_ggufs["llama"].path, path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 64)
    assert main(["--model", path]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"tokenyard: cannot serve --model {path}:") and "truncated" in err
