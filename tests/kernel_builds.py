"""The C kernels' tests run once per build of the C kernels that this CPU can execute (conftest.py
registers the fixture and the hook below).

Design choices:
- A module whose tests call the kernels (test_kernels.py, test_blocks.py, test_inference_layers.py,
  test_amx.py) uses the `kernel_build` fixture; each of its tests runs under every build of this
  architecture (kernels.VARIANTS: avx512, avx2 and portable on x86-64), test ids `[avx2]` etc., so
  a developer on an AVX-512 machine runs the AVX2 and portable builds' tests too, and a difference
  between builds shows where it is made. `pytest.mark.kernel_builds("avx512")` narrows a test to
  the builds named (the AMX tests); `pytest.mark.any_build` marks one that does not depend on the
  build (pure PyTorch, the choice of a build itself): it runs once, under the process's own build.
- The fixture is module-scoped and switches the process with kernels.use_variant, so pytest groups
  a module's tests by build and switches once per group; a module-scoped fixture that prepares
  kernel calls (a prepared Call keeps the library it was prepared with) must ask for `kernel_build`
  to be made anew per build.
- A build this CPU cannot execute is skipped, and the skip names the instructions it lacks
  (kernels.why_not_here: the CPU's flags, or the operating system that does not enable them).
- ATTNLAB_KERNELS forces a build as it does outside the tests: only that build's tests run (a test
  narrowed to other builds skips, saying so); ATTNLAB_KERNELS=0 or a name this machine has not
  runs each test once, unswitched (and the kernels' own tests fail, saying why).
"""

from __future__ import annotations

import os

import pytest

from attnlab.generate import kernels


def builds_of_this_architecture() -> tuple[str, ...]:
    """The kernels' builds on this kind of processor, best first (choose_variant's names)."""
    return kernels.build_names()


def builds_to_run(narrowed: tuple[str, ...], forced: str) -> list[str] | None:
    """The builds a test runs under: `narrowed` (a kernel_builds marker's names; empty: every build
    of this architecture), only the one ATTNLAB_KERNELS=`forced` names where it names one of them;
    None (no parametrization: the process's own build) where `forced` names none of this
    architecture's (0, or a mistake the kernels report)."""
    every = builds_of_this_architecture()
    names = list(narrowed or every)
    if forced in ("", "1"):
        return names
    if forced not in every:
        return None
    return [forced] if forced in names else names  # (the others skip: `kernel_build`)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "kernel_builds(*names): run this kernel test under the builds named only",
    )
    config.addinivalue_line(
        "markers", "any_build: a kernel module's test that does not depend on the build: run once"
    )


def pytest_generate_tests(metafunc) -> None:
    if "kernel_build" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("any_build") is not None:
        return
    marker = metafunc.definition.get_closest_marker("kernel_builds")
    forced = os.environ.get("ATTNLAB_KERNELS", "").strip().lower()
    names = builds_to_run(tuple(marker.args) if marker else (), forced)
    if names is not None:
        metafunc.parametrize("kernel_build", names, indirect=True, scope="module")


@pytest.fixture(scope="module")
def kernel_build(request):
    """The build of the kernels this module's tests run under (its name), switched to with
    kernels.use_variant for as long as they run; None where the test is not run per build (the
    process's own build)."""
    name = getattr(request, "param", None)
    if name is None:
        yield None
        return
    forced = os.environ.get("ATTNLAB_KERNELS", "").strip().lower()
    if forced not in ("", "1", name):
        pytest.skip(f"ATTNLAB_KERNELS={forced} runs the {forced} build's tests only")
    if name not in kernels.variants_here():
        pytest.skip(kernels.why_not_here(name))
    previous = os.environ.get("ATTNLAB_KERNELS")
    kernels.use_variant(name)
    try:
        assert kernels.variant() == name  # (a build that fails its self-check: an error here)
        yield name
    finally:
        kernels.use_variant(previous)
