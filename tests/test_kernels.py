"""attnlab.generate.kernels (the C decode kernels), the kernel decode step and int8 weights, each
against the PyTorch equation it stands in for.

Tolerances: float32 products and attention agree with torch to 1e-5 relative (different summation
orders);
greedy tokens of the kernel step equal the module path's exactly; an int8 model's logits stay within
10 % of the
float model's spread (per-row int8 steps of max|w| / 127 on N(0, 0.3) weights: typically 3-5 %).
"""

from __future__ import annotations

import gc
import itertools
import math
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from kernel_builds import builds_of_this_architecture, builds_to_run
from styles import SIZES, build

import attnlab
from attnlab.errors import UserError
from attnlab.generate import kernels
from attnlab.generate import loop as generation
from attnlab.generate.fast_layers import MATVEC_MAX_ROWS, KernelLinear, fast_linears
from attnlab.generate.kernel_decoder import KernelDecoder
from attnlab.generate.kv_cache import KVCache
from attnlab.generate.loop import generate
from attnlab.model.attention import scaled_dot_product_attention
from attnlab.model.layers import _ACTIVATIONS, LayerNorm, Linear, RMSNorm
from attnlab.model.positions import Rotary, apply_rope
from attnlab.quant.int8 import Int8Linear
from attnlab.quant.quantize import quantize

# every test here runs once per build of the kernels this CPU can execute (kernel_builds.py), but
# those marked any_build
pytestmark = pytest.mark.usefixtures("kernel_build")

NO_KERNELS = (
    "attnlab's C kernels could not be built here (no C compiler: cc, gcc or clang; "
    "or ATTNLAB_KERNELS=0): they are the default generation path, so their tests fail "
    "rather than skip; `make test` installs a compiler (apt-get install gcc)"
)


@pytest.fixture(autouse=True, scope="module")
def built_kernels():
    """Every test here needs the kernels: without them each one fails with NO_KERNELS (a skip
    would let a machine without a compiler pass the suite, the default generation path untested)."""
    if not kernels.available():
        pytest.fail(NO_KERNELS, pytrace=False)


F32 = dict(rtol=1e-5, atol=1e-5)
# the styles (tests/styles.py) whose decode program and prompt paths are checked here
STYLE_NAMES = [
    "gpt2",
    "llama-gqa",
    "qwen-qk-norm-partial-rope",
    "sinusoidal-attn-only",
    "pythia-parallel-llama3-rope",
    "speedrun-relu2-softcap",
    "mistral-window",
    "gemma3",
    "gemma2",
    "olmo2",
]


@pytest.mark.parametrize("rows", [1, 3, 8])
# the last split over threads
@pytest.mark.parametrize("d_in, d_out", [(7, 5), (64, 36), (129, 67), (600, 130)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_kernels_equal_f_linear(seed, rows, d_in, d_out, bias, monkeypatch):
    # large enough to be split over threads: two of them (the tests otherwise run one)
    if d_in * d_out > 65536:
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    x, w = torch.randn(rows, d_in), torch.randn(d_out, d_in)
    b = torch.randn(d_out) if bias else None
    tol = product_tolerance(d_in)
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), **tol)
    out = torch.randn(rows, d_out)
    expected = out + F.linear(x, w, b)
    torch.testing.assert_close(kernels.linear(x, w, b, out=out, accumulate=True), expected, **tol)
    # int8: the same product with the weight its int8 values stand for
    q = Int8Linear.from_float(w, b)
    torch.testing.assert_close(
        kernels.linear(x, q.weight, q.bias, q.scale), F.linear(x, q.dequantized(), b), **tol
    )


def product_tolerance(d_in: int) -> dict:
    """F32, widened as √d_in: sums of d_in products of N(0, 1) values, added in another order,
    differ by rounding errors that grow like the sum's spread (1.3e-5 seen at d_in = 600)."""
    return dict(rtol=1e-5, atol=1e-5 * max(1.0, (d_in / 64) ** 0.5))


def test_the_read_probe_reads_every_byte_once(kernel_build):
    """attnlab_read_pass (kernels.read_bandwidth's probe) returns the sum of the buffer's 64-bit
    words modulo 2^64: every word read once, whichever thread reads it, whatever the threads'
    shares."""
    words = torch.randint(-(2**62), 2**62, (3 * 2**17 + 128,))  # 3 MiB + 1 KiB
    assert words.data_ptr() % 64 == 0
    want = int(words.numpy().view("uint64").sum(dtype="uint64"))  # numpy's sum wraps at 2^64
    library = kernels.library()
    for threads, ahead in ((1, 0), (2, 0), (3, 0), (2, 8192)):  # plain, and prefetching
        read = library.attnlab_read_pass(words.data_ptr(), 8 * words.numel(), threads, ahead)
        assert read == want, (threads, ahead)
    assert kernels.read_bandwidth(megabytes=8, repeats=1) > 0


def test_a_kernel_called_with_the_wrong_number_of_arguments_is_refused():
    """ctypes passes a C function's extra arguments on without a word (a product given one too many
    read 0 as its thread count): every declared kernel refuses a call with other than its count,
    before C runs."""
    library = kernels.library()
    permitted = library.attnlab_amx_permitted
    with pytest.raises(TypeError, match="takes 0 arguments"):
        permitted(1)
    rows_many = library.attnlab_linear_q_rows_many
    with pytest.raises(TypeError, match="takes 11 arguments [(]12 given[)]"):
        rows_many(*range(12))
    with pytest.raises(TypeError, match="[(]10 given[)]"):
        rows_many(*range(10))


@pytest.mark.any_build
def test_the_read_bandwidth_without_kernels_is_one_line(monkeypatch):
    monkeypatch.setattr(kernels.builds, "library", lambda: None)
    with pytest.raises(UserError, match="read bandwidth is measured by attnlab's C kernels"):
        kernels.read_bandwidth(megabytes=8)


def test_the_step_program_of_an_int8_model_gives_the_module_paths_logits(seed, monkeypatch):
    """(The float32 models' steps: test_kernel_decode_step_gives_the_module_paths_logits.)"""
    model = build("llama-gqa")
    quantize(model, "int8")
    B, T = 2, 9
    ids = torch.randint(0, SIZES["d_vocab"], (B, T))
    full = model(ids)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cache = KVCache.for_model(model, B, 16)
    model(ids[:, :3], kv_cache=cache, start_pos=0)
    step = KernelDecoder(model, cache)
    for t in range(3, T):
        torch.testing.assert_close(
            step(ids[:, t : t + 1], t, torch.full((B, 1), t)), full[:, t], rtol=1e-4, atol=1e-4
        )


