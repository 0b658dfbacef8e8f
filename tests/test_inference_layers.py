"""Forward passes without gradients in C (attnlab.generate.fast_layers.inference_layers, which
run_with_cache and the other callers that want it enter; `forward` below): the model's Linear and
Attention modules swapped for the kernels' ones for a pass over many float32 rows on the CPU, each
against the module path it stands in for, and the swap decided before the pass as on the residual
stream it runs on.

Tolerances, derived: a float32 dot product of n terms summed in another order differs from the
exact sum by at most about n · 2⁻²⁴ · Σ|xᵢwᵢ| (Higham's γₙ bound), so each product is checked
against float64 within 1e-5 · (|x| |W|ᵀ) (n ≤ 600 here: n · 6e-8 ≤ 3.6e-5 in the worst case, ~√n
times less in practice). Whole models stack a few such products: their logits and every cached
activation are compared with the module path's float32 numbers within 1e-4 of each tensor's
largest value, and with a float64 copy of the model.

Each test runs under every build of the kernels this CPU can execute (tests/kernel_builds.py) and
checks what that build does: the AVX-512 and AVX2 builds swap the layers and multiply on their
float32 tiles; the portable build has no vectorised float32 tiles, so forward passes keep torch's
path (the module path itself) and say why (`inference_kernels_unusable`).
"""

from __future__ import annotations

import contextlib
import types

import pytest
import styles
import torch
import torch.nn.functional as F
from torch import nn

import attnlab
from attnlab import slower
from attnlab.errors import UserError
from attnlab.generate import fast_layers, kernels
from attnlab.generate.fast_layers import (
    TILES_MIN_MACS,
    TILES_MIN_ROWS,
    KernelAttention,
    KernelLinear,
    inference_kernels_unusable,
)
from attnlab.model.config import ModelConfig
from attnlab.model.layers import Linear
from attnlab.quant.int8 import Int8Linear
from attnlab.quant.quantize import store_weights_as

# every test here runs once per build this CPU can execute (kernel_builds.py), but any_build's
pytestmark = pytest.mark.usefixtures("kernel_build")


@pytest.fixture(autouse=True, scope="module")
def built_kernels():
    """The kernels must build here (as tests/test_kernels.py requires)."""
    if not kernels.available():
        pytest.fail("attnlab's C kernels could not be built here (no C compiler)", pytrace=False)


def tiles_here() -> bool:
    """Whether this build's float32 tiles are vectorised (AVX-512, AVX2), and so forward passes
    without gradients take the kernels' layers; where they are not, torch's path runs and says
    why."""
    tiles = kernels.rows_vectorized()[1]
    no_tiles = f"the {kernels.variant()} build of the kernels has no vectorised float32 tiles"
    assert inference_kernels_unusable() == (None if tiles else no_tiles)
    return tiles


def check_product(x, w, bias, out) -> None:
    """out against x Wᵀ + b in float64: float32 summation slack only (the module docstring)."""
    reference = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    slack = 1e-5 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((out.double() - reference).abs() <= slack).all()


def counting(monkeypatch, name: str) -> list:
    """Count the calls of kernels.`name` (still computing them)."""
    calls, original = [], getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("d_in, d_out", [(129, 67), (576, 192), (64, 1000)])
@pytest.mark.parametrize("bias", [True, False])
def test_kernel_linear_takes_the_tiles_from_enough_rows_and_agrees_with_f_linear(
    seed, d_in, d_out, bias, monkeypatch
):
    tiles = counting(monkeypatch, "linear_rows")
    layer = KernelLinear(d_in, d_out, bias=bias)
    with torch.no_grad():
        layer.weight.normal_()
        for rows in (1, 9, TILES_MIN_ROWS - 1, TILES_MIN_ROWS, 203):
            x = torch.randn(rows, d_in) * 2
            before = len(tiles)
            out = layer(x)
            check_product(x, layer.weight, layer.bias, out)
            tiled = rows >= TILES_MIN_ROWS and rows * d_in * d_out >= TILES_MIN_MACS
            assert len(tiles) - before == (1 if tiled and tiles_here() else 0), rows
            if not few_or_tiled(rows, d_in, d_out):  # F.linear itself
                assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
        # a batch of sequences: rows are every leading dimension
        x = torch.randn(3, 50, d_in)
        check_product(x.reshape(-1, d_in), layer.weight, layer.bias, layer(x).reshape(-1, d_out))
    # gradients wanted: torch's product, whose backward exists
    x = torch.randn(TILES_MIN_ROWS, d_in, requires_grad=True)
    before = len(tiles)
    layer(x).sum().backward()
    assert len(tiles) == before and x.grad is not None


