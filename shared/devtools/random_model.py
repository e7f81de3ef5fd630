"""Random Llama checkpoints with SmolLM2's vocabulary and tokenizer files, built here with no network:
``tiny`` (2 layers of 64: steps take milliseconds; the stack tests' model) and ``smollm2-135m`` (the default
model's exact shapes: serving runs on a machine the 540 MB weights cannot travel to, such as a lent GPU).

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--initializer-range", type=float, default=0.02)
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL_DIR, help="directory holding SmolLM2's tokenizer files")
    args = parser.parse_args()
    print(build_random_smollm(args.path, args.shape, args.initializer_range, args.dtype, args.tokenizer))


if __name__ == "__main__":
    main()
