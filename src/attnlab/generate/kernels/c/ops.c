/* The elementwise kernels: RoPE, embeddings, residual adds, the window mask, RMSNorm and LayerNorm,
 * the MLP's nonlinearities and products, logit soft-capping; for the decode step's few rows and,
 * the `_rows` forms, a prompt's rows shared by the threads (ggml-cpu's ops.cpp plays this part).
 * Each is the PyTorch equation it replaces, on float32 (tests/test_kernels.py,
 * tests/test_inference_layers.py). */
#include "common.h"
#include "vec.h"

/* RoPE on a single position per row, in place (LLaMA's rotate-half pairing,
 * attnlab.positions.apply_rope): x [rows, heads, d_head]; cos, sin [n, rotary_dim], the angles of
 * positions 0..n-1, read at row r's positions[r]. For i < rotary_dim / 2, with c, s that position's
 * angles and h = rotary_dim / 2: (x_i, x_{i+h}) -> (x_i c_i - x_{i+h} s_i, x_{i+h} c_{i+h} + x_i
 * s_{i+h}). */
void attnlab_rope(float *x, const float *cos_, const float *sin_, const int64_t *positions,
                  int64_t rows, int64_t heads, int64_t d_head, int64_t rotary_dim) {
  int64_t half = rotary_dim / 2;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < heads; h++) {
      float *v = x + (r * heads + h) * d_head;
      const float *c = cos_ + positions[r] * rotary_dim, *s = sin_ + positions[r] * rotary_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
}

/* The residual stream's start for one token per row from a table kept as blocks of `type` (uint8
 * [d_vocab, row bytes]): out[r] = the dequantized row ids[r], d values (attnlab_dequantize's
 * formulas: bit-equal to the reference; kernels.embed_blocks). The ids are trusted: the caller
 * checks them. */
void attnlab_embed_q(const int64_t *ids, const uint8_t *blocks, float *out, int64_t rows, int64_t d,
                     int type, float scale) {
  int64_t row_bytes = d / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type];
  for (int64_t r = 0; r < rows; r++) {
    float *o = out + r * d;
    attnlab_dequantize(blocks + ids[r] * row_bytes, o, 1, d, type, 1);
    if (scale != 1.0f)
      for (int64_t i = 0; i < d; i++) o[i] *= scale;
  }
}

/* y += x, n values (a sandwich norm's sublayer output joining the residual stream). */
void attnlab_add(float *y, const float *x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

/* y *= x, n values (GeGLU's gelu_tanh(W_gate x) times W_in x). */
void attnlab_mul(float *y, const float *x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) y[i] *= x[i];
}

/* The keys a windowed block sees this step [rows, max_len]: those of key_mask (every slot when it
 * is NULL) from slot[0] - window + 1 on (the band of the last `window` slots, Gemma 3's local
 * blocks, Mistral's window). */
void attnlab_window_mask(uint8_t *window_mask, const uint8_t *key_mask, const int64_t *slot,
                         int64_t rows, int64_t max_len, int64_t window) {
  int64_t start = slot[0] - window + 1 > 0 ? slot[0] - window + 1 : 0;
  start = start < max_len ? start : max_len;
  for (int64_t r = 0; r < rows; r++) {
    uint8_t *m = window_mask + r * max_len;
    memset(m, 0, start);
    if (key_mask)
      memcpy(m + start, key_mask + r * max_len + start, max_len - start);
    else
      memset(m + start, 1, max_len - start);
  }
}

/* The residual stream's start for one token per row: out[r] = table[ids[r]] * scale (+
 * positions_table[positions[r]] when that is not NULL: learned absolute positions), d values per
 * row (attnlab.Transformer.embed_tokens; scale: Gemma's sqrt(d_model) as a float32, else 1). */
void attnlab_embed(const int64_t *ids, const float *table, const int64_t *positions,
                   const float *positions_table, float *out, int64_t rows, int64_t d, float scale) {
  for (int64_t r = 0; r < rows; r++) {
    const float *e = table + ids[r] * d,
                *p = positions_table ? positions_table + positions[r] * d : NULL;
    float *o = out + r * d;
    if (p) {
#pragma omp simd
      for (int64_t i = 0; i < d; i++) o[i] = e[i] * scale + p[i];
    } else if (scale != 1.0f) {
#pragma omp simd
      for (int64_t i = 0; i < d; i++) o[i] = e[i] * scale;
    } else
      memcpy(o, e, d * sizeof(float));
  }
}

