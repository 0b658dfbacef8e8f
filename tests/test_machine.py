"""attnlab.machine: what this machine is, and a choice's measurement made once per machine and kept
under the key of what decides it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab import machine

AVX2_ONLY = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh attnlab cache, nothing kept in this process."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    for name in machine.LIMITS:
        monkeypatch.delenv(name, raising=False)
    machine.forget()
    yield tmp_path / "machine"
    machine.forget()


class Counter:
    """A measurement that counts its runs and answers its count."""

    def __init__(self) -> None:
        self.runs = 0

    def __call__(self) -> dict:
        self.runs += 1
        return {"run": self.runs}


def test_describe_reads_the_cpu_the_operating_system_reports():
    here = machine.describe()
    assert here.threads == torch.get_num_threads() and here.torch == torch.__version__
    assert here.cores == os.cpu_count()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = next(
        line.split(":", 1)[1].split()
        for line in text.splitlines()
        if line.startswith(("flags", "Features"))
    )
    assert set(here.flags) == set(flags)
    sets = here.instruction_sets()
    assert sets, "no instruction sets listed for this architecture"
    if here.family == "x86":
        assert sets["AVX2"] == ("avx2" in flags)
        assert sets["AMX"] == ("amx_tile" in flags and "amx_bf16" in flags)
        assert sets["AVX-512 F/BW/VL/DQ"] == all(
            f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq")
        )


def test_instruction_sets_are_matched_without_case_or_underscores():
    """macOS's sysctl spells AVX512VNNI where Linux has avx512_vnni."""
    mac = machine.Machine("x", "x86_64", 1, ("AVX2", "AVX512VNNI", "FMA"), 1, "t")
    assert mac.has("AVX-512 VNNI") and mac.has("AVX2") and not mac.has("AMX")
    arm = machine.Machine("m", "arm64", 1, ("asimd", "asimddp"), 1, "t")
    assert arm.family == "arm" and arm.instruction_sets() == {
        "NEON": True,
        "dotprod": True,
        "i8mm": False,
        "BF16": False,
        "SVE": False,
    }


def test_a_measurement_runs_once_per_machine_and_is_read_back_by_the_next_process(cache):
    count = Counter()
    first = machine.measured("probe", count)
    assert first.fresh and first.values == {"run": 1} and first.path.parent == cache
    assert machine.measured("probe", count).values == {"run": 1}  # this process kept it
    machine.forget()  # as the next process: from the file
    again = machine.measured("probe", count)
    assert again.values == {"run": 1} and not again.fresh and count.runs == 1
    saved = json.loads(first.path.read_text())
    assert saved["values"] == {"run": 1} and saved["key"]["cpu"] == machine.describe().cpu
    assert [p.name for p in cache.iterdir()] == [first.path.name]  # no temporary file left


def test_what_decides_the_answer_is_its_key(cache, monkeypatch):
    """The thread count, torch's instruction-set limits (the AVX2 emulation must not read the
    AVX-512 answer), the CPU and the caller's extra key each measure anew."""
    count = Counter()
    machine.measured("probe", count)
    for name, value in AVX2_ONLY.items():
        monkeypatch.setenv(name, value)
        assert machine.measured("probe", count).fresh, name
    assert machine.measured("probe", count, {"build": "avx2"}).fresh
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert machine.measured("probe", count).fresh
    finally:
        torch.set_num_threads(threads)
    real = machine._cpu()
    monkeypatch.setattr(machine, "_cpu", lambda: (real[0], real[1] + ("new_flag",)))
    assert machine.measured("probe", count).fresh
    assert count.runs == 1 + len(AVX2_ONLY) + 3
    assert len(list(cache.glob("probe-*.json"))) == count.runs


