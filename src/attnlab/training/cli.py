"""`attnlab train` (its sibling `attnlab sample` is attnlab.generate.sample).

Design choices:
- `train`'s flags are generated from TrainConfig (attnlab.training.config.add_flags); `--preset`,
  `--config`, `--resume` and `--overwrite` choose where the values come from and what happens to an
  existing run. On --resume the run's saved config is the base, so `--out DIR --resume` alone
  continues it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def run_train(args: argparse.Namespace) -> int:
    from .checkpoint import find_checkpoint
    from .config import TrainConfig, build_config
    from .trainer import train

    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if hasattr(args, f.name)
    }
    cfg = build_config(args.preset, args.config, overrides)
    checkpoint = None
    if args.resume:
        checkpoint = find_checkpoint(
            cfg.out, required=args.resume != "auto", announce=_is_main_process()
        )
        if checkpoint is not None:
            cfg = build_config(args.preset, args.config, overrides, base=checkpoint.train_config)
    result = train(
        cfg,
        resume=args.resume,
        overwrite=args.overwrite,
        progress=not args.quiet,
        checkpoint=checkpoint,
    )
    if not _is_main_process():
        return 0
    if result.complete:
        print(result.complete)
        return 0
    if result.interrupted:
        print(
            f"interrupted at step {result.iters}; the checkpoint is saved in {result.out}; "
            f"continue with: attnlab train --out {result.out} --resume",
            file=sys.stderr,
        )
        return 130
    losses = (
        f"train loss {result.train_loss:.4f}, val loss {result.val_loss:.4f}"
        if result.val_loss is not None
        else ""
    )
    print(
        f"trained {result.iters} steps in {result.elapsed_s:.1f} s ({result.tokens_per_s:,.0f} "
        f"tokens/s): {losses}"
    )
    print(
        f"checkpoint, metrics.jsonl, loss.png and report.md in {result.out}; sample it: attnlab "
        f"sample {result.out}"
    )
    return 0


def _resume_mode(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', not {value!r}")
    return value


def _is_main_process() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from .config import TRAIN_PRESETS, add_flags

    p = sub.add_parser(
        "train",
        help="train a GPT-style model on text (nanoGPT's flags; works under torchrun)",
        description="Train a GPT-style model on a text file, a folder of .txt files or the "
        "built-in "
        "corpus. Flags take nanoGPT's names; precedence: defaults < --preset < --config < flags.",
    )
    p.add_argument(
        "--preset", choices=list(TRAIN_PRESETS), default=None, help="a named starting configuration"
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="TOML or JSON file with the same keys as the flags",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_mode,
        metavar="auto",
        help="continue the run in --out exactly where it stopped; --resume auto: continue if "
        "--out holds "
        "a checkpoint, else start fresh (for restarts under torchrun --max-restarts)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="start over even if --out holds a checkpoint"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_flags(p)
    p.set_defaults(func=run_train)
