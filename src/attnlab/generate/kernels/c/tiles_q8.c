/* A prompt's products with weights in blocks, as tiled matrix products of many rows at once (a
 * prompt's T tokens); the float32 one is tiles_f32.c's.
 *
 * Torch's float32 GEMM is MKL's, which on some CPUs runs its AVX2 code at a fraction of the AVX-512
 * FMA rate, and a block model first dequantized every matrix into a float copy for it
 * (benchmarks/README.md, issue 25). Here the weights are read once per tile of TILE_N output
 * features: the tile is laid out (and, for blocks, unpacked) into a small buffer that stays in the
 * core's cache while every row of x passes over it, a register tile of rows at a time.
 *
 * Two products:
 * - attnlab_linear_q_rows, blocks times 8-bit activations (the decode step's arithmetic,
 *   attnlab_linear_q's numbers up to float32 summation order): each row of x is rounded once by
 *   quantize_row_q8 and stored as unsigned bytes q + 128; a tile holds each feature's block as
 *   signed bytes (Q8_0's q, Q4_0's n - 8, Q4_1's n) in the order AVX-512 VNNI's dpbusd reads them
 *   (four consecutive weights of 16 features per 64 bytes), with per block its scale d, Q4_1's
 *   offset m and -128 times its sum, which takes the +128 back out of the integer sum:
 *   sum (q + 128) w - 128 sum w = sum q w. Per block and row the integer sum then takes one
 *   multiply by d dx (and Q4_1's m dx sum q, as attnlab_linear_q does).
 * - attnlab_linear_f_rows (tiles_f32.c), float32 weights (a float model's, or blocks dequantized a
 *   tile at a time) times float32 x: the product a float model's prompt computes, with its own
 *   summation order.
 * The 8-bit product has three forms, fixed by the build: AVX-512 VNNI (x as unsigned bytes q + 128,
 * weights signed, the +128 taken out by the tile's corr), AVX2 (maddubs + madd: unsigned times
 * signed bytes into 16 bits, where q + 128 times a weight would saturate, so x stays signed and the
 * weights are the unsigned ones: Q4_0/Q4_1's nibbles n, Q4_0's -8 added back as -8 sum q per block
 * of x; Q8_0's signed weights take the sign trick, |w| times x with w's sign, as the decode
 * step's), and a plain loop with AVX2's layout anywhere else (for the tests). The float32 one is
 * written with GCC's vector types, which compile to whatever vectors the target has; generation
 * takes it on AVX-512 builds only. */
#include "common.h"
#include "vec.h"

