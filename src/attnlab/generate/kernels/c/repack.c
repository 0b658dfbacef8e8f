#include "common.h"
#include "vec.h"

/* The 16-row decode layout and its products: sixteen rows interleaved, the decode layout of Q4_0,
 * Q4_1, Q8_0 and Q5_0 (Q4_K's below; after llama.cpp's repacked AMX/VNNI layout,
 * ggml-cpu/amx/mmq.cpp, and ggml-cpu's repack.cpp, where one 512-bit lane holds one output row).
 * The same blocks, bit for bit, rearranged for the decode step's products: rows come in groups of
 * 16 (d_out a multiple of 16); a group's blocks follow each other, and block b of the group holds,
 * in order,
 *   its quants in 64-byte chunks j (4 for Q4_0 / Q4_1, 8 for Q8_0), bytes 4n .. 4n + 3 of chunk j
 *     being row n's quant bytes 4j .. 4j + 3 (Q4: the low nibbles weights 4j .. 4j + 3, the high
 *     ones 16 + 4j ..; Q8_0: weights 4j .. 4j + 3);
 *   the 16 rows' d (IEEE halves), then Q4_1's 16 m;
 * so 16 x (18 | 20 | 34) bytes, as many as the 16 rows' blocks. Q5_0 the same way (22 bytes: d,
 * then the 32-bit qh of the fifth bits, then 16 nibble bytes): its chunk 0 holds the 16 rows' qh
 * (lane n: row n's), chunks 1-4 the nibbles as Q4_0's, then the d's. A product then multiplies 16
 * rows at once by x's four bytes broadcast to every lane (one dpbusd per 64 weights of 16 rows, no
 * permute), and scales 16 rows with one conversion of 16 halves and one FMA per block: the decode
 * step runs faster than on the file's layout (benchmarks/README.md, "The idle run on the Intel
 * Xeon"). */

/* Q4_K's super-blocks of 16 rows the same way, 16 x 144 = 2304 bytes per super-block of the group:
 *   its 128 quant bytes in 32 chunks of 64 bytes j, bytes 4n .. 4n + 3 of chunk j being row n's
 *     quant bytes 4j .. 4j + 3 (chunks 8i .. 8i + 7: sub-block 2i in the low nibbles, 2i + 1 in
 *     the high ones);
 *   the 16 rows' d, then their 16 dmin (IEEE halves);
 *   the 12 bytes of scales and mins as three 64-byte vectors k, bytes 4n .. 4n + 3 of vector k
 *     being row n's bytes 4k .. 4k + 3: scales_mins_k's dwords a0, a1, a2, one row a lane, so that
 *     the masks and shifts that unpack one row's eight scales and mins there unpack sixteen rows'
 *     here (dot16_q_k). */
/* bytes of a 16-row group's blocks that the AVX2 products pass over twice (rows 0-7, then 8-15)
 * before going on: their second pass finds them in the level-1 cache */
#define HALVES_TILE 8192
#define Q4_K_QUANTS (GROUP * 128)
#define Q4_K_SCALES (Q4_K_QUANTS + 2 * 2 * GROUP) /* after the quants, the d's and the dmin's */

/* out = w (d_out rows of d_in weights in blocks of `type`: Q8_0, Q4_0, Q4_1, Q5_0 or Q4_K; d_out a
 * multiple of 16) in the 16-row layouts above. */
void attnlab_repack16(const uint8_t *w, uint8_t *out, int64_t d_out, int64_t d_in, int type) {
  int64_t bytes = BLOCK_BYTES[type], nb = d_in / BLOCK_WEIGHTS[type], row_bytes = nb * bytes;
  int64_t head = head_bytes(type), quant_bytes = bytes - head;
#pragma omp parallel for schedule(static) if (d_out * d_in > 65536)
  for (int64_t g = 0; g < d_out / GROUP; g++)
    for (int64_t b = 0; b < nb; b++) {
      uint8_t *o = out + (g * nb + b) * GROUP * bytes;
      for (int64_t n = 0; n < GROUP; n++) {
        const uint8_t *src = w + (g * GROUP + n) * row_bytes + b * bytes;
        if (type == BLOCK_Q4_K) {
          const block_q4_K *q4 = (const block_q4_K *)src;
          for (int64_t j = 0; j < 32; j++) memcpy(o + j * 64 + 4 * n, q4->qs + 4 * j, 4);
          memcpy(o + Q4_K_QUANTS + 2 * n, &q4->d, 2);
          memcpy(o + Q4_K_QUANTS + 2 * GROUP + 2 * n, &q4->dmin, 2);
          for (int64_t k = 0; k < 3; k++)
            memcpy(o + Q4_K_SCALES + 64 * k + 4 * n, q4->scales + 4 * k, 4);
          continue;
        }
        for (int64_t j = 0; j < quant_bytes / 4; j++)
          memcpy(o + j * 64 + 4 * n, src + head + 4 * j, 4);
        memcpy(o + GROUP * quant_bytes + 2 * n, &((const block_q4_1 *)src)->d, 2); /* d first */
        if (type == BLOCK_Q4_1)
          memcpy(o + GROUP * quant_bytes + 32 + 2 * n, &((const block_q4_1 *)src)->m, 2);
      }
    }
}

