"""The manual (README.md and docs/) as the code has it: its site builds, its Python runs, its
generated pages and its tables follow the code, and it stays a manual rather than a lab notebook.

Design choices:
- Every ```python block of a page runs as written, the page's blocks in order in one fresh
  interpreter (a later block uses what an earlier one made), in a fresh folder. A block followed by
  a ```text block must print exactly that text: the page shows what its code prints.
- What a reader has before a page's code, the test makes (PREPARE), as tests/test_readme_commands.py
  does for the bash blocks: the induction tutorial reads runs/induction/induction-2L, which
  `attnlab experiment induction` trains; here it is an untrained model of the same shape, since the
  blocks' numbers are not asserted, only that they run.
- The site is built with `mkdocs build --strict` into a temporary folder: a broken link or anchor,
  or a page missing from mkdocs.yml's nav, fails. Nothing is fetched (mkdocs.yml says why).
- The reference pages are compared with what tools/reference_pages.py writes from the code; the
  commands page's help texts say what a flag does, never how long it takes or how much faster.
- The Python API page (docs/reference/api.md, mkdocstrings) must carry every name a user is shown:
  `attnlab.__all__`, each `attnlab.a.b` and `from attnlab.a import b` of the pages, the methods
  they call on a model or a cache; each with a docstring (griffe's reading, as the page renders).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import attnlab
from attnlab.formats.hf import architectures

ROOT = Path(attnlab.__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block, in order."""
    found = re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)
    return [(m.group(1), m.group(2)) for m in found]


def python_blocks(text: str) -> list[tuple[str, str | None]]:
    """(code, the text it must print, or None) of each ```python block."""
    blocks, found = fenced(text), []
    for i, (language, code) in enumerate(blocks):
        if language == "python":
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            shown = after[1] if after and after[0] == "text" and following(text, code) else None
            found.append((code, shown))
    return found


def following(text: str, code: str) -> bool:
    """True when the block right after this ```python block is a ```text block, with only blank
    lines between them."""
    end = text.index("```python\n" + code + "```") + len("```python\n" + code + "```")
    return text[end:].lstrip("\n").startswith("```text\n")


PYTHON_PAGES = [p for p in PAGES if python_blocks(p.read_text(encoding="utf-8"))]

# Runs the blocks given as JSON on stdin in one namespace; prints what each printed, as JSON
RUNNER = """
import contextlib, io, json, sys
blocks, printed, namespace = json.load(sys.stdin), [], {"__name__": "__main__"}
for number, code in enumerate(blocks):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, f"block {number + 1}", "exec"), namespace)
    printed.append(out.getvalue())
print(json.dumps(printed))
"""


def prepare_induction_model(folder: Path) -> None:
    """runs/induction/induction-2L: the shape `attnlab experiment induction` trains, untrained."""
    import torch

    from attnlab.inspection.experiments.induction import InductionSetup

    setup = InductionSetup()
    torch.manual_seed(0)
    config = attnlab.ModelConfig(
        d_vocab=setup.d_vocab,
        n_ctx=setup.n_ctx,
        d_model=64,
        n_layers=2,
        n_heads=4,
        attn_only=True,
        tie_embeddings=False,
    )
    attnlab.save(attnlab.Transformer(config), folder / "runs" / "induction" / "induction-2L")


PREPARE = {"docs/tutorials/induction-heads.md": prepare_induction_model}