def few_or_tiled(rows: int, d_in: int, d_out: int) -> bool:
    return rows <= fast_layers.MATVEC_MAX_ROWS or (
        tiles_here() and rows >= TILES_MIN_ROWS and rows * d_in * d_out >= TILES_MIN_MACS
    )


BASE = dict(d_vocab=97, n_ctx=128, d_model=128, n_layers=2, n_heads=4, d_mlp=192)  # d_head 32
# the styles of tests/styles.py whose fast layers are checked here, with what they take at BASE
CONFIGS = {
    "gpt2": {},
    # SmolLM2's shape: grouped key/value heads, RMSNorm, SwiGLU, RoPE, no biases, d_head 32
    "llama-gqa": dict(n_heads=2, n_kv_heads=1, tie_embeddings=True),
    "qwen-qkv-bias-window": {},
}


def build(name: str) -> attnlab.Transformer:
    return styles.build(name, **{**BASE, **CONFIGS[name]})


def forward(model, ids, **kwargs):
    """model(ids) as the code that wants the kernels runs it: within inference_layers."""
    with fast_layers.inference_layers(model, ids, kwargs.get("start_at_layer")):
        return model(ids, **kwargs)


def module_path(monkeypatch) -> None:
    """From now on forward passes keep the model's own modules (the reference path)."""
    monkeypatch.setattr(
        fast_layers, "inference_layers", lambda model, *a, **k: contextlib.nullcontext(model)
    )


def tiled_linears(model: nn.Module, ids: torch.Tensor) -> int:
    """How many Linear modules of `model` a pass over `ids` multiplies on tiles (TILES_MIN_MACS)."""
    rows = ids.numel()
    return sum(
        isinstance(m, Linear) and rows * m.in_features * m.out_features >= TILES_MIN_MACS
        for m in model.modules()
    )


def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    scale = b.abs().max().item() if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * max(scale, 1e-3), msg=what)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_forward_without_gradients_takes_the_kernels_and_gives_the_module_paths_numbers(
    seed, name, monkeypatch
):
    model = build(name)
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))  # 128 rows
    tiles = counting(monkeypatch, "linear_rows")
    with torch.no_grad():
        fast = forward(model, ids)
        fast_cache = model.run_with_cache(ids)[1]
        # every Linear of the blocks and the LM head large enough for the tiles, in both runs
        linears = tiled_linears(model, ids)
        assert linears >= 5 and len(tiles) == (2 * linears if tiles_here() else 0)
        # and back: the model's own classes after the pass
        assert not any(isinstance(m, (KernelLinear, KernelAttention)) for m in model.modules())
    like_the_module_path(model, ids, fast, fast_cache, monkeypatch)


def like_the_module_path(model, ids, fast, fast_cache, monkeypatch) -> None:
    """`fast` logits and `fast_cache` of `model` on `ids` against the module path's and a float64
    copy's, within the module docstring's tolerance (the module path stays on afterwards)."""
    with torch.no_grad():
        exact = model.double()(ids)
        model.float()
        module_path(monkeypatch)
        reference = model(ids)
        reference_cache = model.run_with_cache(ids)[1]
    close(fast, reference, "logits")
    close(fast.double(), exact, "logits against float64")
    assert list(fast_cache.keys()) == list(reference_cache.keys())
    for key in reference_cache.keys():
        assert fast_cache[key].shape == reference_cache[key].shape, key
        close(fast_cache[key], reference_cache[key], key)


def test_a_hook_that_edits_changes_the_kernel_path_as_the_module_path(seed, monkeypatch):
    """Hooks see the same activations, and what they replace flows on in both paths."""
    model = build("llama-gqa")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))

    def zero_head_0(z, hook):
        z = z.clone()
        z[:, :, 0] = 0
        return z

    def edited():
        return model.run_with_hooks(ids, fwd_hooks=[("blocks.0.attn.hook_z", zero_head_0)])

    with torch.no_grad():
        fast, plain = edited(), model(ids)
        module_path(monkeypatch)
        reference = edited()
    close(fast, reference, "edited logits")
    assert (fast - plain).abs().max() > 1e-3  # the edit did change something


def _double(t, hook):
    return t * 2


def _double_in_place(t, hook):
    return t.mul_(2)


