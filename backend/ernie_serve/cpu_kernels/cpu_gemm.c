/* Weight-only int8 / int4 GEMM for the CPU reference path at decode sizes (few rows).
 *
 *   y[M, N] = (x[M, K] @ W[K, N]) * scale[N]      W int8, or int4 packed two rows a byte
 *                                                  (low nibble row 2i, high nibble row 2i+1, two's complement),
 *                                                  or float32 (routed experts at serving time; no scale)
 *
 * Why: at decode a weight is read once per step for a handful of rows, so the step is bound by weight
 * bytes; dequantizing to fp32 first (Paddle has no int8 or int4 matmul on CPU) reads more bytes than fp32
 * itself. Here each weight byte is read once, widened to fp32 in registers, and multiplied into every row.
 *
 * Layout: W is held column-blocked, [ceil(N/32), R, 32] (R = K rows, or K/2 packed int4 rows; the last block
 * zero-padded), not [R, N]: a thread's 32-column task then streams one contiguous R*32-byte run instead of
 * 32 (or 16) bytes from each of R rows N bytes apart, half a cache line at a stride. Measured on this box with
 * 138 MB of weights (no cache reuse), K 1024 x N 1408: int8 6.8 -> 15.9 GB/s at 1 row, 4.4 -> 8.0 GB/s at 4.
 * Columns are split across the OpenMP threads of the runtime Paddle itself uses (linked against its
 * libiomp5, so the two never compete for the cores). Built by cpu_gemm.py on first use.
 */
#include <stdint.h>

#include "threads.h"
#include "vec_math.h"

#define ROWS 8   /* rows per register block */
#define COLS 32  /* columns per thread task: two 16-float vectors */

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 widen_i8(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* The two nibbles of 16 bytes as two vectors of 16 floats (low nibbles, high nibbles). */
static inline void widen_i4(const int8_t *p, __m512 *lo, __m512 *hi) {
    __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    /* low nibble: shift left 28 then arithmetic right 28 sign-extends it; high nibble: the byte >> 4 */
    *lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28));
    *hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(b, 4));
}

/* Row k of a column block as two vectors of 16 floats: float32 as it is, int8 widened. */
static inline void row_of_32(const int8_t *w, int k, int bits, __m512 *w0, __m512 *w1) {
    if (bits == 32) {
        const float *p = (const float *)w + (int64_t)k * COLS;
        *w0 = _mm512_loadu_ps(p);
        *w1 = _mm512_loadu_ps(p + 16);
    } else {
        const int8_t *p = w + (int64_t)k * COLS;
        *w0 = widen_i8(p);
        *w1 = widen_i8(p + 16);
    }
}

/* One block of `mb` rows (a compile-time constant in each instance, so the accumulators stay in registers)
 * and the COLS columns from n0, whose weights are the contiguous [R, COLS] run at w. */
