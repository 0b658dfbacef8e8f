"""The whole context (issue 26): a text run through the model once, its queries and keys kept, and
any head's pattern computed when the page asks for it, pooled to what the screen can show.

Design choices:
- One forward pass per text (`POST /api/context`): attnlab.inspection.capture's
  `capture_queries_keys` hooks only the queries and keys as the scores use them (after QK-norm and
  RoPE), so every layer keeps torch's fused kernel and no T×T matrix exists during the pass; the
  pass stops before the unembedding. Each layer's q [H, T, D] and k [Hkv, T, D] are kept in float32
  as the model computed them (grouped-query keys once per key head, not once per query head).
- A head's pattern is computed on demand, ROWS query rows at a time, each block with the keys it
  may see (the model's own apply_mask, so the causal mask and a sliding window are the model's):
  softmax row by row the first time, then exp(score − the row's log Σ exp), without the whole row
  when a tile needs only a block of it; tested equal to the model's own pattern
  (attention_pattern) pooled the same way. Max-pooled as it goes: the peak is ROWS × T floats,
  never T × T, never every head. Per head only its rows' normalisers are kept (log Σ exp of each
  row's scores, T floats, from its first overview), so a tile computes its own block of scores
  only, and many head switches stay bounded by heads × T.
- Levels, as a map's: level ℓ of a head's matrix is its 2^ℓ × 2^ℓ max-pools (the maximum, not the
  mean: a sharp head's one bright cell per row stays bright at every zoom), level 0 the matrix
  itself. The overview is the finest level with at most as many cells as the screen has pixels
  (`size`); tiles are TILE × TILE cells of one level, fetched as the page zooms in.
- Binary, not JSON: a HEADER of 32 bytes (magic, level, rows, cols, first row and column in cells
  of that level, the text's tokens, bytes per value) and the cells as little-endian float16 (the
  page's default: 2 MB for a 1024² overview) or float32 (the tests' exact comparison).
- Memory is bounded and reported: the contexts are kept by (model, variant, text, layers) in a
  least-recently-used store with a byte budget on their q and k together (`budget`); a new one
  drops the oldest until it fits. `GET /api/context/status` says what is held, and the process's
  resident memory.
- The layers in view: where every layer's q and k of a text exceed the budget (an 8B model's at
  8,192 tokens: 5.4 GB), a context keeps the consecutive layers that fit, from layer 0 or from
  those the request names (`layers`), and says which; its forward pass stops after the last of
  them. A head of a layer it does not keep is a 404 naming the layers it keeps and how to ask for
  others (the page posts the text again with the layers around the one in view); the heads grid
  takes the layers a window at a time. A text of which not even one layer fits is refused (413).
- A context's id is a hash of what made it (model, variant, text), so posting the same text again
  finds it; an id the store has dropped is a 404 that says to post the text again.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..inspection.capture import capture_queries_keys
from ..model.attention import apply_mask, soft_cap
from .models import ModelEntry, NotFound, TextTooLong, Variant

TILE = 256  # a tile's cells per side
ROWS = 256  # query rows computed at once: the peak is ROWS × T floats
BUDGET = 2 * 2**30  # bytes of kept queries and keys, every context together
MAX_OVERVIEW = 4096  # the largest screen side an overview is pooled to
MAGIC = b"ATL1"
# magic, level, rows, cols, first row, first col (in cells of the level), tokens, bytes per value
HEADER = struct.Struct("<4s7I")
DTYPES = {"f16": (torch.float16, 2), "f32": (torch.float32, 4)}


@dataclass
class Context:
    """A text's queries and keys in every layer of one model (variant)."""

    id: str
    entry: ModelEntry
    tokens: list[str]
    q: dict[int, torch.Tensor]  # per layer kept: [head, pos, d_head]
    k: dict[int, torch.Tensor]  # per layer kept: [kv_head, key_pos, d_head]
    seconds: float  # the forward pass that made it
    bound: int  # the most it can hold: q, k and every head's normalisers (context_bytes)
    # (layer, head) -> each query row's log Σ exp(scores): T floats per head asked for
    lse: dict = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        kept = (*self.q.values(), *self.k.values(), *self.lse.values())
        return sum(t.numel() * t.element_size() for t in kept)

    @property
    def layers(self) -> list[int]:
        """The layers whose queries and keys this context keeps (module docstring)."""
        return sorted(self.q)

    @property
    def levels(self) -> int:
        """Levels 0 .. levels − 1: the last is the coarsest whose matrix fits one tile."""
        return levels(self.n_tokens)

    def describe(self) -> dict:
        return {
            "id": self.id,
            "model": self.entry.name,
            "n_tokens": self.n_tokens,
            "tile": TILE,
            "levels": self.levels,
            "layers": self.layers,
            "n_layers": self.entry.model.config.n_layers,
            "bytes": self.nbytes,
            "seconds": self.seconds,
        }


