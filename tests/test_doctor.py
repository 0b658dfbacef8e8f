"""`attnlab doctor`: a line per topic, each what this machine reports or measured and what attnlab
chose on it; the lines follow what it reads (a forced build, torch kept to AVX2, no compiler), and
it never raises."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab import doctor, machine
from attnlab.cli import main
from attnlab.generate import kernels

TOPICS = [
    "machine",
    "instruction sets",
    "threads",
    "torch",
    "compiler",
    "kernels",
    "OpenMP",
    "float products",
    "decode layout",
    "bfloat16",
    "huge pages",
    "caches",
]
AVX2_ONLY = {
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ATTNLAB_KERNELS": "avx2",
}


def run_doctor(*flags: str, **env: str) -> subprocess.CompletedProcess:
    """`attnlab doctor` in a process of its own, with `env` over this one's (minus the limits and
    forced choices this process may carry)."""
    base = {k: v for k, v in os.environ.items() if k not in machine.LIMITS}
    for name in ("ATTNLAB_KERNELS", "ATTNLAB_FLOAT_ROWS", "ATTNLAB_DECODE_LAYOUT"):
        base.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "attnlab", "doctor", *flags],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def lines_of(done: subprocess.CompletedProcess) -> dict[str, str]:
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert "Traceback" not in done.stdout
    found = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert list(found) == TOPICS, done.stdout
    return found


def check_bfloat16_line(text: str) -> None:
    """The rates it prints decide the dtype it names, by machine.bfloat16_is_fast."""
    rates = re.match(r"products at ([\d,.]+) GFLOP/s against float32's ([\d,.]+) ", text)
    assert rates, text
    bf16, f32 = (float(v.replace(",", "")) for v in rates.groups())
    fast = machine.bfloat16_is_fast({"bfloat16_gflops": bf16, "float32_gflops": f32})
    assert f"Muon's Newton-Schulz runs in {'bfloat16' if fast else 'float32'}" in text


def check_decode_layout_line(text: str, build: str) -> None:
    """Each block kind with a 16-row layout is named once: raced, its layout the one its race's
    times (printed) make the faster, or the file's where `build`'s 16-row product is a lane at a
    time (every kind in the portable build; Q5_0 in the AVX2 build)."""
    raced = {
        kind: (layout, *(float(v.replace(",", "")) for v in times))
        for kind, layout, *times in re.findall(
            r"(Q\w+) (16-row|file) \(([\d,]+) us against ([\d,]+) in the file's\)", text
        )
    }
    lanes = re.search(r"([\w, ]+) file \(the \w+ build's 16-row products? (?:is|are) a lane", text)
    laned = lanes.group(1).split(";")[-1].strip().split(", ") if lanes else []
    assert sorted([*raced, *laned]) == sorted(k.name for k in kernels.REPACKABLE), text
    for layout, repacked_us, file_us in raced.values():
        # (times rounded to whole microseconds: a tie there may have gone either way)
        assert repacked_us == file_us or layout == ("16-row" if repacked_us < file_us else "file")
    assert text.endswith("other kinds: the file's")
    assert build != "portable" or not raced
    assert build != "avx2" or laned == ["Q5_0"]


def test_on_this_machine_each_line_says_what_it_read_and_chose(capsys, monkeypatch):
    monkeypatch.delenv("ATTNLAB_FLOAT_ROWS")  # the suite's forced choices (conftest.py)
    monkeypatch.delenv("ATTNLAB_DECODE_LAYOUT")
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    found = dict(line.split(": ", 1) for line in out.splitlines())
    assert list(found) == TOPICS
    here = machine.describe()
    assert found["machine"].startswith(f"{here.cpu}, {here.architecture}, {here.cores} cores")
    reported = [name for name, present in here.instruction_sets().items() if present]
    assert found["instruction sets"].startswith(", ".join(reported) or "none")
    assert f"torch runs {machine.threads_phrase()} (" in found["threads"]
    assert found["torch"].startswith(torch.__version__)
    assert f"ATen's CPU capability {torch.backends.cpu.get_cpu_capability()}" in found["torch"]
    build = kernels.variant()
    if build is None:
        assert "torch's path" in found["kernels"]
    else:
        forced = os.environ.get("ATTNLAB_KERNELS", "1") not in ("1", "")
        how = f"ATTNLAB_KERNELS={build}" if forced else "the best build this machine allows"
        assert found["kernels"].startswith(f"the {build} build ({how})")
        assert kernels.chosen_variant()[1].name in found["kernels"]
    if build is not None:
        assert found["float products"].startswith(f"{kernels.float_products()} for many rows")
        check_decode_layout_line(found["decode layout"], build)
    check_bfloat16_line(found["bfloat16"])
    rates = machine.bfloat16_products("cpu").values  # the same measurement, kept
    assert f"{rates['bfloat16_gflops']:,.1f} GFLOP/s" in found["bfloat16"]
    try:
        mode = re.search(r"\[(\w+)\]", doctor.THP_ENABLED.read_text()).group(1)
        assert found["huge pages"].startswith(f"transparent huge pages '{mode}'")
    except OSError:
        assert found["huge pages"].startswith("no transparent huge pages here")
    assert str(machine.cache_dir().parent) in found["caches"]


def test_json_holds_the_same_lines_and_their_values(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == TOPICS
    assert report["machine"]["cores"] == os.cpu_count()
    assert report["torch"]["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert report["bfloat16"]["muon_newton_schulz"] in ("bfloat16", "float32")
    assert all(isinstance(entry["line"], str) and entry["line"] for entry in report.values())


@pytest.mark.parametrize("build", ["avx512", "avx2", "portable", "0"])
def test_with_each_build_forced_the_kernel_lines_follow_it(build):
    if build != "0" and build not in kernels.variants_here():
        pytest.skip(f"this CPU or its operating system does not allow the {build} build")
    found = lines_of(run_doctor(ATTNLAB_KERNELS=build))
    if build == "0":
        assert found["kernels"] == "off (ATTNLAB_KERNELS=0): every caller takes torch's path"
        assert found["OpenMP"] == "no kernels run here"
        assert found["float products"].startswith("torch's GEMM and attention")
        return
    assert found["kernels"].startswith(f"the {build} build (ATTNLAB_KERNELS={build}), passed")
    better = kernels.variants_here()[: kernels.variants_here().index(build)]
    for name in better:
        assert f"the {name} build: not tried (ATTNLAB_KERNELS={build})" in found["kernels"]
    line = found["float products"]
    if build != "avx512":  # AMX is the AVX-512 build's only
        assert "for many rows: no AMX (AMX tiles are" in line
    if build == "portable":  # the vectorised float32 tiles are the AVX-512 and AVX2 builds'
        assert line.startswith("torch for many rows")
        assert line.endswith("vectorised in the AVX-512 and AVX2 builds only (attention: torch)")
    else:  # each race's verdict
        assert "for the fused attention" in line
        assert "for the attention's scores, pattern and z" in line
    check_decode_layout_line(found["decode layout"], build)


def test_a_forced_build_the_cpu_refuses_is_its_line_not_an_error():
    refused = [name for name in ("avx512", "avx2") if name not in kernels.variants_here()]
    build = refused[0] if refused else "no-such-build"
    found = lines_of(run_doctor(ATTNLAB_KERNELS=build))
    assert found["kernels"].startswith(f"none: ATTNLAB_KERNELS={build}: ")
    assert found["float products"].startswith("torch's GEMM")


def test_under_the_avx2_emulation_torch_and_bfloat16_lines_say_so():
    """torch kept to AVX2 (the emulation of an AVX2-only CPU): ATen's capability and the limits
    read, and bfloat16's speed measured under them, apart from the unlimited answer."""
    plain = json.loads(run_doctor("--json").stdout)
    done = run_doctor("--json", **AVX2_ONLY)
    emulated = json.loads(done.stdout)
    assert done.returncode == 0 and list(emulated) == TOPICS, done.stderr
    torch_line = emulated["torch"]["line"]
    assert "ATen's CPU capability AVX2; limited by ONEDNN_MAX_CPU_ISA=AVX2, " in torch_line
    assert "MKL_ENABLE_INSTRUCTIONS=AVX2, ATEN_CPU_CAPABILITY=avx2" in torch_line
    assert "no instruction-set limit set" in plain["torch"]["line"]
    check_bfloat16_line(emulated["bfloat16"]["line"])
    assert emulated["bfloat16"]["kept_in"] != plain["bfloat16"]["kept_in"]  # measured apart
    assert emulated["bfloat16"]["line"] != plain["bfloat16"]["line"]
    if "avx2" in kernels.variants_here():
        assert emulated["kernels"]["line"].startswith("the avx2 build (ATTNLAB_KERNELS=avx2)")


