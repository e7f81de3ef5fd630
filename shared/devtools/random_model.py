"""Random Llama checkpoints with SmolLM2's vocabulary and tokenizer files, built here with no network:
``tiny`` (2 layers of 64: steps take milliseconds; the stack tests' model) and ``smollm2-135m`` (the default
model's exact shapes: serving runs on a machine the 540 MB weights cannot travel to, such as a lent GPU), and
a tiny hybrid ``qwen3_next`` (``--shape hybrid``: Gated DeltaNet and full attention, the hybrid stack tests' model;
``--mtp`` adds a random MTP layer for ``--speculative-method mtp``).

    python -m shared.devtools.random_model DIR [--shape tiny|smollm2-135m] [--dtype float32|bfloat16] [--initializer-range 0.02]

Greedy comparisons across batch sizes or devices want a large ``initializer_range`` (0.2): the top logits
are then far apart, so rounding never flips a greedy token.
"""

from __future__ import annotations

import argparse
import os
import shutil

from shared.config import DEFAULT_MODEL_DIR

SHAPES: dict[str, dict[str, int | float]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096),
    # SmolLM2-135M-Instruct's config.json
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
}


def build_random_smollm(path: str, shape: str = "tiny", initializer_range: float = 0.02, dtype: str = "float32", tokenizer_dir: str = DEFAULT_MODEL_DIR) -> str:
    """Writes the checkpoint (seeded: the same weights every time) and SmolLM2's tokenizer files to ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=initializer_range, **SHAPES[shape])
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


# A hybrid qwen3_next: Gated DeltaNet layers around full attention (every 4th layer), a small MoE with a shared expert.
HYBRID_SHAPE: dict[str, object] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    max_position_embeddings=8192,
)


def build_random_qwen3_next(path: str, initializer_range: float = 0.2, tokenizer_dir: str = DEFAULT_MODEL_DIR, mtp: bool = False, **overrides: object) -> str:
    """A seeded random hybrid (qwen3_next) checkpoint with SmolLM2's vocabulary and tokenizer files at ``path``; with
    ``mtp``, also a random multi-token-prediction layer (``mtp.*``, shaped as its last full-attention layer, in
    ``mtp.safetensors``), which transformers' model does not hold."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        vocab_size=49152, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=initializer_range, **{**HYBRID_SHAPE, **overrides}
    )
    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(config)
    model.save_pretrained(path)
    if mtp:
        full = max(i for i, kind in enumerate(config.layer_types) if kind == "full_attention")
        layer = f"model.layers.{full}."
        weights = {
            "mtp.layers.0." + n.removeprefix(layer): torch.randn(t.shape) * initializer_range for n, t in model.state_dict().items() if n.startswith(layer)
        }
        weights["mtp.fc.weight"] = torch.randn(config.hidden_size, 2 * config.hidden_size) * initializer_range
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            weights[f"mtp.{norm}.weight"] = torch.zeros(config.hidden_size)  # zero-centred: scales by 1
        save_file(weights, os.path.join(path, "mtp.safetensors"))
    for name in os.listdir(tokenizer_dir):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--shape", choices=[*sorted(SHAPES), "hybrid"], default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--initializer-range", type=float, default=0.02)
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL_DIR, help="directory holding SmolLM2's tokenizer files")
    parser.add_argument("--mtp", action="store_true", help="hybrid: also a random MTP layer (for --speculative-method mtp)")
    args = parser.parse_args()
    if args.shape == "hybrid":
        print(build_random_qwen3_next(args.path, args.initializer_range, args.tokenizer, args.mtp))
    else:
        print(build_random_smollm(args.path, args.shape, args.initializer_range, args.dtype, args.tokenizer))


if __name__ == "__main__":
    main()
