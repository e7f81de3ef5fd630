"""The MoE benchmark model: a seeded random ``qwen3_moe`` checkpoint whose active path is the default model's
size (SmolLM2-135M's attention, 64 experts of 192, top-8: ~135M active of ~0.7B parameters) with SmolLM2's
tokenizer, written as HF safetensors and as GGUF (BF16, then Q4_0 and Q8_0) by llama.cpp's own
``convert_hf_to_gguf.py`` and ``llama-quantize``, so that tokenyard and llama-server serve the same weights.

    python -m bench.moe_model [--out models/moe-bench] [--seed 0] [--shape a135m|tiny] \\
        [--hot-experts 8 --hot-bias 3] [--gguf-types Q4_0 Q8_0 | --no-gguf]

Writes ``OUT/`` (config.json, model.safetensors in bfloat16, the tokenizer files, moe_bench.json: how it was
made) and ``OUT.BF16.gguf``, ``OUT.Q4_0.gguf``, ``OUT.Q8_0.gguf`` beside it.
The same arguments give the same bytes. The GGUFs need ``bench/peer/build_llama_server.sh`` (it builds
llama-quantize and unpacks the llama.cpp sources that hold the converter).

Random weights are shaped so that a benchmark's output is text of the requested length: the tied
embeddings of special tokens and of tokens that decode to anything but printable ASCII are scaled down, so
no greedy or sampled step picks them (no end of turn, no empty or partial-UTF-8 chunks), and the layers'
contributions (the MoE's as much as attention's) outweigh the token's own embedding, so the next token
depends on the context rather than repeating one token.

Skewed routing (``--hot-experts K --hot-bias B``): in every layer a seeded subset of K experts gets about B
added to its router logit. The last hidden channel carries a constant that only the routers read (every
projection's input column and output row on it are zero, and the final norm drops it); each hot expert's
router weight on it is calibrated per layer from a forward pass in transformers so that the bias is B on
average. The measured share of routed slots that land on hot experts is printed and kept in moe_bench.json.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch

from shared.config import DEFAULT_MODEL_DIR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_DIR = os.environ.get("PEER_DIR", os.path.join(REPO, "bench", "peer", "build"))
DEFAULT_OUT = os.path.join(REPO, "models", "moe-bench")
GGUF_TYPES = ("Q4_0", "Q8_0")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

EMBED_STD = 0.15  # tied: the logits' spread is EMBED_STD * sqrt(hidden) (~3.6 at 576); the layers add ~1 a channel each
SWIGLU_VAR = 0.355  # E[(silu(g) * u)^2] for standard normal g, u
MUTED_SCALE = 0.01  # embedding rows of tokens no step should pick
BIAS_CHANNEL_VALUE = 1.0  # the constant the routers read in the last hidden channel


@dataclass(frozen=True)
class MoeShape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    max_position_embeddings: int
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5


SHAPES = {
    # SmolLM2-135M-Instruct's attention, hidden size and depth; its 1536-wide MLP becomes 8 active experts of 192
    "a135m": MoeShape(576, 30, 9, 3, 64, 64, 8, 192, 8192),
    # for tests: steps take milliseconds
    "tiny": MoeShape(64, 2, 4, 2, 16, 8, 2, 32, 4096),
}


@dataclass(frozen=True)
class MoeSpec:
    shape: str = "a135m"
    seed: int = 0
    hot_experts: int = 0
    hot_bias: float = 0.0

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {sorted(SHAPES)}, not {self.shape!r}")
        if not 0 <= self.hot_experts < SHAPES[self.shape].num_experts:
            raise ValueError(f"hot_experts must be in [0, {SHAPES[self.shape].num_experts}), not {self.hot_experts}")


def hf_config(shape: MoeShape, vocab_size: int) -> dict:
    """config.json as published Qwen3-MoE checkpoints spell it (every layer sparse, top-k weights renormalized as llama.cpp does)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.num_experts_per_tok * shape.moe_intermediate_size,  # unused: every layer is sparse
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def _randn(seed: int, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
    """N(0, std²) from a generator seeded by (seed, name): a tensor never depends on the order of the others."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1
    return torch.randn(shape, generator=torch.Generator().manual_seed(key)) * std


@functools.cache
def muted_tokens(tokenizer_dir: str) -> torch.Tensor:
    """A bool per token id: special tokens and tokens whose text is empty or not printable ASCII."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    special = set(tokenizer.get_added_tokens_decoder())  # ids of the added (control) tokens
    texts = tokenizer.decode_batch([[i] for i in range(tokenizer.get_vocab_size())], skip_special_tokens=False)
    return torch.tensor([i in special or not text or not all(" " <= c <= "~" for c in text) for i, text in enumerate(texts)])


def make_weights(spec: MoeSpec, muted: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in float32 under transformers' published names (one tensor per expert)."""
    s, seed = SHAPES[spec.shape], spec.seed
    hidden, inter, heads, kv, hd = s.hidden_size, s.moe_intermediate_size, s.num_attention_heads, s.num_key_value_heads, s.head_dim
    bias = hidden - 1  # the channel only the routers read
    w: dict[str, torch.Tensor] = {}

    embed = _randn(seed, "embed", (len(muted), hidden), EMBED_STD)
    embed[muted] *= MUTED_SCALE
    embed[:, bias] = BIAS_CHANNEL_VALUE
    w["model.embed_tokens.weight"] = embed
    final_norm = torch.ones(hidden)
    final_norm[bias] = 0.0
    w["model.norm.weight"] = final_norm

    def reads(t: torch.Tensor) -> torch.Tensor:  # a projection from the hidden state ignores the bias channel
        t[..., bias] = 0.0
        return t

    def writes(t: torch.Tensor) -> torch.Tensor:  # a projection into the hidden state leaves it alone
        t[..., bias, :] = 0.0
        return t

    for layer in range(s.num_hidden_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = reads(_randn(seed, p + "q", (heads * hd, hidden), hidden**-0.5))
        w[p + "self_attn.k_proj.weight"] = reads(_randn(seed, p + "k", (kv * hd, hidden), hidden**-0.5))
        w[p + "self_attn.v_proj.weight"] = reads(_randn(seed, p + "v", (kv * hd, hidden), hidden**-0.5))
        w[p + "self_attn.o_proj.weight"] = writes(_randn(seed, p + "o", (hidden, heads * hd), (heads * hd) ** -0.5))
        w[p + "self_attn.q_norm.weight"] = torch.ones(hd)
        w[p + "self_attn.k_norm.weight"] = torch.ones(hd)
        w[p + "mlp.gate.weight"] = reads(_randn(seed, p + "router", (s.num_experts, hidden), hidden**-0.5))
        gate = reads(_randn(seed, p + "experts.gate", (s.num_experts, inter, hidden), hidden**-0.5))
        up = reads(_randn(seed, p + "experts.up", (s.num_experts, inter, hidden), hidden**-0.5))
        # top-k weights near 1/k: experts of unit output variance would add only 1/k a channel, and 30 layers of
        # mostly attention collapse every context onto one token; this keeps the MoE's sum near unit variance
        down = writes(_randn(seed, p + "experts.down", (s.num_experts, hidden, inter), (s.num_experts_per_tok / (SWIGLU_VAR * inter)) ** 0.5))
        for e in range(s.num_experts):
            w[f"{p}mlp.experts.{e}.gate_proj.weight"] = gate[e].clone()
            w[f"{p}mlp.experts.{e}.up_proj.weight"] = up[e].clone()
            w[f"{p}mlp.experts.{e}.down_proj.weight"] = down[e].clone()
    return w


def hot_expert_sets(spec: MoeSpec) -> list[list[int]]:
    """Each layer's hot experts: a seeded subset of hot_experts ids."""
    s = SHAPES[spec.shape]
    return [
        sorted(torch.randperm(s.num_experts, generator=torch.Generator().manual_seed(spec.seed * 1000 + layer))[: spec.hot_experts].tolist())
        for layer in range(s.num_hidden_layers)
    ]


def calibration_text(n_prompts: int = 8) -> list[str]:
    with open(os.path.join(REPO, "bench", "workloads", "chat-128.json")) as f:
        return json.load(f)["prompts"][:n_prompts]


def router_inputs(model, input_ids: torch.Tensor) -> list[torch.Tensor]:  # noqa: ANN001 (a transformers model)
    """Each layer's router input (the normed hidden state), from one forward pass."""
    captured: list[torch.Tensor] = []
    hooks = [
        layer.mlp.gate.register_forward_pre_hook(lambda _m, args: captured.append(args[0].detach().reshape(-1, args[0].shape[-1])))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def chat_token_ids(out: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    ids: list[int] = []
    for prompt in calibration_text():
        ids += tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False)
    return torch.tensor([ids])


def write_hf(out: str, spec: MoeSpec, tokenizer_dir: str = DEFAULT_MODEL_DIR) -> dict:
    """Writes the HF checkpoint to ``out``; returns what moe_bench.json records."""
    from safetensors.torch import save_file

    muted = muted_tokens(tokenizer_dir)
    weights = make_weights(spec, muted)
    os.makedirs(out, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out, name))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf_config(SHAPES[spec.shape], len(muted)), f, indent=2)
    safetensors_path = os.path.join(out, "model.safetensors")

    def save() -> None:
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, safetensors_path, metadata={"format": "pt"})

    save()
    record: dict = {"maker": "bench.moe_model", **asdict(spec), "muted_tokens": int(muted.sum())}
    if spec.hot_experts:
        hot = hot_expert_sets(spec)
        record["hot_sets"] = hot
        record["hot_share"] = _calibrate(out, spec, weights, hot)
        save()
    with open(os.path.join(out, "moe_bench.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def _calibrate(out: str, spec: MoeSpec, weights: dict[str, torch.Tensor], hot: list[list[int]]) -> float:
    """Sets each hot expert's router weight on the bias channel so that its logit gains hot_bias on average
    over the calibration prompts; returns the measured share of routed slots on hot experts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = chat_token_ids(out)
    bias = SHAPES[spec.shape].hidden_size - 1
    for index, (layer, x) in enumerate(zip(model.model.layers, router_inputs(model, ids))):
        channel = x[:, bias].mean().item()  # bf16-exact router weights reach this layer's input in fp32
        value = torch.tensor(spec.hot_bias / channel).to(torch.bfloat16).float()
        weights[f"model.layers.{index}.mlp.gate.weight"][hot[index], bias] = value
        with torch.no_grad():
            layer.mlp.gate.weight[hot[index], bias] = value
    hits = total = 0
    for index, (layer, x) in enumerate(zip(model.model.layers, router_inputs(model, ids))):
        top = torch.topk(x @ layer.mlp.gate.weight.T, SHAPES[spec.shape].num_experts_per_tok, dim=-1).indices
        hits += int(torch.isin(top, torch.tensor(hot[index])).sum())
        total += top.numel()
    return hits / total


def llama_cpp_dir() -> str:
    """The llama.cpp sources that build_llama_server.sh unpacked (they hold convert_hf_to_gguf.py)."""
    path = os.path.join(PEER_DIR, "llama.cpp")
    if not os.path.isfile(os.path.join(path, "convert_hf_to_gguf.py")):
        raise FileNotFoundError(f"no llama.cpp sources at {path}: run bench/peer/build_llama_server.sh")
    return path


def write_gguf(out: str, types: tuple[str, ...] = GGUF_TYPES, python: str = sys.executable) -> list[str]:
    """Converts ``out`` to ``out.BF16.gguf`` (lossless from the bf16 checkpoint) with llama.cpp's converter,
    then quantizes that to each of ``types`` with llama-quantize; returns the paths written."""
    quantize = os.path.join(PEER_DIR, "bin", "llama-quantize")
    if types and not os.access(quantize, os.X_OK):
        raise FileNotFoundError(f"no llama-quantize at {quantize}: run bench/peer/build_llama_server.sh")
    out = out.rstrip("/")
    bf16 = f"{out}.BF16.gguf"
    converter = os.path.join(llama_cpp_dir(), "convert_hf_to_gguf.py")
    subprocess.run([python, converter, out, "--outtype", "bf16", "--outfile", bf16], check=True)
    written = [bf16]
    for kind in types:
        target = f"{out}.{kind}.gguf"
        subprocess.run([quantize, bf16, target, kind, str(os.cpu_count() or 1)], check=True)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="HF directory (default: models/moe-bench, models/moe-bench-hot<K> with --hot-experts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="a135m")
    parser.add_argument("--hot-experts", type=int, default=0, help="experts per layer the routers favour (0: no skew)")
    parser.add_argument("--hot-bias", type=float, default=3.0, help="router logit added to the hot experts, on average")
    parser.add_argument("--gguf-types", nargs="+", choices=GGUF_TYPES, default=list(GGUF_TYPES), help="quantized GGUFs written besides the BF16 one")
    parser.add_argument("--no-gguf", action="store_true", help="write the HF checkpoint only")
    parser.add_argument("--tokenizer", default=DEFAULT_MODEL_DIR, help="directory holding SmolLM2's tokenizer files")
    args = parser.parse_args(argv)
    spec = MoeSpec(args.shape, args.seed, args.hot_experts, args.hot_bias if args.hot_experts else 0.0)
    out = args.out or (DEFAULT_OUT + (f"-hot{args.hot_experts}" if args.hot_experts else ""))
    record = write_hf(out, spec, args.tokenizer)
    print(f"wrote {out}: {json.dumps({k: v for k, v in record.items() if k != 'hot_sets'})}", flush=True)
    if not args.no_gguf:
        for path in write_gguf(out, tuple(args.gguf_types)):
            print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
