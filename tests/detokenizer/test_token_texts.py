"""Token texts for logprobs: each token's exact bytes, which concatenate to the text, even when a token
holds part of a character."""

from __future__ import annotations

import pytest

from shared.token_texts import TokenTexts

from .conftest import SAMPLES


@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_concatenate_to_the_text(tokenizer, text: str) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(text, add_special_tokens=False)
    # SentencePiece's normaliser starts the text with a word boundary (a space that decode() strips).
    prefix = b" " if tokenizer.convert_ids_to_tokens(ids[0]).startswith("▁") else b""
    assert b"".join(texts(i)[1] for i in ids) == prefix + text.encode()


def test_partial_characters_have_their_bytes_and_a_replacement_text(byte_level) -> None:
    texts = TokenTexts(byte_level)
    ids = byte_level.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1  # unseen in training: one token per byte
    parts = [texts(i) for i in ids]
    assert b"".join(raw for _, raw in parts) == "🦀".encode()
    assert all(text == "\ufffd" for text, _ in parts)


def test_special_tokens_show_their_own_text(tokenizer) -> None:
    texts = TokenTexts(tokenizer)
    eos = tokenizer.eos_token_id
    assert texts(eos) == (tokenizer.eos_token, tokenizer.eos_token.encode())


def test_the_default_model_tokens() -> None:
    from shared.config import DEFAULT_MODEL_DIR
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    texts = TokenTexts(tokenizer)
    text = "Hello, wörld! 你好 😀"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(texts(i)[1] for i in ids) == text.encode()
    assert texts(ids[0]) == ("Hello", b"Hello")
