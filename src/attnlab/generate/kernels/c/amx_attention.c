/* Attention's products on AMX tiles (the explicit path's scores, pattern V, or all three steps in
 * one call, where run_with_cache's hooks only read): each head's q K^T and pattern V as amx.c's
 * float32 products of three bfloat16 parts, the softmax in float32 between them. */
#include "common.h"
#include "vec.h"

/* A head's scores and pattern of at most this many floats each (2 MB) are made in the thread's
 * scratch and stored past the caches (amx_attend_heads); a longer head's go straight into scores
 * and pattern, as a head's of 8,192 tokens would need 512 MB more scratch a thread. */
#define AMX_KEPT_MOST (1 << 19)

/* The scratch bytes attnlab_attend_scores_amx, attnlab_attend_mix_amx and
 * attnlab_attend_explicit_amx need: per thread, one head's queries (or pattern rows) and keys (or
 * values) split into their parts, a block of the result, and one head's scores and pattern (the
 * explicit path's, kept in the core's cache, up to AMX_KEPT_MOST). */
/* values per part */
static void amx_head_sizes(int64_t T, int64_t S, int64_t d_head, int64_t *a, int64_t *w) {
  const int64_t k =
      round_up(S, AMX_K) > round_up(d_head, AMX_K) ? round_up(S, AMX_K) : round_up(d_head, AMX_K);
  *a = round_up(T, 32) * k; /* A: T rows of k */
  *w = round_up(S, 32) * round_up(d_head, AMX_K) +
       round_up(d_head, 32) * round_up(S, AMX_K); /* B: K or V */
}

int64_t attnlab_attend_amx_scratch(int64_t T, int64_t S, int64_t d_head, int threads) {
  int64_t a, w;
  amx_head_sizes(T, S, d_head, &a, &w);
  int64_t kept = T * S <= AMX_KEPT_MOST ? round_up(2 * T * S, 16) * 4 : 0;
  return threads * ((a + w) * 6 + 32 * 32 * 4 + kept + 128) + 64;
}

#if AMX
/* One head's masked scores (attnlab_attend_scores_amx) into y [T, T]: its queries (q, rows
 * `q_stride` apart) split into A, its keys packed into B; blocks of 32 x 32 above the diagonal
 * written without a product; the seen keys' scores soft-capped where `cap` is not 0. */
AMX_TARGET static void amx_head_scores(const float *q, int64_t q_stride, const float *k,
                                       int64_t k_stride, float *y, uint16_t *A, uint16_t *B,
                                       float *out, int64_t T, int64_t d_head, float scale,
                                       float cap) {
  const int64_t chunks = round_up(d_head, AMX_K) / AMX_K, row_tiles = round_up(T, 32) / 16;
  amx_split_rows(q, q_stride, T, d_head, 0, row_tiles * 16, A);
  int third;
  const int64_t part_stride = amx_pack(k, k_stride, 0, d_head, 0, T, B, &third);
  for (int64_t rt = 0; rt < row_tiles; rt += 2)
    for (int64_t ft = 0; ft < row_tiles; ft += 2) {
      const int64_t r0 = rt * 16, f0 = ft * 16, m = T - r0 < 32 ? T - r0 : 32,
                    cols = T - f0 < 32 ? T - f0 : 32;
      if (f0 > r0 + 31) { /* every key after every query: masked */
        for (int64_t r = 0; r < m; r++)
          for (int64_t j = 0; j < cols; j++) y[(r0 + r) * T + f0 + j] = -INFINITY;
        continue;
      }
      amx_block(A, B, part_stride, chunks, chunks, third, rt, ft, out, 32);
      for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < cols; j++)
          y[(r0 + r) * T + f0 + j] = f0 + j <= r0 + r ? out[r * 32 + j] * scale : -INFINITY;
      if (cap > 0.0f)
        for (int64_t r = 0; r < m; r++) {
          int64_t seen = r0 + r + 1 - f0 < cols ? r0 + r + 1 - f0 : cols;
          for (int64_t j = 0; j < seen; j++)
            y[(r0 + r) * T + f0 + j] = soft_cap(y[(r0 + r) * T + f0 + j], cap);
        }
    }
}

