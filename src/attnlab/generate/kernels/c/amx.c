/* Float32 products on AMX tiles (Sapphire Rapids and later), as accurate as a float32 GEMM.
 *
 * AMX multiplies bfloat16 (8 significant bits) into float32 sums, many times the multiply-adds a
 * cycle of AVX-512's float32 FMAs. A float32 v splits exactly into three bfloat16 parts, v = v1 +
 * v2 + v3 (v1 = v rounded to bfloat16, v2 = what is left rounded again, v3 = the rest, which fits:
 * 24 bits = 3 x 8), and each product of two parts is exact in float32. So x w = sum over i, j of
 * x_i w_j, and the six terms with i + j <= 4 carry everything down to 2^-24 of |x w| (the three
 * left out are at most 2^-25 of it, below float32's own rounding of the product): six `tdpbf16ps`
 * products per tile, summed in float32, give a float32 GEMM's accuracy (the "bf16x6" of Henry, Tang
 * and Heinecke, "Leveraging the bfloat16 Artificial Intelligence Datatype For Higher-Precision
 * Computations", ARITH 2019). On SmolLM2's shapes it is faster than MKL's float32 GEMM where q, k
 * and v share one call (one of them alone is not), with an error against float64 of the same size
 * as MKL's (benchmarks/README.md, "Float32 products on AMX tiles").
 *
 * Layout: x split once per call into A [row tile of 16][32-wide chunk of k][part][16 rows][32 k]
 * (one 1 KB tile each); the weights split a panel of output features at a time (sized to stay in
 * the core's L2) into B [part][tile of 16 features][chunk][16 k pairs][16 features][2] (the pairs
 * layout `tdpbf16ps` reads). Each thread computes 32 x 32 blocks of y: four accumulator tiles, two
 * of x's parts and two of W's loaded at a time (8 tiles, all of them), so that each accumulator
 * takes all six products: 16 tile loads (from L2) per 24 products. Separate accumulators for the
 * small products (1 x 2 blocks of y, 9 loads per 12 products) came closer to float64, but their
 * tile loads bounded the product; the 2 x 2 blocks are faster, their error that of MKL's float32
 * GEMM (benchmarks/README.md, "Float32 products on AMX tiles").
 *
 * AMX needs the operating system's permission per process (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA, Linux 5.16+), besides CPUID's flags and XCR0's tile bits: attnlab_amx_permitted asks
 * for it; attnlab.generate.kernels runs it first in a child process (a fault there costs nothing)
 * and calls attnlab_linear_amx only where it said yes. The tile configuration is loaded with our
 * own `ldtilecfg` statement: GCC 12's _tile_loadconfig declares 8 of its 64 bytes as read, so -O3
 * drops the stores of the rows and widths before it (llama.cpp's fault at ldtilecfg in these
 * virtual machines; ggml-org/llama.cpp#9473). */
#include "common.h"
#include "vec.h"

#define AMX_K 32 /* k per tile row: 32 bfloat16 */
static int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

/* 1 when this process may run AMX's bfloat16 tiles: the build has them, CPUID lists AMX-TILE,
 * AMX-BF16 and AVX512-BF16, the OS enables the tile state in XCR0 and grants this process
 * XTILEDATA; else 0. */
int attnlab_amx_permitted(void) {
#if AMX
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 22) & 1)) return 0;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !((a >> 5) & 1)) return 0;
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & (3u << 17)) != (3u << 17)) return 0; /* XTILECFG and XTILEDATA state */
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) return 0;
  uint64_t granted = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted)) return 0;
  return (granted >> XFEATURE_XTILEDATA) & 1;
#else
  return 0;
#endif
}

/* Output features per panel of packed weights: the fewest panels, a multiple of the threads, whose
 * three parts fit in 1.25 MB (the core's L2 is 2 MB on Sapphire Rapids), 32 at least. */
static int64_t amx_panel(int64_t d_in, int64_t d_out, int threads) {
  int64_t most = (5 << 18) / (round_up(d_in, AMX_K) * 6) / 32 * 32;
  for (int64_t panels = threads;; panels += threads) {
    int64_t p = round_up((d_out + panels - 1) / panels, 32);
    if (p <= most || p == 32) return p;
  }
}

