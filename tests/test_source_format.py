"""The C kernels and the explorer's JavaScript as a reader holds them: lines of at most 100 columns
(ruff holds the Python to the same), and, where clang-format is installed (the test environment
installs it: pyproject's test extra), each file exactly as clang-format leaves it under the
repository's .clang-format (`make format` applies it).

- Columns are characters, not bytes: the JavaScript writes `·`, `→` and `“` in its strings.
- The kernels' unity file reaches every C file and header in kernels/c/ (cpu.c apart, a library
  of its own) through its includes: what the build compiles and what its cache key reads, so that
  an edit to any of them builds anew.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnlab.generate import kernels

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "src"
TEST_SOURCES = ROOT / "tests" / "c"  # the tests' C programs, kept alike
ANCHOR_SOURCES = ROOT / "benchmarks" / "anchors"  # the benchmarks' C anchors, kept alike
COLUMNS = 100


def formatted_files(root: Path = SOURCES) -> list[Path]:
    """The C, header and JavaScript files under `root` that the formatter keeps."""
    return sorted(p for p in root.rglob("*") if p.suffix in (".c", ".h", ".js") and p.is_file())


def every_formatted_file() -> list[Path]:
    """The formatted files of the package, the tests' C programs and the benchmarks' anchors."""
    return formatted_files() + formatted_files(TEST_SOURCES) + formatted_files(ANCHOR_SOURCES)


def long_lines(paths: list[Path]) -> list[str]:
    """'path:line: N columns' for each line of `paths` longer than COLUMNS characters."""
    found = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > COLUMNS:
                found.append(f"{path}:{number}: {len(line)} columns")
    return found


def clang_format() -> str | None:
    """The clang-format beside this Python (the venv's, from PyPI), else the one on PATH."""
    beside = Path(sys.executable).with_name("clang-format")
    return str(beside) if beside.is_file() else shutil.which("clang-format")


def test_the_sources_are_c_headers_and_javascript_of_both_rooms():
    names = {p.relative_to(SOURCES).as_posix() for p in formatted_files()}
    assert {
        "attnlab/generate/kernels/c/kernels.c",
        "attnlab/generate/kernels/c/common.h",
        "attnlab/generate/kernels/c/cpu.c",
        "attnlab/explorer/static/app.js",
        "attnlab/explorer/static/views/map.js",
    } <= names


def test_no_c_header_or_javascript_line_is_over_100_columns():
    assert long_lines(every_formatted_file()) == []


def test_a_long_line_is_found_and_counted_in_characters(tmp_path):
    (tmp_path / "a.js").write_text("// " + "·" * 97 + "\n" + "x" * 101 + "\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("y" * 200 + "\n")  # not a source the formatter keeps
    assert long_lines(formatted_files(tmp_path)) == [f"{tmp_path / 'a.js'}:2: 101 columns"]


def test_the_sources_are_as_clang_format_leaves_them():
    program = clang_format()
    if program is None:
        pytest.skip("clang-format is not installed (pip install clang-format, or make venv-test)")
    paths = [str(p) for p in every_formatted_file()]
    result = subprocess.run(
        [program, "--dry-run", "--Werror", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"run `make format`:\n{result.stderr[-3000:]}"


def included_files(source: Path) -> list[Path]:
    """`source` and every file it includes by a quoted name (`#include "common.h"`), at any depth,
    each once."""
    found, todo = [], [source]
    while todo:
        path = todo.pop(0)
        if path in found or not path.is_file():
            continue
        found.append(path)
        text = path.read_text(encoding="utf-8", errors="replace")
        todo += [
            path.parent / name for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M)
        ]
    return found


def test_the_unity_file_includes_every_c_file_and_header_of_the_kernels():
    folder = Path(kernels.SOURCE).parent
    reached = {p.name for p in included_files(Path(kernels.SOURCE))}
    on_disk = {p.name for p in folder.iterdir() if p.suffix in (".c", ".h")}
    assert reached == on_disk - {"cpu.c"}


def test_an_edit_to_an_included_header_builds_the_library_anew(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / "cache"))
    main, header = tmp_path / "main.c", tmp_path / "part.h"
    main.write_text('#include "part.h"\nint attnlab_answer(void) { return ANSWER; }\n')
    header.write_text("#define ANSWER 1\n")
    first = kernels.compile_library(main, (["-O1"],))
    assert first is not None and kernels.compile_library(main, (["-O1"],)) == first  # cached
    header.write_text("#define ANSWER 2\n")
    second = kernels.compile_library(main, (["-O1"],))
    assert second != first and ctypes.CDLL(str(second)).attnlab_answer() == 2
