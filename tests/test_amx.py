"""Float32 products on AMX tiles (c/amx.c, attnlab_linear_amx; kernels.linear_amx), and the choice
of the product that forward passes and prompts of many rows take (kernels.float_products).

Tolerances, derived: the kernel splits each float32 value into three bfloat16 parts and sums six
exact products of parts in float32 (c/amx.c's comment), so it is a float32 GEMM with its own order
of summation: within Higham's bound of the exact sum (1e-5 · |x| |W|ᵀ here, as the float32 tiles'
tests), and, tighter, its largest error against float64 within 3x torch's own float32 GEMM's on the
same product plus 8 units in the last place of the largest |x| |W|ᵀ + |b| (a few terms: six
roundings where torch has one or two). Seen over 300 seeds of these shapes: at most 0.27 of that
bound; a part or a product left out exceeds it.

The product's tests belong to the AVX-512 build, the only one with AMX: they run under it alone
(tests/kernel_builds.py), skipped where the CPU lacks its instructions or where the CPU or its
operating system does not allow AMX, with the reason; the choice's tests run once, everywhere.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_inference_layers import (
    BASE,
    build,
    counting,
    forward,
    like_the_module_path,
    tiled_linears,
)

from attnlab import memory
from attnlab.errors import UserError
from attnlab.generate import kernels

# the tests that ask for `amx` run under the AVX-512 build (kernel_builds.py), the others once
pytestmark = pytest.mark.kernel_builds("avx512")


@pytest.fixture
def amx(kernel_build):
    if not kernels.available():
        pytest.fail("attnlab's C kernels could not be built here (no C compiler)", pytrace=False)
    why = kernels.amx_unusable()
    if why is not None and any(no in why for no in NO_AMX):
        pytest.skip(f"no AMX here: {why}")
    if why is not None:  # a fault or a wrong sum where the CPU and the OS allow AMX: a bug
        pytest.fail(f"the AMX product cannot run: {why}", pytrace=False)


# what amx_unusable says where this machine, not the kernel, is why
NO_AMX = ("does not let a process run AMX tiles", "only in the AVX-512 build")


# (rows, d_in, d_out): one of each; rows, k and features not multiples of the 32 x 32 blocks and 32
# k per tile; a few panels per thread; SmolLM2's q, k/v and down projections
SHAPES = [
    (1, 1, 1),
    (5, 33, 17),
    (31, 64, 31),
    (33, 100, 65),
    (64, 576, 192),
    (100, 1000, 70),
    (70, 1536, 576),
    (257, 576, 576),
]


def errors(x, w, bias, out) -> tuple[float, float]:
    """The largest error of `out` and of torch's float32 product against float64."""
    reference = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    slack = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((out.double() - reference).abs() <= slack).all()
    ours = (out.double() - reference).abs().max().item()
    torchs = (F.linear(x, w, bias).double() - reference).abs().max().item()
    return ours, torchs


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, d_in, d_out", SHAPES)
def test_the_amx_product_is_a_float32_gemm(amx, seed, rows, d_in, d_out, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    # values of every size, so that each needs all three of its bfloat16 parts
    x = torch.randn(rows, d_in, generator=g) * torch.rand(1, d_in, generator=g) * 3
    w = torch.randn(d_out, d_in, generator=g) * torch.rand(d_out, 1, generator=g)
    for bias in (None, torch.randn(d_out, generator=g)):
        out = kernels.linear_amx(x, w, bias)
        assert out.shape == (rows, d_out) and out.dtype == torch.float32
        ours, torchs = errors(x, w, bias, out)
        scale = (x.double().abs() @ w.double().abs().T).max().item()
        scale += 0.0 if bias is None else bias.abs().max().item()
        assert ours <= 3 * torchs + 8 * 2**-24 * scale, (ours, torchs)
    # leading dimensions are rows; a transposed x is read as its values
    x3 = torch.randn(3, rows, d_in, generator=g)
    assert torch.equal(
        kernels.linear_amx(x3, w),
        kernels.linear_amx(x3.reshape(-1, d_in), w).reshape(3, rows, d_out),
    )
    xt = torch.randn(d_in, rows, generator=g).T
    assert torch.equal(kernels.linear_amx(xt, w), kernels.linear_amx(xt.contiguous(), w))


def test_the_amx_product_of_exact_values_is_exact_and_threads_agree(amx, monkeypatch):
    """Small integers and halves: every partial sum exact, whatever the order; two threads compute
    each 32 x 32 block of y as one does, bit for bit."""
    x = torch.randint(-40, 40, (77, 300)).float() / 2
    w = torch.randint(-9, 9, (133, 300)).float()
    bias = torch.arange(133).float()
    exact = (x.double() @ w.double().T + bias.double()).float()
    outs = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda t=threads: t)
        outs.append(kernels.linear_amx(x, w, bias))
        assert torch.equal(outs[-1], exact)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(77, 300, generator=g), torch.randn(133, 300, generator=g)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = kernels.linear_amx(x, w)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert torch.equal(one, kernels.linear_amx(x, w))