/* The scratch bytes attnlab_linear_amx needs for rows of d_in values and a matrix of d_out
 * features: x's parts, and one panel of W's and a block of y per thread (attnlab_linear_amx_many:
 * the most over its matrices, as a panel's width does not grow with d_out). */
int64_t attnlab_linear_amx_scratch(int64_t rows, int64_t d_in, int64_t d_out, int threads) {
  int64_t kp = round_up(d_in, AMX_K), panel = amx_panel(d_in, d_out, threads);
  return round_up(rows, 32) * kp * 6 + threads * (panel * kp * 6 + 32 * 32 * 4) + 64;
}

/* attnlab_linear_amx_swiglu's panels (both matrices' parts in the 1.25 MB) and scratch bytes: x's
 * parts, and two panels and a block of up per thread. */
static int64_t amx_swiglu_panel(int64_t d_in, int64_t d_out, int threads) {
  return amx_panel(2 * round_up(d_in, AMX_K), d_out, threads);
}

int64_t attnlab_linear_amx_swiglu_scratch(int64_t rows, int64_t d_in, int64_t d_out, int threads) {
  int64_t kp = round_up(d_in, AMX_K), panel = amx_swiglu_panel(d_in, d_out, threads);
  return round_up(rows, 32) * kp * 6 + threads * (2 * panel * kp * 6 + 32 * 32 * 4) + 64;
}

#if AMX
/* 32 floats -> their three bfloat16 parts, 32 each (v = p0 + p1 + p2 exactly: each part v's leading
 * 16 bits, truncated, then what is left of v, whose 24 significant bits the three parts' 8 each
 * hold; an infinite or NaN v gives NaN parts after its first, so a product with it is NaN, where
 * float32's may be infinite). Truncated rather than rounded to nearest (one and, one permute of
 * 16-bit halves, where the rounding took a conversion and two widenings): run_with_cache is faster,
 * the products as accurate (benchmarks/README.md, "run_with_cache past the caches"). */
AMX_TARGET static inline void split_bf16(const float *v, __m512i p[3]) {
  __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const __m512i odd =
      _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                       25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  const __m512i top = _mm512_set1_epi32((int)0xffff0000u);
  for (int part = 0; part < 3; part++) {
    __m512i ta = _mm512_and_si512(_mm512_castps_si512(a), top),
            tb = _mm512_and_si512(_mm512_castps_si512(b), top);
    p[part] = _mm512_permutex2var_epi16(ta, odd, tb);
    a = _mm512_sub_ps(a, _mm512_castsi512_ps(ta));
    b = _mm512_sub_ps(b, _mm512_castsi512_ps(tb));
  }
}

/* 32 values of a row from src (len of them, zeros after; NULL: all zeros) into buf, for split_bf16
 */
static inline const float *row_chunk(const float *src, int64_t len, float *buf) {
  if (src && len == AMX_K) return src;
  memset(buf, 0, AMX_K * sizeof(float));
  if (src) memcpy(buf, src, len * sizeof(float));
  return buf;
}

typedef struct {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} tile_config;

AMX_TARGET static void configure_tiles(void) { /* eight tiles of 16 rows x 64 bytes */
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) cfg.bytes_per_row[t] = 64, cfg.rows[t] = 16;
  __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

#define AMX_TILE 512 /* bfloat16s in a tile: 16 rows of 32 */

/* Rows r0 .. r0 + n - 1 of x's parts (x [rows, d_in], row stride `stride`) into A [row
 * tile][chunk][part][16][32], zeros past the last row and the last k; only the first `used` chunks
 * of k (amx_block's). */
AMX_TARGET static void amx_split_first(const float *x, int64_t stride, int64_t rows, int64_t d_in,
                                       int64_t r0, int64_t n, int64_t used, uint16_t *A) {
  const int64_t chunks = round_up(d_in, AMX_K) / AMX_K, row_tile = chunks * 3 * AMX_TILE;
  for (int64_t r = r0; r < r0 + n; r++)
    for (int64_t c = 0; c < used; c++) {
      float buf[AMX_K];
      int64_t len = d_in - c * AMX_K < AMX_K ? d_in - c * AMX_K : AMX_K;
      __m512i p[3];
      split_bf16(row_chunk(r < rows ? x + r * stride + c * AMX_K : NULL, len, buf), p);
      for (int part = 0; part < 3; part++)
        _mm512_store_si512(A + (r / 16) * row_tile + (c * 3 + part) * AMX_TILE + (r % 16) * 32,
                           p[part]);
    }
}