@pytest.mark.slow
@pytest.mark.parametrize("page", PYTHON_PAGES, ids=[name(p) for p in PYTHON_PAGES])
def test_python_blocks_run_as_written(page, tmp_path):
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    if name(page) in PREPARE:
        PREPARE[name(page)](tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "ATTNLAB_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / ".hf"), MPLBACKEND="Agg")
    done = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([code for code, _ in blocks]),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, f"{name(page)}:\n{done.stderr[-4000:]}"
    printed = json.loads(done.stdout.splitlines()[-1])
    for number, ((code, shown), output) in enumerate(zip(blocks, printed), start=1):
        if shown is not None:
            assert output == shown, f"{name(page)}, block {number} printed:\n{output}"


def test_the_chapters_script_is_the_pages_code():
    """docs/tutorials/chapters_in_code.py, section by section, is the page's Python blocks under
    their headings, so `python docs/tutorials/chapters_in_code.py` runs what the page shows."""
    page = (DOCS / "tutorials" / "chapters-in-code.md").read_text(encoding="utf-8")
    script = (DOCS / "tutorials" / "chapters_in_code.py").read_text(encoding="utf-8")
    sections = re.split(r"^# %% (.+)\n", script, flags=re.M)[1:]
    from_script = [(title, code.strip("\n")) for title, code in zip(sections[::2], sections[1::2])]
    headings = re.findall(r"^## (.+)$", page, flags=re.M)
    from_page = list(zip(headings, (code.strip("\n") for code, _ in python_blocks(page))))
    assert from_page == from_script
    assert all(shown is not None for _, shown in python_blocks(page)), "a block without its output"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with `mkdocs build --strict` (a griffe warning about a docstring of the
    API page fails it too)."""
    folder = tmp_path_factory.mktemp("site") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder


def test_the_site_builds_strictly(site):
    assert (site / "reference" / "commands" / "index.html").exists()


def resolve(dotted: str) -> object:
    """The object `attnlab.a.b` names, importing modules on the way; None where nothing is."""
    import importlib

    parts = dotted.split(".")
    found: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            found = getattr(found, part)
        except AttributeError:
            try:
                found = importlib.import_module(".".join(parts[: i + 1]))
            except ImportError:
                return None
    return found


def names_the_manual_uses() -> dict[str, object]:
    """{name: object} of what a user calls: `attnlab.__all__`, every `attnlab.a.b` README.md and
    docs/ write and every `from attnlab.a import b` they show (modules left out: the page documents
    what a module holds), the methods they call on a model (`model.run_with_cache(`) or a cache
    (`cache.stack_head_results(`), and the functions of `attnlab.utils` and `attnlab.patching`."""
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
    names = {f"attnlab.{n}" for n in attnlab.__all__}
    names |= set(re.findall(r"\battnlab(?:\.[A-Za-z_]\w*)+", text))
    for module, imported in re.findall(r"^from (attnlab[\w.]*) import ([\w, ]+)$", text, re.M):
        names |= {f"{module}.{n.strip()}" for n in imported.split(",")}
    for variable, cls in (("model", "Transformer"), ("cache", "ActivationCache")):
        names |= {f"attnlab.{cls}.{m}" for m in re.findall(rf"\b{variable}\.(\w+)\(", text)}
    # `from attnlab import utils, patching`, TransformerLens's module names
    for module in ("utils", "patching"):
        called = re.findall(rf"(?<![\w.]){module}\.(\w+)\(", text)
        names |= {f"attnlab.{module}.{m}" for m in called}
    found = {dotted: resolve(dotted) for dotted in sorted(names)}
    return {n: obj for n, obj in found.items() if not isinstance(obj, type(attnlab))}


def test_the_api_page_documents_every_name_the_manual_uses(site):
    """Each name is on docs/reference/api.md (its anchor in the built page: the object's own path,
    so `attnlab.load` is attnlab.workbench.load) with a docstring griffe reads."""
    import griffe

    package = griffe.GriffeLoader(search_paths=[str(ROOT / "src")]).load("attnlab")
    page = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
    problems = []
    for dotted, obj in names_the_manual_uses().items():
        assert obj is not None, f"{dotted}: the manual names it, and attnlab has no such thing"
        if "<locals>" in getattr(obj, "__qualname__", ""):
            # made at import time (the patching sweeps): griffe reads no docstring; the page names
            # it and help() shows its own
            if f"<code>{dotted}</code>" not in page:
                problems.append(f"{dotted} (made by {obj.__qualname__}) is not named on the page")
            elif not (obj.__doc__ or "").strip():
                problems.append(f"{dotted} (made by {obj.__qualname__}) has no docstring")
            continue
        if callable(obj) and hasattr(obj, "__qualname__"):
            path = f"{obj.__module__}.{obj.__qualname__}"
        else:  # data (attnlab.PRESETS): where griffe finds the name imported from
            path = package[dotted.removeprefix("attnlab.")].canonical_path
        documented = package[path.removeprefix("attnlab.")]
        if f'id="{path}"' not in page:
            problems.append(f"{dotted} ({path}) is not on docs/reference/api.md")
        elif documented.docstring is None or not documented.docstring.value.strip():
            problems.append(f"{dotted} ({path}) has no docstring")
    assert not problems, "\n".join(problems)


def reference_pages():
    """tools/reference_pages.py, the script that writes the generated reference pages."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import reference_pages
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return reference_pages


def test_the_reference_pages_are_the_codes():
    for path, text in reference_pages().pages().items():
        assert path.read_text(encoding="utf-8") == text, (
            f"{path.relative_to(ROOT)} differs from the code: run python tools/reference_pages.py"
        )


# what a help text must not carry: how long a flag takes or how much faster it is (figures live in
# benchmarks/results/ and on the results page, measured on a named machine)
TIMING = re.compile(
    r"\b(?:tens|hundreds|a few|several) of (?:milli)?(?:seconds|minutes|hours)\b"
    r"|\b(?:faster|slower|quicker|speed-?ups?|pays off)\b|\b\d+(?:\.\d+)?x\b|benchmarks/",
    re.I,
)


def test_the_help_texts_say_what_a_flag_does_not_how_long_it_takes():
    page = reference_pages().commands_page()
    found = [line for line in page.splitlines() if TIMING.search(line)]
    assert not found, "help texts with timings or speed claims:\n" + "\n".join(found)


def test_the_architectures_table_lists_every_supported_architecture():
    page = (DOCS / "reference" / "architectures.md").read_text(encoding="utf-8")
    table = page[page.index("## Hugging Face checkpoints") : page.index("## GGUF files")]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M)
    listed = [row for row in rows if row != "model_type"]
    assert sorted(listed) == sorted(architectures()), "the table and attnlab.formats.hf differ"
    from attnlab.formats import gguf

    gguf_table = page[page.index("## GGUF files") :]
    listed = re.findall(r"^\| `([a-z0-9_-]+)` \|", gguf_table, flags=re.M)
    assert sorted(listed) == sorted(gguf.ARCHITECTURES), "the GGUF table and formats.gguf differ"