@pytest.mark.parametrize(
    "name, hook",
    [
        ("ln1.hook_scale", _double),
        ("ln1.hook_scale", _double_in_place),
        ("ln2.hook_normalized", _double),
        ("ln2.hook_normalized", _double_in_place),
    ],
)
def test_a_hook_that_edits_a_norms_parts_changes_the_kernel_path_as_the_module_path(
    seed, monkeypatch, name, hook
):
    """KernelRMSNorm computes the scale and normalized input its hooks read in C (where this build
    swaps the layers: tiles_here); a hook that replaces either, or edits it in place, gets
    RMSNorm's steps after it (`_hooked_norm`: a replaced part flows on into the output; an edit in
    place reaches the hooks after it, not the output, in both paths)."""
    model = build("llama-gqa")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    norms = counting(monkeypatch, "rms_norm_parts_rows")

    def edited():
        return model.run_with_cache(ids, fwd_hooks=[(f"blocks.1.{name}", hook)])

    with torch.no_grad():
        fast, fast_cache = edited()
        # every norm, the final one too
        assert len(norms) == (2 * BASE["n_layers"] + 1 if tiles_here() else 0)
        plain = model(ids)
        module_path(monkeypatch)
        reference, reference_cache = edited()
    close(fast, reference, "edited logits")
    for key in reference_cache.keys():
        close(fast_cache[key], reference_cache[key], key)
    if hook is _double:  # a replaced part flows on; one edited in place is what later hooks see
        assert (fast - plain).abs().max() > 1e-3


def counting_swaps(monkeypatch) -> list:
    """Count the times fast_layers.swapped swaps a model's Linear modules."""
    swapped, original = [], fast_layers.swapped

    def spy(roots, fast):
        if Linear in fast:
            swapped.append(1)
        return original(roots, fast)

    monkeypatch.setattr(fast_layers, "swapped", spy)
    return swapped


@pytest.mark.any_build
def test_training_keeps_torchs_path_and_its_gradients(seed, monkeypatch):
    """With gradients on, the modules are never swapped (and each swapped one would check again:
    kernels.usable)."""
    model = build("llama-gqa").train()
    tiles = counting(monkeypatch, "linear_rows")
    prompt = counting(monkeypatch, "attend_rows")
    swapped = counting_swaps(monkeypatch)
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    model.loss(ids[:, :-1], ids[:, 1:]).backward()
    assert tiles == [] and prompt == [] and swapped == []
    assert all(p.grad is not None for p in model.parameters())


def test_few_rows_keep_the_models_own_modules(seed, monkeypatch):
    """Below TILES_MIN_ROWS rows the swap would not pay: the modules stay as they are."""
    model = build("llama-gqa")
    swapped = counting_swaps(monkeypatch)
    with torch.no_grad():
        forward(model, torch.randint(0, BASE["d_vocab"], (1, TILES_MIN_ROWS - 1)))
        assert swapped == []
        forward(model, torch.randint(0, BASE["d_vocab"], (1, TILES_MIN_ROWS)))
        assert swapped == ([1] if tiles_here() else [])


def test_a_quantized_model_keeps_its_block_layers_module_path(seed, monkeypatch):
    """Block layers are not swapped outside generation: their prompt product rounds activations
    to 8 bits, which a forward pass of the model does not (attention still takes the kernel)."""
    model = build("llama-gqa")
    attnlab.quantize(model, "q8_0")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    blocks = counting(monkeypatch, "block_linear_rows")
    with torch.no_grad():
        fast = forward(model, ids)
        module_path(monkeypatch)
        reference = model(ids)
    assert blocks == []
    close(fast, reference, "q8_0 logits")


@pytest.mark.any_build
def test_without_vectorised_tiles_torchs_path_runs_and_says_why(seed, monkeypatch, tmp_path):
    """A portable build keeps torch's products, and says so in one line, once (attnlab.slower)."""
    for where in (kernels, kernels.policy):  # generation's layers, and float_rows
        monkeypatch.setattr(where, "rows_vectorized", lambda: (False, False))
    monkeypatch.setattr(kernels, "variant", lambda: "portable")
    monkeypatch.setattr(slower, "_said", set())
    tiles = counting(monkeypatch, "linear_rows")
    model = build("llama-gqa")
    with torch.no_grad(), pytest.warns(slower.SlowerPath) as said:
        for _ in range(2):
            model.run_with_cache(torch.randint(0, BASE["d_vocab"], (2, 64)))
    assert tiles == []
    assert inference_kernels_unusable() == (
        "the portable build of the kernels has no vectorised float32 tiles"
    )
    assert [str(w.message) for w in said] == [
        "run_with_cache and other hooked forward passes run torch's modules, not attnlab's C "
        "kernels: the portable build of the kernels has no vectorised float32 tiles"
    ]


