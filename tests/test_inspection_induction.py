"""The induction experiment's --quick run: what its models measure, and what ablating their heads does."""

import json

import pytest

import attnlab
from attnlab.cli import main
from attnlab.inspection.experiments.common import per_token_loss, repeated_spans
from attnlab.inspection.interventions import ablate_head


def icl_gain(model, data, hooks=()) -> float:
    """Loss on the first tokens minus loss on the last ones: what looking back buys the model."""
    with model.hooks(hooks):
        loss = per_token_loss(model, data)
    return float(loss[:6].mean() - loss[-12:].mean())


@pytest.mark.slow
def test_quick_induction_run_and_ablation_of_its_layer_0_heads(tmp_path, capsys):
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
    one, two = result["final"]["1L"], result["final"]["2L"]
    # Only the two-layer model grows a previous-token head (the first half of an induction circuit).
    assert two["best_previous_token"] > one["best_previous_token"] + 0.03, (one, two)

    # The two-layer model's in-context gain runs through its heads: zeroing all of layer 0 removes most of it.
    model = attnlab.load(tmp_path / "induction-2L")
    data = repeated_spans(256, model.config.n_ctx + 1, model.config.d_vocab, seed=99)
    gain = icl_gain(model, data)
    ablated = icl_gain(model, data, [ablate_head(0, h) for h in range(model.config.n_heads)])
    assert gain > 0.5, gain
    assert ablated < 0.5 * gain, (gain, ablated)