def test_the_readme_is_a_short_manual():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it at most 200"
    first = "\n".join(lines[:60])
    assert "attnlab explore" in first, "`attnlab explore` must be in the README's first 60 lines"
    assert "make demo" in first and "make test" in first and "run_with_cache" in first
    assert "](docs/results.md)" in text


def test_the_readme_says_what_its_commands_need_before_them():
    """A newcomer reads top to bottom: before the first `attnlab` command block, the README says
    how `attnlab` gets on the PATH (the venv `make demo` made), and before a command reads
    input.txt, what that file is."""
    text = README.read_text(encoding="utf-8")
    first_command = next(
        m.start()
        for m in re.finditer(r"^```bash\n(.*?)^```", text, re.S | re.M)
        if re.search(r"^attnlab ", m.group(1), re.M)
    )
    activate = text.find("source .venv/bin/activate")
    assert 0 <= activate < first_command, "say `source .venv/bin/activate` before the commands"
    uses = text.find("--data input.txt")
    explained = text.find("`input.txt` is")
    assert uses < 0 or 0 <= explained < uses, "say what input.txt is before a command reads it"


@pytest.mark.parametrize("page", PAGES, ids=[name(p) for p in PAGES])
def test_no_date_or_clock_time(page):
    text = page.read_text(encoding="utf-8")
    found = re.findall(r"\b20\d\d-\d\d(?:-\d\d)?\b|\b\d{1,2}:\d\d(?::\d\d)? ?UTC\b|\bUTC\b", text)
    assert not found, f"{name(page)} carries dates or clock times: {found}"


def test_the_readmes_links_lead_somewhere():
    """The README is not part of the site (the site checks its own links): its relative links and
    pictures must name files that exist."""
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
