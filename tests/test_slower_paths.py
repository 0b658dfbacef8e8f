"""Every slower path than the usual one says so in one line, once per reason per process
(attnlab.slower): generation's module path, forward passes on torch's modules, kernels passed
over, built without OpenMP or not built at all (no compiler), a hook that keeps fused steps
apart; and the usual paths say nothing.

Each test starts with nothing said (`fresh`), and reads the lines as warnings of the SlowerPath
category; the command line's, as its `attnlab COMMAND: warning: ...` lines on stderr; a process
without a compiler, on its stderr.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import warnings

import pytest
import torch
from styles import fields

import attnlab
from attnlab import slower
from attnlab.cli import main
from attnlab.generate import kernels
from attnlab.generate.fast_layers import inference_kernels_unusable
from attnlab.generate.kernel_decoder import KernelDecoder
from attnlab.generate.loop import generate
from attnlab.lens.hooks import reads
from attnlab.model.config import ModelConfig
from attnlab.quant.quantize import store_weights_as
from attnlab.tokenizer import Tokenizer

BASE = dict(d_vocab=29, n_ctx=96, d_model=32, n_layers=2, n_heads=4, d_mlp=48)
LLAMA = fields("llama-gqa", tie_embeddings=True)
MODULE_PATH = (
    "generation runs the model's modules at every new token, not attnlab's C decode step: "
)
FORWARD = (
    "run_with_cache and other hooked forward passes run torch's modules, not attnlab's C kernels: "
)
NO_KERNELS = "generation and forward passes run on torch's paths, not attnlab's C kernels: "


def build(**overrides) -> attnlab.Transformer:
    torch.manual_seed(0)
    return attnlab.Transformer(ModelConfig(**{**BASE, **overrides})).eval()


@pytest.fixture
def fresh(monkeypatch):
    """Nothing said yet in this process (as in a new one)."""
    monkeypatch.setattr(slower, "_said", set())


class Said:
    """The SlowerPath lines said inside the block, whatever the filters outside it."""

    def __enter__(self) -> list[str]:
        self._catch = warnings.catch_warnings(record=True)
        self._record = self._catch.__enter__()
        warnings.simplefilter("always")
        self.lines: list[str] = []
        return self.lines

    def __exit__(self, *exc) -> None:
        self.lines += [str(w.message) for w in self._record if w.category is slower.SlowerPath]
        self._catch.__exit__(*exc)


def kernels_here() -> None:
    if not kernels.available():
        pytest.fail(f"attnlab's C kernels are off here ({kernels.unavailable()})", pytrace=False)


def test_a_line_is_said_once_per_process_whatever_the_filters(fresh):
    with Said() as said:
        for _ in range(3):
            slower.say("generation runs X", "Y", "because Z")
        slower.say("generation runs X", "Y", "because W")
    assert said == ["generation runs X, not Y: because Z", "generation runs X, not Y: because W"]
    assert issubclass(slower.SlowerPath, UserWarning)


def test_pythons_display_names_the_callers_line_not_attnlabs(monkeypatch):
    """Python's own format names the frame that called into attnlab: the user's call, past
    torch.no_grad's wrapper around a decorated function."""
    from attnlab.generate.watch import generate_watched

    kernels_here()
    model, ids = build(norm_placement="post"), torch.tensor([[1, 2, 3]])
    calls = [
        lambda: model.generate(ids, 4, temperature=0),
        lambda: generate(model, ids, 4, temperature=0),
        lambda: generate_watched(model, ids, 4, lambda step: None),
    ]
    for call in calls:
        monkeypatch.setattr(slower, "_said", set())
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            call()
        (warning,) = [w for w in record if w.category is slower.SlowerPath]
        assert (warning.filename, warning.lineno) == (__file__, call.__code__.co_firstlineno)


