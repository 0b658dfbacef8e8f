"""A GGUF file's tokenizer (tokenizer.ggml.*) as an attnlab Tokenizer, and its chat template,
rendered safely.

Design choices:
- The reference is llama.cpp's own tokenizer (llama-vocab.cpp), not the one transformers builds from
  a GGUF file: ids must equal what `llama-tokenize` gives on the same file
  (tests/fixtures/gguf_tokens.json holds its output for a fixed set of texts, and
  tests/test_formats_gguf_vocabularies.py runs llama.cpp's own tokenizer tests). Each
  `tokenizer.ggml.pre` value maps to llama.cpp's list of split regexes for it, applied one after the
  other (each splits the pieces the previous one left, and text a regex does not match stays a piece
  of its own, as in llama.cpp), then byte-level BPE with the file's merges.
- Byte-level BPE ("gpt2" in tokenizer.ggml.model), with the pre-tokenizers of llama.cpp's tested
  vocabularies (PRE_TOKENIZERS: GPT-2's, Llama 3's, Qwen2's, the digits one by one of StarCoder's
  family, DeepSeek's, Falcon's, ...), and SentencePiece ("llama": Llama 2's, Mistral 7B's,
  Phi-3's, Gemma's), and WordPiece ("bert": BERT's, in the class WordPiece, which encodes as
  llama.cpp does, beside BERT's `tokenizers` WordPiece), and Gemma 4's BPE on UTF-8 ("gemma4",
  _gemma4); another model or pre-tokenizer is refused by name rather than tokenized differently
  from llama.cpp.
- SentencePiece as llama.cpp runs it (llm_tokenizer_spm), in the class SentencePiece, which encodes:
  spaces become "▁" (a "▁" first where add_space_prefix says so; Gemma's file says no), the text is
  split into characters, and the adjacent pair whose join is a token with the highest score merges
  first, again and again, a tie going to the leftmost pair; a character left outside the
  vocabulary becomes its UTF-8 bytes' <0xXX> tokens (byte fallback). Beside it the tokenizer keeps
  a `tokenizers` BPE (for decoding, and as the tokenizer.json a saved model holds) whose merges are
  every split of every token in two tokens, ranked by the joined token's score (no pre-tokenizer:
  the whole text between special tokens is one word, as in llama.cpp). It gives the same ids where
  the scores are distinct (Gemma's), not where pieces share one (Llama 2's): llama.cpp breaks such
  a tie by position, a ranked BPE by rank. So the backend encodes a file whose scores are
  distinct (compiled, and it is many times faster on a long text), SentencePiece one where they
  tie.
- Token types: CONTROL (and UNKNOWN) tokens are special (matched in text, skipped by
  decode(skip_special_tokens=True)), USER_DEFINED ones are matched in text too, as llama.cpp's
  partition of special tokens does; add_bos_token / add_eos_token become the post-processor.
- attnlab's character tokenizer is written (attnlab.formats.gguf_write) as llama.cpp's "rwkv"
  vocabulary: llama.cpp tokenizes it by the longest token that matches the text's next bytes, which
  for tokens of one character each is one token per character, exactly attnlab's char tokenizer,
  and it is the one vocabulary type with no default end-of-generation id (a "gpt2" one ends
  generation at id 11 unless told otherwise). Its token text is escaped as llama.cpp unescapes it
  (rwkv_escape / rwkv_unescape, side by side below); only single-character ones are read.
- The chat template (Jinja, tokenizer.chat_template) is kept in ModelConfig.extra["chat_template"],
  so a model saved by attnlab keeps it, and is rendered in jinja2's ImmutableSandboxedEnvironment,
  as transformers does: a template cannot reach Python objects' internals or change the messages;
  one that tries is one line.
"""

from __future__ import annotations

import heapq
import re
import unicodedata
from typing import Any

from ..errors import UserError, first_line
from ..tokenizer import Tokenizer

# llama.cpp's split regexes per tokenizer.ggml.pre (src/llama-vocab.cpp, llm_tokenizer_bpe; the same
# strings, which tests/test_formats_gguf_vocabularies.py checks against that file), and
# whether its BPE first looks the whole piece up in the vocabulary (ignore_merges: Llama 3, which
# also adds BOS by default).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|"
    r"\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM's letters: the ranges of its tokenizer.json, as llama.cpp copies them (escaped:
# several of its characters change under Unicode normalization, which an editor may apply)
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-"
    "\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15"
    "\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d"
    "\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183"
    "\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
    "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-"
    "\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK = "[一-龥ࠀ-一가-퟿]+"
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool]] = {
    "smollm": ((r"\p{N}", _GPT2), False),
    "starcoder": ((r"\p{N}", _GPT2), False),
    "refact": ((r"\p{N}", _GPT2), False),
    "command-r": ((r"\p{N}", _GPT2), False),
    "gpt-2": ((_GPT2,), False),
    "mpt": ((_GPT2,), False),
    "falcon": ((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"), False),
    "deepseek-llm": (
        (
            "[\r\n]",
            rf"\s?[{_DEEPSEEK_LETTERS}]+",
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            _CJK,
            r"\p{N}+",
        ),
        False,
    ),
    "deepseek-coder": (
        ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"),
        False,
    ),
    "llama-bpe": ((_LLAMA3,), True),
    "llama3": ((_LLAMA3,), True),
    "qwen2": ((_QWEN2,), False),
    "qwen35": ((_QWEN35,), False),
}
# llama_token_type values in tokenizer.ggml.token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4


def tokenizer_from_gguf(file) -> Tokenizer | None:
    """The tokenizer the file describes; None when it has no tokenizer.ggml.model."""
    kind = file.value("tokenizer.ggml.model")
    if kind in (None, "none"):  # "none": llama.cpp's files that feed token ids (llama-bench's)
        return None
    if kind == "rwkv":
        return char_tokenizer(file)
    if kind not in ("gpt2", "llama", "bert", "gemma4"):
        raise UserError(
            f"{file.path}: tokenizer model {kind!r}, which attnlab does not build from a GGUF "
            "file (it builds 'gpt2', byte-level BPE, 'llama', SentencePiece, 'bert', WordPiece, "
            "'gemma4', BPE on UTF-8, and 'rwkv' of single characters)"
        )
    pre = file.value("tokenizer.ggml.pre", "default")
    if kind == "gpt2" and pre not in PRE_TOKENIZERS:
        raise UserError(
            f"{file.path}: pre-tokenizer {pre!r}, which attnlab does not know (it knows "
            f"{', '.join(PRE_TOKENIZERS)}); the ids would differ from llama.cpp's"
        )
    try:
        if kind == "gemma4":
            return _gemma4(file)
        if kind == "llama":
            return _sentencepiece(file)
        if kind == "bert":
            return _wordpiece(file)
        return Tokenizer(_byte_level_bpe(file, *PRE_TOKENIZERS[pre]), "hf")
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        if isinstance(exc, UserError):
            raise
        raise UserError(
            f"{file.path}: the tokenizer metadata is malformed ({first_line(exc)})"
        ) from None


def rwkv_escape(token: str) -> str:
    """A token's text as llama.cpp's rwkv vocabulary stores it (llama_unescape_rwkv_token reads
    it): a backslash escapes the next character, \\t \\n \\r are tab, newline, return."""
    return (
        token.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n").replace("\r", "\\r")
    )


def rwkv_unescape(text: str) -> bytes:
    """llama.cpp's llama_unescape_rwkv_token: the bytes a token of an rwkv vocabulary stands for
    (\\xhh is one byte, in lowercase hex)."""
    out, data, i = bytearray(), text.encode("utf-8"), 0
    while i < len(data):
        byte = data[i]
        if byte != ord("\\"):
            out.append(byte)
            i += 1
            continue
        if i + 1 == len(data):  # a backslash at the end escapes nothing, and is dropped
            break
        escaped = chr(data[i + 1])
        if escaped == "x":
            out.append(int(data[i + 2 : i + 4].decode("ascii"), 16))
            i += 4
            continue
        out.append({"t": 9, "n": 10, "r": 13}.get(escaped, data[i + 1]))
        i += 2
    return bytes(out)


def char_tokenizer(file) -> Tokenizer:
    """An rwkv vocabulary of single characters (what attnlab writes for its char tokenizer) as
    attnlab's character tokenizer, with the file's ids."""
    vocab = {}
    for index, text in enumerate(_strings(file, "tokenizer.ggml.tokens")):
        try:
            token = rwkv_unescape(text).decode("utf-8")
        except (ValueError, IndexError):
            token = ""
        if len(token) != 1:
            raise UserError(
                f"{file.path}: the rwkv vocabulary's token {index} ({text!r}) is not one "
                "character; attnlab reads rwkv vocabularies of single characters (its char "
                "tokenizer's), not a real RWKV model's"
            )
        if vocab.setdefault(token, index) != index:
            raise UserError(
                f"{file.path}: the token {token!r} appears twice (ids {vocab[token]} and {index})"
            )
    return Tokenizer.from_chars(vocab)


def _byte_level_bpe(file, regexes: tuple[str, ...], ignore_merges: bool, raw: bool = False):
    """llama.cpp's BPE: the pieces the regexes split, each merged by the file's ranked merges (as
    the `tokenizers` BPE merges: the lowest rank first, then the leftmost). Byte-level (GPT-2's
    alphabet), or `raw`: on the UTF-8 text itself with spaces as "▁" and a character outside the
    vocabulary as its <0xXX> byte tokens (Gemma 4's, llama.cpp's byte_encode = false)."""
    from tokenizers import (
        AddedToken,
        Regex,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers import Tokenizer as Backend

    tokens = _strings(file, "tokenizer.ggml.tokens")
    merges = _strings(file, "tokenizer.ggml.merges")
    types = file.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise UserError(
            f"{file.path}: {len(tokens)} tokens but {len(types)} token types; the tokenizer is "
            "damaged"
        )
    vocab = {}
    for index, token in enumerate(tokens):
        if vocab.setdefault(token, index) != index:
            raise UserError(
                f"{file.path}: the token {token!r} appears twice (ids {vocab[token]} and {index})"
            )
    pairs = []
    for merge in merges:
        # as llama.cpp splits a merge: at the first space after its first character
        cut = merge.find(" ", 1)
        if cut < 0:
            raise UserError(
                f"{file.path}: the merge {merge!r} is not two tokens separated by a space"
            )
        pairs.append((merge[:cut], merge[cut + 1 :]))
    try:
        model = models.BPE(vocab, pairs, ignore_merges=ignore_merges, byte_fallback=raw)
        backend = Backend(model)
    # the library raises a bare Exception (a merge of tokens the vocabulary lacks)
    except Exception as exc:
        raise UserError(
            f"{file.path}: the tokenizer's merges do not fit its tokens ({first_line(exc)})"
        ) from None
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in regexes]
    if raw:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits)
        backend.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        backend.decoder = decoders.ByteLevel()
    backend.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] in (CONTROL, USER_DEFINED)
        ]
    )
    backend.post_processor = _post_processor(
        file, tokens, processors, add_bos=ignore_merges or raw, bos_always=raw
    )
    return backend


