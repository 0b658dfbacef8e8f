/* What every family of attnlab's C kernels shares: the headers, the instruction-set switches of
 * this build, the constants, the block types and their structs, the rows of x rounded to 8 bits,
 * the op program's enums, and the declarations of the few functions one family calls from a later
 * one.
 *
 * The kernels are plain C compiled at first use once per instruction set (on x86-64: AVX-512 with
 * VNNI, AVX2 with FMA and F16C, portable; elsewhere -march=native), the best one the CPU and the
 * operating system allow chosen at run time (attnlab.generate.kernels and cpu.c). The switches
 * below are what that build's -m flags turned on; every kernel has a portable form that compiles
 * anywhere, and the tests build and check each form (tests/kernel_builds.py). kernels.c includes
 * the family files in order into one translation unit: one compiler call, and the functions a
 * family shares stay `static` (inlined across files as within one). */
#ifndef ATTNLAB_KERNELS_COMMON_H
#define ATTNLAB_KERNELS_COMMON_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

/* The build's instruction sets: AVX512 (F and BW; the build's flags add VL, DQ and VNNI), AMX's
 * bfloat16 tiles (compiled in where the compiler can target them; run only where the CPU and the
 * operating system allow, attnlab_amx_permitted) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define AVX512 1
#else
#define AVX512 0
#endif
#if AVX512 && defined(__x86_64__) && defined(__linux__) && (__GNUC__ >= 11 || __clang_major__ >= 12)
#define AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#else
#define AMX 0
#endif

/* output features computed together: four independent sums per pass over x */
#define ROWS_AT_ONCE 4
/* Bytes of int8 weights asked for ahead of the pass that reads them (see attnlab_linear_i8). The
 * float32 loop computes little per byte and gained nothing from it (benchmarks/README.md, issue
 * 14). */
#define PREFETCH_AHEAD 8192

/* ggml's block types the products multiply (attnlab.quant.blocks), by attnlab_block_type */
typedef enum {
  BLOCK_Q8_0,
  BLOCK_Q4_0,
  BLOCK_Q4_1,
  BLOCK_Q5_0,
  BLOCK_Q4_K,
  BLOCK_Q5_K,
  BLOCK_Q6_K,
} attnlab_block_type;

/* The blocks as ggml-common.h declares them (block_q8_0 and its siblings; gguf-py's quants.py reads
 * the same bytes): an IEEE half d (and Q4_1's m, the K-quants' dmin) and the quants. Packed with no
 * padding (2-byte alignment: a row of blocks is a whole number of them), the sizes asserted below.
 * The products read a block's fields through these; a loop over blocks of any type steps by
 * BLOCK_BYTES[type]. */
#define QK 32 /* weights per block of the 32-weight types, and per sub-block of the K-quants */
#define QK_K 256 /* weights per block of the K-quants */
typedef uint16_t ggml_half;

typedef struct {
  ggml_half d;
  int8_t qs[QK]; /* w = d q */
} block_q8_0;
typedef struct {
  ggml_half d;
  uint8_t qs[QK / 2]; /* weights j and j + 16 in byte j's low and high nibbles; w = d (n - 8) */
} block_q4_0;
typedef struct {
  ggml_half d, m;
  uint8_t qs[QK / 2]; /* as Q4_0's; w = d n + m */
} block_q4_1;
typedef struct {
  ggml_half d;
  uint8_t qh[4]; /* the fifth bit of weight j in bit j */
  uint8_t qs[QK / 2]; /* the low four bits, as Q4_0's; w = d (n - 16) */
} block_q5_0;
typedef struct {
  ggml_half d, dmin;
  uint8_t scales[12]; /* eight 6-bit scales and mins (scale_min_k) */
  uint8_t qs[QK_K / 2]; /* sub-blocks 2i and 2i + 1 in the low and high nibbles of bytes 32i.. */
} block_q4_K;
typedef struct {
  ggml_half d, dmin;
  uint8_t scales[12];
  uint8_t qh[QK_K / 8]; /* bit s of byte j: the fifth bit of weight j of sub-block s */
  uint8_t qs[QK_K / 2]; /* as Q4_K's */
} block_q5_K;
typedef struct {
  uint8_t ql[QK_K / 2]; /* the low four bits */
  uint8_t qh[QK_K / 4]; /* the high two bits */
  int8_t scales[QK_K / 16]; /* one per 16 weights */
  ggml_half d;
} block_q6_K;
_Static_assert(sizeof(block_q8_0) == 34, "block_q8_0 is 34 bytes");
_Static_assert(sizeof(block_q4_0) == 18, "block_q4_0 is 18 bytes");
_Static_assert(sizeof(block_q4_1) == 20, "block_q4_1 is 20 bytes");
_Static_assert(sizeof(block_q5_0) == 22, "block_q5_0 is 22 bytes");
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K is 144 bytes");
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K is 176 bytes");
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K is 210 bytes");

/* the bytes of a 32-weight block before its quants: d, and Q4_1's m (Q8_0's qs and Q5_0's qh follow
 * d as Q4_0's qs do) */
static inline int64_t head_bytes(int type) {
  return type == BLOCK_Q4_1 ? (int64_t)offsetof(block_q4_1, qs) : (int64_t)offsetof(block_q4_0, qs);
}

/* bytes and weights per block, by attnlab_block_type */
static const int64_t BLOCK_BYTES[] = {sizeof(block_q8_0), sizeof(block_q4_0), sizeof(block_q4_1),
                                      sizeof(block_q5_0), sizeof(block_q4_K), sizeof(block_q5_K),
                                      sizeof(block_q6_K)};
