"""`attnlab compare PATH`: attnlab against transformers on one checkpoint, layer by layer; and
`attnlab convert MODEL OUT`: any model attnlab loads, written by attnlab.save (a GGUF file for
llama.cpp when OUT ends in .gguf, `--dtype f32|f16|q8_0`).

Also the one place the model argument every command takes is described (MODEL_HELP,
add_revision_flag).

Exit code 0 when every difference is within tolerance (output relative to its scale, patterns
absolute), 1 when one is not, 2 for a user's mistake (printed as one line by attnlab.cli).
"""

from __future__ import annotations

import argparse

MODEL_HELP = (
    "a model directory (attnlab or Hugging Face format), a GGUF file, a bundled name (minilm, "
    "smollm2) or a Hugging Face Hub name (gpt2, EleutherAI/pythia-70m)"
)


def add_keep_blocks_flag(parser: argparse.ArgumentParser) -> None:
    """--keep-blocks: a GGUF file's matrices and embedding in blocks as the file's blocks (load's
    keep_blocks)."""
    parser.add_argument(
        "--keep-blocks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a GGUF file's matrices and embedding in blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, "
        "Q5_K, Q6_K) as the file's blocks and multiply them with 8-bit activations, as llama.cpp "
        "does; --no-keep-blocks: dequantized to float32 (default: float32 where it fits in the "
        "memory available, else the blocks)",
    )


def add_revision_flag(parser: argparse.ArgumentParser, what: str = "MODEL") -> None:
    """--revision: which version of a Hub model to load (ignored by nothing: a local model with it
    is an error)."""
    parser.add_argument(
        "--revision",
        default=None,
        metavar="REV",
        help=f"branch, tag or commit of {what} when it is a Hugging Face Hub name (Pythia's "
        "training "
        "checkpoints are branches: step3000); default: the main branch",
    )


def add_commands(sub) -> None:
    parser = sub.add_parser(
        "compare",
        help="compare attnlab with transformers on a checkpoint, layer by layer",
        description="Load PATH (a Hugging Face or attnlab directory, 'minilm' or a Hub name) with "
        "attnlab and with "
        "transformers, run both on a sample input and print the largest difference per layer.",
    )
    parser.add_argument("path", help=MODEL_HELP)
    add_revision_flag(parser, "PATH")
    parser.add_argument(
        "--text", default=None, help="sample text (default: the chapter's sentence about the cat)"
    )
    parser.add_argument(
        "--rtol", type=float, default=1e-4, help="allowed output difference relative to its scale"
    )
    parser.add_argument(
        "--pattern-atol", type=float, default=1e-5, help="allowed attention-pattern difference"
    )
    parser.set_defaults(func=run_compare)

    convert = sub.add_parser(
        "convert",
        help="write a model as a GGUF file for llama.cpp (or another format attnlab.save writes)",
        description="Load MODEL and write it to OUT with attnlab.save: a GGUF file that llama.cpp, "
        "ollama and LM Studio run when OUT ends in .gguf (or --format gguf), else an attnlab or "
        "Hugging Face directory.",
    )
    convert.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    convert.add_argument("out", metavar="OUT", help="the file or directory to write")
    add_revision_flag(convert)
    convert.add_argument(
        "--format",
        default=None,
        help="gguf, hf or attnlab; default: gguf when OUT ends in .gguf, else attnlab",
    )
    convert.add_argument(
        "--dtype",
        default=None,
        help="a GGUF file's matrices: f32 (default, exact), f16 or q8_0 (llama.cpp's 8-bit blocks)",
    )
    # (no argparse choices: attnlab.save checks both and names the ones it takes)
    convert.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    from . import load, save

    model = load(args.model, revision=args.revision)
    path = save(model, args.out, format=args.format, dtype=args.dtype)
    print(f"wrote {path}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from .compare import compare

    result = compare(args.path, text=args.text, revision=args.revision)
    print(
        f"attnlab vs transformers on {args.path} ({result.tokens} tokens, float32, eager attention)"
    )
    print(result.table())
    worst_pattern = max(result.pattern, default=0.0)
    ok = result.output_relative <= args.rtol and worst_pattern <= args.pattern_atol
    print(
        "match"
        if ok
        else f"MISMATCH: output relative {result.output_relative:.3e} (allowed {args.rtol:g}), "
        f"pattern {worst_pattern:.3e} (allowed {args.pattern_atol:g})"
    )
    return 0 if ok else 1
