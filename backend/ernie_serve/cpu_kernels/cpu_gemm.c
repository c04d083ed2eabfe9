/* The float GEMM of the CPU serving path, at every row count; int8 / int4 weights go to cpu_qgemm.c.
 *
 *   y[M, N] = x[M, K] @ W[K, N]      (the dense Linears, lm_head and the routed experts in serving layout)
 *
 * W is float32 (bits 32) or bfloat16 (bits 16, --dtype bfloat16: its bits held as 16-bit integers); a bfloat16
 * weight is widened to float32 as it is streamed (a shift: bf16 is a float32's high half) and multiplied in
 * float32, so a step reads half the bytes for the same float32 arithmetic on x.
 *
 * Why: at decode a weight is read once per step for a handful of rows, so the step is bound by weight bytes, and
 * Paddle's matmul over [K, N] streams them well below the memory's bandwidth; at prefill sizes this kernel still
 * beats MKL (README "Benchmarks": scripts/bench_decode_step.py splits a decode step by kernel).
 *
 * Layout: W is held column-blocked, [ceil(N/32), K, 32] (the last block zero-padded), not [K, N]: a thread's
 * 32-column task then streams one contiguous K*32-float run instead of 32 floats from each of K rows N apart.
 * Columns are split across the OpenMP threads of the runtime Paddle itself uses (linked against its libiomp5, so
 * the two never compete for the cores). Built by build.py on first use.
 */
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"
#include "qgemm.h"
#include "threads.h"
#include "vec_math.h"

#define COLS 32  /* columns per thread task: two 16-float vectors */
#ifdef __AVX512F__
#define ROWS 8   /* rows per register block: 16 accumulators of AVX-512's 32 registers */
#else
#define ROWS 3   /* AVX2's 16 registers: 6 vf16 accumulators (12 halves) and a weight row (4 halves) */
#endif

/* A column-blocked weight, or one column block of it: float32 values, or bfloat16 ones (bf16 set). */
typedef struct {
    const void *p;
    int bf16;
} blocked_w;

static inline blocked_w weight_of(const void *p, int bits) {
    blocked_w w = {p, bits == 16};
    return w;
}

/* Element i of a weight, as float32. */
static inline float weight_at(blocked_w w, int64_t i) {
    return w.bf16 ? bf16_to_f32(((const uint16_t *)w.p)[i]) : ((const float *)w.p)[i];
}

#ifdef ERNIE_VF16
/* Row k of a column block as two vectors of 16 floats. */
static inline void row_of_32(const float *w, int k, vf16 *w0, vf16 *w1) {
    *w0 = vf16_load(w + (int64_t)k * COLS);
    *w1 = vf16_load(w + (int64_t)k * COLS + 16);
}

static inline void row_of_32_bf16(const uint16_t *w, int k, vf16 *w0, vf16 *w1) {
    *w0 = vf16_load_bf16(w + (int64_t)k * COLS);
    *w1 = vf16_load_bf16(w + (int64_t)k * COLS + 16);
}

/* One block of `mb` rows (a compile-time constant in each instance, so the accumulators stay in registers)
 * and the COLS columns whose weights (of type WT, read by ROW) are the contiguous [K, COLS] run at w
 * -> y[m * ldy + j]. */