@pytest.mark.any_build
def test_the_attention_kernel_refuses_a_cache_layout_it_would_misread():
    """The C loop reads the values position-major: a position-minor cache (the compiled step's) is
    refused where the call is prepared, not misread."""
    q, k_new, v_new = torch.randn(1, 2, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    k_cache = torch.randn(1, 1, 16, 8)
    v_minor = torch.randn(1, 1, 8, 16).transpose(-2, -1)
    scores, out = torch.empty(1, 2, 16), torch.empty(1, 2, 8)
    with pytest.raises(AssertionError):
        kernels.attend_call(
            q, k_new, v_new, k_cache, v_minor, torch.tensor([3]), 0.3, None, scores, out
        )
    with pytest.raises(AssertionError):  # a key mask of another length than the cache
        kernels.attend_call(
            q,
            k_new,
            v_new,
            k_cache,
            k_cache.clone(),
            torch.tensor([3]),
            0.3,
            torch.ones(1, 8, dtype=torch.bool),
            scores,
            out,
        )


@pytest.mark.any_build
def test_a_wrong_input_width_is_torchs_shape_error_not_an_assertion():
    for layer in (KernelLinear(24, 10), Int8Linear.from_float(torch.randn(10, 24), None)):
        with torch.no_grad(), pytest.raises(RuntimeError, match="cannot be multiplied"):
            layer(torch.randn(2, 23))


def test_kernel_linear_modules_take_the_kernel_on_few_rows_and_agree_with_f_linear(
    seed, monkeypatch
):
    calls = []
    monkeypatch.setattr(
        kernels, "linear", lambda *a, **k: calls.append(1) or kernels_linear(*a, **k)
    )
    layer, x = KernelLinear(24, 10), torch.randn(2, 3, 24)
    with torch.no_grad():
        # 4 rows
        torch.testing.assert_close(
            layer(x[:, :2]), F.linear(x[:, :2], layer.weight, layer.bias), **F32
        )
        assert len(calls) == 1
        layer(torch.randn(3, 3, 24))  # 9 rows: BLAS
        assert len(calls) == 1
    layer(x[:, :1])  # gradients wanted: the kernel has no backward
    assert len(calls) == 1


kernels_linear = kernels.linear


@pytest.mark.any_build
def test_the_models_linear_never_takes_a_fast_path_generation_swaps_one_in_and_out(
    seed, monkeypatch
):
    calls = []
    monkeypatch.setattr(
        kernels, "linear", lambda *a, **k: calls.append(1) or kernels_linear(*a, **k)
    )
    model = build("gpt")
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))  # 3 rows: the model's own Linear is F.linear
    assert calls == [] and not any(isinstance(m, KernelLinear) for m in model.modules())
    with fast_linears(model):
        assert all(type(m) is KernelLinear for m in model.modules() if isinstance(m, Linear))
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
    # back as they were
    assert calls and not any(isinstance(m, KernelLinear) for m in model.modules())
    # the module path, fast
    generate(model, torch.tensor([[1, 2, 3]]), 2, temperature=0, use_kernels=False)
    assert len(calls) > 1 and not any(isinstance(m, KernelLinear) for m in model.modules())


@pytest.mark.any_build
def test_int8_linear_rounds_each_row_to_127_steps_of_its_largest_weight(seed):
    w = torch.randn(6, 40)
    q = Int8Linear.from_float(w)
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() == 127
    torch.testing.assert_close(q.scale, w.abs().amax(1) / 127)
    # round to nearest step
    assert ((q.dequantized() - w).abs() <= q.scale[:, None] / 2 + 1e-7).all()
    x = torch.randn(20, 40)  # 20 rows: the PyTorch path
    torch.testing.assert_close(q(x), F.linear(x, q.dequantized()), **F32)


def test_rope_kernel_equals_apply_rope(seed):
    for d_head, rotary_dim in ((16, 16), (16, 8)):
        x, positions = torch.randn(3, 5, d_head), torch.randint(0, 100, (3, 1))
        cos, sin = Rotary(rotary_dim)(positions)  # (3, 1, 1, rotary_dim)
        expected = apply_rope(x.unsqueeze(1), cos, sin).squeeze(1)  # [batch, pos=1, head, d_head]
        rotated = x.clone()
        cos_table, sin_table = (
            t.view(100, -1).contiguous() for t in Rotary(rotary_dim)(torch.arange(100)[None])
        )
        kernels.rope_call(rotated, cos_table, sin_table, positions.view(-1))()
        torch.testing.assert_close(rotated, expected, **F32)


def test_embed_kernel_looks_up_tokens_and_learned_positions(seed):
    table, positions_table = torch.randn(11, 6), torch.randn(9, 6)
    ids, positions, out = torch.tensor([3, 10, 0]), torch.tensor([8, 0, 4]), torch.empty(3, 6)
    kernels.embed_call(ids, table, positions, None, out)()
    assert torch.equal(out, table[ids])
    kernels.embed_call(ids, table, positions, positions_table, out)()
    assert torch.equal(out, table[ids] + positions_table[positions])
    # Gemma's √d_model, as embed_tokens multiplies: torch rounds the scale to float32
    kernels.embed_call(ids, table, positions, None, out, math.sqrt(6))()
    assert torch.equal(out, table[ids] * math.sqrt(6))
    assert not torch.equal(out, (table[ids].double() * math.sqrt(6)).float())  # it would show


def test_the_step_programs_small_ops_equal_torchs(seed):
    """add, mul (sandwich norms, GeGLU) and the window mask (generate's band of the last W
    slots), each against the PyTorch it replaced."""
    y, x = torch.randn(37), torch.randn(37)
    added, multiplied = y.clone(), y.clone()
    kernels.add_call(added, x)()
    kernels.mul_call(multiplied, x)()
    assert torch.equal(added, y + x) and torch.equal(multiplied, y * x)
    key_mask = torch.rand(3, 10) > 0.3
    window, slot = torch.zeros(3, 10, dtype=torch.bool), torch.zeros(1, dtype=torch.int64)
    for mask in (key_mask, None):
        for at, W in ((0, 4), (2, 4), (7, 4), (9, 1), (9, 10), (5, 20)):
            slot.fill_(at)
            kernels.window_mask_call(window, mask, slot, W)()
            expected = mask.clone() if mask is not None else torch.ones(3, 10, dtype=torch.bool)
            expected[:, : max(0, at - W + 1)] = False
            assert torch.equal(window, expected), (at, W)