static int64_t this_thread(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

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

/* One block of 32 values of x rounded as quantize_row_q8 rounds it (the same float operations, so
 * the same q): dx = max|x| / 127 (NaN for a block holding a NaN or an infinity), q =
 * round-to-even(x / dx) via the reciprocal. */
static inline void round_block(const float *xb, uint8_t *q, float *dx, float *sx, int32_t *qs) {
#if AVX512
  __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  __m512 z0 = _mm512_mul_ps(v0, _mm512_setzero_ps()), z1 = _mm512_mul_ps(v1, _mm512_setzero_ps());
  int bad = _mm512_cmp_ps_mask(z0, z1, _CMP_UNORD_Q) != 0; /* NaN when a value is NaN or infinite */
  float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  if (bad) d = NAN, id = 0.0f;
  /* the rounding mode: to even */
  __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
  __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
  int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  __m128i b0 = _mm512_cvtepi32_epi8(q0), b1 = _mm512_cvtepi32_epi8(q1); /* |q| <= 127 */
  if (ROWS_VNNI)
    b0 = _mm_xor_si128(b0, _mm_set1_epi8((char)0x80)),
    b1 = _mm_xor_si128(b1, _mm_set1_epi8((char)0x80));
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
  __m256i b =
      _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256((__m256i *)q,
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
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

/* One tile of TILE_N features, 8-bit: w [blocks][8 groups][TILE_N][4] (four consecutive weights of
 * a feature per dword, as dpbusd and maddubs + madd read them), then d, m [blocks][TILE_N] float
 * and corr [blocks][TILE_N] int32 (VNNI: -128 sum w). */
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

/* Q4_1 and the K-quants Q4_K, Q5_K: a min term m per block of 32 (the tiles' m times the row's sum)
 */
static inline int rows_have_min(int type) {
  return type == BLOCK_Q4_1 || type == BLOCK_Q4_K || type == BLOCK_Q5_K;
}

/* block b (of 32 weights) of a row of `type` as 32 bytes in weight order, its d and m, the weights
 * being d v + m: Q8_0's q; Q4_0's n - 8, or n when `nibbles`, as the non-VNNI tiles hold them;
 * Q4_1's n; Q5_0's n - 16; Q4_K's and Q5_K's sub-block b % 8 of their block b / 8 as Q4_1 with d =
 * d sc and m = -dmin m, in dequantize_more's float operations (so d v + m is its value bit for bit)
 */
static inline void block_values(const uint8_t *row, int64_t b, int type, int nibbles, int8_t *v,
                                float *d, float *m) {
  if (type >= BLOCK_Q5_0) {
    const uint8_t *p = row + b / (BLOCK_WEIGHTS[type] / QK) * BLOCK_BYTES[type];
    int s = (int)(b % (BLOCK_WEIGHTS[type] / QK)), offset = type == BLOCK_Q5_0 ? 16 : 0;
    uint8_t n[QK];
    values_of(type, p, s, n);
    for (int j = 0; j < QK; j++) v[j] = (int8_t)(n[j] - offset);
    const block_q4_K *q4 = (const block_q4_K *)p; /* Q5_K's d, dmin and scales too */
    *d = half_at(&q4->d), *m = 0.0f; /* (Q5_0's d is first too) */
    if (type != BLOCK_Q5_0) {
      int sc, mn;
      scale_min_k(q4->scales, s, &sc, &mn);
      *d = *d * (float)sc, *m = -(half_at(&q4->dmin) * (float)mn);
    }
    return;
  }
  const uint8_t *p = row + b * BLOCK_BYTES[type];
  const block_q4_1 *q41 = (const block_q4_1 *)p; /* (d comes first in all three) */
  *d = half_at(&q41->d);
  *m = type == BLOCK_Q4_1 ? half_at(&q41->m) : 0.0f;
  if (type == BLOCK_Q8_0) {
    memcpy(v, ((const block_q8_0 *)p)->qs, QK);
    return;
  }
  const uint8_t *n = type == BLOCK_Q4_1 ? q41->qs : ((const block_q4_0 *)p)->qs;
  int offset = type == BLOCK_Q4_0 && !nibbles ? 8 : 0;
  for (int j = 0; j < QK / 2; j++) {
    v[j] = (int8_t)((n[j] & 15) - offset);
    v[j + QK / 2] = (int8_t)((n[j] >> 4) - offset);
  }
}

/* pack_q_tile one feature at a time: its block's 32 values, then each group of four stored as one
 * dword at its place (the VNNI build's gathers below take Q8_0, Q4_0 and Q4_1 only) */
static void pack_q_tile_plain(const uint8_t *w, int type, int64_t o0, int64_t n, int64_t nb,
                              q_tile t) {
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
      for (int g = 0; g < QK / 4; g++)
        memcpy(t.w + ((b * (QK / 4) + g) * TILE_N + j) * 4, v + 4 * g, 4);
      for (int i = 0; i < QK; i++) sum += v[i];
      t.d[b * TILE_N + j] = d, t.m[b * TILE_N + j] = m, t.corr[b * TILE_N + j] = -128 * sum;
    }
}

/* features o0 .. o0 + n - 1 of w (rows of nb blocks of `type`) into tile t; features n .. TILE_N -
 * 1 zero */
static void pack_q_tile(const uint8_t *w, int type, int64_t o0, int64_t n, int64_t nb, q_tile t) {
#if ROWS_VNNI
  if (type >= BLOCK_Q5_0) { /* Q5_0 and the K-quants: not vectorised yet */
    pack_q_tile_plain(w, type, o0, n, nb, t);
    return;
  }
  int64_t bytes = BLOCK_BYTES[type];
  /* sixteen features at a time: each group of four weights gathered from the sixteen rows (one
   * dword each), the nibbles split with a shift and a mask, the sums by dpbusd with ones; the plain
   * loop below computed the same bytes far slower (benchmarks/README.md) */
  const __m512i ones = _mm512_set1_epi8(1), low = _mm512_set1_epi8(0x0F),
                eight = _mm512_set1_epi8(8);
  const int64_t data = head_bytes(type);
  for (int64_t half = 0; half < TILE_N / 16; half++) {
    int64_t j0 = half * 16, valid = n - j0 < 0 ? 0 : (n - j0 < 16 ? n - j0 : 16);
    __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const uint8_t *base = w + (o0 + j0) * nb * bytes;
    __m512i rows =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32((int32_t)(nb * bytes)));
    for (int64_t b = 0; b < nb; b++) {
      __m512i at = _mm512_add_epi32(rows, _mm512_set1_epi32((int32_t)(b * bytes)));
      __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, at, base, 1);
      __m512i sum = _mm512_setzero_si512();
      __m512i *out = (__m512i *)(t.w + b * TILE_N * QK) + half;
      if (type == BLOCK_Q8_0) {
        for (int g = 0; g < QK / 4; g++) {
          __m512i v = _mm512_mask_i32gather_epi32(
              _mm512_setzero_si512(), mask, _mm512_add_epi32(at, _mm512_set1_epi32(data + 4 * g)),
              base, 1);
          _mm512_store_si512(out + 2 * g, v);
          sum = _mm512_dpbusd_epi32(sum, ones, v);
        }
      } else {
        /* bytes 4g .. 4g + 3: weights 4g.. (low nibbles), 16 + 4g.. (high) */
        for (int g = 0; g < QK / 8; g++) {
          __m512i v = _mm512_mask_i32gather_epi32(
              _mm512_setzero_si512(), mask, _mm512_add_epi32(at, _mm512_set1_epi32(data + 4 * g)),
              base, 1);
          __m512i lo = _mm512_and_si512(v, low),
                  hi = _mm512_and_si512(_mm512_srli_epi32(v, 4), low);
          if (type == BLOCK_Q4_0) lo = _mm512_sub_epi8(lo, eight), hi = _mm512_sub_epi8(hi, eight);
          lo = _mm512_maskz_mov_epi32(mask, lo), hi = _mm512_maskz_mov_epi32(mask, hi);
          _mm512_store_si512(out + 2 * g, lo);
          _mm512_store_si512(out + 2 * (g + QK / 8), hi);
          sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum, ones, lo), ones, hi);
        }
      }
      _mm512_storeu_si512(t.corr + b * TILE_N + j0,
                          _mm512_mullo_epi32(sum, _mm512_set1_epi32(-128)));
      _mm512_storeu_ps(t.d + b * TILE_N + j0, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head)));
      _mm512_storeu_ps(t.m + b * TILE_N + j0,
                       type == BLOCK_Q4_1
                           ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)))
                           : _mm512_setzero_ps());
    }
  }
  return;
