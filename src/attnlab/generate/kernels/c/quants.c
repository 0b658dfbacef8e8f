/* The decode step's products with weights in ggml's blocks (attnlab.quant.blocks): 32 weights
 * of a row per block with a float16 scale d (and, in Q4_1, a float16 offset m). As in llama.cpp
 * (ggml-cpu's quants.c, ggml_vec_dot_q4_0_q8_0 and its siblings), each row of x is first rounded to
 * 8 bits per block of 32 (q8: a float scale dx = max|x| / 127 and q = round(x / dx)), so that a
 * block's product is an integer dot product and one multiply by the two scales:
 *   Q8_0: d dx sum q_w q_x
 *   Q4_0: d dx sum (n - 8) q_x
 *   Q4_1: d dx sum n q_x + m dx sum q_x
 * Each |x - dx q| <= dx / 2, so a product moves by at most sum over blocks of dx / 2 sum |w| (the
 * tests' bound). The integer dot product: AVX-512 VNNI's dpbusd (unsigned 8-bit times signed 8-bit,
 * four products added into each 32-bit lane) where the compiler targets it, AVX2's maddubs + madd
 * otherwise, NEON on AArch64 (vdotq with the dot-product instructions), a plain loop anywhere else;
 * which one is fixed by the build. Q8_0's signed weights
 * take the sign trick (|w| times x with w's sign). Q4_0's -8 is folded into the lane sums' start
 * (-8 times each lane's four q_x, made once per row of x), Q4_1's m term uses the row's dx sum q_x
 * per block. Q5_0 and the K-quants: quants_k.c; the 16-row layout: repack.c; the loop over a
 * thread's rows: linear_q.c. */
#include "common.h"
#include "vec.h"

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
    for (int l = 0; l < 8; l++)
      r.c8[b * 8 + l] = -8 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
#if AVX512 && defined(__AVX512VNNI__) /* only the two-block products read them */
    r.ds[2 * b] = r.dx[b];
    r.ds[2 * b + 1] = r.sx[b];
    for (int l = 0; l < 8; l++) r.c16[b * 8 + l] = r.c8[b * 8 + l] * (l < 4 ? 1 : 16);
#endif
  }
}

#if AVX512 && defined(__AVX512VNNI__)
/* Two blocks per step in 512-bit vectors (AVX-512 with VNNI): each weight row's two blocks come in
 * one (masked) load, which also holds their d (and Q4_1's m); one word permute (vpermw) lays their
 * bytes out as dpbusd reads them, so that one dpbusd, one conversion and one FMA serve 64 weights
 * of a row where the 256-bit loop spends them on 32, and the four rows' scales come out of those
 * loads by three permutes instead of eight scalar loads (the 256-bit loop's compute took most of a
 * product's streamed time: benchmarks/README.md, issue 25).
 *   Q4_0 / Q4_1: the 36 / 40 bytes of blocks b and b + 1 are words 0..17 / 0..19 of the load;
 *     vpermw gives [block b's 16 nibble bytes twice | block b + 1's twice], then the upper copy of
 *     each is shifted right by 4 (weights 0-15 in the low nibbles, 16-31 in the high), so that the
 *     64 bytes are the two blocks' 4-bit values in weight order, opposite x's 64 bytes.
 *   Q8_0: 68 bytes, one 64-byte load (d, q of block b, d of b + 1, most of its q) and one of
 *     b + 1's 32 q bytes; a two-source word permute puts the 64 q bytes together; dpbusd multiplies
 *     unsigned by signed bytes, so the weights go in as q + 128 (xor 0x80) and the lane sums start
 *     at -128 times x's sums of four, 16 c8.
 * A row's last block, when nb is odd, goes alone through the same steps with masked loads (the
 * missing block's bytes, x, scales read as zeros). Lanes 0-7 of a row's sums are block b's, 8-15
 * block b + 1's. */
typedef struct {
  __m512i take, heads, nibble, lane[4];
} q_consts;

/* blocks b and b + 1 (b alone when !two) of rows w[0..3] into acc (and Q4_1's m_sum); `full`: both
 * blocks there and 64 bytes readable from each row's block b, so that every load is a plain one (on
 * Sapphire Rapids a masked load also takes a vector ALU uop, and a pass has ten of them) */
