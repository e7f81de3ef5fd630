"""IncrementalDetokenizer: streamed text equals decode() of the whole output, and never
shows half a character on the way."""

from __future__ import annotations

import random

import pytest

from shared.detokenize.incremental import REPLACEMENT, IncrementalDetokenizer

from .conftest import SAMPLES, UNSEEN, stream


def chunkings(n: int, rng: random.Random) -> list[list[int]]:
    out = [[1] * n, [n]]
    for _ in range(6):
        sizes, left = [], n
        while left:
            sizes.append(min(left, rng.choice([0, 1, 1, 2, 3, 5, 8])))
            left -= sizes[-1]
        out.append(sizes)
    return out


def sequences(tokenizer, rng: random.Random) -> list[list[int]]:
    """Encoded samples with special tokens mixed in, random splices of them, and (byte-level
    BPE only) random ids, which are often invalid UTF-8.

    Byte-fallback tokenizers get no random ids: when a run of byte tokens is not valid UTF-8,
    decode() turns every byte of the run into U+FFFD, including characters completed (and
    streamed) earlier in the run, which no streaming decoder can take back.
    """
    special = tokenizer.all_special_ids
    samples = [tokenizer.encode(text, add_special_tokens=False) for text in SAMPLES]
    seqs = []
    for ids in samples:
        ids.insert(rng.randrange(len(ids)), special[-1])
        seqs.append([special[0], *ids, special[-1]])
    for _ in range(30):
        if tokenizer.backend_tokenizer.model.byte_fallback:
            seqs.append([i for _ in range(4) for i in rng.choice(samples)[: rng.randrange(1, 12)]])
        else:
            seqs.append([rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))])
    return seqs


@pytest.mark.parametrize("skip", [True, False])
def test_any_chunking_reproduces_decode(tokenizer, skip):
    rng = random.Random(7)
    for ids in sequences(tokenizer, rng):
        expected = tokenizer.decode(ids, skip_special_tokens=skip)
        for sizes in chunkings(len(ids), rng):
            deltas, tail = stream(tokenizer, ids, sizes, skip)
            assert "".join(deltas) + tail == expected, (ids, sizes)


def test_split_characters_never_stream_a_replacement_character(tokenizer):
    crab = tokenizer.encode(UNSEEN, add_special_tokens=False)
    assert any(tokenizer.decode([i]) == REPLACEMENT for i in crab), "test needs characters split across tokens"
    rng = random.Random(3)
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        for sizes in chunkings(len(ids), rng):
            deltas, tail = stream(tokenizer, ids, sizes)
            assert not any(REPLACEMENT in d for d in deltas), deltas
            assert "".join(deltas) == text and tail == ""


def test_skip_special_tokens(byte_level):
    ids = byte_level.encode("<|im_start|>Hi 😀<|im_end|>", add_special_tokens=False)
    sizes = [1] * len(ids)
    assert "".join(stream(byte_level, ids, sizes, skip=True)[0]) == "Hi 😀"
    assert "".join(stream(byte_level, ids, sizes, skip=False)[0]) == "<|im_start|>Hi 😀<|im_end|>"


def test_sentencepiece_keeps_spaces_between_words(sentencepiece):
    ids = sentencepiece.encode("Hello world Café 😀 你好", add_special_tokens=False)
    deltas, _ = stream(sentencepiece, ids, [1] * len(ids))
    assert "".join(deltas) == "Hello world Café 😀 你好"


def test_unfinished_character_at_the_end_comes_out_at_flush(tokenizer):
    ids = tokenizer.encode("ok 🦀", add_special_tokens=False)[:-1]  # drop the crab's last byte
    deltas, tail = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas).rstrip() == "ok"
    assert tail.endswith(REPLACEMENT)
    assert "".join(deltas) + tail == tokenizer.decode(ids)


class _WindowSpy:
    """A tokenizer that records how many ids each decode() call is given."""

    def __init__(self, tokenizer):
        self._tokenizer, self.longest = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self._tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("text", ["Hello world! Café 😀 你好 " * 40, REPLACEMENT * 200])
def test_each_call_decodes_a_short_window(byte_level, text):
    """Cost per token stays flat as the output grows, even when a model keeps emitting U+FFFD."""
    spy = _WindowSpy(byte_level)
    detok = IncrementalDetokenizer(spy)
    ids = byte_level.encode(text, add_special_tokens=False)
    streamed = "".join(detok.add([i]) for i in ids)
    assert len(ids) > 300 and spy.longest <= 12
    assert len(streamed) >= len(text) - 3 and streamed + detok.flush() == text