def test_nan_and_infinity_stay_not_finite(amx):
    x = torch.ones(3, 40)
    x[0, 7], x[1, 20] = float("nan"), float("inf")
    out = kernels.linear_amx(x, torch.ones(5, 40))
    assert torch.isnan(out[0]).all() and not torch.isfinite(out[1]).any()
    assert torch.equal(out[2], torch.full((5,), 40.0))


def test_a_forward_without_gradients_takes_the_amx_product_and_the_module_paths_numbers(
    amx, seed, monkeypatch
):
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "amx")
    # the fused attention's and the explicit one's choices, timed once (with the tiles) before
    # counting
    kernels.float_rows(), kernels.attention_rows()
    products, calls, many = [], [], kernels.linear_amx_many  # the matrices; the calls
    for where in (kernels, kernels.products):  # generation's layers, and linear_amx
        monkeypatch.setattr(
            where,
            "linear_amx_many",
            lambda x, m: calls.append(len(m)) or products.extend(m) or many(x, m),
        )
    swiglu = kernels.swiglu_amx  # run_with_cache's gate and up (its gate hook only reads)
    monkeypatch.setattr(
        kernels,
        "swiglu_amx",
        lambda x, g, u: (
            calls.append(2) or products.extend([(g, None), (u, None)]) or swiglu(x, g, u)
        ),
    )
    tiles = counting(monkeypatch, "linear_rows")
    model = build("llama-gqa")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    with torch.no_grad():
        fast = forward(model, ids)  # within the fast layers, as their callers enter them
        fast_cache = model.run_with_cache(ids)[1]
        # every Linear of the blocks and the LM head large enough for the tiles, in both runs
        linears = tiled_linears(model, ids)
        assert linears >= 5 and len(products) == 2 * linears and tiles == []
        # q, k and v, and gate and up, x split once for each: 2 + 2 calls a layer, 1 the LM head;
        # run_with_cache's gate and up through swiglu_amx (silu(gate) · up from the same call)
        assert len(calls) == 2 * (4 * BASE["n_layers"] + 1)
    like_the_module_path(model, ids, fast, fast_cache, monkeypatch)


