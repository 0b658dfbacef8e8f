/* A whole decode step in one parallel region: the op program's interpreter (attnlab_run) and
 * greedy generation with no Python between tokens (attnlab_generate_greedy).
 *
 * Called kernel by kernel, a step opened one OpenMP parallel region per product and made a Python
 * call per kernel: between products the threads went to sleep and woke again, and the step took
 * well over the time of its products alone (benchmarks/README.md, issue 14). Here the step is a
 * program, an array of attnlab_op, and `attnlab_run` opens one region for all of it: every thread
 * walks the program, takes its share of each product and attention (`omp for`), one thread takes
 * each small serial kernel (`omp single`), and they wait for each other (`omp barrier`) only after
 * an op whose output the next reads (`wait`). Threads stay hot for the whole step, as in
 * llama.cpp's thread pool (ggml_graph_compute: one barrier per graph node).
 *
 * An op's `kind` names its kernel (attnlab_op_kind); its `a` holds the kernel's arguments in the
 * order of its attnlab_* function (addresses and integers as 64-bit values; the float arguments,
 * where there are any, in `f` in their order, their slots in `a` unused; the `threads` argument
 * unused: the program's own count applies). */

#include "common.h"
#include "vec.h"

/* [lo, hi): this thread's share of n elementwise values, in whole cache lines */
static void share(int64_t n, int64_t *lo, int64_t *hi) {
#ifdef _OPENMP
  int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
  int64_t t = 0, nt = 1;
#endif
  int64_t chunk = ((n + nt - 1) / nt + 15) / 16 * 16;
  *lo = t * chunk < n ? t * chunk : n;
  *hi = *lo + chunk < n ? *lo + chunk : n;
}

/* run_op's `next`: the block product that the program runs after this op (NULL: none); `first`:
 * whether this op is the program's first block product (linear_q's prologue); `rounded`: where this
 * thread's rounding of the op's x already is (linear_q's; NULL: none). */
static void run_op(const attnlab_op *op, const attnlab_op *next, int first, int8_t *rounded) {
  int64_t lo, hi;
  switch (op->kind) {
  case OP_LINEAR_F32:
    linear_f32(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *), ARG(3, float *),
               op->a[4], op->a[5], op->a[6], (int)op->a[7]);
    break;
  case OP_LINEAR_I8:
    linear_i8(ARG(0, const float *), ARG(1, const int8_t *), ARG(2, const float *),
              ARG(3, const float *), ARG(4, float *), op->a[5], op->a[6], op->a[7], (int)op->a[8]);
    break;
  case OP_ROPE:
#pragma omp single nowait
    attnlab_rope(ARG(0, float *), ARG(1, const float *), ARG(2, const float *),
                 ARG(3, const int64_t *), op->a[4], op->a[5], op->a[6], op->a[7]);
    break;
  case OP_EMBED:
#pragma omp single nowait
    attnlab_embed(ARG(0, const int64_t *), ARG(1, const float *), ARG(2, const int64_t *),
                  ARG(3, const float *), ARG(4, float *), op->a[5], op->a[6], (float)op->f[0]);
    break;
  case OP_ATTEND:
    attend(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *), ARG(3, float *),
           ARG(4, float *), ARG(5, const uint8_t *), op->a[6], ARG(7, float *), ARG(8, float *),
           op->a[9], op->a[10], op->a[11], op->a[12], op->a[13], ARG(14, const int64_t *),
           (float)op->f[0], (float)op->f[1]);
    break;
  case OP_RMS_NORM:
#pragma omp single nowait
    attnlab_rms_norm(ARG(0, const float *), ARG(1, const float *), ARG(2, float *), op->a[3],
                     op->a[4], (float)op->f[0]);
    break;
  case OP_LAYER_NORM:
