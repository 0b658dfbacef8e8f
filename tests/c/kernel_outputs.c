/* The C kernels' outputs on fixed inputs, printed for a comparison between builds: the same program
 * compiled for two machines (say the portable build on x86-64 and on AArch64, run under qemu) must
 * print the same numbers, or numbers within the bound tests/test_kernels_elsewhere.py gives them.
 *
 * Compiled with the kernels in one unit (`cc FLAGS -I KERNELS_C_DIR kernel_outputs.c -lm`): the
 * block structs of common.h build valid blocks. Every input comes from one linear congruential
 * generator, so both machines read the same bits; one thread, so sums keep one order. Each line:
 * a case's name, then its outputs as C99 hexadecimal floats (exact). */
#include "kernels.c"

#include <stdio.h>
#include <stdlib.h>

static uint64_t state = 42;

static uint32_t next_u32(void) {
  state = state * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(state >> 32);
}

/* uniform in [-1, 1), a multiple of 2^-23 */
static float next_float(void) {
  return (float)((int32_t)(next_u32() >> 8) - (1 << 23)) / (1 << 23);
}

static float *floats(int64_t n) {
  float *x = malloc(n * sizeof(float));
  for (int64_t i = 0; i < n; i++) x[i] = next_float();
  return x;
}

static void print(const char *name, const float *y, int64_t n) {
  printf("%s", name);
  for (int64_t i = 0; i < n; i++) printf(" %a", (double)y[i]);
  printf("\n");
}

/* rows of valid blocks of `type`: random quants, every half-precision scale a small finite one */
static uint8_t *blocks(int type, int64_t rows, int64_t d_in) {
  int64_t per_row = d_in / BLOCK_WEIGHTS[type], bytes = BLOCK_BYTES[type];
  uint8_t *w = malloc(rows * per_row * bytes);
  for (int64_t i = 0; i < rows * per_row * bytes; i++) w[i] = (uint8_t)next_u32();
  for (int64_t i = 0; i < rows * per_row; i++) {
    uint8_t *block = w + i * bytes;
    ggml_half d = (ggml_half)(0x2000 + (next_u32() & 0x3ff)),
              m = (ggml_half)(0xa000 + (next_u32() & 0x3ff));
    switch (type) {
    case BLOCK_Q8_0:
      ((block_q8_0 *)block)->d = d;
      break;
    case BLOCK_Q4_0:
      ((block_q4_0 *)block)->d = d;
      break;
    case BLOCK_Q4_1:
      ((block_q4_1 *)block)->d = d, ((block_q4_1 *)block)->m = m;
      break;
    case BLOCK_Q5_0:
      ((block_q5_0 *)block)->d = d;
      break;
    case BLOCK_Q4_K:
      ((block_q4_K *)block)->d = d, ((block_q4_K *)block)->dmin = m;
      break;
    case BLOCK_Q5_K:
      ((block_q5_K *)block)->d = d, ((block_q5_K *)block)->dmin = m;
      break;
    case BLOCK_Q6_K:
      ((block_q6_K *)block)->d = d;
      break;
    }
  }
  return w;
}

