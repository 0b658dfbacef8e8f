/* Attention: the decode step's single query per row against the KV cache, and a prompt's causal
 * attention from position 0 (fused, or in three steps for run_with_cache's hooks), each the
 * chapter's softmax(q K^T scale + mask) V on float32, grouped-query heads included. Each takes a
 * soft-cap `cap` (Gemma 2's attn_logit_softcapping; 0: none): the scores cap tanh(q K^T scale /
 * cap) before the mask (vec.h's soft_cap; attnlab.model.attention.attention_scores). */
#include "common.h"
#include "vec.h"

/* o[i] = inv sum_s p[s] v[s, i] for i < d, the values v [n, d] row-major: the attention's mix of
 * values. The sums stay in registers across the keys, 64 values of o at a time (AVX-512, d a
 * multiple of 16); adding into o in memory made each key's pass wait for the last one's stores, a
 * large share of the kernel's time. */
static inline void weighted_sum(const float *p, const float *v, int64_t n, int64_t d, float inv,
                                float *o) {
  /* a masked key (p = 0) is multiplied, not skipped: a NaN value there makes NaN, as softmax(...) @
   * V does */
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

/* One query per row attends to the cached keys and values (the chapter's softmax(q K^T scale +
 * mask) V): first the new key and value are written to cache slot `slot`, then query head h of row
 * r reads key/value head h / (heads / kv_heads) (grouped-query attention) at slots [0, slot], those
 * with key_mask[r, s] set (key_mask NULL: all); the slot is read from *slot_at, so a prepared call
 * serves every step. q, out [rows, heads, d_head]; k_new, v_new [rows, kv_heads, d_head]; k_cache,
 * v_cache [rows, kv_heads, max_len, d_head]; key_mask [rows, mask_stride] bytes; scores: room for
 * rows * heads * max_len floats; on return scores[rh, 0 .. slot] holds the unnormalised weights
 * exp(score - max), 0 at masked keys (KernelDecoder.weights reads them). A row that may see no key
 * gets zeros, as attnlab.attention does. `cap`: the soft-cap (0: none). */
static void attend(const float *q, const float *k_new, const float *v_new, float *k_cache,
                   float *v_cache, const uint8_t *key_mask, int64_t mask_stride, float *scores,
                   float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d_head,
                   int64_t max_len, const int64_t *slot_at, float scale, float cap) {
  int64_t slot = *slot_at, group = heads / kv_heads, n = slot + 1;
/* one thread writes the new key and value; the others wait for them at its end */
#pragma omp single
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
    /* q·k for every key, four keys at a time (masked ones too: they are set to -inf below) */
    int64_t s = 0;
    for (; s + 4 <= n; s += 4) {
      const float *k0 = kb + s * d_head;
      dot4(qv, k0, k0 + d_head, k0 + 2 * d_head, k0 + 3 * d_head, d_head, p + s);
    }
    for (; s < n; s++) p[s] = dot(qv, kb + s * d_head, d_head);
    float top = -INFINITY;
#pragma omp simd
    for (s = 0; s < n; s++) p[s] *= scale;
    if (cap > 0.0f) {
#pragma omp simd
      for (s = 0; s < n; s++) p[s] = soft_cap(p[s], cap);
    }
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
    /* no visible key: every weight 0. Not `top == -INFINITY`: a max reduction's private copies
     * start at the type's least value, -inf for GCC but -FLT_MAX for clang, so with every key
     * masked clang's top is -FLT_MAX. */
    if (total == 0) {
      for (int64_t i = 0; i < d_head; i++) o[i] = 0.0f;
      continue;
    }
    weighted_sum(p, vb, n, d_head, 1.0f / total, o);
  }
}

void attnlab_attend(const float *q, const float *k_new, const float *v_new, float *k_cache,
                    float *v_cache, const uint8_t *key_mask, int64_t mask_stride, float *scores,
                    float *out, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d_head,
                    int64_t max_len, const int64_t *slot_at, float scale, float cap, int threads) {
#pragma omp parallel num_threads(threads) if (rows * heads * (*slot_at + 1) * d_head > 65536)
  attend(q, k_new, v_new, k_cache, v_cache, key_mask, mask_stride, scores, out, rows, heads,
         kv_heads, d_head, max_len, slot_at, scale, cap);
}

