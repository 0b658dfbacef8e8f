"""Weights stored in fewer bits: the layers that hold them and the function that makes them.

- `blocks`: ggml's blocks (Q8_0, Q4_0, Q4_1 and the kinds a GGUF file may hold), their table
  (BLOCK_TYPES), the one dequantizer, and the modules that keep a matrix or an embedding as those
  bytes (BlockLinear, BlockEmbedding).
- `int8`: one int8 row per output feature with one float32 scale (Int8Linear).
- `quantize`: `quantize(model, scheme)` (attnlab.quantize), the schemes it offers (QUANTIZATIONS),
  and `store_weights_as` (float weights stored in a narrower dtype).

Design choices:
- The layers here are plain PyTorch: each forward is its equation (dequantize or widen, then
  F.linear). The fast products that multiply the stored bits themselves (attnlab's C kernels, a
  compiled multiply-and-sum) are generation's: attnlab.generate.fast_layers swaps them in
  (KernelBlockLinear, KernelInt8Linear) for as long as the code that wants them runs.
- This room sits below both the formats (which read and write these layers) and generation (which
  multiplies them fast), and imports neither, nor the model: it works on any module tree.
- Nothing is imported here, so `import attnlab.quant.blocks` stays light.
"""
