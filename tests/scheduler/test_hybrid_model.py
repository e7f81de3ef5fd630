"""The scheduler process set up for a hybrid (GDN) model, read from its config.json alone: one state
slot per request that may run, KV sized for the full-attention layers, GDN state checkpoints for its prefix
cache (off without them, saying why)."""

from __future__ import annotations

import json
from pathlib import Path

import structlog

from services.scheduler.loop import SchedulerLoop
from shared.config import StackConfig
from shared.model_info import load_model_info

CONFIG = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 8,  # full_attention_interval 4 (transformers' default): layers 3 and 7 hold KV
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_size": 64,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}


def loop_for(tmp_path: Path, config: dict, **flags: object) -> SchedulerLoop:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    stack = StackConfig(model=str(model), run_dir=str(tmp_path / "run"), max_num_seqs=6, kv_cache_tokens=0, kv_cache_bytes=1 << 20, block_size=16, **flags)
    return SchedulerLoop(stack, structlog.get_logger())


def test_a_hybrid_model_gets_a_slot_per_sequence_kv_for_its_attention_layers_and_gdn_checkpoints(tmp_path: Path) -> None:
    loop = loop_for(tmp_path, CONFIG, gdn_checkpoint_slots=5, gdn_checkpoint_interval=20)
    facts = loop.instrumentation()
    assert facts["gdn_state_slots"] == {"total": 6, "used": 0}
    assert facts["prefix_cache"]["enabled"] is True and facts["prefix_cache"]["disabled_reason"] == ""
    assert facts["prefix_cache"]["gdn_checkpoints"] == {"total": 5, "used": 0, "saved": 0, "restored": 0, "interval": 32}  # whole blocks of 16
    # 2 KV layers x (k, v) x 2 heads x 32 dims x 4 bytes = 1 KiB per token: 1 MiB holds 1024 tokens, 64 blocks
    assert facts["kv_blocks_total"] == 64
    assert load_model_info(loop.config.model).num_gdn_layers == 6


def test_a_plain_model_keeps_its_prefix_cache_and_has_no_slots(tmp_path: Path) -> None:
    loop = loop_for(tmp_path, {**CONFIG, "model_type": "qwen3"})
    facts = loop.instrumentation()
    assert facts["gdn_state_slots"] is None
    assert facts["prefix_cache"]["enabled"] is True and facts["prefix_cache"]["disabled_reason"] == ""
    assert facts["kv_blocks_total"] == 16  # all 8 layers hold KV


def test_a_hybrid_model_without_checkpoint_slots_has_no_prefix_cache_and_says_why(tmp_path: Path) -> None:
    facts = loop_for(tmp_path, CONFIG, gdn_checkpoint_slots=0).instrumentation()
    assert facts["prefix_cache"]["enabled"] is False
    assert "Gated DeltaNet" in facts["prefix_cache"]["disabled_reason"] and "--gdn-checkpoint-slots 0" in facts["prefix_cache"]["disabled_reason"]
    assert "gdn_checkpoints" not in facts["prefix_cache"]