@pytest.mark.parametrize(
    "case, reason",
    [
        ("hook", "a hook is attached to the model, and only the modules run hooks"),
        ("post-norm", "the model has post-norm blocks, which the C step does not cover"),
        ("float64", "the model is float64 on cpu; the kernels run float32 on a CPU"),
        ("bfloat16 weights", "Linear weights are stored as bfloat16 (the C step multiplies"),
    ],
)
def test_generation_on_the_module_path_says_so_and_why_once(fresh, case, reason):
    kernels_here()
    model = build(**LLAMA, **({"norm_placement": "post"} if case == "post-norm" else {}))
    if case == "float64":
        model = model.double()
    if case == "bfloat16 weights":
        store_weights_as(model, torch.bfloat16)
    if case == "hook":
        model.blocks[0].register_forward_hook(lambda module, inputs, output: None)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with Said() as said:
        for temperature in (0, 1.0):  # greedy and sampled, 9 tokens each
            generate(model, ids, 9, temperature=temperature, seed=1)
    assert len(said) == 1 and said[0].startswith(MODULE_PATH + reason), said


def test_the_usual_paths_say_nothing(fresh):
    """The C decode step, and the choices a caller makes (use_kernels=False, compile=), say
    nothing; nor does a forward pass where the kernels take it (else its one line)."""
    kernels_here()
    model = build(**LLAMA)
    ids = torch.randint(0, BASE["d_vocab"], (2, 70))
    with Said() as said:
        for kwargs in ({}, {"use_kernels": False}, {"compile": "aot_eager"}):
            generate(model, ids[:, :5], 6, temperature=0, **kwargs)
        with torch.no_grad():
            model.run_with_cache(ids)
            model(ids)
    why = inference_kernels_unusable()
    assert said == ([] if why is None else [FORWARD + why])


def test_each_forward_pass_line_is_said_once(fresh, monkeypatch):
    """A build without vectorised float32 tiles (AVX2, portable): hooked forward passes without
    gradients (run_with_cache) say so once, however many, with the build named; passes with
    gradients take the modules anyway, and plain passes (training's evaluation) torch's modules as
    always: neither says anything."""
    kernels_here()
    for where in (kernels, kernels.policy):  # generation's layers, and float_rows
        monkeypatch.setattr(where, "rows_vectorized", lambda: (False, False))
    model = build(**LLAMA)
    ids = torch.randint(0, BASE["d_vocab"], (2, 70))
    with Said() as said:
        model(ids)  # gradients on: the modules, as always
        with torch.no_grad():
            model(ids)  # no hook: nothing to say
            assert said == []
            for _ in range(3):
                model.run_with_cache(ids)
    tiles = f"the {kernels.variant()} build of the kernels has no vectorised float32 tiles"
    assert said == [FORWARD + tiles]


@pytest.fixture
def post_norm_model_dir(tmp_path):
    """A post-norm model with a character tokenizer and a chat template (each message's text)."""
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    model = build(norm_placement="post", d_vocab=12, extra={"chat_template": template})
    model.tokenizer = Tokenizer.train_char("the cat sat")  # 7 characters, ids 0-6
    return attnlab.save(model, tmp_path / "post-norm")


def test_sample_says_the_module_path_in_one_line_once(fresh, post_norm_model_dir, capsys):
    kernels_here()
    argv = ["sample", str(post_norm_model_dir), "--prompt", "the", "--max-new-tokens", "150"]
    code = main([*argv, "--num-samples", "2", "--device", "cpu"])  # 150 > n_ctx: windows too
    err = capsys.readouterr().err
    assert code == 0
    assert err.splitlines() == [
        "attnlab sample: warning: "
        + MODULE_PATH
        + "the model has post-norm blocks, which the C step does not cover"
    ]


def test_chat_says_the_module_path_in_one_line_once(fresh, post_norm_model_dir, capsys):
    kernels_here()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stdin", io.StringIO("the cat\nthe hat\n"))  # two turns, then the end
        code = main(["chat", str(post_norm_model_dir), "--max-new-tokens", "8"])
    err = capsys.readouterr().err
    assert code == 0
    assert err.splitlines() == [
        "attnlab chat: warning: "
        + MODULE_PATH
        + "the model has post-norm blocks, which the C step does not cover"
    ]


