"""No measured figure in the source's prose: the comments and docstrings of src/ (Python, C and
its headers, JavaScript) keep the equation and the reason, never a timing, a rate, a ratio or a
date. Figures belong in benchmarks/results/ (rendered by benchmarks/render_results.py), where
the machine, the versions and the command come with them; a number in a comment goes stale the
day the code or the machine changes.

What counts as a figure (FIGURE): a date (2026-12-02), a clock time (14:02 UTC), a rate or a time
with its unit (12.5 GB/s, 385 GFLOP/s, 40 tok/s, 4 ms, 80 µs, "86 s", 3 seconds), a ratio (1.48x,
~10x cheaper, 2.3 times, 35% faster). Sizes (2 MB pages, 4 KB), shapes (256 x 576) and counts are
not figures. Tests are not scanned: a test's tolerance is a stated bound, not a measurement.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

FIGURE = re.compile(
    r"\b20\d\d-[01]\d-[0-3]\d\b"  # a date
    r"|\b[0-2]?\d:[0-5]\d(?::[0-5]\d)?\s*(?:UTC|GMT|CET|CEST|am|pm)\b"  # a clock time
    # a rate or a time with its unit ("s" alone after a space: "86 s", not HTTP's "503s")
    r"|\b\d+(?:,\d{3})*(?:\.\d+)?\s?(?:[KMGT]i?B/s|[KMGT]?FLOP/s|[KMGT]?FLOPS|tok/s|tokens/s"
    r"|tokens per second|it/s|steps/s|ms|µs|us|ns|secs?|seconds?|minutes?|hours?)(?![\w/])"
    r"|\b\d+(?:,\d{3})*(?:\.\d+)?\s+s\b(?![\w/'])"
    # a ratio: 1.48x, ~10x cheaper, 2.3 times, 35% faster
    r"|\b\d+\.\d+\s?[x×](?!\w)"
    r"|\b\d+\s?[x×]\s+(?:faster|slower|cheaper|dearer|quicker|the speed|as fast|fewer|more)\b"
    r"|\b\d+\.\d+\s+times\b|\b\d+\s+times\s+(?:faster|slower|as fast|quicker)\b"
    r"|\b\d+(?:\.\d+)?\s?%\s+(?:faster|slower|quicker|of the step|of tg\d+)",
)


def python_prose(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and docstring of a Python source."""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                yield node.body[0].lineno, docstring


def c_like_prose(text: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each /* */ and // comment of a C, header or JavaScript source, string
    literals ("...", '...', `...`) skipped."""
    i, line = 0, 1
    while i < len(text):
        if text.startswith(("/*", "//"), i):
            end = text.find("*/", i + 2) + 2 if text[i + 1] == "*" else text.find("\n", i)
            end = len(text) if end < i + 2 else end
            yield line, text[i:end]
        elif text[i] in "\"'`":
            end = i + 1
            while end < len(text) and text[end] not in (text[i], "\n" if text[i] != "`" else ""):
                end += 2 if text[end] == "\\" else 1
            end += 1
        else:
            end = i + 1
        line += text.count("\n", i, end)
        i = end


def figures(path: Path) -> list[str]:
    """`path:line: figure` for each figure in the file's comments and docstrings."""
    text = path.read_text(encoding="utf-8")
    prose = python_prose(text) if path.suffix == ".py" else c_like_prose(text)
    return [
        f"{path.relative_to(SRC.parent)}:{line + part[: m.start()].count(chr(10))}: {m.group(0)}"
        for line, part in prose
        for m in FIGURE.finditer(part)
    ]


SOURCES = sorted(p for p in SRC.rglob("*") if p.suffix in (".py", ".c", ".h", ".js"))


@pytest.mark.parametrize(
    "text, found",
    [
        (
            "# on the Intel Xeon of 2026-12-02 torch ran 385 GFLOP/s\n",
            ["2026-12-02", "385 GFLOP/s"],
        ),
        (
            "# measured at 14:02 UTC: 12.5 GB/s, 40 tok/s, 1,200 tokens/s\n",
            ["14:02 UTC", "12.5 GB/s", "40 tok/s", "1,200 tokens/s"],
        ),
        (
            '"""86 s instead of 141, 4 ms a call, 80 µs, 3 seconds."""\n',
            ["86 s", "4 ms", "80 µs", "3 seconds"],
        ),
        (
            "# 1.48x the step; ~10x cheaper; 2.3 times; 35% faster\n",
            ["1.48x", "10x cheaper", "2.3 times", "35% faster"],
        ),
        (
            "# 2 MB pages of 4 KB, a 256 x 576 product, 503s, 4 * d_model, -8 times each lane, "
            "maxs and mins of 7, mins\n",
            [],
        ),
        ('x = "2026-12-02 at 86 s"  # (a string: not prose)\n', []),
    ],
)
def test_the_scan_finds_figures_and_leaves_sizes_shapes_and_strings(text, found, tmp_path):
    source = tmp_path / "src" / "example.py"
    source.parent.mkdir()
    source.write_text(text, encoding="utf-8")
    global SRC
    kept, SRC = SRC, tmp_path / "src"
    try:
        assert [hit.split(": ", 1)[1] for hit in figures(source)] == found
    finally:
        SRC = kept


def test_c_and_javascript_comments_are_read_and_their_strings_skipped(tmp_path):
    text = (
        'const url = "http://host/2026-12-02";  // 40 ms a request\n'
        "/* a block read\n   at 12.5 GB/s */\nlet s = '/* 1.5x */';\n"
    )
    assert [(line, part[:2]) for line, part in c_like_prose(text)] == [(1, "//"), (2, "/*")]
    assert [FIGURE.findall(part) for _, part in c_like_prose(text)] == [["40 ms"], ["12.5 GB/s"]]


def test_no_measured_figure_in_the_sources_comments_and_docstrings():
    found = [hit for path in SOURCES for hit in figures(path)]
    assert found == [], (
        "measured figures in src/'s comments and docstrings (keep the reason, move the number "
        "to benchmarks/results/ and point at benchmarks/README.md):\n" + "\n".join(found)
    )