/* RMSNorm (Zhang & Sennrich 2019): out = x / sqrt(mean(x^2) + eps) * w, each of `rows` rows of d.
 */
void attnlab_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t d,
                      float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * d;
    float *o = out + r * d;
    float squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < d; i++) squares += xr[i] * xr[i];
    float inv = 1.0f / sqrtf(squares / (float)d + eps);
#pragma omp simd
    for (int64_t i = 0; i < d; i++) o[i] = xr[i] * inv * w[i];
  }
}

/* LayerNorm (Ba et al. 2016): out = (x - mean) / sqrt(var + eps) * w + b (b may be NULL), each row
 * of d. */
void attnlab_layer_norm(const float *x, const float *w, const float *b, float *out, int64_t rows,
                        int64_t d, float eps) {
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * d;
    float *o = out + r * d;
    float sum = 0, squares = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < d; i++) sum += xr[i];
    float mean = sum / (float)d;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < d; i++) squares += (xr[i] - mean) * (xr[i] - mean);
    float inv = 1.0f / sqrtf(squares / (float)d + eps);
    for (int64_t i = 0; i < d; i++) o[i] = (xr[i] - mean) * inv * w[i] + (b ? b[i] : 0.0f);
  }
}

/* v sigmoid(z) = v / (1 + e^-z) through the vectorised exp_; below z = -88, e^-z is past float's
 * range (exp_ holds it there): -0. SiLU is v sigmoid(v), GELU's tanh form v sigmoid(2u). */
static inline float times_sigmoid(float v, float z) {
  return z < -88.0f ? -0.0f : v / (1.0f + exp_(-z));
}

/* erfc z for z >= 0 (Numerical Recipes' erfcc, 2nd ed., 6.2: t e^(-z^2 + a polynomial in t), t = 1
 * / (1 + z / 2), fractional error under 1.2e-7 for every z), through the vectorised exp_. */
static inline float erfc_nonnegative(float z) {
  float t = 1.0f / (1.0f + 0.5f * z);
  float p = -0.82215223f + t * 0.17087277f;
  p = 1.48851587f + t * p;
  p = -1.13520398f + t * p;
  p = 0.27886807f + t * p;
  p = -0.18628806f + t * p;
  p = 0.09678418f + t * p;
  p = 0.37409196f + t * p;
  p = 1.00002368f + t * p;
  return t * exp_(-z * z - 1.26551223f + t * p);
}

/* The MLP's nonlinearity `kind` (an attnlab_activation), in place on n values. Exact GELU,
 * 0.5 v (1 + erf(v / sqrt 2)), as 0.5 v (2 - erfc z) for v >= 0 and 0.5 v erfc z below, z = |v| /
 * sqrt 2 (libm's erff was a call per value; below 0 this form also keeps its relative precision
 * where 1 + erf cancels). GELU's tanh form as 0.5 v (1 + tanh u) = v sigmoid(2u), u = sqrt(2 / pi)
 * (v + 0.044715 v^3): the same function through the vectorised exp_ (libm's tanhf, a call per
 * value, was a visible share of Gemma 3's decode step, benchmarks/README.md; the sigmoid form also
 * keeps its relative precision where 1 + tanh u cancels). */
void attnlab_activate(float *x, int64_t n, int kind) {
  if (kind == ACTIVATION_GELU_TANH) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
      float v = x[i];
      x[i] = times_sigmoid(v, 2.0f * (0.79788456080286536f * (v + 0.044715f * v * v * v)));
    }
    return;
  }
  if (kind == ACTIVATION_GELU) {
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
      float v = x[i], c = erfc_nonnegative(fabsf(v) * 0.70710678118654752f);
      x[i] = 0.5f * v * (v >= 0.0f ? 2.0f - c : c);
    }
    return;
  }
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    if (kind == ACTIVATION_RELU)
      x[i] = v > 0 ? v : 0.0f;
    else
      x[i] = v > 0 ? v * v : 0.0f;
  }
}

