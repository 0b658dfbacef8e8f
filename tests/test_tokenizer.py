"""The character tokenizer's fast path (one dict lookup per character) against the tokenizers
backend it stands in for."""

import random

import pytest

from attnlab.errors import UserError
from attnlab.tokenizer import Tokenizer

ALPHABET = "abc xyz\n\r\t.,;'\"é✓ü日本😀\u00a0\u2028"


def test_char_encode_equals_the_backend_on_random_texts():
    tokenizer = Tokenizer.train_char(ALPHABET)
    assert tokenizer._plain_char()
    rng = random.Random(0)
    for n in (0, 1, 7, 500):
        text = "".join(rng.choice(ALPHABET) for _ in range(n))
        assert tokenizer.encode(text) == tokenizer.backend.encode(text).ids
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_char_encode_names_unseen_characters():
    with pytest.raises(UserError, match="never saw: 'q', '€'"):
        Tokenizer.train_char("abc").encode("abq€c")


def test_a_char_tokenizer_with_added_tokens_takes_the_backend():
    """An added token spans several characters: only the backend knows to match it, so the fast path
    steps aside."""
    tokenizer = Tokenizer.train_char("abc<|>")
    tokenizer.backend.add_special_tokens(["<|>"])
    assert not tokenizer._plain_char()
    assert tokenizer.encode("a<|>b") == tokenizer.backend.encode("a<|>b").ids
    assert len(tokenizer.encode("a<|>b")) == 3


def test_byte_level_labels_read_as_the_text():
    """Views label tokens with the text they stand for: byte-level BPE's stand-ins ("Ġ" a space, "Ċ"
    a newline) are turned back into characters, and the alphabet is GPT-2's own."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from attnlab.tokenizer import _BYTE_OF

    assert _BYTE_OF == {c: b for b, c in bytes_to_unicode().items()}
    text = "def f(x):\n\treturn x  + 1\n\nThe cat sat on the mat. "
    tokenizer = Tokenizer.train_bpe([text * 20], vocab_size=300)
    ids = tokenizer.encode(text)
    labels = [tokenizer.label(i) for i in ids]
    assert "".join(labels) == text and tokenizer.tokens(text) == labels
    assert not any(c in "".join(labels) for c in "ĠĊĉ")
    assert "Ġ" in "".join(tokenizer.id_to_token(i) for i in ids)  # the vocabulary keeps its own
    # one byte of a two-byte character alone reads as U+FFFD, not as a Latin-1 letter
    lone = [i for i in tokenizer.encode("é") if len(tokenizer.label(i)) == 1]
    assert lone and {tokenizer.label(i) for i in lone} <= {"é", "\ufffd"}


def test_a_char_tokenizer_labels_each_character():
    tokenizer = Tokenizer.train_char(ALPHABET)
    assert [tokenizer.label(i) for i in tokenizer.encode(ALPHABET)] == list(ALPHABET)
