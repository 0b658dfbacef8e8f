"""The results page: docs/results.md rendered from the records in benchmarks/results/.

    python benchmarks/render_results.py            # rewrite docs/results.md
    python benchmarks/render_results.py --check    # exit 1 when docs/results.md is not up to date

Design choices:
- The records are the data (benchmarks/_common.py, `write_result`, says what one holds); this page
  is only a view of them, so it is never edited by hand and a test fails when it differs from what
  this script writes from the committed records.
- One table per benchmark, in the order of their names; in a table, one group of rows per record
  (a machine, and a setup where the benchmark has several), newest first by the record's
  `recorded` time. The page prints no date: the order says which is newest, the versions column
  says what was measured.
- Each row is one figure: attnlab's value, the anchor's measured in the same run, and the ratio
  (how many times better attnlab is, whatever the unit). Numbers keep three significant digits
  (four decimals for a unitless figure such as a loss), so a figure quoted elsewhere can be found
  here as written.
- `quoted_figures` is what counts as a figure in prose (README.md and docs/): a number with a unit
  of speed or time, a ratio with decimals (2.37x), a share (55 %), a size with decimals (1.3 GB);
  whole factors and sizes (4x the width, 2 MB pages) are settings, not measurements.
  tests/test_results_page.py checks that every one quoted outside code appears on this page.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
PAGE = HERE.parent / "docs" / "results.md"

# what a record must hold (benchmarks/_common.py, write_result), with the type of each
RECORD_KEYS = {
    "benchmark": str, "measures": str, "setup": str, "anchor": (str, type(None)),
    "machine": dict, "versions": dict, "command": str, "recorded": str, "figures": list,
}  # fmt: skip
MACHINE_KEYS = {
    "cpu": str, "cores": int, "instruction_sets": list, "caches": dict, "limits": dict,
    "load_average": list,
}  # fmt: skip
FIGURE_KEYS = {
    "name": str, "unit": str, "attnlab": (int, float), "anchor": (int, float, type(None)),
    "ratio": (int, float, type(None)),
}  # fmt: skip


class RecordError(ValueError):
    """A results file that is not a record this page can show."""


def check_record(record: Any, where: str) -> dict[str, Any]:
    """`record` itself when it holds every key of RECORD_KEYS, MACHINE_KEYS and FIGURE_KEYS with
    its type, and at least one figure; otherwise RecordError naming the file and the key."""

    def check(value: Any, keys: dict[str, Any], part: str) -> None:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: {part or 'the record'} is not a JSON object")
        for key, kind in keys.items():
            if key not in value:
                raise RecordError(f"{where}: no {part}{key!r}; write it with _common.write_result")
            if not isinstance(value[key], kind) or isinstance(value[key], bool):
                raise RecordError(f"{where}: {part}{key!r} is {value[key]!r}, of the wrong type")

    check(record, RECORD_KEYS, "")
    check(record["machine"], MACHINE_KEYS, "machine.")
    if not record["figures"]:
        raise RecordError(f"{where}: no figures")
    for figure in record["figures"]:
        check(figure, FIGURE_KEYS, "figures[].")
    return record


def load_records(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every record in `folder` (its *.json files), each checked by `check_record`."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise RecordError(f"{path}: not JSON ({error})") from None
        records.append(check_record(record, str(path)))
    return records


def number(value: float, unit: str) -> str:
    """Three significant digits (no exponent), four decimals for a unitless figure (three
    significant digits for one below 0.001, such as an error against a reference)."""
    if not unit:
        return f"{value:.3g}" if 0 < abs(value) < 1e-3 else f"{value:.4f}"
    size = abs(value)
    if size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def quantity(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return number(value, unit) + (f" {unit}" if unit else "")


def machine_cell(machine: dict[str, Any]) -> str:
    """The machine's name (as _common.machine_name gives it), its measured bandwidths and its load
    average when measured."""
    sys.path.insert(0, str(HERE))
    try:
        from _common import machine_name
    finally:
        sys.path.remove(str(HERE))
    parts = [machine_name(machine)]
    for key, what in (("read_bandwidth", "read"), ("copy_bandwidth", "copy")):
        if machine.get(key):
            parts.append(f"{machine[key] / 1e9:.1f} GB/s {what}")
    parts.append("load " + ", ".join(f"{x:.1f}" for x in machine["load_average"]))
    return "; ".join(parts)


def versions_cell(record: dict[str, Any]) -> str:
    names = {"attnlab": "attnlab", "torch": "torch", "anchor": record["anchor"] or "anchor"}
    # a commit by its first 12 hex digits ("+" kept: the files differed from it)
    short = lambda v: re.sub(r"\b([0-9a-f]{12})[0-9a-f]{28}\b", r"\1", str(v))  # noqa: E731
    return ", ".join(
        f"{names[key]} {short(value)}"
        for key, value in record["versions"].items()
        if key in names and value
    )


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(records: list[dict[str, Any]]) -> str:
    lines = [
        "# Results",
        "",
        "Generated by `python benchmarks/render_results.py` from the records in "
        "benchmarks/results/ (one per benchmark, setup and machine); do not edit it by hand. "
        "benchmarks/README.md says what each benchmark measures and how to run it.",
        "",
        "Each figure stands beside its anchor's, measured in the same run on the same machine. "
        "The ratio is how many times better attnlab is: the anchor's time over attnlab's, or "
        "attnlab's rate over the anchor's; above 1 means attnlab is ahead. In each table the "
        "newest record comes first; the versions column names the commits measured.",
    ]
    by_benchmark: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_benchmark.setdefault(record["benchmark"], []).append(record)
    for benchmark in sorted(by_benchmark):
        group = sorted(by_benchmark[benchmark], key=lambda r: r["recorded"], reverse=True)
        anchors = sorted({r["anchor"] for r in group if r["anchor"]})
        lines += [
            "",
            f"## {benchmark}",
            "",
            cell(group[0]["measures"]) + f" Anchor: {', '.join(anchors) or 'none'}.",
            "",
            "| machine | setup | figure | attnlab | anchor | ratio | versions |",
            "| --- | --- | --- | ---: | ---: | ---: | --- |",
        ]
        for record in group:
            for i, figure in enumerate(record["figures"]):
                first = i == 0
                ratio = figure["ratio"]
                lines.append(
                    "| "
                    + " | ".join(
                        [
                            cell(machine_cell(record["machine"])) if first else "",
                            cell(record["setup"]) if first else "",
                            cell(figure["name"]),
                            quantity(figure["attnlab"], figure["unit"]),
                            quantity(figure["anchor"], figure["unit"]),
                            "-" if ratio is None else number(ratio, "x") + "x",
                            cell(versions_cell(record)) if first else "",
                        ]
                    )
                    + " |"
                )
        lines += ["", "Commands, in the order of the table:", ""]
        lines += [f"- `{record['command']}`" for record in group]
    return "\n".join(lines) + "\n"


# Figures quoted in prose ------------------------------------------------------------------------

_NUMBER = r"(?<![\w.,/-])\d+(?:,\d{3})*(?:\.\d+)?"
FIGURE = re.compile(
    _NUMBER + r"(?:"
    # a rate: 33.1 GB/s, 385 GFLOP/s, 357 tok/s, 1,200 tokens/s, 12 it/s
    r"\s?(?:[KMGT]i?B/s|[KMGT]?FLOP/s|tok/s|tokens/s|it/s|steps/s)(?![\w/])"
    # a time: 809 s, 4 ms, 80 µs, 3 seconds, 2 minutes, 1.5 h
    r"|\s?(?:ms|µs|us|ns|min|minutes?|seconds?|hours?)(?![\w/])"
    r"|\s(?:s|h)\b(?![\w/'])"
    # a share: 55 %, 12%
    r"|\s?(?P<share>%)"
    r")"
    # a ratio with its decimals: 2.37x, 1.5 x (not a factor of the design, "4x the width", nor a
    # shape, 4x4, 256 x 576)
    r"|(?<![\w.,/-])\d+\.\d+\s?[x×](?!\w)(?!\s*\d)"
    # a size with a fraction (1.3 GB, 270.5 MB); a whole one (2 MB pages, 24 GiB) is a setting
    r"|(?<![\w.,/-])\d+\.\d+\s?[KMGT]i?B\b(?!/)"
)
_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")


def normal(figure: str) -> str:
    """A figure as compared: no spaces or thousands separators, one spelling of each unit."""
    text = re.sub(r"[\s,]", "", figure).replace("×", "x").replace("tokens/s", "tok/s")
    return text.replace("seconds", "s").replace("second", "s")


def quoted_figures(text: str, shares: bool = True) -> Iterator[tuple[int, str]]:
    """(line, figure) of each figure in a Markdown text, outside fenced code blocks and inline
    code spans; shares (55 %) only with `shares` (a tutorial's shares are its script's output, such
    as a head's part of a logit, which the suite checks by running it)."""
    fenced = False
    for line_number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for match in FIGURE.finditer(_INLINE_CODE.sub(" ", line)):
            if shares or not match.group("share"):
                yield line_number, match.group(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the records' folder")
    parser.add_argument("--out", type=Path, default=PAGE, help="the page to write")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when --out differs from the rendering"
    )
    args = parser.parse_args()
    try:
        page = render(load_records(args.results))
    except RecordError as error:
        raise SystemExit(f"render_results: {error}") from None
    if args.check:
        current = args.out.read_text(encoding="utf-8") if args.out.is_file() else ""
        if current != page:
            raise SystemExit(
                f"render_results: {args.out} is not what the records give; run "
                "python benchmarks/render_results.py"
            )
        return
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