@pytest.mark.parametrize("tiles_win, attention_wins", [(True, True), (False, True), (True, False)])
def test_float_prompts_take_whichever_measured_faster_here(
    seed, monkeypatch, tiles_win, attention_wins
):
    """Unforced, without AMX (tests/test_amx.py), the float32 tiles run where they beat torch's
    GEMM in the one-off timing (kernels.float_rows: MKL's AVX-512 path runs on Intel CPUs only;
    MKL's AVX2 GEMM against AVX2's tiles); otherwise torch's products, and the forward pass says
    why. run_with_cache's attention steps take C where they beat torch's in their own timing
    (kernels.attention_rows), whichever product won. ATTNLAB_FLOAT_ROWS forces both; anything
    else is one line. A build without vectorised float32 tiles keeps torch's products whatever
    the timing or ATTNLAB_FLOAT_ROWS says (tiles_here says why)."""
    monkeypatch.delenv("ATTNLAB_FLOAT_ROWS")
    monkeypatch.setattr(kernels.policy, "amx_unusable", lambda: "no AMX (this test's premise)")
    monkeypatch.setattr(kernels.policy, "_tiles_beat_torch", lambda build, threads: tiles_win)
    monkeypatch.setattr(
        kernels.policy, "_attention_beats_torch", lambda build, threads: attention_wins
    )
    tiles = counting(monkeypatch, "linear_rows")
    fused = counting(monkeypatch, "attend_explicit")
    model = build("llama-gqa")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    with torch.no_grad():
        forward(model, ids)
        products = len(tiles)
        model.run_with_cache(ids)
    assert bool(products) == (tiles_here() and tiles_win)
    assert len(fused) == (BASE["n_layers"] if tiles_here() and attention_wins else 0)
    # the layers are swapped either way where the build has the tiles (RoPE, RMSNorm and SwiGLU in
    # C; torch's products and attention where they measured faster, in the fewest tensors: the
    # test below)
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "torch" if tiles_win else "c")
    assert kernels.float_rows() == kernels.attention_rows() == (tiles_here() and not tiles_win)
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "mkl")
    for choice in (kernels.float_rows, kernels.attention_rows, kernels.float_products):
        with pytest.raises(UserError, match="ATTNLAB_FLOAT_ROWS=mkl: it takes amx, c or torch"):
            choice()


@pytest.mark.any_build
def test_the_one_off_timing_compares_the_tiles_with_torchs_gemm(monkeypatch, tmp_path):
    """_tiles_beat_torch times both on the same product and picks the faster: made slow on
    purpose, each side loses (each in a cache of its own: the answer is kept per machine). The
    clock it reads moves a millisecond a reading and a second a call in the side made slow, so
    that the verdict does not depend on how fast this build's tiles or this machine are (a
    portable build's plain loops took longer than a real sleep made torch's product)."""
    from attnlab import machine

    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-3
        return clock[0]

    monkeypatch.setattr(kernels.policy, "time", types.SimpleNamespace(perf_counter=perf_counter))

    def slow(product):
        def call(*args):
            clock[0] += 1.0
            return product(*args)

        return call

    rows, linear = kernels.linear_rows, torch.nn.functional.linear
    for slowed, expected in (("c", False), ("torch", True)):
        monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / slowed))
        monkeypatch.setattr(kernels.policy, "linear_rows", slow(rows) if slowed == "c" else rows)
        monkeypatch.setattr(
            torch.nn.functional, "linear", slow(linear) if slowed == "torch" else linear
        )
        state = torch.get_rng_state()  # a forward pass's first ask: its caller's seed untouched
        assert kernels.policy._tiles_beat_torch("test", 1) is expected
        assert torch.equal(torch.get_rng_state(), state)
        machine.forget()  # as a new process: the answer from its file, the timing not run again
        monkeypatch.setattr(kernels.policy, "linear_rows", None)
        assert kernels.policy._tiles_beat_torch("test", 1) is expected


