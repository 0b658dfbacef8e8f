/* attnlab's CPU kernels for one decoding step: the few-row products and the single query's attention.
 *
 * Plain C with `#pragma omp simd` reductions, compiled at first use with -O3 -march=native (see
 * attnlab/generate/kernels/__init__.py): the compiler vectorises the loops for whatever the machine has (AVX-512,
 * AVX2, NEON), and the same source compiles to scalar code anywhere else. The two products also have an AVX-512
 * form written with intrinsics (`#if AVX512`), where that measured faster; the portable loop stays the fallback,
 * and tests/test_kernels.py builds and checks both. Threads: OpenMP, the runtime
 * torch itself runs on, split over output features. Every function here is tested against the PyTorch
 * equation it replaces (tests/test_kernels.py).
 *
 * Why: a decode step reads every weight once to multiply it by one row, so it runs at the speed weights
 * stream from memory, which BLAS's one-row product fell well short of (benchmarks/README.md, issue 14); these
 * loops stream each weight row once, four rows at a time (four independent sums hide the add latency), like llama.cpp's ggml_vec_dot.
 */
#include <math.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROWS_AT_ONCE 4 /* output features computed together: four independent sums per pass over x */
/* Bytes of int8 weights asked for ahead of the pass that reads them (see attnlab_linear_i8). The float32 loop
 * computes little per byte and gained nothing from it (benchmarks/README.md, issue 14). */
#define PREFETCH_AHEAD 8192

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define AVX512 1
/* 16 int8 weights widened to float: one sign-extending load (int8 -> int32) and a conversion */
static inline __m512 widen16(const int8_t *q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}
static inline __m512 widen16_masked(const int8_t *q, __mmask16 m) { /* the first popcount(m) of them, zeros after */
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q)));
}

/* The sums of a, b, c and d's sixteen lanes, in that order: three shuffle-and-add rounds for all four, where four
 * separate reductions take four rounds each. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E)); /* 128-bit lane k now holds four partial sums of a, b, c, d's k */
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
}
#else
#define AVX512 0
#endif


/* e^x to float32's precision (relative error ~1e-7 across float's normal range; x is first held to [-87.3, 88.3],
 * so that e^x stays a normal float), written so that a loop of it vectorises: libm's expf is a call per value,
 * which made the softmax and SwiGLU's SiLU most of those kernels' time. Cody and Waite's range reduction
 * x = n ln 2 + r, |r| <= ln 2 / 2, Cephes' polynomial for e^r, and 2^n written into the exponent bits. */
static inline float exp_(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rounded to an integer: 1.5 2^23 */
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  union { int32_t i; float f; } two_n = {.i = bits};
  return p * two_n.f;
}

/* s[j] = sum_i x[i] w_j[i] for j < 4, over n values: one pass over x for four weight rows (four independent sums
 * hide the add latency). With AVX-512 the four sums are reduced together (sum4), faster than the compiler's
 * four reductions. */
static inline void dot4(const float *x, const float *w0, const float *w1, const float *w2, const float *w3, int64_t n,
                        float *s) {
#if AVX512
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 xv = _mm512_loadu_ps(x + i);
    a0 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w0 + i), a0);
    a1 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w1 + i), a1);
    a2 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w2 + i), a2);
    a3 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(w3 + i), a3);
  }
  if (i < n) {
    __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
    __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
    a0 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w0 + i), a0);
    a1 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w1 + i), a1);
    a2 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w2 + i), a2);
    a3 = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w3 + i), a3);
  }
  _mm_storeu_ps(s, sum4(a0, a1, a2, a3));
#else
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; i++) {
    s0 += x[i] * w0[i];
    s1 += x[i] * w1[i];
    s2 += x[i] * w2[i];
    s3 += x[i] * w3[i];
  }
  s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
#endif
}

static inline float dot(const float *x, const float *w, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; i++) s += x[i] * w[i];
  return s;
}

/* y[r, o] (=, or += when accumulate) sum_i x[r, i] w[o, i] + b[o], for r < rows, o < d_out: four output features
 * at a time (dot4). */