static inline __attribute__((always_inline)) void pair_q(int type, const uint8_t *const w[4],
                                                         q8_row r, int64_t b, int two, int full,
                                                         const q_consts *c, __m512 acc[4],
                                                         __m512 *m_sum) {
  const int64_t bytes = BLOCK_BYTES[type];
  const __mmask64 row_mask = two ? (bytes >= 32 ? ~(__mmask64)0 : ((__mmask64)1 << (2 * bytes)) - 1)
                                 : ((__mmask64)1 << bytes) - 1;
  const __mmask16 half = two ? 0xFFFF : 0x00FF;
  __m512i xq =
      full ? _mm512_loadu_si512(r.q + b * QK) : _mm512_maskz_loadu_epi32(half, r.q + b * QK);
  /* the lane sums' start: Q4_0's -8 per group of four x (c8; -128 in the lanes of high nibbles,
   * which come 16 times their value), Q8_0's -128 (16 c8), none for Q4_1 */
  const int32_t *c8 = type == BLOCK_Q4_0 ? r.c16 : r.c8;
  __m512i start = type == BLOCK_Q4_1 ? _mm512_setzero_si512()
                  : full             ? _mm512_loadu_si512(c8 + b * 8)
                                     : _mm512_maskz_loadu_epi32(half, c8 + b * 8);
  __m512i row[4], v[4];
  for (int k = 0; k < 4; k++)
    row[k] = full ? _mm512_loadu_si512(w[k] + b * bytes)
                  : _mm512_maskz_loadu_epi8(row_mask, w[k] + b * bytes);
  if (type == BLOCK_Q8_0) {
    start = _mm512_slli_epi32(start, 4);
    for (int k = 0; k < 4; k++) {
      const int8_t *q = ((const block_q8_0 *)w[k])[b + 1].qs;
      __m512i next = _mm512_castsi256_si512(full ? _mm256_loadu_si256((const __m256i *)q)
                                                 : _mm256_maskz_loadu_epi32(two ? 0xFF : 0x00, q));
      v[k] = _mm512_xor_si512(_mm512_permutex2var_epi16(row[k], c->take, next),
                              _mm512_set1_epi8((char)0x80));
    }
  } else {
    for (int k = 0; k < 4; k++)
      v[k] = _mm512_and_si512(_mm512_permutexvar_epi16(c->take, row[k]), c->nibble);
  }
  /* d (m) of both blocks, four rows: [d0 m0 d0' m0' d1 m1 d1' m1' ...] (' block b + 1) */
  __m256i dm16 = _mm256_inserti128_si256(
      _mm512_castsi512_si256(_mm512_permutex2var_epi16(row[0], c->heads, row[1])),
      _mm512_castsi512_si128(_mm512_permutex2var_epi16(row[2], c->heads, row[3])), 1);
  __m512 dm = _mm512_cvtph_ps(dm16);
  /* dx sx dx' sx' */
  __m128 ds = full ? _mm_loadu_ps(r.ds + 2 * b) : _mm_maskz_loadu_ps(two ? 15 : 3, r.ds + 2 * b);
  /* d dx, m sx, d' dx', m' sx', four rows */
  __m512 scale = _mm512_mul_ps(dm, _mm512_broadcast_f32x4(ds));
  if (type == BLOCK_Q4_1) *m_sum = _mm512_add_ps(*m_sum, scale);
  /* the scales of the high nibbles' lanes divided by 16 (exact: a power of two), so that the FMA's
   * product is the one of the integer sum that the low nibbles' shift would have given, bit for bit
   */
  __m512 scale16 = type == BLOCK_Q8_0 ? scale : _mm512_mul_ps(scale, _mm512_set1_ps(1.0f / 16.0f));
  for (int k = 0; k < 4; k++)
    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, v[k], xq)),
                             _mm512_permutex2var_ps(scale, c->lane[k], scale16), acc[k]);
}