def levels(n_tokens: int) -> int:
    """How many levels a text's matrix has: 0 (single cells) up to the first that fits one tile."""
    return overview_level(n_tokens, TILE) + 1


def cells(n_tokens: int, level: int) -> int:
    """A level's cells per side."""
    return -(-n_tokens // 2**level)


def context_bytes(entry: ModelEntry, n_tokens: int, n_layers: int | None = None) -> int:
    """What a context of n_tokens may hold in n_layers (default: every layer): q and k in float32,
    and every head's normalisers."""
    cfg = entry.model.config
    n_layers = cfg.n_layers if n_layers is None else n_layers
    return 4 * n_layers * n_tokens * ((cfg.n_heads + cfg.n_kv_heads) * cfg.d_head + cfg.n_heads)


def context_id(name: str, variant: Variant, text: str, layers: list[int] | None = None) -> str:
    made_of = repr((name, variant.ablate, variant.ablation, variant.step, text))
    if layers is not None:
        made_of += repr(tuple(layers))
    return hashlib.sha256(made_of.encode("utf-8")).hexdigest()[:20]


def span(layers: list[int]) -> str:
    """'0-11' for consecutive layers, '3' for one, '1, 5, 9' otherwise."""
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))


class ContextStore:
    """The contexts kept, least recently used first, within `budget` bytes of queries and keys."""

    def __init__(self, budget: int = BUDGET) -> None:
        self.budget = budget
        self.contexts: OrderedDict[str, Context] = OrderedDict()
        self.lock = threading.Lock()  # the dict only; a forward pass holds its model's lock

    def layers_in_view(
        self, entry: ModelEntry, n_tokens: int, layers: list[int] | None = None
    ) -> list[int]:
        """The layers a context of n_tokens keeps: `layers` (consecutive, in range) where they
        fit the budget, or (None) every layer where they fit, else as many from layer 0 as fit
        (module docstring); a text of which not even one layer fits is refused (413)."""
        n_layers = entry.model.config.n_layers
        one = context_bytes(entry, n_tokens, 1)
        fit = min(n_layers, self.budget // one)
        if fit == 0:
            raise TextTooLong(
                f"the text's queries and keys in one layer of model {entry.name!r} would take "
                f"{one / 2**20:.0f} MiB, over the explorer's budget of "
                f"{self.budget / 2**20:.0f} MiB for kept contexts; shorten the text"
            )
        if layers is None:
            return list(range(fit))
        layers = sorted(set(layers))
        if not layers or layers[0] < 0 or layers[-1] >= n_layers:
            raise UserError(
                f"layers {layers} are not layers of model {entry.name!r}: it has {n_layers} "
                f"(0 to {n_layers - 1})"
            )
        if len(layers) > fit:
            raise TextTooLong(
                f"the text's queries and keys in {len(layers)} layers of model {entry.name!r} "
                f"would take {context_bytes(entry, n_tokens, len(layers)) / 2**20:.0f} MiB, over "
                f"the explorer's budget of {self.budget / 2**20:.0f} MiB for kept contexts: "
                f"{fit} layers fit; ask for at most {fit}"
            )
        return layers

    def create(
        self,
        cid: str,
        entry: ModelEntry,
        ids: torch.Tensor,
        tokens: list[str],
        layers: list[int] | None = None,
    ) -> Context:
        """The context `cid` of a text: found kept, or made from one forward pass keeping
        `layers` (default: every layer; layers_in_view checks them against the budget)."""
        with self.lock:
            if cid in self.contexts:
                self.contexts.move_to_end(cid)
                return self.contexts[cid]
        every = list(range(entry.model.config.n_layers))
        layers = self.layers_in_view(entry, len(tokens), every if layers is None else layers)
        need = context_bytes(entry, len(tokens), len(layers))
        with self.lock:  # room first: the old contexts go before the new one's memory is taken
            self._drop_until(self.budget - need)
        start = time.perf_counter()
        with entry.lock, torch.no_grad(), entry.model.hooks(entry.hooks):
            captured = capture_queries_keys(entry.model, ids, layers)
        q, k = {}, {}
        for layer in layers:  # each layer's hooked tensors freed as soon as they are copied
            q_layer, k_layer = captured.pop(layer)
            q[layer] = q_layer[0].float().contiguous()
            k[layer] = k_layer[0].float().contiguous()
        context = Context(cid, entry, tokens, q, k, time.perf_counter() - start, need)
        with self.lock:
            self.contexts[cid] = context
            self._drop_until(self.budget)
        return context

    def _drop_until(self, limit: int) -> None:
        # by what each may come to hold, so that the normalisers added later stay within the budget
        while self.contexts and sum(c.bound for c in self.contexts.values()) > limit:
            self.contexts.popitem(last=False)

    def get(self, cid: str) -> Context:
        with self.lock:
            if cid not in self.contexts:
                raise NotFound(
                    f"no context {cid!r} is kept (the explorer keeps "
                    f"{self.budget / 2**20:.0f} MiB of them, the least recently used go first); "
                    "post the text to /api/context again"
                )
            self.contexts.move_to_end(cid)
            return self.contexts[cid]

    def status(self) -> dict:
        with self.lock:
            held = [c.describe() for c in self.contexts.values()]
        return {
            "contexts": held,
            "bytes": sum(c["bytes"] for c in held),
            "budget_bytes": self.budget,
            "rss_bytes": resident_bytes(),
        }


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's /proc), or None where that is not readable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def masked_scores(
    context: Context, layer: int, head: int, rows: tuple[int, int], cols: tuple[int, int]
) -> torch.Tensor:
    """One head's scores q·kᵀ · scale for query rows [a, b) and keys [c, d), masked as the model
    masks them (its causal mask, seen from this block; a sliding window's band): [b − a, d − c].
    The model's own apply_mask, applied only to the columns the diagonal crosses (the keys before
    the block's first row are all visible, unless a window)."""
    cfg = context.entry.model.config
    (a, b), (c, d) = rows, cols
    q = context.q[layer][head]  # [pos, d_head]
    k = context.k[layer][head // (cfg.n_heads // cfg.n_kv_heads)]  # the key head it shares
    # attention_scores' q·kᵀ · scale with the scale on q: a pass over the block less (exactly the
    # same numbers when the scale is a power of two, as 1/√64 is)
    scores = torch.matmul(q[a:b] * cfg.scale, k[c:d].T)
    if cfg.attn_softcap is not None:  # the model's cap before its mask (Gemma 2: soft_cap)
        scores = soft_cap(scores, cfg.attn_softcap)
    if not cfg.causal:
        return scores
    window = context.entry.model.blocks[layer].attn.window  # per block (Gemma 3: 5 in 6)
    if window is not None:
        return apply_mask(scores, causal=True, diagonal=a - c, window=window)
    first = max(c, a + 1)  # the first key some row of the block cannot see
    if first < d:
        crossed = scores[:, first - c :]
        crossed.copy_(apply_mask(crossed, causal=True, diagonal=a - first))
    return scores


def normalisers(context: Context, layer: int, head: int) -> torch.Tensor:
    """log Σ_j exp(score_ij) of every query row i of one head ([pos]), computed once per head and
    kept (T floats): a tile's weights are then exp(score − this), its own block of scores only."""
    if (layer, head) not in context.lse:
        T = context.n_tokens
        pooled_pattern(context, layer, head, overview_level(T, TILE), (0, T), (0, T))
    return context.lse[(layer, head)]


def pool(x: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """The max over each run of `size` along dim 0 or 1 of a matrix (the last may be shorter)."""
    if size == 1:
        return x
    if dim == 0:
        return pool(x.T, size, 1).T
    return F.max_pool1d(x[None], size, size, ceil_mode=True)[0]


def pooled_pattern(
    context: Context,
    layer: int,
    head: int,
    level: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> torch.Tensor:
    """The max over each 2^level × 2^level block of one head's pattern, for the token rows [a, b)
    and key columns [c, d) (a and c multiples of 2^level): [⌈(b − a)/2^level⌉, ⌈(d − c)/2^level⌉].

    Query rows go ROWS at a time (a pooling window taller than ROWS gathers several blocks'
    maxima), and a causal block never computes the keys it cannot see. Whole rows of a head not
    seen before (its first overview) are its pattern's rows, softmax(scores), pooled; they also
    give each row's normaliser, log Σ exp(scores) = the row's largest score − log its largest
    weight. After that a block of a row needs only its own scores: a weight is exp(score −
    normaliser), and exp is increasing, so a pooled block's largest weight is exp(its largest score
    − normaliser): the scores are pooled first, and only their maxima exponentiated. Both ways are
    tested against the model's own pattern."""
    causal = context.entry.model.config.causal
    f = 2**level
    (a, b), (c, d) = rows, cols
    # whole rows of a head not seen yet (an overview): the normalisers come from the same scores
    fresh = (
        (layer, head) not in context.lse and (c, d) == (0, context.n_tokens) and (a, b) == (c, d)
    )
    lse = torch.empty(context.n_tokens) if fresh else normalisers(context, layer, head)
    out = torch.zeros(-(-(b - a) // f), -(-(d - c) // f))
    with torch.no_grad():
        for s in range(a, b, ROWS):
            e = min(s + ROWS, b)
            end = min(d, e) if causal else d  # causal: keys after the block's last row weigh 0
            if end <= c:
                continue
            scores = masked_scores(context, layer, head, (s, e), (c, end))
            if fresh:  # the pattern's rows (a causal query sees itself: no row is all masked)
                maxima = pool(torch.softmax(scores, -1), f, 1)  # [e − s, ⌈width / f⌉]
                # the row's largest weight is exp(its largest score − its normaliser)
                lse[s:e] = pool(scores, f, 1).amax(-1) - torch.log(maxima.amax(-1))
            else:
                maxima = torch.exp(pool(scores, f, 1) - lse[s:e, None])
            pooled = pool(maxima, min(f, e - s), 0)
            r = (s - a) // f
            target = out[r : r + pooled.shape[0], : pooled.shape[1]]
            torch.maximum(target, pooled, out=target)
    if fresh:
        context.lse[(layer, head)] = lse
    return out


def thumbnail(context: Context, layer: int, head: int, size: int) -> torch.Tensor:
    """One head's pattern max-pooled to n × n cells, n = min(T, size), exactly as
    F.adaptive_max_pool2d pools it (cell i covers rows ⌊iT/n⌋ to ⌈(i+1)T/n⌉, which may overlap by
    one), computed ROWS query rows at a time: the heads grid of a long text without any T × T
    matrix (a layer's patterns at 8,192 tokens are 2.4 GB for SmolLM2's nine heads)."""
    T = context.n_tokens
    n = min(T, size)
    first = [i * T // n for i in range(n)]
    last = [-(-(i + 1) * T // n) for i in range(n)]  # exclusive
    causal = context.entry.model.config.causal
    out = torch.zeros(n, n)
    with torch.no_grad():
        for s in range(0, T, ROWS):
            e = min(s + ROWS, T)
            end = e if causal else T  # causal: the keys after the block's last row weigh 0
            scores = masked_scores(context, layer, head, (s, e), (0, end))
            # a cell's largest weight is exp(its largest score − the row's log Σ exp): the scores
            # are pooled first and only their maxima exponentiated (a cell past `end` weighs 0)
            columns = torch.full((e - s, n), float("-inf"))  # [e − s, n]
            for j in range(n):
                if first[j] < end:
                    columns[:, j] = scores[:, first[j] : min(last[j], end)].amax(-1)
            columns = torch.exp(columns - torch.logsumexp(scores, -1, keepdim=True))
            for i in range(n):
                lo, hi = max(first[i], s), min(last[i], e)
                if lo < hi:
                    torch.maximum(out[i], columns[lo - s : hi - s].amax(0), out=out[i])
    return out


def encode_cells(
    values: torch.Tensor, level: int, first: tuple[int, int], n_tokens: int, dtype: str
) -> bytes:
    """HEADER + the cells row by row, little-endian."""
    torch_dtype, size = DTYPES[dtype]
    rows, cols = values.shape
    header = HEADER.pack(MAGIC, level, rows, cols, first[0], first[1], n_tokens, size)
    return header + values.to(torch_dtype).contiguous().numpy().astype(f"<f{size}").tobytes()


def overview_level(n_tokens: int, size: int) -> int:
    """The finest level whose side is at most `size` cells."""
    level = 0
    while cells(n_tokens, level) > size:
        level += 1
    return level


def check_head(context: Context, layer: int, head: int) -> None:
    cfg = context.entry.model.config
    if not 0 <= layer < cfg.n_layers:
        raise UserError(
            f"layer {layer} is out of range: model {context.entry.name!r} has {cfg.n_layers} "
            f"layers (0 to {cfg.n_layers - 1})"
        )
    if layer not in context.q:
        kept = context.layers
        raise NotFound(
            f"layer {layer} is not kept in context {context.id!r}: within the explorer's budget "
            f"it keeps layers {span(kept)} of {cfg.n_layers} at {context.n_tokens} tokens; post "
            f'the text to /api/context again with "layers" (at most {len(kept)} of them)'
        )
    if not 0 <= head < cfg.n_heads:
        raise UserError(
            f"head {head} is out of range: model {context.entry.name!r} has {cfg.n_heads} heads "
            f"per layer (0 to {cfg.n_heads - 1})"
        )


def overview(context: Context, layer: int, head: int, size: int, dtype: str = "f16") -> bytes:
    """The whole matrix at the finest level that is at most `size` cells per side."""
    check_head(context, layer, head)
    T = context.n_tokens
    level = overview_level(T, size)
    values = pooled_pattern(context, layer, head, level, (0, T), (0, T))
    return encode_cells(values, level, (0, 0), T, dtype)


def tile(
    context: Context, layer: int, head: int, level: int, row: int, col: int, dtype: str = "f16"
) -> bytes:
    """Tile (row, col) of a level: its cells [row·TILE, (row+1)·TILE) × [col·TILE, ...), clipped
    to the matrix."""
    check_head(context, layer, head)
    T, top = context.n_tokens, context.levels - 1
    # 404, not 422, as for a token past a text's end: the request is well formed (the document
    # cannot tie a level or a tile to the text's length), and the tile it names does not exist
    if not 0 <= level <= top:
        raise NotFound(
            f"level {level} is out of range: a {T}-token text has levels 0 (single cells) to "
            f"{top} (the whole matrix in one {TILE}×{TILE} tile)"
        )
    n = -(-cells(T, level) // TILE)  # tiles per side
    if not (0 <= row < n and 0 <= col < n):
        raise NotFound(
            f"tile ({row}, {col}) is outside the matrix: level {level} of a {T}-token text has "
            f"{n}×{n} tiles (rows and columns 0 to {n - 1})"
        )
    span = TILE * 2**level  # tokens per tile side
    a, c = row * span, col * span
    values = pooled_pattern(
        context, layer, head, level, (a, min(T, a + span)), (c, min(T, c + span))
    )
    return encode_cells(values, level, (row * TILE, col * TILE), T, dtype)


def open_context(
    explorer, name: str, text: str, variant: Variant, layers: list[int] | None = None
) -> dict:
    """POST /api/context: the text run once through the model (or found kept), described with its
    tokens and the layers it keeps (`layers`, or every layer that fits the budget)."""
    entry = explorer.served.entry(name, variant)
    ids, tokens = explorer.served.encode(entry, text)
    layers = explorer.contexts.layers_in_view(entry, len(tokens), layers)
    every = layers == list(range(entry.model.config.n_layers))
    cid = context_id(name, variant, text, None if every else layers)
    context = explorer.contexts.create(cid, entry, ids, tokens, layers)
    return {
        **context.describe(),
        "tokens": context.tokens,
        "info": explorer.served.describe(entry),
        "memory": explorer.contexts.status(),
    }