def test_the_explorers_generation_says_the_module_path_once(fresh):
    from explorer_models import small_models
    from fastapi.testclient import TestClient

    from attnlab.explorer.app import create_app

    kernels_here()
    model = small_models()["llama"]
    model.blocks[1].register_forward_hook(lambda module, inputs, output: None)
    body = {"model": "llama", "text": "The cat", "max_new_tokens": 4, "temperature": 0.0}
    with Said() as said, TestClient(create_app({"llama": model}), base_url="http://127.0.0.1") as c:
        for _ in range(2):
            lines = c.post("/api/generate", json=body).text.splitlines()
            assert '"event": "end"' in lines[-1] or '"event":"end"' in lines[-1], lines[-1]
    assert said == [MODULE_PATH + "a hook is attached to the model, and only the modules run hooks"]


def test_a_better_build_passed_over_is_said(fresh, tmp_path, monkeypatch):
    """The best build this CPU allows fails (here: does not compile): the next one runs, and one
    line says which and why."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.delenv("ATTNLAB_KERNELS", raising=False)
    best, next_best = kernels.variants_here()[:2]
    real = kernels.compile_library

    def compile_library(source, flag_sets, verbose=False):
        failing = flag_sets[0] == kernels.VARIANTS[best][0]
        return None if failing else real(source, flag_sets, verbose)

    monkeypatch.setattr(kernels.builds, "compile_library", compile_library)
    kernels.decision.cache_clear()
    kernels.library.cache_clear()
    try:
        with Said() as said:
            assert kernels.variant() == next_best
            kernels.variant()
    finally:
        kernels.decision.cache_clear()
        kernels.library.cache_clear()
    assert said == [
        f"attnlab's C kernels run their {next_best} build, not a better one this CPU allows: "
        f"the {best} build: it does not compile"
    ]


def run_without_a_compiler(tmp_path, code: str, *args: str, kernels_env: str | None = None):
    """`python -c code args` (or `python -m attnlab args`) with CC naming no program and an empty
    kernel cache: no compiler, as on a machine without one."""
    env = {**os.environ, "CC": str(tmp_path / "no-such-compiler"), "ATTNLAB_CACHE": str(tmp_path)}
    env.pop("ATTNLAB_KERNELS", None)
    if kernels_env is not None:
        env["ATTNLAB_KERNELS"] = kernels_env
    command = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


GENERATE_AND_FORWARD = """
import torch, attnlab
from attnlab.generate import kernels
m = attnlab.Transformer(attnlab.preset("nano", d_vocab=11, n_ctx=128)).eval()
for _ in range(2):
    m.generate(torch.tensor([[1, 2]]), 5, temperature=0)
    with torch.no_grad():
        m.run_with_cache(torch.randint(0, 11, (1, 80)))
print(kernels.available(), kernels.openmp())
"""


@pytest.mark.parametrize("forced", [None, "avx2", "portable"])
def test_without_a_compiler_everything_runs_on_torch_and_says_why_once(tmp_path, forced):
    """Whatever ATTNLAB_KERNELS forces, no compiler means no kernels, and the one line names the
    missing compiler (a forced AVX2 build read as 'this CPU does not allow avx2': cpu.c, which
    reads the CPU, needs the compiler too)."""
    if forced == "avx2" and "avx2" not in kernels.variants_here():
        pytest.skip("this CPU or its operating system does not allow avx2")
    result = run_without_a_compiler(tmp_path, GENERATE_AND_FORWARD, kernels_env=forced)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "None"]
    said = [line for line in result.stderr.splitlines() if "SlowerPath" in line]
    assert len(said) == 1, result.stderr
    assert (
        NO_KERNELS + f"no C compiler (CC={tmp_path / 'no-such-compiler'} names no program here); "
        "install one (apt-get install gcc" in said[0]
    ), said


def test_without_a_compiler_the_command_says_so_in_one_line(tmp_path, post_norm_model_dir):
    argv = ["attnlab", "sample", str(post_norm_model_dir), "--prompt", "the"]
    result = run_without_a_compiler(tmp_path, "", *argv, "--max-new-tokens", "20")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "attnlab sample: warning: "
        + NO_KERNELS
        + f"no C compiler (CC={tmp_path / 'no-such-compiler'} names no program here); install "
        "one (apt-get install gcc, or xcode-select --install on macOS)"
    ]


@pytest.fixture
def amx_products(monkeypatch):
    """Forward passes on AMX's tiles, where this CPU and its operating system allow them."""
    kernels_here()
    why = kernels.amx_unusable()
    if why is not None:
        pytest.skip(f"no AMX here: {why}")
    monkeypatch.setenv("ATTNLAB_FLOAT_ROWS", "amx")


