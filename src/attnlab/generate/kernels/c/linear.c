/* The decode step's float32 and int8 products: y = x W^T + b for the few rows of one decoding step
 * (a row per sequence), W float32 or int8 with one scale per output feature.
 *
 * Why: a decode step reads every weight once to multiply it by one row, so it runs at the speed
 * weights stream from memory, which BLAS's one-row product fell well short of
 * (benchmarks/README.md, issue 14); these loops stream each weight row once, four rows at a time
 * (four independent sums hide the add latency), like llama.cpp's ggml_vec_dot. Plain C with
 * `#pragma omp simd` reductions: the compiler vectorises them for the build's instruction set; both
 * products also have an AVX-512 form written with intrinsics (`#if AVX512`), the int8 one an AVX2
 * form too, the portable loop staying the fallback, and tests/test_kernels.py builds and checks
 * both. Threads: OpenMP, the runtime torch itself runs on, split over output features. */
#include "common.h"
#include "vec.h"

/* s[j] = sum_i x[i] w_j[i] for j < 4, over n values: one pass over x for four weight rows (four
 * independent sums hide the add latency). With AVX-512 the four sums are reduced together (sum4),
 * in fewer shuffles than the compiler's four reductions (benchmarks/README.md). */
static inline void dot4(const float *x, const float *w0, const float *w1, const float *w2,
                        const float *w3, int64_t n, float *s) {
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

/* y[r, o] (=, or += when accumulate) sum_i x[r, i] w[o, i] + b[o], for r < rows, o < d_out: four
 * output features at a time (dot4). */
static void linear_f32(const float *x, const float *w, const float *b, float *y, int64_t rows,
                       int64_t d_in, int64_t d_out, int accumulate) {
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

void attnlab_linear_f32(const float *x, const float *w, const float *b, float *y, int64_t rows,
                        int64_t d_in, int64_t d_out, int accumulate, int threads) {
#pragma omp parallel num_threads(threads) if (d_in * d_out > 32768)
  linear_f32(x, w, b, y, rows, d_in, d_out, accumulate);
}

/* sum_i x[i] q[i] for int8 q, widened to float (the portable build's loop; the AVX-512 and AVX2
 * builds run attnlab_linear_i8's four-row loops below instead) */
static inline float dot_i8(const float *x, const int8_t *q, int64_t n) {
  float s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; i++) s += x[i] * (float)q[i];
  return s;
}

/* the vector of the build's int8 loop: 16 floats (AVX-512) or 8 (AVX2 with FMA), and its ops */
#if AVX512
#define I8_WIDTH 16
#define I8_VEC __m512
#define I8_ZERO _mm512_setzero_ps
#define I8_LOAD _mm512_loadu_ps
#define I8_FMA _mm512_fmadd_ps
#define I8_WIDEN widen16
#define I8_SUM4 sum4
#elif defined(__AVX2__) && defined(__FMA__)
#define I8_WIDTH 8
#define I8_VEC __m256
#define I8_ZERO _mm256_setzero_ps
#define I8_LOAD _mm256_loadu_ps
#define I8_FMA _mm256_fmadd_ps
#define I8_WIDEN widen8
#define I8_SUM4 sum4_256
#endif

/* The same product with int8 weights and one scale per output feature (weight-only quantization;
 * the activations stay float32): y[r, o] = scale[o] sum_i x[r, i] q[o, i] + b[o].
 *
 * With AVX-512 (16 weights a step) and with AVX2 (8), four weight rows per pass share each load of
 * x (as the float32 loop does), their four sums are reduced together, and the scale is applied
 * once per row. Each pass also asks for the weights PREFETCH_AHEAD bytes further on: widening int8
 * costs enough instructions that, without it, the core computed and then waited for memory in
 * turn; prefetched, the two overlap (benchmarks/README.md, issues 14 and 42: the AVX2 build's
 * former loop, one row at a time and no prefetch, fell behind llama.cpp's Q8_0). A widened weight
 * costs a sign-extending load, a conversion and an FMA whatever the width, so AVX2 spends twice
 * AVX-512's instructions per weight. One loop for both, its vector I8_VEC. */
static void linear_i8(const float *x, const int8_t *q, const float *scale, const float *b, float *y,
                      int64_t rows, int64_t d_in, int64_t d_out, int accumulate) {
#ifdef I8_WIDTH
  int64_t blocks = (d_out + ROWS_AT_ONCE - 1) / ROWS_AT_ONCE;
#pragma omp for schedule(static) nowait
  for (int64_t blk = 0; blk < blocks; blk++) {
    int64_t o = blk * ROWS_AT_ONCE, n = d_out - o < ROWS_AT_ONCE ? d_out - o : ROWS_AT_ONCE;
    /* a last block of fewer than four rows repeats its first row in the missing ones and stores
     * only n sums */
    const int8_t *q0 = q + o * d_in, *q1 = q0 + (n > 1) * d_in, *q2 = q0 + (n > 2) * 2 * d_in,
                 *q3 = q0 + (n > 3) * 3 * d_in;
    for (int64_t r = 0; r < rows; r++) {
      const float *xr = x + r * d_in;
      I8_VEC a0 = I8_ZERO(), a1 = a0, a2 = a0, a3 = a0;
      int64_t i = 0;
      for (; i + I8_WIDTH <= d_in; i += I8_WIDTH) {
        if (r == 0 && i % 16 == 0) /* one 64-byte line of the four rows' bytes per 16 weights */
          _mm_prefetch((const char *)q0 + ROWS_AT_ONCE * i + PREFETCH_AHEAD, _MM_HINT_T0);
        I8_VEC xv = I8_LOAD(xr + i);
        a0 = I8_FMA(xv, I8_WIDEN(q0 + i), a0);
        a1 = I8_FMA(xv, I8_WIDEN(q1 + i), a1);
        a2 = I8_FMA(xv, I8_WIDEN(q2 + i), a2);
        a3 = I8_FMA(xv, I8_WIDEN(q3 + i), a3);
      }
#if AVX512
      if (i < d_in) { /* the last d_in % 16 weights: masked loads */
        __mmask16 m = (__mmask16)((1u << (d_in - i)) - 1);
        __m512 xv = _mm512_maskz_loadu_ps(m, xr + i);
        a0 = _mm512_fmadd_ps(xv, widen16_masked(q0 + i, m), a0);
        a1 = _mm512_fmadd_ps(xv, widen16_masked(q1 + i, m), a1);
        a2 = _mm512_fmadd_ps(xv, widen16_masked(q2 + i, m), a2);
        a3 = _mm512_fmadd_ps(xv, widen16_masked(q3 + i, m), a3);
        i = d_in;
      }
#endif
      float sums[ROWS_AT_ONCE];
      _mm_storeu_ps(sums, I8_SUM4(a0, a1, a2, a3));
      for (; i < d_in; i++) { /* AVX2: the last d_in % 8 weights */
        sums[0] += xr[i] * (float)q0[i], sums[1] += xr[i] * (float)q1[i];
        sums[2] += xr[i] * (float)q2[i], sums[3] += xr[i] * (float)q3[i];
      }
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

/* attnlab_linear_i8's loop on one thread or, when the product is large enough to pay for it, on
 * `threads` */
void attnlab_linear_i8(const float *x, const int8_t *q, const float *scale, const float *b,
                       float *y, int64_t rows, int64_t d_in, int64_t d_out, int accumulate,
                       int threads) {
#pragma omp parallel num_threads(threads) if (d_in * d_out > 65536)
  linear_i8(x, q, scale, b, y, rows, d_in, d_out, accumulate);
}
