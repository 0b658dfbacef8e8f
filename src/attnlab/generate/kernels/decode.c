/* attnlab's CPU kernels for one decoding step: the few-row products and the single query's attention.
 *
 * Plain C with `#pragma omp simd` reductions, compiled at first use once per instruction set (on x86-64: AVX-512
 * with VNNI, AVX2 with FMA and F16C, portable; elsewhere -march=native), the best one the CPU and the operating
 * system allow chosen at run time (see attnlab/generate/kernels/__init__.py and cpu.c): the compiler vectorises the
 * loops for that instruction set, and the same source compiles to scalar code anywhere else. The two products also have an AVX-512
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

/* Products with weights in ggml's blocks (attnlab.generate.blocks): 32 weights of a row per block with a float16
 * scale d (and, in Q4_1, a float16 offset m). As in llama.cpp (ggml-cpu's quants.c, ggml_vec_dot_q4_0_q8_0 and its
 * siblings), each row of x is first rounded to 8 bits per block of 32 (q8: a float scale dx = max|x| / 127 and
 * q = round(x / dx)), so that a block's product is an integer dot product and one multiply by the two scales:
 *   Q8_0: d dx sum q_w q_x      Q4_0: d dx sum (n - 8) q_x      Q4_1: d dx sum n q_x + m dx sum q_x
 * Each |x - dx q| <= dx / 2, so a product moves by at most sum over blocks of dx / 2 sum |w| (the tests' bound).
 * The integer dot product: AVX-512 VNNI's dpbusd (unsigned 8-bit times signed 8-bit, four products added into
 * each 32-bit lane) where the compiler targets it, AVX2's maddubs + madd otherwise, a plain loop anywhere else;
 * which one is fixed by the build (attnlab.generate.kernels.VARIANTS; the process runs the best build the CPU and
 * the operating system's saved register state allow). Q8_0's signed weights take the sign trick (|w| times
 * x with w's sign). Q4_0's -8 is folded into the lane sums' start (-8 times each lane's four q_x, made once per
 * row of x), Q4_1's m term uses the row's dx sum q_x per block. */
typedef enum {
  BLOCK_Q8_0,
  BLOCK_Q4_0,
  BLOCK_Q4_1,
  BLOCK_Q5_0,
  BLOCK_Q4_K,
  BLOCK_Q5_K,
  BLOCK_Q6_K,
} attnlab_block_type;

#define QK 32
static const int64_t BLOCK_BYTES[] = {34, 18, 20, 22, 144, 176, 210}; /* per attnlab_block_type */
static const int64_t BLOCK_WEIGHTS[] = {32, 32, 32, 32, 256, 256, 256}; /* weights per block, the same order */

/* IEEE half -> float (F16C's instruction where the build has it) */
static inline float half_to_float(const uint8_t *p) {
  uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__) && defined(__AVX2__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F)
    bits = sign | 0x7F800000u | (mant << 13);
  else if (exp)
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  else if (mant == 0)
    bits = sign;
  else { /* subnormal: shift the mantissa up to its leading one */
    int e = -1;
    do {
      e++;
      mant <<= 1;
    } while (!(mant & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((mant & 0x3FF) << 13);
  }
  union { uint32_t u; float f; } v = {bits};
  return v.f;
#endif
}

/* One row of x rounded to 8 bits per block, as the products read it: q [d_in] int8, dx [blocks], sx [blocks]
 * (dx sum q, Q4_1's offset term), c8 [blocks][8] (-8 times each group of four q: Q4_0's start of the lane sums);
 * for the two-block AVX-512 products (and only in their builds) the same again laid out as they load it, so that
 * a pass loads it without a shuffle: ds [blocks][2] (dx, sx of each block: blocks b and b + 1 in one 128-bit
 * load) and c16 [blocks][8] (c8 with its last four, the high nibbles' lanes, times 16); sq [blocks] (sum q: the
 * 16-row products' start of the lane sums, -8 or -128 times it). A block holding a NaN or an infinity gets
 * dx = NaN, so that its products are NaN, as the float product's. */
typedef struct {
  int8_t *q;
  float *dx, *sx, *ds;
  int32_t *c8, *c16, *sq;
} q8_row;

static int64_t align64(int64_t n) { return (n + 63) / 64 * 64; }
static int64_t q8_row_bytes(int64_t d_in) {
  int64_t nb = d_in / QK;
  return align64(d_in) + 2 * align64(4 * nb) + align64(8 * nb) + 2 * 32 * nb + 4 * nb;
}

static q8_row q8_row_at(int8_t *base, int64_t d_in) {
  int64_t nb = d_in / QK;
  q8_row r;
  r.q = base;
  r.dx = (float *)(base + align64(d_in));
  r.sx = (float *)(base + align64(d_in) + align64(4 * nb));
  r.ds = (float *)(base + align64(d_in) + 2 * align64(4 * nb));
  r.c8 = (int32_t *)(base + align64(d_in) + 2 * align64(4 * nb) + align64(8 * nb));
  r.c16 = r.c8 + 8 * nb;
  r.sq = r.c16 + 8 * nb;
  return r;
}

static void quantize_row_q8(const float *x, int64_t d_in, q8_row r) {
  for (int64_t b = 0; b < d_in / QK; b++) {
    const float *xb = x + b * QK;
    float amax = 0.0f, probe = 0.0f;
#pragma omp simd reduction(max : amax) reduction(+ : probe)
    for (int j = 0; j < QK; j++) {
      float a = fabsf(xb[j]);
      amax = a > amax ? a : amax;
      probe += xb[j] * 0.0f; /* NaN when a value is NaN or infinite */
    }
    float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    if (probe != 0.0f) d = NAN, id = 0.0f;
    int8_t *q = r.q + b * QK;
    int32_t sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int j = 0; j < QK; j++) {
      int32_t v = (int32_t)nearbyintf(xb[j] * id); /* |v| <= 127 */
      q[j] = (int8_t)v;
      sum += v;
    }
    r.dx[b] = d;
    r.sx[b] = d * (float)sum;
    r.sq[b] = sum;
    for (int l = 0; l < 8; l++) r.c8[b * 8 + l] = -8 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
#if AVX512 && defined(__AVX512VNNI__) /* only the two-block products read them */
    r.ds[2 * b] = r.dx[b];
    r.ds[2 * b + 1] = r.sx[b];
    for (int l = 0; l < 8; l++) r.c16[b * 8 + l] = r.c8[b * 8 + l] * (l < 4 ? 1 : 16);
#endif
  }
}

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else /* AVX2: pairs of u8 x s8 products into 16 bits (at most 2 x 15 x 127 or 2 x 127 x 127: no saturation), then
         pairs of those into 32 */
#define DPBUSD(acc, u, s) _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#endif
/* whether DPBUSD sums its four products in 32 bits (VNNI), so that an unsigned byte may go up to 255 (maddubs'
 * pairs saturate at 16 bits) */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define DPBUSD_32 1
#else
#define DPBUSD_32 0
#endif

/* the 32 four-bit values of a block's 16 bytes, in weight order: low nibbles (weights 0-15), then high (16-31) */
static inline __m256i nibbles32(const uint8_t *p) {
  __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(0x0F));
}

/* the first four bytes of each of w[0..3] + offset, in that order: four 32-bit loads and three unpacks (through a
 * stack buffer, four 4-byte stores and one 16-byte load, the load cannot take its bytes from the stores: a
 * store-forwarding stall per block) */
static inline __m128i first4_of4(const uint8_t *const w[4], int64_t offset) {
  int32_t h[4];
  for (int k = 0; k < 4; k++) memcpy(h + k, w[k] + offset, 4);
  return _mm_unpacklo_epi64(_mm_unpacklo_epi32(_mm_cvtsi32_si128(h[0]), _mm_cvtsi32_si128(h[1])),
                            _mm_unpacklo_epi32(_mm_cvtsi32_si128(h[2]), _mm_cvtsi32_si128(h[3])));
}

/* The four float16 at the start of block b of rows w[0..3] (their d; the second is Q4_1's m, Q4_K's dmin, or the
 * first half of Q5_0's high bits, never read), as eight floats: row k's d in lane 2k */
static inline __m256 heads4(const uint8_t *const w[4], int64_t offset) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(first4_of4(w, offset));
#else
  uint8_t head[16];
  for (int k = 0; k < 4; k++) memcpy(head + 4 * k, w[k] + offset, 4);
  float halves[8];
  for (int i = 0; i < 8; i++) halves[i] = half_to_float(head + 2 * i);
  return _mm256_loadu_ps(halves);
#endif
}

/* the sums of a, b, c and d's eight lanes, in that order */
static inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

#if AVX512 && defined(__AVX512VNNI__)
/* Two blocks per step in 512-bit vectors (AVX-512 with VNNI): each weight row's two blocks come in one (masked)
 * load, which also holds their d (and Q4_1's m); one word permute (vpermw) lays their bytes out as dpbusd reads
 * them, so that one dpbusd, one conversion and one FMA serve 64 weights of a row where the 256-bit loop spends
 * them on 32, and the four rows' scales come out of those loads by three permutes instead of eight scalar loads
 * (benchmarks/README.md, issue 25: with the 256-bit loop a product's compute took 77-90 % of its streamed time).
 *   Q4_0 / Q4_1: the 36 / 40 bytes of blocks b and b + 1 are words 0..17 / 0..19 of the load; vpermw gives
 *     [block b's 16 nibble bytes twice | block b + 1's twice], then the upper copy of each is shifted right by 4
 *     (weights 0-15 in the low nibbles, 16-31 in the high), so that the 64 bytes are the two blocks' 4-bit values
 *     in weight order, opposite x's 64 bytes.
 *   Q8_0: 68 bytes, one 64-byte load (d, q of block b, d of b + 1, most of its q) and one of b + 1's 32 q bytes;
 *     a two-source word permute puts the 64 q bytes together; dpbusd multiplies unsigned by signed bytes, so the
 *     weights go in as q + 128 (xor 0x80) and the lane sums start at -128 times x's sums of four, 16 c8.
 * A row's last block, when nb is odd, goes alone through the same steps with masked loads (the missing block's
 * bytes, x, scales read as zeros). Lanes 0-7 of a row's sums are block b's, 8-15 block b + 1's. */
typedef struct {
  __m512i take, heads, nibble, lane[4];
} q_consts;

/* blocks b and b + 1 (b alone when !two) of rows w[0..3] into acc (and Q4_1's m_sum); `full`: both blocks there
 * and 64 bytes readable from each row's block b, so that every load is a plain one (on Sapphire Rapids a masked
 * load also takes a vector ALU uop, and a pass has ten of them) */
static inline __attribute__((always_inline)) void pair_q(int type, const uint8_t *const w[4], q8_row r, int64_t b,
                                                         int two, int full, const q_consts *c, __m512 acc[4],
                                                         __m512 *m_sum) {
  const int64_t bytes = BLOCK_BYTES[type];
  const __mmask64 row_mask = two ? (bytes >= 32 ? ~(__mmask64)0 : ((__mmask64)1 << (2 * bytes)) - 1)
                                 : ((__mmask64)1 << bytes) - 1;
  const __mmask16 half = two ? 0xFFFF : 0x00FF;
  __m512i xq = full ? _mm512_loadu_si512(r.q + b * QK) : _mm512_maskz_loadu_epi32(half, r.q + b * QK);
  /* the lane sums' start: Q4_0's -8 per group of four x (c8; -128 in the lanes of high nibbles, which come 16
   * times their value), Q8_0's -128 (16 c8), none for Q4_1 */
  const int32_t *c8 = type == BLOCK_Q4_0 ? r.c16 : r.c8;
  __m512i start = type == BLOCK_Q4_1 ? _mm512_setzero_si512()
                  : full             ? _mm512_loadu_si512(c8 + b * 8)
                                     : _mm512_maskz_loadu_epi32(half, c8 + b * 8);
  __m512i row[4], v[4];
  for (int k = 0; k < 4; k++)
    row[k] = full ? _mm512_loadu_si512(w[k] + b * bytes) : _mm512_maskz_loadu_epi8(row_mask, w[k] + b * bytes);
  if (type == BLOCK_Q8_0) {
    start = _mm512_slli_epi32(start, 4);
    for (int k = 0; k < 4; k++) {
      const uint8_t *q = w[k] + (b + 1) * bytes + 2; /* block b + 1's q */
      __m512i next = _mm512_castsi256_si512(full ? _mm256_loadu_si256((const __m256i *)q)
                                                 : _mm256_maskz_loadu_epi32(two ? 0xFF : 0x00, q));
      v[k] = _mm512_xor_si512(_mm512_permutex2var_epi16(row[k], c->take, next), _mm512_set1_epi8((char)0x80));
    }
  } else {
    for (int k = 0; k < 4; k++)
      v[k] = _mm512_and_si512(_mm512_permutexvar_epi16(c->take, row[k]), c->nibble);
  }
  /* d (m) of both blocks, four rows: [d0 m0 d0' m0' d1 m1 d1' m1' ...] (' block b + 1) */
  __m256i dm16 = _mm256_inserti128_si256(_mm512_castsi512_si256(_mm512_permutex2var_epi16(row[0], c->heads, row[1])),
                                         _mm512_castsi512_si128(_mm512_permutex2var_epi16(row[2], c->heads, row[3])), 1);
  __m512 dm = _mm512_cvtph_ps(dm16);
  __m128 ds = full ? _mm_loadu_ps(r.ds + 2 * b) : _mm_maskz_loadu_ps(two ? 15 : 3, r.ds + 2 * b); /* dx sx dx' sx' */
  __m512 scale = _mm512_mul_ps(dm, _mm512_broadcast_f32x4(ds)); /* d dx, m sx, d' dx', m' sx', four rows */
  if (type == BLOCK_Q4_1) *m_sum = _mm512_add_ps(*m_sum, scale);
  /* the scales of the high nibbles' lanes divided by 16 (exact: a power of two), so that the FMA's product is the
   * one of the integer sum that the low nibbles' shift would have given, bit for bit */
  __m512 scale16 = type == BLOCK_Q8_0 ? scale : _mm512_mul_ps(scale, _mm512_set1_ps(1.0f / 16.0f));
  for (int k = 0; k < 4; k++)
    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, v[k], xq)),
                             _mm512_permutex2var_ps(scale, c->lane[k], scale16), acc[k]);
}

static inline __attribute__((always_inline)) void dot4_q(int type, const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[type];
  const int h = (int)bytes / 2;                   /* the word where block b + 1 begins */
  const int at = type == BLOCK_Q4_1 ? 2 : 1;      /* the word where block b's values begin */
  q_consts c;
  /* vpermw: [values of b (8 words) twice | values of b + 1 twice]; Q8_0: its 32 words of q, b then b + 1 */
  c.take = type == BLOCK_Q8_0
               ? _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32, 16, 15, 14, 13, 12,
                                  11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)
               : _mm512_set_epi16(h + at + 7, h + at + 6, h + at + 5, h + at + 4, h + at + 3, h + at + 2,
                                  h + at + 1, h + at, h + at + 7, h + at + 6, h + at + 5, h + at + 4, h + at + 3,
                                  h + at + 2, h + at + 1, h + at, at + 7, at + 6, at + 5, at + 4, at + 3, at + 2,
                                  at + 1, at, at + 7, at + 6, at + 5, at + 4, at + 3, at + 2, at + 1, at);
  /* two rows' heads: words 0, 1, h, h + 1 of each (d, m of block b, then of b + 1) */
  c.heads = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32 + h + 1,
                             32 + h, 33, 32, h + 1, h, 1, 0);
  /* the 4-bit values without a shift: the low nibbles of the first copy of each block's bytes (weights 0-15), the
   * high nibbles of the second as they are, 16 times their value (weights 16-31; at most 240 x 127 x 4 in a lane) */
  c.nibble = _mm512_set_epi64(-0x0F0F0F0F0F0F0F10, -0x0F0F0F0F0F0F0F10, 0x0F0F0F0F0F0F0F0F, 0x0F0F0F0F0F0F0F0F,
                              -0x0F0F0F0F0F0F0F10, -0x0F0F0F0F0F0F0F10, 0x0F0F0F0F0F0F0F0F, 0x0F0F0F0F0F0F0F0F);
  /* row k's scale d dx: lane 4k of the heads' products for block b, 4k + 2 for block b + 1; the high nibbles'
   * lanes (Q4_0, Q4_1) from the scales divided by 16 (indices 16 on) */
  const int hi = type == BLOCK_Q8_0 ? 0 : 16;
  for (int k = 0; k < 4; k++)
    c.lane[k] = _mm512_set_epi32(hi + 4 * k + 2, hi + 4 * k + 2, hi + 4 * k + 2, hi + 4 * k + 2, 4 * k + 2,
                                 4 * k + 2, 4 * k + 2, 4 * k + 2, hi + 4 * k, hi + 4 * k, hi + 4 * k, hi + 4 * k,
                                 4 * k, 4 * k, 4 * k, 4 * k);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __m512 m_sum = _mm512_setzero_ps(); /* Q4_1: m sx in lanes 4k + 1 and 4k + 3 */
  int64_t b = 0;
  for (; b + 1 < nb && b * bytes + 64 <= nb * bytes; b += 2) pair_q(type, w, r, b, 1, 1, &c, acc, &m_sum);
  for (; b < nb; b += 2) pair_q(type, w, r, b, b + 1 < nb, 0, &c, acc, &m_sum);
  _mm_storeu_ps(s, sum4(acc[0], acc[1], acc[2], acc[3]));
  if (type == BLOCK_Q4_1) {
    float m[16];
    _mm512_storeu_ps(m, m_sum);
    for (int k = 0; k < 4; k++) s[k] += m[4 * k + 1] + m[4 * k + 3];
  }
}
#else
/* s[k] = the product of block rows w[k] (k < 4, nb blocks each) with the rounded row r of x */
static inline __attribute__((always_inline)) void dot4_q(int type, const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  int64_t bytes = BLOCK_BYTES[type];
#if defined(__AVX2__)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 m_sum = _mm256_setzero_ps(); /* Q4_1: m_k sx summed in lane 2k + 1 */
  /* the four rows' scales (and Q4_1's offsets) come together: the first dword of each row's block (d, then m) in
   * one gather, eight halves converted at once, each row's d dx spread over its vector by one permute; one scalar
   * conversion and broadcast per row and block before, which made the 4-bit kernels compute-bound */
  const __m256i lane[4] = {_mm256_set1_epi32(0), _mm256_set1_epi32(2), _mm256_set1_epi32(4), _mm256_set1_epi32(6)};
  for (int64_t b = 0; b < nb; b++) {
    __m256i xq = _mm256_loadu_si256((const __m256i *)(r.q + b * QK));
    __m256 dm = heads4(w, b * bytes), scale = _mm256_mul_ps(dm, _mm256_set1_ps(r.dx[b])); /* d_k dx in lane 2k */
    __m256i isum[4];
    if (type == BLOCK_Q8_0) {
      for (int k = 0; k < 4; k++) {
        __m256i wq = _mm256_loadu_si256((const __m256i *)(w[k] + b * bytes + 2));
        isum[k] = DPBUSD(_mm256_setzero_si256(), _mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
      }
    } else if (type == BLOCK_Q4_0) {
      __m256i start = _mm256_loadu_si256((const __m256i *)(r.c8 + b * 8));
      for (int k = 0; k < 4; k++) isum[k] = DPBUSD(start, nibbles32(w[k] + b * bytes + 2), xq);
    } else {
      for (int k = 0; k < 4; k++) isum[k] = DPBUSD(_mm256_setzero_si256(), nibbles32(w[k] + b * bytes + 4), xq);
      m_sum = _mm256_fmadd_ps(dm, _mm256_set1_ps(r.sx[b]), m_sum);
    }
    for (int k = 0; k < 4; k++)
      acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[k]), _mm256_permutevar8x32_ps(scale, lane[k]), acc[k]);
  }
  _mm_storeu_ps(s, sum4_256(acc[0], acc[1], acc[2], acc[3]));
  if (type == BLOCK_Q4_1) {
    float m[8];
    _mm256_storeu_ps(m, m_sum);
    for (int k = 0; k < 4; k++) s[k] += m[2 * k + 1];
  }
#else
  for (int k = 0; k < 4; k++) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t *p = w[k] + b * bytes;
      const int8_t *q = r.q + b * QK;
      int32_t isum = 0;
      if (type == BLOCK_Q8_0) {
        for (int j = 0; j < QK; j++) isum += (int8_t)p[2 + j] * q[j];
      } else {
        const uint8_t *n = p + (type == BLOCK_Q4_1 ? 4 : 2);
        for (int j = 0; j < QK / 2; j++) isum += (n[j] & 15) * q[j] + (n[j] >> 4) * q[j + 16];
        if (type == BLOCK_Q4_0)
          for (int l = 0; l < 8; l++) isum += r.c8[b * 8 + l];
      }
      total += half_to_float(p) * r.dx[b] * (float)isum;
      if (type == BLOCK_Q4_1) total += half_to_float(p + 2) * r.sx[b];
    }
    s[k] = total;
  }
