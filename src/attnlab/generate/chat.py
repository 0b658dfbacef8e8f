"""`attnlab chat MODEL`: a multi-turn chat in the terminal, each reply streamed as it is written.

Design choices:
- The conversation goes through the model's own chat template
  (attnlab.formats.gguf_tokenizer.chat_ids: a GGUF file carries one), re-rendered whole each turn,
  so the model always sees exactly the template's text.
- Ctrl-C during a reply ends that reply, not the session: the words written so far stay in the
  conversation (the model sees what the user saw). Ctrl-C or Ctrl-D (end of input) at the prompt
  ends the session.
- Each reply ends at the end-of-turn token (the model's eos_token_id), or after --max-new-tokens; a
  conversation that outgrows the context is one line asking to start over (no silent truncation of
  earlier turns).
"""

from __future__ import annotations

import argparse
import sys

from ..errors import UserError


def run_chat(args: argparse.Namespace, read=input, out=None) -> int:
    import torch

    from ..formats import load
    from ..formats.gguf_tokenizer import chat_ids
    from .loop import generate
    from .sample import TextStream

    out = out if out is not None else sys.stdout
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    model = load(args.model, revision=args.revision, keep_blocks=args.keep_blocks)
    if not model.config.causal:
        raise UserError(
            f"{args.model} is an encoder (BERT-style) model; chatting needs a causal language model"
        )
    # no template: one line before the first question
    chat_ids(model, [{"role": "user", "content": ""}])
    end_of_turn = model.config.extra.get("eos_token_id")
    print(
        "(Ctrl-C stops a reply; Ctrl-D or Ctrl-C at the prompt ends the chat)", file=out, flush=True
    )
    messages: list[dict[str, str]] = []
    while True:
        try:
            text = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=out)
            return 0
        messages.append({"role": "user", "content": text})
        ids = torch.tensor([chat_ids(model, messages)])
        stream, reply = TextStream(model.tokenizer, file=out), []

        def show(token) -> None:
            if token[0].item() != end_of_turn:
                reply.append(token[0].item())
                stream.push(token[0].tolist())

        budget = min(args.max_new_tokens, model.config.n_ctx - ids.shape[1])
        try:
            generate(
                model,
                ids,
                budget,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed + len(messages),
                eos_token_id=end_of_turn,
                on_token=show,
            )
        except KeyboardInterrupt:
            stream.finish()
            print(" [stopped]", file=out, end="")
        else:
            stream.finish()
        print(file=out, flush=True)
        messages.append({"role": "assistant", "content": model.tokenizer.decode(reply)})


def add_commands(sub: argparse._SubParsersAction) -> None:
    from ..formats.cli import MODEL_HELP, add_keep_blocks_flag, add_revision_flag

    c = sub.add_parser("chat", help="chat with a model in the terminal, through its chat template")
    c.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    add_revision_flag(c)
    add_keep_blocks_flag(c)
    c.add_argument("--max-new-tokens", type=int, default=512, help="the longest reply, in tokens")
    c.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    c.add_argument("--top-k", type=int, default=50)
    c.add_argument("--top-p", type=float, default=None)
    c.add_argument("--seed", type=int, default=1337)
    c.set_defaults(func=run_chat)
