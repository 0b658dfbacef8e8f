"""attnlab's Muon: torch.optim.Muon's update with the Newton-Schulz dtype a choice, the choice made
from this machine's measured bfloat16 speed, said in one line, and kept out of checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from training_tiny import tiny_config, tiny_flags

import attnlab
from attnlab import machine
from attnlab.training.config import TrainConfig, build_config
from attnlab.training.muon import Muon, orthogonalise
from attnlab.training.schedule import Optimizers, make_optimizer, newton_schulz_dtype
from attnlab.training.trainer import Trainer, train

SHAPES = [(24, 40), (40, 24), (32, 32)]  # wide, tall (run transposed) and square
FAST = {"bfloat16_gflops": 600.0, "float32_gflops": 390.0, "size": 512}
SLOW = {"bfloat16_gflops": 1.25, "float32_gflops": 99.0, "size": 512}


def fake_rates(monkeypatch, rates: dict) -> list:
    """machine.bfloat16_products answers `rates`; the list records each device asked about."""
    asked = []

    def measured(device="cpu"):
        asked.append(torch.device(device))
        return machine.Measured(dict(rates), machine.cache_dir() / "fake.json", fresh=False)

    monkeypatch.setattr(machine, "bfloat16_products", measured)
    return asked


def steps(optimizer_class, shape, n_steps=4, seed=0, **kwargs) -> list[torch.Tensor]:
    """Two parameters of `shape` after each of n_steps steps on the same random gradients."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=generator)) for _ in range(2)]
    optimizer = optimizer_class(
        params, lr=3e-3, weight_decay=0.1, ns_steps=5, adjust_lr_fn="match_rms_adamw", **kwargs
    )
    after = []
    for _ in range(n_steps):
        for p in params:
            p.grad = torch.randn(*shape, generator=generator)
        optimizer.step()
        after.append(torch.stack([p.detach().clone() for p in params]))
    return after


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_in_bfloat16_its_steps_are_torchs_bit_for_bit(shape, nesterov, adjust):
    generator = torch.Generator().manual_seed(1)
    start = [torch.randn(*shape, generator=generator) for _ in range(2)]
    grads = [[torch.randn(*shape, generator=generator) for _ in start] for _ in range(3)]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    kwargs = dict(lr=0.02, weight_decay=0.1, nesterov=nesterov, ns_steps=4, adjust_lr_fn=adjust)
    optimizers = [Muon(ours, **kwargs, ns_dtype=torch.bfloat16), torch.optim.Muon(theirs, **kwargs)]
    for step_grads in grads:
        for params in (ours, theirs):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
        for optimizer in optimizers:
            optimizer.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    for a, b in zip(optimizers[0].state.values(), optimizers[1].state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_in_float32_the_update_is_bfloat16s_up_to_its_rounding_and_float64s_more_closely(shape):
    """The same steps with the Newton-Schulz products in bfloat16, float32 and float64: float32's
    moves stay within bfloat16's rounding of bfloat16's (8 bits of mantissa, over five
    iterations) and within float32's of float64's, far closer."""
    moved = {
        dtype: steps(Muon, shape, ns_dtype=dtype)[-1] - start_of(shape)
        for dtype in (torch.bfloat16, torch.float32, torch.float64)
    }

    def distance(a, b):
        return float((moved[a] - moved[b]).norm() / moved[torch.float64].norm())

    assert 1e-4 < distance(torch.bfloat16, torch.float32) < 5e-2
    assert distance(torch.float32, torch.float64) < 1e-4
    assert distance(torch.float32, torch.float64) < distance(torch.bfloat16, torch.float32) / 100


def start_of(shape) -> torch.Tensor:
    """The parameters `steps` starts from (its seed's first draws)."""
    generator = torch.Generator().manual_seed(0)
    return torch.stack([torch.randn(*shape, generator=generator) for _ in range(2)])


def test_orthogonalise_leaves_its_input_alone_and_orthogonalises_in_any_dtype():
    """Its output's singular values lie near 1 (Jordan et al.: roughly within 0.5-1.5), whatever
    the dtype; the update it was given (the momentum buffer itself without Nesterov) unchanged."""
    update = torch.randn(16, 48)
    before = update.clone()
    for dtype in (torch.bfloat16, torch.float32):
        out = orthogonalise(update, 5, dtype)
        assert out.dtype == dtype and out.shape == update.shape
        singular = torch.linalg.svdvals(out.double())
        assert singular.min() > 0.5 and singular.max() < 1.5
        assert torch.equal(update, before)


def test_the_state_dict_is_torchs_and_loads_either_way():
    """A checkpoint holds the keys torch.optim.Muon's holds (no dtype: the machine's choice), so a
    run saved with torch's resumes with attnlab's and back, bit for bit in bfloat16."""
    shape = (24, 40)
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(*shape, generator=generator)
    grads = [torch.randn(*shape, generator=generator) for _ in range(4)]

    def run(first, second):
        p = torch.nn.Parameter(start.clone())
        optimizer = first([p], lr=0.02, ns_steps=5)
        for g in grads[:2]:
            p.grad = g.clone()
            optimizer.step()
        saved = optimizer.state_dict()
        resumed = second([p], lr=0.02, ns_steps=5)
        resumed.load_state_dict(saved)
        for g in grads[2:]:
            p.grad = g.clone()
            resumed.step()
        return p.detach(), saved

    ours, saved_ours = run(Muon, Muon)
    theirs, saved_theirs = run(torch.optim.Muon, torch.optim.Muon)
    assert saved_ours["param_groups"] == saved_theirs["param_groups"]
    assert torch.equal(run(torch.optim.Muon, Muon)[0], theirs)
    assert torch.equal(run(Muon, torch.optim.Muon)[0], ours)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize(
    "rates, expected", [(FAST, torch.bfloat16), (SLOW, torch.float32)], ids=["fast", "slow"]
)
def test_make_optimizer_takes_bfloat16_only_where_it_measured_fast_here(
    monkeypatch, rates, expected
):
    asked = fake_rates(monkeypatch, rates)
    model = attnlab.Transformer(
        attnlab.preset("nano", d_vocab=11, n_layers=1, d_model=16, n_heads=2, bias=False)
    )
    optimizer = make_optimizer(model, TrainConfig(optimizer="muon"), torch.device("cpu"))
    assert isinstance(optimizer, Optimizers)
    muon = optimizer.optimizers[0]
    assert isinstance(muon, Muon) and muon.ns_dtype == expected
    assert asked == [torch.device("cpu")]
    choice = newton_schulz_dtype(TrainConfig(optimizer="muon"), torch.device("cpu"))
    name = str(expected).removeprefix("torch.")
    assert choice.line() == (
        f"attnlab: Muon's Newton-Schulz runs in {name}: torch's bfloat16 products run at "
        f"{rates['bfloat16_gflops']:,.1f} GFLOP/s here against float32's "
        f"{rates['float32_gflops']:,.1f} (512 x 512, {machine.threads_phrase()}; "
        "measured once, kept in attnlab's cache)"
    )
    # --muon-dtype forces either, without measuring
    for forced in ("bfloat16", "float32"):
        cfg = TrainConfig(optimizer="muon", muon_dtype=forced)
        muon = make_optimizer(model, cfg, torch.device("cpu")).optimizers[0]
        assert muon.ns_dtype == getattr(torch, forced)
        assert newton_schulz_dtype(cfg, torch.device("cpu")).line() == (
            f"attnlab: Muon's Newton-Schulz runs in {forced}: --muon-dtype {forced}"
        )
    assert len(asked) == 2  # the two auto choices above only


def test_the_flag_takes_auto_bfloat16_or_float32_and_the_presets_keep_auto():
    assert build_config("speedrun", overrides={"muon_dtype": "float32"}).muon_dtype == "float32"
    for preset in ("speedrun", "demo"):
        assert build_config(preset).muon_dtype == "auto"
    with pytest.raises(attnlab.UserError, match="--muon-dtype must be one of auto, bfloat16"):
        TrainConfig(muon_dtype="float16")


@pytest.mark.parametrize(
    "rates, name", [(FAST, "bfloat16"), (SLOW, "float32")], ids=["fast", "slow"]
)
def test_a_muon_run_says_its_choice_in_one_line_and_its_report(
    tmp_path, monkeypatch, capsys, rates, name
):
    fake_rates(monkeypatch, rates)
    cfg = tiny_config(tmp_path, optimizer="muon", max_iters=2, eval_interval=2)
    train(cfg, progress=False)
    lines = [
        line for line in capsys.readouterr().err.splitlines() if "Muon's Newton-Schulz" in line
    ]
    assert len(lines) == 1 and lines[0].startswith(f"attnlab: Muon's Newton-Schulz runs in {name}:")
    assert f"{rates['bfloat16_gflops']:,.1f} GFLOP/s here" in lines[0]
    report = (tmp_path / "run" / "report.md").read_text()
    assert f"| Muon's Newton-Schulz | {name}: torch's bfloat16 products run at" in report
    # AdamW alone: no line, no row
    train(tiny_config(tmp_path, max_iters=2, eval_interval=2), overwrite=True, progress=False)
    assert "Newton-Schulz" not in capsys.readouterr().err
    assert "Newton-Schulz" not in (tmp_path / "run" / "report.md").read_text()


def test_the_experiments_many_small_runs_say_nothing(tmp_path, monkeypatch, capsys):
    fake_rates(monkeypatch, SLOW)
    cfg = tiny_config(tmp_path, optimizer="muon", max_iters=1, eval_interval=1)
    trainer = Trainer(cfg, progress=False, evaluation_lines=False)
    assert trainer.newton_schulz.dtype == torch.float32
    assert "Newton-Schulz" not in capsys.readouterr().err


@pytest.mark.parametrize("rates", [FAST, SLOW], ids=["bfloat16", "float32"])
def test_a_muon_run_resumes_exactly_in_either_dtype(tmp_path, monkeypatch, rates):
    """Interrupted at step 3 and resumed: the same losses as the run that never stopped, with the
    momentum buffers back from the checkpoint (the Newton-Schulz dtype chosen again, the same)."""
    fake_rates(monkeypatch, rates)
    changes = dict(optimizer="muon", max_iters=6, lr_decay_iters=6, eval_interval=3)
    whole = train(tiny_config(tmp_path / "a", **changes), progress=False)
    train(tiny_config(tmp_path / "b", **{**changes, "max_iters": 3}), progress=False)
    saved = torch.load(next((tmp_path / "b" / "run").rglob("train_state.pt")), weights_only=True)[
        "optimizer"
    ]["optimizers"][0]
    assert saved["state"] and all("momentum_buffer" in s for s in saved["state"].values())
    rest = train(tiny_config(tmp_path / "b", **changes), resume=True, progress=False)
    assert rest.losses == {k: v for k, v in whole.losses.items() if k > 3}


RANKS_SCRIPT = """
import os, sys
from pathlib import Path
from attnlab import machine
from attnlab.cli import main
from attnlab.training import muon

rank = int(os.environ["RANK"])
rates = {fast} if rank == 0 else {slow}  # each rank alone would choose differently
machine.bfloat16_products = lambda device="cpu": machine.Measured(rates, Path("fake"), False)
made = muon.Muon.__init__

def init(self, *args, **kwargs):
    made(self, *args, **kwargs)
    Path({out!r}, f"rank {{rank}}").write_text(str(self.ns_dtype))

muon.Muon.__init__ = init
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_under_torchrun_every_rank_takes_rank_0s_choice(tmp_path):
    """Replicas whose Newton-Schulz rounded differently would drift apart: rank 0 chooses."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT.format(fast=FAST, slow=SLOW, out=str(tmp_path)))
    flags = tiny_flags(tmp_path, max_iters=2, eval_interval=2) + ["--optimizer", "muon"]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        + [str(script), "train", *flags],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    said = {path.name: path.read_text() for path in tmp_path.glob("rank *")}
    assert said == {"rank 0": "torch.bfloat16", "rank 1": "torch.bfloat16"}, done.stderr
    chosen = [line for line in done.stderr.splitlines() if "Muon's Newton-Schulz" in line]
    assert len(chosen) == 1 and "runs in bfloat16" in chosen[0]  # said once, by rank 0
