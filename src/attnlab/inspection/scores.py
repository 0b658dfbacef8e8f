"""Head scores: which heads look back one token, which do induction, which copy (Olsson et al.
2022).

Design choices:
- Every attention score is one function, `attention_to(pattern, targets)`: the attention mass a
  query puts on its target keys, averaged over the queries that have a target. The scores differ
  only in their targets, built from the tokens:
    previous-token   key i − 1;
    first-token      key 0 (the "attention sink"), for queries i ≥ 1;
    duplicate-token  earlier keys j < i holding the same token as query i;
    induction        keys j ≤ i right after an earlier occurrence of the query's token (tokens[j−1]
    = tokens[i],
                     j − 1 < i): Olsson et al.'s "prefix matching";
    local-window     the query itself and the LOCAL_WINDOW − 1 keys before it, for queries
                     i ≥ LOCAL_WINDOW (so key 0, the sink, is never in a scored window).
  So a pure previous-token pattern scores exactly 1 and a uniform (non-causal) T×T pattern scores
  1/T.
- The input is Olsson et al.'s: random tokens (fixed seed; special tokens of the model's tokenizer
  left out) repeated `n_repeats` times, so induction and duplicates have exact, known targets.
- Scores read the patterns and never write to them, one layer at a time as the forward pass makes
  them (`score_patterns`, a hook on each hook_pattern), so only one layer's T × T patterns exist at
  once. The same function scores the random tokens (`head_scores`, `attnlab heads`) and any text
  (`score_patterns(model, ids)`, the explorer's atlas on its current text).
- Copying score (weights only, models with an unembedding): for each head the OV circuit
  W_E · W_V^h · W_O^h · W_U (d_vocab × d_vocab) maps the attended token to the logits it raises.
  Its score is Σλ / Σ|λ| over the circuit's eigenvalues (Elhage et al. 2021, "A Mathematical
  Framework", the measure Olsson et al. use): 1 when every eigenvalue is positive (pure copying),
  −1 for anti-copying. The circuit has rank ≤ d_head, and its non-zero eigenvalues are those of
  the d_head × d_head product W_O^h · W_U · W_E · W_V^h (eig(AB) = eig(BA)), so it is computed at
  that size. Norm gains (ln1's before W_V, the final norm's before W_U) are folded in as diagonal
  scalings; biases and the norms' centring and division are left out, as in those papers.
- The copying score holds no float copy of the vocabulary or of every layer: W_U · W_E is summed
  over slices of vocabulary rows (dequantized from a GGUF file's blocks slice by slice), then each
  layer is taken in turn; what it holds is `copying_bytes`, checked before it starts against the
  memory the machine reports. Where that does not fit, the copying score is left out (NaN) with one
  warning line and a note in the result naming both figures; the attention scores still come.
- "Standout" heads are those above a fixed threshold per score (STANDOUT), so a random model shows
  none.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from .. import memory
from ..errors import UserError
from ..generate.fast_layers import inference_layers
from ..quant.blocks import weight_rows

# A head stands out when its score reaches this (chosen so that a freshly initialised model has
# none).
STANDOUT = {
    "previous_token": 0.5,
    "induction": 0.3,
    "duplicate_token": 0.3,
    "first_token": 0.8,
    "local_window": 0.8,
    "copying": 0.7,
}
# the local-window score's window: the query and the 3 keys before it
LOCAL_WINDOW = 4


# Targets
# ------------------------------------------------------------------------------------------------
def previous_token_targets(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, T) bool: query i targets key i − 1."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril(-1).triu(-1)


def first_token_targets(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, T) bool: queries i ≥ 1 target key 0."""
    targets = torch.zeros(T, T, dtype=torch.bool, device=device)
    targets[1:, 0] = True
    return targets


def local_window_targets(
    T: int, window: int = LOCAL_WINDOW, device: torch.device | str | None = None
) -> torch.Tensor:
    """(T, T) bool: queries i ≥ window target keys i − window + 1 ... i (themselves included)."""
    band = torch.ones(T, T, dtype=torch.bool, device=device).tril().triu(-(window - 1))
    band[:window] = False
    return band


