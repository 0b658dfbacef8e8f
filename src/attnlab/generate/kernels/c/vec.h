/* Small vector helpers every family uses (ggml-cpu's vec.h and simd-mappings.h play this part): the
 * AVX-512 widening and four-way reduction, e^x in float32 that vectorises, IEEE half to float, and
 * the AVX2 integer dot product of unsigned by signed bytes (DPBUSD) with its block loaders. */
#ifndef ATTNLAB_KERNELS_VEC_H
#define ATTNLAB_KERNELS_VEC_H
#include "common.h"

#if AVX512
/* 16 int8 weights widened to float: one sign-extending load (int8 -> int32) and a conversion */
static inline __m512 widen16(const int8_t *q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}
/* the first popcount(m) of them, zeros after */
static inline __m512 widen16_masked(const int8_t *q, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q)));
}

/* The sums of a, b, c and d's sixteen lanes, in that order: three shuffle-and-add rounds for all
 * four, where four separate reductions take four rounds each. */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  /* 128-bit lane k now holds four partial sums of a, b, c, d's k */
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0x4E));
  s = _mm512_add_ps(s, _mm512_permute_ps(s, 0xB1));
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), s));
}
#endif

/* e^x to float32's precision (relative error ~1e-7 across float's normal range; x is first held to
 * [-87.3, 88.3], so that e^x stays a normal float), written so that a loop of it vectorises: libm's
 * expf is a call per value, which made the softmax and SwiGLU's SiLU most of those kernels' time.
 * Cody and Waite's range reduction x = n ln 2 + r, |r| <= ln 2 / 2, Cephes' polynomial for e^r, and
 * 2^n written into the exponent bits. */
static inline float exp_(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  /* rounded to an integer: 1.5 2^23 */
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = ((int32_t)n + 127) << 23;
  union {
    int32_t i;
    float f;
  } two_n = {.i = bits};
  return p * two_n.f;
}

/* The soft-cap (Gemma 2's attn_logit_softcapping and final_logit_softcapping; modded-nanogpt's
 * logits): cap tanh(x / cap), x bounded smoothly to (-cap, cap), cap > 0.
 * tanh t through the vectorised exp_ as sign(t) (1 - e^(-2|t|)) / (1 + e^(-2|t|)), and below |t| =
 * 1/8, where 1 - e^(-2|t|) cancels, as its series t - t^3/3 + 2t^5/15 - 17t^7/315 (the next term is
 * under 2e-9 of t there): libm's tanhf was a call per value. */
static inline float soft_cap(float x, float cap) {
  float t = x / cap, a = fabsf(t), t2 = t * t, e = exp_(-2.0f * a);
  float series = t * (1.0f + t2 * (-1.0f / 3.0f + t2 * (2.0f / 15.0f + t2 * (-17.0f / 315.0f))));
  return cap * (a < 0.125f ? series : copysignf((1.0f - e) / (1.0f + e), t));
}

/* IEEE half -> float (F16C's instruction where the build has it) */
static inline float half_to_float(ggml_half h) {
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
  union {
    uint32_t u;
    float f;
  } v = {bits};
  return v.f;
#endif
}

/* The IEEE half at p (little-endian: a block's d, m or dmin, or a 16-row layout's) as a float. Read
 * as two bytes, not as a uint16_t: the compiler then orders the load among the float loads and
 * stores around it as it did when the kernels read blocks as bytes, and makes the same code. */
static inline float half_at(const void *at) {
  const uint8_t *p = (const uint8_t *)at;
  return half_to_float((ggml_half)(p[0] | (p[1] << 8)));
}

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else /* AVX2: pairs of u8 x s8 products into 16 bits (at most 2 x 15 x 127 or 2 x 127 x 127: no   \
         saturation), then pairs of those into 32 */
#define DPBUSD(acc, u, s)                                                                          \
  _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#endif
/* whether DPBUSD sums its four products in 32 bits (VNNI), so that an unsigned byte may go up to
 * 255 (maddubs' pairs saturate at 16 bits) */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define DPBUSD_32 1
#else
#define DPBUSD_32 0
#endif

/* the 32 four-bit values of a block's 16 bytes, in weight order: low nibbles (weights 0-15), then
 * high (16-31) */
static inline __m256i nibbles32(const uint8_t *p) {
  __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
  return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)),
                          _mm256_set1_epi8(0x0F));
}

/* the first four bytes of each of w[0..3] + offset, in that order: four 32-bit loads and three
 * unpacks (through a stack buffer, four 4-byte stores and one 16-byte load, the load cannot take
 * its bytes from the stores: a store-forwarding stall per block) */
static inline __m128i first4_of4(const uint8_t *const w[4], int64_t offset) {
  int32_t h[4];
  for (int k = 0; k < 4; k++) memcpy(h + k, w[k] + offset, 4);
  return _mm_unpacklo_epi64(_mm_unpacklo_epi32(_mm_cvtsi32_si128(h[0]), _mm_cvtsi32_si128(h[1])),
                            _mm_unpacklo_epi32(_mm_cvtsi32_si128(h[2]), _mm_cvtsi32_si128(h[3])));
}

/* The four float16 at the start of block b of rows w[0..3] (their d; the second is Q4_1's m, Q4_K's
 * dmin, or the first half of Q5_0's high bits, never read), as eight floats: row k's d in lane 2k
 */
static inline __m256 heads4(const uint8_t *const w[4], int64_t offset) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(first4_of4(w, offset));
#else
  uint8_t head[16];
  for (int k = 0; k < 4; k++) memcpy(head + 4 * k, w[k] + offset, 4);
  float halves[8];
  for (int i = 0; i < 8; i++) halves[i] = half_at(head + 2 * i);
  return _mm256_loadu_ps(halves);
#endif
}

/* 8 int8 weights widened to float: one sign-extending load (int8 -> int32) and a conversion */
static inline __m256 widen8(const int8_t *q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

/* the sums of a, b, c and d's eight lanes, in that order */
static inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
#endif

#endif
