/* attnlab's CPU kernels, one translation unit: the family files included in order, so that the
 * build stays one compiler call (`cc -O3 ... kernels.c`) and a later family may call an earlier
 * one's static functions (inlined as within one file). Every exported function (attnlab_*) is
 * declared to Python by attnlab.generate.kernels and tested against the PyTorch equation it
 * replaces (tests/test_kernels.py, tests/test_blocks.py, tests/test_amx.py,
 * tests/test_inference_layers.py).
 *
 *   common.h         headers, instruction-set switches, block structs, op enums
 *   vec.h            vector helpers: widening, reductions, exp_, half_to_float, DPBUSD
 *   linear.c         the decode step's float32 and int8 products
 *   quants.c         x rounded to 8 bits; Q8_0, Q4_0, Q4_1 products
 *   quants_k.c       Q5_0 and the K-quants (Q4_K, Q5_K, Q6_K)
 *   repack.c         the 16-row decode layout and its products
 *   linear_q.c       the decode step's block product, dequantization
 *   tiles_q8.c       a prompt's block products, 8-bit tiles
 *   tiles_f32.c      a prompt's float32 tile product
 *   amx.c            float32 products on AMX tiles
 *   amx_attention.c  attention's products on AMX tiles
 *   attention.c      decode and prompt attention
 *   ops.c            norms, RoPE, activations, embeddings
 *   moe.c            a mixture of experts: the router's choice, the chosen experts' products
 *   program.c        the decode step as a program, the greedy loop
 *   probe.c          the read-bandwidth probe, the build's facts
 */
#include "common.h"
#include "vec.h"

#include "linear.c"
#include "quants.c"
#include "quants_k.c"
#include "repack.c"
#include "linear_q.c"
#include "tiles_q8.c"
#include "tiles_f32.c"
#include "amx.c"
#include "amx_attention.c"
#include "attention.c"
#include "ops.c"
#include "moe.c"
#include "program.c"
#include "probe.c"