@pytest.mark.any_build
def test_the_one_off_timing_compares_the_c_attention_with_torchs_steps(monkeypatch, tmp_path):
    """_attention_beats_torch times the C attention steps and torch's on the same heads and picks
    the faster, as _tiles_beat_torch does (the test above): made slow on purpose, each side
    loses, and the answer is kept per machine."""
    from attnlab import machine

    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-3
        return clock[0]

    monkeypatch.setattr(kernels.policy, "time", types.SimpleNamespace(perf_counter=perf_counter))

    def slow(step):
        def call(*args, **kwargs):
            clock[0] += 1.0
            return step(*args, **kwargs)

        return call

    fused, softmax = kernels.attend_explicit, torch.softmax
    for slowed, expected in (("c", False), ("torch", True)):
        monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path / slowed))
        monkeypatch.setattr(
            kernels.policy, "attend_explicit", slow(fused) if slowed == "c" else fused
        )
        monkeypatch.setattr(torch, "softmax", slow(softmax) if slowed == "torch" else softmax)
        state = torch.get_rng_state()
        assert kernels.policy._attention_beats_torch("test", 1) is expected
        assert torch.equal(torch.get_rng_state(), state)
        machine.forget()  # as a new process: the answer from its file, the timing not run again
        monkeypatch.setattr(kernels.policy, "attend_explicit", None)
        assert kernels.policy._attention_beats_torch("test", 1) is expected


# run_with_cache's attention: the explicit path's three steps in C --------------------------------


# (batch, T, heads, kv_heads, d_head): T not a multiple of the kernels' 12 queries or 32 keys,
# grouped and plain heads; the scores take any d_head, the product with V multiples of 32
ATTENTION_SHAPES = ((1, 1, 2, 1, 32), (2, 37, 4, 2, 32), (1, 70, 6, 3, 64), (2, 13, 3, 3, 96))


@pytest.mark.parametrize("softcap", [None, 2.0])  # Gemma 2's, low enough to bend these scores
def test_the_attention_steps_equal_the_chapters_equation(softcap):
    """Scores: masked where the chapter's mask is (exactly −∞), q·k · scale elsewhere (soft-capped
    where a cap is given); pattern: exactly 0 where masked, rows summing to 1; z = pattern V;
    against float64, within float32 summation slack (the module docstring's bound, ≤ 1e-5 of the
    terms' magnitudes here)."""
    from attnlab.model.attention import apply_mask, attention_pattern, attention_scores, expand_kv

    g = torch.Generator().manual_seed(0)
    for B, T, H, Hkv, D in (*ATTENTION_SHAPES, (1, 33, 2, 1, 20)):
        q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # [batch, head, pos, d_head]
        k, v = (torch.randn(B, T, Hkv, D, generator=g).transpose(1, 2) * 2 for _ in range(2))
        scores = apply_mask(
            attention_scores(q.double(), expand_kv(q, k).double(), 0.2, softcap), causal=True
        )
        pattern = attention_pattern(scores)
        got_scores = kernels.attend_scores(q, k, 0.2, softcap=softcap)
        masked = torch.isneginf(scores)
        assert torch.equal(torch.isneginf(got_scores), masked)
        torch.testing.assert_close(
            got_scores.double().masked_fill(masked, 0), scores.masked_fill(masked, 0), **SLACK
        )
        got_pattern = kernels.softmax_rows(got_scores)
        assert (got_pattern[masked] == 0).all()
        torch.testing.assert_close(got_pattern.double(), pattern, **SLACK)
        if D % 32 == 0:
            z = kernels.attend_mix(got_pattern, v)
            assert z.shape == (B, H, T, D) and z.transpose(1, 2).is_contiguous()
            expected = torch.matmul(pattern, expand_kv(q, v).double())
            torch.testing.assert_close(z.double(), expected, **SLACK)


SLACK = dict(rtol=1e-5, atol=1e-5)


def test_the_softmax_of_a_row_without_a_visible_key_is_zeros_and_a_pattern_of_any_weights_mixes():
    """A hook may mask a whole row or put weight on any key: the C steps follow the equation."""
    from attnlab.model.attention import attention_pattern

    scores = torch.randn(2, 3, 5, 40)
    scores[0, 1, 2] = float("-inf")
    scores[1, 0, :, 7] = float("-inf")
    pattern = kernels.softmax_rows(scores)
    assert (pattern[0, 1, 2] == 0).all()
    torch.testing.assert_close(pattern, attention_pattern(scores), **SLACK)
    weights, v = torch.rand(2, 3, 5, 40), torch.randn(2, 1, 40, 64)  # every key weighted
    torch.testing.assert_close(
        kernels.attend_mix(weights, v), torch.matmul(weights, v.expand(2, 3, 40, 64)), **SLACK
    )


