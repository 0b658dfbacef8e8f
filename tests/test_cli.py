"""The command line as a user meets it: installed entry points, one-line errors, no tracebacks."""

import subprocess
import sys

import pytest

from attnlab.cli import COMMAND_MODULES, build_parser


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=300)


def test_every_command_module_is_present():
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    assert {"demo", "compare", "train", "sample", "heads", "experiment", "explore", "export-html"} <= commands
    assert len(COMMAND_MODULES) == 5


def test_version_and_help():
    result = run("--version")
    assert result.returncode == 0 and result.stdout.startswith("attnlab ")
    assert run().returncode == 2  # no command: usage, non-zero


@pytest.mark.parametrize(
    "args",
    [
        ("sample", "no/such/run"),
        ("compare", "no/such/run"),
        ("heads", "no/such/run"),
        ("explore", "no/such/run", "--port", "0"),
    ],
)
def test_a_missing_model_is_one_line_and_exit_2(args):
    result = run(*args)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no/such/run" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_file_where_a_folder_should_be_is_one_line_and_exit_2(tmp_path, capsys):
    from attnlab.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["train", "--out", str(blocker / "run"), "--max-iters", "1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Not a directory" in err and str(blocker) in err, err
