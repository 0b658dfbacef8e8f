"""Quality of int8 weights: validation loss of a trained model in float32 and after
attnlab.quantize(model, "int8").

    .venv/bin/python -m attnlab train --data tinyshakespeare.txt --out runs/ts --preset cpu
    --max-iters 600 .venv/bin/python benchmarks/quantize_quality.py runs/ts

Design choices:
- The loss is the mean next-token cross-entropy over the *whole* validation split (nanoGPT's last 10
  % of the token stream), in non-overlapping windows of the model's context, the same windows for
  both models: no sampling noise between the two figures, so their difference is the quantization's
  alone.
- Also reported: the greedy continuation of a prompt, how many of its tokens the int8 model shares,
  and the largest logit difference relative to the logits' spread.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line  # noqa: E402

import attnlab  # noqa: E402
from attnlab.training.data import TokenData  # noqa: E402


@torch.no_grad()
def val_loss(model, tokens: torch.Tensor, window: int, batch: int = 32) -> float:
    """Mean cross-entropy of every next token in the validation split, windows of `window`
    tokens."""
    n = (len(tokens) - 1) // window
    inputs = tokens[: n * window].view(n, window)
    targets = tokens[1 : n * window + 1].view(n, window)
    total = 0.0
    for i in range(0, n, batch):
        logits = model(inputs[i : i + batch])
        total += float(
            F.cross_entropy(logits.flatten(0, 1), targets[i : i + batch].flatten(), reduction="sum")
        )
    return total / (n * window)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a training run's directory (attnlab train --out)")
    parser.add_argument("--new-tokens", type=int, default=500)
    args = parser.parse_args()
    run = Path(args.run)
    model = attnlab.load(run)
    quantized = attnlab.quantize(copy.deepcopy(model), "int8")
    tokens = torch.from_numpy(TokenData.open(run).split("val").astype("int64"))
    window = model.config.n_ctx
    full, int8 = val_loss(model, tokens, window), val_loss(quantized, tokens, window)
    print(f"# int8 weight quality\n{machine_line()}")
    print(
        f"{run}: {model.num_params() / 1e6:.2f}M parameters, validation split {len(tokens):,} "
        f"tokens, windows of {window}"
    )
    print(f"| model | val loss | × float32 |\n|---|---:|---:|\n| float32 | {full:.4f} | 1.0000 |")
    print(f"| int8 weights (attnlab.quantize) | {int8:.4f} | {int8 / full:.4f} |")
    prompt = tokens[:16].unsqueeze(0)
    a = model.generate(prompt, args.new_tokens, temperature=0)
    b = quantized.generate(prompt, args.new_tokens, temperature=0)
    differ = (a != b).nonzero()
    same = (int(differ[0, -1]) if len(differ) else a.shape[-1]) - prompt.shape[-1]
    with torch.no_grad():
        ref, out = model(a[:, :window]), quantized(a[:, :window])
    print(
        f"\ngreedy, {args.new_tokens} tokens from a validation prompt: int8 shares the first "
        f"{same}; teacher-forced "
        f"logits differ by at most {float((ref - out).abs().max() / ref.std()):.3f} × their std, "
        "top-1 agrees at "
        f"{float((ref.argmax(-1) == out.argmax(-1)).float().mean()):.1%} of {ref.shape[1]} "
        "positions"
    )


if __name__ == "__main__":
    main()