static inline __attribute__((always_inline)) void dot4_q(int type, const uint8_t *const w[4],
                                                         q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[type];
  const int h = (int)bytes / 2; /* the word where block b + 1 begins */
  /* the word where block b's values begin */
  const int at =
      (int)(type == BLOCK_Q4_1 ? offsetof(block_q4_1, qs) : offsetof(block_q4_0, qs)) / 2;
  q_consts c;
  /* vpermw: [values of b (8 words) twice | values of b + 1 twice]; Q8_0: its 32 words of q, b then
   * b + 1 */
  c.take = type == BLOCK_Q8_0
               ? _mm512_set_epi16(47, 46, 45, 44, 43, 42, 41, 40, 39, 38, 37, 36, 35, 34, 33, 32,
                                  16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1)
               : _mm512_set_epi16(h + at + 7, h + at + 6, h + at + 5, h + at + 4, h + at + 3,
                                  h + at + 2, h + at + 1, h + at, h + at + 7, h + at + 6,
                                  h + at + 5, h + at + 4, h + at + 3, h + at + 2, h + at + 1,
                                  h + at, at + 7, at + 6, at + 5, at + 4, at + 3, at + 2, at + 1,
                                  at, at + 7, at + 6, at + 5, at + 4, at + 3, at + 2, at + 1, at);
  /* two rows' heads: words 0, 1, h, h + 1 of each (d, m of block b, then of b + 1) */
  c.heads = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                             32 + h + 1, 32 + h, 33, 32, h + 1, h, 1, 0);
  /* the 4-bit values without a shift: the low nibbles of the first copy of each block's bytes
   * (weights 0-15), the high nibbles of the second as they are, 16 times their value (weights
   * 16-31; at most 240 x 127 x 4 in a lane) */
  c.nibble = _mm512_set_epi64(-0x0F0F0F0F0F0F0F10, -0x0F0F0F0F0F0F0F10, 0x0F0F0F0F0F0F0F0F,
                              0x0F0F0F0F0F0F0F0F, -0x0F0F0F0F0F0F0F10, -0x0F0F0F0F0F0F0F10,
                              0x0F0F0F0F0F0F0F0F, 0x0F0F0F0F0F0F0F0F);
  /* row k's scale d dx: lane 4k of the heads' products for block b, 4k + 2 for block b + 1; the
   * high nibbles' lanes (Q4_0, Q4_1) from the scales divided by 16 (indices 16 on) */
  const int hi = type == BLOCK_Q8_0 ? 0 : 16;
  for (int k = 0; k < 4; k++)
    c.lane[k] = _mm512_set_epi32(hi + 4 * k + 2, hi + 4 * k + 2, hi + 4 * k + 2, hi + 4 * k + 2,
                                 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2, hi + 4 * k, hi + 4 * k,
                                 hi + 4 * k, hi + 4 * k, 4 * k, 4 * k, 4 * k, 4 * k);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  __m512 m_sum = _mm512_setzero_ps(); /* Q4_1: m sx in lanes 4k + 1 and 4k + 3 */
  int64_t b = 0;
  for (; b + 1 < nb && b * bytes + 64 <= nb * bytes; b += 2)
    pair_q(type, w, r, b, 1, 1, &c, acc, &m_sum);
  for (; b < nb; b += 2) pair_q(type, w, r, b, b + 1 < nb, 0, &c, acc, &m_sum);
  _mm_storeu_ps(s, sum4(acc[0], acc[1], acc[2], acc[3]));
  if (type == BLOCK_Q4_1) {
    float m[16];
    _mm512_storeu_ps(m, m_sum);
    for (int k = 0; k < 4; k++) s[k] += m[4 * k + 1] + m[4 * k + 3];
  }
}
#else
/* sum q_w q_x over one block (Q8_0), or sum n q_x (Q4_0 without its -8, Q4_1): integers, exact, so
 * every form gives the same sum. NEON (AArch64): vdotq's four products into each 32-bit lane where
 * the CPU has the dot-product instructions (as llama.cpp's ggml_vec_dot_q8_0_q8_0 on ARM), widening
 * products and pairwise sums otherwise; a plain loop anywhere else. */