def test_a_rows_weights_do_not_depend_on_the_masked_keys_after_it():
    """The C kernels' softmax_row sums in 16 fixed lanes and skips the trailing blocks of 16 masked
    scores: a causal row's weights are the same bits whatever number of masked keys follow it
    (the fused attention's pattern relies on it), and each masked key weighs exactly 0."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(10, 70, generator=g) * 4
    visible = [1, 15, 16, 17, 31, 32, 33, 48, 69, 70]
    for row, n in enumerate(visible):
        scores[row, n:] = float("-inf")
    pattern = kernels.softmax_rows(scores)
    for row, n in enumerate(visible):
        assert torch.equal(pattern[row, :n], kernels.softmax_rows(scores[row, :n].clone()))
        assert (pattern[row, n:] == 0).all()
    torch.testing.assert_close(pattern, torch.softmax(scores, -1), **SLACK)
    # a hook may mask any keys: a block of 16 is skipped only where all of it is masked
    scores[0] = scores[1] = float("-inf")
    scores[0, 47] = 1.0
    scores[1, [3, 40]] = 2.0
    pattern = kernels.softmax_rows(scores[:2])
    torch.testing.assert_close(pattern, torch.softmax(scores[:2], -1), **SLACK)


def test_the_attention_steps_on_two_threads_equal_one(monkeypatch):
    q, k, v = torch.randn(2, 4, 50, 64), torch.randn(2, 2, 50, 64), torch.randn(2, 2, 50, 64)

    def steps():
        scores = kernels.attend_scores(q, k, 0.125)
        pattern = kernels.softmax_rows(scores)
        return scores, pattern, kernels.attend_mix(pattern, v)

    one = steps()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for a, b in zip(steps(), one, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "batch, T, heads, kv_heads, d_head",
    # T not a multiple of the 6 or 12 queries of a register block, nor of 32 keys
    [(1, 1, 2, 1, 32), (2, 37, 4, 2, 32), (1, 70, 6, 3, 64), (2, 13, 3, 3, 96)],
)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_the_three_attention_steps_in_one_call_on_the_tiles_are_the_steps_bit_for_bit(
    seed, batch, T, heads, kv_heads, d_head, threads, softcap, monkeypatch
):
    """attend_explicit on the float32 tiles (run_with_cache's attention where its hooks only read:
    a block of queries' scores and pattern read back from the core's cache, the zeros after its
    last query not multiplied) gives attend_scores', softmax_rows' and attend_mix's results
    exactly."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, T, d_head, generator=g)
    k, v = (torch.randn(batch, kv_heads, T, d_head, generator=g) * 2 for _ in range(2))
    scores, pattern, z = kernels.attend_explicit(q, k, v, d_head**-0.5, softcap=softcap)
    assert z.shape == (batch, heads, T, d_head)
    assert torch.equal(scores, kernels.attend_scores(q, k, d_head**-0.5, softcap=softcap))
    assert torch.equal(pattern, kernels.softmax_rows(scores))
    assert torch.equal(z, kernels.attend_mix(pattern, v))


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_run_with_cache_takes_the_attention_in_one_call_in_every_block(seed, name, monkeypatch):
    """Its hooks only read: one attend_explicit a block where this build has the tiles; a hook
    that may edit the pattern keeps the three steps apart, in every block."""
    model = build(name)
    fused = counting(monkeypatch, "attend_explicit")
    calls = {step: counting(monkeypatch, step) for step in ATTENTION_STEPS}
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    with torch.no_grad():
        model.run_with_cache(ids)
        expected = model.config.n_layers if tiles_here() else 0
        assert len(fused) == expected and all(c == [] for c in calls.values())
        editing = [(f"blocks.{i}.attn.hook_pattern", lambda pattern, hook: pattern)
                   for i in range(model.config.n_layers)]  # fmt: skip
        model.run_with_cache(ids, fwd_hooks=editing)
    assert len(fused) == expected
    assert {step: len(c) for step, c in calls.items()} == dict.fromkeys(ATTENTION_STEPS, expected)


ATTENTION_STEPS = ("attend_scores", "softmax_rows", "attend_mix")


def edit_in_place(scores, hook):
    scores[:, :, :, 0] += 3.0  # every query sees key 0


def unmask_the_future(scores, hook):
    return torch.where(torch.isneginf(scores), 0.0, scores)  # the queries see every key