/* amx_split_first for every chunk of k */
AMX_TARGET static void amx_split_rows(const float *x, int64_t stride, int64_t rows, int64_t d_in,
                                      int64_t r0, int64_t n, uint16_t *A) {
  amx_split_first(x, stride, rows, d_in, r0, n, round_up(d_in, AMX_K) / AMX_K, A);
}

/* r[i] lane j <- r[j] lane i for 16 x 16 32-bit lanes, in registers: pairs of lanes, pairs of
 * pairs, then 128-bit quarters (in place of gathers, which were amx_pack's bound) */
AMX_TARGET static inline void transpose_16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; i++) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; i++) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

/* W's parts for its features o0 .. o0 + features - 1 into B [part][feature tile][chunk][16 k
 * pairs][16][2] (the pairs layout), features padded to 32 with zeros; W [d_out, d_in] by rows of k
 * (row stride `stride`: a Linear's weight, keys) or, `by_k`, [d_in, d_out] by rows of features (V).
 * Returns the stride between parts; *third: whether any of these weights has a third part (none
 * does where every weight has at most 16 significant bits, as the float32 values of a GGUF file's
 * 4-bit blocks: amx_block then leaves out x1 w3, a product of zeros, which changes no sum). */
AMX_TARGET static int64_t amx_pack(const float *w, int64_t stride, int by_k, int64_t d_in,
                                   int64_t o0, int64_t features, uint16_t *B, int *third) {
  const int64_t chunks = round_up(d_in, AMX_K) / AMX_K, feature_tiles = round_up(features, 32) / 16;
  const int64_t part_stride = feature_tiles * chunks * AMX_TILE;
  __m512i any = _mm512_setzero_si512(); /* the third parts' bits, or-ed */
  for (int64_t ft = 0; ft < feature_tiles; ft++)
    for (int64_t c = 0; c < chunks; c++) {
      int64_t len = d_in - c * AMX_K < AMX_K ? d_in - c * AMX_K : AMX_K;
      if (by_k) { /* two rows of k at a time: their 16 features' parts, interleaved into pairs */
        const __m512i pairs =
            _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                             22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        for (int64_t pair = 0; pair < 16; pair++) {
          float buf[AMX_K] = {0};
          for (int e = 0; e < 2; e++) {
            int64_t k = c * AMX_K + 2 * pair + e,
                    n = features - ft * 16 < 16 ? features - ft * 16 : 16;
            if (k < d_in && n > 0)
              memcpy(buf + 16 * e, w + k * stride + o0 + ft * 16, n * sizeof(float));
          }
          __m512i p[3];
          split_bf16(buf, p);
          any = _mm512_or_si512(any, p[2]);
          for (int part = 0; part < 3; part++)
            _mm512_store_si512(B + part * part_stride + (ft * chunks + c) * AMX_TILE + pair * 32,
                               _mm512_permutexvar_epi16(pairs, p[part]));
        }
        continue;
      }
      /* [part][feature]: the feature's 16 pairs of k, each pair one 32-bit lane */
      __m512i parts[3][16];
      for (int64_t j = 0; j < 16; j++) {
        float buf[AMX_K];
        int64_t o = ft * 16 + j;
        __m512i p[3];
        split_bf16(row_chunk(o < features ? w + (o0 + o) * stride + c * AMX_K : NULL, len, buf), p);
        for (int part = 0; part < 3; part++) parts[part][j] = p[part];
        any = _mm512_or_si512(any, p[2]);
        /* the next 16 features' chunk: 16 rows read across are 16 streams */
        if (o + 16 < features) {
          _mm_prefetch((const char *)(w + (o0 + o + 16) * stride + c * AMX_K), _MM_HINT_T0);
          _mm_prefetch((const char *)(w + (o0 + o + 16) * stride + c * AMX_K) + 64, _MM_HINT_T0);
        }
      }
      for (int part = 0; part < 3; part++) { /* tile row: the pair of each feature's k */
        uint16_t *dst = B + part * part_stride + (ft * chunks + c) * AMX_TILE;
        transpose_16x16(parts[part]);
        for (int pair = 0; pair < 16; pair++)
          _mm512_store_si512(dst + pair * 32, parts[part][pair]);
      }
    }
  /* a part that is a signed zero (0x8000) is no weight either */
  *third = _mm512_test_epi16_mask(any, _mm512_set1_epi16(0x7fff)) != 0;
  return part_stride;
}

