"""The induction experiment's --quick run: what its models measure, and what ablating its induction
heads does."""

import json

import pytest
import torch

import attnlab
from attnlab.cli import main
from attnlab.inspection.experiments.common import per_token_loss
from attnlab.inspection.experiments.induction import QUICK
from attnlab.inspection.interventions import ablate_head
from attnlab.inspection.scores import head_scores


def icl_gain(model, data, hooks=()) -> float:
    """Loss on the first tokens minus loss on the last ones: what looking back buys the model."""
    with model.hooks(hooks):
        loss = per_token_loss(model, data)
    return float(loss[:6].mean() - loss[-12:].mean())


@pytest.mark.slow
def test_quick_induction_run_and_ablation_of_the_induction_heads(tmp_path, capsys):
    assert main(["experiment", "induction", "--quick", "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "ind 2L" in table and "phase change" in table
    assert (tmp_path / "induction.png").stat().st_size > 10_000
    result = json.loads((tmp_path / "induction.json").read_text())
    setup = result["setup"]
    for name in ("1L", "2L"):
        snaps = result["snapshots"][name]
        assert len(snaps) == setup["steps"] // setup["eval_every"] + 1
        assert snaps[-1]["loss"] < snaps[0]["loss"] - 0.5  # both learn the repeats in part
        assert snaps[-1]["icl_score"] < -0.5  # later tokens are easier than early ones
    # Measured on the float32 weights (not on the float16 snapshot files, which move the 4th-5th
    # digit): the last step's numbers are the final checkpoint's
    eval_data = QUICK.data(QUICK.n_eval, seed=10_000)
    for name in ("1L", "2L"):
        final, measured = attnlab.load(tmp_path / f"induction-{name}"), result["final"][name]
        assert float(per_token_loss(final, eval_data).mean()) == pytest.approx(
            measured["loss"], abs=2e-6, rel=0
        )
        induction = head_scores(final).scores["induction"].max()
        assert float(induction) == pytest.approx(measured["best_induction"], abs=2e-6, rel=0)
    one, two = result["final"]["1L"], result["final"]["2L"]
    # The claim: only the two-layer model grows an induction head ...
    assert two["best_induction"] > one["best_induction"] + 0.2, (one, two)
    # ... in its second layer (it needs a first layer to compose with)
    assert two["best_induction_head"][0] == 1
    # ... and learns far more from the context than the one-layer model can.
    assert two["icl_score"] < one["icl_score"] - 1.0, (one, two)

    # Ablating its induction heads (those whose score stands out) removes most of its in-context
    # gain.
    # They are redundant: ablating any single one leaves the gain nearly whole (full run: 4.78-5.14
    # nats of 4.88 measured), so all of them are ablated together.
    model = attnlab.load(tmp_path / "induction-2L")
    scores = head_scores(model)
    induction_heads = [(layer, head) for layer, head, _ in scores.standout("induction")]
    assert induction_heads and all(layer == 1 for layer, _ in induction_heads), induction_heads
    data = QUICK.data(256, seed=99)
    gain = icl_gain(model, data)
    ablated = icl_gain(model, data, [ablate_head(layer, head) for layer, head in induction_heads])
    assert gain > 2.0, gain
    assert ablated < 0.5 * gain, (gain, ablated)
    # Control: ablating the layer-0 head that looks back least keeps most of the gain.
    control = int(scores.scores["previous_token"][0].argmin())
    assert icl_gain(model, data, [ablate_head(0, control)]) > 0.8 * gain

    # The explorer's knockout shows the same thing on one text: with the induction heads out, the
    # loss on the repeated part rises back towards the first copy's, which barely moves.
    from attnlab.explorer.models import Variant
    from attnlab.explorer.views import Explorer

    text = result["example_text"]
    knock = Explorer({"2L": model}).knockout("2L", text, Variant(tuple(induction_heads)))
    before, after = torch.tensor(knock["loss_before"]), torch.tensor(knock["loss_after"])
    late = slice(len(before) // 2, None)  # past the first copy: the span is repeating
    assert after[late].mean() > before[late].mean() + 1.0, (before, after)
    # ... and the run is there to scrub through: snapshots and losses beside the model, its
    # tokenizer one character per id
    from attnlab.training.snapshots import list_snapshots

    steps = [s["step"] for s in result["snapshots"]["2L"]]
    assert list(list_snapshots(tmp_path / "induction-2L")) == steps
    assert len(model.tokenizer.encode(text)) == len(text) == QUICK.n_ctx
    # The run is the Trainer's (one training loop): its checkpoint, its train/val losses at every
    # snapshot
    # step (the slider's loss curve), and the explorer's slider opened on the phase change.
    from attnlab.explorer.models import Run
    from attnlab.training.report import read_metrics

    run_dir = tmp_path / "induction-2L"
    assert (run_dir / "checkpoints").is_dir() and (run_dir / "report.md").is_file()
    assert [r["iter"] for r in read_metrics(run_dir)] == steps[1:]
    start = result["phase_change_2L"]["steps"]["induction_rise"]
    explorer = Explorer(
        {"2L": model},
        runs={"2L": Run(run_dir, list_snapshots(run_dir), start_step=start, example=text)},
    )
    curves = explorer.training("2L")
    assert (
        curves["steps"] == steps
        and start in curves["score_steps"]
        and len(curves["metrics"]) == len(steps) - 1
    )
    induction = dict(
        zip(
            curves["score_steps"],
            (max(max(row) for row in grid) for grid in curves["scores"]["induction"]),
        )
    )
    assert induction[steps[-1]] > 0.5 > induction[0]  # the slider shows the induction heads form
    before = explorer.knockout("2L", text, Variant(tuple(induction_heads), step=0))
    assert before["step"] == 0 and len(before["loss_after"]) == len(text) - 1


def test_explore_opens_the_explorer_on_the_phase_change(tmp_path, monkeypatch):
    """--explore serves the two models, both runs' sliders at the step where the 2L model's
    induction score rises most."""
    from attnlab.explorer import cli as explorer_cli
    from attnlab.explorer import server

    served = []
    monkeypatch.setattr(
        server,
        "serve",
        lambda models, host, port, max_tokens, runs: served.append((models, port, runs)) or 0,
    )
    result = {
        "phase_change_2L": {"steps": {"induction_rise": 20}},
        "example_text": "abcabc",
        "models": {"2L": "m2", "1L": "m1"},
    }
    for name in ("induction-2L", "induction-1L"):
        (tmp_path / name / "snapshots").mkdir(parents=True)
        for step in (0, 20, 40):
            (tmp_path / name / "snapshots" / f"step-{step:06d}.safetensors").write_bytes(b"")
    assert explorer_cli.explore_induction(result, tmp_path, 8123) == 0
    models, port, runs = served[0]
    assert list(models) == ["induction-2L", "induction-1L"] and port == 8123
    assert runs["induction-2L"].start_step == 20 and list(runs["induction-2L"].snapshots) == [
        0,
        20,
        40,
    ]
    assert runs["induction-2L"].example == "abcabc"
    assert runs["induction-1L"].start_step == 20 and list(runs["induction-1L"].snapshots) == [
        0,
        20,
        40,
    ]


def test_explore_is_for_the_induction_experiment_only(capsys):
    assert main(["experiment", "scaling", "--explore"]) == 2
    assert "--explore" in capsys.readouterr().err
