"""`attnlab experiment coreference`: which heads send a pronoun to its antecedent?

On the bundled pretrained MiniLM (`attnlab.load("minilm")`, a BERT-style encoder) and a small
built-in
set of sentence pairs: in each pair the two sentences share their nouns and differ in the end, which
changes what the pronoun refers to ("The cat sat on the mat because it was tired." -> cat; "...
because it was soft." -> mat). So a head that always picks the first noun, or the nearest one, is
right half of
the time: the pairs are each other's control.

Design choices:
- A head "gets a sentence right" when the pronoun's attention to the antecedent (summed over its
  sub-word tokens) is larger than to the other noun. Accuracy is over all sentences; the table also
  shows it on each half (antecedent = first noun / second noun), which exposes positional heads.
- Words are located by character offsets from the tokenizer, so any tokenizer works (WordPiece,
  byte-level BPE, characters); the model can be any attnlab Transformer with a tokenizer.
- Patterns come from one `run_with_cache` per sentence, keeping only the pattern hooks.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ...errors import UserError
from ...formats import load
from ...generate.fast_layers import inference_layers
from .common import format_table, new_figure, save_figure, write_outputs

# (sentence, pronoun, antecedent, the other noun); pairs share their nouns and flip the antecedent.
SENTENCES: tuple[tuple[str, str, str, str], ...] = (
    ("The cat sat on the mat because it was tired.", "it", "cat", "mat"),
    ("The cat sat on the mat because it was soft.", "it", "mat", "cat"),
    ("The trophy did not fit in the suitcase because it was too big.", "it", "trophy", "suitcase"),
    (
        "The trophy did not fit in the suitcase because it was too small.",
        "it",
        "suitcase",
        "trophy",
    ),
    ("The bird ate the seed because it was hungry.", "it", "bird", "seed"),
    ("The bird ate the seed because it was tasty.", "it", "seed", "bird"),
    ("The car hit the tree because it was going too fast.", "it", "car", "tree"),
    ("The car hit the tree because it stood in the road.", "it", "tree", "car"),
    ("The horse jumped over the fence because it was brave.", "it", "horse", "fence"),
    ("The horse jumped over the fence because it was low.", "it", "fence", "horse"),
    ("The boat sank in the lake because it had a hole.", "it", "boat", "lake"),
    ("The boat crossed the lake because it was calm.", "it", "lake", "boat"),
    ("The baby dropped the toy because it was sleepy.", "it", "baby", "toy"),
    ("The baby dropped the toy because it was heavy.", "it", "toy", "baby"),
    ("The knife cut the bread because it was sharp.", "it", "knife", "bread"),
    ("The knife cut the bread because it was soft.", "it", "bread", "knife"),
    ("The lamp lit the room because it was bright.", "it", "lamp", "room"),
    ("The lamp lit the room because it was dark.", "it", "room", "lamp"),
    ("The cup broke on the floor because it was fragile.", "it", "cup", "floor"),
    ("The cup broke on the floor because it was hard.", "it", "floor", "cup"),
    ("The dog chased the ball until it was exhausted.", "it", "dog", "ball"),
    ("The dog chased the ball until it stopped rolling.", "it", "ball", "dog"),
    ("The phone fell off the table and it broke.", "it", "phone", "table"),
    ("The phone fell off the table because it was tilted.", "it", "table", "phone"),
)


def word_tokens(offsets: list[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the tokens whose character span lies inside [start, end) (special tokens have
    empty spans)."""
    return [i for i, (a, b) in enumerate(offsets) if b > a and a >= start and b <= end]


def locate(
    text: str, offsets: list[tuple[int, int]], pronoun: str, antecedent: str, other: str
) -> dict[str, list[int]]:
    """Token indices of the pronoun (its last occurrence) and of the two nouns (their first
    occurrence)."""

    def span(word: str, last: bool) -> tuple[int, int]:
        found = list(re.finditer(rf"\b{re.escape(word)}\b", text, flags=re.IGNORECASE))
        if not found:
            raise UserError(f"the word {word!r} is not in the sentence {text!r}")
        m = found[-1] if last else found[0]
        return m.start(), m.end()

    where = {
        "pronoun": span(pronoun, True),
        "antecedent": span(antecedent, False),
        "other": span(other, False),
    }
    tokens = {k: word_tokens(offsets, *v) for k, v in where.items()}
    for k, v in tokens.items():
        if not v:
            raise UserError(
                f"no token covers the {k} in {text!r}; the tokenizer's offsets do not match the "
                "text"
            )
    return tokens