#endif
}

#endif /* two blocks per step in 512-bit vectors */

/* Q5_0 and the K-quants (ggml-common.h's block_q5_0, block_q4_K, block_q5_K, block_q6_K; their values as
 * ggml-quants.c's dequantize_row_* and gguf-py's quants.py read them):
 *   Q5_0, 22 bytes per 32 weights: d, qh (32 high bits), 16 bytes of low nibbles;   w = d (n - 16), n in 0..31
 *   Q4_K, 144 bytes per 256: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles;
 *         sub-block s of 32: w = d sc_s n - dmin m_s, n in 0..15
 *   Q5_K, 176 bytes per 256: Q4_K's head, 32 bytes of high bits (bit s of byte j: weight j of sub-block s),
 *         128 bytes of nibbles; w = d sc_s n - dmin m_s, n in 0..31
 *   Q6_K, 210 bytes per 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 weights), d;
 *         w = d sc (n - 32), n in 0..63
 * The products read the same 8-bit activation rows as Q8_0/Q4_0/Q4_1 above (one scale per 32 values), so a
 * sub-block of 32 is one integer dot product (dpbusd or maddubs: unsigned n times signed q, the offsets -16 and
 * -32 folded into the lane sums' start as Q4_0's -8 is), times its float scales. llama.cpp instead rounds the
 * activations of a K-quant product to Q8_K (one scale per 256) so that it can add a super-block's scaled integer
 * sums before one float multiply; a scale per 32 rounds less (the tests' bound is the same as for the 32-weight
 * types), and horizontal adds fold the eight sub-blocks' lane sums into one vector, so that the per-32 scales
 * still cost one FMA per block of 256 (dot4_q_k); Q5_0 folds the four rows of a pass the same way (dot4_q5_0). */

/* sub-block j's 6-bit scale and min (j < 8) from a Q4_K / Q5_K block's 12 bytes: bytes 0-3 hold the low six bits
 * of scales 0-3, bytes 4-7 those of mins 0-3, bytes 8-11 the low four bits of scales and mins 4-7, whose top two
 * bits sit in the top two bits of bytes 0-7 (ggml-quants.c, get_scale_min_k4) */
static inline void scale_min_k(const uint8_t *s, int j, int *sc, int *m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/* the 32 unsigned values n of sub-block s of block p (type Q5_0: s = 0; K-quants: s < 8), in weight order */
static inline void values_of(int type, const uint8_t *p, int s, uint8_t *n) {
  if (type == BLOCK_Q5_0) {
    uint32_t qh;
    memcpy(&qh, p + 2, 4);
    for (int j = 0; j < QK / 2; j++) {
      n[j] = (uint8_t)((p[6 + j] & 15) | ((qh >> j) & 1) << 4);
      n[j + QK / 2] = (uint8_t)((p[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
  } else if (type == BLOCK_Q6_K) { /* half h of the block, quarter t of that half */
    int h = s / 4, t = s % 4;
    const uint8_t *ql = p + 64 * h + 32 * (t & 1), *qh = p + 128 + 32 * h;
    for (int j = 0; j < QK; j++) n[j] = (uint8_t)(((ql[j] >> (4 * (t >> 1))) & 15) | ((qh[j] >> (2 * t)) & 3) << 4);
  } else { /* Q4_K, Q5_K: sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32i .. 32i + 31 */
    const uint8_t *qs = p + (type == BLOCK_Q5_K ? 48 : 16) + 32 * (s / 2);
    for (int j = 0; j < QK; j++) n[j] = (qs[j] >> (4 * (s & 1))) & 15;
    if (type == BLOCK_Q5_K)
      for (int j = 0; j < QK; j++) n[j] |= (uint8_t)(((p[16 + j] >> s) & 1) << 4);
  }
}

#if defined(__AVX2__)
/* values_of in a register */
static inline __m256i values_of_256(int type, const uint8_t *p, int s) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if (type == BLOCK_Q5_0) { /* byte j takes bit j of qh */
    uint32_t qh;
    memcpy(&qh, p + 2, 4);
#if AVX512 && defined(__AVX512VL__) /* qh is the mask of the bytes that get 16 */
    return _mm256_mask_add_epi8(nibbles32(p + 6), (__mmask32)qh, nibbles32(p + 6), _mm256_set1_epi8(0x10));
#endif
    /* without AVX-512: qh's byte j / 8 to byte j, then a test of bit j % 8 */
    __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                                       0x0101010101010101, 0));
    __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles32(p + 6), high);
  }
  if (type == BLOCK_Q6_K) {
    int h = s / 4, t = s % 4;
    __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32 * (t & 1)));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
    __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (t >> 1)), low4);
    __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), _mm256_set1_epi8(3)), 4);
    return _mm256_or_si256(low, high);
  }
  __m256i qs = _mm256_loadu_si256((const __m256i *)(p + (type == BLOCK_Q5_K ? 48 : 16) + 32 * (s / 2)));
  __m256i n = _mm256_and_si256(_mm256_srli_epi16(qs, 4 * (s & 1)), low4);
  if (type == BLOCK_Q5_K) {
    __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
#if AVX512 && defined(__AVX512VL__) /* the bytes whose bit s is set get 16 */
    return _mm256_mask_add_epi8(n, _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << s))), n, _mm256_set1_epi8(0x10));
#endif
    n = _mm256_or_si256(n, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), _mm256_set1_epi8(1)), 4));
  }
  return n;
}
#endif

#if defined(__AVX2__)
/* s[k] = the product of Q5_0 rows w[k] (k < 4, nb blocks each) with the rounded row r: dot4_q's pattern (x's
 * bytes and -16 start loaded once for the four rows, their four d converted together) with values_of_256's five-bit
 * values */
#if AVX512 && defined(__AVX512VL__) && defined(__AVX512VNNI__)
/* dot4_q's 512-bit form for Q5_0: blocks b and b + 1 of a row in one masked 44-byte load; vpermw puts [block b's
 * 16 nibble bytes twice | block b + 1's twice] (words 3-10 and 14-21), the upper copy of each shifted right by 4;
 * the two blocks' 32-bit qh, read as integers, are the 64-bit byte mask that adds 16. Lanes 0-7 of a row's sums
 * are block b's, 8-15 block b + 1's; an odd last block goes alone with masked loads (zeros in the other half).
 * One weights' load of 64 bytes per row, where a row's last blocks take a masked one. */
static inline void dot4_q5_0(const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[BLOCK_Q5_0];
  const __m512i take = _mm512_set_epi16(21, 20, 19, 18, 17, 16, 15, 14, 21, 20, 19, 18, 17, 16, 15, 14, 10, 9, 8, 7, 6,
                                        5, 4, 3, 10, 9, 8, 7, 6, 5, 4, 3);
  /* two rows' d: words 0 and 11 of each (blocks b and b + 1) */
  const __m512i heads = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 0, 32 + 11, 32, 11, 0);
  const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0), low4 = _mm512_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(0x10);
  /* row k's d dx: lane 2k of the scales for block b, 2k + 1 for block b + 1 */
  const __m512i lane[4] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                           _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
                           _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),
                           _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6)};
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < nb; b += 2) {
    const int two = b + 1 < nb;
    const __mmask64 row_mask = ((__mmask64)1 << (two ? 2 * bytes : bytes)) - 1;
    const __mmask16 half = two ? 0xFFFF : 0x00FF;
    /* plain loads where both blocks are there (a masked load also takes a vector ALU uop on Sapphire Rapids) */
    __m512i xq = two ? _mm512_loadu_si512(r.q + b * QK) : _mm512_maskz_loadu_epi32(half, r.q + b * QK);
    __m512i start = _mm512_slli_epi32(two ? _mm512_loadu_si512(r.c8 + b * 8) : _mm512_maskz_loadu_epi32(half, r.c8 + b * 8),
                                      1); /* -16 sum q */
    __m512i row[4];
    if (b + 3 <= nb) /* 64 bytes stay inside the row (a masked load streamed ~10 % slower) */
      for (int k = 0; k < 4; k++) row[k] = _mm512_loadu_si512(w[k] + b * bytes);
    else
      for (int k = 0; k < 4; k++) row[k] = _mm512_maskz_loadu_epi8(row_mask, w[k] + b * bytes);
    __m256 d = _mm256_cvtph_ps(_mm_unpacklo_epi64(_mm512_castsi512_si128(_mm512_permutex2var_epi16(row[0], heads, row[1])),
                                                  _mm512_castsi512_si128(_mm512_permutex2var_epi16(row[2], heads, row[3]))));
    /* dx of blocks b and b + 1 (zero for a missing one), repeated for the four rows */
    __m256 dx = two ? _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(r.dx + b)))
                    : _mm256_blend_ps(_mm256_set1_ps(r.dx[b]), _mm256_setzero_ps(), 0xAA);
    __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(d, dx));
    for (int k = 0; k < 4; k++) {
      const uint8_t *p = w[k] + b * bytes;
      uint32_t h0, h1 = 0;
      memcpy(&h0, p + 2, 4);
      if (two) memcpy(&h1, p + bytes + 2, 4);
      __m512i v = _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi16(take, row[k]), shift), low4);
      v = _mm512_mask_add_epi8(v, (__mmask64)h0 | (__mmask64)h1 << 32, v, sixteen);
      acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, v, xq)),
                               _mm512_permutexvar_ps(lane[k], scale), acc[k]);
    }
  }
  _mm_storeu_ps(s, sum4(acc[0], acc[1], acc[2], acc[3]));
}
#else
static inline void dot4_q5_0(const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[BLOCK_Q5_0];
  __m256 acc = _mm256_setzero_ps(); /* lanes k and k + 4: row k's sums of weights 0-15 and 16-31 */
  const __m256i spread = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  for (int64_t b = 0; b < nb; b++) {
    __m256i xq = _mm256_loadu_si256((const __m256i *)(r.q + b * QK));
    __m256i start = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(r.c8 + b * 8)), 1); /* -16 sum q */
    __m256i is[4];
    for (int k = 0; k < 4; k++) is[k] = DPBUSD(start, values_of_256(BLOCK_Q5_0, w[k] + b * bytes, 0), xq);
    __m256i folded = _mm256_hadd_epi32(_mm256_hadd_epi32(is[0], is[1]), _mm256_hadd_epi32(is[2], is[3]));
    __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(heads4(w, b * bytes), spread), _mm256_set1_ps(r.dx[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), scale, acc);
  }
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)));
}
#endif

/* Q4_K / Q5_K: a block's eight 6-bit scales (bytes 0-7) and mins (bytes 8-15) from its 12 bytes at q (bytes
 * 12-15 read but unused), as four 32-bit lanes of masks and shifts (scale_min_k's layout, four at a time; llama.cpp
 * unpacks them with the same masks in scalar code): with a = q's dwords,
 *   scales 0-3 = a0 & 3F..,  scales 4-7 = (a2 & 0F..) | ((a0 >> 6) & 03..) << 4,
 *   mins 0-3 = a1 & 3F..,    mins 4-7 = ((a2 >> 4) & 0F..) | ((a1 >> 6) & 03..) << 4 */
static inline __m128i scales_mins_k(const uint8_t *q) {
  __m128i a = _mm_loadu_si128((const __m128i *)q);
  __m128i low = _mm_shuffle_epi32(a, _MM_SHUFFLE(2, 1, 2, 0));  /* a0, a2, a1, a2 */
  __m128i high = _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 1, 0, 0)); /* -, a0, -, a1 */
  low = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                      _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
  high = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(high, 6), _mm_setr_epi32(0, 0x03030303, 0, 0x03030303)), 4);
  return _mm_or_si128(low, high);
}

/* s[k] = the product of K-quant rows w[k] (k < 4, nb sub-blocks of 32 each) with the rounded row r. Per block of
 * 256 and row: the eight sub-blocks' integer sums (dpbusd, eight lanes each) folded by horizontal adds into one
 * vector whose lane j is sub-block j's sum (Q6_K: its two halves first, each times its int8 scale, in integers),
 * then one FMA by the eight scales d sc_j dx_j (Q6_K: d dx_j) and, for Q4_K / Q5_K, one by the mins dmin m_j
 * sx_j; x's bytes are loaded once for the four rows. (Converting, scaling and adding each sub-block's eight
 * lanes alone cost four operations per sub-block, where this fold costs about one: benchmarks/README.md.) */
static inline __attribute__((always_inline)) void dot4_q_k(int type, const uint8_t *const w[4], q8_row r, int64_t nb,
                                                           float *s) {
  const int64_t bytes = BLOCK_BYTES[type];
  __m256 acc[4], mins[4];
  for (int k = 0; k < 4; k++) acc[k] = mins[k] = _mm256_setzero_ps();
  /* Q6_K's sixteen scales in the order of the folded halves: sub-blocks 0-3's first halves, then their second */
  const __m128i halves = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int64_t at = b0 / 8 * bytes;
    __m256i xq[8], start[8];
    for (int j = 0; j < 8; j++) {
      xq[j] = _mm256_loadu_si256((const __m256i *)(r.q + (b0 + j) * QK));
      start[j] = type == BLOCK_Q6_K /* -32 times each lane's four q */
                     ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(r.c8 + (b0 + j) * 8)), 2)
                     : _mm256_setzero_si256();
    }
    __m256 dx = _mm256_loadu_ps(r.dx + b0);
#if DPBUSD_32
    /* Q4_K's odd sub-blocks (the high nibbles) taken as they are, 16 times their value, their scales over 16
     * (exact, a power of two): a shift fewer per sub-block pair, the same products bit for bit */
    if (type == BLOCK_Q4_K) dx = _mm256_mul_ps(dx, _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f));
#endif
    for (int k = 0; k < 4; k++) {
      const uint8_t *p = w[k] + at;
      __m256i is[8];
#if DPBUSD_32
      if (type == BLOCK_Q4_K)
        for (int i = 0; i < 4; i++) {
          __m256i qs = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * i));
          is[2 * i] = DPBUSD(start[2 * i], _mm256_and_si256(qs, _mm256_set1_epi8(0x0F)), xq[2 * i]);
          is[2 * i + 1] = DPBUSD(start[2 * i + 1], _mm256_and_si256(qs, _mm256_set1_epi8((char)0xF0)), xq[2 * i + 1]);
        }
      else
#endif
        for (int j = 0; j < 8; j++) is[j] = DPBUSD(start[j], values_of_256(type, p, j), xq[j]);
      /* lanes 0-3: sub-blocks 0-3's (or 4-7's) weights 0-15, lanes 4-7: their weights 16-31 */
      __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(is[0], is[1]), _mm256_hadd_epi32(is[2], is[3]));
      __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(is[4], is[5]), _mm256_hadd_epi32(is[6], is[7]));
      __m256 scale;
      if (type == BLOCK_Q6_K) {
        __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 192)), halves);
        a = _mm256_mullo_epi32(a, _mm256_cvtepi8_epi32(sc));
        c = _mm256_mullo_epi32(c, _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)));
        scale = _mm256_mul_ps(_mm256_set1_ps(half_to_float(p + 208)), dx);
      } else {
        __m128i smv = scales_mins_k(p + 4);
        scale = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smv)), _mm256_set1_ps(half_to_float(p))), dx);
        __m256 dm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8))),
                                  _mm256_set1_ps(half_to_float(p + 2)));
        mins[k] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(r.sx + b0), mins[k]);
      }
      __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31));
      acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[k]);
    }
  }
  for (int k = 0; k < 4; k++) acc[k] = _mm256_sub_ps(acc[k], mins[k]);
  _mm_storeu_ps(s, sum4_256(acc[0], acc[1], acc[2], acc[3]));
}

/* s[k] = the product of rows w[k] (k < 4) of `type` (Q5_0 or a K-quant; nb sub-blocks of 32) with the rounded
 * row r */
static void dot4_q_more(int type, const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  switch (type) {
  case BLOCK_Q5_0:
    dot4_q5_0(w, r, nb, s);
    break;
  case BLOCK_Q4_K:
    dot4_q_k(BLOCK_Q4_K, w, r, nb, s);
    break;
  case BLOCK_Q5_K:
    dot4_q_k(BLOCK_Q5_K, w, r, nb, s);
    break;
  default:
    dot4_q_k(BLOCK_Q6_K, w, r, nb, s);
  }
}
#else
/* The product of one row of blocks w of `type` (Q5_0 or a K-quant; nb sub-blocks of 32) with the rounded row r:
 * the integer sums of each sub-block in plain C */
static float dot_q_more(int type, const uint8_t *w, q8_row r, int64_t nb) {
  int per = type == BLOCK_Q5_0 ? 1 : 8; /* sub-blocks of 32 per block */
  int64_t bytes = BLOCK_BYTES[type];
  float total = 0.0f;
  for (int64_t b0 = 0; b0 < nb; b0 += per) {
    const uint8_t *p = w + b0 / per * bytes;
    float d = half_to_float(type == BLOCK_Q6_K ? p + 208 : p);
    for (int s = 0; s < per; s++) {
      int64_t b = b0 + s;
      const int8_t *q = r.q + b * QK;
      uint8_t n[QK];
      values_of(type, p, s, n);
      int32_t lo = 0, hi = 0, start = 0;
      for (int j = 0; j < QK / 2; j++) lo += n[j] * q[j], hi += n[j + QK / 2] * q[j + QK / 2];
      if (type == BLOCK_Q6_K) { /* its two int8 scales of 16 weights each */
        const int8_t *sc6 = (const int8_t *)(p + 192) + 2 * s;
        for (int l = 0; l < 4; l++) lo += 4 * r.c8[b * 8 + l], hi += 4 * r.c8[b * 8 + 4 + l];
        total += d * r.dx[b] * (float)(sc6[0] * lo + sc6[1] * hi);
      } else if (type == BLOCK_Q5_0) {
        for (int l = 0; l < 8; l++) start += 2 * r.c8[b * 8 + l];
        total += d * r.dx[b] * (float)(lo + hi + start);
      } else {
        int sc, m;
        scale_min_k(p + 4, s, &sc, &m);
        total += d * (float)sc * r.dx[b] * (float)(lo + hi) - half_to_float(p + 2) * (float)m * r.sx[b];
      }
    }
  }
  return total;
}

static void dot4_q_more(int type, const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  for (int k = 0; k < 4; k++) s[k] = dot_q_more(type, w[k], r, nb);
}
#endif

/* out [32 per sub-block] = the float32 values of one block of `type` (Q5_0 or a K-quant), in gguf-py's order of
 * float operations (d sc computed first, then times n, then minus dmin m), so equal to it bit for bit: d sc and
 * dmin m are exact in float32, and so is d sc n but in Q6_K (one rounding there, as gguf-py's) */
static void dequantize_more(int type, const uint8_t *p, float *out) {
  int per = type == BLOCK_Q5_0 ? 1 : 8;
  float d = half_to_float(type == BLOCK_Q6_K ? p + 208 : p);
  for (int s = 0; s < per; s++) {
    uint8_t n[QK];
    values_of(type, p, s, n);
    float *o = out + s * QK;
    if (type == BLOCK_Q5_0) {
      for (int j = 0; j < QK; j++) o[j] = d * (float)(n[j] - 16);
    } else if (type == BLOCK_Q6_K) {
      const int8_t *sc = (const int8_t *)(p + 192) + 2 * s;
      float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
      for (int j = 0; j < QK / 2; j++) o[j] = d0 * (float)(n[j] - 32);
      for (int j = QK / 2; j < QK; j++) o[j] = d1 * (float)(n[j] - 32);
    } else {
      int sc, m;
      scale_min_k(p + 4, s, &sc, &m);
      float ds = d * (float)sc, dm = half_to_float(p + 2) * (float)m;
      for (int j = 0; j < QK; j++) o[j] = ds * (float)n[j] - dm;
    }
  }
}

/* This thread's share of a block product of d_out rows of row_bytes each: groups of four rows [g0, g1), the same
 * contiguous split as OpenMP's static schedule, so that the thread also knows where its share of the next product
 * begins (below). */
typedef struct {
  int64_t g0, g1;
  const uint8_t *start; /* its first weight byte */
  int64_t bytes;        /* and how many follow */
} q_share;

static q_share share_of(const uint8_t *w, int64_t d_out, int64_t row_bytes, int64_t group) {
#ifdef _OPENMP
  int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
  int64_t t = 0, nt = 1;
#endif
  int64_t groups = (d_out + group - 1) / group, per = (groups + nt - 1) / nt;
  q_share s;
  s.g0 = t * per < groups ? t * per : groups;
  s.g1 = s.g0 + per < groups ? s.g0 + per : groups;
  int64_t first = s.g0 * group, end = s.g1 * group < d_out ? s.g1 * group : d_out;
  s.start = w + first * row_bytes;
  s.bytes = (end - first) * row_bytes;
  return s;
}