def _sentencepiece(file) -> Tokenizer:
    """llama.cpp's SentencePiece: SentencePiece below encodes, a `tokenizers` BPE with byte
    fallback (module docstring) decodes, names ids and is what a saved tokenizer.json holds."""
    tokens = _strings(file, "tokenizer.ggml.tokens")
    scores = file.value("tokenizer.ggml.scores")
    types = file.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not isinstance(scores, list) or len(scores) != len(tokens) or len(types) != len(tokens):
        raise UserError(
            f"{file.path}: {len(tokens)} tokens but "
            f"{len(scores) if isinstance(scores, list) else 'no'} scores and {len(types)} token "
            "types; the tokenizer is damaged"
        )
    prefix = bool(file.value("tokenizer.ggml.add_space_prefix", True))
    bos, eos = _ends(file, tokens, add_bos=True)
    # The backend gives llama.cpp's ids where the pieces' scores are distinct (Gemma's), in
    # compiled code; SentencePiece encodes where they tie (Llama 2's), which the backend cannot.
    normal = [score for score, kind in zip(scores, types) if kind == NORMAL]
    tied = len(set(normal)) != len(normal)
    encoder = SentencePiece(tokens, scores, types, prefix, bos, eos) if tied else None
    return Tokenizer(_sentencepiece_backend(file, tokens, scores, types, prefix), "hf", encoder)