/* Logit soft-capping (Gemma 2; modded-nanogpt), in place on n values: x = cap tanh(x / cap)
 * (vec.h's soft_cap), over the whole vocabulary every token. */
void attnlab_softcap(float *x, int64_t n, float cap) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) x[i] = soft_cap(x[i], cap);
}

/* SwiGLU's product (Shazeer 2020), in place: gate = silu(gate) * up = gate / (1 + exp(-gate)) * up,
 * n values. */
void attnlab_silu_mul(float *gate, const float *up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) gate[i] = times_sigmoid(gate[i], gate[i]) * up[i];
}

/* A prompt's elementwise kernels, rows shared by the threads (each of the serial kernels above on
 * its share): RMSNorm of `rows` rows of d; SwiGLU's product on n values; RoPE out of place, x and
 * out [rows, heads, d_head], cos, sin [rows, rotary_dim] (each row's own angles; the dims past
 * rotary_dim copied). */
void attnlab_rms_norm_rows(const float *x, const float *w, float *out, int64_t rows, int64_t d,
                           float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d > 16384)
  for (int64_t r = 0; r < rows; r++) attnlab_rms_norm(x + r * d, w, out + r * d, 1, d, eps);
}

/* SwiGLU's product into up, where a hook holds the gate (run_with_cache): up = silu(gate) * up, n
 * values. */
void attnlab_silu_mul_up_rows(const float *gate, float *up, int64_t n, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads) if (n > 16384)
  for (int64_t i = 0; i < n; i++) up[i] = times_sigmoid(gate[i], gate[i]) * up[i];
}

/* RMSNorm with the parts its hooks read (run_with_cache): out as attnlab_rms_norm_rows, scale
 * [rows] = sqrt(mean(x^2)
 * + eps) and normalized = x / scale, from one pass over each row's squares. */
void attnlab_rms_norm_parts_rows(const float *x, const float *w, float *out, float *scale,
                                 float *normalized, int64_t rows, int64_t d, float eps,
                                 int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d > 16384)
  for (int64_t r = 0; r < rows; r++) {
    const float *xr = x + r * d;
    float *o = out + r * d, *n = normalized + r * d;
    float squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < d; i++) squares += xr[i] * xr[i];
    float s = sqrtf(squares / (float)d + eps), inv = 1.0f / s;
    scale[r] = s;
#pragma omp simd
    for (int64_t i = 0; i < d; i++) {
      o[i] = xr[i] * inv * w[i];
      n[i] = xr[i] / s;
    }
  }
}

void attnlab_silu_mul_rows(float *gate, const float *up, int64_t n, int threads) {
  int64_t chunks = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) num_threads(threads) if (n > 16384)
  for (int64_t i = 0; i < chunks; i++)
    attnlab_silu_mul(gate + i * 4096, up + i * 4096, n - i * 4096 < 4096 ? n - i * 4096 : 4096);
}

/* (no fused multiply-add here: the two products rounded, then added, as apply_rope's x cos +
 * rotate_half(x) sin, so that the prompt's rotation is PyTorch's bit for bit; GCC is told by an
 * attribute, clang, which ignores that attribute and contracts within an expression by default, by
 * a pragma) */
#ifdef __clang__
#define NO_CONTRACTION
#else
#define NO_CONTRACTION __attribute__((optimize("fp-contract=off")))
#endif
NO_CONTRACTION void attnlab_rope_rows(const float *x, float *out, const float *cos_,
                                      const float *sin_, int64_t rows, int64_t heads,
                                      int64_t d_head, int64_t rotary_dim, int threads) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads * d_head > 16384)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < heads; h++) {
      const float *v = x + (r * heads + h) * d_head, *c = cos_ + r * rotary_dim,
                  *s = sin_ + r * rotary_dim;
      float *o = out + (r * heads + h) * d_head;
#pragma omp simd
      for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        o[i] = a * c[i] - b * s[i];
        o[i + half] = b * c[i + half] + a * s[i + half];
      }
      for (int64_t i = rotary_dim; i < d_head; i++) o[i] = v[i];
    }
}