/* Causal attention over a whole prompt from position 0 (generation's prefill): softmax(q K^T scale,
 * keys up to the query's own position) V, with grouped-query heads; q, out [batch, T, heads,
 * d_head], k, v [batch, T, kv_heads, d_head], d_head a multiple of TILE_N. Torch's fused CPU
 * attention ran well below the float32 tile product's rate (benchmarks/README.md, issue 25); this
 * one is that product twice per TILE_ROWS_F queries of a head: their scores against
 * blocks of TILE_N keys (K^T laid out once per kv head in scratch), a softmax per row (exp_), then
 * the scores times V, read in place (the scores soft-capped first where `cap` is not 0). scratch:
 * attnlab_attend_rows_scratch bytes. */
int64_t attnlab_attend_rows_scratch(int64_t batch, int64_t T, int64_t kv_heads, int64_t d_head,
                                    int threads) {
  int64_t padded = (T + TILE_N - 1) / TILE_N * TILE_N;
  return (batch * kv_heads * padded * d_head + threads * TILE_ROWS_F * padded) *
         (int64_t)sizeof(float);
}

/* kt [batch, kv_heads, key block, d_head, TILE_N] = each block of TILE_N keys of k [batch, T,
 * kv_heads, d_head] transposed, zeros past the last key; shared out over the threads of the
 * parallel region it is called in (which wait for each other at its end). */
static void lay_out_keys(const float *k, float *kt, int64_t batch, int64_t T, int64_t kv_heads,
                         int64_t d_head) {
  int64_t key_blocks = (T + TILE_N - 1) / TILE_N;
#pragma omp for schedule(static)
  for (int64_t i = 0; i < batch * kv_heads * key_blocks; i++) {
    int64_t bg = i / key_blocks, s0 = i % key_blocks * TILE_N, b = bg / kv_heads, g = bg % kv_heads;
    float *tile = kt + i * d_head * TILE_N;
    for (int64_t j = 0; j < TILE_N; j++)
      for (int64_t c = 0; c < d_head; c++)
        tile[c * TILE_N + j] =
            s0 + j < T ? k[((b * T + s0 + j) * kv_heads + g) * d_head + c] : 0.0f;
  }
}