#define BLOCK(NAME, BITS, mb)                                                                               \
static void NAME(const float *x, int K, const int8_t *w, int N, const float *s, float *y, int n0) {         \
    __m512 a0[mb], a1[mb];                                                                                  \
    for (int m = 0; m < mb; m++) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }              \
    if (BITS != 4) {  /* one weight row of the block per k: float32, or int8 widened in registers */        \
        for (int k = 0; k < K; k++) {                                                                       \
            __m512 w0, w1;                                                                                  \
            row_of_32(w, k, BITS, &w0, &w1);                                                                \
            for (int m = 0; m < mb; m++) {                                                                  \
                __m512 xv = _mm512_set1_ps(x[(int64_t)m * K + k]);                                          \
                a0[m] = _mm512_fmadd_ps(xv, w0, a0[m]);                                                     \
                a1[m] = _mm512_fmadd_ps(xv, w1, a1[m]);                                                     \
            }                                                                                               \
        }                                                                                                   \
    } else {                                                                                                \
        const int8_t *wp = w;                                                                               \
        for (int k = 0; k < K; k += 2, wp += COLS) {                                                        \
            __m512 l0, h0, l1, h1;                                                                          \
            widen_i4(wp, &l0, &h0);                                                                         \
            widen_i4(wp + 16, &l1, &h1);                                                                    \
            for (int m = 0; m < mb; m++) {                                                                  \
                __m512 xe = _mm512_set1_ps(x[(int64_t)m * K + k]);                                          \
                __m512 xo = _mm512_set1_ps(x[(int64_t)m * K + k + 1]);                                      \
                a0[m] = _mm512_fmadd_ps(xo, h0, _mm512_fmadd_ps(xe, l0, a0[m]));                            \
                a1[m] = _mm512_fmadd_ps(xo, h1, _mm512_fmadd_ps(xe, l1, a1[m]));                            \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    __m512 s0 = s ? _mm512_loadu_ps(s + n0) : _mm512_set1_ps(1.0f);                                         \
    __m512 s1 = s ? _mm512_loadu_ps(s + n0 + 16) : _mm512_set1_ps(1.0f);                                    \
    for (int m = 0; m < mb; m++) {                                                                          \
        _mm512_storeu_ps(y + (int64_t)m * N + n0, _mm512_mul_ps(a0[m], s0));                                \
        _mm512_storeu_ps(y + (int64_t)m * N + n0 + 16, _mm512_mul_ps(a1[m], s1));                           \
    }                                                                                                       \
}
typedef void (*block_fn)(const float *, int, const int8_t *, int, const float *, float *, int);
#define INSTANCES(P, BITS) BLOCK(P##1, BITS, 1) BLOCK(P##2, BITS, 2) BLOCK(P##3, BITS, 3) BLOCK(P##4, BITS, 4) \
    BLOCK(P##5, BITS, 5) BLOCK(P##6, BITS, 6) BLOCK(P##7, BITS, 7) BLOCK(P##8, BITS, 8)                       \
    static const block_fn P##s[ROWS + 1] = {0, P##1, P##2, P##3, P##4, P##5, P##6, P##7, P##8};
INSTANCES(block_i8_, 8)
INSTANCES(block_i4_, 4)
INSTANCES(block_f32_, 32)
#endif

/* Rows of the column-blocked layout: K, or K/2 packed int4 rows. */
static inline int block_rows(int K, int bits) { return bits == 4 ? K / 2 : K; }

/* The weight of row k, column n in the column-blocked layout. */
static inline float weight_at(const int8_t *w, int K, int n, int k, int bits) {
    int64_t at = ((int64_t)(n / COLS) * block_rows(K, bits) + (bits == 4 ? k / 2 : k)) * COLS + n % COLS;
    if (bits == 32) return ((const float *)w)[at];
    int8_t byte = w[at];
    if (bits == 8) return byte;
    return (k & 1) ? (int8_t)(byte >> 4) : (int8_t)((int8_t)(byte << 4) >> 4);
}

/* Columns [n0, n1) of any format, plainly (a last block narrower than COLS; every column on CPUs
 * without AVX-512). */
static void columns_plain(const float *x, int M, int K, const int8_t *w, int N, const float *s, float *y,
                          int n0, int n1, int bits) {
    for (int m = 0; m < M; m++)
        for (int n = n0; n < n1; n++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += x[(int64_t)m * K + k] * weight_at(w, K, n, k, bits);
            y[(int64_t)m * N + n] = s ? acc * s[n] : acc;
        }
}

#ifdef __AVX512F__
static const block_fn *blocks_for(int bits) {
    return bits == 32 ? block_f32_s : bits == 8 ? block_i8_s : block_i4_s;
}
#endif

static void gemm(const float *x, int M, int K, const int8_t *w, int N, const float *s, float *y, int bits) {
    int vec_cols = 0;
#ifdef __AVX512F__
    vec_cols = N / COLS * COLS;
    const block_fn *blocks = blocks_for(bits);
    const int64_t block_bytes = (int64_t)block_rows(K, bits) * COLS * (bits == 32 ? 4 : 1);
    #pragma omp parallel for THREADS schedule(static)
    for (int b = 0; b < N / COLS; b++)
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            int mb = M - m0 < ROWS ? M - m0 : ROWS;
            blocks[mb](x + (int64_t)m0 * K, K, w + b * block_bytes, N, s, y + (int64_t)m0 * N, b * COLS);
        }
#endif
    if (vec_cols < N) columns_plain(x, M, K, w, N, s, y, vec_cols, N, bits);
}

/* How the threads share E experts x nb column blocks: contiguous halves (each thread streams one run of the
 * weights) when the experts' row counts are even, as at decode; round robin (static chunks of 1) when a few experts
 * hold most rows, as with a prefill chunk in the step, which would otherwise leave a thread idle. */
static int task_chunk(const int64_t *rows, int E, int nb) {
    int64_t total = 0, most = 0;
    for (int e = 0; e < E; e++) {
        total += rows[e];
        most = rows[e] > most ? rows[e] : most;
    }
    const int threads = ernie_threads();
    return most * E <= 2 * total ? (E * nb + threads - 1) / threads : 1;
}

/* Every routed expert of a MoE layer in one call: y[starts[e] + m] = x[starts[e] + m] @ W_e * scale_e for m < rows[e]
 * (rows of x [*, K] and y [*, N]; a padded [E, cap] batch has starts[e] = e * cap, a packed one the running sum of
 * rows). w[e] / s[e] point at each expert's column-blocked weight and scale. The threads split the (expert, column
 * block) pairs, so a step's many expert matmuls, small at decode or mid-sized in a step mixing decodes and a
 * prefill chunk, become one parallel loop instead of a call per expert. */
static void moe_gemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K,
                     const int8_t *const *w, int N, const float *const *s, float *y, int bits) {
    int vec_cols = 0;
#ifdef __AVX512F__
    vec_cols = N / COLS * COLS;
    const block_fn *blocks = blocks_for(bits);
    const int64_t block_bytes = (int64_t)block_rows(K, bits) * COLS * (bits == 32 ? 4 : 1);
    const int nb = N / COLS, chunk = task_chunk(rows, E, nb);
    #pragma omp parallel for THREADS schedule(static, chunk)
    for (int task = 0; task < E * nb; task++) {
        int e = task / nb, b = task % nb, M = (int)rows[e];
        const float *xe = x + starts[e] * K;
        float *ye = y + starts[e] * N;
        for (int m0 = 0; m0 < M; m0 += ROWS) {
            int mb = M - m0 < ROWS ? M - m0 : ROWS;
            blocks[mb](xe + (int64_t)m0 * K, K, w[e] + b * block_bytes, N, s ? s[e] : 0, ye + (int64_t)m0 * N,
                       b * COLS);
        }
    }
#endif
    if (vec_cols < N)
        for (int e = 0; e < E; e++)
            columns_plain(x + starts[e] * K, (int)rows[e], K, w[e], N, s ? s[e] : 0, y + starts[e] * N, vec_cols, N,
                          bits);
}

/* The SwiGLU MLP's first matmul with its activation fused: W is [K, 2I] with the gate half first, and
 * y[m, j] = silu(g[m, j]) * u[m, j] for [g | u] = (x @ W) * scale, y [M, I]. Each task computes gate block b and
 * up block b into two register-block tiles and writes their product, so the [M, 2I] projection is never stored
 * and read back (at decode it was a separate pass per MLP). Needs I % 32 == 0 and AVX-512 (swiglu_fits). */
static int swiglu_fits(int N) {
#ifdef __AVX512F__
    return N % (2 * COLS) == 0;
#else
    (void)N;
    return 0;
#endif
}

int ernie_gemm_swiglu_fits(int N) { return swiglu_fits(N); }

#ifdef __AVX512F__
static void swiglu_rows(const float *x, int M, int K, const int8_t *w, int N, const float *s, float *y, int b,
                        int bits) {
    const block_fn *blocks = blocks_for(bits);
    const int64_t block_bytes = (int64_t)block_rows(K, bits) * COLS * (bits == 32 ? 4 : 1);
    const int I = N / 2, nb = I / COLS;
    float g[ROWS * COLS], u[ROWS * COLS];
    for (int m0 = 0; m0 < M; m0 += ROWS) {
        int mb = M - m0 < ROWS ? M - m0 : ROWS;
        const float *xm = x + (int64_t)m0 * K;
        blocks[mb](xm, K, w + b * block_bytes, COLS, s ? s + b * COLS : 0, g, 0);
        blocks[mb](xm, K, w + (b + nb) * block_bytes, COLS, s ? s + I + b * COLS : 0, u, 0);
        for (int m = 0; m < mb; m++)
            silu_mul_row(g + m * COLS, u + m * COLS, y + (int64_t)(m0 + m) * I + b * COLS, COLS);
    }
}
#endif

/* y = x @ W * scale (bits 8: int8 W, 4: packed int4, 32: float32 with s NULL); swiglu: y [M, N / 2] as above. */
void ernie_gemm(const float *x, int M, int K, const int8_t *w, int N, const float *s, float *y, int bits,
                int swiglu) {
    if (!swiglu) {
        gemm(x, M, K, w, N, s, y, bits);
        return;
    }
#ifdef __AVX512F__
    if (!swiglu_fits(N)) return;
    #pragma omp parallel for THREADS schedule(static)
    for (int b = 0; b < N / 2 / COLS; b++) swiglu_rows(x, M, K, w, N, s, y, b, bits);
#endif
}

/* moe_gemm above, or with swiglu each expert's rows -> y rows of width N / 2. */
void ernie_moe_gemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K, const int8_t *const *w,
                    int N, const float *const *s, float *y, int bits, int swiglu) {
    if (!swiglu) {
        moe_gemm(x, rows, starts, E, K, w, N, s, y, bits);
        return;
    }
#ifdef __AVX512F__
    if (!swiglu_fits(N)) return;
    const int nb = N / 2 / COLS, chunk = task_chunk(rows, E, nb);
    #pragma omp parallel for THREADS schedule(static, chunk)
    for (int task = 0; task < E * nb; task++) {
        int e = task / nb;
        swiglu_rows(x + starts[e] * K, (int)rows[e], K, w[e], N, s ? s[e] : 0, y + starts[e] * N / 2, task % nb,
                    bits);
    }
#endif
}
