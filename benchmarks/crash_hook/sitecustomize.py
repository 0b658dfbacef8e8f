"""Kill points for the crash test (benchmarks/crash_test.py), loaded into the training processes
only.

Python imports `sitecustomize` at start-up from any folder on PYTHONPATH; the crash test puts this
folder there in the environment of the processes it kills, so attnlab itself carries no kill points.
Without ATTNLAB_CRASH_OUT in the environment this file does nothing.

Every call that commits something to the file system (os.fsync, os.rename, os.replace, os.link) is
an event; one made inside a checkpoint save (attnlab.training.checkpoint.write_checkpoint on the
call's
stack: its files, the folder's rename, the links into OUT, the pruning) is a save event.
Environment:
- ATTNLAB_CRASH_OUT: the run folder.
- ATTNLAB_CRASH_LOG: a file that gets a line per kill (what was under way, inside a save or not) and
  a "first event" line with the time (when the data is ready and training starts).
- ATTNLAB_CRASH_PLAN: a JSON list, one entry per start under torchrun (TORCHELASTIC_RESTART_COUNT
  picks it; a plain process uses the first), each {"rank": R (default 0), and "save_event": K
  (SIGKILL just before the K-th save event) or "after": SECONDS (SIGKILL that long after the first
  event, or, with "clock": "checkpoint", after a first checkpoint folder appears: for a rank that
  writes nothing)}. Starts past the list's end, and other ranks, run undisturbed.
"""

import json
import os
import signal
import sys
import threading
import time

_OUT = os.environ.get("ATTNLAB_CRASH_OUT")


def _plan() -> dict:
    plan = json.loads(os.environ.get("ATTNLAB_CRASH_PLAN", "[]"))
    start = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    entry = plan[start] if start < len(plan) else {}
    return entry if int(os.environ.get("RANK", "0")) == entry.get("rank", 0) else {}


def _path_of(arg) -> str:
    if isinstance(arg, int):  # a file descriptor (fsync)
        try:
            return os.readlink(f"/proc/self/fd/{arg}")
        except OSError:
            return ""
    return os.fsdecode(os.fspath(arg)) if isinstance(arg, (str, bytes, os.PathLike)) else ""


def _saving(frame) -> bool:
    """Whether `frame`'s stack is inside a checkpoint save:
    attnlab.training.checkpoint.write_checkpoint is on it. The stack, not the paths: the start-up
    write of tokenizer.json into OUT looks like a save's link
    of it (same folder, same temporary name), and a hidden folder a killed save left stays until the
    next save, so neither a path nor the folder's contents can tell."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "write_checkpoint" and code.co_filename.endswith(
            os.path.join("training", "checkpoint.py")
        ):
            return True
        frame = frame.f_back
    return False


def _saving_now() -> bool:
    """Whether the main thread is inside a save (asked from the timer's thread)."""
    return _saving(sys._current_frames().get(threading.main_thread().ident))


def _listdir(folder: str) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _log(line: str) -> None:
    log = os.environ.get("ATTNLAB_CRASH_LOG")
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, (line + "\n").encode())
        os.close(fd)


def _kill(why: str) -> None:
    _log(why)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm_timer(seconds: float) -> None:
    timer = threading.Timer(
        seconds,
        lambda: _kill(
            f"kill at a random moment ({seconds:.3f} s), "
            f"{'inside' if _saving_now() else 'outside'} a save"
        ),
    )
    timer.daemon = True
    timer.start()


def _install(plan: dict) -> None:
    kill_at, after = int(plan.get("save_event", 0)), float(plan.get("after", 0))
    state = {"save_events": 0, "first": False}
    if after and plan.get("clock") == "checkpoint":

        def watch(seconds: float = after) -> None:
            while not any(
                n.startswith("step-") for n in _listdir(os.path.join(_OUT, "checkpoints"))
            ):
                time.sleep(0.01)
            _arm_timer(seconds)

        threading.Thread(target=watch, daemon=True).start()
        after = 0

    def wrap(name):
        original = getattr(os, name)

        def event(*args, **kwargs):
            if not state["first"]:
                state["first"] = True
                _log(f"first event at {time.time():.6f}")
                if after:
                    _arm_timer(after)
            if kill_at and _saving(sys._getframe(1)):
                state["save_events"] += 1
                if state["save_events"] == kill_at:
                    _kill(f"kill inside a save, before os.{name}({_path_of(args[0])})")
            return original(*args, **kwargs)

        setattr(os, name, event)

    for name in ("fsync", "rename", "replace", "link"):
        wrap(name)


if _OUT:
    _install(_plan())
