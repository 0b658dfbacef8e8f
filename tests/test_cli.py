"""The command line as a user meets it: installed entry points, one-line errors, no tracebacks."""

import subprocess
import sys

import pytest

from attnlab.cli import COMMAND_MODULES, build_parser


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=300
    )


def test_every_command_module_is_present():
    parser = build_parser()
    commands = set(parser._subparsers._group_actions[0].choices)
    assert {
        "demo",
        "compare",
        "train",
        "sample",
        "heads",
        "experiment",
        "explore",
        "export-html",
        "chat",
        "doctor",
    } <= commands
    assert len(COMMAND_MODULES) == 8


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


def test_a_warning_is_one_line_naming_the_command_in_a_real_process(tmp_path):
    """Python's own format (file:line: UserWarning: ..., then the source line) never reaches the
    user."""
    from training_tiny import tiny_config

    from attnlab.training.trainer import train

    train(tiny_config(tmp_path, max_iters=6), progress=False)  # checkpoints at steps 3 and 6
    weights = tmp_path / "run" / "checkpoints" / "step-0000006" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    result = run("sample", str(tmp_path / "run"), "--max-new-tokens", "2", "--prompt", "a")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"attnlab sample: warning: skipped a damaged checkpoint ({weights}: "
    ), lines[0]
    assert "step-0000003" in lines[0] and "Warning:" not in lines[0] and ".py:" not in lines[0]


def test_warnings_print_one_line_during_a_command_and_pythons_display_comes_back_after(
    capsys, monkeypatch
):
    import warnings

    from attnlab import cli
    from attnlab.generate import sample as training_cli

    def warn_twice(args) -> int:
        warnings.warn("first line\n  second line", stacklevel=1)
        warnings.warn("from a library", RuntimeWarning, stacklevel=1)
        return 0

    monkeypatch.setattr(training_cli, "run_sample", warn_twice)  # what `attnlab sample` runs
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert cli.main(["sample", "x"]) == 0
    assert warnings.showwarning is before
    assert capsys.readouterr().err.splitlines() == [
        "attnlab sample: warning: first line second line",
        "attnlab sample: warning: from a library",
    ]
