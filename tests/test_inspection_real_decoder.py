"""The chapters' claims on a real decoder (docs/tutorials/real-decoder.md), pinned on
SmolLM2-135M-Instruct's GGUF file (30 layers × 9 query heads sharing 3 key/value heads), so that a
regression of `attnlab heads`, `attnlab attribute` or `attnlab patch` on a grouped-query model fails
here.

Design choices:
- The page's numbers come from docs/tutorials/real_decoder.py, which runs the page's commands; the
  page's command block must be the script's commands, word for word, and its pictures must exist.
- The model is loaded once; each finding is recomputed by the function its command calls (or the
  script's own), on the cheapest input that still shows it: one of `heads`' four sequences, the
  page's three best heads patched alone instead of the whole 270-run sweep. The findings are pinned
  loosely (a threshold, a top-3, a rank) and the heads the page names must still be the ones found,
  so a change that moves them fails until the page is regenerated.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.inspection import patching
from attnlab.inspection.attribution import direct_logit_attribution
from attnlab.inspection.scores import head_scores
from attnlab.lens.names import get_act_name

ROOT = Path(__file__).resolve().parent.parent
TUTORIALS = ROOT / "docs" / "tutorials"
PAGE = TUTORIALS / "real-decoder.md"
COMMITTED = TUTORIALS / "real-decoder"


def load_script():
    spec = importlib.util.spec_from_file_location("real_decoder", TUTORIALS / "real_decoder.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def committed() -> dict:
    return json.loads((COMMITTED / "numbers.json").read_text())


def page_commands() -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            if shlex.split(line, comments=True):
                commands.append(line.split("  #")[0].strip())
    return commands


def test_the_page_shows_the_scripts_commands_and_its_pictures():
    script = load_script()
    assert page_commands() == [
        "python docs/tutorials/real_decoder.py --out docs/tutorials/real-decoder",
        *script.commands("smollm2", "docs/tutorials/real-decoder"),
    ]
    pictures = re.findall(r"\]\((real-decoder/[^)]+\.png)\)", PAGE.read_text(encoding="utf-8"))
    assert len(pictures) >= 5
    for picture in pictures:
        assert (PAGE.parent / picture).read_bytes()[:4] == b"\x89PNG", picture
    assert "(docs/tutorials/real-decoder.md)" in (ROOT / "README.md").read_text(encoding="utf-8")


# The findings, on the model itself ----------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return attnlab.load("smollm2")


@pytest.mark.slow
def test_previous_token_and_induction_heads(model):
    """`attnlab heads`' scores (head_scores, the function it calls), on one of its four sequences:
    the page's best heads still score high and are still among the best; the copying scores
    (weights only, each query head read through its own key/value head) are the page's."""
    page = committed()
    scores = head_scores(model, batch=1)
    for name, floor in (("previous_token", 0.7), ("induction", 0.7)):
        fresh = scores.scores[name]
        best = fresh.flatten().argsort(descending=True)[:3].tolist()
        names = [f"L{i // 9}H{i % 9}" for i in best]
        assert page[name][0][0] in names, (name, names, page[name][:3])
        assert float(fresh[load_script().cell(page[name][0][0])]) >= floor, (name, page[name][0])
    heads = json.loads((COMMITTED / "heads.json").read_text())
    copying = torch.tensor(heads["scores"]["copying"])
    torch.testing.assert_close(scores.scores["copying"], copying, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_it_attends_to_cat(model, tmp_path):
    page, script = committed()["it_cat"], load_script()
    fresh = script.it_attends(model, tmp_path, top=3)
    best = fresh["top_heads_to_cat"][0]
    assert best["head"] == page["top_heads_to_cat"][0]["head"]
    assert best["to_cat"] >= 0.5 and best["to_cat"] >= 5 * best["to_mat"], best
    assert fresh["control_it_row_max_difference"] == 0.0  # causal: later words change nothing
    for name in ("it-cat.png", "it-cat-head.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_the_fact_recalled_and_its_direct_logit_attribution(model):
    page, script = committed(), load_script()
    fact = script.next_token(model, script.CLEAN, script.ANSWER)
    assert fact["rank"] == 1 and fact["probability"] >= 0.5, fact
    assert script.next_token(model, script.CORRUPTED, script.WRONG)["rank"] == 1
    result = direct_logit_attribution(model, script.CLEAN, script.ANSWER, script.WRONG)
    assert result.logit >= 3.0
    assert result.total() == pytest.approx(result.logit, abs=1e-3)
    top = result.heads.flatten().argsort(descending=True)[:3].tolist()
    names = [f"L{i // 9}H{i % 9}" for i in top]
    assert names[0] == page["attribution"]["top_heads"][0][0], names
    assert result.logit == pytest.approx(page["attribution"]["logit_difference"], abs=1e-3)


@pytest.mark.slow
def test_head_patching_restores_what_the_page_says(model):
    """The page's three best heads of `attnlab patch --sweeps head-outputs`, each patched alone
    with the sweep's own setter: the same restored fraction (the whole sweep is 270 runs)."""
    page, script = committed()["patching"], load_script()
    metric = patching.logit_diff_metric(
        model.to_single_token(script.ANSWER), model.to_single_token(script.WRONG)
    )
    clean_ids, corrupted_ids = model.to_tokens(script.CLEAN), model.to_tokens(script.CORRUPTED)
    with torch.no_grad():
        clean_logits, cache = model.run_with_cache(clean_ids)
        clean, corrupted = float(metric(clean_logits)), float(metric(model(corrupted_ids)))
    assert clean == pytest.approx(page["clean"], abs=1e-3)
    assert corrupted == pytest.approx(page["corrupted"], abs=1e-3)
    assert page["output"][0][1] >= 0.2, page["output"][:3]
    for name, restored in page["output"][:3]:
        layer, head = load_script().cell(name)
        hook_name = get_act_name("z", layer)

        def hook(z, hook, index=(layer, head), clean_z=cache[hook_name]):
            return patching.layer_head_vector_patch_setter(z.clone(), index, clean_z)

        with torch.no_grad():
            value = float(
                metric(model.run_with_hooks(corrupted_ids, fwd_hooks=[(hook_name, hook)]))
            )
        assert (value - corrupted) / (clean - corrupted) == pytest.approx(restored, abs=0.01), name
