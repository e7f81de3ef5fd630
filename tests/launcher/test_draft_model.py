"""The launcher refuses at once a draft-model speculation the worker would refuse: no draft, a directory that is no
model, or a draft of another vocabulary; a draft of the model's vocabulary starts, its flag passed to every child."""

from __future__ import annotations

import json

import pytest

from services.launcher.__main__ import child_argvs
from shared.config import StackConfig


def model_dir(path, vocab_size: int) -> str:
    path.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "vocab_size": vocab_size}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_a_draft_model_of_another_vocabulary_or_none_is_refused_at_once(tmp_path) -> None:
    model, draft, other = model_dir(tmp_path / "model", 100), model_dir(tmp_path / "draft", 100), model_dir(tmp_path / "other", 120)
    with pytest.raises(SystemExit, match="needs --draft-model"):
        child_argvs(StackConfig(model=model, speculative_method="draft"))
    with pytest.raises(SystemExit, match="is not a model"):
        child_argvs(StackConfig(model=model, speculative_method="draft", draft_model=str(tmp_path / "missing")))
    with pytest.raises(SystemExit, match="vocabulary of 120 tokens but the model 100"):
        child_argvs(StackConfig(model=model, speculative_method="draft", draft_model=other))
    argvs = child_argvs(StackConfig(model=model, speculative_method="draft", draft_model=draft))
    assert all(argv[argv.index("--draft-model") + 1] == draft for name, argv in argvs.items() if name in ("scheduler", "worker"))