#pragma omp single nowait
    attnlab_layer_norm(ARG(0, const float *), ARG(1, const float *), ARG(2, const float *),
                       ARG(3, float *), op->a[4], op->a[5], (float)op->f[0]);
    break;
  case OP_ACTIVATE:
    share(op->a[1], &lo, &hi);
    attnlab_activate(ARG(0, float *) + lo, hi - lo, (int)op->a[2]);
    break;
  case OP_SILU_MUL:
    share(op->a[2], &lo, &hi);
    attnlab_silu_mul(ARG(0, float *) + lo, ARG(1, const float *) + lo, hi - lo);
    break;
  case OP_SOFTCAP:
    share(op->a[1], &lo, &hi);
    attnlab_softcap(ARG(0, float *) + lo, hi - lo, (float)op->f[0]);
    break;
  case OP_EMBED_Q:
#pragma omp single nowait
    attnlab_embed_q(ARG(0, const int64_t *), ARG(1, const uint8_t *), ARG(2, float *), op->a[3],
                    op->a[4], (int)op->a[5], (float)op->f[0]);
    break;
  case OP_ADD:
    share(op->a[2], &lo, &hi);
    attnlab_add(ARG(0, float *) + lo, ARG(1, const float *) + lo, hi - lo);
    break;
  case OP_MUL:
    share(op->a[2], &lo, &hi);
    attnlab_mul(ARG(0, float *) + lo, ARG(1, const float *) + lo, hi - lo);
    break;
  case OP_WINDOW_MASK:
#pragma omp single nowait
    attnlab_window_mask(ARG(0, uint8_t *), ARG(1, const uint8_t *), ARG(2, const int64_t *),
                        op->a[3], op->a[4], op->a[5]);
    break;
  case OP_ROUTE:
#pragma omp single nowait
    attnlab_route(ARG(0, float *), ARG(1, float *), ARG(2, int64_t *), op->a[3], op->a[4], op->a[5],
                  (int)op->a[6]);
    break;
  case OP_LINEAR_EXPERTS:
    linear_experts(ARG(0, const float *), ARG(1, const int64_t *), ARG(2, const int64_t *),
                   ARG(3, float *), ARG(4, int8_t *), op->a[5], op->a[6], op->a[7], op->a[8],
                   (int)op->a[9]);
    break;
  case OP_WEIGH_EXPERTS:
    share(op->a[5] * op->a[7], &lo, &hi);
    weigh_experts(ARG(0, float *), ARG(1, const float *), ARG(2, const float *),
                  ARG(3, const float *), ARG(4, const float *), op->a[6], op->a[7], (int)op->a[8],
                  lo, hi);
    break;
  case OP_LINEAR_Q: {
    /* this thread's share of the next product, which linear_q prefetches */
    q_share after = {0, 0, NULL, 0};
    if (next) {
      /* (16 rows' blocks take the bytes of 16 rows: the same offsets) */
      int64_t type = next->a[8] & ~REPACKED;
      after = share_of((const uint8_t *)(intptr_t)next->a[1], next->a[7],
                       next->a[6] / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type],
                       next->a[8] & REPACKED ? GROUP : ROWS_AT_ONCE);
    }
    linear_q(ARG(0, const float *), ARG(1, const uint8_t *), ARG(2, const float *), ARG(3, float *),
             ARG(4, int8_t *), op->a[5], op->a[6], op->a[7], (int)op->a[8], (int)op->a[9],
             after.start, after.bytes, first, rounded);
    break;
  }
  }
}

