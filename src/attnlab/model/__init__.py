"""The model: plain PyTorch, read top to bottom, that knows nothing of kernels or compilation.

config (ModelConfig and presets) -> positions, layers (norms, MLP) -> attention -> transformer
(Block, Transformer). The interpretability layer it is built with (hook points, the cache,
TransformerLens's views) is attnlab.lens; the fast paths that generation swaps in are
attnlab.generate.
"""