static void linear_f32(const float *x, const float *w, const float *b, float *y, int64_t rows, int64_t d_in,
                       int64_t d_out, int accumulate) {
  int64_t blocks = (d_out + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
#pragma omp for schedule(static) nowait
  for (int64_t blk = 0; blk < blocks; blk++) {
    int64_t o = blk * ROWS_AT_ONCE;
    if (o + ROWS_AT_ONCE <= d_out) {
      const float *w0 = w + o * d_in, *w1 = w0 + d_in, *w2 = w1 + d_in, *w3 = w2 + d_in;
      for (int64_t r = 0; r < rows; r++) {
        float s[ROWS_AT_ONCE];
        dot4(x + r * d_in, w0, w1, w2, w3, d_in, s);
        for (int j = 0; j < ROWS_AT_ONCE; j++) {
          float v = s[j] + (b ? b[o + j] : 0.0f);
          y[r * d_out + o + j] = accumulate ? y[r * d_out + o + j] + v : v;
        }
      }
    } else {
      for (; o < d_out; o++)
        for (int64_t r = 0; r < rows; r++) {
          float v = dot(x + r * d_in, w + o * d_in, d_in) + (b ? b[o] : 0.0f);
          y[r * d_out + o] = accumulate ? y[r * d_out + o] + v : v;
        }
    }
  }
}

void attnlab_linear_f32(const float *x, const float *w, const float *b, float *y, int64_t rows, int64_t d_in,
                        int64_t d_out, int accumulate, int threads) {
#pragma omp parallel num_threads(threads) if (d_in * d_out > 32768)
  linear_f32(x, w, b, y, rows, d_in, d_out, accumulate);
}

/* sum_i x[i] q[i] for int8 q, widened to float in registers. The portable loop below vectorises, but
 * gcc widens int8 -> float through several shuffles; with AVX2 one sign-extending load per 8 weights and four
 * independent sums run faster (benchmarks/README.md). With AVX-512 attnlab_linear_i8 below does
 * not call this at all. */
static inline float dot_i8(const float *x, const int8_t *q, int64_t n) {
  int64_t i = 0;
  float s = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i)))), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i + 8)))), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i + 16)))), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i + 24)))), a3);
  }
  __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  s = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#endif
#pragma omp simd reduction(+ : s)
  for (int64_t j = i; j < n; j++) s += x[j] * (float)q[j];
  return s;
}


/* The same product with int8 weights and one scale per output feature (weight-only quantization; the
 * activations stay float32): y[r, o] = scale[o] sum_i x[r, i] q[o, i] + b[o].
 *
 * With AVX-512, four weight rows per pass share each load of x (as the float32 loop does), their four sums are
 * reduced together, and the scale is applied once per row. Each pass also asks for the weights PREFETCH_AHEAD
 * bytes further on: widening int8 costs enough instructions that, without it, the core computed and then
 * waited for memory in turn; prefetched, the two overlap (benchmarks/README.md, issue 14). */
