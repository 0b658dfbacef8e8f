#include "common.h"
#include "vec.h"

/* The decode step's products with Q5_0 and the K-quants (common.h's block_q5_0, block_q4_K,
 * block_q5_K, block_q6_K, as ggml-common.h declares them; their values as ggml-quants.c's
 * dequantize_row_* and gguf-py's quants.py read them):
 *   Q5_0, 22 bytes per 32 weights: d, qh (32 high bits), 16 bytes of low nibbles;
 *     w = d (n - 16), n in 0..31
 *   Q4_K, 144 bytes per 256: d, dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of
 *     nibbles; sub-block s of 32: w = d sc_s n - dmin m_s, n in 0..15
 *   Q5_K, 176 bytes per 256: Q4_K's head, 32 bytes of high bits (bit s of byte j: weight j of
 *     sub-block s), 128 bytes of nibbles; w = d sc_s n - dmin m_s, n in 0..31
 *   Q6_K, 210 bytes per 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per
 *     16 weights), d; w = d sc (n - 32), n in 0..63
 * The products read the same 8-bit activation rows as Q8_0/Q4_0/Q4_1 (quants.c; one scale per 32
 * values), so a sub-block of 32 is one integer dot product (dpbusd or maddubs: unsigned n times
 * signed q, the offsets -16 and -32 folded into the lane sums' start as Q4_0's -8 is), times its
 * float scales. llama.cpp instead rounds the activations of a K-quant product to Q8_K (one scale
 * per 256) so that it can add a super-block's scaled integer sums before one float multiply; a
 * scale per 32 rounds less (the tests' bound is the same as for the 32-weight types), and
 * horizontal adds fold the eight sub-blocks' lane sums into one vector, so that the per-32 scales
 * still cost one FMA per block of 256 (dot4_q_k); Q5_0 folds the four rows of a pass the same way
 * (dot4_q5_0). The blocks' float32 values for a prompt's products: dequantize_more. */

/* sub-block j's 6-bit scale and min (j < 8) from a Q4_K / Q5_K block's 12 bytes: bytes 0-3 hold the
 * low six bits of scales 0-3, bytes 4-7 those of mins 0-3, bytes 8-11 the low four bits of scales
 * and mins 4-7, whose top two bits sit in the top two bits of bytes 0-7 (ggml-quants.c,
 * get_scale_min_k4) */