def special_tokens(tokens: list[str], types: list[int]) -> list[tuple[str, int, bool]]:
    """llama.cpp's cache_special_tokens: (text, id, is control or unknown) of every token the text
    is cut at before tokenizing, the longest text (in bytes) first."""
    specials = [
        (token, index, kind != USER_DEFINED)
        for index, (token, kind) in enumerate(zip(tokens, types))
        if kind in (CONTROL, USER_DEFINED, UNKNOWN) and token
    ]
    return sorted(specials, key=lambda s: len(s[0].encode()), reverse=True)


def partition(text: str, specials, parse_special: bool) -> list[str | int]:
    """tokenizer_st_partition: the text as pieces of text and special tokens' ids, no piece empty;
    each special token in turn cuts every piece of text left, control and unknown ones only when
    parse_special (user-defined ones always)."""
    pieces: list[str | int] = [text] if text else []
    for token, index, control in specials:
        if control and not parse_special:
            continue
        cut: list[str | int] = []
        for piece in pieces:
            if isinstance(piece, int) or token not in piece:
                cut.append(piece)
                continue
            for at, part in enumerate(piece.split(token)):
                cut += ([index] if at else []) + ([part] if part else [])
        pieces = cut
    return pieces


class SentencePiece:
    """llama.cpp's SentencePiece tokenizer (llama_vocab::impl::tokenize, its SPM case, and
    llm_tokenizer_spm_session in src/llama-vocab.cpp), step by step:
    - the text is cut at special tokens' texts (tokenizer_st_partition: the longest first; control
      and unknown ones only when parse_special), and each piece between them gets a space before it
      where add_space_prefix says so and the piece starts the text or follows a special token;
    - spaces become "▁", the piece is split into characters, and the adjacent pair whose join is a
      token with the highest score merges, again and again; a tie goes to the leftmost pair (the
      queue's comparator orders by score, then by the left symbol's index);
    - each symbol left is its token, or (a character outside the vocabulary) its UTF-8 bytes'
      <0xXX> tokens (resegment: every merged symbol is a token, so only characters fall back).
    A token text that appears twice is looked up as its last id, as llama.cpp's token_to_id map is
    filled."""

    def __init__(self, tokens, scores, types, add_space_prefix: bool, bos, eos) -> None:
        self.ids = {token: index for index, token in enumerate(tokens)}
        self.scores = scores
        self.add_space_prefix = add_space_prefix
        self.bos, self.eos = bos, eos
        self.specials = special_tokens(tokens, types)
        self.byte_ids = [self.ids.get(f"<0x{b:02X}>", self.ids.get(chr(b))) for b in range(256)]

    def __call__(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        ids = [self.bos] if add_special_tokens and self.bos is not None else []
        follows_special = True  # the first piece gets the space prefix too
        for piece in partition(text, self.specials, parse_special):
            if isinstance(piece, int):
                ids.append(piece)
                follows_special = True
                continue
            if self.add_space_prefix and follows_special:
                piece = " " + piece
            ids += self.merge(piece.replace(" ", "▁"))
            follows_special = False
        if add_special_tokens and self.eos is not None:
            ids.append(self.eos)
        return ids

    def merge(self, text: str) -> list[int]:
        """One piece of text (spaces already "▁") as ids: the bigram merges by score."""
        symbols = list(text)  # each symbol's text; "" once merged into its left neighbour
        before = list(range(-1, len(symbols) - 1))
        after = [*range(1, len(symbols)), -1]
        queue: list[tuple[float, int, int, int]] = []

        def add_bigram(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            joined = symbols[left] + symbols[right]
            index = self.ids.get(joined)
            if index is not None:  # best score first, then the leftmost
                heapq.heappush(queue, (-self.scores[index], left, right, len(joined)))

        for i in range(1, len(symbols)):
            add_bigram(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            # a pair one of whose symbols has merged since it was queued is stale
            if not symbols[left] or not symbols[right]:
                continue
            if len(symbols[left]) + len(symbols[right]) != size:
                continue
            symbols[left] += symbols[right]
            symbols[right] = ""
            after[left] = after[right]
            if after[right] >= 0:
                before[after[right]] = left
            add_bigram(before[left], left)
            add_bigram(left, after[left])
        ids = []
        for symbol in symbols:
            if not symbol:
                continue
            index = self.ids.get(symbol)
            if index is not None:
                ids.append(index)
                continue
            for byte in symbol.encode("utf-8"):  # byte fallback
                if self.byte_ids[byte] is None:
                    raise UserError(
                        f"the text has {symbol!r}, which is not in the SentencePiece vocabulary, "
                        f"and the vocabulary has no token for its byte 0x{byte:02X}"
                    )
                ids.append(self.byte_ids[byte])
        return ids


def _add_pieces_cut_first(backend, tokens: list[str], types: list[int]) -> None:
    """The tokens llama.cpp cuts the text at before the model runs (its partition of special
    tokens): control and unknown ones, special (decode(skip_special_tokens=True) drops them), and
    user-defined ones (Gemma's runs of spaces and newlines), which decoding keeps."""
    from tokenizers import AddedToken

    backend.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] != USER_DEFINED, normalized=False)
            for i in range(len(tokens))
            if types[i] in (CONTROL, USER_DEFINED, UNKNOWN)
        ]
    )