int main(void) {
  char name[64];
  /* decode products: float32 and int8 with a scale per output feature */
  {
    int64_t rows = 3, d_in = 96, d_out = 40;
    float *x = floats(rows * d_in), *w = floats(d_out * d_in), *b = floats(d_out),
          *y = floats(rows * d_out);
    attnlab_linear_f32(x, w, b, y, rows, d_in, d_out, 0, 1);
    print("linear_f32", y, rows * d_out);
    int8_t *q = malloc(d_out * d_in);
    for (int64_t i = 0; i < d_out * d_in; i++) q[i] = (int8_t)next_u32();
    float *scale = floats(d_out);
    attnlab_linear_i8(x, q, scale, b, y, rows, d_in, d_out, 0, 1);
    print("linear_i8", y, rows * d_out);
  }
  /* every block type: the blocks as floats, a decode product, a prompt's product (tiles) */
  for (int type = 0; type <= BLOCK_Q6_K; type++) {
    int64_t rows = 2, many = 19, d_in = 512, d_out = 24;
    uint8_t *w = blocks(type, d_out, d_in);
    float *x = floats(many * d_in), *b = floats(d_out), *y = malloc(many * d_out * sizeof(float));
    float *dense = malloc(d_out * d_in * sizeof(float));
    attnlab_dequantize(w, dense, d_out, d_in, type, 1);
    snprintf(name, sizeof name, "dequantize_%d", type);
    print(name, dense, d_out * d_in);
    int8_t *scratch =
        malloc(attnlab_linear_rows_scratch(many, d_in, 1) + attnlab_linear_q_scratch(many, d_in));
    attnlab_linear_q(x, w, b, y, scratch, rows, d_in, d_out, type, 0, 1);
    snprintf(name, sizeof name, "linear_q_%d", type);
    print(name, y, rows * d_out);
    if (type <= BLOCK_Q5_0 || type == BLOCK_Q4_K) {
      attnlab_linear_q_rows(x, w, b, y, scratch, many, d_in, d_out, type, 1);
      snprintf(name, sizeof name, "linear_q_rows_%d", type);
      print(name, y, many * d_out);
    }
  }
  /* a prompt's float32 product on tiles */
  {
    int64_t rows = 21, d_in = 64, d_out = 40;
    float *x = floats(rows * d_in), *w = floats(d_out * d_in), *b = floats(d_out),
          *y = floats(rows * d_out);
    int8_t *scratch = malloc(attnlab_linear_rows_scratch(rows, d_in, 1));
    attnlab_linear_f_rows(x, w, b, y, scratch, rows, d_in, d_out, -1, 1);
    print("linear_f_rows", y, rows * d_out);
  }
  /* a prompt's causal attention, in one call and in three steps */
  {
    int64_t batch = 2, T = 37, heads = 4, kv_heads = 2, d_head = 32, n = batch * T * heads * d_head;
    float *q = floats(n), *k = floats(batch * T * kv_heads * d_head),
          *v = floats(batch * T * kv_heads * d_head);
    float *out = malloc(n * sizeof(float));
    float *scratch = malloc(attnlab_attend_rows_scratch(batch, T, kv_heads, d_head, 1));
    attnlab_attend_rows(q, k, v, out, scratch, batch, T, heads, kv_heads, d_head, 0.17677669f, 0.0f,
                        1);
    print("attend_rows", out, n);
    /* Gemma 2's soft-capped scores: cap·tanh(s/cap) */
    attnlab_attend_rows(q, k, v, out, scratch, batch, T, heads, kv_heads, d_head, 0.17677669f, 1.5f,
                        1);
    print("attend_rows_capped", out, n);
    float *scores = malloc(batch * heads * T * T * sizeof(float)),
          *pattern = malloc(batch * heads * T * T * sizeof(float));
    attnlab_attend_scores(q, k, scores, scratch, batch, T, heads, kv_heads, d_head, 0.17677669f,
                          0.0f, 1);
    attnlab_softmax_rows(scores, pattern, batch * heads * T, T, 1);
    print("softmax_rows", pattern, batch * heads * T * T);
    attnlab_attend_mix(pattern, v, out, batch, T, T, heads, kv_heads, d_head, 1);
    print("attend_mix", out, n);
  }
  /* norms, RoPE, activations */
  {
    int64_t rows = 5, d = 72;
    float *x = floats(rows * d), *w = floats(d), *b = floats(d),
          *out = malloc(rows * d * sizeof(float));
    attnlab_rms_norm(x, w, out, rows, d, 1e-5f);
    print("rms_norm", out, rows * d);
    attnlab_layer_norm(x, w, b, out, rows, d, 1e-5f);
    print("layer_norm", out, rows * d);
    for (int kind = ACTIVATION_GELU; kind <= ACTIVATION_RELU2; kind++) {
      for (int64_t i = 0; i < rows * d; i++) out[i] = 4.0f * x[i];
      attnlab_activate(out, rows * d, kind);
      snprintf(name, sizeof name, "activate_%d", kind);
      print(name, out, rows * d);
    }
    for (int64_t i = 0; i < rows * d; i++) out[i] = 4.0f * x[i];
    attnlab_silu_mul(out, x, rows * d);
    print("silu_mul", out, rows * d);
    int64_t heads = 3, d_head = 24, rotary = 16, positions[5] = {0, 1, 7, 30, 63};
    float *cos_ = floats(64 * rotary), *sin_ = floats(64 * rotary);
    attnlab_rope(x, cos_, sin_, positions, rows, heads, d_head, rotary);
    print("rope", x, rows * heads * d_head);
  }
  return 0;
}