void attnlab_attend_rows(const float *q, const float *k, const float *v, float *out, float *scratch,
                         int64_t batch, int64_t T, int64_t heads, int64_t kv_heads, int64_t d_head,
                         float scale, float cap, int threads) {
  int64_t padded = (T + TILE_N - 1) / TILE_N * TILE_N, key_blocks = padded / TILE_N,
          group = heads / kv_heads;
  int64_t query_blocks = (T + TILE_ROWS_F - 1) / TILE_ROWS_F;
  /* [batch, kv_heads, key block, d_head, TILE_N]: each block of keys transposed */
  float *kt = scratch;
#pragma omp parallel num_threads(threads)
  {
    float *p = scratch + batch * kv_heads * padded * d_head + this_thread() * TILE_ROWS_F * padded;
    lay_out_keys(k, kt, batch, T, kv_heads, d_head);
    /* the last blocks of queries see the most keys: dynamic, so that the threads end together */
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < batch * heads * query_blocks; i++) {
      int64_t t0 = (query_blocks - 1 - i % query_blocks) * TILE_ROWS_F, bh = i / query_blocks;
      int64_t b = bh / heads, h = bh % heads, g = h / group,
              m = T - t0 < TILE_ROWS_F ? T - t0 : TILE_ROWS_F;
      int64_t n = t0 + m; /* keys that any of these queries sees */
      const float *qr[TILE_ROWS_F], *pr[TILE_ROWS_F];
      for (int64_t r = 0; r < TILE_ROWS_F; r++) { /* rows past the last repeat t0; dropped */
        qr[r] = q + ((b * T + t0 + (r < m ? r : 0)) * heads + h) * d_head;
        pr[r] = p + r * padded;
      }
      float tile_out[TILE_ROWS_F * TILE_N];
      for (int64_t s0 = 0; s0 < n; s0 += TILE_N) {
        f_tile_rows(kt + ((b * kv_heads + g) * key_blocks + s0 / TILE_N) * d_head * TILE_N, TILE_N,
                    d_head, qr, NULL, tile_out);
        for (int64_t r = 0; r < TILE_ROWS_F; r++)
          memcpy(p + r * padded + s0, tile_out + r * TILE_N, sizeof(float) * TILE_N);
      }
      float inv[TILE_ROWS_F];
      for (int64_t r = 0; r < m; r++) { /* query t0 + r sees keys 0 .. t0 + r */
        float *row = p + r * padded, top = -INFINITY, total = 0.0f, by = scale;
        int64_t seen = t0 + r + 1;
        if (cap > 0.0f) { /* the capped scores in place, scaled already */
#pragma omp simd
          for (int64_t s = 0; s < seen; s++) row[s] = soft_cap(row[s] * scale, cap);
          by = 1.0f;
        }
#pragma omp simd reduction(max : top)
        for (int64_t s = 0; s < seen; s++) top = row[s] * by > top ? row[s] * by : top;
#pragma omp simd reduction(+ : total)
        for (int64_t s = 0; s < seen; s++) {
          row[s] = exp_(row[s] * by - top);
          total += row[s];
        }
        for (int64_t s = seen; s < n; s++) row[s] = 0.0f;
        inv[r] = 1.0f / total;
      }
      const float *vh = v + g * d_head + b * T * kv_heads * d_head;
      for (int64_t c0 = 0; c0 < d_head; c0 += TILE_N) {
        f_tile_rows(vh + c0, kv_heads * d_head, n, pr, NULL, tile_out);
        for (int64_t r = 0; r < m; r++)
          for (int64_t j = 0; j < TILE_N; j++)
            out[((b * T + t0 + r) * heads + h) * d_head + c0 + j] =
                tile_out[r * TILE_N + j] * inv[r];
      }
    }
  }
}

/* One block of m queries (t0 ... t0 + m - 1, their rows in qr) against the keys laid out in
 * tiles (keys: this batch row's and KV head's first tile): rows [m, T] = q K^T scale (soft-capped
 * where `cap` is not 0) where query t sees key s (s <= t), -inf elsewhere (apply_mask's value).
 * Shared by attnlab_attend_scores and attnlab_attend_explicit, so the two give the same scores bit
 * for bit. */
static void causal_scores(const float *keys, const float *const *qr, int64_t t0, int64_t m,
                          int64_t T, int64_t d_head, float scale, float cap, float *rows) {
  float tile_out[TILE_ROWS_F * TILE_N];
  for (int64_t s0 = 0; s0 < t0 + m; s0 += TILE_N) { /* the key blocks any of these queries sees */
    f_tile_rows(keys + s0 / TILE_N * d_head * TILE_N, TILE_N, d_head, qr, NULL, tile_out);
    int64_t n = T - s0 < TILE_N ? T - s0 : TILE_N;
    for (int64_t r = 0; r < m; r++)
      for (int64_t j = 0; j < n; j++)
        rows[r * T + s0 + j] = s0 + j <= t0 + r ? tile_out[r * TILE_N + j] * scale : -INFINITY;
    if (cap > 0.0f) /* the seen keys' scores capped (a masked one stays -inf) */
      for (int64_t r = 0; r < m; r++) {
        int64_t seen = t0 + r + 1 - s0 < n ? t0 + r + 1 - s0 : n;
#pragma omp simd
        for (int64_t j = 0; j < seen; j++)
          rows[r * T + s0 + j] = soft_cap(rows[r * T + s0 + j], cap);
      }
  }
  for (int64_t r = 0; r < m; r++) /* the keys no query of the block sees */
    for (int64_t s = (t0 + m + TILE_N - 1) / TILE_N * TILE_N; s < T; s++)
      rows[r * T + s] = -INFINITY;
}