static void linear_i8(const float *x, const int8_t *q, const float *scale, const float *b, float *y, int64_t rows,
                      int64_t d_in, int64_t d_out, int accumulate) {
#if AVX512
  int64_t blocks = (d_out + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
#pragma omp for schedule(static) nowait
  for (int64_t blk = 0; blk < blocks; blk++) {
    int64_t o = blk * ROWS_AT_ONCE, n = d_out - o < ROWS_AT_ONCE ? d_out - o : ROWS_AT_ONCE;
    /* a last block of fewer than four rows repeats its first row in the missing ones and stores only n sums */
    const int8_t *q0 = q + o * d_in, *q1 = q0 + (n > 1) * d_in, *q2 = q0 + (n > 2) * 2 * d_in, *q3 = q0 + (n > 3) * 3 * d_in;
    for (int64_t r = 0; r < rows; r++) {
      const float *xr = x + r * d_in;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      int64_t i = 0;
      for (; i + 16 <= d_in; i += 16) {
        if (r == 0) _mm_prefetch((const char *)q0 + ROWS_AT_ONCE * i + PREFETCH_AHEAD, _MM_HINT_T0);
        __m512 xv = _mm512_loadu_ps(xr + i);
        a0 = _mm512_fmadd_ps(xv, widen16(q0 + i), a0);
        a1 = _mm512_fmadd_ps(xv, widen16(q1 + i), a1);
        a2 = _mm512_fmadd_ps(xv, widen16(q2 + i), a2);
        a3 = _mm512_fmadd_ps(xv, widen16(q3 + i), a3);
      }
      if (i < d_in) { /* the last d_in % 16 weights: masked loads */
        __mmask16 m = (__mmask16)((1u << (d_in - i)) - 1);
        __m512 xv = _mm512_maskz_loadu_ps(m, xr + i);
        a0 = _mm512_fmadd_ps(xv, widen16_masked(q0 + i, m), a0);
        a1 = _mm512_fmadd_ps(xv, widen16_masked(q1 + i, m), a1);
        a2 = _mm512_fmadd_ps(xv, widen16_masked(q2 + i, m), a2);
        a3 = _mm512_fmadd_ps(xv, widen16_masked(q3 + i, m), a3);
      }
      float sums[ROWS_AT_ONCE];
      _mm_storeu_ps(sums, sum4(a0, a1, a2, a3));
      for (int64_t j = 0; j < n; j++) {
        float v = sums[j] * scale[o + j] + (b ? b[o + j] : 0.0f);
        y[r * d_out + o + j] = accumulate ? y[r * d_out + o + j] + v : v;
      }
    }
  }
#else
#pragma omp for schedule(static) nowait
  for (int64_t o = 0; o < d_out; o++)
    for (int64_t r = 0; r < rows; r++) {
      float v = dot_i8(x + r * d_in, q + o * d_in, d_in) * scale[o] + (b ? b[o] : 0.0f);
      y[r * d_out + o] = accumulate ? y[r * d_out + o] + v : v;
    }
#endif
}

/* attnlab_linear_i8's loop on one thread or, when the product is large enough to pay for it, on `threads` */
void attnlab_linear_i8(const float *x, const int8_t *q, const float *scale, const float *b, float *y, int64_t rows,
                       int64_t d_in, int64_t d_out, int accumulate, int threads) {
#pragma omp parallel num_threads(threads) if (d_in * d_out > 65536)
  linear_i8(x, q, scale, b, y, rows, d_in, d_out, accumulate);
}

/* RoPE on a single position per row, in place (LLaMA's rotate-half pairing, attnlab.positions.apply_rope):
 * x [rows, heads, d_head]; cos, sin [n, rotary_dim], the angles of positions 0..n-1, read at row r's
 * positions[r]. For i < rotary_dim / 2, with c, s that position's angles and h = rotary_dim / 2:
 * (x_i, x_{i+h}) -> (x_i c_i - x_{i+h} s_i, x_{i+h} c_{i+h} + x_i s_{i+h}). */
void attnlab_rope(float *x, const float *cos_, const float *sin_, const int64_t *positions, int64_t rows,
                  int64_t heads, int64_t d_head, int64_t rotary_dim) {
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

/* The residual stream's start for one token per row: out[r] = table[ids[r]] (+ positions_table[positions[r]] when
 * that is not NULL: learned absolute positions), d values per row (attnlab.Transformer.embed_tokens). */
void attnlab_embed(const int64_t *ids, const float *table, const int64_t *positions, const float *positions_table,
                   float *out, int64_t rows, int64_t d) {
  for (int64_t r = 0; r < rows; r++) {
    const float *e = table + ids[r] * d, *p = positions_table ? positions_table + positions[r] * d : NULL;
    float *o = out + r * d;
    if (p) {
#pragma omp simd
      for (int64_t i = 0; i < d; i++) o[i] = e[i] + p[i];
    } else
      memcpy(o, e, d * sizeof(float));
  }
}

/* o[i] = inv sum_s p[s] v[s, i] for i < d, the values v [n, d] row-major: the attention's mix of values. The sums
 * stay in registers across the keys, 64 values of o at a time (AVX-512, d a multiple of 16); adding into o in
 * memory made each key's pass wait for the last one's stores, a large share of the kernel's time. */
static inline void weighted_sum(const float *p, const float *v, int64_t n, int64_t d, float inv, float *o) {
  /* a masked key (p = 0) is multiplied, not skipped: a NaN value there makes NaN, as softmax(...) @ V does */
#if AVX512
  if (d % 16 == 0) {
    for (int64_t i0 = 0; i0 < d; i0 += 64) {
      int64_t m = d - i0 < 64 ? (d - i0) / 16 : 4; /* vectors of 16 in this chunk */
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      const float *vv = v + i0;
      for (int64_t s = 0; s < n; s++, vv += d) {
        __m512 w = _mm512_set1_ps(p[s]);
        a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vv), a0);
        if (m > 1) a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vv + 16), a1);
        if (m > 2) a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vv + 32), a2);
        if (m > 3) a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vv + 48), a3);
      }
      __m512 scale = _mm512_set1_ps(inv);
      _mm512_storeu_ps(o + i0, _mm512_mul_ps(a0, scale));
      if (m > 1) _mm512_storeu_ps(o + i0 + 16, _mm512_mul_ps(a1, scale));
      if (m > 2) _mm512_storeu_ps(o + i0 + 32, _mm512_mul_ps(a2, scale));
      if (m > 3) _mm512_storeu_ps(o + i0 + 48, _mm512_mul_ps(a3, scale));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < d; i++) o[i] = 0.0f;
  for (int64_t s = 0; s < n; s++) {
    const float *vv = v + s * d;
#pragma omp simd
    for (int64_t i = 0; i < d; i++) o[i] += p[s] * vv[i];
  }