def duplicate_token_targets(tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B, T) -> (B, T, T) bool: key j < i holds the same token as query i."""
    same = tokens[:, :, None] == tokens[:, None, :]  # [batch, query_pos, key_pos]
    return same & _strictly_earlier(tokens)


def induction_targets(tokens: torch.Tensor) -> torch.Tensor:
    """tokens (B, T) -> (B, T, T) bool: key j follows an earlier occurrence of query i's token
    (tokens[j−1] = tokens[i], j ≤ i)."""
    B, T = tokens.shape
    targets = torch.zeros(B, T, T, dtype=torch.bool, device=tokens.device)
    # key j = (earlier occurrence at j − 1) + 1; j − 1 < i, so j ≤ i
    targets[:, :, 1:] = duplicate_token_targets(tokens)[:, :, :-1]
    return targets


def _strictly_earlier(tokens: torch.Tensor) -> torch.Tensor:
    T = tokens.shape[-1]
    return torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril(-1)


# The one score
# --------------------------------------------------------------------------------------------
def attention_to(pattern: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean attention mass on the targets, over the queries that have at least one target.

    pattern: [batch, head, query_pos, key_pos]; targets: bool [query_pos, key_pos] or [batch,
    query_pos, key_pos].
    Returns [head]. Reads `pattern` only.
    """
    if targets.dim() == 2:
        targets = targets.expand(pattern.shape[0], *targets.shape)
    targets = targets.to(pattern.device)
    has_target = targets.any(-1)  # [batch, query_pos]
    if not bool(has_target.any()):
        return torch.full(pattern.shape[1:2], float("nan"))
    mass = (pattern * targets[:, None].to(pattern.dtype)).sum(-1)  # [batch, head, query_pos]
    weights = has_target[:, None].to(pattern.dtype)
    return ((mass * weights).sum((0, 2)) / weights.sum((0, 2))).float()


