"""The model: plain PyTorch, read top to bottom, that knows nothing of kernels or compilation.

config (ModelConfig and presets) -> positions, layers (norms, MLP) -> attention -> transformer
(Block, Transformer). The interpretability layer it is built with (hook points, the cache,
TransformerLens's views) is attnlab.lens. Nothing here imports the fast paths: the C kernels'
layers (attnlab.generate.fast_layers) are swapped in by the code that wants them, and the
Transformer users hold, with `generate` and a fast `run_with_cache`, is attnlab.workbench's subclass
of this one.
"""
