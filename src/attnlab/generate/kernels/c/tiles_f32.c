/* A prompt's float32 product as a tiled matrix product (tiles_q8.c's tiles with float32 weights):
 * y = x W^T + b for W float32, or blocks dequantized a tile at a time; the tile product
 * (f_tile_rows) is also the prompt attention's (attention.c). */
#include "common.h"

/* out[r][j] = init[r][j] + sum_k x[r][k] tile[k][j] for r < TILE_ROWS_F, j < TILE_N (init NULL:
 * zeros): tile [d_in][TILE_N], its rows `ld` floats apart. Each sum runs over k in order (a fused
 * multiply-add per term where the build has FMA), so that a sum taken over k in pieces, each piece
 * starting from the last one's out, is the same sum bit for bit. */
#if AVX512
/* sixteen floats per vector: 2 per row of the tile, 24 sums for 12 rows */
typedef float fvec __attribute__((vector_size(64), aligned(4)));
static void f_tile_rows(const float *tile, int64_t ld, int64_t d_in, const float *const *x,
                        const float *init, float *out) {
  fvec a[TILE_ROWS_F][2];
  if (init)
    memcpy(a, init, sizeof(a));
  else
    memset(a, 0, sizeof(a));
  for (int64_t k = 0; k < d_in; k++) {
    fvec w0, w1;
    memcpy(&w0, tile + k * ld, sizeof(w0));
    memcpy(&w1, tile + k * ld + 16, sizeof(w1));
#pragma GCC unroll 16
    for (int r = 0; r < TILE_ROWS_F; r++) {
      /* x broadcast (minus zero, an identity the compiler drops; plus zero is not) */
      fvec xb = x[r][k] - (fvec){0};
      a[r][0] += xb * w0;
      a[r][1] += xb * w1;
    }
  }
  memcpy(out, a, sizeof(a));
}
#elif F_TILES
/* AVX2 with FMA: the register block of BLIS's Haswell float32 micro-kernel (6 rows x 16 features,
 * bli_sgemm_haswell_asm_6x16; OpenBLAS's Haswell sgemm kernel blocks 16 x 4 the other way round),
 * once for each half of the tile's 32 features. Its 12 sums, 2 weight vectors and one broadcast of
 * x fill AVX2's sixteen registers; per k, 2 loads and 6 broadcasts feed 12 multiply-adds. (A 3 x 32
 * block, one pass over k, needs 17 registers: the compiler then read a weight vector from memory
 * at every multiply-add, 15 loads for 12.) */
static void f_tile_rows(const float *tile, int64_t ld, int64_t d_in, const float *const *x,
                        const float *init, float *out) {
  const float *xr[TILE_ROWS_F];
  for (int r = 0; r < TILE_ROWS_F; r++) xr[r] = x[r];
  for (int half = 0; half < TILE_N; half += 16) {
    __m256 a[TILE_ROWS_F][2];
    for (int r = 0; r < TILE_ROWS_F; r++) {
      a[r][0] = init ? _mm256_loadu_ps(init + r * TILE_N + half) : _mm256_setzero_ps();
      a[r][1] = init ? _mm256_loadu_ps(init + r * TILE_N + half + 8) : _mm256_setzero_ps();
    }
    const float *w = tile + half;
    for (int64_t k = 0; k < d_in; k++, w += ld) {
      __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 6
      for (int r = 0; r < TILE_ROWS_F; r++) {
        __m256 xb = _mm256_broadcast_ss(xr[r] + k);
        a[r][0] = _mm256_fmadd_ps(xb, w0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(xb, w1, a[r][1]);
      }
    }
    for (int r = 0; r < TILE_ROWS_F; r++) {
      _mm256_storeu_ps(out + r * TILE_N + half, a[r][0]);
      _mm256_storeu_ps(out + r * TILE_N + half + 8, a[r][1]);
    }
  }
}
#else
/* the other builds: GCC's vector types, eight floats (whatever vectors the target has), 3 rows'
 * 12 sums */
typedef float fvec __attribute__((vector_size(32), aligned(4)));
static void f_tile_rows(const float *tile, int64_t ld, int64_t d_in, const float *const *x,
                        const float *init, float *out) {
  fvec a[TILE_ROWS_F][TILE_N / 8];
  if (init)
    memcpy(a, init, sizeof(a));
  else
    memset(a, 0, sizeof(a));
  for (int64_t k = 0; k < d_in; k++) {
    /* loads through the (4-byte aligned) vector type: memcpy here went through the stack in 16-byte
     * halves, which the 32-byte reads then waited on */
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
  }
  memcpy(out, a, sizeof(a));
}
#endif

/* tile[k][j] = W[o0 + j, k] for j < TILE_N, k < d_in, zeros past the last feature (d_out) */
static void lay_out_tile(const void *w, int type, int64_t o0, int64_t d_in, int64_t d_out,
                         float *tile) {
  int64_t n = d_out - o0 < TILE_N ? d_out - o0 : TILE_N;
  for (int64_t j = 0; j < TILE_N; j++) {
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
          block_values((const uint8_t *)w +
                           (o0 + j) * (d_in / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type]),
                       (k0 + c) / QK, type, 0, q, &d, &m);
          for (int e = 0; e < QK; e++) v[c + e] = d * (float)q[e] + m;
        }
      for (int64_t k = 0; k < len; k++) tile[(k0 + k) * TILE_N + j] = v[k];
    }
  }
}

