"""The qwen3_moe family against transformers on tiny random checkpoints (softmax top-k routing with
and without renormalisation, MoE and dense layers mixed by ``mlp_only_layers`` and
``decoder_sparse_step``): logits and greedy continuations through paged KV, chunked prefill and
mixed batches; both expert layouts on disk; the grouped torch MoE against a per-token loop."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from services.worker.moe import experts_torch, route
from services.worker.runner import ModelRunner, RunnerConfig
from shared.frames import Slice, StepPlan

from .harness import GREEDY, Checkpoint, check_greedy_alone, check_greedy_in_mixed_batches, check_logits_after_chunked_prefill_and_in_decode, prompt_of


def test_logits_match_transformers_after_chunked_prefill_and_in_decode(tiny_qwen3_moe: Checkpoint) -> None:
    check_logits_after_chunked_prefill_and_in_decode(tiny_qwen3_moe)


def test_greedy_matches_transformers_generate_alone(tiny_qwen3_moe: Checkpoint) -> None:
    check_greedy_alone(tiny_qwen3_moe)


def test_greedy_matches_transformers_generate_in_mixed_batches(tiny_qwen3_moe: Checkpoint) -> None:
    check_greedy_in_mixed_batches(tiny_qwen3_moe)


def _fuse_experts(src: str, dst: Path) -> None:
    """Rewrite a per-expert checkpoint with each layer's experts stacked as transformers 5 holds them in memory."""
    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        layers = {name.split(".experts.")[0] for name in tensors if ".experts." in name}
        for mlp in layers:
            count = sum(1 for name in tensors if name.startswith(f"{mlp}.experts.") and name.endswith(".down_proj.weight"))
            gate_up = [torch.cat([tensors.pop(f"{mlp}.experts.{e}.{x}_proj.weight") for x in ("gate", "up")]) for e in range(count)]
            tensors[f"{mlp}.experts.gate_up_proj"] = torch.stack(gate_up)
            tensors[f"{mlp}.experts.down_proj"] = torch.stack([tensors.pop(f"{mlp}.experts.{e}.down_proj.weight") for e in range(count)])
        save_file(tensors, shard, metadata={"format": "pt"})


def test_fused_and_per_expert_layouts_load_to_the_same_model(tmp_path: Path, tiny_qwen3_moes: dict[str, Checkpoint]) -> None:
    tiny = tiny_qwen3_moes["renorm-dense-middle"]
    _fuse_experts(tiny.path, tmp_path / "fused")
    prompt = prompt_of(4, 13)
    plan = StepPlan(0, [Slice("r", 0, 13, prompt, [2, 0, 3, 1], sampling=GREEDY)])
    per_expert = ModelRunner(RunnerConfig(tiny.path, num_blocks=4, block_size=4)).logits(plan)["r"]
    fused = ModelRunner(RunnerConfig(str(tmp_path / "fused"), num_blocks=4, block_size=4)).logits(plan)["r"]
    assert torch.equal(fused, per_expert)


def test_describe_reports_the_moe_backend_and_every_parameter_once(tiny_qwen3_moes: dict[str, Checkpoint]) -> None:
    for tiny, moe_layers in zip(tiny_qwen3_moes.values(), (2, 1)):
        facts = ModelRunner(RunnerConfig(tiny.path, num_blocks=4, block_size=4)).describe()
        config = tiny.reference.config
        assert facts["family"] == "qwen3_moe" and facts["moe_backend"] == "torch"
        assert (facts["num_experts"], facts["num_experts_per_tok"], facts["moe_layers"]) == (config.num_experts, config.num_experts_per_tok, moe_layers)
        assert facts["param_count"] == tiny.reference.num_parameters()


def test_grouped_torch_moe_equals_a_per_token_loop_on_uneven_routing() -> None:
    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 19, 24, 20, 12, 3
    x, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    w_gate_up, w_down = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    bias = torch.linspace(4, -4, experts)  # experts 0.. are popular, the last ones receive no token
    weights, ids = route(torch.randn(tokens, experts) + bias, top_k, renormalize=False)
    assert (torch.bincount(ids.flatten(), minlength=experts) == 0).any()
    expected = residual.clone()
    for t in range(tokens):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            expected[t] += w * (w_down[e] @ (F.silu(gate) * up))
    ours = experts_torch(x, w_gate_up, w_down, weights, ids, residual)
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-6
