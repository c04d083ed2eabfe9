/* The float GEMM of the CPU serving path, at every row count; int8 / int4 weights go to cpu_qgemm.c.
 *
 *   y[M, N] = x[M, K] @ W[K, N]      (the dense Linears, lm_head and the routed experts in serving layout)
 *
 * W is float32 (bits 32) or bfloat16 (bits 16, --dtype bfloat16: its bits held as 16-bit integers); a bfloat16
 * weight is widened to float32 as it is streamed (a shift: bf16 is a float32's high half) and multiplied in
 * float32, so a step reads half the bytes for the same float32 arithmetic on x. On a CPU with AMX (cpu_amx.c) and
 * K % 32 == 0, x is rounded to bfloat16 too, once a call, and the tile unit multiplies the two in bfloat16 with
 * float32 accumulation, as vLLM-CPU and FastDeploy compute bfloat16 there.
 *
 * Why: at decode a weight is read once per step for a handful of rows, so the step is bound by weight bytes, and
 * Paddle's matmul over [K, N] streams them well below the memory's bandwidth; at prefill sizes this kernel still
 * beats MKL (scripts/bench_decode_step.py splits a decode step by kernel; docs/cpu-backend.md).
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

#include "amx.h"
#include "kernels.h"
#include "qgemm.h"
#include "threads.h"
#include "vec_math.h"

#define COLS 32  /* columns per thread task (a column block) */

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

/* The rows a GEMM multiplies: float32, and where bfloat16 weights run on AMX (rows_for) the same values rounded to
 * bfloat16 at the same element offsets (h; NULL otherwise). */
typedef struct {
    const float *f;
    const uint16_t *h;
} rows_x;

static inline rows_x rows_at(rows_x x, int64_t offset) {
    rows_x r = {x.f + offset, x.h ? x.h + offset : NULL};
    return r;
}

/* The `rows` rows of one expert's weight at x + offset: on AMX only when the expert has enough of them (on_amx), so an
 * expert's rows are multiplied alike whichever call they come in. */
static inline rows_x expert_rows(rows_x x, int64_t offset, int64_t rows) {
    rows_x r = rows_at(x, offset);
    if (rows < AMX_ROWS) r.h = NULL;
    return r;
}

/* Element i of x as the GEMM multiplies it. */
static inline float x_at(rows_x x, int64_t i) { return x.h ? bf16_to_f32(x.h[i]) : x.f[i]; }

#ifdef ERNIE_VF16
/* Register tiles: `mb` rows x `nv` native vectors of a column block's columns, accumulated over all of K in
 * registers. Each accumulator is its own variable: GCC kept an array of them on the stack, a store after every FMA,
 * which halved AVX2's rate. ROWS x 2 accumulators, the weight row's vectors and a broadcast fit the register file. */
#ifdef __AVX512F__
typedef vf16 vn;    /* a native vector: vec16.h's vf16 is AVX-512's own */
#define VN 16       /* its floats */
#define ROWS 8      /* 16 accumulators of AVX-512's 32 registers */
#define WIDE_ROWS 8 /* every tile spans all COLS columns (two native vectors) */
#define WIDE_UP_TO(bf16) INT32_MAX
#define vn_load vf16_load
#define vn_load_bf16 vf16_load_bf16
#define vn_set1 vf16_set1
#define vn_zero vf16_zero
#define vn_fmadd vf16_fmadd
#define vn_store vf16_store
#else
typedef __m256 vn;
#define VN 8
#define ROWS 6      /* 12 accumulators, 2 weight vectors and a broadcast: 15 of AVX2's 16 registers */
#define WIDE_ROWS 3 /* whole-block tiles: 12 accumulators, the weights read as FMA operands */
/* How many rows at most take the block whole; more take it in two 16-column halves. float32: up to 16, a decode
 * step's sizes: a float32 half is every other 64-byte line of the block's rows, and where the weights come from
 * memory once a step two strided passes were slower than 3-row tiles re-reading the block from L2 (engine A/B:
 * scripts/bench_kernels_ab.py --workload mixed --dtype float32 re-checks it). bfloat16: up to 2 (its halves share
 * each line; a whole-block tile of 3 rows spills an accumulator as it widens four vectors a row). */
