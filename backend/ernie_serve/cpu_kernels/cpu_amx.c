/* bfloat16 weights times bfloat16 activations on AMX (Intel Sapphire Rapids and later): one or two column blocks
 * of cpu_gemm.c's layout at a time, products accumulated in float32 by the tile unit. And int8 codes times int8
 * activation codes (ernie_amx_int8_rows, for cpu_qgemm.c): its layout is already the tile unit's (each group of 4 k
 * a row of 32 columns x 4 bytes), so a B tile loads straight from the weight, no repack.
 *
 * Why: a `--dtype bfloat16` prefill is compute-bound, and TDPBF16PS does an order of magnitude more multiply-adds a
 * second a core than the AVX-512 float32 FMA; vdpbf16ps, the AVX512-BF16 dot product, issues at a fraction of the
 * FMA's rate, so it would be slower than widening the weight to float32 and is not used. vLLM-CPU and FastDeploy's
 * CPU path take bfloat16 matmuls to AMX through oneDNN likewise. scripts/bench_cpu_dtypes.py --formats bfloat16
 * against ERNIE_CPU_AMX=0 re-checks it.
 *
 * The weight keeps the one layout every bfloat16 path reads, [K, 32] a column block; AMX wants a B tile's rows
 * to be (k, k + 1) pairs of 16 columns, so a panel of the block is interleaved into that form as it is streamed
 * in (the repack is the block's one pass over memory; at decode it also prefetches the thread's next block), and
 * every row group of 16 then reads the panel from L1 / L2. The x tile (16 rows at K apart, read from L2) is the
 * costly load, so a SwiGLU's gate and up blocks go through together and share each one, in row groups of 16
 * (scripts/bench_kernels_ab.py --prefill --bits 16 re-checks it). x comes in already rounded to
 * bfloat16 (cpu_gemm.c rounds it once a call), with 16 readable rows past the last: a tile always loads 16 rows,
 * the extra ones are never stored. */
#include <stdint.h>
#include <string.h>

#include "amx.h"
#include "threads.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: ask for the AMX tile data state (off by default for a process) */
#define XFEATURE_XTILEDATA 18
#define COLS 32                    /* cpu_gemm.c's column block */
/* k values interleaved at once (64 KB a block), read by every row group; C goes back to memory between panels, so
 * a panel covers ERNIE-4.5's K (704-1024 here) whole: smaller panels made the bfloat16 prefill slower
 * (scripts/bench_cpu_dtypes.py --formats bfloat16 re-checks it). */
#define PANEL 1024
/* Up to this many row groups of 16 a block is memory-bound and its interleave pass prefetches the next call's block
 * (scripts/bench_kernels_ab.py --bits 16 at 17-64 rows re-checks it). */
#define PREFETCH_GROUPS 4

static int allowed = 1, ready = -1; /* ready -1: not asked yet */

void ernie_set_amx(int on) {
    allowed = on;
    ready = -1;
}

int ernie_amx_ready(void) {
    if (ready < 0) ready = allowed && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

/* The tile configuration's generation: ernie_amx_new_call advances it at each GEMM entry point, and a thread loads
 * the configuration once a generation: LDTILECFG costs a sizeable share of a decode-sized block's product, so it is
 * not loaded for every block; within one of our parallel regions no other code runs on its threads, while between
 * two calls Paddle's own oneDNN kernels may load theirs. */
static unsigned generation = 1;
static __thread unsigned configured_in = 0;
static __thread int configured_rows = 0;

void ernie_amx_new_call(void) { __atomic_add_fetch(&generation, 1, __ATOMIC_RELAXED); }

/* Eight tiles of 64 bytes a row: C in 0-3 (`rows` rows x the 32 columns of up to two blocks), A in 4-5 (`rows` rows),
 * B in 6-7 (16 rows: 32 k of bfloat16 pairs or 64 k of int8 quads). `rows` is 16, or 8 for an int8 GEMM of at most 8
 * rows (a MoE step's expert of 5-8), whose A tiles then read half the activation lines (each block re-reads them,
 * 2 KB of them a 64-k step against 2 KB of codes). A thread walks an expert's blocks in a run, so the configuration
 * changes at most at an expert's first block. scripts/bench_kernels_ab.py --bits 8 (experts at 5-8 rows)
 * re-checks it. */
static void configure(int rows) {
    const unsigned now = __atomic_load_n(&generation, __ATOMIC_RELAXED);
    if (configured_in == now && configured_rows == rows) return;
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 6 ? rows : 16;
    }
    _tile_loadconfig(&cfg);
    configured_in = now, configured_rows = rows;
}

