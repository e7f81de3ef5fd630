"""Tiny tokenizers trained at test time, in the two layouts real models use.

``byte_level``: GPT-2 / SmolLM style byte-level BPE, with chat special tokens.
``sentencepiece``: Llama style BPE on "▁"-joined words, byte fallback for unseen characters,
and a decoder that strips the leading space of the text.
Both are trained on text with accented letters, CJK and emoji; characters left out of the
training text (``UNSEEN``) are split into one token per UTF-8 byte.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from shared.detokenize.incremental import IncrementalDetokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café, naïve, résumé, über, señor, déjà vu, Ærø, smörgåsbord.",
    "你好世界。我们今天去公园吧。日本語のテキストです。한국어 문장도 있어요.",
    "Emoji time 😀 🎉 👍🏽 ❤️ 👩‍💻 and more 😀😀 🎉!",
    "def add(a, b):\n    return a + b  # numbers 12345 67890",
] * 4
UNSEEN = "🦀 ∮ 𝔘"  # never in the training text: one token per byte
SAMPLES = [
    "Hello world! Café 😀 你好",
    f"Crabs {UNSEEN} everywhere {UNSEEN}",
    "The quick brown fox 🎉👩‍💻 jumps. 日本語 ∮ naïve",
    "  spaced   out\n\nlines\t😀",
]


def _byte_level() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", clean_up_tokenization_spaces=False)


def _sentencepiece() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):  # byte-fallback tokens, as in a Llama vocabulary
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="session")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level()


@pytest.fixture(scope="session")
def sentencepiece() -> PreTrainedTokenizerFast:
    return _sentencepiece()


@pytest.fixture(scope="session", params=["byte_level", "sentencepiece"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    return request.getfixturevalue(request.param)


def stream(tokenizer, ids: list[int], sizes: list[int], skip: bool = True) -> tuple[list[str], str]:
    """Feeds ``ids`` in calls of the given sizes: (the deltas, what flush() returned)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    deltas, start = [], 0
    for size in sizes:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    assert start == len(ids)
    return deltas, detok.flush()