#pragma omp simd
  for (int64_t i = 0; i < d; i++) o[i] *= inv;
}

/* One query per row attends to the cached keys and values (the chapter's softmax(q K^T scale + mask) V):
 * first the new key and value are written to cache slot `slot`, then query head h of row r reads key/value
 * head h / (heads / kv_heads) (grouped-query attention) at slots [0, slot], those with key_mask[r, s] set
 * (key_mask NULL: all); the slot is read from *slot_at, so a prepared call serves every step. q, out [rows, heads, d_head]; k_new, v_new [rows, kv_heads, d_head]; k_cache, v_cache
 * [rows, kv_heads, max_len, d_head]; key_mask [rows, mask_stride] bytes; scores: room for rows * heads * max_len
 * floats. A row that may see no key gets zeros, as attnlab.attention does. */
static void attend(const float *q, const float *k_new, const float *v_new, float *k_cache, float *v_cache,
                   const uint8_t *key_mask, int64_t mask_stride, float *scores, float *out, int64_t rows,
                   int64_t heads, int64_t kv_heads, int64_t d_head, int64_t max_len, const int64_t *slot_at,
                   float scale) {
  int64_t slot = *slot_at, group = heads / kv_heads, n = slot + 1;
#pragma omp single /* one thread writes the new key and value; the others wait for them at its end */
  for (int64_t r = 0; r < rows; r++)
    for (int64_t g = 0; g < kv_heads; g++) {
      int64_t at = ((r * kv_heads + g) * max_len + slot) * d_head;
      memcpy(k_cache + at, k_new + (r * kv_heads + g) * d_head, d_head * sizeof(float));
      memcpy(v_cache + at, v_new + (r * kv_heads + g) * d_head, d_head * sizeof(float));
    }
#pragma omp for schedule(static) nowait
  for (int64_t rh = 0; rh < rows * heads; rh++) {
    int64_t r = rh / heads, h = rh % heads;
    const float *qv = q + rh * d_head;
    const float *kb = k_cache + (r * kv_heads + h / group) * max_len * d_head;
    const float *vb = v_cache + (r * kv_heads + h / group) * max_len * d_head;
    const uint8_t *mask = key_mask ? key_mask + r * mask_stride : NULL;
    float *p = scores + rh * max_len, *o = out + rh * d_head;
    int64_t s = 0; /* q·k for every key, four keys at a time (masked ones too: they are set to -inf below) */
    for (; s + 4 <= n; s += 4) {
      const float *k0 = kb + s * d_head;
      dot4(qv, k0, k0 + d_head, k0 + 2 * d_head, k0 + 3 * d_head, d_head, p + s);
    }
    for (; s < n; s++) p[s] = dot(qv, kb + s * d_head, d_head);
    float top = -INFINITY;
#pragma omp simd
    for (s = 0; s < n; s++) p[s] *= scale;
    if (mask)
      for (s = 0; s < n; s++) p[s] = mask[s] ? p[s] : -INFINITY;
#pragma omp simd reduction(max : top)
    for (s = 0; s < n; s++) top = p[s] > top ? p[s] : top;
    if (top == -INFINITY) { /* no visible key */
      for (int64_t i = 0; i < d_head; i++) o[i] = 0.0f;
      continue;
    }
    float total = 0;
#pragma omp simd reduction(+ : total)
    for (s = 0; s < n; s++) {
      p[s] = p[s] == -INFINITY ? 0.0f : exp_(p[s] - top);
      total += p[s];
    }
    weighted_sum(p, vb, n, d_head, 1.0f / total, o);
  }
}