/* out [32][ld] = the 32 x 32 block of x W^T at row tile rt and feature tile ft (both even) of A and
 * B (above), rows ld floats apart, from the first `used` of the chunks of k (the rest known to be
 * zeros in x: a causal pattern's); without x1 w3 where W has no third part (amx_pack's *third) */
AMX_TARGET static void amx_block(const uint16_t *A, const uint16_t *B, int64_t part_stride,
                                 int64_t chunks, int64_t used, int third, int64_t rt, int64_t ft,
                                 float *out, int64_t ld) {
  const int64_t row_tile = chunks * 3 * AMX_TILE, next_features = chunks * AMX_TILE;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < used; c++) {
    const uint16_t *x1 = A + rt * row_tile + c * 3 * AMX_TILE, *x2 = x1 + AMX_TILE,
                   *x3 = x2 + AMX_TILE;
    const uint16_t *w1 = B + (ft * chunks + c) * AMX_TILE, *w2 = w1 + part_stride,
                   *w3 = w2 + part_stride;
    /* tiles 0-3: y's 2 x 2 block; 4, 5: x's part for row tiles rt, rt + 1; 6, 7: W's for ft, ft + 1
     */
#define AMX_PRODUCTS                                                                               \
  _tile_dpbf16ps(0, 4, 6);                                                                         \
  _tile_dpbf16ps(1, 4, 7);                                                                         \
  _tile_dpbf16ps(2, 5, 6);                                                                         \
  _tile_dpbf16ps(3, 5, 7)
    _tile_loadd(4, x1, 64);
    _tile_loadd(5, x1 + row_tile, 64);
    _tile_loadd(6, w1, 64);
    _tile_loadd(7, w1 + next_features, 64);
    AMX_PRODUCTS; /* x1 w1 */
    _tile_loadd(6, w2, 64);
    _tile_loadd(7, w2 + next_features, 64);
    AMX_PRODUCTS; /* x1 w2 */
    _tile_loadd(4, x2, 64);
    _tile_loadd(5, x2 + row_tile, 64);
    AMX_PRODUCTS; /* x2 w2 */
    _tile_loadd(6, w1, 64);
    _tile_loadd(7, w1 + next_features, 64);
    AMX_PRODUCTS; /* x2 w1 */
    _tile_loadd(4, x3, 64);
    _tile_loadd(5, x3 + row_tile, 64);
    AMX_PRODUCTS; /* x3 w1 */
    if (third) {
      _tile_loadd(4, x1, 64);
      _tile_loadd(5, x1 + row_tile, 64);
      _tile_loadd(6, w3, 64);
      _tile_loadd(7, w3 + next_features, 64);
      AMX_PRODUCTS; /* x1 w3 */
    }
#undef AMX_PRODUCTS
  }
  _tile_stored(0, out, ld * 4);
  _tile_stored(1, out + 16, ld * 4);
  _tile_stored(2, out + 16 * ld, ld * 4);
  _tile_stored(3, out + 16 * ld + 16, ld * 4);
}

/* Outputs of at least this many floats (64 MB) are written with streaming stores; smaller ones,
 * which their next step reads back from the caches, through a block in L1, unless the caller says
 * that y is on pages no cache holds (`fresh`: a run_with_cache's cache, on attnlab.memory's blocks,
 * where a line read before its write is a read from memory for nothing). Streaming every output
 * slowed the head-patching sweep, and tiles stored straight into y were slower than through L1
 * (benchmarks/README.md, "run_with_cache in fewer passes over memory" and "run_with_cache past the
 * caches"). */
#define AMX_STREAM_FROM (16 << 20)

/* n floats from src to dst past the caches (streaming stores) where dst is on a cache line and n a
 * multiple of 16, else copied: a result no step reads back soon, kept in the core's cache while it
 * was being made. */
AMX_TARGET static inline void store_past_caches(float *dst, const float *src, int64_t n) {
  if ((uintptr_t)dst % 64 == 0 && n % 16 == 0) {
    for (int64_t j = 0; j < n; j += 16) _mm512_stream_ps(dst + j, _mm512_loadu_ps(src + j));
    return;
  }
  memcpy(dst, src, n * sizeof(float));
}