#define BLOCK(NAME, mb, WT, ROW)                                                                            \
static void NAME(const float *x, int K, const WT *w, int64_t ldy, float *y) {                               \
    vf16 a0[mb], a1[mb];                                                                                    \
    for (int m = 0; m < mb; m++) { a0[m] = vf16_zero(); a1[m] = vf16_zero(); }                              \
    for (int k = 0; k < K; k++) {                                                                           \
        vf16 w0, w1;                                                                                        \
        ROW(w, k, &w0, &w1);                                                                                \
        for (int m = 0; m < mb; m++) {                                                                      \
            vf16 xv = vf16_set1(x[(int64_t)m * K + k]);                                                     \
            a0[m] = vf16_fmadd(xv, w0, a0[m]);                                                              \
            a1[m] = vf16_fmadd(xv, w1, a1[m]);                                                              \
        }                                                                                                   \
    }                                                                                                       \
    for (int m = 0; m < mb; m++) {                                                                          \
        vf16_store(y + m * ldy, a0[m]);                                                                     \
        vf16_store(y + m * ldy + 16, a1[m]);                                                                \
    }                                                                                                       \
}
typedef void (*block_fn)(const float *, int, const float *, int64_t, float *);
typedef void (*block_bf16_fn)(const float *, int, const uint16_t *, int64_t, float *);
#define BLOCKS(P, WT, ROW)                                                                                  \
BLOCK(P##1, 1, WT, ROW) BLOCK(P##2, 2, WT, ROW) BLOCK(P##3, 3, WT, ROW) BLOCK(P##4, 4, WT, ROW)             \
BLOCK(P##5, 5, WT, ROW) BLOCK(P##6, 6, WT, ROW) BLOCK(P##7, 7, WT, ROW) BLOCK(P##8, 8, WT, ROW)
BLOCKS(block_, float, row_of_32)
BLOCKS(block_bf16_, uint16_t, row_of_32_bf16)
static const block_fn blocks[9] = {0, block_1, block_2, block_3, block_4, block_5, block_6, block_7, block_8};
static const block_bf16_fn blocks_bf16[9] = {0, block_bf16_1, block_bf16_2, block_bf16_3, block_bf16_4, block_bf16_5,
                                             block_bf16_6, block_bf16_7, block_bf16_8};
#endif

/* Columns [n0, n1) plainly (a last block narrower than COLS) -> y[m * ldy + n - n0]. */
static void columns_plain(const float *x, int M, int K, blocked_w w, int64_t ldy, float *y, int n0, int n1) {
    for (int m = 0; m < M; m++)
        for (int n = n0; n < n1; n++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc += x[(int64_t)m * K + k] * weight_at(w, ((int64_t)(n / COLS) * K + k) * COLS + n % COLS);
            y[m * ldy + n - n0] = acc;
        }
}

#ifdef ERNIE_VF16
/* A bfloat16 column block [K, COLS] widened into this thread's float32 scratch `slot` (0 or 1: SwiGLU holds its
 * gate and up blocks at once; kept and grown, never freed: one pair per kernel thread), or NULL out of memory. */
static const float *widened_block(const uint16_t *w, int K, int slot) {
    static _Thread_local float *scratch[2];
    static _Thread_local int64_t capacity[2];
    const int64_t n = (int64_t)K * COLS;
    if (n > capacity[slot]) {  /* 64-byte aligned: vector loads split across cache lines slowed prefill markedly */
        float *grown = aligned_alloc(64, sizeof(float) * n);  /* n is a multiple of COLS: a whole number of lines */
        if (!grown) return NULL;
        free(scratch[slot]);
        scratch[slot] = grown;
        capacity[slot] = n;
    }
    for (int64_t i = 0; i < n; i += 16) vf16_store(scratch[slot] + i, vf16_load_bf16(w + i));
    return scratch[slot];
}
#endif

/* Column block b of w, as its row blocks read it. A bfloat16 block with more than one register block of rows
 * (prefill) is widened once (into scratch `slot`) and read as float32, instead of widening every weight row again
 * for each block of rows: the widening costs about what the FMAs of one row block do. */
static blocked_w block_source(blocked_w w, int K, int b, int M, int slot) {
    const int64_t at = (int64_t)b * K * COLS;
    blocked_w src = {w.bf16 ? (const void *)((const uint16_t *)w.p + at) : (const void *)((const float *)w.p + at),
                     w.bf16};
#ifdef ERNIE_VF16
    const float *wide = w.bf16 && M > ROWS ? widened_block(src.p, K, slot) : NULL;
    if (wide) {
        src.p = wide;
        src.bf16 = 0;
    }
#endif
    return src;
}

/* Rows [0, M) of x times one full column block -> y[m * ldy + j], j < COLS. */
static void rows_times_block(const float *x, int M, int K, blocked_w src, int64_t ldy, float *y) {
#ifdef ERNIE_VF16
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        int mb = M - m0 < ROWS ? M - m0 : ROWS;
        if (src.bf16)
            blocks_bf16[mb](x + (int64_t)m0 * K, K, src.p, ldy, y + m0 * ldy);
        else
            blocks[mb](x + (int64_t)m0 * K, K, src.p, ldy, y + m0 * ldy);
    }
#else
    for (int m = 0; m < M; m++)
        for (int j = 0; j < COLS; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += x[(int64_t)m * K + k] * weight_at(src, (int64_t)k * COLS + j);
            y[m * ldy + j] = acc;
        }
#endif
}

/* Rows [0, M) of x times column block b (a full one) -> y[m * ldy + j], j < COLS. */
static void column_block(const float *x, int M, int K, blocked_w w, int64_t ldy, float *y, int b) {
    rows_times_block(x, M, K, block_source(w, K, b, M, 0), ldy, y);
}

static void gemm(const float *x, int M, int K, blocked_w w, int N, float *y) {
    #pragma omp parallel for THREADS schedule(static)
    for (int b = 0; b < N / COLS; b++) column_block(x, M, K, w, N, y + b * COLS, b);
    if (N % COLS) columns_plain(x, M, K, w, N, y + N / COLS * COLS, N / COLS * COLS, N);
}

/* Every routed expert of a MoE layer in one call: y[starts[e] + m] = x[starts[e] + m] @ W_e for m < rows[e]
 * (rows of x [*, K] and y [*, N]; a padded [E, cap] batch has starts[e] = e * cap, a packed one the running sum of
 * rows). w[e] points at each expert's column-blocked weight. The threads split the (expert, column block) pairs, so
 * a step's many expert matmuls, small at decode or mid-sized in a step mixing decodes and a prefill chunk, become
 * one parallel loop instead of a call per expert. */
static void moe_gemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K,
                     const void *const *w, int bits, int N, float *y) {
    const int nb = N / COLS, chunk = ernie_task_chunk(rows, E, nb);
    #pragma omp parallel for THREADS schedule(static, chunk)
    for (int task = 0; task < E * nb; task++) {
        int e = task / nb;
        column_block(x + starts[e] * K, (int)rows[e], K, weight_of(w[e], bits), N, y + starts[e] * N + task % nb * COLS,
                     task % nb);
    }
    if (N % COLS)
        for (int e = 0; e < E; e++)
            columns_plain(x + starts[e] * K, (int)rows[e], K, weight_of(w[e], bits), N,
                          y + starts[e] * N + N / COLS * COLS, N / COLS * COLS, N);
}

