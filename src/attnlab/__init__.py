"""attnlab: the Transformer of the attention chapters, real, fast and visible.

    import attnlab
    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=65))
    logits, cache = model.run_with_cache(ids)
    cache["blocks.0.attn.hook_pattern"]  # [batch, head, query_pos, key_pos]

Heavier parts (checkpoint formats, the explorer) are imported when first used, not at import time,
and so are TransformerLens's module names `utils` and `patching` (`from attnlab import utils,
patching`).
"""

from .errors import UserError
from .generate.fast_layers import quantize
from .lens.cache import ActivationCache
from .lens.hooks import HookPoint
from .model.attention import scaled_dot_product_attention
from .model.config import PRESETS, ModelConfig, preset
from .model.transformer import Transformer
from .version import __version__ as __version__

__all__ = [
    "ActivationCache",
    "HookPoint",
    "ModelConfig",
    "PRESETS",
    "Transformer",
    "UserError",
    "load",
    "preset",
    "quantize",
    "save",
    "scaled_dot_product_attention",
    "show",
]


def __getattr__(name: str):
    if name in ("load", "save"):
        from . import formats

        return getattr(formats, name)
    if name == "utils":  # TransformerLens's name for its helpers module
        from .lens import names

        return names
    if name == "patching":
        from .inspection import patching

        return patching
    if name == "show":
        from .explorer.notebook import show

        return show
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
