"""Checkpoints are complete or absent: one folder per checkpoint with a manifest written last,
verified on every load; a damaged newest one falls back to the one before; a full disk, an I/O error
or a read-only folder is one line and leaves the last checkpoint byte for byte as it was. (The kill
test is test_training_crash.py.)"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from training_tiny import one_line_error, run_cli, tiny_config, tiny_flags

import attnlab
from attnlab.errors import UserError
from attnlab.files import file_digest
from attnlab.training import checkpoint as checkpoint_module
from attnlab.training.trainer import train

SRC = Path(attnlab.__file__).resolve().parents[1]


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes): what 'unchanged byte for byte'
    compares."""
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def checkpoint_files(run: Path) -> dict[str, bytes]:
    """The checkpoints and the model files linked into the run folder (metrics and plots may
    change)."""
    files = snapshot(run / "checkpoints")
    files.update({name: (run / name).read_bytes() for name in checkpoint_module.PUBLISHED})
    return files


def hidden_leftovers(run: Path) -> list[Path]:
    return [p for p in run.rglob(".*") if p.name.endswith(".tmp")]


def test_a_checkpoint_is_one_folder_whose_manifest_lists_every_file(tmp_path):
    train(tiny_config(tmp_path, max_iters=9, lr_decay_iters=9), progress=False)  # saves at 3, 6, 9
    run = tmp_path / "run"
    # KEEP = 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-0000006",
        "step-0000009",
    ]
    newest = run / "checkpoints" / "step-0000009"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["step"] == 9
    assert set(manifest["files"]) == {
        "train_state.pt",
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "train.json",
    }
    for name, entry in manifest["files"].items():
        assert file_digest(newest / name) == entry, name
    # the run folder's model is the newest checkpoint's, not a copy
    for name in checkpoint_module.PUBLISHED:
        assert (run / name).stat().st_ino == (newest / name).stat().st_ino, name
    assert not hidden_leftovers(run)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one_saying_so(
    tmp_path, capsys, damage
):
    # saves at 3 and 6
    assert run_cli(["train", *tiny_flags(tmp_path, max_iters=6)], capsys)[0] == 0
    newest = tmp_path / "run" / "checkpoints" / "step-0000006"
    victim = newest / ("manifest.json" if damage == "manifest" else "model.safetensors")
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data[-5] ^= 0x01  # one bit of one weight: the file still parses, only the digest knows
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    code, err = run_cli(
        ["train", "--out", str(tmp_path / "run"), "--resume", "--max-iters", "9", "--quiet"], capsys
    )
    assert code == 0, err
    warning = [line for line in err.splitlines() if line.strip()]
    assert (
        len(warning) == 1
        and "skipping a damaged checkpoint" in warning[0]
        and "step 3" in warning[0]
    ), err
    assert str(newest) in warning[0]
    metrics = [
        json.loads(line)["iter"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert metrics == [3, 6, 9]  # step 6 was trained again from step 3, and logged once
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-0000006",
        "step-0000009",
    ]
    # all damage is gone: rewritten
    checkpoint_module.find_checkpoint(tmp_path / "run", required=True)


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_loading_a_run_and_resuming_it_skip_the_same_damaged_checkpoint_for_the_same_reason(
    tmp_path, damage
):
    """attnlab.load(run) and --resume choose by one walk (runs.newest_complete): the same folder,
    the same problem named, so a model loaded from a run is always the one a resume continues."""
    from attnlab.formats.runs import run_model_dir

    # keeps steps 6 and 9
    train(tiny_config(tmp_path, max_iters=9, lr_decay_iters=9), progress=False)
    run = tmp_path / "run"
    victim = run / "checkpoints" / "step-0000009" / "train_state.pt"
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    else:
        victim.unlink()
    resumed = checkpoint_module.find_checkpoint(run, required=True, announce=False)
    with pytest.warns(UserWarning, match="skipped a damaged checkpoint") as warned:
        loaded = run_model_dir(run)
    assert resumed.path == loaded == run / "checkpoints" / "step-0000006" and resumed.step == 6
    assert len(resumed.skipped) == 1 and str(victim) in resumed.skipped[0]
    assert f"({resumed.skipped[0]})" in str(warned[0].message)


def _fd_name(fd: int) -> str:
    """The name of the file or folder an open descriptor refers to."""
    return Path(os.readlink(f"/proc/self/fd/{fd}")).name


@pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="names an fsync's file through /proc"
)
def test_a_save_makes_each_file_durable_then_the_manifest_then_one_rename_then_syncs_the_folder(
    tmp_path, monkeypatch
):
    """The order of a save's commits (what makes it survive a power cut, which no kill test can
    show): every file fsynced once, as it is written, then the manifest, the hidden folder fsynced,
    one rename to the final name, and the checkpoints/ folder fsynced after that rename, so the
    rename itself is on disk. The manifest's digests come from the bytes written: no file is read
    back to hash it."""
    events, hashed = [], []
    fsync, rename = os.fsync, os.rename
    monkeypatch.setattr(
        os, "fsync", lambda fd: (events.append(("fsync", _fd_name(fd))), fsync(fd))[1]
    )
    monkeypatch.setattr(
        os, "rename", lambda a, b: (events.append(("rename", Path(b).name)), rename(a, b))[1]
    )
    monkeypatch.setattr(
        "attnlab.files.file_digest", lambda file: hashed.append(file) or file_digest(file)
    )

    def write(files) -> None:
        files.write("train_state.pt", b"state")
        files.write("config.json", "{}")

    final = checkpoint_module.write_checkpoint(tmp_path / "run", 7, write)
    monkeypatch.undo()
    start = events.index(("fsync", "run"))  # checkpoints/ was made: its parent synced first
    saved = events[start + 1 : events.index(("rename", final.name)) + 2]
    tmp = saved[3][1]
    assert tmp.startswith(".step-0000007.") and tmp.endswith(".tmp")
    assert saved == [
        ("fsync", "train_state.pt"),
        ("fsync", "config.json"),
        ("fsync", "manifest.json"),
        ("fsync", tmp),
        ("rename", final.name),
        ("fsync", "checkpoints"),
    ]
    assert not hashed
    manifest = checkpoint_module.verify_manifest(final)
    assert manifest["step"] == 7 and manifest["files"] == {
        name: file_digest(final / name) for name in ("config.json", "train_state.pt")
    }


@pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="names an fsync's file through /proc"
)
def test_a_training_checkpoint_fsyncs_each_file_once_and_reads_none_back(tmp_path, monkeypatch):
    """The trainer's save writes each of its five files and the manifest once, fsynced once, hashing
    nothing it has to read again (the hidden folder's rename is the commit; a per-file rename adds
    nothing)."""
    from attnlab.training.trainer import Trainer

    trainer = Trainer(tiny_config(tmp_path, max_iters=3), progress=False)
    synced, hashed, renamed = [], [], []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1]
    )
    monkeypatch.setattr(
        os, "replace", lambda a, b: (renamed.append(Path(b).name), replace(a, b))[1]
    )
    monkeypatch.setattr(
        "attnlab.files.file_digest", lambda file: hashed.append(file) or file_digest(file)
    )
    trainer.save_checkpoint(0.0)
    monkeypatch.undo()
    folder = tmp_path / "run" / "checkpoints" / "step-0000000"
    in_folder = sorted(
        Path(path).name for path in synced if Path(path).parent.name.startswith(".step-0000000.")
    )
    assert in_folder == sorted(
        [
            "train_state.pt",
            "model.safetensors",
            "tokenizer.json",
            "config.json",
            "train.json",
            "manifest.json",
        ]
    )
    # only the links into OUT are swapped in
    assert not hashed and renamed == list(checkpoint_module.PUBLISHED)
    assert checkpoint_module.find_checkpoint(tmp_path / "run", required=True).path == folder