/* Rows [k0, k0 + kp) of the block w ([K, COLS]) as two B tiles' worth of (k, k + 1) pairs: left[p] holds columns
 * 0-15 of rows k0 + 2p and k0 + 2p + 1, pair by pair, right[p] columns 16-31. `pf`: bytes to prefetch alongside, 128
 * a pair, into L2 (into L1 streamed slower: the lines were evicted before their use). */
static void interleave(const uint16_t *w, int k0, int kp, uint16_t (*left)[32], uint16_t (*right)[32],
                       const char *pf) {
    /* vpunpck*wd pairs the two rows within each 128-bit lane: lo holds columns 0-3, 8-11, 16-19, 24-27, hi 4-7, ...
     * The qword permutes put them back in column order, the first 16 columns in one tile, the last 16 in the other. */
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int p = 0; p < kp / 2; p++) {
        const uint16_t *r = w + (int64_t)(k0 + 2 * p) * COLS;
        if (pf) {
            _mm_prefetch(pf + (int64_t)p * 128, _MM_HINT_T1);
            _mm_prefetch(pf + (int64_t)p * 128 + 64, _MM_HINT_T1);
        }
        const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + COLS);
        const __m512i lo = _mm512_unpacklo_epi16(r0, r1), hi = _mm512_unpackhi_epi16(r0, r1);
        _mm512_store_si512(left[p], _mm512_permutex2var_epi64(lo, first, hi));
        _mm512_store_si512(right[p], _mm512_permutex2var_epi64(lo, second, hi));
    }
}

/* One k chunk of 32 for 16 rows: the A tile (tile 4, 16 rows K apart from a) loaded once, times block 0's two B tiles
 * (L0, R0: its columns 0-15 and 16-31) into C tiles 0, 1 and, with NW 2, block 1's (L1, R1) into 2, 3. */
#define PRODUCTS(NW, a, L0, R0, L1, R1)                                                                     \
    _tile_loadd(4, a, (int64_t)K * 2);                                                                      \
    _tile_loadd(6, L0, 64);                                                                                 \
    _tile_dpbf16ps(0, 4, 6);                                                                                \
    _tile_loadd(7, R0, 64);                                                                                 \
    _tile_dpbf16ps(1, 4, 7);                                                                                \
    if (NW > 1) {                                                                                           \
        _tile_loadd(6, L1, 64);                                                                             \
        _tile_dpbf16ps(2, 4, 6);                                                                            \
        _tile_loadd(7, R1, 64);                                                                             \
        _tile_dpbf16ps(3, 4, 7);                                                                            \
    }
#define CHUNK(NW) PRODUCTS(NW, a + kc, pack[0][0][kc / 2], pack[0][1][kc / 2], pack[1][0][kc / 2], pack[1][1][kc / 2])

/* The tile loads are asm without a memory operand (GCC's amxtileintrin.h), so the compiler may move the stores
 * that made a panel past them, or drop those stores as never read: this barrier keeps them before. */
#define STORES_BEFORE_TILE_LOADS() __asm__ volatile("" ::: "memory")

/* The rows of a last group of fewer than 16 (M % 16 of them), stored to `tail` as a tile, to their places in y. */
static void copy_tail(float tail[2][16 * COLS], int M, int nw, float *const *y, int64_t ldy) {
    for (int b = 0; b < nw; b++)
        for (int m = M / 16 * 16; m < M; m++)
            memcpy(y[b] + (int64_t)m * ldy, tail[b] + (m % 16) * COLS, sizeof(float) * COLS);
}

