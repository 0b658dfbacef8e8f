"""The C kernels on a processor this machine is not: AArch64 (Apple silicon, Graviton, a Raspberry
Pi), cross-compiled here and run under user-mode emulation (qemu-aarch64).

Design choices:
- One C program (tests/c/kernel_outputs.c) calls the kernels on fixed inputs and prints their
  outputs as exact hexadecimal floats: the products of every block type (one row and a prompt's
  tiles), the blocks as floats, float32 and int8 products, attention in one call and in three
  steps, the norms, RoPE and the activations. It is compiled with the kernels in one unit, once for
  this machine with the portable build's flags (the reference: the build every x86 CPU can run)
  and once per AArch64 compiler and build, then run under qemu; their outputs are compared.
- The bound: the blocks as floats bit for bit (no arithmetic but the scale's product); every
  other output within 1e-6 of the largest value of its case. The builds part only in the order
  and fusion of float operations (gcc fuses a * b + c on AArch64 by default, not on x86-64
  without FMA); the x86 builds of the same program, gcc's and clang's, part from each other by as
  much (a few 1e-7).
- The AArch64 builds: gcc with the portable build's flags and with the dot-product extension that
  most ARM CPUs in use have (armv8.2-a+dotprod, the level llama.cpp's ARM builds target for its
  vdotq products), and clang without OpenMP (-fopenmp-simd, the kernels' build for a compiler
  without it, as Apple's clang is). The decode step's Q8_0, Q4_0 and Q4_1 products take NEON's
  integer dot products there (vdotq with the dot-product extension, widening products without):
  integer sums are exact, so those outputs are the portable build's on the same machine, bit for
  bit. No speed is measured: emulation says nothing about it.
- Without a cross compiler or qemu-aarch64 the tests skip, saying what to install.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from attnlab.generate import kernels

HARNESS = Path(__file__).with_name("c") / "kernel_outputs.c"
C_FOLDER = Path(kernels.SOURCE).parent
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's libc6-dev-arm64-cross
BOUND = 1e-6  # of the largest |value| of a case
EXACT = ("dequantize_",)

# name: (compiler command, flags)
AARCH64 = {
    "gcc": (["aarch64-linux-gnu-gcc"], ["-O3", "-fopenmp"]),
    "gcc-dotprod": (["aarch64-linux-gnu-gcc"], ["-O3", "-fopenmp", "-march=armv8.2-a+dotprod"]),
    "clang-no-openmp": (["clang", "--target=aarch64-linux-gnu"], ["-O3", "-fopenmp-simd"]),
}


def outputs(text: str) -> dict[str, list[float]]:
    """{case: its values} from kernel_outputs' lines."""
    found = {}
    for line in text.splitlines():
        name, *values = line.split()
        found[name] = [float.fromhex(v) for v in values]
    return found


def compile_harness(compiler: list[str], flags: list[str], target: Path) -> None:
    command = [*compiler, *flags, "-Wno-pass-failed", "-I", str(C_FOLDER), str(HARNESS)]
    done = subprocess.run(
        [*command, "-o", str(target), "-lm"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{' '.join(compiler)} failed:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, list[float]]:
    """The outputs of this machine's portable build (gcc, or whichever compiler the kernels use)."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler here (apt-get install gcc)")
    program = tmp_path_factory.mktemp("native") / "kernel_outputs"
    compile_harness([compiler], kernels.VARIANTS["portable"][0], program)
    return outputs(
        subprocess.run([str(program)], capture_output=True, text=True, check=True).stdout
    )


def differences(reference: dict, other: dict) -> list[str]:
    """The cases of `other` past their bound, each with its worst difference."""
    assert other.keys() == reference.keys()
    found = []
    for case, expected in reference.items():
        got = other[case]
        assert len(got) == len(expected), case
        if case.startswith(EXACT):
            if got != expected:
                found.append(f"{case}: not bit for bit")
            continue
        largest = max(abs(v) for v in expected)
        worst = max(abs(a - b) for a, b in zip(got, expected))
        if not worst <= BOUND * largest:  # NaN too
            found.append(f"{case}: {worst:.3g} against {BOUND * largest:.3g}")
    return found


@pytest.mark.parametrize("build", list(AARCH64))
def test_the_kernels_on_aarch64_give_the_portable_builds_numbers(build, reference, tmp_path):
    compiler, flags = AARCH64[build]
    qemu = shutil.which("qemu-aarch64")
    if shutil.which(compiler[0]) is None or qemu is None or not SYSROOT.is_dir():
        pytest.skip(
            "no AArch64 cross compiler or emulator here (apt-get install gcc-aarch64-linux-gnu "
            "libc6-dev-arm64-cross qemu-user; clang for the clang build)"
        )
    program = tmp_path / "kernel_outputs"
    compile_harness(compiler, flags, program)
    run = subprocess.run(
        [qemu, "-L", str(SYSROOT), str(program)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, f"under qemu-aarch64: {run.stderr[-2000:]}"
    assert differences(reference, outputs(run.stdout)) == []


def test_the_comparison_sees_a_difference_past_the_bound_and_one_bit_of_a_block():
    reference = {"linear_q_0": [1.0, -4.0], "dequantize_0": [0.5, 0.25]}
    assert differences(reference, reference) == []
    within = {"linear_q_0": [1.0 + 3e-6, -4.0], "dequantize_0": [0.5, 0.25]}
    assert differences(reference, within) == []
    past = {"linear_q_0": [1.0 + 5e-6, float("nan")], "dequantize_0": [0.5, 0.25 + 2**-25]}
    assert [line.split(":")[0] for line in differences(reference, past)] == [
        "linear_q_0",
        "dequantize_0",
    ]