def test_a_hook_that_may_edit_says_it_keeps_the_fused_steps_apart(fresh, amx_products):
    """run_with_cache's hooks only read: one C call per layer for the attention's steps and for
    SwiGLU's, and nothing said; a hook at hook_pattern or hook_pre not marked `reads` keeps them
    apart, said once each; one marked `reads` does not."""
    model = build(**LLAMA, d_model=128, d_mlp=256)  # products large enough for the tiles
    ids = torch.randint(0, BASE["d_vocab"], (2, 70))
    editing = [
        ("blocks.0.attn.hook_pattern", lambda pattern, hook: pattern),
        ("blocks.1.mlp.hook_pre", lambda gate, hook: gate),
    ]
    reading = [(name, reads(lambda x, hook: None)) for name, _ in editing]
    with torch.no_grad():
        with Said() as quiet:
            model.run_with_cache(ids)
            model.run_with_cache(ids, fwd_hooks=reading)
        with Said() as said:
            for _ in range(2):
                model.run_with_cache(ids, fwd_hooks=editing)
    assert quiet == []
    hint = "(a hook that only reads says so with attnlab.lens.hooks.reads)"
    assert said == [
        "forward passes compute the attention's scores, pattern and z in separate steps, not in "
        f"one C call on AMX tiles: a hook at hook_attn_scores or hook_pattern may edit them {hint}",
        "forward passes compute SwiGLU's gate and silu(gate) · up in separate steps, not in one "
        f"C call on AMX tiles: a hook at an MLP's hook_pre may edit them {hint}",
    ]


def test_kernel_decoder_reasons_name_what_the_model_has():
    """The reasons `KernelDecoder.unsupported` gives (the explorer's stream shows them too)."""
    kernels_here()
    assert KernelDecoder.unsupported(build(**LLAMA)) is None
    assert "(Linear)" in KernelDecoder.unsupported(_with_a_torch_linear(build(**LLAMA)))


def _with_a_torch_linear(model):
    model.blocks[0].attn.W_Q = torch.nn.Linear(BASE["d_model"], BASE["d_model"], bias=False)
    return model


def test_a_watched_generation_reads_the_pattern_in_the_fused_call(fresh, amx_products):
    """Generation you can watch (the explorer's) on the module path hands out each step's rows
    through a hook on every hook_pattern that only reads: the prompt's fused call stays, and the
    one line said is the module path's."""
    from attnlab.generate.watch import generate_watched

    model = build(**LLAMA, norm_placement="post")
    fused = []
    real = kernels.attend_explicit
    kernels_attend = lambda *args, **kw: fused.append(1) or real(*args, **kw)  # noqa: E731
    with Said() as said, pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "attend_explicit", kernels_attend)
        generate_watched(model, torch.tensor([[1, 2, 3, 4, 5, 6]]), 3, lambda step: None)
    assert len(fused) == BASE["n_layers"]  # the prompt's, a call per layer
    assert said == [MODULE_PATH + "the model has post-norm blocks, which the C step does not cover"]


def test_cc_may_carry_arguments_and_a_cc_that_names_nothing_is_no_compiler(tmp_path, monkeypatch):
    """CC is split as a shell would (`CC="ccache gcc"`); CC naming no program is no compiler, not
    a reason to take another one."""
    monkeypatch.setenv("ATTNLAB_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", f"{kernels.builds._compiler()[0]} -g")
    assert kernels.no_compiler() is None
    assert kernels.compile_library(kernels.CPU_SOURCE, (["-O2"],)) is not None
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert kernels.no_compiler().startswith(f"no C compiler (CC={tmp_path / 'no-such-compiler'}")
    assert kernels.compile_library(kernels.CPU_SOURCE, (["-O1"],)) is None
