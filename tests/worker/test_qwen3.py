"""The dense qwen3 family against transformers on tiny random checkpoints (per-head q/k RMSNorm,
head_dim apart from hidden / heads, attention biases, tied and untied embeddings): logits and
greedy continuations through paged KV, chunked prefill and mixed batches."""

from __future__ import annotations

import json
import shutil

import pytest

from services.worker.runner import ModelRunner, RunnerConfig

from .harness import Checkpoint, check_greedy_alone, check_greedy_in_mixed_batches, check_logits_after_chunked_prefill_and_in_decode


def test_logits_match_transformers_after_chunked_prefill_and_in_decode(tiny_qwen3: Checkpoint) -> None:
    check_logits_after_chunked_prefill_and_in_decode(tiny_qwen3)


def test_greedy_matches_transformers_generate_alone(tiny_qwen3: Checkpoint) -> None:
    check_greedy_alone(tiny_qwen3)


def test_greedy_matches_transformers_generate_in_mixed_batches(tiny_qwen3: Checkpoint) -> None:
    check_greedy_in_mixed_batches(tiny_qwen3)


def test_describe_counts_every_parameter_once(tiny_qwen3s: dict[str, Checkpoint]) -> None:
    for tiny in tiny_qwen3s.values():
        facts = ModelRunner(RunnerConfig(tiny.path, num_blocks=4, block_size=4)).describe()
        assert facts["family"] == "qwen3" and facts["head_dim"] == tiny.reference.config.head_dim
        assert facts["param_count"] == tiny.reference.num_parameters()
        assert "moe_backend" not in facts


@pytest.mark.parametrize("patch", [{"use_sliding_window": True}, {"hidden_act": "gelu"}])
def test_unsupported_configs_are_rejected(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3s: dict[str, Checkpoint], patch: dict) -> None:
    path = tmp_path_factory.mktemp("patched") / "model"
    shutil.copytree(tiny_qwen3s["untied-bias"].path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | patch))
    with pytest.raises(ValueError, match="sliding-window attention|hidden_act 'gelu'"):
        ModelRunner(RunnerConfig(str(path), 4, 4))