def test_many_rows_take_amx_where_allowed_else_the_measured_product(monkeypatch):
    """Unforced: AMX where amx_unusable has no objection, else the float32 tiles or torch as
    measured (kernels.float_rows; the attention's C steps as measured: kernels.attention_rows).
    Forced: what ATTNLAB_FLOAT_ROWS names; amx where AMX cannot run, or a name it does not take,
    is one line."""
    monkeypatch.delenv("ATTNLAB_FLOAT_ROWS")
    monkeypatch.setattr(kernels.policy, "rows_vectorized", lambda: (True, True))
    monkeypatch.setattr(kernels.policy, "_tiles_beat_torch", lambda build, threads: False)
    monkeypatch.setattr(kernels.policy, "_attention_beats_torch", lambda build, threads: True)
    monkeypatch.setattr(kernels.policy, "amx_unusable", lambda: None)
    assert kernels.float_products() == "amx"
    # the fused attention and blocks' float32 products, and the C attention steps: as measured
    assert kernels.float_rows() is False and kernels.attention_rows() is True
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "c")
    assert kernels.float_products() == "c" and kernels.float_rows() is True
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "torch")
    assert kernels.float_products() == "torch"
    why = "this CPU or its operating system does not let a process run AMX tiles"
    monkeypatch.setattr(kernels.policy, "amx_unusable", lambda: why)
    monkeypatch.delenv("ATTNLAB_FLOAT_ROWS")
    assert kernels.float_products() == "torch"
    monkeypatch.setattr(kernels.policy, "_tiles_beat_torch", lambda build, threads: True)
    assert kernels.float_products() == "c"
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "amx")
    with pytest.raises(UserError, match=f"ATTNLAB_FLOAT_ROWS=amx: {why}; use c or torch"):
        kernels.float_products()
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "mkl")
    with pytest.raises(UserError, match="ATTNLAB_FLOAT_ROWS=mkl: it takes amx, c or torch"):
        kernels.float_products()


def test_amx_runs_only_from_the_avx512_build_that_passed_its_check_in_a_child(tmp_path):
    """Other builds have no AMX; the portable build's own check (a child process) reports that the
    build cannot run it, and the verdict is kept beside the library."""
    assert "only in the AVX-512 build" in kernels.builds._amx_unusable(("avx2", Path("unused")))
    assert "only in the AVX-512 build" in kernels.builds._amx_unusable(None)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTNLAB_CACHE", str(tmp_path))
        path = kernels.build(flag_sets=(kernels.VARIANTS["portable"][0],))
    assert path is not None
    why = kernels.self_check(path, kernels.AMX_CHECK, ".amx-checked")
    assert why is not None and "does not let a process run AMX tiles" in why
    assert path.with_suffix(".amx-checked").read_text() == why


@pytest.mark.parametrize("threads", [1, 2])
def test_matrices_that_share_x_give_each_ones_own_product(amx, seed, threads, monkeypatch):
    """linear_amx_many (a layer's q, k and v: x split once) equals linear_amx on each matrix, bit
    for bit, whatever their sizes (one panel or many, one thread's or both)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 45, 200, generator=g)
    matrices = [
        (torch.randn(d_out, 200, generator=g), torch.randn(d_out, generator=g) if bias else None)
        for d_out, bias in ((576, True), (17, False), (1000, True), (64, False))
    ]
    together = kernels.linear_amx_many(x, matrices)
    for (w, bias), got in zip(matrices, together, strict=True):
        assert got.shape == (2, 45, w.shape[0])
        assert torch.equal(got, kernels.linear_amx(x, w, bias))


def test_matrices_that_share_x_ask_for_the_widest_panel_s_scratch(amx, monkeypatch):
    """A panel's width does not grow with d_out (d_in 200, one thread: one panel of 576 features,
    two of 512 for 1,000), so linear_amx_many asks for the most any of its matrices needs, not the
    largest d_out's (which overran the buffer: glibc's "corrupted top size")."""
    lib = kernels.library()
    need = {d: lib.attnlab_linear_amx_scratch(90, 200, d, 1) for d in (576, 1000)}
    assert need[576] > need[1000]
    asked = []
    keep = kernels.buffers._kept_scratch
    # the room the call needs, whatever it asks for: a short buffer would be overrun, not reported
    monkeypatch.setattr(
        kernels.products, "_kept_scratch", lambda n: asked.append(n) or keep(need[576])
    )
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    x = torch.randn(90, 200)
    kernels.linear_amx_many(x, [(torch.randn(576, 200), None), (torch.randn(1000, 200), None)])
    assert asked == [need[576]]


def test_a_thread_keeps_one_scratch_buffer_of_bounded_size():
    """The scratch of the AMX products is kept from call to call (no page faults each time) up to
    KEPT_SCRATCH_MAX; a larger one is the call's own."""
    small = kernels.buffers._kept_scratch(1000)
    assert kernels.buffers._kept_scratch(800).data_ptr() == small.data_ptr()
    large = kernels.buffers._kept_scratch(kernels.KEPT_SCRATCH_MAX + 1)
    assert large.numel() == kernels.KEPT_SCRATCH_MAX + 1
    assert kernels.buffers._kept_scratch(900).data_ptr() == small.data_ptr()