def uniform(pattern, hook):
    return torch.full_like(pattern, 1 / pattern.shape[-1])


EDITING_HOOKS = [
    ("blocks.0.attn.hook_attn_scores", edit_in_place),
    ("blocks.1.attn.hook_attn_scores", unmask_the_future),
    ("blocks.0.attn.hook_pattern", uniform),
]


def edited_both_ways(hooks, run: str, monkeypatch):
    """SmolLM2-shaped model's logits without hooks, then `run` ("run_with_hooks" or
    "run_with_cache") with each hook alone, on the swapped layers and on the module path."""
    model = build("llama-gqa")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    with torch.no_grad():
        plain = model(ids)
        edited = [getattr(model, run)(ids, fwd_hooks=[hook]) for hook in hooks]
        module_path(monkeypatch)
        reference = [getattr(model, run)(ids, fwd_hooks=[hook]) for hook in hooks]
    return plain, edited, reference


def test_hooks_that_edit_scores_and_patterns_change_both_paths_alike(seed, monkeypatch):
    """A hook that edits the scores in place, one that replaces them and one that replaces the
    pattern: each flows on through the steps after it, in C as in the module path."""
    plain, edited, reference = edited_both_ways(EDITING_HOOKS, "run_with_hooks", monkeypatch)
    for fast, slow, (where, _) in zip(edited, reference, EDITING_HOOKS, strict=True):
        close(fast, slow, where)
        assert (fast - plain).abs().max() > 1e-3, where


def torchs_products(monkeypatch) -> None:
    """As where torch's GEMM measured faster than the tiles (kernels.float_rows: the Intel Xeon of
    2026-12-02) and torch's attention faster than the C steps (kernels.attention_rows): the
    swapped layers keep torch's products and attention."""
    for where in (kernels, kernels.policy):  # generation's layers, and float_products
        monkeypatch.setattr(where, "float_rows", lambda: False)
        monkeypatch.setattr(where, "attention_rows", lambda: False)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_where_torch_multiplies_run_with_cache_equals_the_module_path_bit_for_bit(
    seed, name, monkeypatch
):
    """With torch's products, the swapped layers' attention (scores scaled and masked in place, the
    softmax without its all-masked guard where no row needs it) and MLP (act(gate) · up in place)
    change no number of run_with_cache: logits and every cached activation equal the module
    path's, bit for bit, and no attention step runs in C (where this build has no tiles, the
    layers are not swapped: the module path itself)."""
    torchs_products(monkeypatch)
    model = build(name)
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    calls = {step: counting(monkeypatch, step) for step in ATTENTION_STEPS}
    swapped = counting_swaps(monkeypatch)
    with torch.no_grad():
        fast, fast_cache = model.run_with_cache(ids)
        module_path(monkeypatch)
        reference, reference_cache = model.run_with_cache(ids)
    assert swapped == ([1] if tiles_here() else []) and all(c == [] for c in calls.values())
    assert torch.equal(fast, reference)
    assert list(fast_cache.keys()) == list(reference_cache.keys())
    for key in reference_cache.keys():
        assert torch.equal(fast_cache[key], reference_cache[key]), key


def test_where_torch_multiplies_hooks_that_edit_scores_and_patterns_flow_on(seed, monkeypatch):
    """The in-place attention under hooks that edit: the scores edited in place, unmasked, a row
    left with no visible key (its pattern is zeros, as the module path makes it) and a pattern
    replaced; each equals the module path's logits bit for bit and changes them."""
    torchs_products(monkeypatch)

    def hide_every_key_of_query_5(scores, hook):
        scores[:, :, 5, :] = float("-inf")

    hooks = [*EDITING_HOOKS, ("blocks.0.attn.hook_attn_scores", hide_every_key_of_query_5)]
    plain, edited, reference = edited_both_ways(hooks, "run_with_cache", monkeypatch)
    for (fast, cache), (slow, slow_cache), (where, _) in zip(edited, reference, hooks, strict=True):
        assert torch.equal(fast, slow), where
        assert torch.equal(
            cache["blocks.0.attn.hook_pattern"], slow_cache["blocks.0.attn.hook_pattern"]
        )
        assert (fast - plain).abs().max() > 1e-3, where
    hidden = edited[-1][1]["blocks.0.attn.hook_pattern"][:, :, 5]
    assert torch.equal(hidden, torch.zeros_like(hidden))


# the decision, made before the pass -------------------------------------------------------------