static inline void scale_min_k(const uint8_t *s, int j, int *sc, int *m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

/* the 32 unsigned values n of sub-block s of block p (type Q5_0: s = 0; K-quants: s < 8), in weight
 * order */
static inline void values_of(int type, const uint8_t *p, int s, uint8_t *n) {
  if (type == BLOCK_Q5_0) {
    const block_q5_0 *q5 = (const block_q5_0 *)p;
    uint32_t qh;
    memcpy(&qh, q5->qh, 4);
    for (int j = 0; j < QK / 2; j++) {
      n[j] = (uint8_t)((q5->qs[j] & 15) | ((qh >> j) & 1) << 4);
      n[j + QK / 2] = (uint8_t)((q5->qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
  } else if (type == BLOCK_Q6_K) { /* half h of the block, quarter t of that half */
    int h = s / 4, t = s % 4;
    const block_q6_K *q6 = (const block_q6_K *)p;
    const uint8_t *ql = q6->ql + 64 * h + 32 * (t & 1), *qh = q6->qh + 32 * h;
    for (int j = 0; j < QK; j++)
      n[j] = (uint8_t)(((ql[j] >> (4 * (t >> 1))) & 15) | ((qh[j] >> (2 * t)) & 3) << 4);
    /* Q4_K, Q5_K: sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32i .. 32i + 31 */
  } else {
    const block_q5_K *q5 = (const block_q5_K *)p;
    const uint8_t *qs = (type == BLOCK_Q5_K ? q5->qs : ((const block_q4_K *)p)->qs) + 32 * (s / 2);
    for (int j = 0; j < QK; j++) n[j] = (qs[j] >> (4 * (s & 1))) & 15;
    if (type == BLOCK_Q5_K)
      for (int j = 0; j < QK; j++) n[j] |= (uint8_t)(((q5->qh[j] >> s) & 1) << 4);
  }
}

#if defined(__AVX2__)
/* values_of in a register */
static inline __m256i values_of_256(int type, const uint8_t *p, int s) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if (type == BLOCK_Q5_0) { /* byte j takes bit j of qh */
    const block_q5_0 *q5 = (const block_q5_0 *)p;
    uint32_t qh;
    memcpy(&qh, q5->qh, 4);
#if AVX512 && defined(__AVX512VL__) /* qh is the mask of the bytes that get 16 */
    return _mm256_mask_add_epi8(nibbles32(q5->qs), (__mmask32)qh, nibbles32(q5->qs),
                                _mm256_set1_epi8(0x10));
#endif
    /* without AVX-512: qh's byte j / 8 to byte j, then a test of bit j % 8 */
    __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
    __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit),
                                    _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles32(q5->qs), high);
  }
  if (type == BLOCK_Q6_K) {
    int h = s / 4, t = s % 4;
    const block_q6_K *q6 = (const block_q6_K *)p;
    __m256i ql = _mm256_loadu_si256((const __m256i *)(q6->ql + 64 * h + 32 * (t & 1)));
    __m256i qh = _mm256_loadu_si256((const __m256i *)(q6->qh + 32 * h));
    __m256i low = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (t >> 1)), low4);
    /* bits 2t and 2t + 1 of each qh byte masked where they are, then moved to bits 4 and 5 by one
     * 16-bit shift (none for t = 2: a mask and an OR where a shift, a mask and a shift were), as
     * llama.cpp's AVX2 Q6_K product does (ggml-cpu/arch/x86/quants.c); the bits a shift carries
     * across bytes are masked zeros */
    __m256i bits = _mm256_and_si256(qh, _mm256_set1_epi8((char)(3 << (2 * t))));
    __m256i high = t < 2 ? _mm256_slli_epi16(bits, 4 - 2 * t) : _mm256_srli_epi16(bits, 2 * t - 4);
    return _mm256_or_si256(low, high);
  }
  const block_q5_K *q5 = (const block_q5_K *)p;
  const uint8_t *at = type == BLOCK_Q5_K ? q5->qs : ((const block_q4_K *)p)->qs;
  __m256i qs = _mm256_loadu_si256((const __m256i *)(at + 32 * (s / 2)));
  __m256i n = _mm256_and_si256(_mm256_srli_epi16(qs, 4 * (s & 1)), low4);
  if (type == BLOCK_Q5_K) {
    __m256i qh = _mm256_loadu_si256((const __m256i *)q5->qh);
#if AVX512 && defined(__AVX512VL__) /* the bytes whose bit s is set get 16 */
    return _mm256_mask_add_epi8(n, _mm256_test_epi8_mask(qh, _mm256_set1_epi8((char)(1 << s))), n,
                                _mm256_set1_epi8(0x10));
#endif
    n = _mm256_or_si256(
        n, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), _mm256_set1_epi8(1)), 4));
  }
  return n;
}
#endif

#if defined(__AVX2__)
/* s[k] = the product of Q5_0 rows w[k] (k < 4, nb blocks each) with the rounded row r: dot4_q's
 * pattern (x's bytes and -16 start loaded once for the four rows, their four d converted together)
 * with values_of_256's five-bit values */
#if AVX512 && defined(__AVX512VL__) && defined(__AVX512VNNI__)
/* dot4_q's 512-bit form for Q5_0: blocks b and b + 1 of a row in one masked 44-byte load; vpermw
 * puts [block b's 16 nibble bytes twice | block b + 1's twice] (words 3-10 and 14-21), the upper
 * copy of each shifted right by 4; the two blocks' 32-bit qh, read as integers, are the 64-bit byte
 * mask that adds 16. Lanes 0-7 of a row's sums are block b's, 8-15 block b + 1's; an odd last block
 * goes alone with masked loads (zeros in the other half). One weights' load of 64 bytes per row,
 * where a row's last blocks take a masked one. */