def test_norm_and_activation_kernels_equal_the_modules(seed):
    x = torch.randn(3, 20) * 3
    for norm in (LayerNorm(20), LayerNorm(20, bias=False), RMSNorm(20)):
        with torch.no_grad():
            for p in norm.parameters():
                p.normal_()
            out = torch.empty_like(x)
            kernels.norm_call(norm, x, out)()
            torch.testing.assert_close(out, norm(x), **F32)
    for name, kind in kernels.ACTIVATIONS.items():
        y = x.clone()
        kernels.activate_call(y, kind)()
        torch.testing.assert_close(y, _ACTIVATIONS[name](x), **F32)
    # GELU's tanh form through the vectorised exp_ (as a sigmoid), over float's whole range, against
    # the float64 function (where 1 + tanh u cancels, the more precise of the two float forms; where
    # float64 rounds it to 0, a value under 1e-15)
    v = torch.cat([torch.randn(60) * 3, torch.linspace(-100, 100, 2001)])
    v = torch.cat([v, torch.tensor([-1e30, -1e38, 1e30, 1e38, float("nan")])])
    y = v.clone()
    kernels.activate_call(y, kernels.ACTIVATIONS["gelu_tanh"])()
    expected = F.gelu(v.double(), approximate="tanh").float()
    torch.testing.assert_close(y, expected, rtol=2e-6, atol=1e-12, equal_nan=True)
    # exact GELU through erfc and exp_, the same way (e^(-z^2) carries z^2's rounding: under 1e-5 of
    # values under 1e-6 there)
    y = v.clone()
    kernels.activate_call(y, kernels.ACTIVATIONS["gelu"])()
    expected = F.gelu(v.double()).float()
    torch.testing.assert_close(y, expected, rtol=2e-6, atol=1e-11, equal_nan=True)
    # SiLU's exp over float's whole range: the vectorised exp_ holds its input to [-87.3, 88.3]
    gate = torch.cat(
        [torch.randn(60), torch.linspace(-100, 100, 2001), torch.tensor([-1e30, -1e38, 1e30, 1e38])]
    )
    up = torch.randn_like(gate)
    expected = F.silu(gate) * up
    kernels.silu_mul_call(gate, up)()
    torch.testing.assert_close(gate, expected, rtol=1e-6, atol=1e-30)


def test_the_logit_softcap_kernel_equals_cap_tanh_over_floats_whole_range(seed):
    """x = cap tanh(x / cap) through the vectorised exp_ (and a series near 0, where the exp form
    cancels) against the float64 function: large, small, tiny, infinite and NaN logits."""
    for cap in (30.0, 3.0):
        x = torch.cat(
            [
                torch.randn(100) * cap,
                torch.linspace(-10 * cap, 10 * cap, 6001),
                torch.logspace(-30, 1, 200) * cap * torch.tensor([-1.0, 1.0]).repeat(100),
                torch.tensor([-1e38, 1e38, float("inf"), float("-inf"), float("nan"), 0.0]),
            ]
        )
        y = x.clone()
        kernels.softcap_call(y, cap)()
        expected = (cap * torch.tanh(x.double() / cap)).float()
        torch.testing.assert_close(y, expected, rtol=2e-6, atol=1e-30, equal_nan=True)


# 32, 80: AVX-512's weighted sum (64 values at a time, then 16)
@pytest.mark.parametrize("d_head", [8, 32, 80])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("softcap", [None, 1.5])  # Gemma 2's cap, low enough to bend these scores
def test_attend_kernel_writes_the_cache_and_equals_the_chapters_equation(
    seed, heads, kv_heads, d_head, softcap
):
    B, D, max_len, slot = 3, d_head, 16, 9
    k_cache, v_cache = torch.randn(B, kv_heads, max_len, D), torch.randn(B, kv_heads, max_len, D)
    q, k_new, v_new = (
        torch.randn(B, heads, D),
        torch.randn(B, kv_heads, D),
        torch.randn(B, kv_heads, D),
    )
    mask = torch.rand(B, max_len) < 0.7
    mask[:, slot] = True
    mask[2, : slot + 1] = False  # a row that may see no key: zeros
    out, scores, at = torch.empty(B, heads, D), torch.empty(B, heads, max_len), torch.tensor([slot])
    call = (q, k_new, v_new, k_cache, v_cache, at, 0.3)
    kernels.attend_call(*call, mask, scores, out, softcap)()
    assert torch.equal(k_cache[:, :, slot], k_new) and torch.equal(v_cache[:, :, slot], v_new)
    keys, values = k_cache[:, :, : slot + 1], v_cache[:, :, : slot + 1]
    expected = scaled_dot_product_attention(
        q.unsqueeze(2),
        keys,
        values,
        mask=mask[:, None, None, : slot + 1],
        scale=0.3,
        return_weights=True,
        softcap=softcap,
    )[0].squeeze(2)
    torch.testing.assert_close(out, expected, **F32)
    assert (out[2] == 0).all()
    # no mask: every slot
    kernels.attend_call(*call, None, scores, out, softcap)()
    expected = scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, scale=0.3, return_weights=True, softcap=softcap
    )[0]
    torch.testing.assert_close(out, expected.squeeze(2), **F32)


def test_prompt_attention_equals_the_chapters_equation():
    prompt_attention_equals_the_chapters_equation()


def prompt_attention_equals_the_chapters_equation() -> None:
    """kernels.attend_rows against the explicit equation in float64, on prompts whose length is
    not a multiple of the kernel's 12 queries or 32 keys, grouped and plain heads, a batch of 2;
    without a soft-cap and with one (Gemma 2's, low enough to bend these scores)."""
    g = torch.Generator().manual_seed(0)
    for (B, T, H, Hkv, D), softcap in itertools.product(
        ((1, 1, 2, 1, 32), (2, 37, 4, 2, 32), (1, 70, 6, 3, 64), (2, 13, 3, 3, 96)), (None, 2.0)
    ):
        q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # [batch, head, pos, d_head]
        k, v = (torch.randn(B, T, Hkv, D, generator=g).transpose(1, 2) * 2 for _ in range(2))
        expected = scaled_dot_product_attention(
            q.double(),
            k.double(),
            v.double(),
            causal=True,
            scale=0.2,
            return_weights=True,
            softcap=softcap,
        )[0]
        got = kernels.attend_rows(q, k, v, 0.2, softcap)
        assert got.shape == (B, H, T, D) and got.transpose(1, 2).is_contiguous()
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_prompt_attention_on_two_threads_equals_one(monkeypatch):
    q, k, v = torch.randn(1, 4, 50, 64), torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64)
    one = kernels.attend_rows(q, k, v, 0.125)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert torch.equal(kernels.attend_rows(q, k, v, 0.125), one)