def _sentencepiece_backend(file, tokens, scores, types, prefix: bool):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, processors

    # as llama.cpp looks a text up: the last token of a text that appears twice
    vocab = {token: index for index, token in enumerate(tokens)}
    # Every split of a token in two tokens, the best-scored joins first: llama.cpp merges the
    # adjacent pair whose join scores highest (ties: the leftmost, as the BPE's queue does).
    # (one comprehension: Gemma 3's 262k tokens give 515k merges, and a loop was slower)
    best_first = sorted(range(len(tokens)), key=scores.__getitem__, reverse=True)  # stable
    joins = [tokens[i] for i in best_first if vocab[tokens[i]] == i]
    merges = [
        (left, right)
        for token in joins
        for cut in range(1, len(token))
        if (left := token[:cut]) in vocab and (right := token[cut:]) in vocab
    ]
    try:
        backend = Backend(models.BPE(vocab, merges, byte_fallback=True, fuse_unk=False))
    # the library raises a bare Exception
    except Exception as exc:
        raise UserError(f"{file.path}: the tokenizer cannot be built ({first_line(exc)})") from None
    escape = [normalizers.Replace(" ", "▁")]
    if prefix:  # llama.cpp puts it before each text fragment, every one following a special token
        escape.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(escape)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    _add_pieces_cut_first(backend, tokens, types)
    backend.post_processor = _post_processor(file, tokens, processors, add_bos=True)
    return backend


def _gemma4(file) -> Tokenizer:
    """Gemma 4's BPE on UTF-8 (tokenizer model "gemma4") as llama.cpp's BPE session runs it: no
    split but lines and runs of newlines ("[^\\n]+|[\\n]+"), BOS added whatever the file says
    (llama.cpp overrides add_bos_token for it), and a run of newlines that is a token taken whole
    before any merge (llama.cpp's fix for Gemma 4, whose merges do not build them): RawLines."""
    tokens = _strings(file, "tokenizer.ggml.tokens")
    types = file.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    backend = _byte_level_bpe(file, ("[^\n]+|[\n]+",), False, raw=True)
    bos, eos = _ends(file, tokens, add_bos=True, bos_always=True)
    return Tokenizer(backend, "hf", RawLines(backend, tokens, types, bos, eos))


class RawLines:
    """The encoder of _gemma4: special tokens cut first (partition), spaces as "▁", the text split
    into lines and runs of newlines, a run that is a token whole, anything else the backend's
    BPE (its model alone: the merges, byte fallback)."""

    def __init__(self, backend, tokens, types, bos, eos) -> None:
        self.model = backend.model
        self.ids = {token: index for index, token in enumerate(tokens)}
        self.specials = special_tokens(tokens, types)
        self.bos, self.eos = bos, eos

    def __call__(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        ids = [self.bos] if add_special_tokens and self.bos is not None else []
        for piece in partition(text, self.specials, parse_special):
            if isinstance(piece, int):
                ids.append(piece)
                continue
            for word in re.findall(r"[^\n]+|\n+", piece.replace(" ", "▁")):
                if word[0] == "\n" and word in self.ids:
                    ids.append(self.ids[word])
                else:
                    ids += [token.id for token in self.model.tokenize(word)]
        if add_special_tokens and self.eos is not None:
            ids.append(self.eos)
        return ids


# llama.cpp's whitespace (unicode_set_whitespace in src/unicode-data.cpp; not str.isspace's)
_WHITESPACE = frozenset(
    map(chr, [*range(0x9, 0xE), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029])
) | frozenset(map(chr, [0x202F, 0x205F, 0x3000]))
# BERT's CJK ideographs (llm_tokenizer_wpm_session::is_chinese_char, its 0x2B920 included)
_CHINESE = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B920, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)