/* Sixteen rows interleaved: the decode layout of Q4_0, Q4_1, Q8_0 and Q5_0 (Q4_K's below; after llama.cpp's
 * repacked AMX/VNNI layout, ggml-cpu/amx/mmq.cpp, where one 512-bit lane holds one output row). The same blocks,
 * bit for bit, rearranged for the decode step's products: rows come in groups of 16 (d_out a multiple of 16); a
 * group's blocks follow each other, and block b of the group holds, in order,
 *   its quants in 64-byte chunks j (4 for Q4_0 / Q4_1, 8 for Q8_0), bytes 4n .. 4n + 3 of chunk j being row n's
 *     quant bytes 4j .. 4j + 3 (Q4: the low nibbles weights 4j .. 4j + 3, the high ones 16 + 4j ..; Q8_0: weights
 *     4j .. 4j + 3);
 *   the 16 rows' d (IEEE halves), then Q4_1's 16 m;
 * so 16 x (18 | 20 | 34) bytes, as many as the 16 rows' blocks. Q5_0 the same way (22 bytes: d, then the 32-bit qh
 * of the fifth bits, then 16 nibble bytes): its chunk 0 holds the 16 rows' qh (lane n: row n's), chunks 1-4 the
 * nibbles as Q4_0's, then the d's. A product then multiplies 16 rows at once by x's
 * four bytes broadcast to every lane (one dpbusd per 64 weights of 16 rows, no permute), and scales 16 rows with
 * one conversion of 16 halves and one FMA per block: the decode step 1.26-1.32x its speed on the file's layout
 * (benchmarks/README.md, "The idle run on the Intel Xeon"). */
#define REPACKED 0x100 /* a LINEAR_Q op's type | REPACKED: its weights are in the 16-row layout */
#define GROUP 16

/* Q4_K's super-blocks of 16 rows the same way, 16 x 144 = 2304 bytes per super-block of the group:
 *   its 128 quant bytes in 32 chunks of 64 bytes j, bytes 4n .. 4n + 3 of chunk j being row n's quant bytes
 *     4j .. 4j + 3 (chunks 8i .. 8i + 7: sub-block 2i in the low nibbles, 2i + 1 in the high ones);
 *   the 16 rows' d, then their 16 dmin (IEEE halves);
 *   the 12 bytes of scales and mins as three 64-byte vectors k, bytes 4n .. 4n + 3 of vector k being row n's
 *     bytes 4k .. 4k + 3: scales_mins_k's dwords a0, a1, a2, one row a lane, so that the masks and shifts that
 *     unpack one row's eight scales and mins there unpack sixteen rows' here (dot16_q_k). */
#define Q4_K_QUANTS (GROUP * 128)
#define Q4_K_SCALES (Q4_K_QUANTS + 2 * 2 * GROUP) /* after the quants, the d's and the dmin's */

/* out = w (d_out rows of d_in weights in blocks of `type`: Q8_0, Q4_0, Q4_1, Q5_0 or Q4_K; d_out a multiple
 * of 16) in the 16-row layouts above. */
void attnlab_repack16(const uint8_t *w, uint8_t *out, int64_t d_out, int64_t d_in, int type) {
  int64_t bytes = BLOCK_BYTES[type], nb = d_in / BLOCK_WEIGHTS[type], row_bytes = nb * bytes;
  int64_t head = type == BLOCK_Q4_1 ? 4 : 2, quant_bytes = bytes - head;
#pragma omp parallel for schedule(static) if (d_out * d_in > 65536)
  for (int64_t g = 0; g < d_out / GROUP; g++)
    for (int64_t b = 0; b < nb; b++) {
      uint8_t *o = out + (g * nb + b) * GROUP * bytes;
      for (int64_t n = 0; n < GROUP; n++) {
        const uint8_t *src = w + (g * GROUP + n) * row_bytes + b * bytes;
        if (type == BLOCK_Q4_K) {
          for (int64_t j = 0; j < 32; j++) memcpy(o + j * 64 + 4 * n, src + 16 + 4 * j, 4);
          memcpy(o + Q4_K_QUANTS + 2 * n, src, 2);                /* d */
          memcpy(o + Q4_K_QUANTS + 2 * GROUP + 2 * n, src + 2, 2); /* dmin */
          for (int64_t k = 0; k < 3; k++) memcpy(o + Q4_K_SCALES + 64 * k + 4 * n, src + 4 + 4 * k, 4);
          continue;
        }
        for (int64_t j = 0; j < quant_bytes / 4; j++) memcpy(o + j * 64 + 4 * n, src + head + 4 * j, 4);
        memcpy(o + GROUP * quant_bytes + 2 * n, src, 2);                        /* d */
        if (type == BLOCK_Q4_1) memcpy(o + GROUP * quant_bytes + 32 + 2 * n, src + 2, 2); /* m */
      }
    }
}

/* The lane sums' start: `offset` times the sum of a block's 32 rounded x (r.sq): Q4_0's -8, Q5_0's -16, Q8_0's
 * -128 (weights taken as q + 128), none for Q4_1. */
static inline int32_t dot16_offset(int type) {
  return type == BLOCK_Q4_0 ? -8 : type == BLOCK_Q5_0 ? -16 : type == BLOCK_Q8_0 ? -128 : 0;
}

/* dot16_q a lane at a time: the portable build's (for tests), and the AVX2 build's Q5_0 (which generation does
 * not repack there: attnlab_repack16_fast) */
static __attribute__((unused)) void dot16_lanes(int type, const uint8_t *g, q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[type], step = GROUP * bytes, quant = GROUP * (bytes - (type == BLOCK_Q4_1 ? 4 : 2));
  const int32_t offset = dot16_offset(type);
  const int q5 = type == BLOCK_Q5_0; /* chunk 0: the qh; the nibbles from chunk 1 */
  float acc[GROUP] = {0}, m_acc[GROUP] = {0};
  for (int64_t b = 0; b < nb; b++, g += step) {
    const int8_t *x = r.q + b * QK;
    for (int n = 0; n < GROUP; n++) {
      int32_t sum = offset * r.sq[b];
      uint32_t qh = 0;
      if (q5) memcpy(&qh, g + 4 * n, 4);
      for (int j = 0; j < (type == BLOCK_Q8_0 ? 8 : 4); j++)
        for (int i = 0; i < 4; i++) {
          uint8_t v = g[64 * (j + q5) + 4 * n + i];
          if (type == BLOCK_Q8_0)
            sum += (int32_t)(uint8_t)(v ^ 0x80) * x[4 * j + i];
          else
            sum += (int32_t)((v & 15) | ((qh >> (4 * j + i)) & 1) << 4) * x[4 * j + i] +
                   (int32_t)((v >> 4) | ((qh >> (16 + 4 * j + i)) & 1) << 4) * x[16 + 4 * j + i];
        }
      acc[n] += (float)sum * (half_to_float(g + quant + 2 * n) * r.dx[b]);
      if (type == BLOCK_Q4_1) m_acc[n] += half_to_float(g + quant + 32 + 2 * n) * r.sx[b];
    }
  }
  for (int n = 0; n < GROUP; n++) s[n] = acc[n] + m_acc[n];
}

/* s[n] = the product of row n of a 16-row group (its nb blocks at g) with the rounded row r of x, a block's lane
 * sums starting at dot16_offset(type) times r.sq. */
static inline __attribute__((always_inline)) void dot16_q(int type, const uint8_t *g, q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[type], step = GROUP * bytes, quant = GROUP * (bytes - (type == BLOCK_Q4_1 ? 4 : 2));
  const int32_t offset = dot16_offset(type);
#if AVX512 && defined(__AVX512VNNI__)
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
  __m512 acc = _mm512_setzero_ps(), m_acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, g += step) {
    const int32_t *xq = (const int32_t *)(r.q + b * QK); /* x's weights 4i .. 4i + 3 as one 32-bit value */
    __m512i sum = _mm512_set1_epi32(offset * r.sq[b]);
    if (type == BLOCK_Q8_0) { /* dpbusd multiplies unsigned by signed bytes: the weights go in as q + 128 */
      for (int j = 0; j < 8; j++)
        sum = _mm512_dpbusd_epi32(sum, _mm512_xor_si512(_mm512_loadu_si512((const void *)(g + 64 * j)), flip),
                                  _mm512_set1_epi32(xq[j]));
    } else if (type == BLOCK_Q5_0) {
      /* n + 16 x (fifth bit) in 0..31, the fifth bits of byte 4n + i of chunk j (row n's weights 4j + i and
       * 16 + 4j + i) being bits 4j + i and 16 + 4j + i of row n's qh: vpshufb copies the qh byte that holds them
       * (j / 2, and 2 + j / 2) to the lane's four bytes, a byte test against 1 << (4 (j % 2) + i) makes the mask
       * of the 16s to add */
      const __m512i qh = _mm512_loadu_si512((const void *)g), sixteen = _mm512_set1_epi8(16);
      /* vpshufb indexes within 128-bit lanes, four rows each: row m's qh bytes are 4m .. 4m + 3 there */
      const __m512i rows = _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
                                            0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
      __m512i high = _mm512_setzero_si512();
      for (int j = 0; j < 4; j++) {
        const __m512i bits = _mm512_set1_epi32((int)(0x08040201u << (4 * (j % 2))));
        const __m512i lo_bits = _mm512_shuffle_epi8(qh, _mm512_add_epi8(rows, _mm512_set1_epi8((char)(j / 2))));
        const __m512i hi_bits = _mm512_shuffle_epi8(qh, _mm512_add_epi8(rows, _mm512_set1_epi8((char)(2 + j / 2))));
        __m512i v = _mm512_loadu_si512((const void *)(g + 64 * (j + 1)));
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(lo_bits, bits), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(hi_bits, bits), hi, sixteen);
        sum = _mm512_dpbusd_epi32(sum, lo, _mm512_set1_epi32(xq[j]));
        high = _mm512_dpbusd_epi32(high, hi, _mm512_set1_epi32(xq[4 + j]));
      }
      sum = _mm512_add_epi32(sum, high);
    } else {
      /* the high nibbles as they are (16 times their value, at most 4 x 240 x 127 per dpbusd): their sums apart,
       * divided by 16 (exactly: a multiple of 16) once per block, a shift fewer per 64 bytes */
      __m512i high = _mm512_setzero_si512();
      for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_loadu_si512((const void *)(g + 64 * j));
        sum = _mm512_dpbusd_epi32(sum, _mm512_and_si512(v, low4), _mm512_set1_epi32(xq[j]));
        high = _mm512_dpbusd_epi32(high, _mm512_andnot_si512(low4, v), _mm512_set1_epi32(xq[4 + j]));
      }
      sum = _mm512_add_epi32(sum, _mm512_srai_epi32(high, 4));
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + quant)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(r.dx[b])), acc);
    if (type == BLOCK_Q4_1)
      m_acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + quant + 32))),
                              _mm512_set1_ps(r.sx[b]), m_acc);
  }
  _mm512_storeu_ps(s, _mm512_add_ps(acc, m_acc));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (type == BLOCK_Q5_0) {
    dot16_lanes(type, g, r, nb, s);
    return;
  }
  /* 256 bits: rows 0-7 in the low half of each 64-byte chunk, 8-15 in the high half; u8 x s8 pairs into 16 bits
   * (maddubs), then pairs of those into 32 (madd). Q4: a pair is at most 2 x 15 x 127, so the eight of a block's
   * chunks and nibble halves add in 16 bits (at most 30,480) before one madd. Q8_0: |w| times x with w's sign
   * (maddubs' first operand is unsigned): at most 2 x 128 x 127, one madd per chunk, no lane-sum start. */
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; h++) {
    const uint8_t *gh = g + 32 * h;
    __m256 acc = _mm256_setzero_ps(), m_acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, gh += step) {
      const int32_t *xq = (const int32_t *)(r.q + b * QK);
      __m256i sum;
      if (type == BLOCK_Q8_0) {
        sum = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
          __m256i w = _mm256_loadu_si256((const __m256i *)(gh + 64 * j)), x = _mm256_set1_epi32(xq[j]);
          sum = _mm256_add_epi32(
              sum, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones));
        }
      } else {
        __m256i pairs = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
          __m256i v = _mm256_loadu_si256((const __m256i *)(gh + 64 * j));
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_and_si256(v, low4), _mm256_set1_epi32(xq[j])));
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                                              _mm256_set1_epi32(xq[4 + j])));
        }
        sum = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(offset * r.sq[b]));
      }
      __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + b * step + quant + 16 * h)));
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(r.dx[b])), acc);
      if (type == BLOCK_Q4_1)
        m_acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + b * step + quant + 32 + 16 * h))),
                                _mm256_set1_ps(r.sx[b]), m_acc);
    }
    _mm256_storeu_ps(s + 8 * h, _mm256_add_ps(acc, m_acc));
  }
#else /* a lane at a time (the portable build: for tests; generation repacks only where attnlab_repack16_fast
         says so) */
  (void)bytes, (void)step, (void)quant, (void)offset;
  dot16_lanes(type, g, r, nb, s);
#endif
}

/* s[n] = the product of row n of a 16-row group of Q4_K rows (its nb / 8 super-blocks at g, the layout above)
 * with the rounded row r. Per sub-block pair i: eight dpbusd of the low nibbles against x's broadcast bytes of
 * sub-block 2i, eight of the high ones as they are (16 times their value, at most 8 x 4 x 240 x 127) against
 * 2i + 1's; per sub-block one conversion and one FMA by sc_n dx (dx / 16 for the high nibbles: exact, a power of
 * two, so the products are those of the shifted nibbles bit for bit) and one FMA of the mins m_n sx; d and dmin
 * once per super-block. dot4_q_k's sums in another order (d (sum sc dx S) rather than sum (d sc dx) S). */
static inline __attribute__((always_inline)) void dot16_q_k(const uint8_t *g, q8_row r, int64_t nb, float *s) {
  const int64_t step = GROUP * BLOCK_BYTES[BLOCK_Q4_K];
#if AVX512 && defined(__AVX512VNNI__)
  const __m512i low4 = _mm512_set1_epi8(0x0F), low6 = _mm512_set1_epi8(0x3F), bits45 = _mm512_set1_epi8(0x30);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  __m512 acc = _mm512_setzero_ps(), m_acc = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8, g += step) {
    const int32_t *xq = (const int32_t *)(r.q + b0 * QK); /* x's weights 4i .. 4i + 3 as one 32-bit value */
    /* scales_mins_k, one row a lane: scales 0-3 and 4-7, mins 0-3 and 4-7, a byte each */
    __m512i a0 = _mm512_loadu_si512((const void *)(g + Q4_K_SCALES)), a1 = _mm512_loadu_si512((const void *)(g + Q4_K_SCALES + 64));
    __m512i a2 = _mm512_loadu_si512((const void *)(g + Q4_K_SCALES + 128));
    __m512i sc[2] = {_mm512_and_si512(a0, low6), _mm512_or_si512(_mm512_and_si512(a2, low4),
                                                                 _mm512_and_si512(_mm512_srli_epi32(a0, 2), bits45))};
    __m512i mn[2] = {_mm512_and_si512(a1, low6), _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a2, 4), low4),
                                                                 _mm512_and_si512(_mm512_srli_epi32(a1, 2), bits45))};
    __m512 sb = _mm512_setzero_ps(), mb = _mm512_setzero_ps(); /* this super-block's sums before d and dmin */
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int j = 0; j < 8; j++) {
        __m512i v = _mm512_loadu_si512((const void *)(g + 64 * (8 * i + j)));
        lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, low4), _mm512_set1_epi32(xq[16 * i + j]));
        hi = _mm512_dpbusd_epi32(hi, _mm512_andnot_si512(low4, v), _mm512_set1_epi32(xq[16 * i + 8 + j]));
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; h++) {
        /* sub-block 2i + h: byte (2i + h) % 4 of sc[i / 2], mn[i / 2] (a byte of at most 63: the top one needs
         * no mask, the bottom one no shift; unrolled, so that the shifts are constants: a loop with variable
         * shifts and branches ran 1.06-1.11x the time in L2) */
        const int sub = 2 * i + h, shift = 8 * (sub % 4);
        __m512i sci = shift == 0 ? _mm512_and_si512(sc[i / 2], byte) : _mm512_srli_epi32(sc[i / 2], shift);
        __m512i mni = shift == 0 ? _mm512_and_si512(mn[i / 2], byte) : _mm512_srli_epi32(mn[i / 2], shift);
        if (shift == 8 || shift == 16) sci = _mm512_and_si512(sci, byte), mni = _mm512_and_si512(mni, byte);
        __m512 scale = _mm512_cvtepi32_ps(sci), min = _mm512_cvtepi32_ps(mni);
        sb = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h ? hi : lo),
                             _mm512_mul_ps(scale, _mm512_set1_ps(r.dx[b0 + sub] * (h ? 0.0625f : 1.0f))), sb);
        mb = _mm512_fmadd_ps(min, _mm512_set1_ps(r.sx[b0 + sub]), mb);
      }
    }
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + Q4_K_QUANTS))), sb, acc);
    m_acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + Q4_K_QUANTS + 32))), mb, m_acc);
  }
  _mm512_storeu_ps(s, _mm512_sub_ps(acc, m_acc));
#else /* the same sums, a lane at a time (every other build: for tests; generation repacks Q4_K only where
         attnlab_repack16_fast says so) */
  float acc[GROUP] = {0}, m_acc[GROUP] = {0};
  for (int64_t b0 = 0; b0 < nb; b0 += 8, g += step)
    for (int n = 0; n < GROUP; n++) {
      uint8_t scales[12]; /* row n's 12 bytes, back in the file's order */
      for (int k = 0; k < 3; k++) memcpy(scales + 4 * k, g + Q4_K_SCALES + 64 * k + 4 * n, 4);
      float sb = 0.0f, mb = 0.0f;
      for (int sub = 0; sub < 8; sub++) {
        const int8_t *x = r.q + (b0 + sub) * QK;
        int32_t sum = 0;
        for (int j = 0; j < QK; j++) /* weight j of sub-block sub: chunk 8 (sub / 2) + j / 4, byte j % 4 of lane n */
          sum += (int32_t)((g[64 * (8 * (sub / 2) + j / 4) + 4 * n + j % 4] >> (4 * (sub & 1))) & 15) * x[j];
        int sc, m;
        scale_min_k(scales, sub, &sc, &m);
        sb += (float)sum * ((float)sc * r.dx[b0 + sub]);
        mb += (float)m * r.sx[b0 + sub];
      }
      acc[n] += half_to_float(g + Q4_K_QUANTS + 2 * n) * sb;
      m_acc[n] += half_to_float(g + Q4_K_QUANTS + 2 * GROUP + 2 * n) * mb;
    }
  for (int n = 0; n < GROUP; n++) s[n] = acc[n] - m_acc[n];
#endif
}

/* Whether this build's 16-row products of `type` are its fast ones (AVX-512 VNNI; AVX2 but for Q5_0 and Q4_K,
 * whose AVX2 products keep the file's layout: dot4_q5_0, dot4_q_k): generation repacks only then. */
int attnlab_repack16_fast(int type) {
#if AVX512 && defined(__AVX512VNNI__)
  return type == BLOCK_Q8_0 || type == BLOCK_Q4_0 || type == BLOCK_Q4_1 || type == BLOCK_Q5_0 || type == BLOCK_Q4_K;
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  return type == BLOCK_Q8_0 || type == BLOCK_Q4_0 || type == BLOCK_Q4_1;
#else
  (void)type;
  return 0;
#endif
}

/* y[r, o] (=, or += when accumulate) sum_i x[r, i] w[o, i] + b[o] for w in blocks of `type`: each thread rounds
 * x to 8 bits into its own part of `scratch` (attnlab_linear_q_scratch bytes per thread; a few hundred
 * nanoseconds, cheaper than making the threads wait for one copy), then takes its share of four output features
 * at a time, streaming their rows once.
 *
 * Prefetched in software, PREFETCH_AHEAD bytes ahead of the rows being read: on this project's AMD EPYC host the
 * hardware prefetchers barely help (without these prefetches the products ran at a sixth of the speed,
 * benchmarks/README.md, issue 25). Near the end of its share a thread's prefetches run on into `next`, its share
 * of the product that the decode program runs after this one (next_bytes bytes; NULL: none), so that the next
 * product's first rows are on their way while this one ends, the barrier passes and the small ops between run;
 * a prefetch past the share's end would otherwise fetch rows another thread has already read. `prologue` asks
 * for the share's first PREFETCH_AHEAD bytes at once, for a product that no earlier one prefetched for.
 * `rounded`: the scratch of the product just before this one, which read the same x (q, k and v; the MLP's two
 * input products): each thread's rounding of x is already there, in its own part, and is read instead of made
 * again (NULL: round x here). `type | REPACKED`: the weights are in the 16-row layout (attnlab_repack16), a
 * thread's share whole groups of 16 rows, each multiplied at once (dot16_q, Q4_K's dot16_q_k). */