/* The SwiGLU MLP's first matmul with its activation fused: W is [K, 2I] with the gate half first, and
 * y[m, j] = silu(g[m, j]) * u[m, j] for [g | u] = x @ W, y [M, I]. Each task computes gate block b and up block b
 * into two tiles and writes their product, so the [M, 2I] projection is never stored and read back (at decode it was
 * a separate pass per MLP). Needs I % 32 == 0 (swiglu_fits). */
static int swiglu_fits(int N) { return N % (2 * COLS) == 0; }

int ernie_gemm_swiglu_fits(int N) { return swiglu_fits(N); }

static void swiglu_rows(const float *x, int M, int K, blocked_w w, int N, float *y, int b) {
    const int I = N / 2, nb = I / COLS;
    float g[ROWS * COLS], u[ROWS * COLS];
    const blocked_w gate = block_source(w, K, b, M, 0), up = block_source(w, K, b + nb, M, 1);
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        int mb = M - m0 < ROWS ? M - m0 : ROWS;
        const float *xm = x + (int64_t)m0 * K;
        rows_times_block(xm, mb, K, gate, COLS, g);
        rows_times_block(xm, mb, K, up, COLS, u);
        for (int m = 0; m < mb; m++)
            silu_mul_row(g + m * COLS, u + m * COLS, y + (int64_t)(m0 + m) * I + b * COLS, COLS);
    }
}

static int is_float(int bits) { return bits == 32 || bits == 16; }

/* y = x @ W * scale: float32 / bfloat16 W (bits 32 / 16, s NULL) here, int8 / int4 codes (bits 8 / 4) in
 * cpu_qgemm.c, where int_x says x is integer-valued already (w4a8). swiglu: y [M, N / 2] as above. Returns 0, or -1
 * out of memory. */
int ernie_gemm(const float *x, int M, int K, const void *w, int N, const float *s, float *y, int bits, int swiglu,
               int int_x) {
    if (!is_float(bits)) return ernie_qgemm(x, M, K, w, N, s, y, bits, swiglu, int_x);
    const blocked_w wb = weight_of(w, bits);
    if (!swiglu) {
        gemm(x, M, K, wb, N, y);
        return 0;
    }
    #pragma omp parallel for THREADS schedule(static)
    for (int b = 0; b < N / 2 / COLS; b++) swiglu_rows(x, M, K, wb, N, y, b);
    return 0;
}