#define WIDE_UP_TO(bf16) ((bf16) ? 2 : 16)
static inline vn vn_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vn vn_load_bf16(const uint16_t *p) { return bf16_8(p); }
static inline vn vn_set1(float x) { return _mm256_set1_ps(x); }
static inline vn vn_zero(void) { return _mm256_setzero_ps(); }
static inline vn vn_fmadd(vn a, vn b, vn c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vn_store(float *p, vn v) { _mm256_storeu_ps(p, v); }
#endif

#define TILE_FMA(m)                                                                                         \
    if (rows > m) {                                                                                         \
        const vn b = vn_set1(x[(int64_t)m * K + k]);                                                        \
        c##m##0 = vn_fmadd(b, w0, c##m##0);                                                                 \
        c##m##1 = vn_fmadd(b, w1, c##m##1);                                                                 \
        if (vecs > 2) {                                                                                     \
            c##m##2 = vn_fmadd(b, w2, c##m##2);                                                             \
            c##m##3 = vn_fmadd(b, w3, c##m##3);                                                             \
        }                                                                                                   \
    }
#define TILE_STORE(m)                                                                                       \
    if (rows > m) {                                                                                         \
        vn_store(y + m * ldy, c##m##0);                                                                     \
        vn_store(y + m * ldy + VN, c##m##1);                                                                \
        if (vecs > 2) {                                                                                     \
            vn_store(y + m * ldy + 2 * VN, c##m##2);                                                        \
            vn_store(y + m * ldy + 3 * VN, c##m##3);                                                        \
        }                                                                                                   \
    }
/* x [mb, K] (row stride K) times the nv * VN columns whose weights (of type WT, read by LOAD) start at w, row k at
 * w + k * COLS -> y[m * ldy + j]. mb and nv are constants in each instance, so the unused accumulators vanish. */
#define TILE(NAME, mb, nv, WT, LOAD)                                                                        \
static void NAME(const float *x, int K, const WT *w, int64_t ldy, float *y, const char *pf, int pf_step) {  \
    enum { rows = mb, vecs = nv };                                                                          \
    vn c00 = vn_zero(), c01 = c00, c02 = c00, c03 = c00, c10 = c00, c11 = c00, c12 = c00, c13 = c00;        \
    vn c20 = c00, c21 = c00, c22 = c00, c23 = c00, c30 = c00, c31 = c00, c32 = c00, c33 = c00;              \
    vn c40 = c00, c41 = c00, c42 = c00, c43 = c00, c50 = c00, c51 = c00, c52 = c00, c53 = c00;              \
    vn c60 = c00, c61 = c00, c62 = c00, c63 = c00, c70 = c00, c71 = c00, c72 = c00, c73 = c00;              \
    for (int k = 0; k < K; k++) {                                                                           \
        const WT *r = w + (int64_t)k * COLS;                                                                \
        if (pf)                                                                                             \
            for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pf + (int64_t)k * pf_step + o, _MM_HINT_T1);   \
        const vn w0 = LOAD(r), w1 = LOAD(r + VN);                                                           \
        const vn w2 = nv > 2 ? LOAD(r + 2 * VN) : w0, w3 = nv > 2 ? LOAD(r + 3 * VN) : w1;                  \
        TILE_FMA(0) TILE_FMA(1) TILE_FMA(2) TILE_FMA(3) TILE_FMA(4) TILE_FMA(5) TILE_FMA(6) TILE_FMA(7)     \
    }                                                                                                       \
    TILE_STORE(0) TILE_STORE(1) TILE_STORE(2) TILE_STORE(3) TILE_STORE(4) TILE_STORE(5) TILE_STORE(6)       \
    TILE_STORE(7)                                                                                           \
}
typedef void (*tile_fn)(const float *, int, const float *, int64_t, float *, const char *, int);
typedef void (*tile_bf16_fn)(const float *, int, const uint16_t *, int64_t, float *, const char *, int);
#define TILES(P, WT, LOAD)                                                                                  \
TILE(P##1, 1, 2, WT, LOAD) TILE(P##2, 2, 2, WT, LOAD) TILE(P##3, 3, 2, WT, LOAD) TILE(P##4, 4, 2, WT, LOAD) \
TILE(P##5, 5, 2, WT, LOAD) TILE(P##6, 6, 2, WT, LOAD)
TILES(tile_, float, vn_load)
TILES(tile_bf16_, uint16_t, vn_load_bf16)
#ifdef __AVX512F__
TILE(tile_7, 7, 2, float, vn_load) TILE(tile_8, 8, 2, float, vn_load)
TILE(tile_bf16_7, 7, 2, uint16_t, vn_load_bf16) TILE(tile_bf16_8, 8, 2, uint16_t, vn_load_bf16)
/* [wide][mb]: two native vectors span the block, so wide and narrow tiles are the same */
static const tile_fn tiles[2][ROWS + 1] = {
    {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8},
    {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8}};
static const tile_bf16_fn tiles_bf16[2][ROWS + 1] = {
    {0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4, tile_bf16_5, tile_bf16_6, tile_bf16_7, tile_bf16_8},
    {0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4, tile_bf16_5, tile_bf16_6, tile_bf16_7, tile_bf16_8}};
#else
TILE(wide_1, 1, 4, float, vn_load) TILE(wide_2, 2, 4, float, vn_load) TILE(wide_3, 3, 4, float, vn_load)
TILE(wide_bf16_1, 1, 4, uint16_t, vn_load_bf16) TILE(wide_bf16_2, 2, 4, uint16_t, vn_load_bf16)
/* [wide][mb]: half-block tiles (16 columns), and whole-block ones of up to WIDE_ROWS rows */
static const tile_fn tiles[2][ROWS + 1] = {{0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6},
                                           {0, wide_1, wide_2, wide_3}};
static const tile_bf16_fn tiles_bf16[2][ROWS + 1] = {
    {0, tile_bf16_1, tile_bf16_2, tile_bf16_3, tile_bf16_4, tile_bf16_5, tile_bf16_6},
    {0, wide_bf16_1, wide_bf16_2}};
#endif
#else
#define ROWS 8
#endif

/* Columns [n0, n1) plainly (a last block narrower than COLS) -> y[m * ldy + n - n0]. */
static void columns_plain(rows_x x, int M, int K, blocked_w w, int64_t ldy, float *y, int n0, int n1) {
    for (int m = 0; m < M; m++)
        for (int n = n0; n < n1; n++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++)
                acc += x_at(x, (int64_t)m * K + k) * weight_at(w, ((int64_t)(n / COLS) * K + k) * COLS + n % COLS);
            y[m * ldy + n - n0] = acc;
        }
}

/* Column block b of w. */
static blocked_w block_of(blocked_w w, int K, int b) {
    const int64_t at = (int64_t)b * K * COLS;
    blocked_w block = {w.bf16 ? (const void *)((const uint16_t *)w.p + at) : (const void *)((const float *)w.p + at),
                       w.bf16};
    return block;
}

#ifdef __AVX512F__
#define ONE_TILE_PREFETCH 1
#else
#define ONE_TILE_PREFETCH 0
#endif
/* Rows [0, M) of x times one full column block -> y[m * ldy + j], j < COLS: tiles of up to WIDE_ROWS rows over the
 * whole block when M is at most WIDE_UP_TO, else tiles of up to ROWS rows over each half of it. The rows are split
 * evenly (4 as 2 + 2, not 3 + 1): a one-row tile has too few accumulators to hide the FMA latency.
 *
 * `next` (or NULL): the block this thread reads after this one, prefetched while this one is multiplied, each tile
 * taking an equal share of it spread over its K steps. At decode a block is multiplied from L2 by a tile every few
 * rows; without the prefetch the memory stream runs during the first tile only and sits idle during the others. On
 * AVX2 a float32 block that one tile reads (a row or three) is left to the hardware prefetcher, which keeps up with a
 * single pass there (the software prefetch cost more than it saved); on AVX-512 (every tile spans the block) it pays
 * even for one tile (ONE_TILE_PREFETCH). There a block's one tile (up to 8 rows) prefetches its own rows
 * PREFETCH_AHEAD bytes on instead, running into the next block at its end (a thread's blocks lie one after another,
 * an expert's and the experts' of a layer too): a prefetch a whole block (64 KB) ahead into L1 was evicted from it
 * before its use. Two tiles of 9-16 bfloat16 rows prefetch `next` as float32's do. Past PREFETCH_ROWS (threads.h) the
 * block is compute-bound and is not prefetched. Both prefetches go to L2, not L1 (T1; a one-row pass reaches the line
 * before L1 would matter), while the AMX one-group pass (cpu_amx.c) keeps L1. Every choice here is re-checked side by
 * side, two kernel builds in one process: scripts/bench_kernels_ab.py --base REV --bits 16,32 (GEMMs from memory)
 * and --workload mixed --dtype bfloat16|float32 (the engine). */
static void rows_times_block(rows_x x, int M, int K, blocked_w src, int64_t ldy, float *y, const char *next) {
#ifdef ERNIE_VF16
    if (M <= 0) return;
    if (x.h) {  /* bfloat16 x and weights: the tile unit's (cpu_amx.c) */
        const uint16_t *w = src.p;
        ernie_amx_blocks(x.h, M, K, &w, 1, &y, ldy, next);
        return;
    }
    const int wide = M <= WIDE_UP_TO(src.bf16), span = wide ? COLS : 2 * VN, rows = wide ? WIDE_ROWS : ROWS;
    const int groups = (M + rows - 1) / rows, tiles_n = groups * (COLS / span);
    const int64_t block_bytes = (int64_t)K * COLS * (src.bf16 ? 2 : 4), share = (block_bytes + tiles_n - 1) / tiles_n;
    const int bits = src.bf16 ? 16 : 32, most = ONE_TILE_PREFETCH ? 16 : PREFETCH_ROWS(bits);
    const int ahead = ONE_TILE_PREFETCH && tiles_n == 1;
    const int prefetch = next && M <= most && (ONE_TILE_PREFETCH || tiles_n > 1 || src.bf16);
    /* one tile: its own rows PREFETCH_AHEAD bytes on (into the next block at its end), else a share of `next` each */
    const int pf_step = ahead ? COLS * bits / 8 : (int)((share + K - 1) / K);
    int tile = 0;
    for (int c0 = 0; c0 < COLS; c0 += span)
        for (int g = 0, m0 = 0; g < groups; g++, tile++) {
            const int mb = M / groups + (g < M % groups);
            const float *xm = x.f + (int64_t)m0 * K;
            float *ym = y + m0 * ldy + c0;
            const char *pf = ahead ? (const char *)src.p + PREFETCH_AHEAD : prefetch ? next + tile * share : NULL;
            if (src.bf16)
                tiles_bf16[wide][mb](xm, K, (const uint16_t *)src.p + c0, ldy, ym, pf, pf_step);
            else
                tiles[wide][mb](xm, K, (const float *)src.p + c0, ldy, ym, pf, pf_step);
            m0 += mb;
        }
#else
    (void)next;
    for (int m = 0; m < M; m++)
        for (int j = 0; j < COLS; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += x_at(x, (int64_t)m * K + k) * weight_at(src, (int64_t)k * COLS + j);
            y[m * ldy + j] = acc;
        }
#endif
}

/* Rows [0, M) of x times column block b (a full one) -> y[m * ldy + j], j < COLS, prefetching `next`. */
static void column_block(rows_x x, int M, int K, blocked_w w, int64_t ldy, float *y, int b, const char *next) {
    rows_times_block(x, M, K, block_of(w, K, b), ldy, y, next);
}

/* Rows from which a dense GEMM's column blocks go through AMX two at a time (amx_column_pair): 1024 x 1536 at 800
 * and 3200 rows 1.25x and 1.36x, at 16 rows 0.93x (scripts/bench_kernels_ab.py --prefill / the decode GEMMs). A
 * MoE layer's experts (K 704 and 1024, 200 and 800 rows each) measured 0.94-1.09x that way, so they keep one. */
#define AMX_PAIR_ROWS 64

/* Where column block b starts, for a prefetch; NULL past the last one. */
static const char *block_start(blocked_w w, int K, int b, int nb) {
    return b < nb ? (const char *)block_of(w, K, b).p : NULL;
}

/* Column blocks b and b + 1 (when there is one) on AMX for M >= AMX_PAIR_ROWS rows: one load of an x tile serves
 * both blocks' B tiles, and a prefill's x tiles come from L2 / L3, the costly load (cpu_amx.c). */
static void amx_column_pair(rows_x x, int M, int K, blocked_w w, int64_t ldy, float *y, int b, int nb) {
    const uint16_t *blocks[2] = {block_of(w, K, b).p, b + 1 < nb ? block_of(w, K, b + 1).p : NULL};
    float *ys[2] = {y, y + COLS};
    ernie_amx_blocks(x.h, M, K, blocks, b + 1 < nb ? 2 : 1, ys, ldy, NULL);
}

static void gemm(rows_x x, int M, int K, blocked_w w, int N, float *y) {
    const int nb = N / COLS;
    if (x.h && M >= AMX_PAIR_ROWS) {
        #pragma omp parallel for THREADS schedule(static)
        for (int b = 0; b < nb; b += 2) amx_column_pair(x, M, K, w, N, y + b * COLS, b, nb);
    } else {
        #pragma omp parallel for THREADS schedule(static)
        for (int b = 0; b < nb; b++) column_block(x, M, K, w, N, y + b * COLS, b, block_start(w, K, b + 1, nb));
    }
    if (N % COLS) columns_plain(x, M, K, w, N, y + N / COLS * COLS, N / COLS * COLS, N);
}

/* Where task t's block starts (expert t / nb, column block t % nb), for a prefetch; NULL for t < 0 (none). */
static const char *task_block(int t, int nb, const void *const *w, int bits, int K) {
    return t < 0 ? NULL : (const char *)block_of(weight_of(w[t / nb], bits), K, t % nb).p;
}

/* Every routed expert of a MoE layer in one call: y[starts[e] + m] = x[starts[e] + m] @ W_e for m < rows[e]
 * (rows of x [*, K] and y [*, N]; a padded [E, cap] batch has starts[e] = e * cap, a packed one the running sum of
 * rows). w[e] points at each expert's column-blocked weight. The threads split the (expert, column block) pairs, so
 * a step's many expert matmuls, small at decode or mid-sized in a step mixing decodes and a prefill chunk, become
 * one parallel loop instead of a call per expert. */
static void moe_gemm(rows_x x, const int64_t *rows, const int64_t *starts, int E, int K,
                     const void *const *w, int bits, int N, float *y) {
    const int nb = N / COLS;
    #pragma omp parallel THREADS
    {
        int first, end;
        ernie_my_task_run(rows, E, nb, 0, &first, &end);
        for (int task = ernie_first_task(first, end, nb, rows), next; task >= 0; task = next) {
            const int e = task / nb;
            next = ernie_next_task(task, end, nb, rows);
            column_block(expert_rows(x, starts[e] * K, rows[e]), (int)rows[e], K, weight_of(w[e], bits), N,
                         y + starts[e] * N + task % nb * COLS, task % nb, task_block(next, nb, w, bits, K));
        }
    }
    if (N % COLS)
        for (int e = 0; e < E; e++)
            columns_plain(expert_rows(x, starts[e] * K, rows[e]), (int)rows[e], K, weight_of(w[e], bits), N,
                          y + starts[e] * N + N / COLS * COLS, N / COLS * COLS, N);
}

/* The SwiGLU MLP's first matmul with its activation fused: W is [K, 2I] with the gate half first, and
 * y[m, j] = silu(g[m, j]) * u[m, j] for [g | u] = x @ W, y [M, I]. Each task computes gate block b and up block b
 * into two tiles and writes their product, so the [M, 2I] projection is never stored and read back (at decode it was
 * a separate pass per MLP). Needs I % 32 == 0 (swiglu_fits). */
static int swiglu_fits(int N) { return N % (2 * COLS) == 0; }

int ernie_gemm_swiglu_fits(int N) { return swiglu_fits(N); }

/* Rows a SwiGLU pass takes at once: the gate and up tiles [SWIGLU_ROWS, COLS] stay in L1, and a prefill's rows go
 * through rows_times_block in groups large enough for its half tiles. */
#define SWIGLU_ROWS (4 * ROWS)

/* Rows a SwiGLU pass on AMX takes at once: its gate and up blocks are interleaved once a pass, and each load of x
 * serves both (cpu_amx.c); the passes' products take 2 x 32 KB of stack. */
#define AMX_SWIGLU_ROWS 256

static void swiglu_rows(rows_x x, int M, int K, blocked_w w, int N, float *y, int b, const char *next) {
    const int I = N / 2, nb = I / COLS, pass = x.h ? AMX_SWIGLU_ROWS : SWIGLU_ROWS;
    const blocked_w gate = block_of(w, K, b), up = block_of(w, K, b + nb);
    const uint16_t *blocks[2] = {gate.p, up.p};
    float g[AMX_SWIGLU_ROWS * COLS], u[AMX_SWIGLU_ROWS * COLS], *gu[2] = {g, u};
    for (int m0 = 0; m0 < M; m0 += pass) {
        const int mb = M - m0 < pass ? M - m0 : pass;
        const char *after = m0 + mb >= M ? next : NULL;
        if (x.h) {
            ernie_amx_blocks(x.h + (int64_t)m0 * K, mb, K, blocks, 2, gu, COLS, after);
        } else {
            const rows_x xm = rows_at(x, (int64_t)m0 * K);
            rows_times_block(xm, mb, K, gate, COLS, g, m0 == 0 ? (const char *)up.p : NULL);
            rows_times_block(xm, mb, K, up, COLS, u, after);
        }
        for (int m = 0; m < mb; m++)
            silu_mul_row(g + m * COLS, u + m * COLS, y + (int64_t)(m0 + m) * I + b * COLS, COLS);
    }
}

static int is_float(int bits) { return bits == 32 || bits == 16; }

/* Whether `rows` rows times bfloat16 weights of K rows run on AMX, x rounded to bfloat16 (else float32 x, widened
 * weights). */
static int on_amx(int64_t rows, int K) { return rows >= AMX_ROWS && K % 32 == 0 && ernie_amx_ready(); }

int ernie_bf16_on_amx(int rows, int K) { return on_amx(rows, K); }

/* x [n_rows, K] as a GEMM with `bits`-bit float weights multiplies it: where bfloat16 weights run on AMX for some
 * of it (max_rows: the most rows one weight multiplies), rounded to bfloat16 too, once a call, into *held (the
 * caller frees it), with the 16 rows past the last an AMX tile loads (zeros). Returns 0, or -1 out of memory. */
static int rows_for(const float *x, int64_t n_rows, int64_t max_rows, int K, int bits, rows_x *out, uint16_t **held) {
    rows_x r = {x, NULL};
    *held = NULL;
#ifdef __AVX512F__
    if (bits == 16 && n_rows > 0 && on_amx(max_rows, K)) {
        const int64_t n = n_rows * K, chunk = 16 * 1024;
        uint16_t *h = malloc(sizeof(uint16_t) * (size_t)(n + 16 * (int64_t)K));
        if (!h) return -1;
        memset(h + n, 0, sizeof(uint16_t) * 16 * (size_t)K);
        #pragma omp parallel for THREADS schedule(static)
        for (int64_t i0 = 0; i0 < n; i0 += chunk) {
            const int64_t i1 = i0 + chunk < n ? i0 + chunk : n;
            int64_t i = i0;
            for (; i + 16 <= i1; i += 16)  /* nearest even, as f32_to_bf16 */
                _mm256_storeu_si256((__m256i *)(h + i), f32_to_bf16_16(_mm512_loadu_ps(x + i)));
            for (; i < i1; i++) h[i] = f32_to_bf16(x[i]);
        }
        r.h = *held = h;
    }
#else
    (void)n_rows, (void)max_rows, (void)K, (void)bits;
#endif
    *out = r;
    return 0;
}

/* y = x @ W * scale: float32 / bfloat16 W (bits 32 / 16, s NULL) here, int8 / int4 codes (bits 8 / 4) in
 * cpu_qgemm.c, where int_x says x is integer-valued already (w4a8). swiglu: y [M, N / 2] as above. Returns 0, or -1
 * out of memory. */
int ernie_gemm(const float *x, int M, int K, const void *w, int N, const float *s, float *y, int bits, int swiglu,
               int int_x) {
    ernie_amx_new_call();
    if (!is_float(bits)) return ernie_qgemm(x, M, K, w, N, s, y, bits, swiglu, int_x);
    const blocked_w wb = weight_of(w, bits);
    rows_x xr;
    uint16_t *held;
    if (rows_for(x, M, M, K, bits, &xr, &held)) return -1;
    if (!swiglu) {
        gemm(xr, M, K, wb, N, y);
    } else {
        #pragma omp parallel for THREADS schedule(static)
        for (int b = 0; b < N / 2 / COLS; b++)
            swiglu_rows(xr, M, K, wb, N, y, b, block_start(wb, K, b + 1, N / 2 / COLS));
    }
    free(held);
    return 0;
}

/* moe_gemm above (or cpu_qgemm.c's for int codes), or with swiglu each expert's rows -> y rows of width N / 2. */
int ernie_moe_gemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K, const void *const *w,
                   int N, const float *const *s, float *y, int bits, int swiglu, int int_x) {
    ernie_amx_new_call();
    if (!is_float(bits))
        return ernie_moe_qgemm(x, rows, starts, E, K, (const uint8_t *const *)w, N, s, y, bits, swiglu, int_x);
    int64_t n_rows = 0, max_rows = 0;  /* x's rows up to the last an expert reads (a padded batch's tail is not) */
    for (int e = 0; e < E; e++)
        if (rows[e]) {
            n_rows = starts[e] + rows[e] > n_rows ? starts[e] + rows[e] : n_rows;
            max_rows = rows[e] > max_rows ? rows[e] : max_rows;
        }
    rows_x xr;
    uint16_t *held;
    if (rows_for(x, n_rows, max_rows, K, bits, &xr, &held)) return -1;
    if (!swiglu) {
        moe_gemm(xr, rows, starts, E, K, w, bits, N, y);
    } else {
        const int nb = N / 2 / COLS;
        #pragma omp parallel THREADS
        {
            int first, end;
            ernie_my_task_run(rows, E, nb, 0, &first, &end);
            for (int task = ernie_first_task(first, end, nb, rows), next; task >= 0; task = next) {
                const int e = task / nb;
                next = ernie_next_task(task, end, nb, rows);
                swiglu_rows(expert_rows(xr, starts[e] * K, rows[e]), (int)rows[e], K, weight_of(w[e], bits), N,
                            y + starts[e] * N / 2, task % nb, task_block(next, nb, w, bits, K));
            }
        }
    }
    free(held);
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
    ernie_amx_new_call();
    const int nb = N / COLS, threads = ernie_threads();
    const blocked_w w = weight_of(wp, bits);
    rows_x xr;
    uint16_t *held;
    if (rows_for(x, M, M, K, bits, &xr, &held)) return -1;
    float *tiles = malloc(sizeof(float) * (size_t)threads * M * COLS + sizeof(float) * (size_t)threads * M);
    int64_t *part_idx = malloc(sizeof(int64_t) * (size_t)threads * M);
    if (!tiles || !part_idx) {
        free(tiles);
        free(part_idx);
        free(held);
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
            column_block(xr, M, K, w, COLS, tile, b, block_start(w, K, b + 1, b1));
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
        columns_plain(xr, M, K, w, COLS, tiles, nb * COLS, n_valid);
        rank_tile(tiles, M, n_valid - nb * COLS, (int64_t)nb * COLS, best_val, best_idx);
    }
    free(tiles);
    free(part_idx);
    free(held);
    return 0;
}
