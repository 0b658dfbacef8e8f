"""Tokenizers: text <-> ids, always stored as a Hugging Face `tokenizer.json`.

Design choices:
- One wrapper around the `tokenizers` library for every kind: character-level and byte-level BPE
  trained here, and whatever tokenizer.json a Hugging Face checkpoint ships (GPT-2, LLaMA, BERT,
  ...). So `attnlab sample` and the explorer treat every model alike.
- A character tokenizer is a WordLevel model over single characters with a Fuse decoder, so it
  round-trips any text made of its characters exactly; a character it has never seen is a UserError
  naming that character, not a silent <unk>.
- Where the library cannot give a tokenizer's ids exactly (llama.cpp's SentencePiece, whose ties
  between equal scores go by position), an `encoder` beside the backend encodes; the backend still
  decodes and is what is saved.
- `encode` adds special tokens the way the tokenizer's own post-processor does (BERT's [CLS] ...
  [SEP]), matching transformers' tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from .errors import UserError, first_line

_UNKNOWN_CHAR = "\x00"  # declared but never in a char vocabulary: an unseen character fails loudly


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's bytes_to_unicode), inverted: each byte that is printable
    Latin-1 stands for itself, the other 68 are shifted to U+0100 onward in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(0x100 + i): b for i, b in enumerate(rest)}


_BYTE_OF = _byte_alphabet()


class Tokenizer:
    """Text <-> ids for every model: a `tokenizers` backend (`kind` "char", "bpe" or "hf"), with
    an `encoder` beside it where the backend cannot give the ids exactly. A model's
    `model.tokenizer`; `model.to_tokens` and `model.to_string` go through it."""

    def __init__(self, backend, kind: str = "hf", encoder=None) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.kind = kind  # "char", "bpe" or "hf" (loaded from a checkpoint)
        # encoder(text, add_special_tokens) -> ids, where the backend's model cannot give the ids
        # exactly (llama.cpp's SentencePiece breaks ties between equal scores by position, a
        # `tokenizers` BPE by rank): encode and tokens use it; the backend still decodes, names
        # ids and is what `save` writes
        self.encoder = encoder

    # Building -------------------------------------------------------------------------------------
    @classmethod
    def train_char(cls, text: str) -> "Tokenizer":
        """One id per distinct character of `text`, in sorted order (as nanoGPT's
        shakespeare_char)."""
        chars = sorted(set(text) - {_UNKNOWN_CHAR})
        if not chars:
            raise UserError("cannot build a character tokenizer from empty text")
        return cls.from_chars({c: i for i, c in enumerate(chars)})

    @classmethod
    def from_chars(cls, vocab: dict[str, int]) -> "Tokenizer":
        """A character tokenizer with the ids `vocab` gives (character -> id): what train_char
        builds, and what a GGUF file's single-character vocabulary is read back as."""
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as Backend

        if _UNKNOWN_CHAR in vocab or any(len(c) != 1 for c in vocab):
            raise UserError("a character vocabulary holds single characters other than NUL")
        backend = Backend(models.WordLevel(vocab, unk_token=_UNKNOWN_CHAR))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        backend.decoder = decoders.Fuse()
        return cls(backend, "char")

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> "Tokenizer":
        """Byte-level BPE (GPT-2's scheme) trained on `texts` up to `vocab_size` ids."""
        from tokenizers import ByteLevelBPETokenizer

        if vocab_size < 257:
            raise UserError(
                "--vocab-size must be at least 257 for byte-level BPE (256 bytes + merges), got "
                f"{vocab_size}"
            )
        trainer = ByteLevelBPETokenizer()
        trainer.train_from_iterator(
            texts, vocab_size=vocab_size, min_frequency=2, show_progress=False
        )
        return cls(trainer._tokenizer, "bpe")

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer a `tokenizer.json` file holds; a malformed file is a UserError."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on malformed JSON
            raise UserError(f"{path}: not a valid tokenizer.json ({first_line(exc)})") from None
        model = backend.get_vocab_size() and backend.model
        kind = (
            "char"
            if type(model).__name__ == "WordLevel" and model.unk_token == _UNKNOWN_CHAR
            else "hf"
        )
        # Some tokenizer.json files store fixed padding/truncation (MiniLM pads to 128);
        # transformers' tokenizer ignores them unless asked, and so does encode here: one text ->
        # exactly its own ids.
        backend.no_padding()
        backend.no_truncation()
        return cls(backend, kind)

    def save(self, path: str | Path) -> None:
        """Write it as a Hugging Face `tokenizer.json` at `path`."""
        self.backend.save(str(path))

    def to_json(self) -> str:
        """The text `save` writes (tokenizer.json), for a writer that takes bytes."""
        return self.backend.to_str(pretty=True)

    # Using ----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the special tokens the tokenizer's post-processor adds (BERT's
        [CLS] ... [SEP]) unless add_special_tokens=False; a character a character-level tokenizer
        never saw is a UserError naming it."""
        if self.kind == "char":
            vocab = self.backend.get_vocab()
            # one id per character: a dict lookup, much faster than the backend
            if self._plain_char():
                try:
                    return [vocab[c] for c in text]
                except KeyError:
                    pass  # the error below names every unseen character
            unknown = sorted({c for c in text if c not in vocab})
            if unknown:
                shown = ", ".join(repr(c) for c in unknown[:5])
                raise UserError(
                    f"the text has characters this character-level model never saw: {shown}"
                    f"{' ...' if len(unknown) > 5 else ''}; remove them or train with --tokenizer "
                    "bpe"
                )
        if self.encoder is not None:
            return self.encoder(text, add_special_tokens)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def _plain_char(self) -> bool:
        """A character tokenizer as train_char builds it: nothing but the per-character vocabulary
        (no normalizer, no post-processor, no added tokens), so its ids are exactly one vocabulary
        lookup per character."""
        b = self.backend
        return (
            b.normalizer is None and b.post_processor is None and not b.get_added_tokens_decoder()
        )

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (special tokens left out with skip_special_tokens=True)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def tokens(self, text: str, add_special_tokens: bool = True) -> list[str]:
        """The token strings of `text`, for labelling views: what each id stands for, as `label`
        shows it."""
        if self.kind == "char":
            return list(text)
        if self.encoder is not None:
            return [self.label(i) for i in self.encode(text, add_special_tokens)]
        pieces = self.backend.encode(text, add_special_tokens=add_special_tokens).tokens
        return [self._readable(t) for t in pieces]

    def id_to_token(self, index: int) -> str:
        """The vocabulary's own string for an id (byte-level BPE's stand-ins included)."""
        return self.backend.id_to_token(index) or ""

    def label(self, index: int) -> str:
        """What one token reads as, for labelling views: byte-level BPE writes each byte as a
        printable stand-in (GPT-2's alphabet: "Ġ" a space, "Ċ" a newline); here they are the
        text's own characters again (a piece of a multi-byte character shows as U+FFFD)."""
        return self._readable(self.id_to_token(index))

    def _readable(self, piece: str) -> str:
        if not self._byte_level():
            return piece
        raw = bytes(_BYTE_OF.get(c, 0x3F) for c in piece)  # "?" for a char outside the alphabet
        return raw.decode("utf-8", errors="replace")

    def _byte_level(self) -> bool:
        from tokenizers import decoders

        return isinstance(self.backend.decoder, decoders.ByteLevel)

    def __repr__(self) -> str:
        return f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size})"