static inline void dot4_q5_0(const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[BLOCK_Q5_0];
  const __m512i take = _mm512_set_epi16(21, 20, 19, 18, 17, 16, 15, 14, 21, 20, 19, 18, 17, 16, 15,
                                        14, 10, 9, 8, 7, 6, 5, 4, 3, 10, 9, 8, 7, 6, 5, 4, 3);
  /* two rows' d: words 0 and 11 of each (blocks b and b + 1) */
  const __m512i heads = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 0, 0, 0, 0, 0, 0, 0, 32 + 11, 32, 11, 0);
  const __m512i shift = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0), low4 = _mm512_set1_epi8(0x0F);
  const __m512i sixteen = _mm512_set1_epi8(0x10);
  /* row k's d dx: lane 2k of the scales for block b, 2k + 1 for block b + 1 */
  const __m512i lane[4] = {_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                           _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2),
                           _mm512_set_epi32(5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),
                           _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6)};
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (int64_t b = 0; b < nb; b += 2) {
    const int two = b + 1 < nb;
    const __mmask64 row_mask = ((__mmask64)1 << (two ? 2 * bytes : bytes)) - 1;
    const __mmask16 half = two ? 0xFFFF : 0x00FF;
    /* plain loads where both blocks are there (a masked load also takes a vector ALU uop on
     * Sapphire Rapids) */
    __m512i xq =
        two ? _mm512_loadu_si512(r.q + b * QK) : _mm512_maskz_loadu_epi32(half, r.q + b * QK);
    __m512i start = _mm512_slli_epi32(two ? _mm512_loadu_si512(r.c8 + b * 8)
                                          : _mm512_maskz_loadu_epi32(half, r.c8 + b * 8),
                                      1); /* -16 sum q */
    __m512i row[4];
    if (b + 3 <= nb) /* 64 bytes stay inside the row (a masked load streamed slower) */
      for (int k = 0; k < 4; k++) row[k] = _mm512_loadu_si512(w[k] + b * bytes);
    else
      for (int k = 0; k < 4; k++) row[k] = _mm512_maskz_loadu_epi8(row_mask, w[k] + b * bytes);
    __m256 d = _mm256_cvtph_ps(_mm_unpacklo_epi64(
        _mm512_castsi512_si128(_mm512_permutex2var_epi16(row[0], heads, row[1])),
        _mm512_castsi512_si128(_mm512_permutex2var_epi16(row[2], heads, row[3]))));
    /* dx of blocks b and b + 1 (zero for a missing one), repeated for the four rows */
    __m256 dx = two ? _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(r.dx + b)))
                    : _mm256_blend_ps(_mm256_set1_ps(r.dx[b]), _mm256_setzero_ps(), 0xAA);
    __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(d, dx));
    for (int k = 0; k < 4; k++) {
      const uint8_t *p = w[k] + b * bytes;
      uint32_t h0, h1 = 0;
      memcpy(&h0, ((const block_q5_0 *)p)[0].qh, 4);
      if (two) memcpy(&h1, ((const block_q5_0 *)p)[1].qh, 4);
      __m512i v =
          _mm512_and_si512(_mm512_srlv_epi64(_mm512_permutexvar_epi16(take, row[k]), shift), low4);
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
    /* -16 sum q */
    __m256i start = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(r.c8 + b * 8)), 1);
    __m256i is[4];
    for (int k = 0; k < 4; k++)
      is[k] = DPBUSD(start, values_of_256(BLOCK_Q5_0, w[k] + b * bytes, 0), xq);
    __m256i folded =
        _mm256_hadd_epi32(_mm256_hadd_epi32(is[0], is[1]), _mm256_hadd_epi32(is[2], is[3]));
    __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(heads4(w, b * bytes), spread),
                                 _mm256_set1_ps(r.dx[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(folded), scale, acc);
  }
  _mm_storeu_ps(s, _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)));
}
#endif

/* Q4_K / Q5_K: a block's eight 6-bit scales (bytes 0-7) and mins (bytes 8-15) from its 12 bytes at
 * q (bytes 12-15 read but unused), as four 32-bit lanes of masks and shifts (scale_min_k's layout,
 * four at a time; llama.cpp unpacks them with the same masks in scalar code): with a = q's dwords,
 *   scales 0-3 = a0 & 3F..,  scales 4-7 = (a2 & 0F..) | ((a0 >> 6) & 03..) << 4,
 *   mins 0-3 = a1 & 3F..,    mins 4-7 = ((a2 >> 4) & 0F..) | ((a1 >> 6) & 03..) << 4 */
static inline __m128i scales_mins_k(const uint8_t *q) {
  __m128i a = _mm_loadu_si128((const __m128i *)q);
  __m128i low = _mm_shuffle_epi32(a, _MM_SHUFFLE(2, 1, 2, 0)); /* a0, a2, a1, a2 */
  __m128i high = _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 1, 0, 0)); /* -, a0, -, a1 */
  low = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                      _mm_setr_epi32(0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F));
  high = _mm_slli_epi32(
      _mm_and_si128(_mm_srli_epi32(high, 6), _mm_setr_epi32(0, 0x03030303, 0, 0x03030303)), 4);
  return _mm_or_si128(low, high);
}

