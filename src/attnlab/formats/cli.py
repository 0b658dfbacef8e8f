"""`attnlab compare PATH`: attnlab against transformers on one checkpoint, layer by layer.

Exit code 0 when every difference is within tolerance (output relative to its scale, patterns absolute),
1 when one is not, 2 for a user's mistake (printed as one line by attnlab.cli).
"""

from __future__ import annotations

import argparse


def add_commands(sub) -> None:
    parser = sub.add_parser(
        "compare", help="compare attnlab with transformers on a checkpoint, layer by layer",
        description="Load PATH (a Hugging Face or attnlab directory, or 'minilm') with attnlab and with "
                    "transformers, run both on a sample input and print the largest difference per layer.",
    )
    parser.add_argument("path", help="model directory, or 'minilm' for the bundled MiniLM")
    parser.add_argument("--text", default=None, help="sample text (default: the chapter's sentence about the cat)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="allowed output difference relative to its scale")
    parser.add_argument("--pattern-atol", type=float, default=1e-5, help="allowed attention-pattern difference")
    parser.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from .compare import compare

    result = compare(args.path, text=args.text)
    print(f"attnlab vs transformers on {args.path} ({result.tokens} tokens, float32, eager attention)")
    print(result.table())
    worst_pattern = max(result.pattern, default=0.0)
    ok = result.output_relative <= args.rtol and worst_pattern <= args.pattern_atol
    print("match" if ok else f"MISMATCH: output relative {result.output_relative:.3e} (allowed {args.rtol:g}), "
                             f"pattern {worst_pattern:.3e} (allowed {args.pattern_atol:g})")
    return 0 if ok else 1