def head_votes(
    patterns: torch.Tensor, tokens: dict[str, list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """patterns [layer, head, query_pos, key_pos] of one sentence -> (correct [layer, head] bool,
    attention to the antecedent).

    The pronoun's attention to a word is the sum over the word's tokens; with several pronoun
    tokens, their mean.
    """
    rows = patterns[:, :, tokens["pronoun"]].mean(2)  # [layer, head, key_pos]
    to_antecedent = rows[..., tokens["antecedent"]].sum(-1)
    to_other = rows[..., tokens["other"]].sum(-1)
    return to_antecedent > to_other, to_antecedent


def score_heads(model, sentences=SENTENCES) -> dict:
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise UserError(
            "the coreference experiment needs a model with a tokenizer (tokenizer.json next to "
            "the weights)"
        )
    n_layers, n_heads = model.config.n_layers, model.config.n_heads
    correct = torch.zeros(len(sentences), n_layers, n_heads, dtype=torch.bool)
    mass = torch.zeros(len(sentences), n_layers, n_heads)
    first_noun = torch.zeros(len(sentences), dtype=torch.bool)
    for i, (text, pronoun, antecedent, other) in enumerate(sentences):
        encoding = tokenizer.backend.encode(text)
        tokens = locate(text, encoding.offsets, pronoun, antecedent, other)
        first_noun[i] = tokens["antecedent"][0] < tokens["other"][0]
        ids = torch.tensor([encoding.ids], device=model.device)
        with torch.no_grad(), inference_layers(model, ids):
            _, cache = model.run_with_cache(
                ids, names_filter=lambda name: name.endswith("attn.hook_pattern")
            )
        # [layer, head, query_pos, key_pos]
        patterns = cache.stack("blocks.{}.attn.hook_pattern")[:, 0].float().cpu()
        correct[i], mass[i] = head_votes(patterns, tokens)
    accuracy = correct.float().mean(0)
    return {
        "accuracy": accuracy,  # [layer, head]
        "accuracy_first_noun": correct[first_noun].float().mean(0),
        "accuracy_second_noun": correct[~first_noun].float().mean(0),
        "attention_to_antecedent": mass.mean(0),
        "correct": correct,
    }


def run(
    out: Path,
    *,
    seed: int = 0,
    quick: bool = False,
    model=None,
    model_name: str = "minilm",
    revision: str | None = None,
    top: int = 8,
) -> dict:
    """`model` overrides `model_name` (tests pass a small one). seed and quick are accepted for a
    uniform CLI; nothing here is random."""
    if model is None:
        model = load(model_name, revision=revision)
    model.eval()
    scores = score_heads(model)
    acc = scores["accuracy"]
    order = acc.flatten().argsort(descending=True).tolist()
    n_heads = model.config.n_heads
    best = []
    for index in order[:top]:
        layer, head = divmod(index, n_heads)
        best.append(
            {
                "layer": layer,
                "head": head,
                "accuracy": float(acc[layer, head]),
                "accuracy_first_noun": float(scores["accuracy_first_noun"][layer, head]),
                "accuracy_second_noun": float(scores["accuracy_second_noun"][layer, head]),
                "attention_to_antecedent": float(scores["attention_to_antecedent"][layer, head]),
            }
        )
    layer, head = best[0]["layer"], best[0]["head"]
    result = {
        "experiment": "coreference",
        "model": model_name if model is None or model_name else "given",
        "n_sentences": len(SENTENCES),
        "rule": "a head is right on a sentence when the pronoun attends more to the antecedent "
        "than to the other noun",
        "chance": 0.5,
        "best_heads": best,
        "per_sentence_best_head": [
            {"sentence": s[0], "antecedent": s[2], "right": bool(scores["correct"][i, layer, head])}
            for i, s in enumerate(SENTENCES)
        ],
        "accuracy": scores["accuracy"],
        "heads_at_least_75_percent": int((acc >= 0.75).sum()),
        "n_heads_total": acc.numel(),
    }
    write_outputs(out, "coreference", result, plot)
    return result


def plot(result: dict, path: Path) -> None:
    acc = torch.as_tensor(result["accuracy"])
    fig, axes = new_figure(1, 1, (1.2 + 0.45 * acc.shape[1], 1.2 + 0.45 * acc.shape[0]))
    ax = axes[0][0]
    image = ax.imshow(acc.numpy(), vmin=0, vmax=1, cmap="viridis")
    for (l, h), v in ((divmod(i, acc.shape[1]), float(x)) for i, x in enumerate(acc.flatten())):
        ax.text(
            h,
            l,
            f"{v:.2f}",
            ha="center",
            va="center",
            fontsize=6,
            color="white" if v < 0.6 else "black",
        )
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(
        f"pronoun -> antecedent, fraction right of {result['n_sentences']} sentences (chance 0.5)",
        fontsize=9,
    )
    fig.colorbar(image, ax=ax, shrink=0.8)
    save_figure(fig, path)


def table(result: dict) -> str:
    rows = [
        [
            f"L{b['layer']}H{b['head']}",
            b["accuracy"],
            b["accuracy_first_noun"],
            b["accuracy_second_noun"],
            b["attention_to_antecedent"],
        ]
        for b in result["best_heads"]
    ]
    text = format_table(
        ["head", "right", "right (1st noun)", "right (2nd noun)", "attn to antecedent"], rows
    )
    return text + (
        f"\n{result['heads_at_least_75_percent']} of {result['n_heads_total']} heads are right on "
        "at least 75% "
        f"of {result['n_sentences']} sentences (chance: 50%)"
    )
