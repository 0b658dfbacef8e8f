/* A prompt's float32 product as a tiled matrix product (tiles_q8.c's tiles with float32 weights):
 * y = x W^T + b for W float32, or blocks dequantized a tile at a time; the tile product
 * (f_tile_rows) is also the prompt attention's (attention.c). */
#include "common.h"

/* The float32 tile product's vectors: sixteen floats on AVX-512 (2 per row of the tile, 24 sums for
 * 12 rows), eight elsewhere (4 per row; AVX2's sixteen registers hold 3 rows' 12 sums:
 * sixteen-float vectors there spilled every sum). GCC's vector types compile to whatever
 * vectors the target has. */
#if AVX512
#define F_LANES 16
#else
#define F_LANES 8
#endif
typedef float fvec __attribute__((vector_size(4 * F_LANES), aligned(4)));
#define F_VECS (TILE_N / F_LANES)

/* out[r][j] = sum_k x[r][k] tile[k][j] for r < TILE_ROWS_F, j < TILE_N: tile [d_in][TILE_N], its
 * rows `ld` floats apart */
static void f_tile_rows(const float *tile, int64_t ld, int64_t d_in, const float *const *x,
                        float *out) {
  fvec a[TILE_ROWS_F][F_VECS];
  memset(a, 0, sizeof(a));
  for (int64_t k = 0; k < d_in; k++) {
#if F_LANES == 16
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
#else
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
#endif
  }
  memcpy(out, a, sizeof(a));
}

/* y [rows, d_out] = x [rows, d_in] W^T + b in float32: W float32 [d_out, d_in] (type < 0) or rows
 * of blocks of `type`, dequantized a tile at a time (attnlab_dequantize's values); scratch as
 * attnlab_linear_q_rows's. */
void attnlab_linear_f_rows(const float *x, const void *w, const float *b, float *y, int8_t *scratch,
                           int64_t rows, int64_t d_in, int64_t d_out, int type, int threads) {
  int64_t tiles = (d_out + TILE_N - 1) / TILE_N,
          tile_bytes = align64(attnlab_linear_rows_scratch(0, d_in, 1));
#pragma omp parallel num_threads(threads)
  {
    int64_t thread = this_thread();
    float *tile = (float *)(scratch + thread * tile_bytes);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles; i++) {
      int64_t o0 = i * TILE_N, n = d_out - o0 < TILE_N ? d_out - o0 : TILE_N;
      /* tile[k][j] = W[o0 + j, k], zeros past the last feature */
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
