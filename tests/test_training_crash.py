"""The crash test, small: a run SIGKILLed at random moments and inside checkpoint saves, resumed
each time with `--resume auto` (the torchrun --max-restarts form is the benchmark's:
benchmarks/crash_test.py --ddp).

Every kill leaves only complete, readable checkpoints, the newest complete step never goes back, and
the finished run's evaluations equal the uninterrupted run's (1e-6). The kill points are in
benchmarks/crash_hook (loaded into the killed processes only); benchmarks/crash_test.py runs the
same checks with 50 kills, benchmarks/README.md says how to run it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from crash_test import run_crash_test  # noqa: E402

SMALL = dict(max_iters=30, lr_decay_iters=30)


@pytest.mark.slow
def test_sigkill_inside_saves_and_at_random_moments_loses_nothing(tmp_path):
    report = run_crash_test(tmp_path, kills=4, seed=0, settings=SMALL)
    # kills 1 and 3 are inside a save
    assert report.kills >= 2 and report.inside_save >= 2, report.log
    assert report.max_difference <= 1e-6
