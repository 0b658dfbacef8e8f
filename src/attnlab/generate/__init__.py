"""Generation: prefill, then one decode step chosen once, with a static KV cache; attnlab's C
kernels (kernels/), int8 weights, and the `attnlab sample` command.
"""
