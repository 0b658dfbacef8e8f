"""The atlas: every head of a model scored for what it does, on the standard probes and on the
current text, for the atlas view's grid (layers × heads).

Design choices:
- The scores are attnlab.inspection.scores', the one place they are defined: on the probes (random
  tokens repeated, Olsson et al.) exactly what `attnlab heads MODEL --json` writes (head_scores with
  its defaults, computed once per model and kept, as the heads grid's are), and on the text the
  same pattern scores (`score_patterns`) of the text's tokens, with the request's knocked-out heads.
- The probes see the model at the request's training step as `attnlab heads` sees it: knocked-out
  heads change the text's scores only (the atlas says so).
- A head's role, the colour the page gives it, is the score that stands out most relative to its
  STANDOUT threshold, among the pattern scores (previous token, induction, duplicate token,
  first-token sink, local window); copying (a property of the weights, not of where a head looks)
  is shown on hover.
"""

from __future__ import annotations

import time
from typing import Any

from ..inspection.scores import LOCAL_WINDOW, STANDOUT, HeadScores, score_patterns
from .models import PLAIN, Variant
from .views import head_scores

# the scores that colour the atlas, in the legend's order
ROLES = ("previous_token", "induction", "duplicate_token", "first_token", "local_window")


def atlas(explorer, name: str, text: str, variant: Variant = PLAIN) -> dict[str, Any]:
    """Every head's scores on the probes and on `text`, with the thresholds and the time each
    took."""
    entry = explorer.served.entry(name, variant)
    ids, tokens = explorer.served.encode(entry, text)
    start = time.perf_counter()
    with entry.lock:
        on_text = score_patterns(entry.model, ids, entry.hooks)
    text_ms = 1000 * (time.perf_counter() - start)
    plain = explorer.served.entry(name, Variant(step=variant.step))
    cached = plain.scores is not None
    start = time.perf_counter()
    probes = head_scores(plain)
    probes_ms = 1000 * (time.perf_counter() - start)
    cfg = entry.model.config
    return {
        "tokens": tokens,
        "n_layers": cfg.n_layers,
        "n_heads": cfg.n_heads,
        "roles": list(ROLES),
        "thresholds": STANDOUT,
        "local_window": LOCAL_WINDOW,
        "probes": probes,
        "text": HeadScores(on_text, {"input": f"this text ({len(tokens)} tokens)"}).to_dict(),
        "ablated": [list(h) for h in variant.ablate],
        "cost": {"text_ms": text_ms, "probes_ms": probes_ms, "probes_cached": cached},
    }
