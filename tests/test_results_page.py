"""The results page is data: docs/results.md is what benchmarks/render_results.py writes from the
committed records in benchmarks/results/, and every figure README.md, benchmarks/README.md and docs/
quote is on it. benchmarks/README.md is the scripts' manual, not a diary.

A figure (render_results.quoted_figures) is a number with a unit of speed or time, a ratio with
decimals, a share or a size with decimals, outside code blocks and inline code. A tutorial's
shares are the output of its own script (which the suite runs), so in docs/tutorials/ only the
other figures count.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    from render_results import (
        PAGE,
        RESULTS,
        RecordError,
        check_record,
        load_records,
        normal,
        quoted_figures,
        render,
    )
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def test_the_results_page_is_what_the_committed_records_render():
    page = PAGE.read_text(encoding="utf-8")
    assert page == render(load_records(RESULTS)), (
        "docs/results.md differs from the records in benchmarks/results/: run "
        "python benchmarks/render_results.py"
    )


def test_every_committed_record_names_its_machine_versions_command_and_anchor():
    records = load_records(RESULTS)
    assert records, "no records in benchmarks/results/"
    for record in records:
        assert record["versions"].get("attnlab") and record["versions"].get("torch"), record
        assert record["command"].startswith(("python benchmarks/", "ONEDNN", "ATTNLAB", "OMP"))
        assert record["machine"]["cores"] > 0 and record["machine"]["instruction_sets"]
        if record["anchor"]:  # the anchor's figure beside attnlab's, or attnlab's error against it
            assert any(
                f["anchor"] is not None or " vs " in f["name"] or "equal to" in f["name"]
                for f in record["figures"]
            ), record["benchmark"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r.pop("command"), "no 'command'"),
        (lambda r: r["machine"].pop("cpu"), "no machine.'cpu'"),
        (lambda r: r["figures"][0].update(attnlab="fast"), "figures[].'attnlab' is 'fast'"),
        (lambda r: r.update(figures=[]), "no figures"),
    ],
)
def test_a_record_missing_a_part_is_refused_naming_the_file_and_the_part(change, message):
    record = json.loads(sorted(RESULTS.glob("*.json"))[0].read_text(encoding="utf-8"))
    change(record)
    with pytest.raises(RecordError, match=message.replace("(", r"\(").replace("[", r"\[")):
        check_record(record, "x.json")


@pytest.mark.parametrize(
    "text, found",
    [
        (
            "2.37x the speed, 357 tok/s, 33.1 GB/s, 1.5x, 809 s, 55 %, 12% and 1,200 tokens/s",
            ["2.37x", "357 tok/s", "33.1 GB/s", "1.5x", "809 s", "55 %", "12%", "1,200 tokens/s"],
        ),
        (
            "4 ms a call, 80 µs, 3 seconds, 2 min, a 1.3 GB file",
            ["4 ms", "80 µs", "3 seconds", "2 min", "1.3 GB"],
        ),  # fmt: skip
        # settings and shapes, not measurements; code is not prose
        ("4x the width, 256 x 576, 4 x n_embd, 2 MB pages, 24 GiB, SmolLM2-135M, tg128", []),
        ("run `sleep 5 s` and `2.5x`", []),
        ("```\n12.5 GB/s\n```\nafter: 1.25x", ["1.25x"]),
    ],
)
def test_the_scan_finds_figures_and_leaves_settings_shapes_and_code(text, found):
    assert [figure for _, figure in quoted_figures(text)] == found


def test_a_tutorials_shares_are_its_output_its_times_are_figures():
    text = "heads 0 and 1 carry 83% of it, in 17 s"
    assert [f for _, f in quoted_figures(text, shares=False)] == ["17 s"]


def unsupported(root: Path, page_text: str) -> list[str]:
    """`path:line: figure` for each figure quoted in root's README.md and docs/ that the page
    does not show."""
    on_page = {normal(figure) for _, figure in quoted_figures(page_text)}
    page = root / "docs" / "results.md"
    readmes = [root / "README.md", root / "benchmarks" / "README.md"]
    sources = [*readmes, *sorted((root / "docs").rglob("*.md"))]
    return [
        f"{path.relative_to(root)}:{line}: {figure} is not on docs/results.md"
        for path in sources
        if path.is_file() and path != page
        for line, figure in quoted_figures(
            path.read_text(encoding="utf-8"), shares="tutorials" not in path.parts
        )
        if normal(figure) not in on_page
    ]


def test_every_figure_quoted_in_the_readme_and_the_docs_is_on_the_results_page():
    missing = unsupported(ROOT, PAGE.read_text(encoding="utf-8"))
    assert not missing, (
        "figures quoted but not measured (quote docs/results.md, or add the benchmark's record "
        "and render the page):\n" + "\n".join(missing)
    )


def test_a_quoted_figure_missing_from_the_page_is_named_with_its_place(tmp_path):
    (tmp_path / "docs" / "tutorials").mkdir(parents=True)
    page = "| machine | 3.25x | 31.2 s |\n"
    (tmp_path / "docs" / "results.md").write_text(page)
    (tmp_path / "README.md").write_text("# attnlab\n\nTrains in 31.2 s, 3.25x nanoGPT's speed.\n")
    (tmp_path / "docs" / "tutorials" / "t.md").write_text("carries 83% of it\n")
    assert unsupported(tmp_path, page) == []
    (tmp_path / "docs" / "how.md").write_text("text\n\nabout 2.4x faster\n")
    assert unsupported(tmp_path, page) == ["docs/how.md:3: 2.4x is not on docs/results.md"]
    (tmp_path / "README.md").write_text("# attnlab\n\nno figure here\n")
    (tmp_path / "docs" / "how.md").unlink()
    assert unsupported(tmp_path, page) == []


MANUAL = ROOT / "benchmarks" / "README.md"
# a heading that names a session, an issue, a branch, a date or a clock time belongs to a diary
DIARY = re.compile(
    r"session|issue|branch|\bagain\b|helper|\b20\d\d\b|\d{1,2}:\d\d|UTC|yesterday|today",
    re.IGNORECASE,
)
DATE = re.compile(
    r"\b20\d\d-[01]\d-[0-3]\d\b|\b[0-2]?\d:[0-5]\d\s*UTC\b|\b\d{1,2} (?:Nov|Dec)\w* 20\d\d"
)


def test_the_benchmarks_manual_is_short_dateless_and_names_every_script():
    text = MANUAL.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 500, f"benchmarks/README.md has {len(lines)} lines; the manual keeps 500"
    headings = [line for line in lines if line.startswith("#") and DIARY.search(line)]
    assert not headings, f"headings of a diary: {headings}"
    assert not DATE.findall(text), DATE.findall(text)
    scripts = sorted(
        p.name
        for p in (ROOT / "benchmarks").glob("*.py")
        if not p.name.startswith("_") and p.name != "render_results.py"
    )
    missing = [name for name in scripts if f"{name}" not in text]
    assert not missing, f"benchmark scripts benchmarks/README.md does not describe: {missing}"


def test_the_manual_check_catches_a_diary_heading_and_a_date():
    assert DIARY.search("### The Intel Xeon, 16:55 UTC (issue 25)")
    assert DIARY.search("### Second session: prefetch") and not DIARY.search("### Decode kernels")
    assert DATE.findall("measured 2026-12-02, 14:02 UTC") == ["2026-12-02", "14:02 UTC"]