/* The lane sums' start: `offset` times the sum of a block's 32 rounded x (r.sq): Q4_0's -8, Q5_0's
 * -16, Q8_0's -128 (weights taken as q + 128), none for Q4_1. */
static inline int32_t dot16_offset(int type) {
  return type == BLOCK_Q4_0 ? -8 : type == BLOCK_Q5_0 ? -16 : type == BLOCK_Q8_0 ? -128 : 0;
}

/* dot16_q a lane at a time: the portable build's (for tests), and the AVX2 build's Q5_0 (which
 * generation does not repack there: attnlab_repack16_vectorised) */
static __attribute__((unused)) void dot16_lanes(int type, const uint8_t *g, q8_row r, int64_t nb,
                                                float *s) {
  const int64_t bytes = BLOCK_BYTES[type], step = GROUP * bytes,
                quant = GROUP * (bytes - head_bytes(type));
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
      acc[n] += (float)sum * (half_at(g + quant + 2 * n) * r.dx[b]);
      if (type == BLOCK_Q4_1) m_acc[n] += half_at(g + quant + 32 + 2 * n) * r.sx[b];
    }
  }
  for (int n = 0; n < GROUP; n++) s[n] = acc[n] + m_acc[n];
}

/* s[n] = the product of row n of a 16-row group (its nb blocks at g) with the rounded row r of x, a
 * block's lane sums starting at dot16_offset(type) times r.sq. */