def test_no_complete_checkpoint_stops_with_one_line_naming_the_file(tmp_path, capsys):
    assert run_cli(["train", *tiny_flags(tmp_path, max_iters=3)], capsys)[0] == 0
    weights = tmp_path / "run" / "checkpoints" / "step-0000003" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    before = snapshot(tmp_path / "run" / "checkpoints")
    # auto must not start over on top of a damaged run
    for resume in (["--resume"], ["--resume", "auto"]):
        code, err = run_cli(
            ["train", "--out", str(tmp_path / "run"), *resume, "--max-iters", "6"], capsys
        )
        line = one_line_error(err)
        assert (
            code == 2
            and "no complete checkpoint" in line
            and str(weights) in line
            and "truncated" in line
        )
    assert snapshot(tmp_path / "run" / "checkpoints") == before


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_loading_a_damaged_checkpoint_folder_names_the_file(tmp_path, capsys, damage):
    train(tiny_config(tmp_path, max_iters=3), progress=False)
    folder = tmp_path / "run" / "checkpoints" / "step-0000003"
    attnlab.load(folder)  # a checkpoint folder is a model directory
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[-1] ^= 0x80
    weights.write_bytes(bytes(data) if damage == "flip" else bytes(data[:-8]))
    with pytest.raises(UserError, match="model.safetensors: .*(truncated|SHA-256)"):
        attnlab.load(folder)
    code, err = run_cli(["sample", str(folder), "--max-new-tokens", "3"], capsys)
    assert code == 2 and str(weights) in one_line_error(err)


def _damage_the_only_checkpoint(run: Path, damage: str) -> Path:
    """Damage the run's one checkpoint; returns the damaged file. In place ("flip", "truncate") the
    run folder's hard link shares the damage; "flip-copied" is a file system without links (the run
    folder holds a copy of the damaged bytes); "replaced" swaps a truncated file in (the run folder
    keeps the intact bytes); "state" flips a bit of train_state.pt (the model files are
    untouched)."""
    folder = run / "checkpoints" / "step-0000003"
    victim = folder / ("train_state.pt" if damage == "state" else "model.safetensors")
    data = bytearray(victim.read_bytes())
    if damage == "truncate":
        victim.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "replaced":
        victim.unlink()
        victim.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[-5] ^= 0x01  # the file still parses: only the digest knows
        victim.write_bytes(bytes(data))
    if damage == "flip-copied":
        (run / "model.safetensors").unlink()
        (run / "model.safetensors").write_bytes(bytes(data))
    return victim


