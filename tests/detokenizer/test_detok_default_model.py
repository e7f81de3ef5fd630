"""The embedded default model's own tokenizer streams exactly what decode() returns."""

from __future__ import annotations

import os
import random

import pytest

from shared.config import DEFAULT_MODEL_DIR
from shared.detokenize.incremental import REPLACEMENT
from shared.detokenize.request import RequestDetokState
from shared.tokenizer import load_tokenizer

from .conftest import stream

TEXT = "<|im_start|>assistant\nSure! Café 😀 🦀 你好世界, naïve ∮ 𝔘 👩‍💻.<|im_end|>\nmore"


@pytest.fixture(scope="module")
def default_tokenizer():
    if not os.path.isdir(DEFAULT_MODEL_DIR):
        pytest.fail(f"default model directory {DEFAULT_MODEL_DIR} is missing: run make setup")
    return load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_matches_decode(default_tokenizer, skip):
    ids = default_tokenizer.encode(TEXT, add_special_tokens=False)
    assert any(default_tokenizer.decode([i]) == REPLACEMENT for i in ids), "test needs split characters"
    expected = default_tokenizer.decode(ids, skip_special_tokens=skip)
    rng = random.Random(11)
    for step in [1, 1, 2, 3, 5]:
        sizes = [step] * (len(ids) // step) + [len(ids) % step]
        rng.shuffle(sizes)
        deltas, tail = stream(default_tokenizer, ids, sizes, skip)
        assert not any(REPLACEMENT in d for d in deltas)
        assert "".join(deltas) + tail == expected


def test_stop_string_on_the_default_tokenizer(default_tokenizer):
    ids = default_tokenizer.encode(TEXT, add_special_tokens=False)
    state = RequestDetokState(default_tokenizer, stop=["世界"])
    update = state.push(ids)
    assert update.text == "assistant\nSure! Café 😀 🦀 你好"
    assert update.finished_by_stop == "世界"
    completed_at = next(k for k in range(len(ids)) if "世界" in default_tokenizer.decode(ids[: k + 1]))
    assert update.completion_tokens == completed_at + 1