static inline int32_t block_isum(int type, const uint8_t *p, const int8_t *q) {
#if defined(__ARM_NEON) && defined(__aarch64__)
  int8x16_t w0, w1;
  if (type == BLOCK_Q8_0) {
    w0 = vld1q_s8(((const block_q8_0 *)p)->qs), w1 = vld1q_s8(((const block_q8_0 *)p)->qs + 16);
  } else { /* weights j and j + 16 in byte j's low and high nibbles */
    uint8x16_t n =
        vld1q_u8(type == BLOCK_Q4_1 ? ((const block_q4_1 *)p)->qs : ((const block_q4_0 *)p)->qs);
    w0 = vreinterpretq_s8_u8(vandq_u8(n, vdupq_n_u8(15))),
    w1 = vreinterpretq_s8_u8(vshrq_n_u8(n, 4));
  }
  int8x16_t x0 = vld1q_s8(q), x1 = vld1q_s8(q + 16);
#if defined(__ARM_FEATURE_DOTPROD)
  return vaddvq_s32(vdotq_s32(vdotq_s32(vdupq_n_s32(0), w0, x0), w1, x1));
#else
  int16x8_t lo =
      vmlal_s8(vmull_s8(vget_low_s8(w0), vget_low_s8(x0)), vget_low_s8(w1), vget_low_s8(x1));
  int16x8_t hi = vmlal_high_s8(vmull_high_s8(w0, x0), w1, x1); /* |sum| <= 2 * 128 * 127: fits */
  return vaddvq_s32(vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
#else
  int32_t isum = 0;
  if (type == BLOCK_Q8_0) {
    for (int j = 0; j < QK; j++) isum += ((const block_q8_0 *)p)->qs[j] * q[j];
  } else {
    const uint8_t *n =
        type == BLOCK_Q4_1 ? ((const block_q4_1 *)p)->qs : ((const block_q4_0 *)p)->qs;
    for (int j = 0; j < QK / 2; j++) isum += (n[j] & 15) * q[j] + (n[j] >> 4) * q[j + 16];
  }
  return isum;
#endif
}

/* s[k] = the product of block rows w[k] (k < 4, nb blocks each) with the rounded row r of x */
static inline __attribute__((always_inline)) void dot4_q(int type, const uint8_t *const w[4],
                                                         q8_row r, int64_t nb, float *s) {
  int64_t bytes = BLOCK_BYTES[type];
#if defined(__AVX2__)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  __m256 m_sum = _mm256_setzero_ps(); /* Q4_1: m_k sx summed in lane 2k + 1 */
  /* the four rows' scales (and Q4_1's offsets) come together: the first dword of each row's block
   * (d, then m) in one gather, eight halves converted at once, each row's d dx spread over its
   * vector by one permute; one scalar conversion and broadcast per row and block before, which made
   * the 4-bit kernels compute-bound */
  const __m256i lane[4] = {_mm256_set1_epi32(0), _mm256_set1_epi32(2), _mm256_set1_epi32(4),
                           _mm256_set1_epi32(6)};
  for (int64_t b = 0; b < nb; b++) {
    __m256i xq = _mm256_loadu_si256((const __m256i *)(r.q + b * QK));
    /* d_k dx in lane 2k */
    __m256 dm = heads4(w, b * bytes), scale = _mm256_mul_ps(dm, _mm256_set1_ps(r.dx[b]));
    __m256i isum[4];
    if (type == BLOCK_Q8_0) {
      for (int k = 0; k < 4; k++) {
        __m256i wq = _mm256_loadu_si256((const __m256i *)((const block_q8_0 *)w[k])[b].qs);
        isum[k] =
            DPBUSD(_mm256_setzero_si256(), _mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
      }
    } else if (type == BLOCK_Q4_0) {
      __m256i start = _mm256_loadu_si256((const __m256i *)(r.c8 + b * 8));
      for (int k = 0; k < 4; k++)
        isum[k] = DPBUSD(start, nibbles32(((const block_q4_0 *)w[k])[b].qs), xq);
    } else {
      for (int k = 0; k < 4; k++)
        isum[k] = DPBUSD(_mm256_setzero_si256(), nibbles32(((const block_q4_1 *)w[k])[b].qs), xq);
      m_sum = _mm256_fmadd_ps(dm, _mm256_set1_ps(r.sx[b]), m_sum);
    }
    for (int k = 0; k < 4; k++)
      acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[k]),
                               _mm256_permutevar8x32_ps(scale, lane[k]), acc[k]);
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
      const block_q4_1 *p41 = (const block_q4_1 *)p; /* (d comes first in all three) */
      int32_t isum = block_isum(type, p, r.q + b * QK);
      if (type == BLOCK_Q4_0)
        for (int l = 0; l < 8; l++) isum += r.c8[b * 8 + l];
      total += half_at(&p41->d) * r.dx[b] * (float)isum;
      if (type == BLOCK_Q4_1) total += half_at(&p41->m) * r.sx[b];
    }
    s[k] = total;
  }
#endif
}

#endif /* two blocks per step in 512-bit vectors */