@pytest.mark.parametrize("damage", ["flip", "truncate", "flip-copied"])
def test_a_run_whose_only_checkpoint_is_damaged_with_its_model_files_is_refused_in_one_line(
    tmp_path, capsys, damage
):
    """Every checkpoint fails its manifest and the run folder's weights are the damaged ones (a link
    to them, or a copy): nothing verifies, so nothing loads; one line names the damaged file and the
    way out."""
    train(tiny_config(tmp_path, max_iters=3), progress=False)
    run = tmp_path / "run"
    victim = _damage_the_only_checkpoint(run, damage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a refusal, not a warning and a load
        with pytest.raises(UserError, match="every checkpoint is damaged") as info:
            attnlab.load(run)
    message = str(info.value)
    assert (
        str(victim) in message
        and str(run / "model.safetensors") in message
        and "--overwrite" in message
    )
    assert ("hard link" if damage != "flip-copied" else "same bytes") in message
    code, err = run_cli(["sample", str(run), "--max-new-tokens", "2"], capsys)
    assert code == 2 and one_line_error(err) == f"attnlab sample: error: {message}"


@pytest.mark.parametrize("damage", ["replaced", "state"])
def test_a_run_whose_only_checkpoint_is_damaged_loads_its_verified_model_files_with_one_warning(
    tmp_path, capsys, damage
):
    """Every checkpoint fails its manifest, but the run folder's model files are the bytes the
    checkpoint's
    manifest lists: they load, with one warning naming the damaged file and what was loaded
    instead."""
    train(tiny_config(tmp_path, max_iters=3), progress=False)
    run = tmp_path / "run"
    expected = attnlab.load(run).state_dict()
    victim = _damage_the_only_checkpoint(run, damage)
    with pytest.warns(UserWarning) as warned:
        model = attnlab.load(run)
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert (
        "every checkpoint" in message
        and str(victim) in message
        and f"loading the model files in {run}" in message
    )
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())
    code, err = run_cli(["sample", str(run), "--max-new-tokens", "2"], capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 0 and lines == [f"attnlab sample: warning: {message}"], err


def test_loading_a_run_hashes_each_checkpoint_file_once(tmp_path, monkeypatch):
    """Choosing the newest complete checkpoint verifies it; loading it then does not hash the same
    bytes again."""
    train(tiny_config(tmp_path, max_iters=3), progress=False)
    hashed = []
    monkeypatch.setattr(
        "attnlab.files.file_digest",
        lambda file: hashed.append(Path(file).name) or file_digest(file),
    )
    monkeypatch.setattr("attnlab.files._verified", {})
    attnlab.load(tmp_path / "run")
    assert hashed and sorted(hashed) == sorted(set(hashed))


def _steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["iter"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_auto_starts_fresh_then_resumes_then_has_nothing_left_to_do(tmp_path, capsys):
    flags = tiny_flags(tmp_path, max_iters=3)
    run = tmp_path / "run"
    # nothing there: a fresh run
    assert run_cli(["train", *flags, "--resume", "auto"], capsys)[0] == 0
    assert _steps_logged(run) == [3]
    first = checkpoint_files(run)
    report = (run / "report.md").read_bytes()
    from attnlab.cli import main

    # done already: one line, exit 0, nothing trained
    code = main(["train", *flags, "--resume", "auto"])
    printed = capsys.readouterr()
    assert code == 0 and not printed.err.strip(), printed.err
    assert (
        printed.out.strip()
        == f"the run in {run} is complete: it is at step 3 and --max-iters is 3; nothing to train"
    )
    # nothing rewritten
    assert checkpoint_files(run) == first and (run / "report.md").read_bytes() == report
    assert (
        run_cli(["train", *tiny_flags(tmp_path, max_iters=6), "--resume", "auto"], capsys)[0] == 0
    )
    assert _steps_logged(run) == [3, 6]
    # resumed at 3, not started over (which rewrites it)
    assert snapshot(run / "checkpoints" / "step-0000003") == {
        name[len("step-0000003/") :]: data
        for name, data in first.items()
        if name.startswith("step-0000003/")
    }
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-0000003",
        "step-0000006",
    ]
    with pytest.raises(SystemExit):  # argparse's usage line and exit 2
        run_cli(["train", *flags, "--resume", "sometimes"], capsys)
    assert "--resume takes no value or 'auto'" in capsys.readouterr().err


def test_resume_auto_on_a_spent_time_budget_says_the_run_is_complete(tmp_path, capsys):
    """A restart after a --max-time run ended (an elastic job's last restart) trains nothing and
    exits 0; plain --resume keeps its one-line error, since there it is the user asking for more
    training."""
    from attnlab.cli import main

    flags = tiny_flags(tmp_path, max_iters=10**6, lr_decay_iters=10**6, eval_interval=10**6)
    assert run_cli(["train", *flags, "--max-time", "0.5"], capsys)[0] == 0
    run = tmp_path / "run"
    first = checkpoint_files(run)
    assert main(["train", *flags, "--max-time", "0.5", "--resume", "auto"]) == 0
    printed = capsys.readouterr()
    assert not printed.err.strip(), printed.err
    assert (
        printed.out.startswith(f"the run in {run} is complete: it has trained ")
        and printed.out.count("\n") == 1
    )
    assert "--max-time is 0.5; nothing to train" in printed.out
    assert checkpoint_files(run) == first
    code, err = run_cli(["train", *flags, "--max-time", "0.5", "--resume"], capsys)
    assert code == 2 and "raise --max-time" in one_line_error(err)


def test_leftovers_of_an_interrupted_save_are_ignored_then_cleaned(tmp_path, capsys):
    assert run_cli(["train", *tiny_flags(tmp_path, max_iters=3)], capsys)[0] == 0
    run = tmp_path / "run"
    torn = run / "checkpoints" / ".step-0000006.abcd.tmp"  # what a kill inside a save leaves
    torn.mkdir()
    (torn / "train_state.pt").write_bytes(b"half")
    (run / ".model.safetensors.abcd.tmp").write_bytes(b"half a link")
    assert checkpoint_module.find_checkpoint(run, required=True).step == 3
    assert (
        run_cli(["train", "--out", str(run), "--resume", "--max-iters", "6", "--quiet"], capsys)[0]
        == 0
    )
    assert not hidden_leftovers(run)


def test_runs_from_before_checkpoint_folders_still_resume(tmp_path, capsys):
    """train_state.pt and train.json in the run folder itself, as attnlab wrote them before."""
    train(tiny_config(tmp_path, max_iters=3), progress=False)
    run = tmp_path / "run"
    folder = run / "checkpoints" / "step-0000003"
    for name in ("train_state.pt", "train.json"):
        (folder / name).rename(run / name)
    (folder / "manifest.json").unlink()
    folder.rename(run / "old-layout")
    (run / "checkpoints").rmdir()
    assert (
        run_cli(["train", "--out", str(run), "--resume", "--max-iters", "6", "--quiet"], capsys)[0]
        == 0
    )
    assert checkpoint_module.find_checkpoint(run, required=True).step == 6
    assert not (run / "train_state.pt").exists()


# Refusals of the file system
# -------------------------------------------------------------------------


def _resume_refused(tmp_path, capsys, expect: str) -> None:
    code, err = run_cli(
        ["train", "--out", str(tmp_path / "run"), "--resume", "--max-iters", "6", "--quiet"], capsys
    )
    assert code == 2 and expect in one_line_error(err)


@pytest.fixture
def trained(tmp_path, capsys):
    """A finished 3-step run and the bytes of its checkpoint, to compare after a refused save."""
    assert run_cli(["train", *tiny_flags(tmp_path, max_iters=3)], capsys)[0] == 0
    return checkpoint_files(tmp_path / "run")


def test_full_disk_is_one_line_and_keeps_the_checkpoint(tmp_path, monkeypatch, capsys, trained):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    _resume_refused(tmp_path, capsys, "disk is full")
    monkeypatch.undo()
    assert checkpoint_files(tmp_path / "run") == trained
    assert not hidden_leftovers(tmp_path / "run")
    assert checkpoint_module.find_checkpoint(tmp_path / "run", required=True).step == 3


@pytest.mark.skipif(
    not Path("/proc/self/fd").is_dir(), reason="names an fsync's file through /proc"
)
def test_io_error_on_write_is_one_line_and_keeps_the_checkpoint(
    tmp_path, monkeypatch, capsys, trained
):
    fsync = os.fsync

    # where a failing disk reports itself: the fsync of a file of the new checkpoint
    def failing(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if Path(path).parent.name.startswith(".step-"):
            raise OSError(errno.EIO, "Input/output error", path)
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", failing)
    _resume_refused(tmp_path, capsys, "Input/output error")
    assert checkpoint_files(tmp_path / "run") == trained
    assert not hidden_leftovers(tmp_path / "run")


def _resume_in_child(
    tmp_path, prefix: tuple[str, ...] = (), **popen
) -> subprocess.CompletedProcess:
    """`attnlab train --resume` of the finished run, to 6 steps, in a real process (after `prefix`,
    a command that
    runs it: unshare)."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [
            *prefix,
            sys.executable,
            "-m",
            "attnlab",
            "train",
            "--out",
            str(tmp_path / "run"),
            "--resume",
            "--max-iters",
            "6",
            "--quiet",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **popen,
    )


def test_file_size_limit_in_a_real_process_is_one_line_and_keeps_the_checkpoint(tmp_path, trained):
    """RLIMIT_FSIZE makes the kernel refuse the write (EFBIG), as a full disk does (ENOSPC)."""
    limit = len(trained["step-0000003/model.safetensors"]) // 2

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    done = _resume_in_child(tmp_path, preexec_fn=limited)
    assert done.returncode == 2 and "disk is full" in one_line_error(done.stderr)
    assert checkpoint_files(tmp_path / "run") == trained
    assert not hidden_leftovers(tmp_path / "run")


# Root writes through permissions, so the folder is made read-only for real: a read-only bind mount,
# made in a mount namespace of the child's own (unshare), which the kernel drops with the child
# however the test ends (Ctrl-C, a timeout, a kill), so no mount is ever left behind under
# /tmp/pytest-of-root.
PRIVATE_MOUNTS = (
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount --bind -o ro "$0" "$0" && exec "$@"',
)


def test_read_only_output_folder_is_one_line_and_keeps_the_checkpoint(tmp_path, capsys, trained):
    run = tmp_path / "run"
    if os.geteuid() == 0:
        probe = subprocess.run([*PRIVATE_MOUNTS, str(run), "true"], capture_output=True)
        if probe.returncode:
            pytest.skip(
                "running as root without the right to mount a read-only folder: "
                f"{probe.stderr.decode().strip()}"
            )
        done = _resume_in_child(tmp_path, (*PRIVATE_MOUNTS, str(run)))
        assert done.returncode == 2 and "Read-only file system" in one_line_error(done.stderr), (
            done.stderr
        )
    else:
        folders = [run, *[p for p in run.rglob("*") if p.is_dir()]]
        for folder in folders:
            folder.chmod(0o555)
        try:
            _resume_refused(tmp_path, capsys, "Permission denied")
        finally:
            for folder in folders:
                folder.chmod(0o755)
    assert checkpoint_files(run) == trained


# A kill at every point of a save
# ------------------------------------------------------------------------


def _save_killed_at(trainer, event: int) -> bool:
    """Save in a forked child that dies (os._exit: no cleanup runs, as under SIGKILL) just before
    its `event`-th file-system change (fsync, rename, replace, link, unlink, rmdir); True if the
    save finished."""
    pid = os.fork()
    if pid == 0:  # the child: count commits, die at the chosen one
        count = [0]
        for name in ("fsync", "rename", "replace", "link", "unlink", "rmdir"):

            def commit(*args, _original=getattr(os, name), **kwargs):
                count[0] += 1
                if count[0] == event:
                    os._exit(137)
                return _original(*args, **kwargs)

            setattr(os, name, commit)
        trainer.save_checkpoint(0.0)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_kill_at_every_point_of_a_save_leaves_the_previous_or_the_new_checkpoint_complete(
    tmp_path,
):
    import shutil

    from attnlab.files import verify_manifest
    from attnlab.formats.runs import checkpoint_dirs
    from attnlab.training.trainer import Trainer

    trainer = Trainer(tiny_config(tmp_path, max_iters=6, lr_decay_iters=6), progress=False)
    trainer.run()  # checkpoints at steps 3 and 6
    trainer.iter = 9  # the next save
    event, outcomes = 0, set()
    while True:
        event += 1
        run = tmp_path / f"killed-at-{event}"
        shutil.copytree(tmp_path / "run", run)
        trainer.out = run
        finished = _save_killed_at(trainer, event)
        for _, folder in checkpoint_dirs(run):  # zero unreadable checkpoints
            assert verify_manifest(folder) is not None, (event, folder)
            torch.load(folder / "train_state.pt", weights_only=True)
        step = checkpoint_module.find_checkpoint(run, required=True, announce=False).step
        assert step in (6, 9), (event, step)
        outcomes.add(step)
        attnlab.load(run)  # the run folder loads: its newest complete checkpoint
        if finished:
            break
        trainer.iter = 12  # the next save cleans what the killed one left
        trainer.save_checkpoint(0.0)
        assert not hidden_leftovers(run), (event, hidden_leftovers(run))
        assert checkpoint_module.find_checkpoint(run, required=True, announce=False).step == 12
        trainer.iter = 9
        shutil.rmtree(run)
    # every change a save makes was a kill point; both outcomes seen
    assert event > 20 and outcomes == {6, 9}
