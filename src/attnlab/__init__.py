"""attnlab: the Transformer of the attention chapters, real, fast and visible.

    import attnlab
    model = attnlab.Transformer(attnlab.preset("nano", d_vocab=65))
    logits, cache = model.run_with_cache(ids)
    cache["blocks.0.attn.hook_pattern"]  # [batch, head, query_pos, key_pos]

`Transformer` and `load` are attnlab.workbench's: the plain model of attnlab.model with `generate`
and a `run_with_cache` in attnlab's C kernels. Heavier parts (checkpoint formats, the explorer) are
imported when first used, not at import time, and so are TransformerLens's module names `utils` and
`patching` (`from attnlab import utils, patching`).
"""

from .errors import UserError
from .lens.cache import ActivationCache
from .lens.hooks import HookPoint
from .model.attention import scaled_dot_product_attention
from .model.config import PRESETS, ModelConfig, preset
from .quant.quantize import quantize
from .version import __version__ as __version__
from .workbench import Transformer

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
    if name == "load":  # the formats' load, the model as attnlab.workbench's Transformer
        from .workbench import load

        return load
    if name == "save":
        from . import formats

        return formats.save
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
