"""llama.cpp's own tokenizer tests (tests/test-tokenizer-0.cpp) on attnlab's GGUF tokenizer: for
every vocabulary-only file llama.cpp ships (models/ggml-vocab-*.gguf), each text of its .inp must
give the ids of its .out.

The files come from llama.cpp's sources as the pinned llama-cpp-python sdist carries them, unpacked
into the venv by `make venv-test` (the Makefile's LLAMA_CPP_SDIST); nothing is copied into the
repository, and without them every test here skips in one line naming that step. As
test-tokenizer-0 does: no BOS or EOS added (add_special=false) and the texts read as they are, the
tests compared by text (a std::map: a text given twice is one test). It also passes
parse_special=false, which only matters where a text holds a control token's text; none does, and
the first test checks that. A vocabulary attnlab cannot yet tokenize as llama.cpp does is a strict
xfail naming what it lacks, so the day it passes the test says so.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from attnlab.errors import UserError
from attnlab.formats.gguf import read_gguf
from attnlab.formats.gguf_tokenizer import CONTROL, PRE_TOKENIZERS, UNKNOWN, tokenizer_from_gguf

# where the Makefile's venv-test step unpacks them
VOCABULARIES = Path(sys.prefix) / "llama.cpp-vocabularies"
SEPARATOR = "\n__ggml_vocab_test__\n"
# the vocabularies attnlab refuses, and what it lacks for each (none today: every vocabulary
# llama-cpp-python 0.3.36's llama.cpp tests passes)
UNSUPPORTED: dict[str, str] = {}


def _names(tested: bool) -> list[str]:
    files = sorted(VOCABULARIES.glob("ggml-vocab-*.gguf"))
    names = [f.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for f in files]
    return [n for n in names if _path(n).with_suffix(".gguf.inp").exists() == tested] or [""]


def _path(name: str) -> Path:
    return VOCABULARIES / f"ggml-vocab-{name}.gguf"


def _skip_without_files(name: str) -> None:
    if not name:
        pytest.skip(
            f"llama.cpp's tokenizer tests are not in {VOCABULARIES}: run `make venv-test` with "
            "PyPI reachable (it unpacks them from the llama-cpp-python sdist)"
        )


def read_cases(path: Path) -> dict[str, list[int]]:
    """The .inp's texts and the .out's ids, read as test-tokenizer-0's read_tests reads them."""
    raw = _read(path.with_suffix(".gguf.inp"))
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):  # the loop there stops at the end: no empty last text
        texts.pop()
    lines = _read(path.with_suffix(".gguf.out")).split("\n")
    if lines and lines[-1] == "":  # std::getline: a final newline ends the last line
        lines.pop()
    assert len(texts) == len(lines), f"{path.name}: {len(texts)} texts but {len(lines)} id lines"
    return {text: [int(i) for i in line.split()] for text, line in zip(texts, lines)}


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", newline="") as f:  # as the bytes are: no newline rewriting
        return f.read()


def _marks(name: str):
    if name in UNSUPPORTED:
        reason = f"attnlab lacks {UNSUPPORTED[name]}"
        return pytest.mark.xfail(strict=True, raises=(UserError, AssertionError), reason=reason)
    return ()


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=_marks(n), id=n or "none") for n in _names(tested=True)]
)
def test_every_text_gives_llama_cpps_ids(name):
    _skip_without_files(name)
    path = _path(name)
    file = read_gguf(path)
    cases = read_cases(path)
    assert len(cases) >= 40, f"{path.name}: only {len(cases)} cases"
    tokens = file.value("tokenizer.ggml.tokens")
    types = file.value("tokenizer.ggml.token_type") or []
    # parse_special=false only changes a text that holds a control (or unknown) token's text
    controls = [t for t, kind in zip(tokens, types) if kind in (CONTROL, UNKNOWN) and t]
    assert not [t for t in controls if any(t in text for text in cases)]
    tokenizer = tokenizer_from_gguf(file)
    wrong = {
        text: (ids, got)
        for text, ids in cases.items()
        if (got := tokenizer.encode(text, add_special_tokens=False)) != ids
    }
    shown = "; ".join(f"{t!r}: {ids} from llama.cpp, {got}" for t, (ids, got) in wrong.items())
    assert not wrong, f"{path.name}: {len(wrong)} of {len(cases)} texts differ: {shown[:2000]}"