def _block_embedding(model):
    """`model` with its token embedding kept as Q8_0 blocks (as a GGUF file's may be)."""
    from attnlab.quant.blocks import BlockEmbedding, quantize_blocks

    weight = model.embed.weight
    model.embed = BlockEmbedding(quantize_blocks(weight, "q8_0"), "q8_0", weight.shape[1])
    return model


def _learned(dtype):
    """A GPT-2-style model (learned positions, token types) whose position table is `dtype`."""
    model = attnlab.Transformer(ModelConfig(**BASE, n_token_types=2)).eval()
    model.pos_embed.to(dtype)
    return model


@pytest.mark.any_build
@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: build("llama-gqa"), (2, 64)),
        (lambda: build("llama-gqa"), (1, TILES_MIN_ROWS - 1)),
        (lambda: build("llama-gqa"), (96,)),  # one sequence without its batch axis
        (lambda: _block_embedding(build("llama-gqa")), (2, 64)),
        (lambda: store_weights_as(build("llama-gqa"), torch.bfloat16), (2, 64)),
        (lambda: build("gpt2").half(), (2, 64)),
        (lambda: build("gpt2").to(torch.bfloat16), (2, 64)),
        (lambda: _learned(torch.float64), (2, 64)),
        (lambda: _learned(torch.float32), (2, 64)),
    ],
    ids=[
        "float32",
        "few rows",
        "no batch axis",
        "block embedding",
        "bfloat16 weights",
        "float16",
        "bfloat16",
        "float64 positions",
        "learned positions",
    ],
)
def test_the_decision_before_the_pass_is_the_one_on_its_residual_stream(make, shape):
    """inference_layers decides from (rows, dtype, device) of the residual stream the blocks will
    run on, known before the pass (`residual_stream`): the same as read off that stream after the
    embeddings, for ids and for a residual stream given with start_at_layer."""
    model = make()
    ids = torch.randint(0, BASE["d_vocab"], shape)
    batched = ids if ids.dim() == 2 else ids[None]
    positions = torch.arange(batched.shape[1]).expand(*batched.shape)
    with torch.no_grad():
        resid = model.embed_tokens(batched, positions, None)  # [batch, pos, d_model]
    seen = (resid.shape[:-1].numel(), resid.dtype, resid.device)
    assert fast_layers.residual_stream(model, ids) == seen
    assert fast_layers.residual_stream(model, resid, start_at_layer=1) == seen
    # and so the swap: the blocks' Linear modules are the kernels' exactly where it says
    expected = fast_layers.many_rows(*seen) and inference_kernels_unusable() is None
    with torch.no_grad(), fast_layers.inference_layers(model, ids):
        assert isinstance(model.blocks[0].attn.W_Q, KernelLinear) == expected
        assert not isinstance(model.embed, KernelLinear)
    assert type(model.blocks[0].attn.W_Q) is Linear


@pytest.mark.any_build
def test_with_gradients_or_a_plain_call_the_model_runs_its_own_modules(seed, monkeypatch):
    """The model's forward enters no fast layer by itself: a pass without gradients that does not
    enter inference_layers is the module path, bit for bit; and with gradients on, entering it
    changes nothing."""
    model = build("llama-gqa")
    ids = torch.randint(0, BASE["d_vocab"], (2, 64))
    swapped = counting_swaps(monkeypatch)
    tiles = counting(monkeypatch, "linear_rows")
    with torch.no_grad():
        plain = model(ids)
    assert swapped == [] and tiles == []
    with fast_layers.inference_layers(model, ids):
        assert type(model.blocks[0].attn.W_Q) is Linear
        with_grad = model(ids)
    assert swapped == [] and torch.equal(plain, with_grad.detach())


def test_int8_weights_take_their_c_product_in_any_pass_without_gradients(seed, monkeypatch):
    """Int8Linear is its equation; within inference_layers, whatever the rows, its modules are
    KernelInt8Linear, whose few rows multiply in C (the numbers generation's decode step gets)."""
    model = attnlab.quantize(build("llama-gqa"), "int8")
    calls = counting(monkeypatch, "linear")
    ids = torch.randint(0, BASE["d_vocab"], (1, fast_layers.MATVEC_MAX_ROWS))
    with torch.no_grad():
        plain = model(ids)
        assert calls == []
        fast = forward(model, ids)
    assert len(calls) == len([m for m in model.modules() if isinstance(m, Int8Linear)])
    close(fast, plain, "int8 logits")
    assert all(type(m) is Int8Linear for m in model.modules() if isinstance(m, Int8Linear))
