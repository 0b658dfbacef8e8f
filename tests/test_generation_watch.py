"""Generation you can watch (attnlab.generate.watch): each step's attention rows and logits are the
full forward pass's on the final ids (the one reference), on the kernel decode program and on the
module path, and its tokens are `model.generate`'s."""

import pytest
import torch
from explorer_models import small_models
from styles import build

import attnlab
from attnlab.errors import UserError
from attnlab.generate.kernel_decoder import KernelDecoder
from attnlab.generate.kv_cache import KVCache
from attnlab.generate.watch import decode_path, generate_watched

SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 0.9, "top_k": 20, "seed": 7},
    {"temperature": 1.2, "top_p": 0.8, "seed": 3},
]


def watched(model, ids, n, **settings):
    steps = []
    out = generate_watched(model, ids, n, steps.append, **settings)
    return out, steps


# styles (tests/styles.py): two the C decode program runs, a window of 4 keys (Mistral) and Gemma
# 3's (GeGLU, sandwich norms, QK-norm, one key-value head, block 0 windowed with its own RoPE base,
# block 1 global); and post-norm blocks, which it does not run: the module path runs
SHAPES = ("mistral-window", "gemma3", "gpt-post-norm")


def model_named(name: str) -> attnlab.Transformer:
    """explorer_models' gpt (learned positions) or llama (RoPE, grouped-query, QK-norm), or a
    random model of one of SHAPES."""
    if name in ("gpt", "llama"):
        return small_models()[name]
    torch.manual_seed(0)
    return build(name)


def prompt(model, tokens: int) -> torch.Tensor:
    return torch.randint(
        0, model.config.d_vocab, (1, tokens), generator=torch.Generator().manual_seed(1)
    )


@pytest.mark.parametrize("name", ["gpt", "llama", "mistral-window", "gemma3", "gpt-post-norm"])
@pytest.mark.parametrize("settings", SETTINGS)
# 3 tokens: the prompt goes through the decode step too (PREFILL_IN_STEPS); 9: the modules' prefill
@pytest.mark.parametrize("T", [3, 9])
def test_each_step_is_the_full_pattern_row_and_logits_of_the_final_ids(
    name, settings, T, monkeypatch
):
    model = model_named(name)
    path, why = decode_path(model)
    assert (path, why is None) == (
        ("modules", False) if name == "gpt-post-norm" else ("kernels", True)
    )
    # count the steps whose rows the C decode program gave (no hook: that would take the modules)
    from_kernels = []
    weights = KernelDecoder.weights
    monkeypatch.setattr(
        KernelDecoder, "weights", lambda self: from_kernels.append(1) or weights(self)
    )
    ids = prompt(model, T)
    n = 24
    out, steps = watched(model, ids, n, **settings)
    assert len(from_kernels) == (0 if path == "modules" else n if T <= 4 else n - 1)
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
    if model.config.sliding_window is not None:  # past the window, block 0 saw only its band
        last = steps[-1].rows[0]
        assert (last[:, : -model.config.sliding_window] == 0).all() and (last[:, -1] > 0).all()


def test_the_weights_need_keep_weights():
    model = model_named("llama")
    step = KernelDecoder(model, KVCache.for_model(model, 1, 64))
    with pytest.raises(AssertionError, match="keep_weights"):
        step.weights()


@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt-post-norm"])
@pytest.mark.parametrize("settings", SETTINGS)
def test_the_tokens_are_model_generates_for_the_same_settings(name, settings):
    model = model_named(name)
    ids = prompt(model, 7)
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


def test_the_rows_of_each_step_come_from_eager_steps_not_a_compiled_one():
    model = small_models()["gpt"]
    with pytest.raises(UserError, match="drop compile="):
        model.generate(torch.zeros(1, 3, dtype=torch.long), 2, compile="aot_eager", on_rows=print)