static inline __attribute__((always_inline)) void dot16_q(int type, const uint8_t *g, q8_row r,
                                                          int64_t nb, float *s) {
  const int64_t bytes = BLOCK_BYTES[type], step = GROUP * bytes,
                quant = GROUP * (bytes - head_bytes(type));
  const int32_t offset = dot16_offset(type);
#if AVX512 && defined(__AVX512VNNI__)
  const __m512i low4 = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
  __m512 acc = _mm512_setzero_ps(), m_acc = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; b++, g += step) {
    /* x's weights 4i .. 4i + 3 as one 32-bit value */
    const int32_t *xq = (const int32_t *)(r.q + b * QK);
    __m512i sum = _mm512_set1_epi32(offset * r.sq[b]);
    /* dpbusd multiplies unsigned by signed bytes: the weights go in as q + 128 */
    if (type == BLOCK_Q8_0) {
      for (int j = 0; j < 8; j++)
        sum = _mm512_dpbusd_epi32(
            sum, _mm512_xor_si512(_mm512_loadu_si512((const void *)(g + 64 * j)), flip),
            _mm512_set1_epi32(xq[j]));
    } else if (type == BLOCK_Q5_0) {
      /* n + 16 x (fifth bit) in 0..31, the fifth bits of byte 4n + i of chunk j (row n's weights 4j
       * + i and 16 + 4j + i) being bits 4j + i and 16 + 4j + i of row n's qh: vpshufb copies the qh
       * byte that holds them (j / 2, and 2 + j / 2) to the lane's four bytes, a byte test against 1
       * << (4 (j % 2) + i) makes the mask of the 16s to add */
      const __m512i qh = _mm512_loadu_si512((const void *)g), sixteen = _mm512_set1_epi8(16);
      /* vpshufb indexes within 128-bit lanes, four rows each: row m's qh bytes are 4m .. 4m + 3
       * there */
      const __m512i rows = _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C,
                                            0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808,
                                            0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
      __m512i high = _mm512_setzero_si512();
      for (int j = 0; j < 4; j++) {
        const __m512i bits = _mm512_set1_epi32((int)(0x08040201u << (4 * (j % 2))));
        const __m512i lo_bits =
            _mm512_shuffle_epi8(qh, _mm512_add_epi8(rows, _mm512_set1_epi8((char)(j / 2))));
        const __m512i hi_bits =
            _mm512_shuffle_epi8(qh, _mm512_add_epi8(rows, _mm512_set1_epi8((char)(2 + j / 2))));
        __m512i v = _mm512_loadu_si512((const void *)(g + 64 * (j + 1)));
        __m512i lo = _mm512_and_si512(v, low4),
                hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(lo_bits, bits), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(hi_bits, bits), hi, sixteen);
        sum = _mm512_dpbusd_epi32(sum, lo, _mm512_set1_epi32(xq[j]));
        high = _mm512_dpbusd_epi32(high, hi, _mm512_set1_epi32(xq[4 + j]));
      }
      sum = _mm512_add_epi32(sum, high);
    } else {
      /* the high nibbles as they are (16 times their value, at most 4 x 240 x 127 per dpbusd):
       * their sums apart, divided by 16 (exactly: a multiple of 16) once per block, a shift fewer
       * per 64 bytes */
      __m512i high = _mm512_setzero_si512();
      for (int j = 0; j < 4; j++) {
        __m512i v = _mm512_loadu_si512((const void *)(g + 64 * j));
        sum = _mm512_dpbusd_epi32(sum, _mm512_and_si512(v, low4), _mm512_set1_epi32(xq[j]));
        high =
            _mm512_dpbusd_epi32(high, _mm512_andnot_si512(low4, v), _mm512_set1_epi32(xq[4 + j]));
      }
      sum = _mm512_add_epi32(sum, _mm512_srai_epi32(high, 4));
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + quant)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(r.dx[b])), acc);
    if (type == BLOCK_Q4_1)
      m_acc =
          _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + quant + 32))),
                          _mm512_set1_ps(r.sx[b]), m_acc);
  }
  _mm512_storeu_ps(s, _mm512_add_ps(acc, m_acc));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  if (type == BLOCK_Q5_0) {
    dot16_lanes(type, g, r, nb, s);
    return;
  }
  /* 256 bits: rows 0-7 in the low half of each 64-byte chunk, 8-15 in the high half, each half a
   * pass over HALVES_TILE bytes of blocks at a time (so that the second pass reads them from the
   * level-1 cache: two passes over a whole group of 16 rows read it twice from level 2, and
   * streamed slower than the file's layout); u8 x s8 pairs
   * into 16 bits (maddubs), then pairs of those into 32 (madd). Q4: a pair is at most 2 x 15 x 127,
   * so the eight of a block's chunks and nibble halves add in 16 bits (at most 30,480) before one
   * madd. Q8_0: |w| times x with w's sign (maddubs' first operand is unsigned): at most 2 x 128 x
   * 127, one madd per chunk, no lane-sum start. */
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 accs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()},
         m_accs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const int64_t tile = HALVES_TILE / step > 1 ? HALVES_TILE / step : 1;
  for (int64_t b1 = 0; b1 < nb; b1 += tile) {
    const int64_t b2 = b1 + tile < nb ? b1 + tile : nb;
    for (int h = 0; h < 2; h++) {
      const uint8_t *gh = g + b1 * step + 32 * h;
      __m256 acc = accs[h], m_acc = m_accs[h];
      for (int64_t b = b1; b < b2; b++, gh += step) {
        const int32_t *xq = (const int32_t *)(r.q + b * QK);
        __m256i sum;
        if (type == BLOCK_Q8_0) {
          sum = _mm256_setzero_si256();
          for (int j = 0; j < 8; j++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)(gh + 64 * j)),
                    x = _mm256_set1_epi32(xq[j]);
            sum = _mm256_add_epi32(
                sum,
                _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), ones));
          }
        } else {
          __m256i pairs = _mm256_setzero_si256();
          for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(gh + 64 * j));
            pairs = _mm256_add_epi16(
                pairs, _mm256_maddubs_epi16(_mm256_and_si256(v, low4), _mm256_set1_epi32(xq[j])));
            pairs = _mm256_add_epi16(
                pairs, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                            _mm256_set1_epi32(xq[4 + j])));
          }
          sum =
              _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(offset * r.sq[b]));
        }
        const uint8_t *heads = g + b * step + quant + 16 * h;
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)heads));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(r.dx[b])),
                              acc);
        if (type == BLOCK_Q4_1)
          m_acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(heads + 32))),
                                  _mm256_set1_ps(r.sx[b]), m_acc);
      }
      accs[h] = acc, m_accs[h] = m_acc;
    }
  }
  for (int h = 0; h < 2; h++) _mm256_storeu_ps(s + 8 * h, _mm256_add_ps(accs[h], m_accs[h]));