void attnlab_attend(const float *q, const float *k_new, const float *v_new, float *k_cache, float *v_cache,
                    const uint8_t *key_mask, int64_t mask_stride, float *scores, float *out, int64_t rows,
                    int64_t heads, int64_t kv_heads, int64_t d_head, int64_t max_len, const int64_t *slot_at,
                    float scale, int threads) {
#pragma omp parallel num_threads(threads) if (rows * heads * (*slot_at + 1) * d_head > 65536)
  attend(q, k_new, v_new, k_cache, v_cache, key_mask, mask_stride, scores, out, rows, heads, kv_heads, d_head,
         max_len, slot_at, scale);
}

/* RMSNorm (Zhang & Sennrich 2019): out = x / sqrt(mean(x^2) + eps) * w, each of `rows` rows of d. */
void attnlab_rms_norm(const float *x, const float *w, float *out, int64_t rows, int64_t d, float eps) {
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

/* LayerNorm (Ba et al. 2016): out = (x - mean) / sqrt(var + eps) * w + b (b may be NULL), each row of d. */
void attnlab_layer_norm(const float *x, const float *w, const float *b, float *out, int64_t rows, int64_t d, float eps) {
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

/* The MLP's nonlinearities attnlab_activate knows; attnlab.generate.kernels.Activation lists the same names in
 * the same order (tests/test_kernels.py reads this enum and compares). */
typedef enum {
  ACTIVATION_GELU,      /* exact, with erf */
  ACTIVATION_GELU_TANH, /* the tanh approximation (GPT-2's gelu_new) */
  ACTIVATION_RELU,
  ACTIVATION_RELU2, /* ReLU² (modded-nanogpt's, the speedrun recipe's and the demo's) */
} attnlab_activation;

/* The MLP's nonlinearity `kind` (an attnlab_activation), in place on n values. */
void attnlab_activate(float *x, int64_t n, int kind) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    if (kind == ACTIVATION_GELU)
      x[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    else if (kind == ACTIVATION_GELU_TANH)
      x[i] = 0.5f * v * (1.0f + tanhf(0.79788456080286536f * (v + 0.044715f * v * v * v)));
    else if (kind == ACTIVATION_RELU)
      x[i] = v > 0 ? v : 0.0f;
    else
      x[i] = v > 0 ? v * v : 0.0f;
  }
}

/* Logit soft-capping (Gemma 2; modded-nanogpt), in place on n values: x = cap tanh(x / cap). */
void attnlab_softcap(float *x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; i++) x[i] = cap * tanhf(x[i] / cap);
}

/* SwiGLU's product (Shazeer 2020), in place: gate = silu(gate) * up = gate / (1 + exp(-gate)) * up, n values. */
void attnlab_silu_mul(float *gate, const float *up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) { /* below -88, e^-gate is past float's range (exp_ holds it there): silu = -0 */
    float g = gate[i];
    gate[i] = (g < -88.0f ? -0.0f : g / (1.0f + exp_(-g))) * up[i];
  }
}


/* A whole decode step in one parallel region.
 *
 * Called kernel by kernel, a step opened one OpenMP parallel region per product and made a Python call per
 * kernel: between products the threads went to sleep and woke again, and the step took well over the time of
 * its products alone (benchmarks/README.md, issue 14). Here the step is a program, an array of
 * attnlab_op, and `attnlab_run` opens one region for all of it: every thread walks the program, takes its share
 * of each product and attention (`omp for`), one thread takes each small serial kernel (`omp single`), and they
 * wait for each other (`omp barrier`) only after an op whose output the next reads (`wait`). Threads stay hot for
 * the whole step, as in llama.cpp's thread pool (ggml_graph_compute: one barrier per graph node).
 *
 * An op's `kind` names its kernel (attnlab_op_kind); its `a` holds the kernel's arguments in the order of its
 * attnlab_* function above (addresses and integers as 64-bit values; the float argument, where there is one, in
 * `f`, its slot in `a` unused; the `threads` argument unused: the program's own count applies). */

