"""The set-up that `make venv` and `make test` do, as it must go on machines other than this one.

- Which torch `make venv` installs (tools/install_torch.py), decided without network access: pip
  gets a configuration of the test's own (PIP_CONFIG_FILE=os.devnull drops every pip config file,
  PIP_NO_INDEX=1 keeps pip off the network, PIP_FIND_LINKS a folder of the test's or none), and the
  script prints the command it would run.
- The C kernels' tests fail, never skip, where no compiler can build the kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import attnlab
from attnlab.generate import kernels

ROOT = Path(attnlab.__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "install_torch.py"
sys.path.insert(0, str(SCRIPT.parent))
import install_torch  # noqa: E402

PIP_INSTALL = "-m pip install --quiet --disable-pip-version-check"


def choice(*args: str, find_links: Path | None = None) -> list[str]:
    """The lines `install_torch.py --print ARGS` prints when pip has no network and, as its only
    source of packages, the folder `find_links` (or none at all)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    if find_links is not None:
        env["PIP_FIND_LINKS"] = str(find_links)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--print", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def fake_wheel(folder: Path, requirement: str = install_torch.LOCAL) -> Path:
    """A wheel that says it is `requirement` (torch==2.13.0+cpu): all that pip's resolver reads."""
    version = requirement.split("==")[1]
    folder.mkdir()
    path = folder / f"torch-{version}-py3-none-any.whl"
    info = f"torch-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
        )
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def test_without_a_local_wheel_the_cpu_build_comes_from_pytorchs_index(tmp_path):
    (tmp_path / "empty").mkdir()
    for find_links in (None, tmp_path / "empty"):
        why, command = choice("--ignore-installed", find_links=find_links)
        assert "cannot see torch==2.13.0+cpu" in why
        expected = f"{PIP_INSTALL} --index-url {install_torch.PYTORCH_CPU_INDEX} torch==2.13.0"
        assert command.endswith(expected), command


def test_a_local_cpu_wheel_that_pip_can_see_is_installed(tmp_path):
    why, command = choice("--ignore-installed", find_links=fake_wheel(tmp_path / "wheels").parent)
    assert "pip can see torch==2.13.0+cpu" in why
    assert command.endswith(f"{PIP_INSTALL} torch==2.13.0+cpu"), command


def test_an_installed_torch_is_kept_and_torch_override_wins():
    import torch

    assert choice() == [f"torch: keeping the installed torch {install_torch.installed_torch()}"]
    assert install_torch.installed_torch().startswith(torch.__version__.split("+")[0])
    why, command = choice("--torch", "torch==2.99.0+cu999")
    assert why == "torch: TORCH=torch==2.99.0+cu999"
    assert command.endswith(f"{PIP_INSTALL} torch==2.99.0+cu999"), command


def test_an_installed_torch_older_than_pyproject_allows_is_replaced(monkeypatch):
    monkeypatch.setattr(install_torch, "installed_torch", lambda: "2.5.1+cpu")
    monkeypatch.setattr(install_torch, "pip_sees", lambda requirement: False)
    command, why = install_torch.choose(None)
    assert "2.5.1+cpu is older" in why and command[-1] == "torch==2.13.0"
    assert install_torch.lower_bound() == (2, 13) and install_torch.release("2.13.0+cpu") >= (2, 13)


@pytest.mark.slow
def test_the_kernel_tests_fail_and_do_not_skip_without_a_compiler(tmp_path):
    """CC names no compiler and the kernel cache is empty: test_kernels.py's tests error out, with
    the reason and the fix."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "ATTNLAB_CACHE": str(tmp_path)}
    pytest_args = [
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "-q",
        "tests/test_kernels.py",
        "-k",
        "test_rope_kernel_equals_apply_rope",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *pytest_args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    forced = os.environ.get("ATTNLAB_KERNELS", "")  # (which runs that build's tests only)
    builds = 1 if forced in kernels.build_names() else len(kernels.build_names())
    errors = f"{builds} error" + ("s" if builds > 1 else "")  # once per build, each an error
    assert errors in result.stdout and "skipped" not in result.stdout, result.stdout
    assert "C kernels could not be built here" in result.stdout, result.stdout
    assert "apt-get install gcc" in result.stdout, result.stdout