def test_without_a_compiler_every_line_still_prints(tmp_path):
    found = lines_of(run_doctor(CC=str(tmp_path / "no-such-compiler"), ATTNLAB_CACHE=str(tmp_path)))
    assert found["compiler"].startswith(
        f"no C compiler (CC={tmp_path / 'no-such-compiler'} names no program here); install one"
    )
    assert found["kernels"].startswith("not built (no C compiler (CC=")
    assert found["kernels"].endswith("): every caller takes torch's path")
    assert found["OpenMP"] == "no kernels run here"
    assert found["float products"].startswith("torch's GEMM")
    if kernels.builds._is_x86():
        assert "permission not checked" in found["instruction sets"]


def test_a_better_build_that_failed_its_self_check_is_named_with_why(monkeypatch):
    """choose_variant's reason for passing over a build is the doctor's."""
    failed = []

    def self_check(path: Path, *args, **kwargs):
        if not failed:  # the best build this CPU allows fails
            failed.append(path)
            return "its self-check failed (an illegal instruction, made up; exit status -4)"
        return None

    monkeypatch.setattr(kernels.builds, "self_check", self_check)
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    line = doctor.kernels_line()
    best = kernels.variants_here()[0]
    assert failed, "no build was checked"
    assert f"the {best} build: its self-check failed (an illegal instruction" in line.text
    assert line.values["build"] != best


