/* The decode step's product with weights in ggml's blocks: x rounded to 8 bits per block of 32,
 * then each thread's share of four output features (or of 16-row groups) at a time, streaming their
 * rows once with software prefetches; and the blocks' float32 values for a prompt's products. */
#include "common.h"
#include "vec.h"

/* This thread's share of a block product of d_out rows of row_bytes each: groups of four rows [g0,
 * g1), the same contiguous split as OpenMP's static schedule, so that the thread also knows where
 * its share of the next product begins (below). */
typedef struct {
  int64_t g0, g1;
  const uint8_t *start; /* its first weight byte */
  int64_t bytes; /* and how many follow */
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

/* y[r, o] (=, or += when accumulate) sum_i x[r, i] w[o, i] + b[o] for w in blocks of `type`: each
 * thread rounds x to 8 bits into its own part of `scratch` (attnlab_linear_q_scratch bytes per
 * thread; cheaper than making the threads wait for one copy), then takes
 * its share of four output features at a time, streaming their rows once.
 *
 * Prefetched in software, PREFETCH_AHEAD bytes ahead of the rows being read: on some hosts the
 * hardware prefetchers barely help, and without these prefetches the products ran far below the
 * memory's speed (benchmarks/README.md, issue 25). Near the end of its share a thread's
 * prefetches run on into `next`, its share of the product that the decode program runs after this
 * one (next_bytes bytes; NULL: none), so that the next product's first rows are on their way while
 * this one ends, the barrier passes and the small ops between run; a prefetch past the share's end
 * would otherwise fetch rows another thread has already read. `prologue` asks for the share's first
 * PREFETCH_AHEAD bytes at once, for a product that no earlier one prefetched for. `rounded`: the
 * scratch of the product just before this one, which read the same x (q, k and v; the MLP's two
 * input products): each thread's rounding of x is already there, in its own part, and is read
 * instead of made again (NULL: round x here). `type | REPACKED`: the weights are in the 16-row
 * layout (attnlab_repack16), a thread's share whole groups of 16 rows, each multiplied at once
 * (dot16_q, Q4_K's dot16_q_k). */
static void linear_q(const float *x, const uint8_t *w, const float *b, float *y, int8_t *scratch,
                     int64_t rows, int64_t d_in, int64_t d_out, int type, int accumulate,
                     const uint8_t *next, int64_t next_bytes, int prologue, int8_t *rounded) {
#ifdef _OPENMP
  int64_t t = omp_get_thread_num();
#else
  int64_t t = 0;
#endif
  int repacked = (type & REPACKED) != 0; /* the 16-row layout: whole groups of 16 rows, dot16_q */
  type &= ~REPACKED;
  int64_t group = repacked ? GROUP : ROWS_AT_ONCE;
  int64_t nb = d_in / QK, row_bytes = d_in / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type],
          per_row = q8_row_bytes(d_in);
  /* (16 rows' blocks take 16 rows' bytes: the same offsets) */
  q_share mine_w = share_of(w, d_out, row_bytes, group);
  if (prologue)
    for (int64_t off = 0; off < mine_w.bytes && off < PREFETCH_AHEAD; off += 64)
      __builtin_prefetch((const char *)mine_w.start + off, 0, 3);
  int8_t *mine = (rounded ? rounded : scratch) + t * rows * per_row;
  if (!rounded)
    for (int64_t r = 0; r < rows; r++)
      quantize_row_q8(x + r * d_in, d_in, q8_row_at(mine + r * per_row, d_in));
  for (int64_t g = mine_w.g0; g < mine_w.g1; g++) {
    int64_t o = g * group, n = d_out - o < group ? d_out - o : group;
    /* the file's layout: a last group of fewer than four rows repeats its first row in the missing
     * ones and stores only n sums */
    const uint8_t *w4[ROWS_AT_ONCE];
    if (!repacked)
      for (int k = 0; k < ROWS_AT_ONCE; k++) w4[k] = w + (o + (k < n ? k : 0)) * row_bytes;
    for (int64_t at = (g - mine_w.g0) * group * row_bytes + PREFETCH_AHEAD,
                 end = at + group * row_bytes;
         at < end; at += 64) { /* at: bytes from the share's start */
      if (at < mine_w.bytes)
        __builtin_prefetch((const char *)mine_w.start + at, 0, 3);
      else if (next && at - mine_w.bytes < next_bytes)
        __builtin_prefetch((const char *)next + (at - mine_w.bytes), 0, 3);
    }
    for (int64_t r = 0; r < rows; r++) {
      float sums[GROUP];
      q8_row q = q8_row_at(mine + r * per_row, d_in);
      if (repacked) switch (type) { /* one loop per type, its constants folded */
        case BLOCK_Q8_0:
          dot16_q(BLOCK_Q8_0, w + o * row_bytes, q, nb, sums);
          break;
        case BLOCK_Q4_0:
          dot16_q(BLOCK_Q4_0, w + o * row_bytes, q, nb, sums);
          break;
        case BLOCK_Q5_0:
          dot16_q(BLOCK_Q5_0, w + o * row_bytes, q, nb, sums);
          break;
        case BLOCK_Q4_K:
          dot16_q_k(w + o * row_bytes, q, nb, sums);
          break;
        default:
          dot16_q(BLOCK_Q4_1, w + o * row_bytes, q, nb, sums);
          break;
        }
      else if (type >= BLOCK_Q5_0) /* Q5_0 and the K-quants */
        dot4_q_more(type, w4, q, nb, sums);
      else
        switch (type) {
        case BLOCK_Q8_0:
          dot4_q(BLOCK_Q8_0, w4, q, nb, sums);
          break;
        case BLOCK_Q4_0:
          dot4_q(BLOCK_Q4_0, w4, q, nb, sums);
          break;
        default:
          dot4_q(BLOCK_Q4_1, w4, q, nb, sums);
          break;
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

void attnlab_linear_q(const float *x, const uint8_t *w, const float *b, float *y, int8_t *scratch,
                      int64_t rows, int64_t d_in, int64_t d_out, int type, int accumulate,
                      int threads) {
#pragma omp parallel num_threads(threads) if (d_in * d_out > 65536)
  linear_q(x, w, b, y, scratch, rows, d_in, d_out, type, accumulate, NULL, 0, 1, NULL);
}

/* out [rows, d_in] = the float32 values of rows of blocks of `type`
 * (attnlab.quant.blocks.dequantize's formulas), for a prompt's products, which then run as a
 * float32 GEMM. Equal to that reference bit for bit whatever the compiler fuses: d n, d (n - 8) and
 * d q are exact in float32 (an 11-bit by an 8-bit significand), so only the one addition of Q4_1's
 * m rounds. */
void attnlab_dequantize(const uint8_t *w, float *out, int64_t rows, int64_t d_in, int type,
                        int threads) {
  int64_t nb = d_in / QK, bytes = BLOCK_BYTES[type];
  if (type >= BLOCK_Q5_0) {
    int64_t n = rows * d_in / BLOCK_WEIGHTS[type];
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d_in > 65536)
    for (int64_t i = 0; i < n; i++)
      dequantize_more(type, w + i * bytes, out + i * BLOCK_WEIGHTS[type]);
    return;
  }
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * d_in > 65536)
  for (int64_t i = 0; i < rows * nb; i++) {
    const uint8_t *p = w + i * bytes;
    const block_q8_0 *p8 = (const block_q8_0 *)p; /* (d comes first in all three) */
    const block_q4_0 *p40 = (const block_q4_0 *)p;
    const block_q4_1 *p41 = (const block_q4_1 *)p;
    float *o = out + i * QK, d = half_at(&p8->d);
    if (type == BLOCK_Q8_0) {
      for (int j = 0; j < QK; j++) o[j] = d * (float)p8->qs[j];
    } else if (type == BLOCK_Q4_0) {
      for (int j = 0; j < QK / 2; j++) {
        o[j] = d * (float)((p40->qs[j] & 15) - 8);
        o[j + QK / 2] = d * (float)((p40->qs[j] >> 4) - 8);
      }
    } else {
      float m = half_at(&p41->m);
      for (int j = 0; j < QK / 2; j++) {
        o[j] = d * (float)(p41->qs[j] & 15) + m;
        o[j + QK / 2] = d * (float)(p41->qs[j] >> 4) + m;
      }
    }
  }
}