#endif
  pack_q_tile_plain(w, type, o0, n, nb, t);
}

#if ROWS_AVX2
/* q_tile_rows on AVX2, one copy per block type (the type a constant: no branch in the loops). Per
 * half of the tile (16 features, two vectors) and block: 4 rows x 2 integer sums in registers, each
 * group's weights loaded once and used by the four rows, the float sums kept in `out` (in L1). The
 * loop over groups is not unrolled: unrolled, the compiler loaded a block's weights ahead into more
 * registers than there are and spilled them. */
static inline __attribute__((always_inline)) void
q_tile_rows_avx2(q_tile t, int64_t nb, const int type, const x_row *xr, float *out) {
  for (int i = 0; i < TILE_ROWS_Q * TILE_N; i++) out[i] = 0.0f;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; half++)
    for (int64_t b = 0; b < nb; b++) {
      const __m256i *wv = (const __m256i *)(t.w + b * TILE_N * QK) + 2 * half;
      const uint8_t *xq[TILE_ROWS_Q];
      for (int r = 0; r < TILE_ROWS_Q; r++) xq[r] = xr[r].q + b * QK;
      __m256i s[TILE_ROWS_Q][2];
      /* |w| times x with w's sign: pairs up to 2 x 128 x 127, into 32 bits each time; five-bit
       * values too (a block of them summed in 16 bits could reach 8 x 2 x 31 x 128) */
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
            s[r][0] =
                _mm256_add_epi32(s[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, x0), ones));
            s[r][1] =
                _mm256_add_epi32(s[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, x1), ones));
          }
        }
      } else { /* nibbles: a pair is at most 2 x 15 x 127, the block's eight at most 30,480: 16-bit
                  sums, widened once per block */
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
        __m256 f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][0]), _mm256_mul_ps(d0, scale),
                                    _mm256_loadu_ps(o));
        __m256 f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][1]), _mm256_mul_ps(d1, scale),
                                    _mm256_loadu_ps(o + 8));
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

