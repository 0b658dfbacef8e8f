"""Small random models with a character tokenizer, for the explorer's tests (imported by test_explorer_*.py).

Three architectures cover the explorer's branches: a GPT-style decoder (learned positions, pre-norm),
a LLaMA-style decoder (RoPE, grouped-query, qk-norm, SwiGLU) and a BERT-style post-norm encoder (with
qk-norm, which the explorer must apply itself when there is no RoPE hook after it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from contextlib import contextmanager

import torch

import attnlab
from attnlab.tokenizer import Tokenizer

TEXT = "The cat sat on the mat because it was tired."
PRINTABLE = "".join(chr(i) for i in range(32, 127)) + "\n"


def char_tokenizer() -> Tokenizer:
    return Tokenizer.train_char(PRINTABLE)


def small_models(seed: int = 0) -> dict[str, attnlab.Transformer]:
    torch.manual_seed(seed)
    tok = char_tokenizer()
    V = tok.vocab_size
    configs = {
        "gpt": attnlab.preset("nano", d_vocab=V, n_layers=2, n_heads=4, d_model=32, n_ctx=128),
        "llama": attnlab.preset("llama-tiny", d_vocab=V, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32, d_mlp=64,
                                qk_norm=True),
        # qk-norm without RoPE: the one case where the explorer applies a module (q_norm) to cached activations
        "bert": attnlab.preset("bert-mini", d_vocab=V, n_layers=2, n_heads=4, d_model=32, d_mlp=64, n_ctx=600, qk_norm=True),
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


@contextmanager
def running_explorer(*args: str, **popen):
    """Start `attnlab explore ARGS --port 0` in a new process; yield the URL it prints; stop it on exit."""
    process = subprocess.Popen([sys.executable, "-m", "attnlab", "explore", *args, "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    try:
        line = process.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert url, (line, process.stderr.read() if process.poll() is not None else "")
        yield url.group(0)
    finally:
        process.terminate()
        process.wait(timeout=30)
        process.stdout.close()
        process.stderr.close()
