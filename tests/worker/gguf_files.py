"""Tiny GGUF files of each architecture, written with the ``gguf`` package the way llama.cpp's converter lays
them out (tensor names, the llama q/k rotary interleave, qwen3next's +1 norms, -exp(A_log), split GDN input
projection, stacked experts), with a byte-level tokenizer of 256 tokens, and the transformers model on the
weights the file holds (its quantized tensors dequantized) to compare against."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize
from transformers import PreTrainedModel

from .harness import build_tiny

Q = GGMLQuantizationType
ARCHS = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "qwen3_next": "qwen3next"}
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet: token i is byte i."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's LlamaModel.permute: each head's rows (half, i) -> (i, half)
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(model: PreTrainedModel, arch: str) -> dict[str, np.ndarray]:
    """The model's weights under llama.cpp's names and in its layout, float32."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    next_norm = arch == "qwen3next"  # llama.cpp stores qwen3next's zero-centred norms (all but linear_attn.norm) as 1 + w
    out = {"token_embd.weight": sd.pop("model.embed_tokens.weight"), "output_norm.weight": sd.pop("model.norm.weight") + next_norm}
    if "lm_head.weight" in sd:
        lm_head = sd.pop("lm_head.weight")
        if not c.tie_word_embeddings:
            out["output.weight"] = lm_head
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd.pop(p + "input_layernorm.weight") + next_norm
        out[b + ("post_attention_norm.weight" if next_norm else "ffn_norm.weight")] = sd.pop(p + "post_attention_layernorm.weight") + next_norm
        if p + "self_attn.q_proj.weight" in sd:
            for hf, gg in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
                for kind in ("weight", "bias"):
                    if p + f"self_attn.{hf}.{kind}" in sd:
                        w = sd.pop(p + f"self_attn.{hf}.{kind}")
                        if arch == "llama" and gg in ("attn_q", "attn_k"):
                            w = _llama_permute(w, c.num_attention_heads if gg == "attn_q" else c.num_key_value_heads)
                        out[b + f"{gg}.{kind}"] = w
            for hf, gg in (("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")):
                if p + f"self_attn.{hf}.weight" in sd:
                    out[b + f"{gg}.weight"] = sd.pop(p + f"self_attn.{hf}.weight") + next_norm
        else:  # qwen3next Gated DeltaNet
            la = p + "linear_attn."
            hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
            qkvz = sd.pop(la + "in_proj_qkvz.weight").reshape(hk, 2 * dk + 2 * hv // hk * dv, -1)
            q, k, v, z = np.split(qkvz, np.cumsum([dk, dk, hv // hk * dv]), axis=1)
            width = qkvz.shape[-1]
            out[b + "attn_qkv.weight"] = np.concatenate([x.reshape(-1, width) for x in (q, k, v)])
            out[b + "attn_gate.weight"] = z.reshape(-1, width)
            out[b + "ssm_ba.weight"] = sd.pop(la + "in_proj_ba.weight")
            out[b + "ssm_conv1d.weight"] = sd.pop(la + "conv1d.weight").squeeze(1)
            out[b + "ssm_dt.bias"] = sd.pop(la + "dt_bias")
            out[b + "ssm_a"] = -np.exp(sd.pop(la + "A_log"))
            out[b + "ssm_norm.weight"] = sd.pop(la + "norm.weight")
            out[b + "ssm_out.weight"] = sd.pop(la + "out_proj.weight")
        if p + "mlp.gate.weight" in sd:
            out[b + "ffn_gate_inp.weight"] = sd.pop(p + "mlp.gate.weight")
            e = p + "mlp.experts."
            if e + "gate_up_proj" in sd:  # transformers 5 holds the experts fused
                gate_up, inter = sd.pop(e + "gate_up_proj"), c.moe_intermediate_size
                out[b + "ffn_gate_exps.weight"], out[b + "ffn_up_exps.weight"] = gate_up[:, :inter], gate_up[:, inter:]
                out[b + "ffn_down_exps.weight"] = sd.pop(e + "down_proj")
            else:
                for hf, gg in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                    out[b + f"{gg}.weight"] = np.stack([sd.pop(f"{e}{x}.{hf}.weight") for x in range(c.num_experts)])
            if p + "mlp.shared_expert_gate.weight" in sd:
                out[b + "ffn_gate_inp_shexp.weight"] = sd.pop(p + "mlp.shared_expert_gate.weight")
                for hf, gg in (("gate_proj", "ffn_gate_shexp"), ("up_proj", "ffn_up_shexp"), ("down_proj", "ffn_down_shexp")):
                    out[b + f"{gg}.weight"] = sd.pop(p + f"mlp.shared_expert.{hf}.weight")
        else:
            for hf, gg in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                out[b + f"{gg}.weight"] = sd.pop(p + f"mlp.{hf}.weight")
    assert not sd, f"tensors left unwritten: {sorted(sd)}"
    return out


def _metadata(writer: GGUFWriter, model: PreTrainedModel, arch: str) -> None:
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    params = getattr(c, "rope_parameters", None) or {}
    writer.add_rope_freq_base(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    writer.add_vocab_size(c.vocab_size)
    if arch in ("qwen3moe", "qwen3next"):
        writer.add_expert_count(c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen3next":
        writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        writer.add_ssm_state_size(c.linear_key_head_dim)
        writer.add_ssm_group_count(c.linear_num_key_heads)
        writer.add_ssm_time_step_rank(c.linear_num_value_heads)
        writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        interval = c.layer_types.index("full_attention") + 1  # transformers keeps layer_types only
        assert all((kind == "full_attention") == ((i + 1) % interval == 0) for i, kind in enumerate(c.layer_types))
        writer.add_full_attention_interval(interval)
        writer.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 0.25)))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_tokens())
    writer.add_token_types([TokenType.NORMAL] * 256)
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


MATRICES = {"token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps"}
MATRICES |= {"ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp", "attn_qkv", "attn_gate", "ssm_ba", "ssm_out"}
_HF_PARTS = {  # a transformers tensor's name (past the layer) -> the GGUF tensor (part) its rows go to
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
    "mlp.experts.gate_up_proj": "ffn_gate_exps",  # and ffn_up_exps, of the same type
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp",
    "linear_attn.in_proj_qkvz.weight": "attn_qkv",  # and attn_gate, of the same type
    "linear_attn.in_proj_ba.weight": "ssm_ba",
    "linear_attn.out_proj.weight": "ssm_out",
}


def type_of(part: str, types: dict[str, Q]) -> Q:
    """The type a tensor (its GGUF name's part) is stored in: ``types[part]``, else ``types["matrices"]`` for a
    matrix, else F32."""
    return types.get(part, types.get("matrices", Q.F32) if part in MATRICES else Q.F32)


def _part(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


def write_gguf(model: PreTrainedModel, path: str, arch: str, types: dict[str, Q], tweak: dict | None = None) -> None:
    """``model`` as a GGUF at ``path``, each tensor in ``type_of`` its part (biases and vectors F32). ``tweak``
    overrides metadata values (key -> value) or a tensor's type (GGUF name -> type)."""
    tweak = tweak or {}
    writer = GGUFWriter(path, arch)
    _metadata(writer, model, arch)
    for key, value in tweak.items():
        if key in writer.kv_data[0]:
            writer.kv_data[0][key].value = value
    for name, w in _gguf_tensors(model, arch).items():
        qtype = tweak.get(name, type_of(_part(name), types) if name.endswith(".weight") else Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quantize(np.ascontiguousarray(w, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def stored_values(model: PreTrainedModel, types: dict[str, Q]) -> None:
    """Sets every weight of ``model`` that ``write_gguf`` quantizes (or rounds to fp16) to the values the file
    holds: each row's blocks dequantized. Row reorderings and quantization commute (blocks run along rows)."""
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        for hf, param in model.state_dict().items():
            if hf == "model.embed_tokens.weight" or (hf == "lm_head.weight" and tied):
                part = "token_embd"
            elif hf == "lm_head.weight":
                part = "output"
            else:
                part = _HF_PARTS.get(hf.split(".", 3)[-1], "")
            qtype = type_of(part, types)
            if qtype == Q.F32:
                continue
            w = param.float().numpy()
            if qtype == Q.F16:
                stored = w.astype(np.float16).astype(np.float32)
            else:
                stored = dequantize(quantize(np.ascontiguousarray(w), qtype), qtype)
            param.copy_(torch.from_numpy(stored).reshape(param.shape))


def tiny_gguf(family: str, directory: str, types: dict[str, Q], tweak: dict | None = None, **overrides: object) -> tuple[str, PreTrainedModel]:
    """A tiny random ``family`` model written as ``directory``/model.gguf, and transformers' model on the
    values that file holds."""
    arch = ARCHS[family]
    reference = build_tiny(family, directory + "/hf", **overrides)
    path = directory + "/model.gguf"
    write_gguf(reference, path, arch, types, tweak)
    stored_values(reference, types)
    return path, reference
