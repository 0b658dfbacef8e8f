/* A mixture of experts' MLP in the decode step (attnlab.model.moe): the router's choice, the chosen
 * experts' products, and their outputs weighed into the residual stream, as three ops of the step's
 * program around the ordinary kernels (the router's product, SwiGLU's silu_mul, Qwen2-MoE's shared
 * expert as a dense MLP):
 *
 *   p = softmax(W_gate x), w, e = top-k of p, w = w / sum w     attnlab_route
 *   g_j = W_gate^(e_j) x, u_j = W_in^(e_j) x                     attnlab_linear_experts
 *   h_j = silu(g_j) u_j                                          attnlab_silu_mul
 *   y_j = W_out^(e_j) h_j                                        attnlab_linear_experts
 *   x += sum_j w_j y_j + sigmoid(w_s . x) s(x)                   attnlab_weigh_experts
 *
 * The experts' products read each matrix through an indirection, a table of every expert's weights
 * (one row per expert: the product op that multiplies it, OP_LINEAR_F32, OP_LINEAR_I8 or
 * OP_LINEAR_Q, then its weights' address, then its int8 scales' address or its block type |
 * REPACKED) indexed by the router's choice at run time: only the k chosen experts' weights are read
 * (the point of a mixture), each by the decode step's own product for its kind (linear.c,
 * linear_q.c), so an expert kept as Q4_K or Q6_K blocks is multiplied as a dense Q4_K or Q6_K
 * matrix is. A row of the batch is multiplied by each of its k experts in turn (one row per
 * product: the rows of a batch choose their own experts). */
#include "common.h"
#include "vec.h"

/* The router's choice for each of `rows` rows of router logits [rows, n_experts]: their softmax
 * over the experts (float32, attention's softmax_row), in place (the router's scores,
 * hook_expert_weights), its k largest in descending order into weights [rows, k] and their experts
 * into chosen [rows, k] (of equal scores the lowest expert first), the k weights divided by their
 * sum where `normalize` (Mixtral; Qwen's norm_topk_prob). */
void attnlab_route(float *scores, float *weights, int64_t *chosen, int64_t rows, int64_t n_experts,
                   int64_t k, int normalize) {
  for (int64_t r = 0; r < rows; r++) {
    float *probs = scores + r * n_experts;
    softmax_row(probs, probs, n_experts);
    float *w = weights + r * k, sum = 0.0f;
    int64_t *e = chosen + r * k;
    for (int64_t j = 0; j < k; j++) {
      int64_t best = -1;
      for (int64_t i = 0; i < n_experts; i++) {
        int taken = 0;
        for (int64_t m = 0; m < j; m++) taken |= e[m] == i;
        if (!taken && (best < 0 || probs[i] > probs[best])) best = i;
      }
      e[j] = best;
      w[j] = probs[best];
      sum += w[j];
    }
    if (normalize)
      for (int64_t j = 0; j < k; j++) w[j] /= sum;
  }
}

/* The chosen experts' products: y[r, j] = W^(chosen[r, j]) x_rj for each row r < rows and slot j <
 * k, W^(e) the matrix of row e of `table` (above; d_out x d_in), x_rj = x[r] (the experts' W_gate
 * and W_in: every slot reads the row) or, where `x_per_slot`, x[r, j] (W_out: each slot reads its
 * own expert's h_j). x [rows, d_in] or [rows, k, d_in], y [rows, k, d_out]. Inside a parallel
 * region every thread takes its share of each product (the products' own `omp for` and share_of
 * splits, no barrier between them: each writes its own slot of y). `scratch`: the block products'
 * rounding of x, attnlab_linear_q_scratch(1, d_in) bytes per thread; an expert after another of
 * blocks on the same row of x reads the rounding that one made (each thread its own part). A
 * thread's block product prefetches, near its end, its share of the next slot's matrix. */
static void linear_experts(const float *x, const int64_t *table, const int64_t *chosen, float *y,
                           int8_t *scratch, int64_t rows, int64_t k, int64_t d_in, int64_t d_out,
                           int x_per_slot) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t j = 0; j < k; j++) {
      const int64_t *w = table + 3 * chosen[r * k + j];
      const float *xr = x + (x_per_slot ? r * k + j : r) * d_in;
      float *yr = y + (r * k + j) * d_out;
      switch (w[0]) {
      case OP_LINEAR_F32:
        linear_f32(xr, (const float *)(intptr_t)w[1], NULL, yr, 1, d_in, d_out, 0);
        break;
      case OP_LINEAR_I8:
        linear_i8(xr, (const int8_t *)(intptr_t)w[1], (const float *)(intptr_t)w[2], NULL, yr, 1,
                  d_in, d_out, 0);
        break;
      default: { /* OP_LINEAR_Q */
        q_share after = {0, 0, NULL, 0};
        int64_t at = r * k + j + 1; /* the next product's expert, of blocks */
        const int64_t *next = at < rows * k ? table + 3 * chosen[at] : NULL;
        if (next && next[0] == OP_LINEAR_Q) {
          int64_t type = next[2] & ~REPACKED;
          after = share_of((const uint8_t *)(intptr_t)next[1], d_out,
                           d_in / BLOCK_WEIGHTS[type] * BLOCK_BYTES[type],
                           next[2] & REPACKED ? GROUP : ROWS_AT_ONCE);
        }
        /* the last product read the same row of x, and was one of blocks: its rounding is here */
        const int64_t *last = j > 0 ? table + 3 * chosen[r * k + j - 1] : NULL;
        int same_x = !x_per_slot && last && last[0] == OP_LINEAR_Q;
        linear_q(xr, (const uint8_t *)(intptr_t)w[1], NULL, yr, scratch, 1, d_in, d_out, (int)w[2],
                 0, after.start, after.bytes, r == 0 && j == 0, same_x ? scratch : NULL);
      }
      }
    }
}

void attnlab_linear_experts(const float *x, const int64_t *table, const int64_t *chosen, float *y,
                            int8_t *scratch, int64_t rows, int64_t k, int64_t d_in, int64_t d_out,
                            int x_per_slot, int threads) {
#pragma omp parallel num_threads(threads) if (d_in * d_out > 65536)
  linear_experts(x, table, chosen, y, scratch, rows, k, d_in, d_out, x_per_slot);
}

/* The experts' outputs weighed into the residual stream, values [lo, hi) of x [rows, d]: x[r] +=
 * sum_j weights[r, j] y[r, j] (+ sigmoid(shared_gate[r]) shared[r], Qwen2-MoE's shared expert,
 * where `shared` is not NULL), y [rows, k, d]: the mixture summed first, then added, the module's
 * order. Unless `accumulate`, x = the mixture (a sandwich norm's sublayer output, normed before it
 * joins the residual). */
static void weigh_experts(float *x, const float *y, const float *weights, const float *shared,
                          const float *shared_gate, int64_t k, int64_t d, int accumulate,
                          int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; i++) {
    int64_t r = i / d, c = i % d;
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) sum += weights[r * k + j] * y[(r * k + j) * d + c];
    if (shared) sum += times_sigmoid(shared[i], shared_gate[r]);
    x[i] = accumulate ? x[i] + sum : sum;
  }
}

void attnlab_weigh_experts(float *x, const float *y, const float *weights, const float *shared,
                           const float *shared_gate, int64_t rows, int64_t k, int64_t d,
                           int accumulate) {
  weigh_experts(x, y, weights, shared, shared_gate, k, d, accumulate, 0, rows * d);
}
