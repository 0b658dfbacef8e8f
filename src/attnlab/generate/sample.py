"""`attnlab sample`: text from a trained or loaded model, streamed as it is written.

Design choices:
- `sample` loads anything `attnlab.load` reads (attnlab checkpoints, Hugging Face-format
  directories), encodes the prompt with the model's own tokenizer and streams text as tokens are
  chosen (generate's `on_token`), KV-cached. A generation longer than the model's context slides a
  window: when the cache is full it restarts from the last n_ctx/2 tokens, as nanoGPT's sampler
  crops its context.
- Byte-level tokens can end inside a UTF-8 character, so the stream prints what decodes cleanly so
  far and holds back a trailing partial character until the next token completes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..env import capped
from ..errors import UserError


# sample
# -----------------------------------------------------------------------------------------------
class TextStream:
    """Prints the decoded text of a growing list of token ids, holding back an unfinished UTF-8
    character.

    Each push decodes a short window, not the whole list, so streaming n tokens costs O(n)
    (incremental detokenisation, as vLLM and TGI do it): the new text is decode(ids[start:]) minus
    decode(ids[start:end]), where ids[:end] are printed and `start` is where the previous print
    began. The window always opens on a token already printed, so a decoder's special case for the
    first token (Metaspace drops its leading space) falls on text that is cut off, never on the new
    text."""

    def __init__(self, tokenizer, file=None) -> None:
        self.tokenizer, self.file = tokenizer, file if file is not None else sys.stdout
        self.ids: list[int] = []
        self.start = self.end = 0  # ids[:end] are printed; the window to decode starts at `start`

    def _new_text(self) -> str:
        printed = self.tokenizer.decode(self.ids[self.start : self.end])
        return self.tokenizer.decode(self.ids[self.start :])[len(printed) :]

    def _write(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()
        self.start, self.end = self.end, len(self.ids)

    def push(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        text = self._new_text()
        # a byte-level token stopped mid-character: wait for the rest
        if text and not text.endswith("\ufffd"):
            self._write(text)

    def finish(self) -> str:
        """Print what is held back; return the text of all ids."""
        self._write(self._new_text())
        return self.tokenizer.decode(self.ids)


def generate_windowed(model, ids, max_new_tokens: int, *, seed: int | None, on_token, **sampling):
    """generate(), sliding the context when prompt + new tokens exceed n_ctx (restart from the last
    n_ctx/2)."""
    import torch

    from .loop import generate

    n_ctx = model.config.n_ctx
    produced, remaining, window = ids, max_new_tokens, 0
    while remaining > 0:
        context = produced if produced.shape[1] < n_ctx else produced[:, -(n_ctx // 2) :]
        n = min(remaining, n_ctx - context.shape[1])
        step_seed = None if seed is None else seed + 7919 * window
        out = generate(model, context, n, seed=step_seed, on_token=on_token, **sampling)
        produced = torch.cat([produced, out[:, context.shape[1] :]], dim=1)
        remaining -= n
        window += 1
    return produced


def read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise UserError("give either --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise UserError(
                f"--prompt-file {path}: "
                f"{'a folder, not a file' if path.is_dir() else 'no such file'}"
            )
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise UserError(f"--prompt-file {path}: not UTF-8 text") from None
    return args.prompt if args.prompt is not None else "\n"


def encode_prompt(model, prompt: str) -> list[int]:
    """The prompt's ids under the model's tokenizer, checked against the model's vocabulary and
    context."""
    if model.tokenizer is None:
        raise UserError(
            "this model directory has no tokenizer.json, so text cannot be encoded; add the "
            "tokenizer "
            "it was trained with"
        )
    ids = model.tokenizer.encode(prompt)  # a char model names characters it never saw (UserError)
    if not ids:
        raise UserError("the prompt encodes to no tokens; give some text with --prompt")
    n_ctx = model.config.n_ctx
    if len(ids) > n_ctx:
        raise UserError(
            f"the prompt is {len(ids)} tokens but the model's context is n_ctx={n_ctx}; "
            f"shorten it to at most {n_ctx} tokens (keep its end)"
        )
    return ids


def run_sample(args: argparse.Namespace) -> int:
    import torch

    from ..devices import resolve_device
    from ..formats import load

    if args.num_samples <= 0:
        raise UserError(f"--num-samples must be a positive integer, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    max_new_tokens = capped(args.max_new_tokens, "ATTNLAB_MAX_NEW_TOKENS", "the tokens of a sample")
    if args.chat is not None and (args.prompt is not None or args.prompt_file is not None):
        raise UserError("give either --chat or --prompt / --prompt-file, not both")
    prompt = read_prompt(args)
    device = resolve_device(args.device)
    model = load(args.dir, device=str(device), revision=args.revision, keep_blocks=args.keep_blocks)
    if not model.config.causal:
        raise UserError(
            f"{args.dir} is an encoder (BERT-style) model; sampling needs a causal language model"
        )
    if args.bf16_weights:
        from ..quant.quantize import store_weights_as

        store_weights_as(model, torch.bfloat16)
    if args.quantize:
        from ..quant.quantize import quantize

        quantize(model, args.quantize)
    end_of_turn = None
    if args.chat is not None:  # the reply alone, up to the end-of-turn token
        from ..formats.gguf_tokenizer import chat_ids

        messages = [{"role": "user", "content": args.chat}]
        ids = torch.tensor([chat_ids(model, messages)], device=device)
        end_of_turn = model.config.extra.get("eos_token_id")
    else:
        ids = torch.tensor([encode_prompt(model, prompt)], device=device)
    for i in range(args.num_samples):
        if i:
            print("\n---------------")
        stream = TextStream(model.tokenizer)
        if args.chat is None:  # the prompt as written: without the BOS its tokenizer adds (Gemma)
            stream.push(model.tokenizer.encode(prompt, add_special_tokens=False))

        # the end-of-turn token ends the reply and is not part of it
        def show(token, stream=stream) -> None:
            if token[0].item() != end_of_turn:
                stream.push(token[0].tolist())

        seed = None if args.seed is None else args.seed + i
        generate_windowed(
            model,
            ids,
            max_new_tokens,
            seed=seed,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            compile=args.compile,
            eos_token_id=end_of_turn,
            on_token=show,
        )
        stream.finish()
    print()
    return 0


def add_commands(sub: argparse._SubParsersAction) -> None:
    from ..formats.cli import MODEL_HELP, add_keep_blocks_flag, add_revision_flag

    s = sub.add_parser(
        "sample", help="generate text from a trained or loaded model, streamed as it is written"
    )
    s.add_argument("dir", metavar="MODEL", help=MODEL_HELP)
    add_revision_flag(s)
    s.add_argument("--prompt", default=None, help="text to continue (default: a newline)")
    s.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
    s.add_argument(
        "--chat",
        default=None,
        metavar="TEXT",
        help="one user message, put through the model's chat template (a GGUF file carries one); "
        "prints the reply, up to the end of the turn",
    )
    s.add_argument("--max-new-tokens", type=int, default=500)
    s.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    s.add_argument("--top-k", type=int, default=200)
    s.add_argument("--top-p", type=float, default=None)
    s.add_argument("--seed", type=int, default=1337)
    s.add_argument("--num-samples", type=int, default=1)
    s.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    s.add_argument(
        "--compile",
        action="store_true",
        help="decode through torch.compile (the decode step compiled before the first new token)",
    )
    s.add_argument(
        "--bf16-weights",
        action="store_true",
        help="store the weight matrices in bfloat16 (half the bytes per token), compute in float32",
    )
    s.add_argument(
        "--quantize",
        choices=["int8", "q8_0", "q4_0", "q4_1"],  # quant.quantize.QUANTIZATIONS (a test compares)
        default=None,
        help="int8: weight matrices in 8 bits with a scale per row (a quarter of the bytes), "
        "compute in float32; q8_0, q4_0, q4_1: llama.cpp's blocks of 32 weights, multiplied with "
        "8-bit activations as llama.cpp does",
    )
    add_keep_blocks_flag(s)
    s.set_defaults(func=run_sample)
