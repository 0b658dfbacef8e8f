"""The built wheel: what pip installs for a user must carry everything attnlab needs at run time.

The wheel is built offline from a copy of the sources (so the worktree gets no build/ or egg-info),
with this environment's setuptools (`pip wheel --no-deps --no-build-isolation`), then checked three
ways:
its metadata (torch as a range, never one version: pip must keep a user's CPU or CUDA torch), its
contents (every file of the package, the explorer's static page included) and a run of the installed
copy (`attnlab --version`, the page and the built-in corpus found from the install, not from src/).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import attnlab

pytestmark = pytest.mark.slow  # builds a wheel and starts python: seconds

ROOT = Path(attnlab.__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(
        ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "-w",
            str(tmp / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (built,) = (tmp / "dist").glob("attnlab-*.whl")
    return built


def metadata(wheel: Path) -> tuple[list[str], object]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        return names, Parser().parsestr(zf.read(meta).decode())


def test_wheel_requires_a_torch_range_and_carries_every_package_file(wheel):
    names, meta = metadata(wheel)
    assert meta["Version"] == attnlab.__version__
    requires = meta.get_all("Requires-Dist")
    (torch,) = [
        r
        for r in requires
        if r.split(";")[0].replace(" ", "").startswith("torch") and "extra" not in r
    ]
    # a range, no local (+cpu) build
    assert ">=" in torch and "==" not in torch and "+" not in torch, torch
    assert any(r.lower().replace("-", "_").startswith("huggingface_hub") for r in requires), (
        requires
    )
    package = ROOT / "src" / "attnlab"
    expected = {
        f"attnlab/{p.relative_to(package).as_posix()}"
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert {
        "attnlab/explorer/static/index.html",
        "attnlab/explorer/static/app.js",
        "attnlab/explorer/static/views/dict.js",
        "attnlab/generate/kernels/c/kernels.c",
        "attnlab/generate/kernels/c/common.h",
    } <= expected  # the page's modules, in a folder too; the kernels' C files and headers
    assert expected <= set(names), sorted(expected - set(names))
    with zipfile.ZipFile(wheel) as zf:
        (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "attnlab = attnlab.cli:main" in zf.read(entry).decode()


def test_the_installed_wheel_runs_from_its_own_files(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--quiet",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": str(target)}  # the install, not src/
    version = subprocess.run(
        [str(target / "bin" / "attnlab"), "--version"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert version.returncode == 0 and version.stdout.strip() == f"attnlab {attnlab.__version__}", (
        version.stderr
    )
    probe = (
        "import attnlab, attnlab.explorer as e, attnlab.data as d; "
        "print(attnlab.__file__); print((e.STATIC / 'index.html').is_file()); "
        "print(len(d.builtin_corpus()))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    where, page, corpus = result.stdout.split()
    assert Path(where).is_relative_to(target) and page == "True" and int(corpus) > 100_000, (
        result.stderr
    )


def test_pip_keeps_the_torch_an_environment_already_has(wheel, tmp_path):
    """Installing attnlab where torch (here the CPU build) and the other dependencies are present
    installs
    attnlab alone: nothing to download (--no-index), torch left as it is."""
    report = tmp_path / "report.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--quiet",
            "--report",
            str(report),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["attnlab"], installs