static void linear_q(const float *x, const uint8_t *w, const float *b, float *y, int8_t *scratch, int64_t rows,
                     int64_t d_in, int64_t d_out, int type, int accumulate, const uint8_t *next, int64_t next_bytes,
                     int prologue, int8_t *rounded) {
#ifdef _OPENMP
  int64_t t = omp_get_thread_num();
#else
  int64_t t = 0;
#endif
  int repacked = (type & REPACKED) != 0; /* the 16-row layout: whole groups of 16 rows, dot16_q */
  type &= ~REPACKED;
  int64_t group = repacked ? GROUP : ROWS_AT_ONCE;
  int64_t nb = d_in / QK, row_bytes = d_in / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type], per_row = q8_row_bytes(d_in);
  q_share mine_w = share_of(w, d_out, row_bytes, group); /* (16 rows' blocks take 16 rows' bytes: the same offsets) */
  if (prologue)
    for (int64_t off = 0; off < mine_w.bytes && off < PREFETCH_AHEAD; off += 64)
      __builtin_prefetch((const char *)mine_w.start + off, 0, 3);
  int8_t *mine = (rounded ? rounded : scratch) + t * rows * per_row;
  if (!rounded)
    for (int64_t r = 0; r < rows; r++) quantize_row_q8(x + r * d_in, d_in, q8_row_at(mine + r * per_row, d_in));
  for (int64_t g = mine_w.g0; g < mine_w.g1; g++) {
    int64_t o = g * group, n = d_out - o < group ? d_out - o : group;
    /* the file's layout: a last group of fewer than four rows repeats its first row in the missing ones and stores
     * only n sums */
    const uint8_t *w4[ROWS_AT_ONCE];
    if (!repacked)
      for (int k = 0; k < ROWS_AT_ONCE; k++) w4[k] = w + (o + (k < n ? k : 0)) * row_bytes;
    for (int64_t at = (g - mine_w.g0) * group * row_bytes + PREFETCH_AHEAD, end = at + group * row_bytes; at < end;
         at += 64) { /* at: bytes from the share's start */
      if (at < mine_w.bytes)
        __builtin_prefetch((const char *)mine_w.start + at, 0, 3);
      else if (next && at - mine_w.bytes < next_bytes)
        __builtin_prefetch((const char *)next + (at - mine_w.bytes), 0, 3);
    }
    for (int64_t r = 0; r < rows; r++) {
      float sums[GROUP];
      q8_row q = q8_row_at(mine + r * per_row, d_in);
      if (repacked)
        switch (type) { /* one loop per type, its constants folded */
        case BLOCK_Q8_0: dot16_q(BLOCK_Q8_0, w + o * row_bytes, q, nb, sums); break;
        case BLOCK_Q4_0: dot16_q(BLOCK_Q4_0, w + o * row_bytes, q, nb, sums); break;
        case BLOCK_Q5_0: dot16_q(BLOCK_Q5_0, w + o * row_bytes, q, nb, sums); break;
        case BLOCK_Q4_K: dot16_q_k(w + o * row_bytes, q, nb, sums); break;
        default: dot16_q(BLOCK_Q4_1, w + o * row_bytes, q, nb, sums); break;
        }
      else if (type >= BLOCK_Q5_0) /* Q5_0 and the K-quants */
        dot4_q_more(type, w4, q, nb, sums);
      else
        switch (type) {
        case BLOCK_Q8_0: dot4_q(BLOCK_Q8_0, w4, q, nb, sums); break;
        case BLOCK_Q4_0: dot4_q(BLOCK_Q4_0, w4, q, nb, sums); break;
        default: dot4_q(BLOCK_Q4_1, w4, q, nb, sums); break;
        }
      for (int64_t k = 0; k < n; k++) {
        float v = sums[k] + (b ? b[o + k] : 0.0f);
        y[r * d_out + o + k] = accumulate ? y[r * d_out + o + k] + v : v;
      }
    }
  }
}

/* The bytes of scratch attnlab_linear_q needs per thread for `rows` rows of d_in values. */
int64_t attnlab_linear_q_scratch(int64_t rows, int64_t d_in) { return rows * q8_row_bytes(d_in); }

void attnlab_linear_q(const float *x, const uint8_t *w, const float *b, float *y, int8_t *scratch, int64_t rows,
                      int64_t d_in, int64_t d_out, int type, int accumulate, int threads) {
#pragma omp parallel num_threads(threads) if (d_in * d_out > 65536)
  linear_q(x, w, b, y, scratch, rows, d_in, d_out, type, accumulate, NULL, 0, 1, NULL);
}

/* out [rows, d_in] = the float32 values of rows of blocks of `type` (attnlab.generate.blocks.dequantize's
 * formulas), for a prompt's products, which then run as a float32 GEMM. Equal to that reference bit for bit
 * whatever the compiler fuses: d n, d (n - 8) and d q are exact in float32 (an 11-bit by an 8-bit significand),
 * so only the one addition of Q4_1's m rounds. */
void attnlab_dequantize(const uint8_t *w, float *out, int64_t rows, int64_t d_in, int type, int threads) {
  int64_t nb = d_in / QK, bytes = BLOCK_BYTES[type];
  if (type >= BLOCK_Q5_0) {
    int64_t n = rows * d_in / BLOCK_WEIGHTS[type];
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d_in > 65536)
    for (int64_t i = 0; i < n; i++) dequantize_more(type, w + i * bytes, out + i * BLOCK_WEIGHTS[type]);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d_in > 65536)
  for (int64_t i = 0; i < rows * nb; i++) {
    const uint8_t *p = w + i * bytes;
    float *o = out + i * QK, d = half_to_float(p);
    if (type == BLOCK_Q8_0) {
      for (int j = 0; j < QK; j++) o[j] = d * (float)(int8_t)p[2 + j];
    } else if (type == BLOCK_Q4_0) {
      for (int j = 0; j < QK / 2; j++) {
        o[j] = d * (float)((p[2 + j] & 15) - 8);
        o[j + QK / 2] = d * (float)((p[2 + j] >> 4) - 8);
      }
    } else {
      float m = half_to_float(p + 2);
      for (int j = 0; j < QK / 2; j++) {
        o[j] = d * (float)(p[4 + j] & 15) + m;
        o[j + QK / 2] = d * (float)(p[4 + j] >> 4) + m;
      }
    }
  }
}

/* Prompts: the same products for many rows at once (a prompt's T tokens), as tiled matrix products.
 *
 * Torch's float32 GEMM is MKL's, which on this AMD EPYC runs its AVX2 code at a fraction of the AVX-512 FMA rate,
 * and a block model first dequantized every matrix into a float copy for it (benchmarks/README.md, issue 25).
 * Here the weights are read once per tile of TILE_N output features: the tile is laid out (and, for blocks,
 * unpacked) into a small buffer that stays in the core's cache while every row of x passes over it, a register
 * tile of rows at a time.
 *
 * Two products:
 * - attnlab_linear_q_rows, blocks times 8-bit activations (the decode step's arithmetic, attnlab_linear_q's
 *   numbers up to float32 summation order): each row of x is rounded once by quantize_row_q8 and stored as
 *   unsigned bytes q + 128; a tile holds each feature's block as signed bytes (Q8_0's q, Q4_0's n - 8, Q4_1's n)
 *   in the order AVX-512 VNNI's dpbusd reads them (four consecutive weights of 16 features per 64 bytes), with
 *   per block its scale d, Q4_1's offset m and -128 times its sum, which takes the +128 back out of the integer
 *   sum: sum (q + 128) w - 128 sum w = sum q w. Per block and row the integer sum then takes one multiply by
 *   d dx (and Q4_1's m dx sum q, as attnlab_linear_q does).
 * - attnlab_linear_f_rows, float32 weights (a float model's, or blocks dequantized a tile at a time) times float32
 *   x: the product a float model's prompt computes, with its own summation order.
 * The 8-bit product has three forms, fixed by the build: AVX-512 VNNI (x as unsigned bytes q + 128, weights signed,
 * the +128 taken out by the tile's corr), AVX2 (maddubs + madd: unsigned times signed bytes into 16 bits, where
 * q + 128 times a weight would saturate, so x stays signed and the weights are the unsigned ones: Q4_0/Q4_1's
 * nibbles n, Q4_0's -8 added back as -8 sum q per block of x; Q8_0's signed weights take the sign trick, |w| times
 * x with w's sign, as the decode step's), and a plain loop with AVX2's layout anywhere else (for the tests). The
 * float32 one is written with GCC's vector types, which compile to whatever vectors the target has; generation takes
 * it on AVX-512 builds only. */
#define TILE_N 32      /* output features per packed tile: two vectors of 16 */
#if AVX512
#define TILE_ROWS_F 12 /* rows per register tile, float32 products: 24 sums of 16 floats */
#else
#define TILE_ROWS_F 3 /* 12 sums of 8 floats */
#endif

#if AVX512 && defined(__AVX512VNNI__)
#define ROWS_VNNI 1
#define TILE_ROWS_Q 6 /* rows of x per register tile, 8-bit products: 12 integer and 12 float sums */
#else
#define ROWS_VNNI 0
#define TILE_ROWS_Q 4 /* AVX2: 4 rows x 16 features, 8 integer sums, the float sums in the core's cache */
#endif
#if defined(__AVX2__) && !ROWS_VNNI
#define ROWS_AVX2 1
#else
#define ROWS_AVX2 0
#endif

static int64_t this_thread(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

/* A row of x rounded for the prompt products (quantize_row_q8's numbers): q [d_in] bytes (q + 128 as unsigned bytes
 * for VNNI, q signed otherwise), dx [blocks], sx [blocks] (dx sum q) and qs [blocks] (sum q, int32). */
typedef struct {
  uint8_t *q;
  float *dx, *sx;
  int32_t *qs;
} x_row;

static int64_t x_row_bytes(int64_t d_in) { return align64(d_in) + 3 * align64(4 * (d_in / QK)); }

static x_row x_row_at(int8_t *base, int64_t d_in) {
  int64_t nb = d_in / QK;
  x_row r;
  r.q = (uint8_t *)base;
  r.dx = (float *)(base + align64(d_in));
  r.sx = (float *)(base + align64(d_in) + align64(4 * nb));
  r.qs = (int32_t *)(base + align64(d_in) + 2 * align64(4 * nb));
  return r;
}

/* One block of 32 values of x rounded as quantize_row_q8 rounds it (the same float operations, so the same q):
 * dx = max|x| / 127 (NaN for a block holding a NaN or an infinity), q = round-to-even(x / dx) via the reciprocal. */
static inline void round_block(const float *xb, uint8_t *q, float *dx, float *sx, int32_t *qs) {
#if AVX512
  __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  __m512 z0 = _mm512_mul_ps(v0, _mm512_setzero_ps()), z1 = _mm512_mul_ps(v1, _mm512_setzero_ps());
  int bad = _mm512_cmp_ps_mask(z0, z1, _CMP_UNORD_Q) != 0; /* NaN when a value is NaN or infinite */
  float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  if (bad) d = NAN, id = 0.0f;
  __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id))); /* the rounding mode: to even */
  __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  __m128i b0 = _mm512_cvtepi32_epi8(q0), b1 = _mm512_cvtepi32_epi8(q1); /* |q| <= 127 */
  if (ROWS_VNNI) b0 = _mm_xor_si128(b0, _mm_set1_epi8((char)0x80)), b1 = _mm_xor_si128(b1, _mm_set1_epi8((char)0x80));
  _mm_storeu_si128((__m128i *)q, b0);
  _mm_storeu_si128((__m128i *)(q + 16), b1);
#elif defined(__AVX2__)
  __m256 v[4], top = _mm256_setzero_ps(), probe = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; i++) {
    v[i] = _mm256_loadu_ps(xb + 8 * i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    probe = _mm256_add_ps(probe, _mm256_mul_ps(v[i], _mm256_setzero_ps()));
  }
  __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
  t4 = _mm_max_ss(t4, _mm_movehdup_ps(t4));
  float amax = _mm_cvtss_f32(t4);
  int bad = _mm256_movemask_ps(_mm256_cmp_ps(probe, probe, _CMP_UNORD_Q)) != 0;
  float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  if (bad) d = NAN, id = 0.0f;
  __m256i qi[4];
  for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  int32_t sum = _mm_cvtsi128_si32(s4);
  /* packs interleave the 128-bit lanes; one permute puts the 32 bytes back in order */
  __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
  float amax = 0.0f, probe = 0.0f;
  for (int j = 0; j < QK; j++) {
    float a = fabsf(xb[j]);
    amax = a > amax ? a : amax;
    probe += xb[j] * 0.0f;
  }
  float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  if (probe != 0.0f) d = NAN, id = 0.0f;
  int32_t sum = 0;
  for (int j = 0; j < QK; j++) {
    int32_t n = (int32_t)nearbyintf(xb[j] * id);
    q[j] = (uint8_t)(int8_t)n;
    sum += n;
  }
#endif
  *dx = d, *sx = d * (float)sum, *qs = sum;
}

/* One tile of TILE_N features, 8-bit: w [blocks][8 groups][TILE_N][4] (four consecutive weights of a feature per
 * dword, as dpbusd and maddubs + madd read them), then d, m [blocks][TILE_N] float and corr [blocks][TILE_N] int32
 * (VNNI: -128 sum w). */
typedef struct {
  int8_t *w;
  float *d, *m;
  int32_t *corr;
} q_tile;

static int64_t q_tile_bytes(int64_t nb) { return nb * TILE_N * (QK + 12); }

static q_tile q_tile_at(int8_t *base, int64_t nb) {
  q_tile t;
  t.w = base;
  t.d = (float *)(base + nb * TILE_N * QK);
  t.m = t.d + nb * TILE_N;
  t.corr = (int32_t *)(t.m + nb * TILE_N);
  return t;
}

/* Q4_1 and the K-quants Q4_K, Q5_K: a min term m per block of 32 (the tiles' m times the row's sum) */
static inline int rows_have_min(int type) {
  return type == BLOCK_Q4_1 || type == BLOCK_Q4_K || type == BLOCK_Q5_K;
}

/* block b (of 32 weights) of a row of `type` as 32 bytes in weight order, its d and m, the weights being
 * d v + m: Q8_0's q; Q4_0's n - 8, or n when `nibbles`, as the non-VNNI tiles hold them; Q4_1's n; Q5_0's
 * n - 16; Q4_K's and Q5_K's sub-block b % 8 of their block b / 8 as Q4_1 with d = d sc and m = -dmin m, in
 * dequantize_more's float operations (so d v + m is its value bit for bit) */
static inline void block_values(const uint8_t *row, int64_t b, int type, int nibbles, int8_t *v, float *d, float *m) {
  if (type >= BLOCK_Q5_0) {
    const uint8_t *p = row + b / (BLOCK_WEIGHTS[type] / QK) * BLOCK_BYTES[type];
    int s = (int)(b % (BLOCK_WEIGHTS[type] / QK)), offset = type == BLOCK_Q5_0 ? 16 : 0;
    uint8_t n[QK];
    values_of(type, p, s, n);
    for (int j = 0; j < QK; j++) v[j] = (int8_t)(n[j] - offset);
    *d = half_to_float(p), *m = 0.0f;
    if (type != BLOCK_Q5_0) {
      int sc, mn;
      scale_min_k(p + 4, s, &sc, &mn);
      *d = *d * (float)sc, *m = -(half_to_float(p + 2) * (float)mn);
    }
    return;
  }
  const uint8_t *p = row + b * BLOCK_BYTES[type];
  *d = half_to_float(p);
  *m = type == BLOCK_Q4_1 ? half_to_float(p + 2) : 0.0f;
  if (type == BLOCK_Q8_0) {
    memcpy(v, p + 2, QK);
    return;
  }
  const uint8_t *n = p + (type == BLOCK_Q4_1 ? 4 : 2);
  int offset = type == BLOCK_Q4_0 && !nibbles ? 8 : 0;
  for (int j = 0; j < QK / 2; j++) {
    v[j] = (int8_t)((n[j] & 15) - offset);
    v[j + QK / 2] = (int8_t)((n[j] >> 4) - offset);
  }
}

/* pack_q_tile one feature at a time: its block's 32 values, then each group of four stored as one dword at its
 * place (the VNNI build's gathers below take Q8_0, Q4_0 and Q4_1 only) */
static void pack_q_tile_plain(const uint8_t *w, int type, int64_t o0, int64_t n, int64_t nb, q_tile t) {
  int64_t row_bytes = nb * QK / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type];
  for (int64_t j = 0; j < TILE_N; j++)
    for (int64_t b = 0; b < nb; b++) {
      int8_t v[QK];
      float d = 0.0f, m = 0.0f;
      if (j < n)
        block_values(w + (o0 + j) * row_bytes, b, type, !ROWS_VNNI, v, &d, &m);
      else
        memset(v, 0, QK);
      int32_t sum = 0;
      for (int g = 0; g < QK / 4; g++) memcpy(t.w + ((b * (QK / 4) + g) * TILE_N + j) * 4, v + 4 * g, 4);
      for (int i = 0; i < QK; i++) sum += v[i];
      t.d[b * TILE_N + j] = d, t.m[b * TILE_N + j] = m, t.corr[b * TILE_N + j] = -128 * sum;
    }
}

/* features o0 .. o0 + n - 1 of w (rows of nb blocks of `type`) into tile t; features n .. TILE_N - 1 zero */
static void pack_q_tile(const uint8_t *w, int type, int64_t o0, int64_t n, int64_t nb, q_tile t) {
#if ROWS_VNNI
  if (type >= BLOCK_Q5_0) { /* Q5_0 and the K-quants: not vectorised yet */
    pack_q_tile_plain(w, type, o0, n, nb, t);
    return;
  }
  int64_t bytes = BLOCK_BYTES[type];
  /* sixteen features at a time: each group of four weights gathered from the sixteen rows (one dword each), the
   * nibbles split with a shift and a mask, the sums by dpbusd with ones; the plain loop below computed the same
   * bytes five times slower (benchmarks/README.md) */
  const __m512i ones = _mm512_set1_epi8(1), low = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  const int64_t data = type == BLOCK_Q4_1 ? 4 : 2;
  for (int64_t half = 0; half < TILE_N / 16; half++) {
    int64_t j0 = half * 16, valid = n - j0 < 0 ? 0 : (n - j0 < 16 ? n - j0 : 16);
    __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const uint8_t *base = w + (o0 + j0) * nb * bytes;
    __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                      _mm512_set1_epi32((int32_t)(nb * bytes)));
    for (int64_t b = 0; b < nb; b++) {
      __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32((int32_t)(b * bytes)));
      __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, at, base, 1);
      __m512i sum = _mm512_setzero_si512();
      __m512i *out = (__m512i *)(t.w + b * TILE_N * QK) + half;
      if (type == BLOCK_Q8_0) {
        for (int g = 0; g < QK / 4; g++) {
          __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask,
                                                  _mm512_add_epi32(at, _mm512_set1_epi32(data + 4 * g)), base, 1);
          _mm512_store_si512(out + 2 * g, v);
          sum = _mm512_dpbusd_epi32(sum, ones, v);
        }
      } else {
        for (int g = 0; g < QK / 8; g++) { /* bytes 4g .. 4g + 3: weights 4g.. (low nibbles), 16 + 4g.. (high) */
          __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask,
                                                  _mm512_add_epi32(at, _mm512_set1_epi32(data + 4 * g)), base, 1);
          __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
          if (type == BLOCK_Q4_0) lo = _mm512_sub_epi8(lo, eight), hi = _mm512_sub_epi8(hi, eight);
          lo = _mm512_maskz_mov_epi32(mask, lo), hi = _mm512_maskz_mov_epi32(mask, hi);
          _mm512_store_si512(out + 2 * g, lo);
          _mm512_store_si512(out + 2 * (g + QK / 8), hi);
          sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, ones, lo), ones, hi);
        }
      }
      _mm512_storeu_si512(t.corr + b * TILE_N + j0, _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
      _mm512_storeu_ps(t.d + b * TILE_N + j0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
      _mm512_storeu_ps(t.m + b * TILE_N + j0, type == BLOCK_Q4_1
                                                  ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                                                  : _mm512_setzero_ps());
    }
  }
  return;
#endif
  pack_q_tile_plain(w, type, o0, n, nb, t);
}

