"""Small random models with a character tokenizer, for the explorer's tests (imported by
test_explorer_*.py).

Three architectures cover the explorer's branches: a GPT-style decoder (learned positions,
pre-norm), a LLaMA-style decoder (RoPE, grouped-query, qk-norm, SwiGLU) and a BERT-style post-norm
encoder (with qk-norm, which the explorer must apply itself when there is no RoPE hook after it). A
real server for them is started by attnlab.explorer.testing's `serving(app)` (a thread) or
`explorer_process(ARGS)` (`attnlab explore`). conftest.py's fixtures `models` (these three, once per
test module) and `client` (a TestClient of the explorer serving them) share them between the
explorer's test files; `post` asks a TestClient for JSON. `moe_model` is a fourth, a mixture of
experts, for the router's view (test_explorer_experts.py).
"""

from __future__ import annotations

import torch

import attnlab
from attnlab.tokenizer import Tokenizer

TEXT = "The cat sat on the mat because it was tired."
# a TestClient's base_url: the explorer refuses any Host but a loopback name
LOCAL = "http://127.0.0.1:8000"
PRINTABLE = "".join(chr(i) for i in range(32, 127)) + "\n"


def char_tokenizer() -> Tokenizer:
    return Tokenizer.train_char(PRINTABLE)


def small_models(seed: int = 0) -> dict[str, attnlab.Transformer]:
    torch.manual_seed(seed)
    tok = char_tokenizer()
    V = tok.vocab_size
    configs = {
        "gpt": attnlab.preset("nano", d_vocab=V, n_layers=2, n_heads=4, d_model=32, n_ctx=128),
        "llama": attnlab.preset(
            "llama-tiny",
            d_vocab=V,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_model=32,
            d_mlp=64,
            qk_norm=True,
        ),
        # qk-norm without RoPE: the one case where the explorer applies a module (q_norm) to cached
        # activations
        "bert": attnlab.preset(
            "bert-mini",
            d_vocab=V,
            n_layers=2,
            n_heads=4,
            d_model=32,
            d_mlp=64,
            n_ctx=600,
            qk_norm=True,
        ),
    }
    models = {}
    for name, config in configs.items():
        model = attnlab.Transformer(config).eval()
        # GPT-2 init is nearly uniform attention; bigger weights give patterns worth comparing
        with torch.no_grad():
            for block in model.blocks:
                block.attn.W_Q.weight.mul_(20)
                block.attn.W_K.weight.mul_(20)
        model.tokenizer = tok
        models[name] = model
    return models


def moe_model(seed: int = 0, **overrides) -> attnlab.Transformer:
    """A small random mixture of experts with the character tokenizer (LLaMA-style, Mixtral's
    router: 6 experts, 2 per token, renormalised; `overrides` changes the config, e.g. Qwen2-MoE's
    norm_topk_prob=False and d_shared_expert). The router's weights are scaled up, as
    test_formats_moe.py's are, so that each token's choices stand apart."""
    torch.manual_seed(seed)
    tok = char_tokenizer()
    config = dict(d_vocab=tok.vocab_size, n_layers=3, n_heads=4, n_kv_heads=2, d_model=32)
    config.update(d_mlp=24, n_experts=6, experts_per_token=2, **overrides)
    model = attnlab.Transformer(attnlab.preset("llama-tiny", **config)).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.W_gate.weight.mul_(20)
    model.tokenizer = tok
    return model


def post(client, path: str, **body) -> dict:
    """POST `body` as JSON to the explorer's `path` through a TestClient; the answer, which must be
    a 200."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def snapshot_run(model: attnlab.Transformer, path, start_step: int | None = 10):
    """A 'training run' of `model` in `path`: snapshots at steps 0, 10, 20 whose queries are the
    model's scaled by 0.5, 1 and 1.5 (so every head's pattern sharpens along the slider); the model
    itself is left as it was."""
    from attnlab.explorer.models import Run
    from attnlab.training.snapshots import list_snapshots, save_snapshot

    original = {k: v.clone() for k, v in model.state_dict().items()}
    for step, factor in ((0, 0.5), (10, 1.0), (20, 1.5)):
        with torch.no_grad():
            for layer, block in enumerate(model.blocks):
                block.attn.W_Q.weight.copy_(original[f"blocks.{layer}.attn.W_Q.weight"] * factor)
        save_snapshot(model, path, step)
    model.load_state_dict(original)
    return Run(path, list_snapshots(path), start_step=start_step)