/* s[k] = the product of K-quant rows w[k] (k < 4, nb sub-blocks of 32 each) with the rounded row r.
 * Per block of 256 and row: the eight sub-blocks' integer sums (dpbusd, eight lanes each) folded by
 * horizontal adds into one vector whose lane j is sub-block j's sum (Q6_K: its two halves first,
 * each times its int8 scale, in integers), then one FMA by the eight scales d sc_j dx_j (Q6_K: d
 * dx_j) and, for Q4_K / Q5_K, one by the mins dmin m_j sx_j; x's bytes are loaded once for the four
 * rows. (Converting, scaling and adding each sub-block's eight lanes alone cost four operations per
 * sub-block, where this fold costs about one: benchmarks/README.md.) */
static inline __attribute__((always_inline)) void dot4_q_k(int type, const uint8_t *const w[4],
                                                           q8_row r, int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[type];
  __m256 acc[4], mins[4];
  for (int k = 0; k < 4; k++) acc[k] = mins[k] = _mm256_setzero_ps();
  /* Q6_K's sixteen scales in the order of the folded halves: sub-blocks 0-3's first halves, then
   * their second */
  const __m128i halves = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int64_t at = b0 / 8 * bytes;
    __m256i xq[8], start[8];
    for (int j = 0; j < 8; j++) {
      xq[j] = _mm256_loadu_si256((const __m256i *)(r.q + (b0 + j) * QK));
      start[j] =
          type == BLOCK_Q6_K /* -32 times each lane's four q */
              ? _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(r.c8 + (b0 + j) * 8)), 2)
              : _mm256_setzero_si256();
    }
    __m256 dx = _mm256_loadu_ps(r.dx + b0);
#if DPBUSD_32
    /* Q4_K's odd sub-blocks (the high nibbles) taken as they are, 16 times their value, their
     * scales over 16 (exact, a power of two): a shift fewer per sub-block pair, the same products
     * bit for bit */
    if (type == BLOCK_Q4_K)
      dx = _mm256_mul_ps(
          dx, _mm256_setr_ps(1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f, 1.0f, 0.0625f));
#endif
    for (int k = 0; k < 4; k++) {
      const uint8_t *p = w[k] + at;
      const block_q4_K *q4 = (const block_q4_K *)p; /* Q5_K's d, dmin and scales too */
      const block_q6_K *q6 = (const block_q6_K *)p;
      __m256i is[8];
#if DPBUSD_32
      if (type == BLOCK_Q4_K)
        for (int i = 0; i < 4; i++) {
          __m256i qs = _mm256_loadu_si256((const __m256i *)(q4->qs + 32 * i));
          is[2 * i] = DPBUSD(start[2 * i], _mm256_and_si256(qs, _mm256_set1_epi8(0x0F)), xq[2 * i]);
          is[2 * i + 1] = DPBUSD(start[2 * i + 1],
                                 _mm256_and_si256(qs, _mm256_set1_epi8((char)0xF0)), xq[2 * i + 1]);
        }
      else
#endif
        for (int j = 0; j < 8; j++) is[j] = DPBUSD(start[j], values_of_256(type, p, j), xq[j]);
      /* lanes 0-3: sub-blocks 0-3's (or 4-7's) weights 0-15, lanes 4-7: their weights 16-31 */
      __m256i a =
          _mm256_hadd_epi32(_mm256_hadd_epi32(is[0], is[1]), _mm256_hadd_epi32(is[2], is[3]));
      __m256i c =
          _mm256_hadd_epi32(_mm256_hadd_epi32(is[4], is[5]), _mm256_hadd_epi32(is[6], is[7]));
      __m256 scale;
      if (type == BLOCK_Q6_K) {
        __m128i sc = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)q6->scales), halves);
        a = _mm256_mullo_epi32(a, _mm256_cvtepi8_epi32(sc));
        c = _mm256_mullo_epi32(c, _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)));
        scale = _mm256_mul_ps(_mm256_set1_ps(half_at(&q6->d)), dx);
      } else {
        __m128i smv = scales_mins_k(q4->scales);
        scale = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(smv)),
                                            _mm256_set1_ps(half_at(&q4->d))),
                              dx);
        __m256 dm = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(smv, 8))),
                                  _mm256_set1_ps(half_at(&q4->dmin)));
        mins[k] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(r.sx + b0), mins[k]);
      }
      __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(a, c, 0x20),
                                      _mm256_permute2x128_si256(a, c, 0x31));
      acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[k]);
    }
  }
  for (int k = 0; k < 4; k++) acc[k] = _mm256_sub_ps(acc[k], mins[k]);
  _mm_storeu_ps(s, sum4_256(acc[0], acc[1], acc[2], acc[3]));
}

