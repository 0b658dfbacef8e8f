"""attnlab's C kernels built by a compiler without OpenMP (Apple's clang; Debian's clang without
libomp-dev): they build, say in one line that they run on one thread, and compute the same
numbers when callers ask for two threads (every `omp` pragma but `omp simd` ignored, each share
computed from thread 0 of 1: no row may be skipped).

The build is clang's, as `CC=clang` makes it, in a temporary ATTNLAB_CACHE; the checks run on that
build compiled without OpenMP whatever clang has (with libomp it would have OpenMP). Without clang
the tests fail, as the kernel tests do without a compiler: `make test` installs it (make
compiler). The numbers are checked as in tests/test_kernels.py and tests/test_blocks.py, whose
checks of one build these reuse: products of every kind, few rows and a prompt's, the attention of
a decode step and of a prompt, the elementwise kernels, and whole generations' greedy tokens.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from styles import SIZES, build
from test_blocks import (
    KINDS,
    MORE,
    PROMPT,
    block_layer,
    check_product,
    products_sharing_one_rounding_in_this_build,
    prompt_products_in_this_build,
)
from test_kernels import (
    STYLE_NAMES,
    product_tolerance,
    prompt_attention_equals_the_chapters_equation,
    prompt_elementwise_kernels_in_this_build,
)

from attnlab import slower
from attnlab.generate import kernels
from attnlab.generate.loop import generate
from attnlab.model.attention import scaled_dot_product_attention
from attnlab.quant.blocks import BLOCK_TYPES, dequantize
from attnlab.quant.int8 import Int8Linear

NO_CLANG = (
    "clang is not installed: the kernels built without OpenMP (as Apple's clang builds them) are "
    "tested with it; `make test` installs it (make compiler: apt-get install clang)"
)


def clang_has_openmp(clang: str, folder) -> bool:
    """Whether `clang -fopenmp` builds a library that includes omp.h (libomp installed)."""
    source = folder / "omp.c"
    source.write_text("#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n")
    command = [clang, "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(folder / "omp.so")]
    return subprocess.run(command, capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def clang_build(tmp_path_factory):
    """(the build a process chooses with CC=clang, or the one ATTNLAB_KERNELS forces, whether it
    has OpenMP, the SlowerPath lines the choice said, the same build compiled without OpenMP and
    loaded)."""
    clang = shutil.which("clang")
    if clang is None:
        pytest.fail(NO_CLANG, pytrace=False)
    folder = tmp_path_factory.mktemp("clang")
    environment = {"CC": clang, "ATTNLAB_CACHE": str(folder)}
    with mock.patch.dict(os.environ, environment), mock.patch.object(slower, "_said", set()):
        if os.environ.get("ATTNLAB_KERNELS") not in kernels.VARIANTS:  # (a build it forces stays)
            os.environ.pop("ATTNLAB_KERNELS", None)
        kernels.decision.cache_clear()
        kernels.library.cache_clear()
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                chosen, openmp = kernels.chosen_variant(), kernels.openmp()
            flags = kernels.openmp_or_not(kernels.VARIANTS[chosen[0]][0])[1]
            assert "-fopenmp" not in flags and "-fopenmp-simd" in flags
            without = kernels.compile_library(kernels.SOURCE, (flags,))
        finally:
            kernels.decision.cache_clear()
            kernels.library.cache_clear()
    said = [str(w.message) for w in record if w.category is slower.SlowerPath]
    assert without is not None, f"clang does not compile the kernels with {flags}"
    return chosen, openmp, clang_has_openmp(clang, folder), said, kernels.load(without)


@pytest.fixture
def on_clangs_build(clang_build, monkeypatch):
    """The kernels are clang's build without OpenMP, and every caller asks for two threads."""
    monkeypatch.setattr(kernels.builds, "library", lambda: clang_build[-1])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not kernels.openmp()


def test_clang_builds_the_best_build_and_says_when_it_runs_on_one_thread(clang_build):
    chosen, openmp, has_openmp, said, _ = clang_build
    forced = os.environ.get("ATTNLAB_KERNELS")
    # compiled and passed its self-check
    assert chosen[0] == (forced if forced in kernels.VARIANTS else kernels.variants_here()[0])
    assert openmp == has_openmp
    one_thread = (
        "attnlab's C kernels run on one thread, not on torch's threads: "
        f"{shutil.which('clang')} built them without OpenMP (-fopenmp failed); gcc, or clang "
        "with libomp (apt-get install libomp-dev), builds them with it"
    )
    assert said == ([] if openmp else [one_thread])


def test_this_processs_kernels_report_their_openmp(tmp_path):
    """kernels.openmp(): what attnlab doctor prints; True where the compiler has OpenMP."""
    compiler = kernels.builds._compiler()
    probe = tmp_path / "omp.c"
    probe.write_text("#include <omp.h>\nint threads(void) { return omp_get_max_threads(); }\n")
    command = [*compiler, "-fopenmp", "-shared", "-fPIC", str(probe), "-o", str(tmp_path / "o.so")]
    has_openmp = subprocess.run(command, capture_output=True).returncode == 0
    assert kernels.openmp() is has_openmp