/* y_i [rows, d_out[i]] = x [rows, d_in] W_i^T + b_i for the n float32 matrices W_i [d_out[i], d_in]
 * (b_i may be NULL), on AMX tiles (above), x split once for all of them (a layer's q, k and v, or
 * its gate and up); only where attnlab_amx_permitted() said 1. One parallel region; the threads
 * share each matrix's panels in turn. scratch: the most of attnlab_linear_amx_scratch's bytes over
 * the d_out[i]; fresh: the y_i are on pages no cache holds (AMX_STREAM_FROM). */
AMX_TARGET void attnlab_linear_amx_many(const float *x, int64_t n, const float *const *w,
                                        const float *const *b, float *const *y,
                                        const int64_t *d_out, int8_t *scratch, int64_t rows,
                                        int64_t d_in, int fresh, int threads) {
  if (rows <= 0) return;
  const int64_t kp = round_up(d_in, AMX_K), chunks = kp / AMX_K,
                row_tiles = round_up(rows, 32) / 16;
  int64_t most = 0;
  for (int64_t i = 0; i < n; i++) {
    int64_t p = amx_panel(d_in, d_out[i], threads);
    most = p > most ? p : most;
  }
  uint16_t *A = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  int8_t *per_thread = (int8_t *)(A + row_tiles * chunks * 3 * AMX_TILE);
  const int64_t thread_bytes = most * kp * 6 + 32 * 32 * 4;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t rt = 0; rt < row_tiles; rt++) amx_split_rows(x, d_in, rows, d_in, rt * 16, 16, A);
    configure_tiles();
    uint16_t *B = (uint16_t *)(per_thread + this_thread() * thread_bytes);
    float *out = (float *)(B + most * kp * 3);
    for (int64_t i = 0; i < n; i++) {
      const int64_t panel = amx_panel(d_in, d_out[i], threads),
                    panels = (d_out[i] + panel - 1) / panel;
#pragma omp for schedule(static) nowait
      for (int64_t pi = 0; pi < panels; pi++) {
        const int64_t o0 = pi * panel, features = d_out[i] - o0 < panel ? d_out[i] - o0 : panel;
        int third;
        const int64_t part_stride = amx_pack(w[i], d_in, 0, d_in, o0, features, B, &third);
        const int stream = !b[i] && (fresh || rows * d_out[i] >= AMX_STREAM_FROM);
        for (int64_t rt = 0; rt < row_tiles; rt += 2)
          for (int64_t ft = 0; ft < round_up(features, 32) / 16; ft += 2) {
            const int64_t r0 = rt * 16, f0 = ft * 16;
            const int64_t m = rows - r0 < 32 ? rows - r0 : 32,
                          cols = features - f0 < 32 ? features - f0 : 32;
            amx_block(A, B, part_stride, chunks, chunks, third, rt, ft, out, 32);
            for (int64_t r = 0; r < m; r++) {
              float *yr = y[i] + (r0 + r) * d_out[i] + o0 + f0;
              if (stream) /* no bias, y too large for any cache (the LM head's logits) or on pages
                           * none holds
                           * (`fresh`): from L1 into y past the caches, W's panel left in L2 */
                store_past_caches(yr, out + r * 32, cols);
              else
                for (int64_t j = 0; j < cols; j++)
                  yr[j] = out[r * 32 + j] + (b[i] ? b[i][o0 + f0 + j] : 0.0f);
            }
          }
      }
    }
    _mm_sfence(); /* the streamed stores seen before the region's end */
    _tile_release();
  }
}

/* SwiGLU's two products and its product of them, where the hook on the gate only reads
 * (run_with_cache): gate = x W_gate^T and post = silu(gate) * (x W_up^T), no biases, both [rows,
 * d_out]; x split once, each panel of features packed from both matrices (half as wide as
 * attnlab_linear_amx_many's, so that both stay in L2) and each 32 x 32 block's product taken while
 * its gate and up are in L1, where attnlab_silu_mul_up_rows read both back from memory.
 * attnlab_linear_amx_many's gate and attnlab_silu_mul_up_rows's post, bit for bit. scratch:
 * attnlab_linear_amx_swiglu_scratch bytes. */