@pytest.mark.parametrize("name", [pytest.param(n, id=n or "none") for n in _names(tested=False)])
def test_a_vocabulary_without_tests_is_built_or_refused_in_one_line(name):
    """llama.cpp ships some vocabularies with no texts to test (aquila, baichuan, ...): each
    still gives a tokenizer, or one line saying what attnlab lacks."""
    _skip_without_files(name)
    try:
        tokenizer = tokenizer_from_gguf(read_gguf(_path(name)))
    except UserError as exc:
        assert "\n" not in str(exc) and "attnlab" in str(exc)
        return
    assert tokenizer.encode("Hello world", add_special_tokens=False)


def llama_cpp_pre_tokenizers(source: str) -> dict[str, tuple[tuple[str, ...], bool]]:
    """Each tokenizer.ggml.pre name of llama-vocab.cpp with its regex_exprs (llm_tokenizer_bpe's
    switch, C escapes undone) and whether it sets ignore_merges: PRE_TOKENIZERS's form."""
    kinds, ignores = {}, {}
    for condition, body in re.findall(r"} else if \((.*?)\) \{(.*?)(?=\n\s*\})", source, re.S):
        kind = re.search(r"pre_type = (LLAMA_VOCAB_PRE_TYPE_\w+);", body)
        for name in re.findall(r'tokenizer_pre == "([^"]+)"', condition):
            if kind:
                kinds[name] = kind.group(1)
                ignores[name] = "ignore_merges = true" in body
    regexes = {}
    for cases, body in re.findall(
        r"((?:case LLAMA_VOCAB_PRE_TYPE_\w+:\s*)+)regex_exprs = \{(.*?)\};", source, re.S
    ):
        lines = [line for line in body.splitlines() if not line.strip().startswith("//")]
        literals = re.findall(r'"((?:[^"\\]|\\.)*)"', "\n".join(lines))
        undone = tuple(re.sub(r"\\(.)", lambda m: _C_ESCAPES.get(m[1], m[1]), s) for s in literals)
        for kind in re.findall(r"case (LLAMA_VOCAB_PRE_TYPE_\w+):", cases):
            regexes[kind] = undone
    return {name: (regexes[kind], ignores[name]) for name, kind in kinds.items() if kind in regexes}


_C_ESCAPES = {"r": "\r", "n": "\n", "t": "\t"}


def test_pre_tokenizers_are_llama_cpps_regexes():
    """Every pre-tokenizer attnlab knows splits by the very regexes of llama.cpp's source (the
    tests above cannot tell some of them apart: no text there has a combining mark, say)."""
    source = VOCABULARIES / "llama-vocab.cpp"
    _skip_without_files(source.exists() and "llama-vocab.cpp")
    theirs = llama_cpp_pre_tokenizers(source.read_text(encoding="utf-8"))
    assert {"gpt-2", "qwen35", "deepseek-llm", "falcon"} <= set(theirs)  # the parse found them
    for name, (regexes, ignore_merges) in PRE_TOKENIZERS.items():
        assert name in theirs, f"llama.cpp knows no pre-tokenizer {name!r}"
        assert (regexes, ignore_merges) == theirs[name], name


def test_gemma4_takes_a_run_of_newlines_that_is_a_token_whole(tmp_path):
    """llama.cpp looks a run of newlines up whole before merging it (its fix for Gemma 4, whose
    merges did not build them); the shipped file's merges do build them, so its texts cannot tell.
    A vocabulary with the runs as tokens and no merges for them can."""
    from gguf import GGUFWriter

    tokens = ["<pad>", "<eos>", "<bos>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["a", "b", "ab", "▁", "\n", "\n\n", "\n\n\n"]
    path = tmp_path / "gemma4.gguf"
    writer = GGUFWriter(str(path), "gemma4")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [6] * 256 + [1] * 7)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(2)
    writer.add_add_bos_token(False)  # llama.cpp adds it for Gemma 4 all the same
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tokenizer = tokenizer_from_gguf(read_gguf(path))
    ab, space, newline, two, three = (tokens.index(t) for t in ("ab", "▁", "\n", "\n\n", "\n\n\n"))
    assert tokenizer.encode("ab\n\n\nab ab\n\n") == [2, ab, three, ab, space, ab, two]
    # a run longer than any token is merged as any text is (here: no merge, one by one)
    assert tokenizer.encode("\n\n\n\n", add_special_tokens=False) == [newline] * 4
    assert tokenizer.encode("中", add_special_tokens=False) == [3 + b for b in "中".encode()]
