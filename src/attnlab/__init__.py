"""attnlab: the Transformer of the attention chapters, real, fast and visible.

    import attnlab
    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=65))
    logits, cache = model.run_with_cache(ids)
    cache["blocks.0.attn.hook_pattern"]  # [batch, head, query_pos, key_pos]

Heavier parts (checkpoint formats, the explorer) are imported when first used, not at import time.
"""

from .attention import scaled_dot_product_attention
from .config import PRESETS, ModelConfig, preset
from .errors import UserError
from .cache import ActivationCache
from .hooks import HookPoint
from .layers import quantize
from .model import Transformer

__version__ = "0.1.0"

__all__ = [
    "ActivationCache", "HookPoint", "ModelConfig", "PRESETS", "Transformer", "UserError",
    "load", "preset", "quantize", "save", "scaled_dot_product_attention", "show",
]


def __getattr__(name: str):
    if name in ("load", "save"):
        from . import formats

        return getattr(formats, name)
    if name == "show":
        from .explorer.notebook import show

        return show
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