/* The kernels a program can hold. attnlab.generate.kernels.Op lists the same names in the same order, each with
 * its attnlab_* function's argument types (tests/test_kernels.py reads this enum and the functions' parameter
 * lists, and compares them with that table). */
typedef enum {
  OP_LINEAR_F32,
  OP_LINEAR_I8,
  OP_ROPE,
  OP_EMBED,
  OP_ATTEND,
  OP_RMS_NORM,
  OP_LAYER_NORM,
  OP_ACTIVATE,
  OP_SILU_MUL,
  OP_SOFTCAP,
} attnlab_op_kind;

typedef struct {
  int64_t kind, wait; /* kind: an attnlab_op_kind */
  int64_t a[17];
  double f;
} attnlab_op;

#define ARG(i, type) ((type)(intptr_t)op->a[i])

/* [lo, hi): this thread's share of n elementwise values, in whole cache lines */
static void share(int64_t n, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
  int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
  int64_t t = 0, nt = 1;
#endif
  int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
  *lo = t * chunk < n ? t * chunk : n;
  *hi = *lo + chunk < n ? *lo + chunk : n;
}

static void run_op(const attnlab_op *op) {
  int64_t lo, hi;
  switch (op->kind) {
  case OP_LINEAR_F32:
    linear_f32(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *), ARG(3, float *), op->a[4],
               op->a[5], op->a[6], (int)op->a[7]);
    break;
  case OP_LINEAR_I8:
    linear_i8(ARG(0, const float *), ARG(1, const int8_t *), ARG(2, const float *), ARG(3, const float *),
              ARG(4, float *), op->a[5], op->a[6], op->a[7], (int)op->a[8]);
    break;
  case OP_ROPE:
#pragma omp single nowait
    attnlab_rope(ARG(0, float *), ARG(1, const float *), ARG(2, const float *), ARG(3, const int64_t *), op->a[4],
                 op->a[5], op->a[6], op->a[7]);
    break;
  case OP_EMBED:
#pragma omp single nowait
    attnlab_embed(ARG(0, const int64_t *), ARG(1, const float *), ARG(2, const int64_t *), ARG(3, const float *),
                  ARG(4, float *), op->a[5], op->a[6]);
    break;
  case OP_ATTEND:
    attend(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *), ARG(3, float *), ARG(4, float *),
           ARG(5, const uint8_t *), op->a[6], ARG(7, float *), ARG(8, float *), op->a[9], op->a[10], op->a[11],
           op->a[12], op->a[13], ARG(14, const int64_t *), (float)op->f);
    break;
  case OP_RMS_NORM:
#pragma omp single nowait
    attnlab_rms_norm(ARG(0, const float *), ARG(1, const float *), ARG(2, float *), op->a[3], op->a[4], (float)op->f);
    break;
  case OP_LAYER_NORM:
#pragma omp single nowait
    attnlab_layer_norm(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *), ARG(3, float *),
                       op->a[4], op->a[5], (float)op->f);
    break;
  case OP_ACTIVATE:
    share(op->a[1], &lo, &hi);
    attnlab_activate(ARG(0, float *) + lo, hi - lo, (int)op->a[2]);
    break;
  case OP_SILU_MUL:
    share(op->a[2], &lo, &hi);
    attnlab_silu_mul(ARG(0, float *) + lo, ARG(1, const float *) + lo, hi - lo);
    break;
  case OP_SOFTCAP:
    share(op->a[1], &lo, &hi);
    attnlab_softcap(ARG(0, float *) + lo, hi - lo, (float)op->f);
    break;
  }
}

void attnlab_run(const attnlab_op *ops, int64_t n, int threads) {
#pragma omp parallel num_threads(threads)
  for (int64_t i = 0; i < n; i++) {
    run_op(ops + i);
    if (ops[i].wait) {
#pragma omp barrier
    }
  }
}