#if ROWS_AVX2
/* q_tile_rows on AVX2, one copy per block type (the type a constant: no branch in the loops). Per half of the tile
 * (16 features, two vectors) and block: 4 rows x 2 integer sums in registers, each group's weights loaded once and
 * used by the four rows, the float sums kept in `out` (in L1). The loop over groups is not unrolled: unrolled, the
 * compiler loaded a block's weights ahead into more registers than there are and spilled them. */
static inline __attribute__((always_inline)) void q_tile_rows_avx2(q_tile t, int64_t nb, const int type,
                                                                   const x_row *xr, float *out) {
  for (int i = 0; i < TILE_ROWS_Q * TILE_N; i++) out[i] = 0.0f;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; half++)
    for (int64_t b = 0; b < nb; b++) {
      const __m256i *wv = (const __m256i *)(t.w + b * TILE_N * QK) + 2 * half;
      const uint8_t *xq[TILE_ROWS_Q];
      for (int r = 0; r < TILE_ROWS_Q; r++) xq[r] = xr[r].q + b * QK;
      __m256i s[TILE_ROWS_Q][2];
      /* |w| times x with w's sign: pairs up to 2 x 128 x 127, into 32 bits each time; five-bit values too (a block
       * of them summed in 16 bits could reach 8 x 2 x 31 x 128) */
      if (type == BLOCK_Q8_0 || type == BLOCK_Q5_0 || type == BLOCK_Q5_K) {
        for (int r = 0; r < TILE_ROWS_Q; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int g = 0; g < QK / 4; g++) {
          __m256i w0 = _mm256_load_si256(wv + 4 * g), w1 = _mm256_load_si256(wv + 4 * g + 1);
          __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);
#pragma GCC unroll 4
          for (int r = 0; r < TILE_ROWS_Q; r++) {
            int32_t four;
            memcpy(&four, xq[r] + 4 * g, 4);
            __m256i xb = _mm256_set1_epi32(four);
            __m256i x0 = _mm256_sign_epi8(xb, w0), x1 = _mm256_sign_epi8(xb, w1);
            s[r][0] = _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, x0), ones));
            s[r][1] = _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, x1), ones));
          }
        }
      } else { /* nibbles: a pair is at most 2 x 15 x 127, the block's eight at most 30,480: 16-bit sums, widened
                  once per block */
        __m256i h[TILE_ROWS_Q][2];
        for (int r = 0; r < TILE_ROWS_Q; r++) h[r][0] = h[r][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
        for (int g = 0; g < QK / 4; g++) {
          __m256i w0 = _mm256_load_si256(wv + 4 * g), w1 = _mm256_load_si256(wv + 4 * g + 1);
#pragma GCC unroll 4
          for (int r = 0; r < TILE_ROWS_Q; r++) {
            int32_t four;
            memcpy(&four, xq[r] + 4 * g, 4);
            __m256i xb = _mm256_set1_epi32(four);
            h[r][0] = _mm256_add_epi16(h[r][0], _mm256_maddubs_epi16(w0, xb));
            h[r][1] = _mm256_add_epi16(h[r][1], _mm256_maddubs_epi16(w1, xb));
          }
        }
        for (int r = 0; r < TILE_ROWS_Q; r++) { /* Q4_0: -8 sum q, the nibbles' offset */
          __m256i start = _mm256_set1_epi32(type == BLOCK_Q4_0 ? -8 * xr[r].qs[b] : 0);
          s[r][0] = _mm256_add_epi32(start, _mm256_madd_epi16(h[r][0], ones));
          s[r][1] = _mm256_add_epi32(start, _mm256_madd_epi16(h[r][1], ones));
        }
      }
      const float *d = t.d + b * TILE_N + 16 * half, *m = t.m + b * TILE_N + 16 * half;
      __m256 d0 = _mm256_loadu_ps(d), d1 = _mm256_loadu_ps(d + 8);
      for (int r = 0; r < TILE_ROWS_Q; r++) {
        float *o = out + r * TILE_N + 16 * half;
        __m256 scale = _mm256_set1_ps(xr[r].dx[b]);
        __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(d0, scale), _mm256_loadu_ps(o));
        __m256 f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(d1, scale), _mm256_loadu_ps(o + 8));
        if (rows_have_min(type)) {
          __m256 sum = _mm256_set1_ps(xr[r].sx[b]);
          f0 = _mm256_fmadd_ps(_mm256_loadu_ps(m), sum, f0);
          f1 = _mm256_fmadd_ps(_mm256_loadu_ps(m + 8), sum, f1);
        }
        _mm256_storeu_ps(o, f0);
        _mm256_storeu_ps(o + 8, f1);
      }
    }
}
#endif

/* out[r][j] = sum over blocks of (d_j dx_r isum + m_j sx_r), isum the integer product of row r's block with
 * feature j's, for r < TILE_ROWS_Q, j < TILE_N */
static void q_tile_rows(q_tile t, int64_t nb, int type, const x_row *xr, float *out) {
#if ROWS_VNNI
  __m512 f[TILE_ROWS_Q][2];
#pragma GCC unroll 8
  for (int r = 0; r < TILE_ROWS_Q; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const __m512i *wv = (const __m512i *)(t.w + b * TILE_N * QK);
    __m512i c0 = _mm512_loadu_si512(t.corr + b * TILE_N), c1 = _mm512_loadu_si512(t.corr + b * TILE_N + 16);
    __m512i s[TILE_ROWS_Q][2];
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS_Q; r++) s[r][0] = c0, s[r][1] = c1;
#pragma GCC unroll 8
    for (int g = 0; g < QK / 4; g++) {
      __m512i w0 = _mm512_load_si512(wv + 2 * g), w1 = _mm512_load_si512(wv + 2 * g + 1);
#pragma GCC unroll 8
      for (int r = 0; r < TILE_ROWS_Q; r++) {
        int32_t four;
        memcpy(&four, xr[r].q + b * QK + 4 * g, 4);
        __m512i xb = _mm512_set1_epi32(four);
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], xb, w0);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], xb, w1);
      }
    }
    __m512 d0 = _mm512_loadu_ps(t.d + b * TILE_N), d1 = _mm512_loadu_ps(t.d + b * TILE_N + 16);
#pragma GCC unroll 8
    for (int r = 0; r < TILE_ROWS_Q; r++) {
      __m512 scale = _mm512_set1_ps(xr[r].dx[b]);
      f[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(d0, scale), f[r][0]);
      f[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(d1, scale), f[r][1]);
    }
    if (rows_have_min(type)) {
      __m512 m0 = _mm512_loadu_ps(t.m + b * TILE_N), m1 = _mm512_loadu_ps(t.m + b * TILE_N + 16);
#pragma GCC unroll 8
      for (int r = 0; r < TILE_ROWS_Q; r++) {
        __m512 sum = _mm512_set1_ps(xr[r].sx[b]);
        f[r][0] = _mm512_fmadd_ps(m0, sum, f[r][0]);
        f[r][1] = _mm512_fmadd_ps(m1, sum, f[r][1]);
      }
    }
  }
  for (int r = 0; r < TILE_ROWS_Q; r++) {
    _mm512_storeu_ps(out + r * TILE_N, f[r][0]);
    _mm512_storeu_ps(out + r * TILE_N + 16, f[r][1]);
  }
#elif ROWS_AVX2
  if (type == BLOCK_Q8_0)
    q_tile_rows_avx2(t, nb, BLOCK_Q8_0, xr, out);
  else if (type == BLOCK_Q4_0)
    q_tile_rows_avx2(t, nb, BLOCK_Q4_0, xr, out);
  else if (type == BLOCK_Q4_1)
    q_tile_rows_avx2(t, nb, BLOCK_Q4_1, xr, out);
  else if (type == BLOCK_Q5_0)
    q_tile_rows_avx2(t, nb, BLOCK_Q5_0, xr, out);
  else if (type == BLOCK_Q4_K)
    q_tile_rows_avx2(t, nb, BLOCK_Q4_K, xr, out);
  else
    q_tile_rows_avx2(t, nb, BLOCK_Q5_K, xr, out);
#else
  for (int r = 0; r < TILE_ROWS_Q; r++)
    for (int j = 0; j < TILE_N; j++) {
      float total = 0.0f;
      for (int64_t b = 0; b < nb; b++) {
        int32_t isum = type == BLOCK_Q4_0 ? -8 * xr[r].qs[b] : 0;
        for (int g = 0; g < QK / 4; g++)
          for (int i = 0; i < 4; i++)
            isum += (int8_t)xr[r].q[b * QK + 4 * g + i] * t.w[((b * (QK / 4) + g) * TILE_N + j) * 4 + i];
        total += (float)isum * (t.d[b * TILE_N + j] * xr[r].dx[b]);
        if (rows_have_min(type)) total += t.m[b * TILE_N + j] * xr[r].sx[b];
      }
      out[r * TILE_N + j] = total;
    }
#endif
}

/* y[r, o] = (tile's out) + b[o] for the n features of the tile at o0 and the rows r0 .. r0 + m - 1 */
static void store_tile(const float *out, const float *b, float *y, int64_t r0, int64_t m, int64_t o0, int64_t n,
                       int64_t d_out) {
  for (int64_t r = 0; r < m; r++)
    for (int64_t j = 0; j < n; j++) y[(r0 + r) * d_out + o0 + j] = out[r * TILE_N + j] + (b ? b[o0 + j] : 0.0f);
}

/* The scratch bytes attnlab_linear_q_rows(_many) and attnlab_linear_f_rows need: the rounded rows, and one tile per
 * thread. */
int64_t attnlab_linear_rows_scratch(int64_t rows, int64_t d_in, int threads) {
  int64_t rounded = align64(rows * x_row_bytes(d_in)), q = q_tile_bytes(d_in / QK);
  int64_t f = d_in * TILE_N * (int64_t)sizeof(float);
  return rounded + threads * align64(q > f ? q : f);
}

/* Which of the two products run vectorised in this build: bit 0 attnlab_linear_q_rows (AVX-512 VNNI or AVX2;
 * otherwise a plain loop), bit 1 attnlab_linear_f_rows on AVX-512 registers (otherwise whatever vectors the target
 * has, where callers keep torch's GEMM). */
int attnlab_linear_rows_vectorized(void) { return (ROWS_VNNI || ROWS_AVX2) | (AVX512 << 1); }

/* y_i [rows, d_out[i]] = x [rows, d_in] W_i^T + b_i for the n matrices W_i (blocks of type[i]; b_i may be NULL), x
 * rounded to 8 bits per block once for all of them (as attnlab_linear_q rounds it): a layer's q, k and v, or its
 * gate and up, share x. One parallel region; the threads share the tiles of every matrix. scratch:
 * attnlab_linear_rows_scratch bytes, 64-byte aligned. */
void attnlab_linear_q_rows_many(const float *x, int64_t n, const uint8_t *const *w, const float *const *b,
                                float *const *y, const int64_t *d_out, const int32_t *type, int8_t *scratch,
                                int64_t rows, int64_t d_in, int threads) {
  int64_t nb = d_in / QK, per_row = x_row_bytes(d_in), tiles = 0;
  int64_t tile_bytes = align64(attnlab_linear_rows_scratch(0, d_in, 1));
  for (int64_t i = 0; i < n; i++) tiles += (d_out[i] + TILE_N - 1) / TILE_N;
#pragma omp parallel num_threads(threads)
  {
    int64_t thread = this_thread();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      x_row xr = x_row_at(scratch + r * per_row, d_in);
      for (int64_t k = 0; k < nb; k++) round_block(x + r * d_in + k * QK, xr.q + k * QK, xr.dx + k, xr.sx + k, xr.qs + k);
    }
    q_tile t = q_tile_at(scratch + align64(rows * per_row) + thread * tile_bytes, nb);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
      int64_t k = 0, o0 = i * TILE_N; /* matrix k, its tile at feature o0 */
      while (o0 >= (d_out[k] + TILE_N - 1) / TILE_N * TILE_N) o0 -= (d_out[k] + TILE_N - 1) / TILE_N * TILE_N, k++;
      int64_t features = d_out[k] - o0 < TILE_N ? d_out[k] - o0 : TILE_N;
      pack_q_tile(w[k], type[k], o0, features, nb, t);
      for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS_Q) {
        int64_t m = rows - r0 < TILE_ROWS_Q ? rows - r0 : TILE_ROWS_Q;
        x_row xr[TILE_ROWS_Q];
        for (int64_t r = 0; r < TILE_ROWS_Q; r++) /* rows past the last repeat row r0; their sums are dropped */
          xr[r] = x_row_at(scratch + (r0 + (r < m ? r : 0)) * per_row, d_in);
        float out[TILE_ROWS_Q * TILE_N];
        q_tile_rows(t, nb, type[k], xr, out);
        store_tile(out, b[k], y[k], r0, m, o0, features, d_out[k]);
      }
    }
  }
}

/* y [rows, d_out] = x [rows, d_in] W^T + b (b may be NULL), W in blocks of `type`: attnlab_linear_q_rows_many for
 * one matrix. */
void attnlab_linear_q_rows(const float *x, const uint8_t *w, const float *b, float *y, int8_t *scratch, int64_t rows,
                           int64_t d_in, int64_t d_out, int type, int threads) {
  int32_t kind = type;
  attnlab_linear_q_rows_many(x, 1, &w, &b, &y, &d_out, &kind, scratch, rows, d_in, threads);
}

/* The float32 tile product's vectors: sixteen floats on AVX-512 (2 per row of the tile, 24 sums for 12 rows), eight
 * elsewhere (4 per row; AVX2's sixteen registers hold 3 rows' 12 sums: sixteen-float vectors there spilled every
 * sum, 3 GFLOP/s). GCC's vector types compile to whatever vectors the target has. */
#if AVX512
#define F_LANES 16
#else
#define F_LANES 8
#endif
typedef float fvec __attribute__((vector_size(4 * F_LANES), aligned(4)));
#define F_VECS (TILE_N / F_LANES)

/* out[r][j] = sum_k x[r][k] tile[k][j] for r < TILE_ROWS_F, j < TILE_N: tile [d_in][TILE_N], its rows `ld` floats
 * apart */
static void f_tile_rows(const float *tile, int64_t ld, int64_t d_in, const float *const *x, float *out) {
  fvec a[TILE_ROWS_F][F_VECS];
  memset(a, 0, sizeof(a));
  for (int64_t k = 0; k < d_in; k++) {
#if F_LANES == 16
    fvec w0, w1;
    memcpy(&w0, tile + k * ld, sizeof(w0));
    memcpy(&w1, tile + k * ld + 16, sizeof(w1));
#pragma GCC unroll 16
    for (int r = 0; r < TILE_ROWS_F; r++) {
      fvec xb = x[r][k] - (fvec){0}; /* x broadcast (minus zero, an identity the compiler drops; plus zero is not) */
      a[r][0] += xb * w0;
      a[r][1] += xb * w1;
    }
#else
    /* loads through the (4-byte aligned) vector type: memcpy here went through the stack in 16-byte halves, which
     * the 32-byte reads then waited on */
    const fvec *wk = (const fvec *)(tile + k * ld);
    fvec w0 = wk[0], w1 = wk[1], w2 = wk[2], w3 = wk[3];
#pragma GCC unroll 16
    for (int r = 0; r < TILE_ROWS_F; r++) {
      fvec xb = x[r][k] - (fvec){0};
      a[r][0] += xb * w0;
      a[r][1] += xb * w1;
      a[r][2] += xb * w2;
      a[r][3] += xb * w3;
    }
#endif
  }
  memcpy(out, a, sizeof(a));
}

/* y [rows, d_out] = x [rows, d_in] W^T + b in float32: W float32 [d_out, d_in] (type < 0) or rows of blocks of
 * `type`, dequantized a tile at a time (attnlab_dequantize's values); scratch as attnlab_linear_q_rows's. */
void attnlab_linear_f_rows(const float *x, const void *w, const float *b, float *y, int8_t *scratch, int64_t rows,
                           int64_t d_in, int64_t d_out, int type, int threads) {
  int64_t tiles = (d_out + TILE_N - 1) / TILE_N, tile_bytes = align64(attnlab_linear_rows_scratch(0, d_in, 1));
#pragma omp parallel num_threads(threads)
  {
    int64_t thread = this_thread();
    float *tile = (float *)(scratch + thread * tile_bytes);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
      int64_t o0 = i * TILE_N, n = d_out - o0 < TILE_N ? d_out - o0 : TILE_N;
      for (int64_t j = 0; j < TILE_N; j++) { /* tile[k][j] = W[o0 + j, k], zeros past the last feature */
        float v[256];
        for (int64_t k0 = 0; k0 < d_in; k0 += 256) {
          int64_t len = d_in - k0 < 256 ? d_in - k0 : 256;
          if (j >= n)
            memset(v, 0, sizeof(v));
          else if (type < 0)
            memcpy(v, (const float *)w + (o0 + j) * d_in + k0, len * sizeof(float));
          else
            for (int64_t c = 0; c < len; c += QK) {
              int8_t q[QK];
              float d, m;
              block_values((const uint8_t *)w + (o0 + j) * (d_in / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type]),
                           (k0 + c) / QK, type, 0, q, &d, &m);
              for (int e = 0; e < QK; e++) v[c + e] = d * (float)q[e] + m;
            }
          for (int64_t k = 0; k < len; k++) tile[(k0 + k) * TILE_N + j] = v[k];
        }
      }
      for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS_F) {
        int64_t m = rows - r0 < TILE_ROWS_F ? rows - r0 : TILE_ROWS_F;
        const float *xr[TILE_ROWS_F];
        for (int64_t r = 0; r < TILE_ROWS_F; r++) xr[r] = x + (r0 + (r < m ? r : 0)) * d_in;
        float out[TILE_ROWS_F * TILE_N];
        f_tile_rows(tile, TILE_N, d_in, xr, out);
        store_tile(out, b, y, r0, m, o0, n, d_out);
      }
    }
  }
}


/* Float32 products on AMX tiles (Sapphire Rapids and later), as accurate as a float32 GEMM.
 *
 * AMX multiplies bfloat16 (8 significant bits) into float32 sums, 16 times the multiply-adds a cycle of AVX-512's
 * float32 FMAs. A float32 v splits exactly into three bfloat16 parts, v = v1 + v2 + v3 (v1 = v rounded to bfloat16,
 * v2 = what is left rounded again, v3 = the rest, which fits: 24 bits = 3 x 8), and each product of two parts is
 * exact in float32. So x w = sum over i, j of x_i w_j, and the six terms with i + j <= 4 carry everything down to
 * 2^-24 of |x w| (the three left out are at most 2^-25 of it, below float32's own rounding of the product): six
 * `tdpbf16ps` products per tile, summed in float32, give a float32 GEMM's accuracy (the "bf16x6" of Henry, Tang
 * and Heinecke, "Leveraging the bfloat16 Artificial Intelligence Datatype For Higher-Precision Computations",
 * ARITH 2019). Measured on SmolLM2's shapes, 1,024 rows, two threads (benchmarks/README.md, "Float32 products on
 * AMX tiles"): 1.25-1.6x MKL's float32 GEMM (k or v alone 0.84x: a layer's q, k and v take one call), the largest
 * error against float64 0.8-1.6x MKL's.
 *
 * Layout: x split once per call into A [row tile of 16][32-wide chunk of k][part][16 rows][32 k] (one 1 KB tile
 * each); the weights split a panel of output features at a time (sized to stay in the core's L2) into B [part][tile
 * of 16 features][chunk][16 k pairs][16 features][2] (the pairs layout `tdpbf16ps` reads). Each thread computes
 * 32 x 32 blocks of y: four accumulator tiles, two of x's parts and two of W's loaded at a time (8 tiles, all of
 * them), so that each accumulator takes all six products: 16 tile loads (from L2) per 24 products. What bounds it:
 * with separate accumulators for the small products (1 x 2 blocks of y, 9 loads per 12 products, two to three
 * times closer to float64), the loads alone took 72 % of its time and the products alone 68 %; the 2 x 2 blocks
 * ran 1.2-1.4x faster, their error that of MKL's float32 GEMM.
 *
 * AMX needs the operating system's permission per process (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, Linux
 * 5.16+), besides CPUID's flags and XCR0's tile bits: attnlab_amx_permitted asks for it; attnlab.generate.kernels
 * runs it first in a child process (a fault there costs nothing) and calls attnlab_linear_amx only where it said
 * yes. The tile configuration is loaded with our own `ldtilecfg` statement: GCC 12's _tile_loadconfig declares 8
 * of its 64 bytes as read, so -O3 drops the stores of the rows and widths before it (llama.cpp's fault at
 * ldtilecfg in these virtual machines; ggml-org/llama.cpp#9473). */
#if AVX512 && defined(__x86_64__) && defined(__linux__) && (__GNUC__ >= 11 || __clang_major__ >= 12)
#define AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#else
#define AMX 0
#endif