@pytest.mark.parametrize(
    "name, window, calls_per_layer",
    [("llama-gqa", None, 1), ("gpt2", None, 1), ("llama-gqa", 11, 1), ("llama-gqa", 6, 0)],
)
def test_generation_takes_the_prompt_attention_where_it_applies(
    name, window, calls_per_layer, monkeypatch
):
    """In generation a float32 prompt from position 0 calls attend_rows in every block (where this
    build runs it vectorised) whose window, if any, is no shorter than the prompt, and the
    prefill's logits stay with the module path's."""
    model = build(name, d_model=128, sliding_window=window)  # d_head 32
    ids = torch.randint(0, SIZES["d_vocab"], (2, 11))
    calls, attend_rows = [], kernels.attend_rows
    monkeypatch.setattr(
        kernels, "attend_rows", lambda *a: calls.append(a[0].shape) or attend_rows(*a)
    )
    with torch.no_grad(), fast_linears(model):
        cache = KVCache.for_model(model, 2, 16)
        logits = generation.prefill(model, ids, cache)
    expected = model(ids)[:, -1]
    torch.testing.assert_close(logits, expected, **F32)
    vectorised = kernels.rows_vectorized()[1]
    assert len(calls) == (calls_per_layer * model.config.n_layers if vectorised else 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_prompt_elementwise_kernels_equal_the_modules(threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    prompt_elementwise_kernels_in_this_build()


def prompt_elementwise_kernels_in_this_build() -> None:
    """rms_norm_rows (and its hooks' parts) and silu_mul_rows (and into up) against the modules'
    equations (up to float32 rounding), rope_rows equal to apply_rope bit for bit, on row counts
    below and above the few-row threshold and on sizes the threads split (more than 16,384
    values), a rotation of every dim and of the first half only (partial RoPE)."""
    norm = RMSNorm(40, 1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    for shape in [(1, 3, 40), (2, 13, 40), (2, 300, 40)]:
        x = torch.randn(shape) * 3
        with torch.no_grad():
            torch.testing.assert_close(kernels.rms_norm_rows(x, norm.weight, 1e-5), norm(x), **F32)
        # with the parts its hooks read: scale = sqrt(mean(x²) + eps), normalized = x / scale
        out, scale, normalized = kernels.rms_norm_parts_rows(x, norm.weight, 1e-5)
        assert torch.equal(out, kernels.rms_norm_rows(x, norm.weight, 1e-5))
        exact = (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
        torch.testing.assert_close(scale, exact.float(), **F32)
        torch.testing.assert_close(normalized, (x.double() / exact).float(), **F32)
        gate, up = torch.randn(shape) * 4, torch.randn(shape)
        expected = F.silu(gate) * up
        kept = gate.clone()
        torch.testing.assert_close(kernels.silu_mul_up_rows(gate, up.clone()), expected, **F32)
        assert torch.equal(gate, kept)  # (the gate, which a hook holds, untouched)
        assert kernels.silu_mul_rows(gate, up) is gate
        torch.testing.assert_close(gate, expected, **F32)
    for B, T, H, D, rotary_dim in [(1, 3, 2, 8, 8), (2, 13, 3, 10, 10), (2, 300, 4, 32, 16)]:
        x = torch.randn(B, T, H, D)
        cos, sin = Rotary(rotary_dim, 10_000.0)(torch.arange(T).expand(B, T), torch.float32)
        before = x.clone()
        # the products rounded, then added, as apply_rope's: the same bits
        assert torch.equal(kernels.rope_rows(x, cos, sin), apply_rope(x, cos, sin))
        assert torch.equal(x, before)  # out of place


def counting(monkeypatch, *names: str) -> dict[str, int]:
    """Count the calls of each kernels.<name> from here on."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        function = getattr(kernels, name)

        def counted(*args, _name=name, _function=function, **kwargs):
            calls[_name] += 1
            return _function(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)
    return calls


ELEMENTWISE = ("rms_norm_rows", "rope_rows", "silu_mul_rows")


@pytest.mark.parametrize("name", ["llama-gqa", "qwen-qk-norm-partial-rope", "gpt2"])
def test_generation_runs_a_prompts_norms_rope_and_swiglu_in_c(name, monkeypatch):
    """A prompt's RMSNorms (both of every block; the final norm sees the last position only), its
    RoPE (q and k of every block) and SwiGLU's product (every block) run in C, and the prefill's
    logits stay with the module path's; a model without them (GPT-2) calls none."""
    model = build(name)
    ids = torch.randint(0, SIZES["d_vocab"], (2, 11))
    calls = counting(monkeypatch, *ELEMENTWISE)
    with torch.no_grad(), fast_linears(model):
        logits = generation.prefill(model, ids, KVCache.for_model(model, 2, 16))
    torch.testing.assert_close(logits, model(ids)[:, -1], rtol=1e-4, atol=1e-4)
    cfg, layers = model.config, model.config.n_layers
    norms = (2 + 2 * cfg.qk_norm) * layers if cfg.norm == "rmsnorm" else 0  # q_norm, k_norm too
    assert calls == {
        "rms_norm_rows": norms,
        "rope_rows": 2 * layers if cfg.positional == "rope" else 0,
        "silu_mul_rows": layers if cfg.mlp == "swiglu" else 0,
    }


def test_a_prompts_c_elementwise_kernels_step_aside_for_a_hook(monkeypatch):
    """A hook that reads or replaces what a C kernel would compute or overwrite (the MLP's
    pre-activation, a norm's scale) gets the module path in that block: the hook runs and its edit
    counts, and the other block keeps the kernels."""
    model = build("llama-gqa")
    ids = torch.randint(0, SIZES["d_vocab"], (2, 11))
    seen = []
    model.blocks[0].mlp.hook_pre.add_hook(lambda t, hook: seen.append(t.clone()) or t * 2)
    model.blocks[1].ln1.hook_scale.add_hook(lambda t, hook: t * 3)
    with torch.no_grad():
        expected = model(ids)[:, -1]
    seen.clear()
    calls = counting(monkeypatch, *ELEMENTWISE)
    with torch.no_grad(), fast_linears(model):
        logits = generation.prefill(model, ids, KVCache.for_model(model, 2, 16))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert len(seen) == 1 and seen[0].shape == (2, 11, SIZES["d_mlp"])
    assert calls == {"rms_norm_rows": 2 * 2 - 1, "rope_rows": 4, "silu_mul_rows": 1}


# two: the step program's threads share every product and wait
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", STYLE_NAMES)
def test_kernel_decode_step_gives_the_module_paths_logits(seed, name, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    model = build(name)
    assert KernelDecoder.unsupported(model) is None
    B, T, max_len = 2, 12, 20
    ids = torch.randint(0, SIZES["d_vocab"], (B, T))
    full = model(ids)
    cache = KVCache.for_model(model, B, max_len)
    model(ids[:, :4], kv_cache=cache, start_pos=0)
    step = KernelDecoder(model, cache)
    for t in range(4, T):
        logits = step(ids[:, t : t + 1], t, torch.full((B, 1), t))
        torch.testing.assert_close(logits, full[:, t], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "name, changes",
    [("gemma3", dict(embedding_multiplier=2.5)), ("pythia-parallel", dict(unembed_bias=True))],
)
def test_the_c_step_takes_granites_embedding_multiplier_and_phi2s_head_bias(seed, name, changes):
    """embedding_multiplier joins √d_model in the C lookup, the LM head's bias its product;
    Granite's other two multipliers send the model down the module path, which says why."""
    model = build(name, **changes)
    assert KernelDecoder.unsupported(model) is None
    ids = torch.randint(0, SIZES["d_vocab"], (1, 6))
    full = model(ids)
    cache = KVCache.for_model(model, 1, 8)
    model(ids[:, :5], kv_cache=cache, start_pos=0)
    logits = KernelDecoder(model, cache)(ids[:, 5:], 5, torch.full((1, 1), 5))
    torch.testing.assert_close(logits, full[:, 5], rtol=1e-4, atol=1e-4)
    for multiplier in (dict(residual_multiplier=0.5), dict(logit_scale=0.125)):
        assert "Granite" in KernelDecoder.unsupported(build("llama-gqa", **multiplier))


# past the few-row kernels: "B = 32" of the benchmarks
@pytest.mark.parametrize("B", [MATVEC_MAX_ROWS + 1, 32])
@pytest.mark.parametrize("int8", [False, True])
# biases (addmm) and none (mm), learned positions and RoPE
@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_a_decode_step_of_many_rows_gives_the_float64_modules_logits(
    seed, name, int8, B, monkeypatch
):
    """A batch of more than MATVEC_MAX_ROWS sequences: float32 weights multiply through BLAS
    (torch.addmm into the step's buffers, added to the residual in place), int8 weights through the
    int8 kernel at B rows; both against the module path in float64."""
    import copy

    model = build(name)
    if int8:
        quantize(model, "int8")
    # int8 weights stay int8, widened to float64 where used
    reference = copy.deepcopy(model).double()
    T, P = 7, 3
    ids = torch.randint(0, SIZES["d_vocab"], (B, T))
    with torch.no_grad():
        full = reference(ids)
    cache = KVCache.for_model(model, B, 12)
    model(ids[:, :P], kv_cache=cache, start_pos=0)
    rows = []
    prepare = kernels.linear_call
    monkeypatch.setattr(
        kernels, "linear_call", lambda x, *a, **k: rows.append(x.shape[0]) or prepare(x, *a, **k)
    )
    step = KernelDecoder(model, cache)
    # float32: BLAS only
    assert rows == ([B] * len(KernelDecoder.linears_in_step_order(model)) if int8 else [])
    for t in range(P, T):
        logits = step(ids[:, t : t + 1], t, torch.full((B, 1), t))
        torch.testing.assert_close(logits.double(), full[:, t], rtol=1e-4, atol=1e-4)


@pytest.mark.any_build
def test_a_decode_step_keeps_the_buffers_it_was_prepared_with_alive(seed):
    """The C calls hold addresses: the prepared step must keep its cache alive when the caller drops
    it."""
    model = build("llama-gqa")
    ids = torch.randint(0, SIZES["d_vocab"], (1, 6))
    full = model(ids)
    cache = KVCache.for_model(model, 1, 8)
    step, keys = KernelDecoder(model, cache), weakref.ref(cache.k[0])
    del cache  # now nobody but the step holds it
    gc.collect()
    assert keys() is not None  # still alive: the C calls' addresses stay valid
    for t in range(6):
        logits = step(ids[:, t : t + 1], t, torch.tensor([[t]]))
    torch.testing.assert_close(logits, full[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", STYLE_NAMES)
def test_default_generation_takes_the_kernels_and_picks_the_module_paths_tokens(name, monkeypatch):
    model = build(name)
    prompts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    reference = generate(model, ids, 12, temperature=0, attention_mask=mask, use_kernels=False)
    steps, loops = [], []
    monkeypatch.setattr(
        KernelDecoder, "__call__", lambda self, *a: steps.append(1) or kernel_call(self, *a)
    )
    monkeypatch.setattr(
        KernelDecoder,
        "generate_greedy",
        lambda self, *a: loops.append(a[1]) or greedy_in_c(self, *a),
    )
    assert torch.equal(generate(model, ids, 12, temperature=0, attention_mask=mask), reference)
    # every decode step went through the kernels: greedy, the whole loop in one C call, but where
    # the embedding is PyTorch's (sinusoids)
    assert (loops, len(steps)) == (([], 11) if name == "sinusoidal-attn-only" else ([12], 0))
    assert torch.equal(
        generate(model, ids[:1], 12, temperature=0),
        generate(model, ids[:1], 12, temperature=0, use_kernels=False),
    )
    # a streaming caller (or sampling) takes the Python loop around the same step
    steps.clear()
    streamed = generate(model, ids, 12, temperature=0, attention_mask=mask, on_token=lambda t: 0)
    assert torch.equal(streamed, reference) and len(steps) == 11


kernel_call, greedy_in_c = KernelDecoder.__call__, KernelDecoder.generate_greedy


def test_an_attention_soft_cap_is_computed_by_the_c_attention(seed, monkeypatch):
    """Gemma 2's attention soft-cap in the C attention: the decode step takes the model (its logits
    step by step: test_kernel_decode_step_gives_the_module_paths_logits), and a prompt's attention
    in its global block takes attend_rows in generation and plain passes and attend_explicit in
    run_with_cache (64 rows and more, where this build vectorises its tiles; the windowed block's
    window is shorter than the prompt: Attention's steps), each giving the module path's numbers
    (Attention, held to the oracle in tests/test_model.py): logits, patterns, greedy tokens."""
    from attnlab.generate.fast_layers import TILES_MIN_ROWS, inference_layers

    model = build("gemma2", d_model=64, n_heads=2, n_kv_heads=1, n_ctx=2 * TILES_MIN_ROWS)
    assert model.config.attn_softcap is not None and model.config.d_head == 32
    assert [model.config.layer_window(i) for i in range(2)] == [4, None]
    assert KernelDecoder.unsupported(model) is None
    calls = counting(monkeypatch, "attend_rows", "attend_explicit")
    ids = torch.randint(0, SIZES["d_vocab"], (1, TILES_MIN_ROWS + 8))
    with torch.no_grad():
        plain = model(ids)
        with fast_linears(model):
            prefill = generation.prefill(model, ids, KVCache.for_model(model, 1, ids.shape[1]))
        with inference_layers(model, ids):
            fast = model(ids)
        logits, cache = model.run_with_cache(ids, names_filter=lambda n: "hook_pattern" in n)
    vectorised = kernels.rows_vectorized()[1]  # attend_rows: the prefill's and the plain pass's
    assert calls == {"attend_rows": 2 * vectorised, "attend_explicit": int(vectorised)}
    torch.testing.assert_close(prefill, plain[:, -1], **F32)
    torch.testing.assert_close(fast, plain, **F32)
    torch.testing.assert_close(logits, plain, **F32)
    kept = []
    with torch.no_grad():  # the pattern the module's explicit steps compute
        model.run_with_hooks(
            ids, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda t, hook: kept.append(t))]
        )
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"], kept[0], **F32)
    prompt = ids[:, :6]
    assert torch.equal(
        generate(model, prompt, 8, temperature=0),
        generate(model, prompt, 8, temperature=0, use_kernels=False),
    )


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", [n for n in STYLE_NAMES if n != "sinusoidal-attn-only"])
def test_greedy_generation_in_c_makes_the_python_loops_tokens(seed, name, threads, monkeypatch):
    """The C loop (no Python between tokens) against generate's Python loop around the same step
    (on_token set): equal tokens for left-padded rows, an eos that stops one row before the other
    and then both, and ties (every logit equal: the first id, as torch.argmax)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    model = build(name)
    ids = torch.tensor([[0, 0, 7, 2, 9, 4], [5, 3, 8, 1, 6, 2]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])

    def both(**kw):  # (the C loop's tokens, the Python loop's)
        in_c = generate(model, ids, 14, temperature=0, attention_mask=mask, **kw)
        return in_c, generate(
            model, ids, 14, temperature=0, attention_mask=mask, on_token=len, **kw
        )

    in_c, python = both()
    assert torch.equal(in_c, python)
    eos = int(python[0, 6 + 3])  # row 0's fourth new token
    in_c, python = both(eos_token_id=eos)
    assert torch.equal(in_c, python) and (in_c[0, 9:] == eos).all()
    with torch.no_grad():
        model.unembed.weight.zero_()  # every logit equal (or a bias's, with its ties)
        if model.unembed.bias is not None:
            model.unembed.bias.copy_(torch.arange(SIZES["d_vocab"]) % 3)  # ties at 2, 5, 8 ...
    in_c, python = both()
    assert torch.equal(in_c, python)
    assert (in_c[:, 6:] == (2 if model.unembed.bias is not None else 0)).all()


@pytest.mark.parametrize("name", ["gpt2", "pythia-parallel-llama3-rope"])
def test_a_short_prompt_goes_through_the_decode_step_and_picks_the_module_paths_tokens(
    name, monkeypatch
):
    model = build(name)
    ids, mask = (
        torch.tensor([[0, 7, 2], [5, 3, 8], [0, 0, 4]]),
        torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]]),
    )
    assert ids.shape[1] <= generation.PREFILL_IN_STEPS
    reference = generate(model, ids, 10, temperature=0, attention_mask=mask, use_kernels=False)
    one = torch.tensor([[6]])
    reference_one = generate(model, one, 10, temperature=0, use_kernels=False)
    steps = []
    monkeypatch.setattr(
        KernelDecoder, "__call__", lambda self, *a: steps.append(1) or kernel_call(self, *a)
    )
    monkeypatch.setattr(generation, "prefill", None)  # the module path's prefill is not called
    assert torch.equal(generate(model, ids, 10, temperature=0, attention_mask=mask), reference)
    # the prompt's three tokens, then (greedy, in C) every new token but the last
    assert len(steps) == 3 and torch.equal(
        generate(model, ids, 10, temperature=0, attention_mask=mask, on_token=len), reference
    )
    assert len(steps) == 3 + 3 + 9  # the same, the new ones each a Python call
    assert torch.equal(generate(model, one, 10, temperature=0), reference_one)
    # checked before the C lookup reads the table
    with pytest.raises(UserError, match="outside the vocabulary"):
        generate(model, torch.tensor([[SIZES["d_vocab"]]]), 3)
    # not truncated to integers by the lookup
    with pytest.raises(UserError, match="must be integers"):
        generate(model, torch.tensor([[1.0, 2.0]]), 3)
    with pytest.raises(UserError, match="no tokens"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 3)


@pytest.mark.any_build
def test_hooked_post_norm_and_narrow_models_take_the_module_path(monkeypatch):
    model = build("gpt2")
    seen = []
    with model.hooks([("blocks.0.hook_resid_pre", lambda x, hook: seen.append(x.shape[1]))]):
        assert "hook" in KernelDecoder.unsupported(model)
        generate(model, torch.tensor([[1, 2, 3]]), 4, temperature=0)
    assert seen == [3, 1, 1, 1]  # the prompt, then every decode step ran the hook
    assert KernelDecoder.unsupported(model) is None
    assert "post-norm" in KernelDecoder.unsupported(build("gpt-post-norm"))
    # an MLP the kernels would not know (every one of config.MLPS is known)
    with monkeypatch.context() as patch:
        patch.delitem(kernels.ACTIVATIONS, "relu2")
        assert "relu2" in KernelDecoder.unsupported(build("gpt", mlp="relu2"))
    assert "float32" in KernelDecoder.unsupported(build("gpt").double())
    assert (
        KernelDecoder.unsupported(
            attnlab.quant.quantize.store_weights_as(build("gpt"), torch.bfloat16)
        )
        is not None
    )


@pytest.mark.any_build
def test_without_a_compiler_generation_falls_back_to_pytorch(tmp_path):
    """No compiler (CC names none) and an empty cache: no kernels, and generate still runs the same
    model."""
    code = (
        "import torch, attnlab; from attnlab.generate import kernels; assert not "
        "kernels.available(); "
        "m = attnlab.Transformer(attnlab.preset('nano', d_vocab=11)).eval(); "
        "print(m.generate(torch.tensor([[1, 2]]), 3, temperature=0).shape)"
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "ATTNLAB_CACHE": str(tmp_path)}
    env.pop("ATTNLAB_KERNELS", None)  # the default choice (the tests may force a build)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "torch.Size([1, 5])"


@pytest.mark.any_build
def test_the_kernel_library_is_built_once_and_cached_by_source_and_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    first = kernels.build()
    assert first is not None and first.parent == tmp_path / "kernels"
    mtime = first.stat().st_mtime_ns
    assert kernels.build() == first and first.stat().st_mtime_ns == mtime  # cached: not rebuilt
    # no temporary file left behind: the library, its self-check's verdict, the CPU probe
    names = sorted(p.name for p in first.parent.iterdir())
    assert not any(n.startswith(".") for n in names) and first.name in names
    assert first.with_suffix(".checked").read_text() == "ok"


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_an_int8_model_stays_close_to_float_and_every_path_agrees(seed, name):
    model = build(name)
    ids = torch.randint(0, SIZES["d_vocab"], (2, 10))
    with torch.no_grad():
        reference = model(ids)
        quantize(model, "int8")
        logits = model(ids)
    assert all(not isinstance(m, torch.nn.Linear) for m in model.modules())
    # int8 with one scale per row: over 300 seeds the relative RMS error was at most 0.017 (gpt2) /
    # 0.021 (llama-gqa) and the largest error 0.057 / 0.108 of the logits' std (the old bound, 0.1
    # std, failed about one seed in a hundred); rows rounded to 4 bits: 0.107-0.175 and 0.26-0.54
    error = logits - reference
    assert error.pow(2).mean().sqrt() <= 0.04 * reference.pow(2).mean().sqrt()
    assert error.abs().max() <= 0.25 * reference.std()
    kernel = generate(model, ids, 8, temperature=0)
    assert torch.equal(kernel, generate(model, ids, 8, temperature=0, use_kernels=False))
    assert torch.equal(kernel, generate(model, ids, 8, temperature=0, compile="aot_eager"))


@pytest.mark.any_build
def test_a_quantized_model_saves_and_loads_as_int8(seed, tmp_path):
    model = quantize(build("gpt2", tie_embeddings=True), "int8")
    attnlab.save(model, tmp_path / "q")
    loaded = attnlab.load(tmp_path / "q")
    assert loaded.quantization == "int8" and loaded.unembed.weight.dtype == torch.int8
    assert loaded.embed.weight.dtype == torch.float32  # the tied embedding keeps its float rows
    ids = torch.randint(0, SIZES["d_vocab"], (1, 6))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    with pytest.raises(UserError, match="quantized"):
        attnlab.save(model, tmp_path / "hf", format="hf")
    with pytest.raises(UserError, match="choose one of int8"):
        quantize(build("gpt"), "int4")


@pytest.mark.any_build
def test_the_decode_step_moves_the_weights_it_reads_into_huge_pages_and_nothing_else_changes(
    seed, tmp_path, monkeypatch
):
    # the test model is small: move it anyway
    monkeypatch.setattr(kernels.buffers, "HUGE_PAGES_FROM", 0)
    model = build("llama-gqa", tie_embeddings=True)
    ids = torch.randint(0, SIZES["d_vocab"], (2, 5))
    reference = generate(model, ids, 6, temperature=0, use_kernels=False)
    weights = [linear.weight for linear in KernelDecoder.linears_in_step_order(model)]
    before = {id(w): (w.data_ptr(), w.detach().clone()) for w in weights}
    assert torch.equal(generate(model, ids, 6, temperature=0), reference)
    addresses = [w.data_ptr() for w in weights]
    assert all(
        w.data_ptr() != before[id(w)][0] and torch.equal(w, before[id(w)][1]) for w in weights
    )
    # still tied, trainable
    assert model.unembed.weight is model.embed.weight and model.embed.weight.requires_grad
    # one after the other, as the step reads
    assert addresses[1] - addresses[0] == -(-weights[0].nbytes // 64) * 64
    assert torch.equal(generate(model, ids, 6, temperature=0), reference)
    assert [w.data_ptr() for w in weights] == addresses  # moved once
    attnlab.save(model, tmp_path / "m")
    assert torch.equal(
        generate(attnlab.load(tmp_path / "m"), ids, 6, temperature=0, use_kernels=False), reference
    )


# Which build runs: chosen at run time ------------------------------------------------------------


@pytest.mark.any_build
def test_the_cpu_probe_agrees_with_the_kernels_flags(tmp_path, monkeypatch):
    """cpu.c's CPUID + XCR0 test against Linux's /proc/cpuinfo (which drops a flag whose register
    state the kernel does not enable): the same AVX2 and AVX-512 verdicts."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    flags = next(
        set(line.split(":", 1)[1].split())
        for line in open("/proc/cpuinfo")
        if line.startswith("flags")
    )
    levels = kernels.cpu_levels()
    assert bool(levels & kernels.CpuLevel.AVX2) == ({"avx2", "fma", "f16c"} <= flags)
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    assert bool(levels & kernels.CpuLevel.AVX512) == (avx512 <= flags and "avx2" in flags)


@pytest.mark.any_build
def test_the_kernel_tests_run_under_each_build_this_cpu_can_execute_or_say_what_it_lacks():
    """kernel_builds.py: every build of this architecture (or those a kernel_builds marker names),
    only the one ATTNLAB_KERNELS forces (a test narrowed to others is skipped, saying so), none
    switched where it forces no build; a build this CPU cannot execute skips, naming the
    instructions /proc/cpuinfo does not list."""
    every = list(builds_of_this_architecture())
    assert builds_to_run((), "") == builds_to_run((), "1") == every
    assert builds_to_run(("avx512",), "") == ["avx512"]
    assert builds_to_run((), every[-1]) == [every[-1]]
    assert builds_to_run((every[0],), every[-1]) == [every[0]]
    assert builds_to_run((), "0") is None and builds_to_run((), "sse4") is None
    zen3 = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}  # (some of a Zen 3's flags)
    assert kernels.why_not_here("avx512", zen3) == (
        "this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni (the avx512 build's "
        "instructions)"
    )
    skylake = zen3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert kernels.why_not_here("avx512", skylake).startswith("this CPU lacks avx512_vnni (")
    assert kernels.why_not_here("avx2", zen3) == (
        "this CPU's operating system does not enable the registers of the avx2 build's "
        "instructions (avx2, fma, f16c: kernels.cpu_levels)"
    )
    # macOS's sysctl spells the flags without underscores
    assert kernels.why_not_here("avx512", {f.replace("_", "") for f in skylake}).startswith(
        "this CPU lacks avx512_vnni ("
    )


def machine_dependent_options(flags: list[str]) -> set[str]:
    """The options this machine's C compiler driver passes its compiler proper for `flags` that
    choose or tune for a processor ("-### ": the command lines, printed, nothing run): gcc's
    -march=, -mtune= and --param (the caches' sizes, which -mtune=native adds), clang's
    -target-cpu and -tune-cpu."""
    driver = subprocess.run(
        [
            *kernels.builds._compiler(),
            *flags,
            "-###",
            "-x",
            "c",
            "-c",
            os.devnull,
            "-o",
            os.devnull,
        ],
        capture_output=True,
        text=True,
    )
    words = driver.stderr.replace('"', " ").split()
    chosen = {w for w in words if w.startswith(("-march=", "-mtune="))}
    for option in ("-target-cpu", "-tune-cpu", "--param"):
        chosen |= {f"{a} {b}" for a, b in zip(words, words[1:]) if a == option}
    return chosen


def test_a_build_for_a_compiler_without_openmp_computes_the_same_numbers(
    kernel_build, seed, tmp_path, monkeypatch
):
    """A compiler without OpenMP's threads (Apple's clang) compiles this build with -fopenmp-simd
    in -fopenmp's place (kernels.openmp_or_not): one thread, and the same numbers bit for bit,
    decode steps and a prompt's kernels alike (gcc without it summed a float32 product's and
    RMSNorm's terms in another order)."""
    threaded, alone = kernels.openmp_or_not(kernels.VARIANTS[kernel_build][0])[:2]
    # (this process runs the threaded flags' build)
    assert kernels.chosen_variant()[1] == kernels.compile_library(kernels.SOURCE, (threaded,))
    assert "-fopenmp" not in alone
    model = build("gemma3")  # sandwich norms, GeGLU, a window, QK-norm
    ids = torch.randint(0, SIZES["d_vocab"], (2, 8))
    q, k, v = torch.randn(1, 4, 40, 32), torch.randn(1, 2, 40, 32), torch.randn(1, 2, 40, 32)
    x, w = torch.randn(40, 600), torch.randn(70, 600)

    def numbers():
        cache = KVCache.for_model(model, 2, 12)
        model(ids[:, :4], kv_cache=cache, start_pos=0)
        step = KernelDecoder(model, cache)
        logits = [step(ids[:, t : t + 1], t, torch.full((2, 1), t)).clone() for t in range(4, 8)]
        prompt = [kernels.attend_rows(q, k, v, 0.2), kernels.linear_rows(x, w, None)]
        norm = kernels.rms_norm_rows(x, w[0], 1e-5)
        return [*logits, *prompt, norm, kernels.linear(x[:3], w)]

    threads = numbers()
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    without = kernels.load(kernels.compile_library(kernels.SOURCE, (alone,)))
    monkeypatch.setattr(kernels.builds, "library", lambda: without)
    for a, b in zip(numbers(), threads, strict=True):
        assert torch.equal(a, b)


@pytest.mark.any_build
@pytest.mark.parametrize("name", ["avx512", "avx2", "portable"])
def test_an_x86_build_is_the_same_program_on_every_machine(name):
    """An x86 build names its instruction sets and nothing the compiler reads from the machine it
    compiles on (-march=native, -mtune=native): tuned for a Zen 3, gcc vectorised other loops of
    the AVX2 build, another order of summation, and SmolLM2's perplexity moved 0.52 % on that
    machine's first 512 tokens where the same build tuned on an AVX-512 machine moved it 0.05 %
    (tests/test_blocks.py, PERPLEXITY_BOUND). So the build tested anywhere is the program an AVX2
    user runs: the compiler chooses and tunes for the processor it would with no flags at all."""
    flags = kernels.VARIANTS[name][0]
    assert not [flag for flag in flags if "native" in flag], flags
    assert machine_dependent_options(flags) == machine_dependent_options([])


@pytest.mark.any_build
@pytest.mark.parametrize("name", ["avx512", "avx2", "portable"])
def test_attnlab_kernels_forces_a_build_and_it_computes_the_reference(name, tmp_path, monkeypatch):
    if name not in kernels.variants_here():
        pytest.skip(kernels.why_not_here(name))
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.setenv("ATTNLAB_KERNELS", name)
    chosen, path = kernels.choose_variant()
    assert chosen == name and path.with_suffix(".checked").read_text() == "ok"
    monkeypatch.setattr(kernels.builds, "library", lambda: kernels.load(path))
    x, w, b = torch.randn(3, 129), torch.randn(67, 129), torch.randn(67)
    torch.testing.assert_close(kernels.linear(x, w, b), F.linear(x, w, b), **product_tolerance(129))


@pytest.mark.any_build
def test_the_best_allowed_build_runs_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    assert kernels.choose_variant()[0] == kernels.variants_here()[0]
    monkeypatch.setenv("ATTNLAB_KERNELS", "0")
    assert kernels.choose_variant() is None


@pytest.mark.any_build
def test_a_build_the_machine_does_not_allow_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels.builds, "_is_x86", lambda: True)
    monkeypatch.setattr(kernels.builds, "cpu_levels", lambda: kernels.CpuLevel.AVX2)  # a Zen 3
    monkeypatch.setenv("ATTNLAB_KERNELS", "avx512")
    with pytest.raises(UserError, match="ATTNLAB_KERNELS=avx512: this CPU.*; use one of avx2, p"):
        kernels.choose_variant()
    monkeypatch.setenv("ATTNLAB_KERNELS", "sse4")
    with pytest.raises(UserError, match="ATTNLAB_KERNELS=sse4: not a build .* avx512, avx2, port"):
        kernels.choose_variant()
    monkeypatch.delenv("ATTNLAB_KERNELS")
    assert kernels.choose_variant()[0] == "avx2"


def library_whose_product_does(tmp_path, name: str, statement: str):
    """A library whose attnlab_linear_f32 (the self-check's first call) runs `statement`,
    compiled into the cache at tmp_path."""
    source = tmp_path / f"{name}.c"
    source.write_text(
        "#include <signal.h>\n#include <stdint.h>\n"
        "void attnlab_linear_f32(const float *x, const float *w, const float *b, float *y,\n"
        "    int64_t rows, int64_t d_in, int64_t d_out, int accumulate, int threads) {\n"
        f"  {statement}\n}}\n"
    )
    path = kernels.compile_library(source, (["-O1"],))
    assert path is not None
    return path


@pytest.mark.any_build
def test_a_build_that_faults_in_its_self_check_is_passed_over_and_the_process_lives(
    tmp_path, monkeypatch
):
    """The self-check runs in a child: a build whose instructions fault here kills the child only;
    the next build runs, and forcing the faulty one is one line."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    # an illegal instruction, as an instruction set the OS does not enable
    trap = library_whose_product_does(tmp_path, "trap", "__builtin_trap();")
    why = kernels.self_check(trap)
    assert why is not None and "self-check failed" in why and "exit status -" in why
    assert kernels.self_check(trap) == why  # the verdict is cached beside the library
    real = kernels.compile_library

    def compile_library(source, flag_sets, verbose=False):  # the best build faults
        return trap if flag_sets[0] == kernels.VARIANTS[best][0] else real(source, flag_sets)

    best = kernels.variants_here()[0]
    monkeypatch.setattr(kernels.builds, "compile_library", compile_library)
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    assert kernels.choose_variant()[0] == kernels.variants_here()[1]
    monkeypatch.setenv("ATTNLAB_KERNELS", best)
    with pytest.raises(UserError, match=f"ATTNLAB_KERNELS={best}: the {best} build cannot run"):
        kernels.choose_variant()


@pytest.mark.any_build
def test_a_self_check_killed_from_outside_is_not_cached(tmp_path, monkeypatch):
    """A child killed from outside says nothing about the build: the build is passed over this
    time, and the next process checks it again (no verdict file)."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    # as the out-of-memory killer would, from outside
    killed = library_whose_product_does(tmp_path, "killed", "raise(SIGKILL);")
    why = kernels.self_check(killed)
    assert why is not None and "exit status -9" in why
    assert not killed.with_suffix(".checked").exists()


@pytest.mark.any_build
def test_use_variant_switches_the_build_a_benchmark_runs():
    """benchmarks/blocks_speed.py's AVX2 columns: the same process runs the AVX2 build, then the
    default choice again (the best this machine allows, whatever ATTNLAB_KERNELS forced); the
    build forced or chosen before is restored after, as kernel_builds.py does."""
    if "avx2" not in kernels.variants_here():
        pytest.skip(kernels.why_not_here("avx2"))
    before, forced = kernels.variant(), os.environ.get("ATTNLAB_KERNELS")
    try:
        kernels.use_variant("avx2")
        assert kernels.variant() == "avx2"
        assert kernels.library()._name == str(kernels.chosen_variant()[1])
        x, w = torch.randn(2, 96), torch.randn(5, 96)
        torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), **product_tolerance(96))
        kernels.use_variant(None)
        assert "ATTNLAB_KERNELS" not in os.environ
        assert kernels.variant() == kernels.variants_here()[0]
    finally:
        kernels.use_variant(forced)
    assert kernels.variant() == before and os.environ.get("ATTNLAB_KERNELS") == forced
