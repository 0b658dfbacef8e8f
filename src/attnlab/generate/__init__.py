"""Generation: prefill, then one decode step chosen once, with a static KV cache; attnlab's C
kernels (kernels/) and the fast layers that the code wanting them swaps into a model
(fast_layers); the `attnlab sample` command. Weights in fewer bits are attnlab.quant's.
"""