/* A whole prompt's causal attention from position 0 in three steps, so that hooks can read and
 * replace what lies between them (hook_attn_scores, hook_pattern:
 * attnlab.generate.fast_layers.KernelAttention): the scores, the pattern, then the pattern times V;
 * each is attnlab.model.attention's equation on float32 tensors.
 *
 * scores [batch, heads, T, T] = q K^T scale (soft-capped where `cap` is not 0) where query t sees
 * key s (s <= t), -inf elsewhere (apply_mask's value); q [batch, T, heads, d_head], k [batch, T,
 * kv_heads, d_head] (grouped-query); scratch: attnlab_attend_rows_scratch(batch, T, kv_heads,
 * d_head, 1) bytes. */
void attnlab_attend_scores(const float *q, const float *k, float *scores, float *scratch,
                           int64_t batch, int64_t T, int64_t heads, int64_t kv_heads,
                           int64_t d_head, float scale, float cap, int threads) {
  int64_t padded = (T + TILE_N - 1) / TILE_N * TILE_N, key_blocks = padded / TILE_N,
          group = heads / kv_heads;
  int64_t query_blocks = (T + TILE_ROWS_F - 1) / TILE_ROWS_F;
#pragma omp parallel num_threads(threads)
  {
    lay_out_keys(k, scratch, batch, T, kv_heads, d_head);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < batch * heads * query_blocks; i++) {
      int64_t t0 = (query_blocks - 1 - i % query_blocks) * TILE_ROWS_F, bh = i / query_blocks;
      int64_t b = bh / heads, h = bh % heads, g = h / group,
              m = T - t0 < TILE_ROWS_F ? T - t0 : TILE_ROWS_F;
      const float *qr[TILE_ROWS_F];
      for (int64_t r = 0; r < TILE_ROWS_F; r++) /* rows past the last repeat t0; dropped */
        qr[r] = q + ((b * T + t0 + (r < m ? r : 0)) * heads + h) * d_head;
      causal_scores(scratch + (b * kv_heads + g) * key_blocks * d_head * TILE_N, qr, t0, m, T,
                    d_head, scale, cap, scores + (bh * T + t0) * T);
    }
  }
}

/* pattern = softmax over a row of n scores (attention_pattern): exp(x - max) / sum, a row whose
 * scores are all -inf all zeros, and every -inf score exactly 0. The sum is kept in 16 lanes (score
 * s in lane s % 16), so that the trailing blocks of 16 whose scores are all -inf (a causal row's
 * keys after its query: half of a prompt's) add exactly nothing, and are skipped: no exp, zeros
 * written. Not inlined: attnlab_softmax_rows and the fused attention on AMX tiles
 * (attnlab_attend_explicit_amx) share its numbers bit for bit. */
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
void attnlab_softmax_rows(const float *scores, float *pattern, int64_t rows, int64_t n,
                          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; r++) softmax_row(scores + r * n, pattern + r * n, n);
}

/* out [batch, T, heads, d_head] = pattern V: pattern [batch, heads, T, S], v [batch, S, kv_heads,
 * d_head] (grouped-query), d_head a multiple of TILE_N; every key of every row (a hook may have put
 * weight anywhere). */
void attnlab_attend_mix(const float *pattern, const float *v, float *out, int64_t batch, int64_t T,
                        int64_t S, int64_t heads, int64_t kv_heads, int64_t d_head, int threads) {
  int64_t query_blocks = (T + TILE_ROWS_F - 1) / TILE_ROWS_F, group = heads / kv_heads;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t i = 0; i < batch * heads * query_blocks; i++) {
    int64_t t0 = i % query_blocks * TILE_ROWS_F, bh = i / query_blocks, b = bh / heads,
            h = bh % heads;
    int64_t m = T - t0 < TILE_ROWS_F ? T - t0 : TILE_ROWS_F;
    const float *pr[TILE_ROWS_F], *vh = v + (b * S * kv_heads + h / group) * d_head;
    for (int64_t r = 0; r < TILE_ROWS_F; r++) pr[r] = pattern + (bh * T + t0 + (r < m ? r : 0)) * S;
    float tile_out[TILE_ROWS_F * TILE_N];
    for (int64_t c0 = 0; c0 < d_head; c0 += TILE_N) {
      f_tile_rows(vh + c0, kv_heads * d_head, S, pr, NULL, tile_out);
      for (int64_t r = 0; r < m; r++)
        memcpy(out + ((b * T + t0 + r) * heads + h) * d_head + c0, tile_out + r * TILE_N,
               TILE_N * sizeof(float));
    }
  }
}