/* y [rows, d_out] = x [rows, d_in] W^T + b in float32: W float32 [d_out, d_in] (type < 0) or rows
 * of blocks of `type`, dequantized a tile at a time (attnlab_dequantize's values); scratch as
 * attnlab_linear_q_rows's. */
void attnlab_linear_f_rows(const float *x, const void *w, const float *b, float *y, int8_t *scratch,
                           int64_t rows, int64_t d_in, int64_t d_out, int type, int threads) {
  int64_t tiles = (d_out + TILE_N - 1) / TILE_N, tile_floats = f_tile_bytes(d_in) / 4,
          scratch_bytes = align64(attnlab_linear_rows_scratch(0, d_in, 1));
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    int64_t thread = omp_get_thread_num(), count = omp_get_num_threads();
#else
    int64_t thread = 0, count = 1;
#endif
    /* this thread's tiles, as many as the next thread's or one more */
    int64_t lo = tiles * thread / count, hi = tiles * (thread + 1) / count;
    float *group = (float *)(scratch + thread * scratch_bytes);
    for (int64_t g0 = lo; g0 < hi; g0 += F_GROUP) {
      int64_t in_group = hi - g0 < F_GROUP ? hi - g0 : F_GROUP;
      for (int64_t t = 0; t < in_group; t++)
        lay_out_tile(w, type, (g0 + t) * TILE_N, d_in, d_out, group + t * tile_floats);
      for (int64_t p0 = 0; p0 < rows; p0 += F_PANEL * TILE_ROWS_F) {
        int64_t left = (rows - p0 + TILE_ROWS_F - 1) / TILE_ROWS_F,
                blocks = left < F_PANEL ? left : F_PANEL;
        for (int64_t t = 0; t < in_group; t++) {
          const float *tile = group + t * tile_floats;
          int64_t o0 = (g0 + t) * TILE_N, n = d_out - o0 < TILE_N ? d_out - o0 : TILE_N;
          float out[F_PANEL][TILE_ROWS_F * TILE_N];
          for (int64_t k0 = 0; k0 < d_in; k0 += F_KC) {
            int64_t kc = d_in - k0 < F_KC ? d_in - k0 : F_KC;
            for (int64_t block = 0; block < blocks; block++) {
              int64_t r0 = p0 + block * TILE_ROWS_F,
                      m = rows - r0 < TILE_ROWS_F ? rows - r0 : TILE_ROWS_F;
              const float *xr[TILE_ROWS_F];
              for (int64_t r = 0; r < TILE_ROWS_F; r++)
                xr[r] = x + (r0 + (r < m ? r : 0)) * d_in + k0;
              f_tile_rows(tile + k0 * TILE_N, TILE_N, kc, xr, k0 ? out[block] : NULL, out[block]);
            }
          }
          for (int64_t block = 0; block < blocks; block++) {
            int64_t r0 = p0 + block * TILE_ROWS_F,
                    m = rows - r0 < TILE_ROWS_F ? rows - r0 : TILE_ROWS_F;
            store_tile(out[block], b, y, r0, m, o0, n, d_out);
          }
        }
      }
    }
  }
}