AMX_TARGET void attnlab_linear_amx_swiglu(const float *x, const float *w_gate, const float *w_up,
                                          float *gate, float *post, int8_t *scratch, int64_t rows,
                                          int64_t d_in, int64_t d_out, int fresh, int threads) {
  if (rows <= 0) return;
  const int64_t kp = round_up(d_in, AMX_K), chunks = kp / AMX_K,
                row_tiles = round_up(rows, 32) / 16;
  const int64_t panel = amx_swiglu_panel(d_in, d_out, threads),
                panels = (d_out + panel - 1) / panel;
  uint16_t *A = (uint16_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
  int8_t *per_thread = (int8_t *)(A + row_tiles * chunks * 3 * AMX_TILE);
  const int64_t thread_bytes = 2 * panel * kp * 6 + 32 * 32 * 4;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t rt = 0; rt < row_tiles; rt++) amx_split_rows(x, d_in, rows, d_in, rt * 16, 16, A);
    configure_tiles();
    uint16_t *Bg = (uint16_t *)(per_thread + this_thread() * thread_bytes),
             *Bu = Bg + panel * kp * 3;
    float *out = (float *)(Bu + panel * kp * 3), g[32 * 32];
#pragma omp for schedule(static)
    for (int64_t pi = 0; pi < panels; pi++) {
      const int64_t o0 = pi * panel, features = d_out - o0 < panel ? d_out - o0 : panel;
      int third_gate, third_up;
      const int64_t part_stride = amx_pack(w_gate, d_in, 0, d_in, o0, features, Bg, &third_gate);
      amx_pack(w_up, d_in, 0, d_in, o0, features, Bu, &third_up);
      for (int64_t rt = 0; rt < row_tiles; rt += 2)
        for (int64_t ft = 0; ft < round_up(features, 32) / 16; ft += 2) {
          const int64_t r0 = rt * 16, f0 = ft * 16;
          const int64_t m = rows - r0 < 32 ? rows - r0 : 32,
                        cols = features - f0 < 32 ? features - f0 : 32;
          amx_block(A, Bg, part_stride, chunks, chunks, third_gate, rt, ft, g, 32);
          amx_block(A, Bu, part_stride, chunks, chunks, third_up, rt, ft, out, 32);
          for (int64_t r = 0; r < m; r++) {
            float *gr = gate + (r0 + r) * d_out + o0 + f0, *pr = post + (r0 + r) * d_out + o0 + f0;
            const float *gb = g + r * 32;
            float *ub = out + r * 32;
#pragma omp simd
            for (int64_t j = 0; j < 32; j++) ub[j] = times_sigmoid(gb[j], gb[j]) * ub[j];
            if (fresh) { /* on pages no cache holds: past the caches (AMX_STREAM_FROM) */
              store_past_caches(gr, gb, cols);
              store_past_caches(pr, ub, cols);
            } else {
              memcpy(gr, gb, cols * sizeof(float));
              memcpy(pr, ub, cols * sizeof(float));
            }
          }
        }
    }
    _mm_sfence(); /* the streamed stores seen before the region's end */
    _tile_release();
  }
}

#else
void attnlab_linear_amx_many(const float *x, int64_t n, const float *const *w,
                             const float *const *b, float *const *y, const int64_t *d_out,
                             int8_t *scratch, int64_t rows, int64_t d_in, int fresh, int threads) {
  (void)x, (void)n, (void)w, (void)b, (void)y, (void)d_out, (void)scratch, (void)rows, (void)d_in,
      (void)fresh;
  (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}

void attnlab_linear_amx_swiglu(const float *x, const float *w_gate, const float *w_up, float *gate,
                               float *post, int8_t *scratch, int64_t rows, int64_t d_in,
                               int64_t d_out, int fresh, int threads) {
  (void)x, (void)w_gate, (void)w_up, (void)gate, (void)post, (void)scratch, (void)rows, (void)d_in,
      (void)d_out;
  (void)fresh, (void)threads;
  abort(); /* never called: attnlab_amx_permitted() is 0 in this build */
}
#endif

/* y [rows, d_out] = x [rows, d_in] W^T + b (b may be NULL): attnlab_linear_amx_many for one matrix.
 */
void attnlab_linear_amx(const float *x, const float *w, const float *b, float *y, int8_t *scratch,
                        int64_t rows, int64_t d_in, int64_t d_out, int threads) {
  attnlab_linear_amx_many(x, 1, &w, &b, &y, &d_out, scratch, rows, d_in, 0, threads);
}