/* attnlab_attend_scores, attnlab_softmax_rows and attnlab_attend_mix in one call, for hooks between
 * them that only read (run_with_cache): per block of TILE_ROWS_F queries of a head, its scores
 * (written to scores), their pattern (softmax_row, the scores read back from the core's cache) and
 * z = pattern V over the keys the block sees, while its rows are in the cache; the pattern's later
 * keys are a causal softmax's exact zeros, which add nothing to a sum of finite values and are not
 * multiplied (as attnlab_attend_explicit_amx does not). The three calls' numbers, bit for bit. q,
 * out_z [batch, T, heads, d_head], k, v [batch, T, kv_heads, d_head], d_head a multiple of TILE_N;
 * scores and pattern [batch, heads, T, T]; scratch as attnlab_attend_scores's; `cap` its. */
void attnlab_attend_explicit(const float *q, const float *k, const float *v, float *scores,
                             float *pattern, float *out_z, float *scratch, int64_t batch, int64_t T,
                             int64_t heads, int64_t kv_heads, int64_t d_head, float scale,
                             float cap, int threads) {
  int64_t padded = (T + TILE_N - 1) / TILE_N * TILE_N, key_blocks = padded / TILE_N,
          group = heads / kv_heads;
  int64_t query_blocks = (T + TILE_ROWS_F - 1) / TILE_ROWS_F;
#pragma omp parallel num_threads(threads)
  {
    lay_out_keys(k, scratch, batch, T, kv_heads, d_head);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < batch * heads * query_blocks; i++) {
      int64_t t0 = (query_blocks - 1 - i % query_blocks) * TILE_ROWS_F, bh = i / query_blocks;
      int64_t b = bh / heads, h = bh % heads, g = h / group,
              m = T - t0 < TILE_ROWS_F ? T - t0 : TILE_ROWS_F;
      int64_t seen = t0 + m; /* keys that any of these queries sees */
      const float *qr[TILE_ROWS_F], *pr[TILE_ROWS_F];
      float tile_out[TILE_ROWS_F * TILE_N], *rows = scores + (bh * T + t0) * T,
                                            *weights = pattern + (bh * T + t0) * T;
      for (int64_t r = 0; r < TILE_ROWS_F; r++) { /* rows past the last repeat t0; dropped */
        qr[r] = q + ((b * T + t0 + (r < m ? r : 0)) * heads + h) * d_head;
        pr[r] = weights + (r < m ? r : 0) * T;
      }
      /* the scores: attnlab_attend_scores's */
      causal_scores(scratch + (b * kv_heads + g) * key_blocks * d_head * TILE_N, qr, t0, m, T,
                    d_head, scale, cap, rows);
      for (int64_t r = 0; r < m; r++) softmax_row(rows + r * T, weights + r * T, T);
      /* z: attnlab_attend_mix's, over the keys seen */
      const float *vh = v + (b * T * kv_heads + g) * d_head;
      for (int64_t c0 = 0; c0 < d_head; c0 += TILE_N) {
        f_tile_rows(vh + c0, kv_heads * d_head, seen, pr, NULL, tile_out);
        for (int64_t r = 0; r < m; r++)
          memcpy(out_z + ((b * T + t0 + r) * heads + h) * d_head + c0, tile_out + r * TILE_N,
                 TILE_N * sizeof(float));
      }
    }
  }
}