#else /* a lane at a time (the portable build: for tests; generation repacks only where            \
         attnlab_repack16_vectorised says so) */
  (void)bytes, (void)step, (void)quant, (void)offset;
  dot16_lanes(type, g, r, nb, s);
#endif
}

/* s[n] = the product of row n of a 16-row group of Q4_K rows (its nb / 8 super-blocks at g, the
 * layout above) with the rounded row r. AVX-512 VNNI: per sub-block pair i, eight dpbusd of the low
 * nibbles against x's broadcast bytes of sub-block 2i, eight of the high ones as they are (16 times
 * their value, at most 8 x 4 x 240 x 127) against 2i + 1's; per sub-block one conversion and one
 * FMA by sc_n dx (dx / 16 for the high nibbles: exact, a power of two, so the products are those of
 * the shifted nibbles bit for bit) and one FMA of the mins m_n sx; d and dmin once per super-block.
 * dot4_q_k's sums in another order (d (sum sc dx S) rather than sum (d sc dx) S). AVX2: below. */
static inline __attribute__((always_inline)) void dot16_q_k(const uint8_t *g, q8_row r, int64_t nb,
                                                            float *s) {
  const int64_t step = GROUP * BLOCK_BYTES[BLOCK_Q4_K];
#if AVX512 && defined(__AVX512VNNI__)
  const __m512i low4 = _mm512_set1_epi8(0x0F), low6 = _mm512_set1_epi8(0x3F),
                bits45 = _mm512_set1_epi8(0x30);
  const __m512i byte = _mm512_set1_epi32(0xFF);
  __m512 acc = _mm512_setzero_ps(), m_acc = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += 8, g += step) {
    /* x's weights 4i .. 4i + 3 as one 32-bit value */
    const int32_t *xq = (const int32_t *)(r.q + b0 * QK);
    /* scales_mins_k, one row a lane: scales 0-3 and 4-7, mins 0-3 and 4-7, a byte each */
    __m512i a0 = _mm512_loadu_si512((const void *)(g + Q4_K_SCALES)),
            a1 = _mm512_loadu_si512((const void *)(g + Q4_K_SCALES + 64));
    __m512i a2 = _mm512_loadu_si512((const void *)(g + Q4_K_SCALES + 128));
    __m512i sc[2] = {_mm512_and_si512(a0, low6),
                     _mm512_or_si512(_mm512_and_si512(a2, low4),
                                     _mm512_and_si512(_mm512_srli_epi32(a0, 2), bits45))};
    __m512i mn[2] = {_mm512_and_si512(a1, low6),
                     _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(a2, 4), low4),
                                     _mm512_and_si512(_mm512_srli_epi32(a1, 2), bits45))};
    /* this super-block's sums before d and dmin */
    __m512 sb = _mm512_setzero_ps(), mb = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int j = 0; j < 8; j++) {
        __m512i v = _mm512_loadu_si512((const void *)(g + 64 * (8 * i + j)));
        lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, low4), _mm512_set1_epi32(xq[16 * i + j]));
        hi = _mm512_dpbusd_epi32(hi, _mm512_andnot_si512(low4, v),
                                 _mm512_set1_epi32(xq[16 * i + 8 + j]));
      }