#define AMX_K 32 /* k per tile row: 32 bfloat16 */
static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* 1 when this process may run AMX's bfloat16 tiles: the build has them, CPUID lists AMX-TILE, AMX-BF16 and
 * AVX512-BF16, the OS enables the tile state in XCR0 and grants this process XTILEDATA; else 0. */
int attnlab_amx_permitted(void) {
#if AMX
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 22) & 1)) return 0;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return 0; /* XTILECFG and XTILEDATA state */
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 0;
  uint64_t granted = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted)) return 0;
  return (granted >> XFEATURE_XTILEDATA) & 1;
#else
  return 0;
#endif
}

/* Output features per panel of packed weights: the fewest panels, a multiple of the threads, whose three parts
 * fit in 1.25 MB (the core's L2 is 2 MB on Sapphire Rapids), 32 at least. */
static int64_t amx_panel(int64_t d_in, int64_t d_out, int threads) {
  int64_t most = (5 << 18) / (round_up(d_in, AMX_K) * 6) / 32 * 32;
  for (int64_t panels = threads;; panels += threads) {
    int64_t p = round_up((d_out + panels - 1) / panels, 32);
    if (p <= most || p == 32) return p;
  }
}

/* The scratch bytes attnlab_linear_amx needs for rows of d_in values and a matrix of d_out features: x's parts, and
 * one panel of W's and a block of y per thread (attnlab_linear_amx_many: the most over its matrices, as a panel's
 * width does not grow with d_out). */
int64_t attnlab_linear_amx_scratch(int64_t rows, int64_t d_in, int64_t d_out, int threads) {
  int64_t kp = round_up(d_in, AMX_K), panel = amx_panel(d_in, d_out, threads);
  return round_up(rows, 32) * kp * 6 + threads * (panel * kp * 6 + 32 * 32 * 4) + 64;
}

/* attnlab_linear_amx_swiglu's panels (both matrices' parts in the 1.25 MB) and scratch bytes: x's parts, and two
 * panels and a block of up per thread. */
static int64_t amx_swiglu_panel(int64_t d_in, int64_t d_out, int threads) {
  return amx_panel(2 * round_up(d_in, AMX_K), d_out, threads);
}

int64_t attnlab_linear_amx_swiglu_scratch(int64_t rows, int64_t d_in, int64_t d_out, int threads) {
  int64_t kp = round_up(d_in, AMX_K), panel = amx_swiglu_panel(d_in, d_out, threads);
  return round_up(rows, 32) * kp * 6 + threads * (2 * panel * kp * 6 + 32 * 32 * 4) + 64;
}

/* A head's scores and pattern of at most this many floats each (2 MB) are made in the thread's scratch and stored
 * past the caches (amx_attend_heads); a longer head's go straight into scores and pattern, as a head's of 8,192
 * tokens would need 512 MB more scratch a thread. */
#define AMX_KEPT_MOST (1 << 19)

/* The scratch bytes attnlab_attend_scores_amx, attnlab_attend_mix_amx and attnlab_attend_explicit_amx need: per
 * thread, one head's queries (or pattern rows) and keys (or values) split into their parts, a block of the result,
 * and one head's scores and pattern (the explicit path's, kept in the core's cache, up to AMX_KEPT_MOST). */
static void amx_head_sizes(int64_t T, int64_t S, int64_t d_head, int64_t *a, int64_t *w) { /* values per part */
  const int64_t k = round_up(S, AMX_K) > round_up(d_head, AMX_K) ? round_up(S, AMX_K) : round_up(d_head, AMX_K);
  *a = round_up(T, 32) * k;                                                                     /* A: T rows of k */
  *w = round_up(S, 32) * round_up(d_head, AMX_K) + round_up(d_head, 32) * round_up(S, AMX_K); /* B: K or V */
}

int64_t attnlab_attend_amx_scratch(int64_t T, int64_t S, int64_t d_head, int threads) {
  int64_t a, w;
  amx_head_sizes(T, S, d_head, &a, &w);
  int64_t kept = T * S <= AMX_KEPT_MOST ? round_up(2 * T * S, 16) * 4 : 0;
  return threads * ((a + w) * 6 + 32 * 32 * 4 + kept + 128) + 64;
}

#if AMX
/* 32 floats -> their three bfloat16 parts, 32 each (v = p0 + p1 + p2 exactly: each part v's leading 16 bits,
 * truncated, then what is left of v, whose 24 significant bits the three parts' 8 each hold; an infinite or NaN v
 * gives NaN parts after its first, so a product with it is NaN, where float32's may be infinite). Truncated rather
 * than rounded to nearest (one and, one permute of 16-bit halves, where the rounding took a conversion and two
 * widenings): run_with_cache 1.3-2.4 % faster, the products as accurate (benchmarks/README.md, "run_with_cache
 * past the caches"). */
AMX_TARGET static inline void split_bf16(const float *v, __m512i p[3]) {
  __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                       23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
  for (int part = 0; part < 3; part++) {
    __m512i ta = _mm512_and_si512(_mm512_castps_si512(a), top), tb = _mm512_and_si512(_mm512_castps_si512(b), top);
    p[part] = _mm512_permutex2var_epi16(ta, odd, tb);
    a = _mm512_sub_ps(a, _mm512_castsi512_ps(ta));
    b = _mm512_sub_ps(b, _mm512_castsi512_ps(tb));
  }
}

/* 32 values of a row from src (len of them, zeros after; NULL: all zeros) into buf, for split_bf16 */
static inline const float *row_chunk(const float *src, int64_t len, float *buf) {
  if (src && len == AMX_K) return src;
  memset(buf, 0, AMX_K * sizeof(float));
  if (src) memcpy(buf, src, len * sizeof(float));
  return buf;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} tile_config;

AMX_TARGET static void configure_tiles(void) { /* eight tiles of 16 rows x 64 bytes */
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.bytes_per_row[t] = 64, cfg.rows[t] = 16;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

#define AMX_TILE 512 /* bfloat16s in a tile: 16 rows of 32 */

/* Rows r0 .. r0 + n - 1 of x's parts (x [rows, d_in], row stride `stride`) into A [row tile][chunk][part][16][32],
 * zeros past the last row and the last k; only the first `used` chunks of k (amx_block's). */
AMX_TARGET static void amx_split_first(const float *x, int64_t stride, int64_t rows, int64_t d_in, int64_t r0,
                                       int64_t n, int64_t used, uint16_t *A) {
  const int64_t chunks = round_up(d_in, AMX_K) / AMX_K, row_tile = chunks * 3 * AMX_TILE;
  for (int64_t r = r0; r < r0 + n; r++)
    for (int64_t c = 0; c < used; c++) {
      float buf[AMX_K];
      int64_t len = d_in - c * AMX_K < AMX_K ? d_in - c * AMX_K : AMX_K;
      __m512i p[3];
      split_bf16(row_chunk(r < rows ? x + r * stride + c * AMX_K : NULL, len, buf), p);
      for (int part = 0; part < 3; part++)
        _mm512_store_si512(A + (r / 16) * row_tile + (c * 3 + part) * AMX_TILE + (r % 16) * 32, p[part]);
    }
}

/* amx_split_first for every chunk of k */
AMX_TARGET static void amx_split_rows(const float *x, int64_t stride, int64_t rows, int64_t d_in, int64_t r0,
                                      int64_t n, uint16_t *A) {
  amx_split_first(x, stride, rows, d_in, r0, n, round_up(d_in, AMX_K) / AMX_K, A);
}

/* r[i] lane j <- r[j] lane i for 16 x 16 32-bit lanes, in registers: pairs of lanes, pairs of pairs, then 128-bit
 * quarters (the gathers this replaced took 1.5 cycles a weight in amx_pack) */
AMX_TARGET static inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; i++) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

/* W's parts for its features o0 .. o0 + features - 1 into B [part][feature tile][chunk][16 k pairs][16][2] (the
 * pairs layout), features padded to 32 with zeros; W [d_out, d_in] by rows of k (row stride `stride`: a
 * Linear's weight, keys) or, `by_k`, [d_in, d_out] by rows of features (V). Returns the stride between parts;
 * *third: whether any of these weights has a third part (none does where every weight has at most 16
 * significant bits, as the float32 values of a GGUF file's 4-bit blocks: amx_block then leaves out x1 w3, a
 * product of zeros, which changes no sum). */
AMX_TARGET static int64_t amx_pack(const float *w, int64_t stride, int by_k, int64_t d_in, int64_t o0,
                                   int64_t features, uint16_t *B, int *third) {
  const int64_t chunks = round_up(d_in, AMX_K) / AMX_K, feature_tiles = round_up(features, 32) / 16;
  const int64_t part_stride = feature_tiles * chunks * AMX_TILE;
  __m512i any = _mm512_setzero_si512(); /* the third parts' bits, or-ed */
  for (int64_t ft = 0; ft < feature_tiles; ft++)
    for (int64_t c = 0; c < chunks; c++) {
      int64_t len = d_in - c * AMX_K < AMX_K ? d_in - c * AMX_K : AMX_K;
      if (by_k) { /* two rows of k at a time: their 16 features' parts, interleaved into pairs */
        const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                               6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int64_t pair = 0; pair < 16; pair++) {
          float buf[AMX_K] = {0};
          for (int e = 0; e < 2; e++) {
            int64_t k = c * AMX_K + 2 * pair + e, n = features - ft * 16 < 16 ? features - ft * 16 : 16;
            if (k < d_in && n > 0) memcpy(buf + 16 * e, w + k * stride + o0 + ft * 16, n * sizeof(float));
          }
          __m512i p[3];
          split_bf16(buf, p);
          any = _mm512_or_si512(any, p[2]);
          for (int part = 0; part < 3; part++)
            _mm512_store_si512(B + part * part_stride + (ft * chunks + c) * AMX_TILE + pair * 32,
                               _mm512_permutexvar_epi16(pairs, p[part]));
        }
        continue;
      }
      __m512i parts[3][16]; /* [part][feature]: the feature's 16 pairs of k, each pair one 32-bit lane */
      for (int64_t j = 0; j < 16; j++) {
        float buf[AMX_K];
        int64_t o = ft * 16 + j;
        __m512i p[3];
        split_bf16(row_chunk(o < features ? w + (o0 + o) * stride + c * AMX_K : NULL, len, buf), p);
        for (int part = 0; part < 3; part++) parts[part][j] = p[part];
        any = _mm512_or_si512(any, p[2]);
        if (o + 16 < features) { /* the next 16 features' chunk: 16 rows read across are 16 streams */
          _mm_prefetch((const char *)(w + (o0 + o + 16) * stride + c * AMX_K), _MM_HINT_T0);
          _mm_prefetch((const char *)(w + (o0 + o + 16) * stride + c * AMX_K) + 64, _MM_HINT_T0);
        }
      }
      for (int part = 0; part < 3; part++) { /* tile row: the pair of each feature's k */
        uint16_t *dst = B + part * part_stride + (ft * chunks + c) * AMX_TILE;
        transpose_16x16(parts[part]);
        for (int pair = 0; pair < 16; pair++) _mm512_store_si512(dst + pair * 32, parts[part][pair]);
      }
    }
  /* a part that is a signed zero (0x8000) is no weight either */
  *third = _mm512_test_epi16_mask(any, _mm512_set1_epi16(0x7fff)) != 0;
  return part_stride;
}

/* out [32][ld] = the 32 x 32 block of x W^T at row tile rt and feature tile ft (both even) of A and B (above), rows
 * ld floats apart, from the first `used` of the chunks of k (the rest known to be zeros in x: a causal pattern's);
 * without x1 w3 where W has no third part (amx_pack's *third) */
AMX_TARGET static void amx_block(const uint16_t *A, const uint16_t *B, int64_t part_stride, int64_t chunks,
                                 int64_t used, int third, int64_t rt, int64_t ft, float *out, int64_t ld) {
  const int64_t row_tile = chunks * 3 * AMX_TILE, next_features = chunks * AMX_TILE;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t c = 0; c < used; c++) {
    const uint16_t *x1 = A + rt * row_tile + c * 3 * AMX_TILE, *x2 = x1 + AMX_TILE, *x3 = x2 + AMX_TILE;
    const uint16_t *w1 = B + (ft * chunks + c) * AMX_TILE, *w2 = w1 + part_stride, *w3 = w2 + part_stride;
    /* tiles 0-3: y's 2 x 2 block; 4, 5: x's part for row tiles rt, rt + 1; 6, 7: W's for ft, ft + 1 */
#define AMX_PRODUCTS _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7)
    _tile_loadd(4, x1, 64); _tile_loadd(5, x1 + row_tile, 64);
    _tile_loadd(6, w1, 64); _tile_loadd(7, w1 + next_features, 64); AMX_PRODUCTS; /* x1 w1 */
    _tile_loadd(6, w2, 64); _tile_loadd(7, w2 + next_features, 64); AMX_PRODUCTS; /* x1 w2 */
    _tile_loadd(4, x2, 64); _tile_loadd(5, x2 + row_tile, 64); AMX_PRODUCTS;      /* x2 w2 */
    _tile_loadd(6, w1, 64); _tile_loadd(7, w1 + next_features, 64); AMX_PRODUCTS; /* x2 w1 */
    _tile_loadd(4, x3, 64); _tile_loadd(5, x3 + row_tile, 64); AMX_PRODUCTS;      /* x3 w1 */
    if (third) {
      _tile_loadd(4, x1, 64); _tile_loadd(5, x1 + row_tile, 64);
      _tile_loadd(6, w3, 64); _tile_loadd(7, w3 + next_features, 64); AMX_PRODUCTS; /* x1 w3 */
    }
#undef AMX_PRODUCTS
  }
  _tile_stored(0, out, ld * 4); _tile_stored(1, out + 16, ld * 4);
  _tile_stored(2, out + 16 * ld, ld * 4); _tile_stored(3, out + 16 * ld + 16, ld * 4);
}

/* Outputs of at least this many floats (64 MB) are written with streaming stores; smaller ones, which their next
 * step reads back from the caches, through a block in L1, unless the caller says that y is on pages no cache holds
 * (`fresh`: a run_with_cache's cache, on attnlab.memory's blocks, where a line read before its write is a read
 * from memory for nothing). Measured: benchmarks/README.md, "run_with_cache in fewer passes over memory" and
 * "run_with_cache past the caches"; streaming every output made the head-patching sweep 13 % slower, the tiles
 * stored straight into y 2-5 % slower than through L1. */
#define AMX_STREAM_FROM (16 << 20)

/* n floats from src to dst past the caches (streaming stores) where dst is on a cache line and n a multiple of 16,
 * else copied: a result no step reads back soon, kept in the core's cache while it was being made. */
AMX_TARGET static inline void store_past_caches(float *dst, const float *src, int64_t n) {
  if ((uintptr_t)dst % 64 == 0 && n % 16 == 0) {
    for (int64_t j = 0; j < n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
    return;
  }
  memcpy(dst, src, n * sizeof(float));
}

/* y_i [rows, d_out[i]] = x [rows, d_in] W_i^T + b_i for the n float32 matrices W_i [d_out[i], d_in] (b_i may be
 * NULL), on AMX tiles (above), x split once for all of them (a layer's q, k and v, or its gate and up); only where
 * attnlab_amx_permitted() said 1. One parallel region; the threads share each matrix's panels in turn. scratch:
 * the most of attnlab_linear_amx_scratch's bytes over the d_out[i]; fresh: the y_i are on pages no cache holds
 * (AMX_STREAM_FROM). */
AMX_TARGET void attnlab_linear_amx_many(const float *x, int64_t n, const float *const *w, const float *const *b,
                                        float *const *y, const int64_t *d_out, int8_t *scratch, int64_t rows,
                                        int64_t d_in, int fresh, int threads) {
  if (rows <= 0) return;
  const int64_t kp = round_up(d_in, AMX_K), chunks = kp / AMX_K, row_tiles = round_up(rows, 32) / 16;
  int64_t most = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t p = amx_panel(d_in, d_out[i], threads);
    most = p > most ? p : most;
  }
  uint16_t *A = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  int8_t *per_thread = (int8_t *)(A + row_tiles * chunks * 3 * AMX_TILE);
  const int64_t thread_bytes = most * kp * 6 + 32 * 32 * 4;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t rt = 0; rt < row_tiles; rt++) amx_split_rows(x, d_in, rows, d_in, rt * 16, 16, A);
    configure_tiles();
    uint16_t *B = (uint16_t *)(per_thread + this_thread() * thread_bytes);
    float *out = (float *)(B + most * kp * 3);
    for (int64_t i = 0; i < n; i++) {
      const int64_t panel = amx_panel(d_in, d_out[i], threads), panels = (d_out[i] + panel - 1) / panel;
#pragma omp for schedule(static) nowait
      for (int64_t pi = 0; pi < panels; pi++) {
        const int64_t o0 = pi * panel, features = d_out[i] - o0 < panel ? d_out[i] - o0 : panel;
        int third;
        const int64_t part_stride = amx_pack(w[i], d_in, 0, d_in, o0, features, B, &third);
        const int stream = !b[i] && (fresh || rows * d_out[i] >= AMX_STREAM_FROM);
        for (int64_t rt = 0; rt < row_tiles; rt += 2)
          for (int64_t ft = 0; ft < round_up(features, 32) / 16; ft += 2) {
            const int64_t r0 = rt * 16, f0 = ft * 16;
            const int64_t m = rows - r0 < 32 ? rows - r0 : 32, cols = features - f0 < 32 ? features - f0 : 32;
            amx_block(A, B, part_stride, chunks, chunks, third, rt, ft, out, 32);
            for (int64_t r = 0; r < m; r++) {
              float *yr = y[i] + (r0 + r) * d_out[i] + o0 + f0;
              if (stream) /* no bias, y too large for any cache (the LM head's logits) or on pages none holds
                           * (`fresh`): from L1 into y past the caches, W's panel left in L2 */
                store_past_caches(yr, out + r * 32, cols);
              else
                for (int64_t j = 0; j < cols; j++) yr[j] = out[r * 32 + j] + (b[i] ? b[i][o0 + f0 + j] : 0.0f);
            }
          }
      }
    }
    _mm_sfence(); /* the streamed stores seen before the region's end */
    _tile_release();
  }
}

/* One head's masked scores (attnlab_attend_scores_amx) into y [T, T]: its queries (q, rows `q_stride` apart) split
 * into A, its keys packed into B; blocks of 32 x 32 above the diagonal written without a product. */
AMX_TARGET static void amx_head_scores(const float *q, int64_t q_stride, const float *k, int64_t k_stride, float *y,
                                       uint16_t *A, uint16_t *B, float *out, int64_t T, int64_t d_head, float scale) {
  const int64_t chunks = round_up(d_head, AMX_K) / AMX_K, row_tiles = round_up(T, 32) / 16;
  amx_split_rows(q, q_stride, T, d_head, 0, row_tiles * 16, A);
  int third;
  const int64_t part_stride = amx_pack(k, k_stride, 0, d_head, 0, T, B, &third);
  for (int64_t rt = 0; rt < row_tiles; rt += 2)
    for (int64_t ft = 0; ft < row_tiles; ft += 2) {
      const int64_t r0 = rt * 16, f0 = ft * 16, m = T - r0 < 32 ? T - r0 : 32, cols = T - f0 < 32 ? T - f0 : 32;
      if (f0 > r0 + 31) { /* every key after every query: masked */
        for (int64_t r = 0; r < m; r++)
          for (int64_t j = 0; j < cols; j++) y[(r0 + r) * T + f0 + j] = -INFINITY;
        continue;
      }
      amx_block(A, B, part_stride, chunks, chunks, third, rt, ft, out, 32);
      for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < cols; j++)
          y[(r0 + r) * T + f0 + j] = f0 + j <= r0 + r ? out[r * 32 + j] * scale : -INFINITY;
    }
}

/* One head's z = pattern V (attnlab_attend_mix_amx) into z (rows `z_stride` apart): the pattern [T, S] split into A,
 * the values (v [S, d_head], rows `v_stride` apart) packed into B. `causal`: the pattern is a causal softmax's,
 * exactly 0 above the diagonal, whose 32-key chunks past a block's last query are neither split nor multiplied
 * (adding their zero products changes no sum). */