@pytest.mark.parametrize("d_in, d_out", [(7, 5), (129, 67), (600, 130)])
def test_float32_and_int8_products_without_openmp(on_clangs_build, seed, d_in, d_out):
    for rows in (1, 3, 8):
        x, w, b = torch.randn(rows, d_in), torch.randn(d_out, d_in), torch.randn(d_out)
        tol = product_tolerance(d_in)
        torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), **tol)
        q = Int8Linear.from_float(w, b)
        torch.testing.assert_close(
            kernels.linear(x, q.weight, q.bias, q.scale), F.linear(x, q.dequantized(), b), **tol
        )


@pytest.mark.parametrize("kind", KINDS + MORE)
def test_block_products_of_every_kind_without_openmp(on_clangs_build, seed, kind):
    """The decode step's block products (file layout and, where the build repacks, 16 rows) and
    the dequantizer, on shapes whose rows two threads would share."""
    k = BLOCK_TYPES[kind].weights // 32
    for rows, d_in, d_out in ((1, 32 * k, 5), (3, 96 * k, 67), (8, 288 * k, 130)):
        x = torch.randn(rows, d_in) * 2
        layer = block_layer(kind, d_out, d_in, seed + d_out, bias=True)
        kernel = BLOCK_TYPES[kind].kernel
        got = kernels.block_linear(x, layer.blocks, kernel, layer.bias)
        check_product(x, layer.blocks, kind, layer.bias, got, layer.weight)
        ours = kernels.dequantize(layer.blocks, kernel, d_in)
        torch.testing.assert_close(ours, dequantize(layer.blocks, kind), rtol=0, atol=0)
    if kernel in kernels.REPACKABLE:
        layer = block_layer(kind, 64, 96 * k, seed, bias=False)
        repacked = kernels.repack16(layer.blocks, kernel, 96 * k)
        x, out = torch.randn(2, 96 * k) * 2, torch.empty(2, 64)
        kernels.block_linear_call(x, repacked, kernel, None, out, repacked=True)()
        check_product(x, layer.blocks, kind, None, out, layer.weight)


@pytest.mark.parametrize("kind", PROMPT)
def test_prompt_products_without_openmp(on_clangs_build, kind):
    """A prompt's products: blocks with 8-bit and float32 activations, and float32 weights on the
    float32 tiles (kernels.linear_rows)."""
    prompt_products_in_this_build(kind)


def test_products_sharing_one_rounding_without_openmp(on_clangs_build):
    products_sharing_one_rounding_in_this_build()


def test_attention_and_elementwise_kernels_without_openmp(on_clangs_build, seed):
    """A decode step's attention over the cache (a row that sees no key gives zeros: clang's max
    reduction starts at -FLT_MAX, not -inf), a prompt's, and the prompt's elementwise kernels."""
    B, H, Hkv, D, max_len, slot = 3, 4, 2, 32, 16, 9
    k_cache, v_cache = torch.randn(B, Hkv, max_len, D), torch.randn(B, Hkv, max_len, D)
    q, k_new, v_new = torch.randn(B, H, D), torch.randn(B, Hkv, D), torch.randn(B, Hkv, D)
    mask = torch.rand(B, max_len) < 0.7
    mask[:, slot] = True
    mask[2, : slot + 1] = False
    out, scores, at = torch.empty(B, H, D), torch.empty(B, H, max_len), torch.tensor([slot])
    kernels.attend_call(q, k_new, v_new, k_cache, v_cache, at, 0.3, mask, scores, out)()
    expected = scaled_dot_product_attention(
        q.unsqueeze(2),
        k_cache[:, :, : slot + 1],
        v_cache[:, :, : slot + 1],
        mask=mask[:, None, None, : slot + 1],
        scale=0.3,
        return_weights=True,
    )[0].squeeze(2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert (out[2] == 0).all()
    prompt_attention_equals_the_chapters_equation()
    prompt_elementwise_kernels_in_this_build()


@pytest.mark.parametrize("name", STYLE_NAMES)
def test_generation_without_openmp_makes_the_module_paths_greedy_tokens(on_clangs_build, name):
    """Whole generations through the C decode step (the loop in C, and the Python loop around the
    step) of left-padded rows: the module path's tokens."""
    model = build(name)
    ids = torch.tensor([[0, 0, 7, 2, 9, 4], [5, 3, 8, 1, 6, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    reference = generate(model, ids, 12, temperature=0, attention_mask=mask, use_kernels=False)
    assert torch.equal(generate(model, ids, 12, temperature=0, attention_mask=mask), reference)
    streamed = generate(model, ids, 12, temperature=0, attention_mask=mask, on_token=len)
    assert torch.equal(streamed, reference)
    assert SIZES["d_vocab"] > int(reference.max())