/* The body of a program's parallel region: every thread walks the ops (attnlab_run above) */
static void run_program(const attnlab_op *ops, int64_t n) {
  int first = 1; /* no block product yet */
  /* the scratch holding the last op's rounding of its x, when it was a block product */
  int8_t *rounding = NULL;
  for (int64_t i = 0; i < n; i++) {
    const attnlab_op *op = ops + i, *next = NULL;
    int8_t *rounded = NULL;
    if (op->kind == OP_LINEAR_Q) {
      for (int64_t j = i + 1; j < n && !next; j++)
        if (ops[j].kind == OP_LINEAR_Q) next = ops + j;
      /* the block product right before this one read the same rows of x: its rounding of them is
       * read again (nothing ran in between that could have written x) */
      if (rounding && op[-1].a[0] == op->a[0] && op[-1].a[5] == op->a[5] && op[-1].a[6] == op->a[6])
        rounded = rounding;
    }
    run_op(op, next, first && op->kind == OP_LINEAR_Q, rounded);
    first = first && op->kind != OP_LINEAR_Q;
    rounding = op->kind != OP_LINEAR_Q ? NULL : rounded ? rounded : (int8_t *)(intptr_t)op->a[4];
    if (ops[i].wait) {
#pragma omp barrier
    }
  }
}

void attnlab_run(const attnlab_op *ops, int64_t n, int threads) {
#pragma omp parallel num_threads(threads)
  run_program(ops, n);
}

/* The index of the largest of v[0..n): the first one where several are equal, the first NaN where
 * there is one (torch.argmax's choices). A vectorised pass for the maximum, then a scan for its
 * first place. */
static int64_t argmax_first(const float *v, int64_t n) {
  float m = -INFINITY;
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < n; i++) {
    m = v[i] > m ? v[i] : m;
    nan |= v[i] != v[i];
  }
  for (int64_t i = 0; i < n; i++)
    if (nan ? v[i] != v[i] : v[i] == m) return i;
  return 0; /* n == 0, or every value -inf: torch's choice too */
}

/* Greedy generation with no Python between tokens (attnlab.generate.loop.generate, temperature 0):
 * `tokens` times, each row's next token is the argmax of its logits [rows, vocab] (those of the
 * prompt when this is called, then each step's), written to out[r * out_stride + i]; then, unless
 * it was the last, it becomes the step program's input: ids[r] = token, position[r] += 1, slot[0]
 * += 1, key_mask[r, slot] = 1 (key_mask may be NULL: no padding), and the program (the decode step,
 * whose last op is the LM head writing `logits`) runs, all inside one parallel region, the threads
 * waiting for each other at the program's barriers and around the choice. With eos >= 0, a row that
 * produced eos (done[r], kept across calls by the caller) gives eos from then on, and generation
 * stops once every row has: the number of tokens written is returned (generate fills the rest with
 * eos, as its Python loop does). The same arithmetic as the Python loop, op for op: the tokens are
 * equal. */
int64_t attnlab_generate_greedy(const attnlab_op *ops, int64_t n, int threads, int64_t tokens,
                                const float *logits, int64_t rows, int64_t vocab, int64_t *ids,
                                int64_t *position, int64_t *slot, uint8_t *key_mask,
                                int64_t max_len, int64_t *out, int64_t out_stride, int64_t eos,
                                uint8_t *done) {
  int64_t made = 0;
#pragma omp parallel num_threads(threads)
  for (int64_t i = 0; i < tokens; i++) {
#pragma omp single
    { /* (the single's end is a barrier: every thread sees the choice and `made`) */
      int all_done = eos >= 0;
      for (int64_t r = 0; r < rows; r++) {
        int64_t token = argmax_first(logits + r * vocab, vocab);
        if (eos >= 0) {
          if (done[r]) token = eos;
          done[r] |= token == eos;
          all_done = all_done && done[r];
        }
        out[r * out_stride + i] = token;
        ids[r] = token;
      }
      made = all_done || i == tokens - 1 ? -(i + 1) : i + 1; /* negative: stop after this token */
      if (made > 0) {
        slot[0] += 1;
        for (int64_t r = 0; r < rows; r++) {
          position[r] += 1;
          if (key_mask) key_mask[r * max_len + slot[0]] = 1;
        }
      }
    }
    if (made < 0) break;
    run_program(ops, n);
#pragma omp barrier /* the logits are whole before the next choice reads them */
  }
  return made < 0 ? -made : made;
}