/* One head's z = pattern V (attnlab_attend_mix_amx) into z (rows `z_stride` apart): the pattern [T,
 * S] split into A, the values (v [S, d_head], rows `v_stride` apart) packed into B. `causal`: the
 * pattern is a causal softmax's, exactly 0 above the diagonal, whose 32-key chunks past a block's
 * last query are neither split nor multiplied (adding their zero products changes no sum). */
AMX_TARGET static void amx_head_mix(const float *pattern, const float *v, int64_t v_stride,
                                    float *z, int64_t z_stride, uint16_t *A, uint16_t *B,
                                    float *out, int64_t T, int64_t S, int64_t d_head, int causal) {
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

/* This thread's part of attnlab_attend_amx_scratch(T, S, d_head, threads)'s scratch: split rows A
 * (room for T rows of max(S, d_head) values), packed keys or values B, a block of the result `out`,
 * then room for one head's scores and pattern `kept` (2 T S floats, where T S <= AMX_KEPT_MOST);
 * the tiles configured. */
AMX_TARGET static uint16_t *amx_head_scratch(int8_t *scratch, int64_t T, int64_t S, int64_t d_head,
                                             uint16_t **B, float **out, float **kept) {
  int64_t a, w;
  amx_head_sizes(T, S, d_head, &a, &w);
  int8_t *base = (int8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  uint16_t *A =
      (uint16_t *)(base + this_thread() * (attnlab_attend_amx_scratch(T, S, d_head, 1) - 64));
  *B = A + a * 3;
  *out = (float *)(*B + w * 3);
  *kept = *out + 32 * 32;
  configure_tiles();
  return A;
}

/* The attention's steps on AMX tiles for every head (the threads share them), those whose outputs
 * are not NULL: q and k to scores, scores to pattern (softmax_row), pattern and v to out_z. q
 * [batch, T, heads, d_head], k [batch, T, kv_heads, d_head] (grouped-query), v [batch, S, kv_heads,
 * d_head], scores and pattern [batch, heads, T, S] (S = T where q is given: a prompt from position
 * 0), out_z [batch, T, heads, d_head]. Where this call made the pattern, it is a causal softmax's,
 * and pattern V leaves out its zero chunks above the diagonal; and a head's scores and pattern (up
 * to AMX_KEPT_MOST floats) are made in the thread's scratch (`kept`, in its core's cache), where
 * the softmax and the mix read them, and leave for scores and pattern past the caches
 * (store_past_caches: no step reads them back, and a line of theirs read from memory before its
 * write is a read for nothing). */
AMX_TARGET static void amx_attend_heads(const float *q, const float *k, const float *v,
                                        float *scores, float *pattern, float *out_z,
                                        int8_t *scratch, int64_t batch, int64_t T, int64_t S,
                                        int64_t heads, int64_t kv_heads, int64_t d_head,
                                        float scale, float cap, int threads) {
#pragma omp parallel num_threads(threads)
  {
    uint16_t *B;
    float *out, *kept;
    uint16_t *A = amx_head_scratch(scratch, T, S, d_head, &B, &out, &kept);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < batch * heads; bh++) {
      const int64_t b = bh / heads, h = bh % heads, g = h / (heads / kv_heads),
                    kv = (b * S * kv_heads + g) * d_head;
      float *sc = scores ? scores + bh * T * S : NULL, *pt = pattern ? pattern + bh * T * S : NULL;
      const int keep = sc && out_z && T * S <= AMX_KEPT_MOST;
      if (keep) /* all three: scores and pattern made in `kept`, then stored past the caches */
        sc = kept, pt = kept + T * S;
      if (sc)
        amx_head_scores(q + (b * T * heads + h) * d_head, heads * d_head, k + kv, kv_heads * d_head,
                        sc, A, B, out, T, d_head, scale, cap);
      if (sc && out_z) /* all three: the pattern from scores this core has just written */
        for (int64_t r = 0; r < T; r++) {
          softmax_row(sc + r * T, pt + r * T, T);
          if (keep) {
            store_past_caches(scores + bh * T * S + r * T, sc + r * T, T);
            store_past_caches(pattern + bh * T * S + r * T, pt + r * T, T);
          }
        }
      if (out_z)
        amx_head_mix(pt, v + kv, kv_heads * d_head, out_z + (b * T * heads + h) * d_head,
                     heads * d_head, A, B, out, T, S, d_head, sc != NULL);
    }
    _mm_sfence(); /* the streamed stores seen before the region's end */
    _tile_release();
  }
}

/* The masked scores of a prompt's causal attention from position 0 on AMX tiles:
 * attnlab_attend_scores's values (q K^T scale where the key's position <= the query's, -inf
 * elsewhere) at a float32 product's accuracy, for q [batch, T, heads, d_head], k [batch, T,
 * kv_heads, d_head] (grouped-query) into scores [batch, heads, T, T]; `cap`: the soft-cap (0:
 * none). */
AMX_TARGET void attnlab_attend_scores_amx(const float *q, const float *k, float *scores,
                                          int8_t *scratch, int64_t batch, int64_t T, int64_t heads,
                                          int64_t kv_heads, int64_t d_head, float scale, float cap,
                                          int threads) {
  amx_attend_heads(q, k, NULL, scores, NULL, NULL, scratch, batch, T, T, heads, kv_heads, d_head,
                   scale, cap, threads);
}

/* z = pattern V on AMX tiles: attnlab_attend_mix's values at a float32 product's accuracy, for
 * pattern [batch, heads, T, S] (any weights: a hook may have put some anywhere) and v [batch, S,
 * kv_heads, d_head] into out [batch, T, heads, d_head]. */
AMX_TARGET void attnlab_attend_mix_amx(const float *pattern, const float *v, float *out_z,
                                       int8_t *scratch, int64_t batch, int64_t T, int64_t S,
                                       int64_t heads, int64_t kv_heads, int64_t d_head,
                                       int threads) {
  amx_attend_heads(NULL, NULL, v, NULL, (float *)pattern, out_z, scratch, batch, T, S, heads,
                   kv_heads, d_head, 0.0f, 0.0f, threads);
}

/* The explicit path's three steps in one call, where the hooks between them only read
 * (run_with_cache): each head's masked scores (attnlab_attend_scores_amx) into scores, their
 * softmax_row into pattern, and z = pattern V (attnlab_attend_mix_amx) into out_z, one head after
 * the other, so that a head's scores and pattern are read back from the core's L2 rather than from
 * memory, and the pattern's chunks above the diagonal (zeros) are neither split nor multiplied. The
 * three calls' numbers, bit for bit (tests/test_amx.py). q, out_z [batch, T, heads, d_head], k, v
 * [batch, T, kv_heads, d_head], scores and pattern [batch, heads, T, T]; `cap` as
 * attnlab_attend_scores_amx's. */
AMX_TARGET void attnlab_attend_explicit_amx(const float *q, const float *k, const float *v,
                                            float *scores, float *pattern, float *out_z,
                                            int8_t *scratch, int64_t batch, int64_t T,
                                            int64_t heads, int64_t kv_heads, int64_t d_head,
                                            float scale, float cap, int threads) {
  amx_attend_heads(q, k, v, scores, pattern, out_z, scratch, batch, T, T, heads, kv_heads, d_head,
                   scale, cap, threads);
}

#else
void attnlab_attend_scores_amx(const float *q, const float *k, float *scores, int8_t *scratch,
                               int64_t batch, int64_t T, int64_t heads, int64_t kv_heads,
                               int64_t d_head, float scale, float cap, int threads) {
  (void)q, (void)k, (void)scores, (void)scratch, (void)batch, (void)T, (void)heads, (void)kv_heads,
      (void)d_head;
  (void)scale, (void)cap, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}

void attnlab_attend_mix_amx(const float *pattern, const float *v, float *out_z, int8_t *scratch,
                            int64_t batch, int64_t T, int64_t S, int64_t heads, int64_t kv_heads,
                            int64_t d_head, int threads) {
  (void)pattern, (void)v, (void)out_z, (void)scratch, (void)batch, (void)T, (void)S, (void)heads,
      (void)kv_heads;
  (void)d_head, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}

void attnlab_attend_explicit_amx(const float *q, const float *k, const float *v, float *scores,
                                 float *pattern, float *out_z, int8_t *scratch, int64_t batch,
                                 int64_t T, int64_t heads, int64_t kv_heads, int64_t d_head,
                                 float scale, float cap, int threads) {
  (void)q, (void)k, (void)v, (void)scores, (void)pattern, (void)out_z, (void)scratch, (void)batch,
      (void)T;
  (void)heads, (void)kv_heads, (void)d_head, (void)scale, (void)cap, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}
#endif