#pragma GCC unroll 2
      for (int h = 0; h < 2; h++) {
        /* sub-block 2i + h: byte (2i + h) % 4 of sc[i / 2], mn[i / 2] (a byte of at most 63: the
         * top one needs no mask, the bottom one no shift; unrolled, so that the shifts are
         * constants: a loop with variable shifts and branches ran slower, benchmarks/README.md) */
        const int sub = 2 * i + h, shift = 8 * (sub % 4);
        __m512i sci =
            shift == 0 ? _mm512_and_si512(sc[i / 2], byte) : _mm512_srli_epi32(sc[i / 2], shift);
        __m512i mni =
            shift == 0 ? _mm512_and_si512(mn[i / 2], byte) : _mm512_srli_epi32(mn[i / 2], shift);
        if (shift == 8 || shift == 16)
          sci = _mm512_and_si512(sci, byte), mni = _mm512_and_si512(mni, byte);
        __m512 scale = _mm512_cvtepi32_ps(sci), min = _mm512_cvtepi32_ps(mni);
        sb = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(h ? hi : lo),
            _mm512_mul_ps(scale, _mm512_set1_ps(r.dx[b0 + sub] * (h ? 0.0625f : 1.0f))), sb);
        mb = _mm512_fmadd_ps(min, _mm512_set1_ps(r.sx[b0 + sub]), mb);
      }
    }
    acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + Q4_K_QUANTS))),
                          sb, acc);
    m_acc = _mm512_fmadd_ps(
        _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(g + Q4_K_QUANTS + 32))), mb, m_acc);
  }
  _mm512_storeu_ps(s, _mm512_sub_ps(acc, m_acc));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  /* 256 bits: rows 0-7 in the low half of each 64-byte chunk (h = 0), 8-15 in the high half, one
   * pass each (as dot16_q's: both in one pass kept more sums than registers). Per sub-block pair i,
   * maddubs' u8 x s8 pairs of the low nibbles (sub-block 2i) and of the high ones (2i + 1) add up
   * in 16 bits over the pair's eight chunks (at most 8 x 2 x 15 x 127 = 30,480); then one madd per
   * sub-block multiplies those pairs by the rows' 6-bit scales and adds them into 32 bits (sc_n
   * S_n, at most 63 x 60,960: exact, and exact in float32), as llama.cpp's AVX2 Q4_K product folds
   * its scales into madd (ggml-cpu/arch/x86/quants.c); then one conversion and one FMA by the
   * sub-block's dx. The mins' term m_n sx first, eight FMAs per super-block. */
  const __m256i low4 = _mm256_set1_epi8(0x0F), low6 = _mm256_set1_epi8(0x3F),
                bits45 = _mm256_set1_epi8(0x30), byte = _mm256_set1_epi32(0xFF);
  /* vpshufb indices (within 128-bit lanes) that copy byte 0 of each 32-bit lane into both of its
   * 16-bit halves, zeros above (0x80); | k: byte k */
  const __m256i pairs_of =
      _mm256_setr_epi8(0, -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12, -128, 0,
                       -128, 0, -128, 4, -128, 4, -128, 8, -128, 8, -128, 12, -128, 12, -128);
  __m256 accs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()},
         m_accs[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  /* (dot16_q's passes over HALVES_TILE bytes at a time) */
  const int64_t tile = 8 * (HALVES_TILE / step > 1 ? HALVES_TILE / step : 1);
  for (int64_t b1 = 0; b1 < nb; b1 += tile)
    for (int h = 0; h < 2; h++) {
      const int64_t b2 = b1 + tile < nb ? b1 + tile : nb;
      const uint8_t *gh = g + b1 / 8 * step + 32 * h;
      __m256 acc = accs[h], m_acc = m_accs[h];
      for (int64_t b0 = b1; b0 < b2; b0 += 8, gh += step) {
        const int32_t *xq = (const int32_t *)(r.q + b0 * QK);
        /* scales 0-3 and 4-7, mins 0-3 and 4-7, a byte each, one row a lane (as above) */
        __m256i a0 = _mm256_loadu_si256((const __m256i *)(gh + Q4_K_SCALES)),
                a1 = _mm256_loadu_si256((const __m256i *)(gh + Q4_K_SCALES + 64)),
                a2 = _mm256_loadu_si256((const __m256i *)(gh + Q4_K_SCALES + 128));
        __m256i sc[2] = {_mm256_and_si256(a0, low6),
                         _mm256_or_si256(_mm256_and_si256(a2, low4),
                                         _mm256_and_si256(_mm256_srli_epi32(a0, 2), bits45))};
        __m256i mn[2] = {_mm256_and_si256(a1, low6),
                         _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(a2, 4), low4),
                                         _mm256_and_si256(_mm256_srli_epi32(a1, 2), bits45))};
        __m256 sb = _mm256_setzero_ps(), mb = _mm256_setzero_ps();
        for (int sub = 0; sub < 8; sub++) {
          __m256i m = _mm256_and_si256(_mm256_srli_epi32(mn[sub / 4], 8 * (sub % 4)), byte);
          mb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(r.sx[b0 + sub]), mb);
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
          __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
          for (int j = 0; j < 8; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(gh + 64 * (8 * i + j)));
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(_mm256_and_si256(v, low4),
                                                           _mm256_set1_epi32(xq[16 * i + j])));
            hi = _mm256_add_epi16(
                hi, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                         _mm256_set1_epi32(xq[16 * i + 8 + j])));
          }
          /* sub-blocks 2i and 2i + 1: bytes (2i) % 4 and (2i + 1) % 4 of sc[i / 2] */
          const __m256i sci = sc[i / 2];
          __m256i lo_scaled = _mm256_madd_epi16(
              lo, _mm256_shuffle_epi8(
                      sci, _mm256_or_si256(pairs_of, _mm256_set1_epi16((short)(2 * i % 4)))));
          __m256i hi_scaled = _mm256_madd_epi16(
              hi, _mm256_shuffle_epi8(
                      sci, _mm256_or_si256(pairs_of, _mm256_set1_epi16((short)((2 * i + 1) % 4)))));
          sb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo_scaled), _mm256_set1_ps(r.dx[b0 + 2 * i]), sb);
          sb = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi_scaled), _mm256_set1_ps(r.dx[b0 + 2 * i + 1]),
                               sb);
        }
        const uint8_t *heads = g + (b0 / 8) * step + Q4_K_QUANTS + 16 * h;
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)heads)), sb, acc);
        m_acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(heads + 32))), mb,
                                m_acc);
      }
      accs[h] = acc, m_accs[h] = m_acc;
    }
  for (int h = 0; h < 2; h++) _mm256_storeu_ps(s + 8 * h, _mm256_sub_ps(accs[h], m_accs[h]));
