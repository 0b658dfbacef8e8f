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