/* out[r][j] = sum over blocks of (d_j dx_r isum + m_j sx_r), isum the integer product of row r's
 * block with feature j's, for r < TILE_ROWS_Q, j < TILE_N */
static void q_tile_rows(q_tile t, int64_t nb, int type, const x_row *xr, float *out) {
#if ROWS_VNNI
  __m512 f[TILE_ROWS_Q][2];
#pragma GCC unroll 8
  for (int r = 0; r < TILE_ROWS_Q; r++) f[r][0] = f[r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++) {
    const __m512i *wv = (const __m512i *)(t.w + b * TILE_N * QK);
    __m512i c0 = _mm512_loadu_si512(t.corr + b * TILE_N),
            c1 = _mm512_loadu_si512(t.corr + b * TILE_N + 16);
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
            isum += (int8_t)xr[r].q[b * QK + 4 * g + i] *
                    t.w[((b * (QK / 4) + g) * TILE_N + j) * 4 + i];
        total += (float)isum * (t.d[b * TILE_N + j] * xr[r].dx[b]);
        if (rows_have_min(type)) total += t.m[b * TILE_N + j] * xr[r].sx[b];
      }
      out[r * TILE_N + j] = total;
    }
#endif
}

/* y[r, o] = (tile's out) + b[o] for the n features of the tile at o0 and the rows r0 .. r0 + m - 1
 */
static void store_tile(const float *out, const float *b, float *y, int64_t r0, int64_t m,
                       int64_t o0, int64_t n, int64_t d_out) {
  for (int64_t r = 0; r < m; r++)
    for (int64_t j = 0; j < n; j++)
      y[(r0 + r) * d_out + o0 + j] = out[r * TILE_N + j] + (b ? b[o0 + j] : 0.0f);
}

/* the bytes of one laid-out float32 tile of d_in rows (tiles_f32.c) */
static int64_t f_tile_bytes(int64_t d_in) {
  return align64(d_in * TILE_N * (int64_t)sizeof(float));
}

/* The scratch bytes attnlab_linear_q_rows(_many) and attnlab_linear_f_rows need: the rounded rows,
 * and per thread one 8-bit tile or F_GROUP float32 ones. */
int64_t attnlab_linear_rows_scratch(int64_t rows, int64_t d_in, int threads) {
  int64_t rounded = align64(rows * x_row_bytes(d_in)), q = q_tile_bytes(d_in / QK);
  int64_t f = F_GROUP * f_tile_bytes(d_in);
  return rounded + threads * align64(q > f ? q : f);
}