def test_a_topic_that_fails_is_its_line_and_the_others_still_print(monkeypatch, capsys):
    def broken() -> doctor.Line:
        raise OSError("no /proc here, as on a sandbox")

    monkeypatch.setattr(doctor, "TOPICS", [doctor.machine_line, broken, doctor.threads_line])
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "broken: could not be read (no /proc here, as on a sandbox)"
    assert lines[0].startswith("machine: ") and lines[2].startswith("threads: ")


@pytest.mark.parametrize(
    "openmp, symbols, says",
    [
        (True, b"\0GOMP_parallel\0", "the kernels run on OpenMP's threads (GCC's libgomp)"),
        (True, b"\0__kmpc_fork_call\0", "the kernels run on OpenMP's threads (LLVM's libomp)"),
        (False, b"\0attnlab_run\0", "the kernels were built without OpenMP ("),
    ],
    ids=["gcc", "clang", "none"],
)
def test_the_openmp_line_says_the_kernels_own_report(tmp_path, monkeypatch, openmp, symbols, says):
    """kernels.openmp (c/probe.c's attnlab_openmp) decides the line; the library's calls name the
    runtime."""
    library = tmp_path / "decode-test.so"
    library.write_bytes(b"\x7fELF" + symbols)
    monkeypatch.setattr(kernels, "chosen_variant", lambda: ("portable", library))
    monkeypatch.setattr(kernels, "openmp", lambda: openmp)
    line = doctor.openmp_line()
    assert line.text.startswith(says) and line.values["openmp"] is openmp
    if not openmp:
        assert line.text.endswith("): they run on one thread")


def test_a_better_build_this_cpu_cannot_execute_is_named_with_what_it_lacks(monkeypatch):
    """On a CPU without AVX-512 (here: cpu.c's answer made a Zen 3's), the avx2 build runs and the
    line says why the avx512 one does not: kernels.why_not_here's words, as the tests' skips."""
    if not kernels.builds._is_x86():
        pytest.skip("the x86 builds only")
    monkeypatch.setattr(kernels.builds, "cpu_levels", lambda: kernels.CpuLevel.AVX2)
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    line = doctor.kernels_line()
    assert line.values["build"] == "avx2"
    assert f"better builds not used: the avx512 build: {kernels.why_not_here('avx512')}" in (
        line.text
    )