/* At most 16 rows (one row group: a decode step's): each 32 k of the blocks is interleaved into an L1 buffer (two in
 * turn) and multiplied at once, the blocks' rows PREFETCH_AHEAD on prefetched into L1 first, all of a chunk's at
 * once; the whole-panel path below sent each 64 KB panel through L2 between its interleave and its one read. A
 * dense 1024 x 1536 layer from memory at 16 rows 1.28-1.30x (1.09x without the prefetch; interleaved into the
 * interleave's loop, one line a row, 1.03x); the engine, uniform bf16, 1.039x (scripts/bench_kernels_ab.py). */
static void one_group(const uint16_t *xh, int M, int K, const uint16_t *const *w, int nw, float *const *y,
                      int64_t ldy, const char *pf) {
    uint16_t pack[2][2][2][16][32] __attribute__((aligned(64))); /* [buffer][block][tile][pair][column] */
    float tail[2][16 * COLS] __attribute__((aligned(64)));
    configure(16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kc = 0, i = 0; kc < K; kc += 32, i ^= 1) {
        for (int b = 0; b < nw; b++)
            for (int o = 0; o < 32 * COLS * 2; o += 64)
                _mm_prefetch((const char *)(w[b] + (int64_t)kc * COLS) + PREFETCH_AHEAD + o, _MM_HINT_T0);
        for (int b = 0; b < nw; b++) /* the next call's block b lies as far from its first as w[b] from w[0] */
            interleave(w[b], kc, 32, pack[i][b][0], pack[i][b][1],
                       pf ? pf + (w[b] - w[0]) * 2 + (int64_t)kc * COLS * 2 : NULL);
        STORES_BEFORE_TILE_LOADS();
        PRODUCTS(nw, xh + kc, pack[i][0][0], pack[i][0][1], pack[i][1][0], pack[i][1][1])
    }
    const int full = M == 16;
    for (int b = 0; b < nw; b++) {
        float *c = full ? y[b] : tail[b];
        const int64_t ldc = (full ? ldy : COLS) * (int64_t)sizeof(float);
        if (b == 0) {
            _tile_stored(0, c, ldc);
            _tile_stored(1, c + 16, ldc);
        } else {
            _tile_stored(2, c, ldc);
            _tile_stored(3, c + 16, ldc);
        }
    }
    copy_tail(tail, M, nw, y, ldy);
}

void ernie_amx_blocks(const uint16_t *xh, int M, int K, const uint16_t *const *w, int nw, float *const *y,
                      int64_t ldy, const char *next) {
    if (M <= 16) {
        one_group(xh, M, K, w, nw, y, ldy, next);
        return;
    }
    uint16_t pack[2][2][PANEL / 2][32] __attribute__((aligned(64))); /* 128 KB of stack */
    float tail[2][16 * COLS] __attribute__((aligned(64))); /* C of a last group of fewer than 16 rows */
    const int groups = (M + 15) / 16;
    const char *pf = groups <= PREFETCH_GROUPS ? next : NULL;
    configure(16);
    for (int k0 = 0; k0 < K; k0 += PANEL) {
        const int kp = K - k0 < PANEL ? K - k0 : PANEL;
        for (int b = 0; b < nw; b++) /* the next call's block b lies as far from its first as w[b] from w[0] */
            interleave(w[b], k0, kp, pack[b][0], pack[b][1],
                       pf ? pf + (w[b] - w[0]) * 2 + (int64_t)k0 * COLS * 2 : NULL);
        STORES_BEFORE_TILE_LOADS();
        for (int g = 0; g < groups; g++) {
            const int m0 = 16 * g, full = M - m0 >= 16;
            float *c0 = full ? y[0] + m0 * ldy : tail[0], *c1 = nw > 1 ? (full ? y[1] + m0 * ldy : tail[1]) : NULL;
            const int64_t ldc = (full ? ldy : COLS) * (int64_t)sizeof(float);
            if (k0 == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, c0, ldc);
                _tile_loadd(1, c0 + 16, ldc);
                if (nw > 1) {
                    _tile_loadd(2, c1, ldc);
                    _tile_loadd(3, c1 + 16, ldc);
                }
            }
            const uint16_t *a = xh + (int64_t)m0 * K + k0;
            if (nw > 1)
                for (int kc = 0; kc < kp; kc += 32) { CHUNK(2) }
            else
                for (int kc = 0; kc < kp; kc += 32) { CHUNK(1) }
            _tile_stored(0, c0, ldc);
            _tile_stored(1, c0 + 16, ldc);
            if (nw > 1) {
                _tile_stored(2, c1, ldc);
                _tile_stored(3, c1 + 16, ldc);
            }
        }
    }
    copy_tail(tail, M, nw, y, ldy);
}