#else /* the same sums, a lane at a time (the portable build: for tests; generation repacks Q4_K   \
         only where attnlab_repack16_vectorised says so) */
  float acc[GROUP] = {0}, m_acc[GROUP] = {0};
  for (int64_t b0 = 0; b0 < nb; b0 += 8, g += step)
    for (int n = 0; n < GROUP; n++) {
      uint8_t scales[12]; /* row n's 12 bytes, back in the file's order */
      for (int k = 0; k < 3; k++) memcpy(scales + 4 * k, g + Q4_K_SCALES + 64 * k + 4 * n, 4);
      float sb = 0.0f, mb = 0.0f;
      for (int sub = 0; sub < 8; sub++) {
        const int8_t *x = r.q + (b0 + sub) * QK;
        int32_t sum = 0;
        /* weight j of sub-block sub: chunk 8 (sub / 2) + j / 4, byte j % 4 of lane n */
        for (int j = 0; j < QK; j++)
          sum +=
              (int32_t)((g[64 * (8 * (sub / 2) + j / 4) + 4 * n + j % 4] >> (4 * (sub & 1))) & 15) *
              x[j];
        int sc, m;
        scale_min_k(scales, sub, &sc, &m);
        sb += (float)sum * ((float)sc * r.dx[b0 + sub]);
        mb += (float)m * r.sx[b0 + sub];
      }
      acc[n] += half_at(g + Q4_K_QUANTS + 2 * n) * sb;
      m_acc[n] += half_at(g + Q4_K_QUANTS + 2 * GROUP + 2 * n) * mb;
    }
  for (int n = 0; n < GROUP; n++) s[n] = acc[n] - m_acc[n];
#endif
}

/* Whether this build's 16-row product of `type` is vectorised (AVX-512 VNNI; AVX2 with FMA and F16C
 * but for Q5_0), rather than computed a lane at a time (for tests): generation repacks
 * only then, and only where that product ran faster than the file's layout on this machine
 * (measured once: attnlab.generate.kernels.policy.repack16_against_file). */
int attnlab_repack16_vectorised(int type) {
#if AVX512 && defined(__AVX512VNNI__)
  return type == BLOCK_Q8_0 || type == BLOCK_Q4_0 || type == BLOCK_Q4_1 || type == BLOCK_Q5_0 ||
         type == BLOCK_Q4_K;
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  return type == BLOCK_Q8_0 || type == BLOCK_Q4_0 || type == BLOCK_Q4_1 || type == BLOCK_Q4_K;
#else
  (void)type;
  return 0;
#endif
}