/* moe_gemm above (or cpu_qgemm.c's for int codes), or with swiglu each expert's rows -> y rows of width N / 2. */
int ernie_moe_gemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K, const void *const *w,
                   int N, const float *const *s, float *y, int bits, int swiglu, int int_x) {
    if (!is_float(bits))
        return ernie_moe_qgemm(x, rows, starts, E, K, (const uint8_t *const *)w, N, s, y, bits, swiglu, int_x);
    if (!swiglu) {
        moe_gemm(x, rows, starts, E, K, w, bits, N, y);
        return 0;
    }
    const int nb = N / 2 / COLS, chunk = ernie_task_chunk(rows, E, nb);
    #pragma omp parallel for THREADS schedule(static, chunk)
    for (int task = 0; task < E * nb; task++) {
        int e = task / nb;
        swiglu_rows(x + starts[e] * K, (int)rows[e], K, weight_of(w[e], bits), N, y + starts[e] * N / 2, task % nb);
    }
    return 0;
}

/* Keep (v, j) over (*bv, *bj) as NumPy's argmax ranks them: the larger value, the lower index among equals, and the
 * first NaN above everything. *bj < 0: nothing kept yet. */
static inline void keep_best(float v, int64_t j, float *bv, int64_t *bj) {
    if (*bj < 0 || v > *bv || (v != v && *bv == *bv)) {
        *bv = v;
        *bj = j;
    }
}

/* Rank the first `width` columns of a [M, COLS] tile holding columns col0.. of y into each row's best. */
static void rank_tile(const float *tile, int M, int width, int64_t col0, float *bv, int64_t *bj) {
    for (int m = 0; m < M; m++) {
        const float *r = tile + m * COLS;
#ifdef ERNIE_VF16
        /* Most tiles hold nothing above the row's best so far: two vector compares decide that. NaN is "not <="
         * too, so a NaN always takes the exact path; a best that is NaN already stays. */
        if (width == COLS && bj[m] >= 0 && !vf16_any_above_or_nan(vf16_load(r), bv[m])
            && !vf16_any_above_or_nan(vf16_load(r + 16), bv[m]))
            continue;
#endif
        for (int j = 0; j < width; j++) keep_best(r[j], col0 + j, &bv[m], &bj[m]);
    }
}

/* Each row's argmax and max over the first n_valid columns of y = x @ W (float32 / bfloat16 W, bits 32 / 16, in the
 * column-blocked layout), without storing y: each thread computes its contiguous run of column blocks into its own
 * [M, COLS] tile and ranks the tile while it is in L1. A greedy step needs no more of the lm_head; the [M, N] logits
 * would otherwise be written and read back cold (256 rows x 4096 columns: a 4 MB pass). best_idx / best_val: [M].
 * Returns 0, or -1 out of memory. */
int ernie_gemm_argmax(const float *x, int M, int K, const void *wp, int N, int n_valid, int64_t *best_idx,
                      float *best_val, int bits) {
    const int nb = N / COLS, threads = ernie_threads();
    const blocked_w w = weight_of(wp, bits);
    float *tiles = malloc(sizeof(float) * (size_t)threads * M * COLS + sizeof(float) * (size_t)threads * M);
    int64_t *part_idx = malloc(sizeof(int64_t) * (size_t)threads * M);
    if (!tiles || !part_idx) {
        free(tiles);
        free(part_idx);
        return -1;
    }
    float *part_val = tiles + (size_t)threads * M * COLS;
    for (int64_t i = 0; i < (int64_t)threads * M; i++) part_idx[i] = -1;
    #pragma omp parallel THREADS
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int t = 0, nt = 1;
#endif
        float *tile = tiles + (size_t)t * M * COLS, *bv = part_val + (size_t)t * M;
        int64_t *bj = part_idx + (size_t)t * M;
        const int b0 = (int)((int64_t)nb * t / nt), b1 = (int)((int64_t)nb * (t + 1) / nt);
        for (int b = b0; b < b1 && b * COLS < n_valid; b++) {
            column_block(x, M, K, w, COLS, tile, b);
            rank_tile(tile, M, n_valid - b * COLS < COLS ? n_valid - b * COLS : COLS, (int64_t)b * COLS, bv, bj);
        }
    }
    for (int m = 0; m < M; m++) {  /* the threads' runs in column order */
        best_idx[m] = -1;
        for (int t = 0; t < threads; t++)
            if (part_idx[(size_t)t * M + m] >= 0)
                keep_best(part_val[(size_t)t * M + m], part_idx[(size_t)t * M + m], &best_val[m], &best_idx[m]);
    }
    if (n_valid > nb * COLS) {  /* then a last block narrower than COLS, in the first tile (free now) */
        columns_plain(x, M, K, w, COLS, tiles, nb * COLS, n_valid);
        rank_tile(tiles, M, n_valid - nb * COLS, (int64_t)nb * COLS, best_val, best_idx);
    }
    free(tiles);
    free(part_idx);
    return 0;
}