#ifdef __AMX_INT8__
int ernie_amx_int8_ready(void) { return ernie_amx_ready(); }

void ernie_amx_int8_rows(const int8_t *const *q, int rows, int levels, int64_t ldq, int G, const uint8_t *w,
                         int32_t *acc, const char *pf, int pf_step) {
    configure(rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    /* A memory-bound block (pf set: at most 16 rows) comes into an L1 buffer through vector loads, the prefetches
     * of the next block among them, and the B tiles load from there: loaded straight from memory, each tile load
     * waited out its 16 lines' misses with few others in flight (perf: most of the loop's time on the tile loads
     * and the products waiting on them). scripts/bench_kernels_ab.py --bits 8 (dense layers at 16 rows) re-checks
     * it. */
    uint8_t copy[2][16 * 4 * COLS] __attribute__((aligned(64)));
    for (int g = 0, i = 0; g < G; g += 16, i ^= 1) { /* 64 k: 16 groups of 4, a B tile's rows */
        const char *b = (const char *)w + (int64_t)g * 4 * COLS;
        if (pf) {
            const char *ahead = pf + (int64_t)g / 16 * pf_step;
            for (int o = 0; o < 16 * 4 * COLS; o += 64) {
                if (o < pf_step) _mm_prefetch(ahead + o, _MM_HINT_T1);
                _mm512_store_si512(copy[i] + o, _mm512_loadu_si512(b + o));
            }
            for (int o = 16 * 4 * COLS; o < pf_step; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T1);
            STORES_BEFORE_TILE_LOADS();
            b = (const char *)copy[i];
        }
        _tile_loadd(6, b, 4 * COLS);      /* columns 0-15: 64 bytes of each group */
        _tile_loadd(7, b + 64, 4 * COLS); /* columns 16-31 */
        _tile_loadd(4, q[0] + (int64_t)g * 4, ldq);
        _tile_dpbsud(0, 4, 6);
        _tile_dpbsud(1, 4, 7);
        if (levels > 1) {
            _tile_loadd(5, q[1] + (int64_t)g * 4, ldq);
            _tile_dpbsud(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 4 * COLS);
    _tile_stored(1, acc + 16, 4 * COLS);
    if (levels > 1) {
        _tile_stored(2, acc + 16 * COLS, 4 * COLS);
        _tile_stored(3, acc + 16 * COLS + 16, 4 * COLS);
    }
}
#define HAVE_AMX_INT8 1
#endif

#else
void ernie_set_amx(int on) { (void)on; }

void ernie_amx_new_call(void) {}

int ernie_amx_ready(void) { return 0; }

void ernie_amx_blocks(const uint16_t *xh, int M, int K, const uint16_t *const *w, int nw, float *const *y,
                      int64_t ldy, const char *next) {
    (void)xh, (void)M, (void)K, (void)w, (void)nw, (void)y, (void)ldy, (void)next; /* never called: not ready */
}
#endif

#ifndef HAVE_AMX_INT8 /* built without AMX-INT8 (or without AMX at all) */
int ernie_amx_int8_ready(void) { return 0; }

void ernie_amx_int8_rows(const int8_t *const *q, int rows, int levels, int64_t ldq, int G, const uint8_t *w,
                         int32_t *acc, const char *pf, int pf_step) {
    (void)q, (void)rows, (void)levels, (void)ldq, (void)G, (void)w, (void)acc, (void)pf, (void)pf_step; /* never called */
}
#endif