/* Which of the two products run vectorised in this build: bit 0 attnlab_linear_q_rows (AVX-512 VNNI
 * or AVX2; otherwise a plain loop), bit 1 attnlab_linear_f_rows and the prompt attention on
 * AVX-512's or AVX2's FMA registers (F_TILES; otherwise whatever vectors the target has, where
 * callers keep torch's GEMM). */
int attnlab_linear_rows_vectorized(void) { return (ROWS_VNNI || ROWS_AVX2) | (F_TILES << 1); }

/* y_i [rows, d_out[i]] = x [rows, d_in] W_i^T + b_i for the n matrices W_i (blocks of type[i]; b_i
 * may be NULL), x rounded to 8 bits per block once for all of them (as attnlab_linear_q rounds it):
 * a layer's q, k and v, or its gate and up, share x. One parallel region; the threads share the
 * tiles of every matrix. scratch: attnlab_linear_rows_scratch bytes, 64-byte aligned. */
void attnlab_linear_q_rows_many(const float *x, int64_t n, const uint8_t *const *w,
                                const float *const *b, float *const *y, const int64_t *d_out,
                                const int32_t *type, int8_t *scratch, int64_t rows, int64_t d_in,
                                int threads) {
  int64_t nb = d_in / QK, per_row = x_row_bytes(d_in), tiles = 0;
  int64_t tile_bytes = align64(attnlab_linear_rows_scratch(0, d_in, 1));
  for (int64_t i = 0; i < n; i++) tiles += (d_out[i] + TILE_N - 1) / TILE_N;
#pragma omp parallel num_threads(threads)
  {
    int64_t thread = this_thread();
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
      x_row xr = x_row_at(scratch + r * per_row, d_in);
      for (int64_t k = 0; k < nb; k++)
        round_block(x + r * d_in + k * QK, xr.q + k * QK, xr.dx + k, xr.sx + k, xr.qs + k);
    }
    q_tile t = q_tile_at(scratch + align64(rows * per_row) + thread * tile_bytes, nb);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
      int64_t k = 0, o0 = i * TILE_N; /* matrix k, its tile at feature o0 */
      while (o0 >= (d_out[k] + TILE_N - 1) / TILE_N * TILE_N)
        o0 -= (d_out[k] + TILE_N - 1) / TILE_N * TILE_N, k++;
      int64_t features = d_out[k] - o0 < TILE_N ? d_out[k] - o0 : TILE_N;
      pack_q_tile(w[k], type[k], o0, features, nb, t);
      for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS_Q) {
        int64_t m = rows - r0 < TILE_ROWS_Q ? rows - r0 : TILE_ROWS_Q;
        x_row xr[TILE_ROWS_Q];
        /* rows past the last repeat row r0; their sums are dropped */
        for (int64_t r = 0; r < TILE_ROWS_Q; r++)
          xr[r] = x_row_at(scratch + (r0 + (r < m ? r : 0)) * per_row, d_in);
        float out[TILE_ROWS_Q * TILE_N];
        q_tile_rows(t, nb, type[k], xr, out);
        store_tile(out, b[k], y[k], r0, m, o0, features, d_out[k]);
      }
    }
  }
}

/* y [rows, d_out] = x [rows, d_in] W^T + b (b may be NULL), W in blocks of `type`:
 * attnlab_linear_q_rows_many for one matrix. */
void attnlab_linear_q_rows(const float *x, const uint8_t *w, const float *b, float *y,
                           int8_t *scratch, int64_t rows, int64_t d_in, int64_t d_out, int type,
                           int threads) {
  int32_t kind = type;
  attnlab_linear_q_rows_many(x, 1, &w, &b, &y, &d_out, &kind, scratch, rows, d_in, threads);
}