# (batch, T, heads, kv_heads, d_head): T not a multiple of the 32 x 32 blocks, grouped and plain
# heads, d_head not a multiple of 32 (the AMX steps pad it)
ATTENTION_SHAPES = [
    (1, 1, 2, 1, 32),
    (2, 37, 4, 2, 32),
    (1, 70, 6, 3, 64),
    (2, 13, 3, 3, 96),
    (1, 45, 2, 1, 48),
]


def within_float32(got, exact, terms, reference32):
    """got against the float64 `exact`, as the products above: Higham's bound on |terms| (the sum
    of the absolute products), and 3x torch's float32 error plus 8 units in the last place."""
    slack = 1e-5 * terms + 1e-6
    assert ((got.double() - exact).abs() <= slack).all()
    ours = (got.double() - exact).abs().max().item()
    torchs = (reference32.double() - exact).abs().max().item()
    assert ours <= 3 * torchs + 8 * 2**-24 * terms.max().item(), (ours, torchs)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("batch, T, heads, kv_heads, d_head", ATTENTION_SHAPES)
def test_the_attention_steps_on_amx_tiles_are_the_chapters_equation(
    amx, seed, batch, T, heads, kv_heads, d_head, threads, monkeypatch
):
    """The masked scores (q Kᵀ · scale where the key's position <= the query's, −∞ elsewhere,
    exactly; soft-capped, Gemma 2's, where a cap is given) and the pattern's mix with V, any
    pattern (a hook may put weight anywhere)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, T, d_head, generator=g)
    k = torch.randn(batch, kv_heads, T, d_head, generator=g)
    v = torch.randn(batch, kv_heads, T, d_head, generator=g)
    scale = d_head**-0.5
    group = heads // kv_heads
    k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = kernels.attend_scores(q, k, scale, amx=True)
    hidden = torch.ones(T, T, dtype=torch.bool).triu(1)
    assert torch.isneginf(scores[..., hidden]).all() and torch.isfinite(scores[..., ~hidden]).all()
    exact = (q.double() @ k_all.double().transpose(-2, -1)) * scale
    terms = (q.double().abs() @ k_all.double().abs().transpose(-2, -1)) * scale
    reference = (q @ k_all.transpose(-2, -1)) * scale
    visible = ~hidden.expand_as(scores)
    within_float32(scores[visible], exact[visible], terms[visible], reference[visible])
    # capped: c·tanh(s / c) of the same scores (its slope at most 1: the same slack)
    capped = kernels.attend_scores(q, k, scale, amx=True, softcap=1.5)
    assert torch.equal(torch.isneginf(capped), torch.isneginf(scores))
    cap = lambda s: 1.5 * torch.tanh(s / 1.5)  # noqa: E731
    within_float32(capped[visible], cap(exact[visible]), terms[visible], cap(reference[visible]))
    pattern = torch.rand(batch, heads, T, T, generator=g)  # weight on every key, masked or not
    z = kernels.attend_mix(pattern, v, amx=True)
    assert z.shape == (batch, heads, T, d_head)
    within_float32(
        z,
        pattern.double() @ v_all.double(),
        pattern.double().abs() @ v_all.double().abs(),
        pattern @ v_all,
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "batch, T, heads, kv_heads, d_head",
    # rows of 96: streamed from the thread's scratch; 725 tokens: straight into scores and pattern
    [*ATTENTION_SHAPES, (1, 130, 9, 3, 64), (2, 96, 4, 2, 64), (1, 725, 2, 1, 32)],
)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_the_three_attention_steps_in_one_call_are_the_steps_bit_for_bit(
    amx, seed, batch, T, heads, kv_heads, d_head, threads, softcap, monkeypatch
):
    """attend_explicit (run_with_cache's attention where its hooks only read: a head's scores and
    pattern read back from the core's cache, the pattern's zero chunks above the diagonal neither
    split nor multiplied) gives attend_scores', softmax_rows' and attend_mix's results exactly."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, T, d_head, generator=g)
    k, v = (torch.randn(batch, kv_heads, T, d_head, generator=g) * 2 for _ in range(2))
    scores, pattern, z = kernels.attend_explicit(q, k, v, d_head**-0.5, amx=True, softcap=softcap)
    assert z.shape == (batch, heads, T, d_head)
    assert torch.equal(scores, kernels.attend_scores(q, k, d_head**-0.5, amx=True, softcap=softcap))
    assert torch.equal(pattern, kernels.softmax_rows(scores))
    assert torch.equal(z, kernels.attend_mix(pattern, v, amx=True))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows, d_in, d_out", [*SHAPES, (1024, 576, 1536)])