static const int64_t BLOCK_WEIGHTS[] = {QK, QK, QK, QK, QK_K, QK_K, QK_K};

/* One row of x rounded to 8 bits per block, as the products read it: q [d_in] int8, dx [blocks], sx
 * [blocks] (dx sum q, Q4_1's offset term), c8 [blocks][8] (-8 times each group of four q: Q4_0's
 * start of the lane sums); for the two-block AVX-512 products (and only in their builds) the same
 * again laid out as they load it, so that a pass loads it without a shuffle: ds [blocks][2] (dx, sx
 * of each block: blocks b and b + 1 in one 128-bit load) and c16 [blocks][8] (c8 with its last
 * four, the high nibbles' lanes, times 16); sq [blocks] (sum q: the 16-row products' start of the
 * lane sums, -8 or -128 times it). A block holding a NaN or an infinity gets dx = NaN, so that its
 * products are NaN, as the float product's. */
typedef struct {
  int8_t *q;
  float *dx, *sx, *ds;
  int32_t *c8, *c16, *sq;
} q8_row;

#define REPACKED 0x100 /* a LINEAR_Q op's type | REPACKED: its weights are in the 16-row layout */
#define GROUP 16

#define TILE_N 32 /* output features per packed tile: two vectors of 16 */
/* rows per register tile, float32 products (tiles_f32.c's f_tile_rows); F_TILES: whether that
 * product runs on this build's vectors (AVX-512, or AVX2 with FMA) or is the compiler's loop */
#if AVX512
#define TILE_ROWS_F 12 /* 24 sums of 16 floats */
#define F_TILES 1
#elif defined(__AVX2__) && defined(__FMA__)
#define TILE_ROWS_F 6 /* 12 sums of 8 floats, for each half of the tile's 32 features */
#define F_TILES 1
#else
#define TILE_ROWS_F 3 /* 12 sums of 8 floats */
#define F_TILES 0
#endif

/* The product's blocking, as BLIS's (its kc, mc and nc): each thread takes a contiguous share of
 * the tiles, F_GROUP of them laid out at a time; the rows go F_PANEL register blocks at a time
 * (a panel of x), each through every tile of the group, their sums over k in pieces of F_KC. So the
 * tile's piece (F_KC x TILE_N floats, 16 KiB on AVX2) stays in the level-1 cache while every block
 * of the panel reads it, where a whole tile (72 KiB at d_in 576) came from level 2 for every
 * block; and the panel of x stays in level 2 for the whole group, where it came from level 3 (or
 * memory) once per tile. AVX-512 keeps its tile-at-a-time pass (F_KC all of k, one tile a
 * group). The pieces add to the same sums bit for bit (tiles_f32.c's f_tile_rows). */
#if AVX512
#define F_KC INT64_MAX
#define F_GROUP 1
#else
#define F_KC 128
#define F_GROUP 4
#endif
#define F_PANEL 12

#if AVX512 && defined(__AVX512VNNI__)
#define ROWS_VNNI 1
/* rows of x per register tile, 8-bit products: 12 integer and 12 float sums */
#define TILE_ROWS_Q 6
#else
#define ROWS_VNNI 0
/* AVX2: 4 rows x 16 features, 8 integer sums, the float sums in the core's cache */
#define TILE_ROWS_Q 4
#endif
#if defined(__AVX2__) && !ROWS_VNNI
#define ROWS_AVX2 1
#else
#define ROWS_AVX2 0
#endif

/* A row of x rounded for the prompt products (quantize_row_q8's numbers): q [d_in] bytes (q + 128
 * as unsigned bytes for VNNI, q signed otherwise), dx [blocks], sx [blocks] (dx sum q) and qs
 * [blocks] (sum q, int32). */
typedef struct {
  uint8_t *q;
  float *dx, *sx;
  int32_t *qs;
} x_row;

/* The MLP's nonlinearities attnlab_activate knows; attnlab.generate.kernels.Activation lists the
 * same names in the same order (tests/test_kernels.py reads this enum and compares). */
typedef enum {
  ACTIVATION_GELU, /* exact, with erf */
  ACTIVATION_GELU_TANH, /* the tanh approximation (GPT-2's gelu_new) */
  ACTIVATION_RELU,
  ACTIVATION_RELU2, /* ReLU² (modded-nanogpt's, the speedrun recipe's and the demo's) */
} attnlab_activation;

/* The kernels a program can hold. attnlab.generate.kernels.Op lists the same names in the same
 * order, each with its attnlab_* function's argument types (tests/test_kernels.py reads this enum
 * and the functions' parameter lists, and compares them with that table). */
typedef enum {
  OP_LINEAR_F32,
  OP_LINEAR_I8,
  OP_ROPE,
  OP_EMBED,
  OP_ATTEND,
  OP_RMS_NORM,
  OP_LAYER_NORM,
  OP_ACTIVATE,
  OP_SILU_MUL,
  OP_SOFTCAP,
  OP_LINEAR_Q,
  OP_EMBED_Q,
  OP_ADD,
  OP_MUL,
  OP_WINDOW_MASK,
  OP_ROUTE,
  OP_LINEAR_EXPERTS,
  OP_WEIGH_EXPERTS,
} attnlab_op_kind;

typedef struct {
  int64_t kind, wait; /* kind: an attnlab_op_kind */
  int64_t a[18];
  double f[2]; /* the float arguments, in order */
} attnlab_op;

#define ARG(i, type) ((type)(intptr_t)op->a[i])

/* defined by a later family (kernels.c's order), called by an earlier one */
static inline float times_sigmoid(float v, float z); /* ops.c */
static void softmax_row(const float *x, float *p, int64_t n); /* attention.c */

#endif