/* s[k] = the product of rows w[k] (k < 4) of `type` (Q5_0 or a K-quant; nb sub-blocks of 32) with
 * the rounded row r */
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
/* The product of one row of blocks w of `type` (Q5_0 or a K-quant; nb sub-blocks of 32) with the
 * rounded row r: the integer sums of each sub-block in plain C */
static float dot_q_more(int type, const uint8_t *w, q8_row r, int64_t nb) {
  int per = type == BLOCK_Q5_0 ? 1 : 8; /* sub-blocks of 32 per block */
  int64_t bytes = BLOCK_BYTES[type];
  float total = 0.0f;
  for (int64_t b0 = 0; b0 < nb; b0 += per) {
    const uint8_t *p = w + b0 / per * bytes;
    const block_q4_K *q4 = (const block_q4_K *)p; /* Q5_K's d, dmin and scales too */
    const block_q6_K *q6 = (const block_q6_K *)p;
    float d = half_at(type == BLOCK_Q6_K ? &q6->d : &q4->d); /* (Q5_0's d is first too) */
    for (int s = 0; s < per; s++) {
      int64_t b = b0 + s;
      const int8_t *q = r.q + b * QK;
      uint8_t n[QK];
      values_of(type, p, s, n);
      int32_t lo = 0, hi = 0, start = 0;
      for (int j = 0; j < QK / 2; j++) lo += n[j] * q[j], hi += n[j + QK / 2] * q[j + QK / 2];
      if (type == BLOCK_Q6_K) { /* its two int8 scales of 16 weights each */
        const int8_t *sc6 = q6->scales + 2 * s;
        for (int l = 0; l < 4; l++) lo += 4 * r.c8[b * 8 + l], hi += 4 * r.c8[b * 8 + 4 + l];
        total += d * r.dx[b] * (float)(sc6[0] * lo + sc6[1] * hi);
      } else if (type == BLOCK_Q5_0) {
        for (int l = 0; l < 8; l++) start += 2 * r.c8[b * 8 + l];
        total += d * r.dx[b] * (float)(lo + hi + start);
      } else {
        int sc, m;
        scale_min_k(q4->scales, s, &sc, &m);
        total +=
            d * (float)sc * r.dx[b] * (float)(lo + hi) - half_at(&q4->dmin) * (float)m * r.sx[b];
      }
    }
  }
  return total;
}

static void dot4_q_more(int type, const uint8_t *const w[4], q8_row r, int64_t nb, float *s) {
  for (int k = 0; k < 4; k++) s[k] = dot_q_more(type, w[k], r, nb);
}
#endif

/* out [32 per sub-block] = the float32 values of one block of `type` (Q5_0 or a K-quant), in
 * gguf-py's order of float operations (d sc computed first, then times n, then minus dmin m), so
 * equal to it bit for bit: d sc and dmin m are exact in float32, and so is d sc n but in Q6_K (one
 * rounding there, as gguf-py's) */
static void dequantize_more(int type, const uint8_t *p, float *out) {
  int per = type == BLOCK_Q5_0 ? 1 : 8;
  const block_q4_K *q4 = (const block_q4_K *)p; /* Q5_K's d, dmin and scales too */
  const block_q6_K *q6 = (const block_q6_K *)p;
  float d = half_at(type == BLOCK_Q6_K ? &q6->d : &q4->d); /* (Q5_0's d is first too) */
  for (int s = 0; s < per; s++) {
    uint8_t n[QK];
    values_of(type, p, s, n);
    float *o = out + s * QK;
    if (type == BLOCK_Q5_0) {
      for (int j = 0; j < QK; j++) o[j] = d * (float)(n[j] - 16);
    } else if (type == BLOCK_Q6_K) {
      const int8_t *sc = q6->scales + 2 * s;
      float d0 = d * (float)sc[0], d1 = d * (float)sc[1];
      for (int j = 0; j < QK / 2; j++) o[j] = d0 * (float)(n[j] - 32);
      for (int j = QK / 2; j < QK; j++) o[j] = d1 * (float)(n[j] - 32);
    } else {
      int sc, m;
      scale_min_k(q4->scales, s, &sc, &m);
      float ds = d * (float)sc, dm = half_at(&q4->dmin) * (float)m;
      for (int j = 0; j < QK; j++) o[j] = ds * (float)n[j] - dm;
    }
  }
}