def test_swiglu_on_the_tiles_is_gate_up_and_their_product_bit_for_bit(
    amx, seed, rows, d_in, d_out, threads, monkeypatch
):
    """swiglu_amx (run_with_cache's MLP where its gate hook only reads: silu(gate) · up taken from
    each block of the tiles) gives linear_amx_many's gate and silu_mul_up_rows' product exactly."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, d_in, generator=g)
    w_gate, w_up = (torch.randn(d_out, d_in, generator=g) * d_in**-0.5 for _ in range(2))
    gate, post = kernels.swiglu_amx(x, w_gate, w_up)
    gate_, up = kernels.linear_amx_many(x, [(w_gate, None), (w_up, None)])
    assert torch.equal(gate, gate_)
    assert torch.equal(post, kernels.silu_mul_up_rows(gate_, up))


def test_run_with_cache_fuses_only_where_every_hook_reads(amx, seed, monkeypatch):
    """run_with_cache's own hooks only read (hooks.reads): the attention's three steps and SwiGLU
    take one call each per layer, and the cache is bit for bit what the separate steps give (a
    caller's hook that is not marked, even one that reads, keeps them separate); a hook that
    edits the pattern still changes what flows on."""
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "amx")
    fused = {name: counting(monkeypatch, name) for name in ("attend_explicit", "swiglu_amx")}
    model = build("llama-gqa")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    seen = []
    with torch.no_grad():
        logits, cache = model.run_with_cache(ids)
        layers = model.config.n_layers
        assert [len(calls) for calls in fused.values()] == [layers, layers]
        looking = [
            (f"blocks.{i}.{point}", lambda t, hook: seen.append(hook.name))
            for i in range(layers)
            for point in ("attn.hook_pattern", "mlp.hook_pre")
        ]
        logits_, cache_ = model.run_with_cache(ids, fwd_hooks=looking)
        assert [len(calls) for calls in fused.values()] == [layers, layers]  # no more calls
        assert len(seen) == 2 * layers
        assert torch.equal(logits, logits_) and list(cache.keys()) == list(cache_.keys())
        for name in cache.keys():
            assert torch.equal(cache[name], cache_[name]), name
        uniform = lambda pattern, hook: torch.full_like(pattern, 1 / pattern.shape[-1])  # noqa: E731
        edited, _ = model.run_with_cache(ids, fwd_hooks=[("blocks.0.attn.hook_pattern", uniform)])
        assert (edited - logits).abs().max() > 1e-3


def test_a_hook_point_says_whether_its_hooks_only_read():
    from attnlab.lens.hooks import HookPoint, reads

    point = HookPoint()
    assert point.only_read  # no hook at all
    handle = point.add_hook(reads(lambda t, hook: None))
    assert point.only_read and point.has_hooks
    other = point.add_hook(lambda t, hook: None)  # unmarked: it might edit in place
    assert not point.only_read
    other.remove()
    assert point.only_read
    handle.remove()


@pytest.mark.parametrize("threads", [1, 2])
def test_outputs_on_fresh_pages_stream_the_same_numbers(amx, seed, threads, monkeypatch):
    """Within memory.recycled() (a run_with_cache's cache, on pages no cache holds) the products
    and SwiGLU write every whole block of their outputs past the caches: the same values as
    outside it, where they go through a block in L1 (rows of 16n floats and others, a bias)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(700, 200, generator=g)  # outputs from memory.SMALLEST bytes: pool blocks
    for d_out in (96, 100):
        w, b = torch.randn(d_out, 200, generator=g), torch.randn(d_out, generator=g)
        w2 = torch.randn(d_out, 200, generator=g)
        cold = kernels.linear_amx_many(x, [(w, None), (w2, b)])
        gate, post = kernels.swiglu_amx(x, w, w2)
        with memory.recycled():
            assert memory.fresh(700 * d_out * 4)
            fresh = kernels.linear_amx_many(x, [(w, None), (w2, b)])
            fresh_gate, fresh_post = kernels.swiglu_amx(x, w, w2)
        assert not memory.fresh(700 * d_out * 4)
        assert all(torch.equal(a, b) for a, b in zip(cold, fresh))
        assert torch.equal(gate, fresh_gate) and torch.equal(post, fresh_post)


def test_an_output_too_large_for_the_caches_streams_the_same_numbers(amx, seed):
    """Outputs from c/amx.c's AMX_STREAM_FROM floats (the LM head's logits) leave the tiles
    through streaming stores, smaller ones through a block in L1: the same values either way
    (the halves of the rows take the other path)."""
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(1024, 40, generator=g), torch.randn(16384, 40, generator=g)
    whole = kernels.linear_amx(x, w)  # 16M floats: streamed
    assert torch.equal(whole[:512], kernels.linear_amx(x[:512], w))
    assert torch.equal(whole[512:], kernels.linear_amx(x[512:], w))


@pytest.mark.parametrize("threads", [1, 2])
def test_weights_of_sixteen_bits_skip_a_product_of_zeros_and_others_keep_it(
    amx, seed, threads, monkeypatch
):
    """A panel whose weights all have at most 16 significant bits (a GGUF file's 4-bit blocks in
    float32) has no third bfloat16 part, and amx_block leaves out x1 w3 there; a panel beside it
    with one full float32 weight keeps it: both within a float32 GEMM's error of float64."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(100, 576, generator=g) * torch.rand(1, 576, generator=g) * 3
    w = torch.randn(2000, 576, generator=g)
    w16 = w.to(torch.bfloat16).float()
    w16 += (w - w16).to(torch.bfloat16).float()  # two parts: 16 significant bits
    mixed = torch.cat([w16[:1000], w[1000:]])  # panels of each kind
    for weights in (w16, mixed):
        out = kernels.linear_amx(x, weights)
        ours, torchs = errors(x, weights, None, out)
        scale = (x.double().abs() @ weights.double().abs().T).max().item()
        assert ours <= 3 * torchs + 8 * 2**-24 * scale, (ours, torchs)
    # one weight with a third part (1, 2^-9, 2^-18) deep inside a panel of 16-bit ones: it counts
    x = torch.randint(1, 4, (100, 576), generator=g).float()
    w16[500] = 0.0
    w16[500, 7] = 1 + 2**-9 + 2**-18
    out = kernels.linear_amx(x, w16)
    assert torch.equal(out[:, 500], x[:, 7] * (1 + 2**-9 + 2**-18))