def pattern_scores(pattern: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """The five attention scores of one layer's pattern [batch, head, T, T] on `tokens` (B, T):
    name -> [head]."""
    T = tokens.shape[-1]
    return {
        "previous_token": attention_to(pattern, previous_token_targets(T)),
        "induction": attention_to(pattern, induction_targets(tokens)),
        "duplicate_token": attention_to(pattern, duplicate_token_targets(tokens)),
        "first_token": attention_to(pattern, first_token_targets(T)),
        "local_window": attention_to(pattern, local_window_targets(T)),
    }


def score_patterns(model, tokens: torch.Tensor, hooks=()) -> dict[str, torch.Tensor]:
    """`pattern_scores` of every layer of `model` on `tokens` (B, T): name -> [n_layers, n_heads].

    Each layer's pattern is scored as the forward pass makes it (a hook on every hook_pattern) and
    then dropped, so one layer's patterns are in memory at a time. `hooks`: fwd_hooks to run first
    (the explorer's knocked-out heads). Reads the patterns only; the model's mode is left as it was,
    in eval for the pass.
    """
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    layer_of = {
        f"blocks.{layer}.attn.hook_pattern": layer for layer in range(model.config.n_layers)
    }
    cpu_tokens = tokens.cpu()

    def score(pattern: torch.Tensor, hook) -> None:  # [batch, head, query_pos, key_pos]
        per_layer[layer_of[hook.name]] = {
            name: values.cpu() for name, values in pattern_scores(pattern, cpu_tokens).items()
        }

    was_training = model.training
    model.eval()
    try:
        with (
            torch.no_grad(),
            model.hooks(list(hooks)),
            model.hooks([(layer_of.__contains__, score)]),
            inference_layers(model, tokens),  # the C kernels' layers
        ):
            model(tokens, stop_at_layer=model.config.n_layers)  # no unembedding: no logits
    finally:
        model.train(was_training)
    names = per_layer[0]
    return {
        name: torch.stack([per_layer[layer][name] for layer in range(model.config.n_layers)])
        for name in names
    }


# The model-level entry point
# -------------------------------------------------------------------------------
@dataclass
class HeadScores:
    """Scores of every head: name -> [n_layers, n_heads] tensor (NaN where a score does not
    apply)."""

    scores: dict[str, torch.Tensor]
    notes: dict[str, str] = field(default_factory=dict)

    def standout(self, name: str) -> list[tuple[int, int, float]]:
        """(layer, head, score) of the heads at or above STANDOUT[name], best first."""
        s = self.scores[name]
        found = [
            (int(l), int(h), float(s[l, h])) for l, h in (s >= STANDOUT[name]).nonzero().tolist()
        ]
        return sorted(found, key=lambda x: -x[2])

    def to_dict(self) -> dict:
        return {
            "scores": {
                k: [[None if v != v else round(v, 6) for v in row] for row in s.tolist()]
                for k, s in self.scores.items()
            },
            "standout": {k: [list(x) for x in self.standout(k)] for k in self.scores},
            "thresholds": STANDOUT,
            "notes": self.notes,
        }


def repeated_random_tokens(
    model, *, n_repeats: int = 4, span: int | None = None, batch: int = 4, seed: int = 0
) -> torch.Tensor:
    """(batch, n_repeats · span) ids: a random span of tokens repeated n_repeats times (fixed seed).

    span defaults to n_ctx // n_repeats, at most 64. Special tokens of the model's tokenizer are
    never drawn.
    """
    if n_repeats < 1 or batch < 1:
        raise UserError(
            f"n_repeats ({n_repeats}) and batch ({batch}) must be at least 1; try the defaults, 4 "
            "and 4"
        )
    cfg = model.config
    span = span or max(2, min(64, cfg.n_ctx // n_repeats))
    allowed = torch.arange(cfg.d_vocab)
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer.backend, "get_added_tokens_decoder"):
        special = [i for i in tokenizer.backend.get_added_tokens_decoder() if i < cfg.d_vocab]
        if special and len(special) < cfg.d_vocab:
            keep = torch.ones(cfg.d_vocab, dtype=torch.bool)
            keep[special] = False
            allowed = allowed[keep]
    generator = torch.Generator().manual_seed(seed)
    if len(allowed) >= span:  # distinct tokens within a span: the only repeats are the planted ones
        picks = torch.stack(
            [torch.randperm(len(allowed), generator=generator)[:span] for _ in range(batch)]
        )
    else:
        picks = torch.randint(len(allowed), (batch, span), generator=generator)
    return allowed[picks].repeat(1, n_repeats).to(model.device)


# vocabulary rows of W_E and W_U taken at once by the copying score (U_E = W_U W_E, summed over
# the vocabulary): 2M weights, 16 MB of float64 per matrix for d_model 4096
COPYING_SLICE = 2 << 20


def copying_bytes(cfg) -> int:
    """The most memory `copying_scores` holds at once beside the model: U_E [d_model, d_model] and
    one layer's W_O in float64 (and its float32 copy), W_V and U_E W_V, and one slice of
    vocabulary rows of W_E and W_U (float32 and float64, with the dequantizer's transients)."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.d_head
    return 8 * (2 * d * d + 2 * d * kv) + 4 * d * d + 2 * 24 * COPYING_SLICE


def copying_scores(model) -> torch.Tensor | None:
    """[n_layers, n_heads] Σλ/Σ|λ| of each head's OV circuit W_E W_V W_O W_U, or None without an
    unembedding.

    No float copy of the whole vocabulary exists: U_E = W_U W_E = Σ_v W_U[:, v] W_E[v] is summed
    over COPYING_SLICE rows at a time, each dequantized from the file's blocks where the model
    keeps them (weight_rows); layers go one at a time. So the memory it holds is `copying_bytes`,
    whatever d_vocab and n_layers are."""
    if getattr(model, "unembed", None) is None:
        return None
    cfg = model.config
    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    group = H // Hkv
    d_vocab = cfg.d_vocab
    with torch.no_grad():
        U_E = torch.zeros(cfg.d_model, cfg.d_model, dtype=torch.float64)  # [d_model, d_model]
        rows = max(1, COPYING_SLICE // cfg.d_model)
        for start in range(0, d_vocab, rows):
            end = min(start + rows, d_vocab)
            W_E = weight_rows(model.embed, start, end).double()  # [rows, d_model]
            W_U = weight_rows(model.unembed, start, end).double()  # [rows, d_model] = W_U[:, v]ᵀ
            U_E.addmm_(W_U.T, W_E)
            del W_E, W_U
        if model.ln_final is not None:
            U_E = model.ln_final.weight.double()[:, None] * U_E  # diag(ln_final) W_U W_E
        out = torch.full((cfg.n_layers, H), float("nan"))
        for layer, block in enumerate(model.blocks):
            attn = block.attn
            W_V = attn.W_V.weight.double().T  # [d_model, Hkv * D]
            if cfg.norm_placement == "pre" and block.ln1 is not None:
                W_V = block.ln1.weight.double()[:, None] * W_V
            W_O = attn.W_O.weight.double().T.reshape(H, D, -1)  # [H, D, d_model]
            # U_E W_V once per layer, then each head's [D, D] W_O_h (U_E W_V_h): the same nonzero
            # eigenvalues as the [d_vocab, d_vocab] circuit, at a few MFLOP a head
            U_E_V = (U_E @ W_V).reshape(-1, Hkv, D).transpose(0, 1)  # [Hkv, d_model, D]
            circuit = torch.cat(  # [H, D, D]: each key-value head's group of query heads
                [W_O[g * group : (g + 1) * group] @ U_E_V[g] for g in range(Hkv)]
            )
            eig = torch.linalg.eigvals(circuit)  # [H, D] complex
            out[layer] = (eig.sum(-1).real / eig.abs().sum(-1).clamp_min(1e-30)).float()
            del W_V, W_O, U_E_V
    return out


def copying_fits(model) -> str | None:
    """None where `copying_bytes` fits in the memory this machine reports available (or it
    reports none), else the line that says why the copying score is left out."""
    found = memory.available()
    need = copying_bytes(model.config)
    if found is None or need <= found[0]:
        return None
    return (
        f"not computed: it needs {memory.gigabytes(need)} beside the model and "
        f"{memory.gigabytes(found[0])} is available ({found[1]}); free memory and ask again"
    )


def head_scores(
    model, *, n_repeats: int = 4, span: int | None = None, batch: int = 4, seed: int = 0
) -> HeadScores:
    """Every score of every head of `model` (any attnlab Transformer, built or loaded)."""
    tokens = repeated_random_tokens(model, n_repeats=n_repeats, span=span, batch=batch, seed=seed)
    scores = score_patterns(model, tokens)
    too_large = copying_fits(model) if getattr(model, "unembed", None) is not None else None
    copying = None if too_large else copying_scores(model)
    notes = {
        "input": f"{batch} sequences of {tokens.shape[1] // n_repeats} random tokens repeated "
        f"{n_repeats} times, seed {seed}",
        "copying": "sum of eigenvalues / sum of their absolute values of W_E W_V W_O W_U (Elhage "
        "et al. 2021); "
        "norm gains folded in, biases left out",
    }
    if too_large:  # one line, and the note the result carries: never a silent NaN
        warnings.warn(f"head_scores: the copying score {too_large}", stacklevel=2)
        notes["copying"] = too_large
    elif copying is None:
        notes["copying"] = "n/a: the model has no unembedding (an encoder)"
    if copying is None:
        copying = torch.full_like(scores["previous_token"], float("nan"))
    scores["copying"] = copying
    return HeadScores(scores, notes)
