"""`attnlab demo`: the main job on built-in defaults (no download).

For now it shows the chapter's "A B C" walk-through on a tiny model: the causal pattern is
lower-triangular and each row sums to 1.
"""

from __future__ import annotations

import argparse

import torch


def run_demo(args: argparse.Namespace) -> int:
    from . import Transformer, preset

    torch.manual_seed(args.seed)
    tokens = ["A", "B", "C"]
    model = Transformer(preset("nano", d_vocab=len(tokens), n_layers=1, n_heads=1, d_model=16)).eval()
    _, cache = model.run_with_cache(torch.arange(len(tokens))[None], names_filter="blocks.0.attn.hook_pattern")
    pattern = cache["blocks.0.attn.hook_pattern"][0, 0]  # [query_pos, key_pos]
    print("causal attention pattern of 'A B C' (rows: queries, columns: keys)")
    print("      " + "".join(f"{t:>8}" for t in tokens))
    for t, row in zip(tokens, pattern.tolist()):
        print(f"{t:>6}" + "".join(f"{w:8.3f}" for w in row))
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="the main job on built-in defaults")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_demo)