class WordPiece:
    """llama.cpp's WordPiece tokenizer (BERT's: llm_tokenizer_wpm_session and the WPM case of
    llama_vocab::impl::tokenize). The text is cut at special tokens (as SentencePiece's); each
    piece is split into words at whitespace and around every punctuation mark, ASCII symbol and
    CJK ideograph (each one a word), with control characters dropped, lowercased and accents
    stripped where tokenizer.ggml.normalizer.* say (both by default; an accent is stripped as
    llama.cpp does, each character replaced by the first character of its NFD form and marks
    dropped). Each word, with "▁" before it, is taken greedily as the longest token that matches
    its next characters; a word some part of which matches no token is the unknown token. The
    BOS ([CLS]) and separator ([SEP]) around it are add_special_tokens's."""

    def __init__(self, tokens, types, lowercase: bool, strip_accents: bool, bos, sep, unknown):
        self.ids = {token: index for index, token in enumerate(tokens)}
        self.longest = max(map(len, tokens))
        self.specials = special_tokens(tokens, types)
        self.lowercase, self.strip_accents = lowercase, strip_accents
        self.bos, self.sep, self.unknown = bos, sep, unknown

    def __call__(
        self, text: str, add_special_tokens: bool = True, parse_special: bool = True
    ) -> list[int]:
        ids = [self.bos] if add_special_tokens else []
        for piece in partition(text, self.specials, parse_special):
            if isinstance(piece, int):
                ids.append(piece)
                continue
            for word in self.words(piece):
                ids += self.longest_first("▁" + word)
        return ids + ([self.sep] if add_special_tokens else [])

    def words(self, text: str) -> list[str]:
        words = [""]
        for char in text:
            if self.strip_accents:
                char = unicodedata.normalize("NFD", char)[0]
            kind = unicodedata.category(char)
            if char in _WHITESPACE:
                if words[-1]:
                    words.append("")
                continue
            if char in "\x00\ufffd" or (kind[0] == "C" and kind != "Cn"):
                continue
            if self.strip_accents and kind[0] == "M":
                continue
            if self.lowercase:
                char = char.lower()[0]
            point = ord(char)
            if (
                kind[0] == "P"
                or (point < 0x7F and kind[0] == "S")
                or any(low <= point <= high for low, high in _CHINESE)
            ):
                words[-1:] = [*([words[-1]] if words[-1] else []), char, ""]
            else:
                words[-1] += char
        return [word for word in words if word]

    def longest_first(self, word: str) -> list[int]:
        ids, start = [], 0
        while start < len(word):
            for end in range(min(len(word), start + self.longest), start, -1):
                if (index := self.ids.get(word[start:end])) is not None:
                    ids.append(index)
                    start = end
                    break
            else:  # some part matches no token: the whole word is unknown
                return [self.unknown]
        return ids