@pytest.mark.parametrize(
    "damage",
    ["torn", "not json", "a list", "another key", "no values", "a folder", "unreadable"],
)
def test_a_damaged_or_unreadable_cache_is_measured_again_never_an_error(cache, damage, monkeypatch):
    count = Counter()
    path = machine.measured("probe", count).path
    machine.forget()
    saved = path.read_text()
    if damage == "torn":
        path.write_text(saved[: len(saved) // 2])
    elif damage == "not json":
        path.write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "a list":
        path.write_text("[1, 2]")
    elif damage == "another key":
        path.write_text(json.dumps({"key": {"cpu": "another"}, "values": {"run": 7}}))
    elif damage == "no values":
        path.write_text(json.dumps({"key": json.loads(saved)["key"]}))
    elif damage == "a folder":
        path.unlink()
        path.mkdir()
    else:  # as a file of mode 0 is to anyone but root
        read = Path.read_text

        def refuse(self, *args, **kwargs):
            if self == path:
                raise PermissionError(13, "Permission denied", str(self))
            return read(self, *args, **kwargs)

        monkeypatch.setattr(Path, "read_text", refuse)
    again = machine.measured("probe", count)
    assert again.fresh and again.values == {"run": 2}
    if damage not in ("a folder", "unreadable"):  # rewritten, whole
        machine.forget()
        assert machine.measured("probe", count).values == {"run": 2} and count.runs == 2


def test_a_cache_that_cannot_be_written_only_costs_the_next_process_the_measurement(
    tmp_path, monkeypatch
):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNLAB_CACHE", str(blocker))  # its machine/ folder cannot be made
    machine.forget()
    count = Counter()
    assert machine.measured("probe", count).values == {"run": 1}
    machine.forget()
    assert machine.measured("probe", count).values == {"run": 2}
    machine.forget()


def test_bfloat16_products_time_both_dtypes_and_keep_the_answer(cache):
    """...and leave torch's random state as it was: the measurement may run in the middle of a
    seeded run (the first training run on a machine)."""
    state = torch.get_rng_state()
    first = machine.bfloat16_products("cpu")
    assert torch.equal(torch.get_rng_state(), state)
    rates = first.values
    assert first.fresh and rates["size"] == machine.PRODUCT_SIZE
    assert rates["bfloat16_gflops"] > 0 and rates["float32_gflops"] > 0
    machine.forget()
    assert machine.bfloat16_products("cpu").values == rates


def test_the_time_products_stops_after_a_long_round_and_takes_the_best(monkeypatch):
    """Made slow on purpose (a bfloat16 product of seconds, where a CPU lacks the instructions):
    one round, then the answer; and which is faster follows which was made slow."""
    import time as clock

    real_matmul = torch.Tensor.__matmul__
    calls = []

    def slow_bfloat16(a, b):
        calls.append(a.dtype)
        if a.dtype == torch.bfloat16:
            clock.sleep(machine.LONG_ROUND_S)
        return real_matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", slow_bfloat16)
    rates = machine.time_products(torch.device("cpu"), n=64)
    # a warm-up each, then one round
    assert calls == [torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]
    assert not machine.bfloat16_is_fast(rates)
    assert rates["bfloat16_gflops"] < 2 * 64**3 / machine.LONG_ROUND_S / 1e9


def test_bfloat16_is_fast_where_it_is_at_least_as_fast_as_float32():
    assert machine.bfloat16_is_fast({"bfloat16_gflops": 600.0, "float32_gflops": 390.0})
    assert machine.bfloat16_is_fast({"bfloat16_gflops": 99.0, "float32_gflops": 99.0})
    assert not machine.bfloat16_is_fast({"bfloat16_gflops": 1.25, "float32_gflops": 99.0})
    # a device that cannot multiply in bfloat16 at all
    assert not machine.bfloat16_is_fast({"bfloat16_gflops": 0.0, "float32_gflops": 0.0})


def test_under_the_avx2_emulation_bfloat16_is_measured_apart(tmp_path):
    """A process that keeps torch to AVX2 measures for itself, and its answer lies beside the
    unlimited one in the same cache, not over it."""
    script = (
        "from attnlab import machine; import json; "
        "m = machine.bfloat16_products('cpu'); print(json.dumps([m.path.name, m.fresh]))"
    )
    env = {**os.environ, "ATTNLAB_CACHE": str(tmp_path)}
    for name in machine.LIMITS:
        env.pop(name, None)
    runs = {}
    for label, extra in (("unlimited", {}), ("avx2", AVX2_ONLY), ("unlimited again", {})):
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        runs[label] = json.loads(done.stdout)
    assert runs["unlimited"][1] and runs["avx2"][1] and not runs["unlimited again"][1]
    assert runs["avx2"][0] != runs["unlimited"][0] == runs["unlimited again"][0]