AMX_TARGET static void amx_head_mix(const float *pattern, const float *v, int64_t v_stride, float *z,
                                    int64_t z_stride, uint16_t *A, uint16_t *B, float *out, int64_t T, int64_t S,
                                    int64_t d_head, int causal) {
  const int64_t chunks = round_up(S, AMX_K) / AMX_K, row_tiles = round_up(T, 32) / 16;
  const int64_t feature_tiles = round_up(d_head, 32) / 16;
  for (int64_t rt = 0; rt < row_tiles; rt += 2) {
    const int64_t used = causal && rt / 2 + 1 < chunks ? rt / 2 + 1 : chunks;
    amx_split_first(pattern, S, T, S, rt * 16, 32, used, A);
  }
  int third;
  const int64_t part_stride = amx_pack(v, v_stride, 1, S, 0, d_head, B, &third);
  for (int64_t rt = 0; rt < row_tiles; rt += 2)
    for (int64_t ft = 0; ft < feature_tiles; ft += 2) {
      const int64_t used = causal && rt / 2 + 1 < chunks ? rt / 2 + 1 : chunks;
      amx_block(A, B, part_stride, chunks, used, third, rt, ft, out, 32);
      const int64_t r0 = rt * 16, f0 = ft * 16;
      const int64_t m = T - r0 < 32 ? T - r0 : 32, cols = d_head - f0 < 32 ? d_head - f0 : 32;
      for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < cols; j++) z[(r0 + r) * z_stride + f0 + j] = out[r * 32 + j];
    }
}

static inline float times_sigmoid(float v, float z);

/* SwiGLU's two products and its product of them, where the hook on the gate only reads (run_with_cache): gate =
 * x W_gate^T and post = silu(gate) * (x W_up^T), no biases, both [rows, d_out]; x split once, each panel of
 * features packed from both matrices (half as wide as attnlab_linear_amx_many's, so that both stay in L2) and each
 * 32 x 32 block's product taken while its gate and up are in L1, where attnlab_silu_mul_up_rows read both back from
 * memory. attnlab_linear_amx_many's gate and attnlab_silu_mul_up_rows's post, bit for bit. scratch:
 * attnlab_linear_amx_swiglu_scratch bytes. */
AMX_TARGET void attnlab_linear_amx_swiglu(const float *x, const float *w_gate, const float *w_up, float *gate,
                                          float *post, int8_t *scratch, int64_t rows, int64_t d_in, int64_t d_out,
                                          int fresh, int threads) {
  if (rows <= 0) return;
  const int64_t kp = round_up(d_in, AMX_K), chunks = kp / AMX_K, row_tiles = round_up(rows, 32) / 16;
  const int64_t panel = amx_swiglu_panel(d_in, d_out, threads), panels = (d_out + panel - 1) / panel;
  uint16_t *A = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  int8_t *per_thread = (int8_t *)(A + row_tiles * chunks * 3 * AMX_TILE);
  const int64_t thread_bytes = 2 * panel * kp * 6 + 32 * 32 * 4;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t rt = 0; rt < row_tiles; rt++) amx_split_rows(x, d_in, rows, d_in, rt * 16, 16, A);
    configure_tiles();
    uint16_t *Bg = (uint16_t *)(per_thread + this_thread() * thread_bytes), *Bu = Bg + panel * kp * 3;
    float *out = (float *)(Bu + panel * kp * 3), g[32 * 32];
#pragma omp for schedule(static)
    for (int64_t pi = 0; pi < panels; pi++) {
      const int64_t o0 = pi * panel, features = d_out - o0 < panel ? d_out - o0 : panel;
      int third_gate, third_up;
      const int64_t part_stride = amx_pack(w_gate, d_in, 0, d_in, o0, features, Bg, &third_gate);
      amx_pack(w_up, d_in, 0, d_in, o0, features, Bu, &third_up);
      for (int64_t rt = 0; rt < row_tiles; rt += 2)
        for (int64_t ft = 0; ft < round_up(features, 32) / 16; ft += 2) {
          const int64_t r0 = rt * 16, f0 = ft * 16;
          const int64_t m = rows - r0 < 32 ? rows - r0 : 32, cols = features - f0 < 32 ? features - f0 : 32;
          amx_block(A, Bg, part_stride, chunks, chunks, third_gate, rt, ft, g, 32);
          amx_block(A, Bu, part_stride, chunks, chunks, third_up, rt, ft, out, 32);
          for (int64_t r = 0; r < m; r++) {
            float *gr = gate + (r0 + r) * d_out + o0 + f0, *pr = post + (r0 + r) * d_out + o0 + f0;
            const float *gb = g + r * 32;
            float *ub = out + r * 32;
#pragma omp simd
            for (int64_t j = 0; j < 32; j++) ub[j] = times_sigmoid(gb[j], gb[j]) * ub[j];
            if (fresh) { /* on pages no cache holds: past the caches (AMX_STREAM_FROM) */
              store_past_caches(gr, gb, cols);
              store_past_caches(pr, ub, cols);
            } else {
              memcpy(gr, gb, cols * sizeof(float));
              memcpy(pr, ub, cols * sizeof(float));
            }
          }
        }
    }
    _mm_sfence(); /* the streamed stores seen before the region's end */
    _tile_release();
  }
}

/* This thread's part of attnlab_attend_amx_scratch(T, S, d_head, threads)'s scratch: split rows A (room for T rows
 * of max(S, d_head) values), packed keys or values B, a block of the result `out`, then room for one head's scores
 * and pattern `kept` (2 T S floats, where T S <= AMX_KEPT_MOST); the tiles configured. */
AMX_TARGET static uint16_t *amx_head_scratch(int8_t *scratch, int64_t T, int64_t S, int64_t d_head, uint16_t **B,
                                             float **out, float **kept) {
  int64_t a, w;
  amx_head_sizes(T, S, d_head, &a, &w);
  int8_t *base = (int8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  uint16_t *A = (uint16_t *)(base + this_thread() * (attnlab_attend_amx_scratch(T, S, d_head, 1) - 64));
  *B = A + a * 3;
  *out = (float *)(*B + w * 3);
  *kept = *out + 32 * 32;
  configure_tiles();
  return A;
}

static void softmax_row(const float *x, float *p, int64_t n);

/* The attention's steps on AMX tiles for every head (the threads share them), those whose outputs are not NULL: q
 * and k to scores, scores to pattern (softmax_row), pattern and v to out_z. q [batch, T, heads, d_head], k
 * [batch, T, kv_heads, d_head] (grouped-query), v [batch, S, kv_heads, d_head], scores and pattern [batch, heads, T,
 * S] (S = T where q is given: a prompt from position 0), out_z [batch, T, heads, d_head]. Where this call made
 * the pattern, it is a causal softmax's, and pattern V leaves out its zero chunks above the diagonal; and a head's
 * scores and pattern (up to AMX_KEPT_MOST floats) are made in the thread's scratch (`kept`, in its core's cache),
 * where the softmax and the mix read them, and leave for scores and pattern past the caches (store_past_caches: no
 * step reads them back, and a line of theirs read from memory before its write is a read for nothing). */
AMX_TARGET static void amx_attend_heads(const float *q, const float *k, const float *v, float *scores,
                                        float *pattern, float *out_z, int8_t *scratch, int64_t batch, int64_t T,
                                        int64_t S, int64_t heads, int64_t kv_heads, int64_t d_head, float scale,
                                        int threads) {
#pragma omp parallel num_threads(threads)
  {
    uint16_t *B;
    float *out, *kept;
    uint16_t *A = amx_head_scratch(scratch, T, S, d_head, &B, &out, &kept);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
      const int64_t b = bh / heads, h = bh % heads, g = h / (heads / kv_heads), kv = (b * S * kv_heads + g) * d_head;
      float *sc = scores ? scores + bh * T * S : NULL, *pt = pattern ? pattern + bh * T * S : NULL;
      const int keep = sc && out_z && T * S <= AMX_KEPT_MOST;
      if (keep) /* all three: scores and pattern made in `kept`, then stored past the caches */
        sc = kept, pt = kept + T * S;
      if (sc)
        amx_head_scores(q + (b * T * heads + h) * d_head, heads * d_head, k + kv, kv_heads * d_head, sc, A, B, out,
                        T, d_head, scale);
      if (sc && out_z) /* all three: the pattern from scores this core has just written */
        for (int64_t r = 0; r < T; r++) {
          softmax_row(sc + r * T, pt + r * T, T);
          if (keep) {
            store_past_caches(scores + bh * T * S + r * T, sc + r * T, T);
            store_past_caches(pattern + bh * T * S + r * T, pt + r * T, T);
          }
        }
      if (out_z)
        amx_head_mix(pt, v + kv, kv_heads * d_head, out_z + (b * T * heads + h) * d_head, heads * d_head, A, B, out,
                     T, S, d_head, sc != NULL);
    }
    _mm_sfence(); /* the streamed stores seen before the region's end */
    _tile_release();
  }
}

/* The masked scores of a prompt's causal attention from position 0 on AMX tiles: attnlab_attend_scores's values
 * (q K^T scale where the key's position <= the query's, -inf elsewhere) at a float32 product's accuracy, for q
 * [batch, T, heads, d_head], k [batch, T, kv_heads, d_head] (grouped-query) into scores [batch, heads, T, T]. */
AMX_TARGET void attnlab_attend_scores_amx(const float *q, const float *k, float *scores, int8_t *scratch,
                                          int64_t batch, int64_t T, int64_t heads, int64_t kv_heads, int64_t d_head,
                                          float scale, int threads) {
  amx_attend_heads(q, k, NULL, scores, NULL, NULL, scratch, batch, T, T, heads, kv_heads, d_head, scale, threads);
}

/* z = pattern V on AMX tiles: attnlab_attend_mix's values at a float32 product's accuracy, for pattern [batch, heads,
 * T, S] (any weights: a hook may have put some anywhere) and v [batch, S, kv_heads, d_head] into out [batch, T,
 * heads, d_head]. */
AMX_TARGET void attnlab_attend_mix_amx(const float *pattern, const float *v, float *out_z, int8_t *scratch,
                                       int64_t batch, int64_t T, int64_t S, int64_t heads, int64_t kv_heads,
                                       int64_t d_head, int threads) {
  amx_attend_heads(NULL, NULL, v, NULL, (float *)pattern, out_z, scratch, batch, T, S, heads, kv_heads, d_head, 0.0f,
                   threads);
}

/* The explicit path's three steps in one call, where the hooks between them only read (run_with_cache): each head's
 * masked scores (attnlab_attend_scores_amx) into scores, their softmax_row into pattern, and z = pattern V
 * (attnlab_attend_mix_amx) into out_z, one head after the other, so that a head's scores and pattern are read back
 * from the core's L2 rather than from memory, and the pattern's chunks above the diagonal (zeros) are neither split
 * nor multiplied. The three calls' numbers, bit for bit (tests/test_amx.py). q, out_z [batch, T, heads, d_head], k,
 * v [batch, T, kv_heads, d_head], scores and pattern [batch, heads, T, T]. */
AMX_TARGET void attnlab_attend_explicit_amx(const float *q, const float *k, const float *v, float *scores,
                                            float *pattern, float *out_z, int8_t *scratch, int64_t batch, int64_t T,
                                            int64_t heads, int64_t kv_heads, int64_t d_head, float scale,
                                            int threads) {
  amx_attend_heads(q, k, v, scores, pattern, out_z, scratch, batch, T, T, heads, kv_heads, d_head, scale, threads);
}

#else
void attnlab_linear_amx_many(const float *x, int64_t n, const float *const *w, const float *const *b,
                             float *const *y, const int64_t *d_out, int8_t *scratch, int64_t rows, int64_t d_in,
                             int fresh, int threads) {
  (void)x, (void)n, (void)w, (void)b, (void)y, (void)d_out, (void)scratch, (void)rows, (void)d_in, (void)fresh;
  (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}

void attnlab_attend_scores_amx(const float *q, const float *k, float *scores, int8_t *scratch, int64_t batch,
                               int64_t T, int64_t heads, int64_t kv_heads, int64_t d_head, float scale, int threads) {
  (void)q, (void)k, (void)scores, (void)scratch, (void)batch, (void)T, (void)heads, (void)kv_heads, (void)d_head;
  (void)scale, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}

void attnlab_attend_mix_amx(const float *pattern, const float *v, float *out_z, int8_t *scratch, int64_t batch,
                            int64_t T, int64_t S, int64_t heads, int64_t kv_heads, int64_t d_head, int threads) {
  (void)pattern, (void)v, (void)out_z, (void)scratch, (void)batch, (void)T, (void)S, (void)heads, (void)kv_heads;
  (void)d_head, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}

void attnlab_linear_amx_swiglu(const float *x, const float *w_gate, const float *w_up, float *gate, float *post,
                               int8_t *scratch, int64_t rows, int64_t d_in, int64_t d_out, int fresh, int threads) {
  (void)x, (void)w_gate, (void)w_up, (void)gate, (void)post, (void)scratch, (void)rows, (void)d_in, (void)d_out;
  (void)fresh, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}

void attnlab_attend_explicit_amx(const float *q, const float *k, const float *v, float *scores, float *pattern,
                                 float *out_z, int8_t *scratch, int64_t batch, int64_t T, int64_t heads,
                                 int64_t kv_heads, int64_t d_head, float scale, int threads) {
  (void)q, (void)k, (void)v, (void)scores, (void)pattern, (void)out_z, (void)scratch, (void)batch, (void)T;
  (void)heads, (void)kv_heads, (void)d_head, (void)scale, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}
#endif

/* y [rows, d_out] = x [rows, d_in] W^T + b (b may be NULL): attnlab_linear_amx_many for one matrix. */
void attnlab_linear_amx(const float *x, const float *w, const float *b, float *y, int8_t *scratch, int64_t rows,
                        int64_t d_in, int64_t d_out, int threads) {
  attnlab_linear_amx_many(x, 1, &w, &b, &y, &d_out, scratch, rows, d_in, 0, threads);
}

/* Causal attention over a whole prompt from position 0 (generation's prefill): softmax(q K^T scale, keys up to the
 * query's own position) V, with grouped-query heads; q, out [batch, T, heads, d_head], k, v [batch, T, kv_heads,
 * d_head], d_head a multiple of TILE_N. Torch's fused CPU attention ran at a fifth of the float32 tile product's
 * rate here (benchmarks/README.md, issue 25); this one is that product twice per TILE_ROWS_F queries of a head:
 * their scores against blocks of TILE_N keys (K^T laid out once per kv head in scratch), a softmax per row (exp_),
 * then the scores times V, read in place. scratch: attnlab_attend_rows_scratch bytes. */
int64_t attnlab_attend_rows_scratch(int64_t batch, int64_t T, int64_t kv_heads, int64_t d_head, int threads) {
  int64_t padded = (T + TILE_N - 1) / TILE_N * TILE_N;
  return (batch * kv_heads * padded * d_head + threads * TILE_ROWS_F * padded) * (int64_t)sizeof(float);
}

/* kt [batch, kv_heads, key block, d_head, TILE_N] = each block of TILE_N keys of k [batch, T, kv_heads, d_head]
 * transposed, zeros past the last key; shared out over the threads of the parallel region it is called in (which
 * wait for each other at its end). */
static void lay_out_keys(const float *k, float *kt, int64_t batch, int64_t T, int64_t kv_heads, int64_t d_head) {
  int64_t key_blocks = (T + TILE_N - 1) / TILE_N;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < batch * kv_heads * key_blocks; i++) {
    int64_t bg = i / key_blocks, s0 = i % key_blocks * TILE_N, b = bg / kv_heads, g = bg % kv_heads;
    float *tile = kt + i * d_head * TILE_N;
    for (int64_t j = 0; j < TILE_N; j++)
      for (int64_t c = 0; c < d_head; c++)
        tile[c * TILE_N + j] = s0 + j < T ? k[((b * T + s0 + j) * kv_heads + g) * d_head + c] : 0.0f;
  }
}

void attnlab_attend_rows(const float *q, const float *k, const float *v, float *out, float *scratch, int64_t batch,
                         int64_t T, int64_t heads, int64_t kv_heads, int64_t d_head, float scale, int threads) {
  int64_t padded = (T + TILE_N - 1) / TILE_N * TILE_N, key_blocks = padded / TILE_N, group = heads / kv_heads;
  int64_t query_blocks = (T + TILE_ROWS_F - 1) / TILE_ROWS_F;
  float *kt = scratch; /* [batch, kv_heads, key block, d_head, TILE_N]: each block of keys transposed */
#pragma omp parallel num_threads(threads)
  {
    float *p = scratch + batch * kv_heads * padded * d_head + this_thread() * TILE_ROWS_F * padded;
    lay_out_keys(k, kt, batch, T, kv_heads, d_head);
    /* the last blocks of queries see the most keys: dynamic, so that the threads end together */
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < batch * heads * query_blocks; i++) {
      int64_t t0 = (query_blocks - 1 - i % query_blocks) * TILE_ROWS_F, bh = i / query_blocks;
      int64_t b = bh / heads, h = bh % heads, g = h / group, m = T - t0 < TILE_ROWS_F ? T - t0 : TILE_ROWS_F;
      int64_t n = t0 + m; /* keys that any of these queries sees */
      const float *qr[TILE_ROWS_F], *pr[TILE_ROWS_F];
      for (int64_t r = 0; r < TILE_ROWS_F; r++) { /* rows past the last repeat t0; dropped */
        qr[r] = q + ((b * T + t0 + (r < m ? r : 0)) * heads + h) * d_head;
        pr[r] = p + r * padded;
      }
      float tile_out[TILE_ROWS_F * TILE_N];
      for (int64_t s0 = 0; s0 < n; s0 += TILE_N) {
        f_tile_rows(kt + ((b * kv_heads + g) * key_blocks + s0 / TILE_N) * d_head * TILE_N, TILE_N, d_head, qr,
                    tile_out);
        for (int64_t r = 0; r < TILE_ROWS_F; r++) memcpy(p + r * padded + s0, tile_out + r * TILE_N, sizeof(float) * TILE_N);
      }
      float inv[TILE_ROWS_F];
      for (int64_t r = 0; r < m; r++) { /* query t0 + r sees keys 0 .. t0 + r */
        float *row = p + r * padded, top = -INFINITY, total = 0.0f;
        int64_t seen = t0 + r + 1;
#pragma omp simd reduction(max : top)
        for (int64_t s = 0; s < seen; s++) top = row[s] * scale > top ? row[s] * scale : top;
#pragma omp simd reduction(+ : total)
        for (int64_t s = 0; s < seen; s++) {
          row[s] = exp_(row[s] * scale - top);
          total += row[s];
        }
        for (int64_t s = seen; s < n; s++) row[s] = 0.0f;
        inv[r] = 1.0f / total;
      }
      const float *vh = v + g * d_head + b * T * kv_heads * d_head;
      for (int64_t c0 = 0; c0 < d_head; c0 += TILE_N) {
        f_tile_rows(vh + c0, kv_heads * d_head, n, pr, tile_out);
        for (int64_t r = 0; r < m; r++)
          for (int64_t j = 0; j < TILE_N; j++)
            out[((b * T + t0 + r) * heads + h) * d_head + c0 + j] = tile_out[r * TILE_N + j] * inv[r];
      }
    }
  }
}

/* A whole prompt's causal attention from position 0 in three steps, so that hooks can read and replace what lies
 * between them (hook_attn_scores, hook_pattern: attnlab.generate.fast_layers.KernelAttention): the scores, the
 * pattern, then the pattern times V; each is attnlab.model.attention's equation on float32 tensors.
 *
 * scores [batch, heads, T, T] = q K^T scale where query t sees key s (s <= t), -inf elsewhere (apply_mask's value);
 * q [batch, T, heads, d_head], k [batch, T, kv_heads, d_head] (grouped-query); scratch:
 * attnlab_attend_rows_scratch(batch, T, kv_heads, d_head, 1) bytes. */
void attnlab_attend_scores(const float *q, const float *k, float *scores, float *scratch, int64_t batch, int64_t T,
                           int64_t heads, int64_t kv_heads, int64_t d_head, float scale, int threads) {
  int64_t padded = (T + TILE_N - 1) / TILE_N * TILE_N, key_blocks = padded / TILE_N, group = heads / kv_heads;
  int64_t query_blocks = (T + TILE_ROWS_F - 1) / TILE_ROWS_F;
#pragma omp parallel num_threads(threads)
  {
    lay_out_keys(k, scratch, batch, T, kv_heads, d_head);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < batch * heads * query_blocks; i++) {
      int64_t t0 = (query_blocks - 1 - i % query_blocks) * TILE_ROWS_F, bh = i / query_blocks;
      int64_t b = bh / heads, h = bh % heads, g = h / group, m = T - t0 < TILE_ROWS_F ? T - t0 : TILE_ROWS_F;
      const float *qr[TILE_ROWS_F];
      for (int64_t r = 0; r < TILE_ROWS_F; r++) /* rows past the last repeat t0; dropped */
        qr[r] = q + ((b * T + t0 + (r < m ? r : 0)) * heads + h) * d_head;
      float tile_out[TILE_ROWS_F * TILE_N], *rows = scores + (bh * T + t0) * T;
      for (int64_t s0 = 0; s0 < t0 + m; s0 += TILE_N) { /* the key blocks any of these queries sees */
        f_tile_rows(scratch + ((b * kv_heads + g) * key_blocks + s0 / TILE_N) * d_head * TILE_N, TILE_N, d_head, qr,
                    tile_out);
        int64_t n = T - s0 < TILE_N ? T - s0 : TILE_N;
        for (int64_t r = 0; r < m; r++)
          for (int64_t j = 0; j < n; j++)
            rows[r * T + s0 + j] = s0 + j <= t0 + r ? tile_out[r * TILE_N + j] * scale : -INFINITY;
      }
      for (int64_t r = 0; r < m; r++) /* the keys no query of the block sees */
        for (int64_t s = (t0 + m + TILE_N - 1) / TILE_N * TILE_N; s < T; s++) rows[r * T + s] = -INFINITY;
    }
  }
}

