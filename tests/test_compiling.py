"""torch.compile as attnlab calls it (attnlab.compiling): inductor's on-disk cache kept apart per
vector width, so that code written for one instruction set is never compiled for another.

Two processes share one fresh inductor cache: the first with ATEN_CPU_CAPABILITY=avx2 (how an
AVX2-only machine is emulated on an AVX-512 one), the second with the machine's own. Each generates
greedily with the compiled bfloat16-weight decode step (`attnlab sample --compile --bf16-weights`)
of the shape the README test trains with `--preset cpu` (d_vocab 45, d_model 128, 4 layers), which
aborted with heap corruption on an AVX-512 Xeon when the second process reused the first's AVX2 code
(attnlab.compiling). Each must exit 0 with the eager step's tokens and logits (float32 arithmetic on
the same bfloat16 weights, summed in another order: 1e-4), and the second may take the first's code
from the cache only where both picked the same vector width: that check fails on any machine whose
vectors are wider than AVX2's, even where the heap's layout hides the overflow. Both of attnlab's
compiled steps, generation's and training's, go through attnlab.compiling (a quick test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch._inductor.cpu_vec_isa import pick_vec_isa
from training_tiny import tiny_config

import attnlab
from attnlab.generate.loop import generate
from attnlab.training.trainer import train

GENERATE = """
import json, torch, attnlab
from torch._dynamo.utils import counters
from torch._inductor.cpu_vec_isa import pick_vec_isa
from attnlab.quant.quantize import store_weights_as
from attnlab.generate.loop import generate

torch.manual_seed(0)
config = attnlab.ModelConfig(d_vocab=45, n_ctx=64, d_model=128, n_layers=4, n_heads=4,
    positional="rope", norm="rmsnorm", mlp="gelu", bias=False)
model = store_weights_as(attnlab.Transformer(config).eval(), torch.bfloat16)
ids = torch.tensor([[1, 7]])
runs = {}
for compile in (False, True):
    logits = []
    tokens = generate(model, ids, 12, temperature=0, compile=compile, use_kernels=False,
        on_logits=lambda x: logits.append(x.clone()))
    runs[compile] = tokens, torch.cat(logits)
torch.testing.assert_close(runs[True][1], runs[False][1], rtol=1e-4, atol=1e-4)
print(json.dumps({
    "eager": runs[False][0].tolist(),
    "compiled": runs[True][0].tolist(),
    "width": pick_vec_isa().bit_width(),
    "cache_hits": counters["inductor"]["fxgraph_cache_hit"],
}))
"""


def generate_compiled(cache_dir, capability: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "ATEN_"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run(
        [sys.executable, "-c", GENERATE], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, (
        f"ATEN_CPU_CAPABILITY={capability}: exit {done.returncode}\n{done.stderr[-3000:]}"
    )
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["compiled"] == run["eager"], run
    return run


@pytest.mark.slow
def test_compiled_step_never_reuses_code_written_for_other_vectors(tmp_path):
    emulated = generate_compiled(tmp_path / "inductor", "avx2")
    own = generate_compiled(tmp_path / "inductor", None)
    assert emulated["cache_hits"] == 0
    assert own["cache_hits"] == (1 if own["width"] == emulated["width"] else 0), (emulated, own)
    assert own["compiled"] == emulated["compiled"]


def test_generation_and_training_compile_with_the_vector_width_inductor_picks(
    tmp_path, monkeypatch
):
    """torch.compile's arguments from `generate(compile=True)` and `attnlab train --compile` (the
    function itself returned: both then run eager)."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    model = attnlab.Transformer(attnlab.ModelConfig(d_vocab=11, d_model=16, n_layers=1, n_heads=2))
    generate(model, torch.tensor([[1, 2]]), 3, temperature=0, compile=True)
    changes = dict(compile=True, max_iters=1, lr_decay_iters=1, warmup_iters=0, eval_interval=1)
    train(tiny_config(tmp_path, **changes), progress=False)
    width = pick_vec_isa().bit_width()
    assert [c["backend"] for c in calls] == ["inductor", "inductor"], calls
    assert all(c.get("options") == {"cpp.simdlen": width} for c in calls), calls
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # an AVX2-only machine's width, emulated
    generate(model, torch.tensor([[1, 2]]), 3, temperature=0, compile=True)
    assert calls[-1].get("options") == {"cpp.simdlen": pick_vec_isa().bit_width()}