def _wordpiece(file) -> Tokenizer:
    """llama.cpp's WordPiece: WordPiece above encodes, the `tokenizers` WordPiece of BERT (tokens
    continuing a word as "##" pieces, those starting one without their "▁") decodes."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

    tokens = _strings(file, "tokenizer.ggml.tokens")
    types = file.value("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise UserError(
            f"{file.path}: {len(tokens)} tokens but {len(types)} token types; the tokenizer is "
            "damaged"
        )
    lowercase = bool(file.value("tokenizer.ggml.normalizer.lowercase", True))
    strip_accents = bool(file.value("tokenizer.ggml.normalizer.strip_accents", lowercase))
    ids = {}
    for key, default in (("bos", 101), ("seperator", 102), ("unknown", 100)):
        index = file.value(f"tokenizer.ggml.{key}_token_id", default)
        if not isinstance(index, int) or not 0 <= index < len(tokens):
            raise UserError(f"{file.path}: {key}_token_id is {index!r}, not a token id")
        ids[key] = index
    encoder = WordPiece(
        tokens, types, lowercase, strip_accents, ids["bos"], ids["seperator"], ids["unknown"]
    )
    vocab = {}
    for index, (token, kind) in enumerate(zip(tokens, types)):
        piece = token if kind != NORMAL else token[1:] if token[:1] == "▁" else "##" + token
        vocab.setdefault(piece, index)
    backend = Backend(models.WordPiece(vocab, unk_token=tokens[ids["unknown"]]))
    backend.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, strip_accents=strip_accents
    )
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    backend.post_processor = processors.BertProcessing(
        (tokens[ids["seperator"]], ids["seperator"]), (tokens[ids["bos"]], ids["bos"])
    )
    _add_pieces_cut_first(backend, tokens, types)
    return Tokenizer(backend, "hf", encoder)


def _strings(file, key: str) -> list[str]:
    values = file.value(key)
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise UserError(
            f"{file.path}: {key} must be an array of strings; the tokenizer is missing or damaged"
        )
    return values


def _ends(
    file, tokens: list[str], add_bos: bool, bos_always: bool = False
) -> tuple[int | None, int | None]:
    """The ids of the BOS and EOS added to a text, as tokenizer.ggml.add_bos_token /
    add_eos_token say; without them, llama.cpp's defaults (`add_bos`; no EOS). `bos_always`: BOS
    whatever the file says (llama.cpp's override for Gemma 4)."""
    ends = []
    for key, default in (("bos", add_bos), ("eos", False)):
        if not (key == "bos" and bos_always) and not file.value(
            f"tokenizer.ggml.add_{key}_token", default
        ):
            ends.append(None)
            continue
        index = file.value(f"tokenizer.ggml.{key}_token_id")
        if not isinstance(index, int) or not 0 <= index < len(tokens):
            raise UserError(
                f"{file.path}: add_{key}_token is set but {key}_token_id is {index!r}, not a "
                "token id"
            )
        ends.append(index)
    return ends[0], ends[1]


def _post_processor(file, tokens: list[str], processors, add_bos: bool, bos_always: bool = False):
    """BOS / EOS added as _ends says."""
    ends = _ends(file, tokens, add_bos, bos_always)
    ends = [None if i is None else (tokens[i], i) for i in ends]
    bos, eos = ends
    if bos is None and eos is None:
        return None
    start, end = [bos[0]] if bos else [], [eos[0]] if eos else []
    single = " ".join([*start, "$A", *end])
    pair = " ".join([*start, "$A", *end, "$B:1", *(f"{token}:1" for token in end)])
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[end for end in ends if end]
    )


# Chat templates ---------------------------------------------------------------------------------


def chat_ids(model, messages: list[dict[str, str]]) -> list[int]:
    """The ids of `messages` through the model's chat template, ready for the assistant's reply. The
    template writes every special token itself, so the tokenizer adds none (as transformers'
    apply_chat_template)."""
    template = model.config.extra.get("chat_template")
    if not isinstance(template, str) or model.tokenizer is None:
        raise UserError(
            "this model has no chat template (a GGUF file's tokenizer.chat_template); use --prompt"
        )
    names = {
        f"{key}_token": model.tokenizer.id_to_token(index)
        for key in ("bos", "eos")
        if isinstance(index := model.config.extra.get(f"{key}_token_id"), int)
    }
    ids = model.tokenizer.encode(
        render_chat(template, messages, add_generation_prompt=True, **names),
        add_special_tokens=False,
    )
    if len(ids) >= model.config.n_ctx:
        raise UserError(
            f"the conversation is {len(ids)} tokens but the model's context is n_ctx="
            f"{model.config.n_ctx}; shorten it"
        )
    return ids


def render_chat(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """The prompt a chat template makes of `messages` ([{"role": ..., "content": ...}]), rendered in
    a sandbox; `variables` are what templates expect beside them (bos_token, eos_token)."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    # templates call it to reject a conversation (transformers' name)
    def raise_exception(message: str) -> None:
        raise UserError(f"the chat template refused the conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except SecurityError as exc:
        raise UserError(
            f"the chat template tried something a template may not ({first_line(exc)}); it was "
            "stopped"
        ) from None
    except TemplateError as exc:
        raise UserError(
            f"the chat template cannot be rendered ({type(exc).__name__}: {first_line(exc)})"
        ) from None