/* pattern = softmax over a row of n scores (attention_pattern): exp(x - max) / sum, a row whose scores are all -inf
 * all zeros, and every -inf score exactly 0. The sum is kept in 16 lanes (score s in lane s % 16), so that the
 * trailing blocks of 16 whose scores are all -inf (a causal row's keys after its query: half of a prompt's) add
 * exactly nothing, and are skipped: no exp, zeros written. Not inlined: attnlab_softmax_rows and the fused
 * attention on AMX tiles (attnlab_attend_explicit_amx) share its numbers bit for bit. */
__attribute__((noinline)) static void softmax_row(const float *x, float *p, int64_t n) {
  int64_t end = n; /* past the last block of 16 with a finite score */
  while (end > 0) {
    int64_t s0 = (end - 1) / 16 * 16;
    int masked = 1;
    for (int64_t s = s0; s < end; s++) masked &= x[s] == -INFINITY;
    if (!masked) break;
    end = s0;
  }
  memset(p + end, 0, (n - end) * sizeof(float));
  if (end == 0) return;
  float top = -INFINITY, lanes[16] = {0};
#pragma omp simd reduction(max : top)
  for (int64_t s = 0; s < end; s++) top = x[s] > top ? x[s] : top;
  for (int64_t s0 = 0; s0 < end; s0 += 16) {
    const int64_t len = end - s0 < 16 ? end - s0 : 16;
#pragma omp simd
    for (int64_t j = 0; j < len; j++) {
      float e = x[s0 + j] == -INFINITY ? 0.0f : exp_(x[s0 + j] - top);
      p[s0 + j] = e;
      lanes[j] += e;
    }
  }
  for (int width = 8; width > 0; width /= 2) /* the lanes' sum in a fixed order */
    for (int j = 0; j < width; j++) lanes[j] += lanes[j + width];
  float inv = 1.0f / lanes[0];
#pragma omp simd
  for (int64_t s = 0; s < end; s++) p[s] *= inv;
}

/* softmax_row over each of rows contiguous rows of n scores */
void attnlab_softmax_rows(const float *scores, float *pattern, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) softmax_row(scores + r * n, pattern + r * n, n);
}

/* out [batch, T, heads, d_head] = pattern V: pattern [batch, heads, T, S], v [batch, S, kv_heads, d_head]
 * (grouped-query), d_head a multiple of TILE_N; every key of every row (a hook may have put weight anywhere). */
void attnlab_attend_mix(const float *pattern, const float *v, float *out, int64_t batch, int64_t T, int64_t S,
                        int64_t heads, int64_t kv_heads, int64_t d_head, int threads) {
  int64_t query_blocks = (T + TILE_ROWS_F - 1) / TILE_ROWS_F, group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < batch * heads * query_blocks; i++) {
    int64_t t0 = i % query_blocks * TILE_ROWS_F, bh = i / query_blocks, b = bh / heads, h = bh % heads;
    int64_t m = T - t0 < TILE_ROWS_F ? T - t0 : TILE_ROWS_F;
    const float *pr[TILE_ROWS_F], *vh = v + (b * S * kv_heads + h / group) * d_head;
    for (int64_t r = 0; r < TILE_ROWS_F; r++) pr[r] = pattern + (bh * T + t0 + (r < m ? r : 0)) * S;
    float tile_out[TILE_ROWS_F * TILE_N];
    for (int64_t c0 = 0; c0 < d_head; c0 += TILE_N) {
      f_tile_rows(vh + c0, kv_heads * d_head, S, pr, tile_out);
      for (int64_t r = 0; r < m; r++)
        memcpy(out + ((b * T + t0 + r) * heads + h) * d_head + c0, tile_out + r * TILE_N, TILE_N * sizeof(float));
    }
  }
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

/* The residual stream's start for one token per row from a table kept as blocks of `type` (uint8 [d_vocab, row
 * bytes]): out[r] = the dequantized row ids[r], d values (attnlab_dequantize's formulas: bit-equal to the reference;
 * kernels.embed_blocks). The ids are trusted: the caller checks them. */
void attnlab_embed_q(const int64_t *ids, const uint8_t *blocks, float *out, int64_t rows, int64_t d, int type,
                     float scale) {
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

/* The keys a windowed block sees this step [rows, max_len]: those of key_mask (every slot when it is NULL) from
 * slot[0] - window + 1 on (the band of the last `window` slots, Gemma 3's local blocks, Mistral's window). */
void attnlab_window_mask(uint8_t *window_mask, const uint8_t *key_mask, const int64_t *slot, int64_t rows,
                         int64_t max_len, int64_t window) {
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

/* The residual stream's start for one token per row: out[r] = table[ids[r]] * scale (+ positions_table[positions[r]]
 * when that is not NULL: learned absolute positions), d values per row (attnlab.Transformer.embed_tokens; scale:
 * Gemma's sqrt(d_model) as a float32, else 1). */
void attnlab_embed(const int64_t *ids, const float *table, const int64_t *positions, const float *positions_table,
                   float *out, int64_t rows, int64_t d, float scale) {
  for (int64_t r = 0; r < rows; r++) {
    const float *e = table + ids[r] * d, *p = positions_table ? positions_table + positions[r] * d : NULL;
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
 * floats; on return scores[rh, 0 .. slot] holds the unnormalised weights exp(score - max), 0 at masked keys
 * (KernelDecoder.weights reads them). A row that may see no key gets zeros, as attnlab.attention does. */
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
    float total = 0;
#pragma omp simd reduction(+ : total)
    for (s = 0; s < n; s++) {
      p[s] = p[s] == -INFINITY ? 0.0f : exp_(p[s] - top);
      total += p[s];
    }
    /* no visible key: every weight 0. Not `top == -INFINITY`: a max reduction's private copies start at the type's
     * least value, -inf for GCC but -FLT_MAX for clang, so with every key masked clang's top is -FLT_MAX. */
    if (total == 0) {
      for (int64_t i = 0; i < d_head; i++) o[i] = 0.0f;
      continue;
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

/* v sigmoid(z) = v / (1 + e^-z) through the vectorised exp_; below z = -88, e^-z is past float's range (exp_ holds
 * it there): -0. SiLU is v sigmoid(v), GELU's tanh form v sigmoid(2u). */
static inline float times_sigmoid(float v, float z) { return z < -88.0f ? -0.0f : v / (1.0f + exp_(-z)); }

/* erfc z for z >= 0 (Numerical Recipes' erfcc, 2nd ed., 6.2: t e^(-z^2 + a polynomial in t), t = 1 / (1 + z / 2),
 * fractional error under 1.2e-7 for every z), through the vectorised exp_. */
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
 * 0.5 v (1 + erf(v / sqrt 2)), as 0.5 v (2 - erfc z) for v >= 0 and 0.5 v erfc z below, z = |v| / sqrt 2 (libm's
 * erff was a call per value; below 0 this form also keeps its relative precision where 1 + erf cancels). GELU's
 * tanh form as 0.5 v (1 + tanh u) = v sigmoid(2u), u = sqrt(2 / pi) (v + 0.044715 v^3): the same function
 * through the vectorised exp_ (libm's tanhf, a call per value, was 0.36 ms of Gemma 3 270M's 11 ms decode step;
 * the sigmoid form also keeps its relative precision where 1 + tanh u cancels). */
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

/* Logit soft-capping (Gemma 2; modded-nanogpt), in place on n values: x = cap tanh(x / cap), over the whole
 * vocabulary every token. tanh t through the vectorised exp_ as sign(t) (1 - e^(-2|t|)) / (1 + e^(-2|t|)), and
 * below |t| = 1/8, where 1 - e^(-2|t|) cancels, as its series t - t^3/3 + 2t^5/15 - 17t^7/315 (the next term is
 * under 2e-9 of t there): libm's tanhf was a call per value. */
void attnlab_softcap(float *x, int64_t n, float cap) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) {
    float t = x[i] / cap, a = fabsf(t), t2 = t * t, e = exp_(-2.0f * a);
    float series = t * (1.0f + t2 * (-1.0f / 3.0f + t2 * (2.0f / 15.0f + t2 * (-17.0f / 315.0f))));
    x[i] = cap * (a < 0.125f ? series : copysignf((1.0f - e) / (1.0f + e), t));
  }
}

/* SwiGLU's product (Shazeer 2020), in place: gate = silu(gate) * up = gate / (1 + exp(-gate)) * up, n values. */
void attnlab_silu_mul(float *gate, const float *up, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; i++) gate[i] = times_sigmoid(gate[i], gate[i]) * up[i];
}


/* A prompt's elementwise kernels, rows shared by the threads (each of the serial kernels above on its share):
 * RMSNorm of `rows` rows of d; SwiGLU's product on n values; RoPE out of place, x and out [rows, heads, d_head],
 * cos, sin [rows, rotary_dim] (each row's own angles; the dims past rotary_dim copied). */
void attnlab_rms_norm_rows(const float *x, const float *w, float *out, int64_t rows, int64_t d, float eps,
                           int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d > 16384)
  for (int64_t r = 0; r < rows; r++) attnlab_rms_norm(x + r * d, w, out + r * d, 1, d, eps);
}

/* SwiGLU's product into up, where a hook holds the gate (run_with_cache): up = silu(gate) * up, n values. */
void attnlab_silu_mul_up_rows(const float *gate, float *up, int64_t n, int threads) {
#pragma omp parallel for simd schedule(static) num_threads(threads) if (n > 16384)
  for (int64_t i = 0; i < n; i++) up[i] = times_sigmoid(gate[i], gate[i]) * up[i];
}

/* RMSNorm with the parts its hooks read (run_with_cache): out as attnlab_rms_norm_rows, scale [rows] = sqrt(mean(x^2)
 * + eps) and normalized = x / scale, from one pass over each row's squares. */
void attnlab_rms_norm_parts_rows(const float *x, const float *w, float *out, float *scale, float *normalized,
                                 int64_t rows, int64_t d, float eps, int threads) {
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

/* (no fused multiply-add here: the two products rounded, then added, as apply_rope's x cos + rotate_half(x) sin,
 * so that the prompt's rotation is PyTorch's bit for bit; GCC is told by an attribute, clang, which ignores that
 * attribute and contracts within an expression by default, by a pragma) */
#ifdef __clang__
#define NO_CONTRACTION
#else
#define NO_CONTRACTION __attribute__((optimize("fp-contract=off")))
#endif
NO_CONTRACTION void attnlab_rope_rows(const float *x, float *out, const float *cos_, const float *sin_, int64_t rows,
                                      int64_t heads, int64_t d_head, int64_t rotary_dim, int threads) {
#ifdef __clang__
#pragma clang fp contract(off)
#endif
  int64_t half = rotary_dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * heads * d_head > 16384)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t h = 0; h < heads; h++) {
      const float *v = x + (r * heads + h) * d_head, *c = cos_ + r * rotary_dim, *s = sin_ + r * rotary_dim;
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
  OP_LINEAR_Q,
  OP_EMBED_Q,
  OP_ADD,
  OP_MUL,
  OP_WINDOW_MASK,
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

/* run_op's `next`: the block product that the program runs after this op (NULL: none); `first`: whether this op is
 * the program's first block product (linear_q's prologue); `rounded`: where this thread's rounding of the op's x
 * already is (linear_q's; NULL: none). */
static void run_op(const attnlab_op *op, const attnlab_op *next, int first, int8_t *rounded) {
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
                  ARG(4, float *), op->a[5], op->a[6], (float)op->f);
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
  case OP_EMBED_Q:
#pragma omp single nowait
    attnlab_embed_q(ARG(0, const int64_t *), ARG(1, const uint8_t *), ARG(2, float *), op->a[3], op->a[4],
                    (int)op->a[5], (float)op->f);
    break;
  case OP_ADD:
    share(op->a[2], &lo, &hi);
    attnlab_add(ARG(0, float *) + lo, ARG(1, const float *) + lo, hi - lo);
    break;
  case OP_MUL:
    share(op->a[2], &lo, &hi);
    attnlab_mul(ARG(0, float *) + lo, ARG(1, const float *) + lo, hi - lo);
    break;
  case OP_WINDOW_MASK:
#pragma omp single nowait
    attnlab_window_mask(ARG(0, uint8_t *), ARG(1, const uint8_t *), ARG(2, const int64_t *), op->a[3], op->a[4],
                        op->a[5]);
    break;
  case OP_LINEAR_Q: {
    q_share after = {0, 0, NULL, 0}; /* this thread's share of the next product, which linear_q prefetches */
    if (next) {
      int64_t type = next->a[8] & ~REPACKED; /* (16 rows' blocks take the bytes of 16 rows: the same offsets) */
      after = share_of((const uint8_t *)(intptr_t)next->a[1], next->a[7],
                       next->a[6] / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type], next->a[8] & REPACKED ? GROUP : ROWS_AT_ONCE);
    }
    linear_q(ARG(0, const float *), ARG(1, const uint8_t *), ARG(2, const float *), ARG(3, float *),
             ARG(4, int8_t *), op->a[5], op->a[6], op->a[7], (int)op->a[8], (int)op->a[9], after.start, after.bytes,
             first, rounded);
    break;
  }
  }
}

/* The body of a program's parallel region: every thread walks the ops (attnlab_run above) */
static void run_program(const attnlab_op *ops, int64_t n) {
  int first = 1;           /* no block product yet */
  int8_t *rounding = NULL; /* the scratch holding the last op's rounding of its x, when it was a block product */
  for (int64_t i = 0; i < n; i++) {
    const attnlab_op *op = ops + i, *next = NULL;
    int8_t *rounded = NULL;
    if (op->kind == OP_LINEAR_Q) {
      for (int64_t j = i + 1; j < n && !next; j++)
        if (ops[j].kind == OP_LINEAR_Q) next = ops + j;
      /* the block product right before this one read the same rows of x: its rounding of them is read again
       * (nothing ran in between that could have written x) */
      if (rounding && op[-1].a[0] == op->a[0] && op[-1].a[5] == op->a[5] && op[-1].a[6] == op->a[6])
        rounded = rounding;
    }
    run_op(op, next, first && op->kind == OP_LINEAR_Q, rounded);
    first = first && op->kind != OP_LINEAR_Q;
    rounding = op->kind != OP_LINEAR_Q ? NULL : rounded ? rounded : (int8_t *)(intptr_t)op->a[4];
    if (ops[i].wait) {
#pragma omp barrier
    }
  }
}

void attnlab_run(const attnlab_op *ops, int64_t n, int threads) {
#pragma omp parallel num_threads(threads)
  run_program(ops, n);
}

/* The index of the largest of v[0..n): the first one where several are equal, the first NaN where there is one
 * (torch.argmax's choices). A vectorised pass for the maximum, then a scan for its first place. */
static int64_t argmax_first(const float *v, int64_t n) {
  float m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; i++) {
    m = v[i] > m ? v[i] : m;
    nan |= v[i] != v[i];
  }
  for (int64_t i = 0; i < n; i++)
    if (nan ? v[i] != v[i] : v[i] == m) return i;
  return 0; /* n == 0, or every value -inf: torch's choice too */
}

/* Greedy generation with no Python between tokens (attnlab.generate.loop.generate, temperature 0): `tokens` times,
 * each row's next token is the argmax of its logits [rows, vocab] (those of the prompt when this is called, then
 * each step's), written to out[r * out_stride + i]; then, unless it was the last, it becomes the step program's
 * input: ids[r] = token, position[r] += 1, slot[0] += 1, key_mask[r, slot] = 1 (key_mask may be NULL: no padding),
 * and the program (the decode step, whose last op is the LM head writing `logits`) runs, all inside one parallel
 * region, the threads waiting for each other at the program's barriers and around the choice. With eos >= 0, a
 * row that produced eos (done[r], kept across calls by the caller) gives eos from then on, and generation stops
 * once every row has: the number of tokens written is returned (generate fills the rest with eos, as its Python
 * loop does). The same arithmetic as the Python loop, op for op: the tokens are equal. */
int64_t attnlab_generate_greedy(const attnlab_op *ops, int64_t n, int threads, int64_t tokens, const float *logits,
                                int64_t rows, int64_t vocab, int64_t *ids, int64_t *position, int64_t *slot,
                                uint8_t *key_mask, int64_t max_len, int64_t *out, int64_t out_stride, int64_t eos,
                                uint8_t *done) {
  int64_t made = 0;
#pragma omp parallel num_threads(threads)
  for (int64_t i = 0; i < tokens; i++) {
#pragma omp single
    { /* (the single's end is a barrier: every thread sees the choice and `made`) */
      int all_done = eos >= 0;
      for (int64_t r = 0; r < rows; r++) {
        int64_t token = argmax_first(logits + r * vocab, vocab);
        if (eos >= 0) {
          if (done[r]) token = eos;
          done[r] |= token == eos;
          all_done = all_done && done[r];
        }
        out[r * out_stride + i] = token;
        ids[r] = token;
      }
      made = all_done || i == tokens - 1 ? -(i + 1) : i + 1; /* negative: stop after this token */
      if (made > 0) {
        slot[0] += 1;
        for (int64_t r = 0; r < rows; r++) {
          position[r] += 1;
          if (key_mask) key_mask[r * max_len + slot[0]] = 1;
        }
      }
    }
    if (made < 0) break;
    run_program(ops, n);
#pragma omp barrier /* the logits are whole before the next choice reads them */
  }
  return made < 0 ? -made : made;
}

/* The machine's streaming read bandwidth, the bound of a decode step, which reads every weight once from memory:
 * one read-only pass over `bytes` of `buf` (64-byte aligned, a multiple of 1024; far larger than the caches), each
 * thread streaming its own contiguous share, in this build's widest loads (four 512-bit loads per 256 bytes with
 * AVX-512, the compiler's vectors elsewhere) into integer sums (an add per load: no chain a load waits on). With
 * `ahead` > 0 each pass also asks for the lines `ahead` bytes further on (as the decode products do); a plain
 * sequential read is what the hardware prefetchers see best, so kernels.read_bandwidth takes the best of both.
 * Returns the sum of the buffer's 64-bit words modulo 2^64, so that no load can be dropped (and a test can check
 * that every word was read once). */
uint64_t attnlab_read_pass(const uint8_t *buf, int64_t bytes, int threads, int64_t ahead) {
  uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    int64_t lo, hi;
    share(bytes / 64, &lo, &hi); /* in 64-byte lines, each thread's in whole multiples of 16 lines */
    const uint8_t *p = buf + 64 * lo, *end = buf + 64 * hi;
#if AVX512
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (; p + 256 <= end; p += 256) {
      if (ahead)
        for (int k = 0; k < 256; k += 64) __builtin_prefetch(p + k + ahead, 0, 3);
      a0 = _mm512_add_epi64(a0, _mm512_load_si512((const void *)p));
      a1 = _mm512_add_epi64(a1, _mm512_load_si512((const void *)(p + 64)));
      a2 = _mm512_add_epi64(a2, _mm512_load_si512((const void *)(p + 128)));
      a3 = _mm512_add_epi64(a3, _mm512_load_si512((const void *)(p + 192)));
    }
    total += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
#endif
    uint64_t s = 0;
    for (; p + 256 <= end; p += 256) { /* the other builds: 256 bytes per pass, vectorised by the compiler */
      const uint64_t *q = (const uint64_t *)p;
      if (ahead)
        for (int k = 0; k < 256; k += 64) __builtin_prefetch(p + k + ahead, 0, 3);
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < 32; i++) s += q[i];
    }
    total += s;
  }
  return total;
}

/* The distance attnlab_read_pass's prefetching pass asks ahead: the decode products' */
int64_t attnlab_prefetch_ahead(void) { return PREFETCH_AHEAD; }

/* Whether this build runs its parallel regions on several threads: _OPENMP's date (OpenMP's version) when it was
 * compiled with OpenMP, 0 without (Apple's clang; clang without libomp): then every pragma above but `omp simd` is
 * ignored, each kernel runs on the calling thread, and the thread index every share is computed from is 0 of 1. */
int attnlab_openmp(void) {
#ifdef _OPENMP
  return _OPENMP;
#else
  return 0;
#endif
}
