"""Generation you can watch (attnlab.generate.watch): each step's attention rows and logits are the
full forward pass's on the final ids (the one reference), and its tokens are `model.generate`'s."""

import pytest
import torch
from explorer_models import small_models

from attnlab.errors import UserError
from attnlab.generate.watch import generate_watched

SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 0.9, "top_k": 20, "seed": 7},
    {"temperature": 1.2, "top_p": 0.8, "seed": 3},
]


def watched(model, ids, n, **settings):
    steps = []
    out = generate_watched(model, ids, n, steps.append, **settings)
    return out, steps


@pytest.mark.parametrize("name", ["gpt", "llama"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_each_step_is_the_full_pattern_row_and_logits_of_the_final_ids(name, settings):
    model = small_models()[name]
    ids = torch.tensor([model.tokenizer.encode("The cat sat on")])
    T, n = ids.shape[1], 24
    out, steps = watched(model, ids, n, **settings)
    assert [s.index for s in steps] == list(range(T, T + n))
    assert [s.token for s in steps] == out[0, T:].tolist()
    # the reference: one forward pass over the final ids, every layer's whole pattern
    with torch.no_grad():
        logits, cache = model.run_with_cache(out, names_filter=lambda n: n.endswith("hook_pattern"))
    pattern = torch.stack(
        [cache[f"blocks.{layer}.attn.hook_pattern"][0] for layer in range(model.config.n_layers)]
    )  # [layer, head, query_pos, key_pos]
    for step in steps:
        # the query before the new token, over the keys before it
        torch.testing.assert_close(
            step.rows, pattern[:, :, step.index - 1, : step.index], atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(step.logits, logits[0, step.index - 1], atol=1e-4, rtol=1e-4)
        assert torch.allclose(step.rows.sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_tokens_are_model_generates_for_the_same_settings(settings):
    model = small_models()["llama"]
    ids = torch.tensor([model.tokenizer.encode("The cat")])
    out, _ = watched(model, ids, 40, **settings)
    # generate's default path (the kernel decode program where it applies)
    assert torch.equal(out, model.generate(ids, 40, **settings))


def test_a_step_that_raises_stops_generation_and_leaves_the_model_unhooked():
    model = small_models()["gpt"]
    ids = torch.tensor([model.tokenizer.encode("The cat")])
    seen = []

    def stop_at_three(step):
        seen.append(step.token)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_watched(model, ids, 50, stop_at_three, temperature=0.0)
    assert len(seen) == 3
    assert not any(point.has_hooks for point in model.hook_dict.values())
    out, steps = watched(model, ids, 5, temperature=0.0)
    assert out[0, ids.shape[1] :].tolist()[:3] == seen


def test_one_prompt_at_a_time():
    model = small_models()["gpt"]
    with pytest.raises(UserError, match="one prompt, got a batch of 2"):
        generate_watched(model, torch.zeros(2, 3, dtype=torch.long), 2, lambda step: None)
