/* Weight-only int8 / int4 GEMM for the CPU serving path: integer dot products with AVX-512 VNNI, codes widened to
 * float32 in registers on AVX2 CPUs without it.
 *
 *   y[M, N] = (x[M, K] @ W[K, N]) * scale[N]      W int8 or int4 codes, x float32
 *
 * Why: on an AVX-512 VNNI CPU, widening each weight to fp32 and multiplying it in with FMAs made the int formats
 * compute-bound at 4+ rows (wint8 decoded little faster than fp32 while reading a quarter of its bytes);
 * vpdpbusd multiplies 64 byte pairs an instruction and needs no widening, so the weights are used as they are
 * stored. AVX2 has no such instruction (its vpmaddubsw needs the codes split into nibbles), so there the widening
 * path below serves float activations (docs/cpu-backend.md). From AMX_INT8_ROWS rows
 * (amx.h), on a CPU with AMX-INT8, int8 codes go to the tile unit instead (cpu_amx.c's ernie_amx_int8_rows: the same
 * integer sums).
 *
 * On the integer paths the activations enter at 16-bit precision: each row is quantized to two int8 levels,
 * x ~ s1 * q1 + s2 * q2 with s1 = max|x| / 127 and s2 = s1 / 254, so |x - (s1 q1 + s2 q2)| <= max|x| / 64516 (per
 * element, against an int8 weight's quantization error of up to 1/254 of its column's max). Callers whose x is
 * already integer-valued (w4a8's int8 activations) pass int_x and get one exact level (the integer path on every
 * CPU). The widening path takes x as it is.
 *
 * vpdpbusd takes unsigned bytes on one side, so the weights are stored offset: int8 w as w + 128, int4 w as the
 * nibble w + 8, and the offset times each activation row's sum is subtracted at the end.
 *
 * Layout (pack_codes in cpu_gemm.py): [ceil(N/32), G, 32, 4] bytes. int8: G = ceil(K/4), byte j of column c in
 * group g holds k = 4g + j. int4: G = ceil(K/8), its low nibble holds k = 8g + j and its high nibble k = 8g + 4 + j.
 * A thread's 32-column task streams one contiguous run; K is zero-padded (padding activations are 0).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "qgemm.h"
#include "threads.h"
#include "vec_math.h"

#define COLS 32   /* columns per task: two vectors of 16 int32 lanes */
#define QROWS 4   /* rows per register block: 4 rows x 2 levels x 2 vectors = 16 accumulators */
#define MAX_LEVELS 2

typedef struct {
    int8_t *q;            /* [M][levels][Kp]; NULL: the widening path below takes x as it is */
    float *scale;         /* [M][levels] */
    int32_t *sum;         /* [M][levels]: each level's sum of codes, for the weight offset */
    int levels, Kp, bias; /* bias: the weights' offset, 128 (int8) or 8 (int4) */
    const float *x;       /* the float rows [M][K]: quantize_rows' source, or the widening path's operand */
    int K, int_x;
} qacts;

static int64_t groups(int K, int bits) { return bits == 4 ? (K + 7) / 8 : (K + 3) / 4; }

/* ------------------------------------------------------------------ activations */
#ifdef __AVX512F__
#include <immintrin.h>
#endif

static inline float clamp127(float v) { return v < -127.0f ? -127.0f : v > 127.0f ? 127.0f : v; }

/* q[k] (and q2[k]) of one element; returns the level-1 code, writes the level-2 one. */
static inline int8_t code_of(float x, float s1, float inv1, float inv2, int8_t *q2) {
    const float a = clamp127(rintf(x * inv1));
    *q2 = (int8_t)clamp127(rintf((x - a * s1) * inv2));
    return (int8_t)a;
}

static void quantize_row(const float *x, int K, int Kp, int levels, int int_x, int8_t *q, float *scale,
                         int32_t *sum) {
    for (int l = 0; l < levels; l++) memset(q + (size_t)l * Kp + K, 0, (size_t)(Kp - K)); /* K's padding: zeros */
    if (int_x) {  /* already integer-valued in [-127, 127]: one exact level */
        int32_t s = 0;
        for (int k = 0; k < K; k++) {
            q[k] = (int8_t)clamp127(rintf(x[k]));
            s += q[k];
        }
        scale[0] = 1.0f, sum[0] = s;
        return;
    }
    float amax = 0.0f;
    int k0 = 0, nan = 0;  /* max ignores NaN, so it is looked for apart */
#ifdef __AVX512F__
    __m512 vmax = _mm512_setzero_ps();
    __mmask16 unordered = 0;
    for (; k0 + 16 <= K; k0 += 16) {
        const __m512 v = _mm512_loadu_ps(x + k0);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    amax = _mm512_reduce_max_ps(vmax), nan = unordered != 0;
#endif
    for (int k = k0; k < K; k++) {
        amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
        nan |= isnan(x[k]);
    }
    if (nan) amax = NAN;
    if (!(amax > 0.0f) || !isfinite(amax)) {  /* a zero row; a non-finite one gives NaN outputs */
        memset(q, 0, (size_t)levels * Kp);
        for (int l = 0; l < levels; l++) scale[l] = amax == 0.0f ? 0.0f : NAN, sum[l] = 0;
        return;
    }
    const float s1 = amax / 127.0f, s2 = s1 / 254.0f, inv1 = 127.0f / amax, inv2 = 254.0f * inv1;
    int32_t t1 = 0, t2 = 0;
    int8_t *q2 = q + Kp;
    int k = 0;
#ifdef __AVX512F__
    const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 vs1 = _mm512_set1_ps(s1), vi1 = _mm512_set1_ps(inv1), vi2 = _mm512_set1_ps(inv2);
    __m512i c1 = _mm512_setzero_si512(), c2 = _mm512_setzero_si512();
    for (; k + 16 <= K; k += 16) {
        const __m512 xv = _mm512_loadu_ps(x + k);
        const __m512 a = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(xv, vi1), rnd), lo), hi);
        const __m512 r = _mm512_fnmadd_ps(a, vs1, xv);
        const __m512 b = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_mul_ps(r, vi2), rnd), lo), hi);
        const __m512i ai = _mm512_cvtps_epi32(a), bi = _mm512_cvtps_epi32(b);
        _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtepi32_epi8(ai));
        _mm_storeu_si128((__m128i *)(q2 + k), _mm512_cvtepi32_epi8(bi));
        c1 = _mm512_add_epi32(c1, ai), c2 = _mm512_add_epi32(c2, bi);
    }
    t1 = _mm512_reduce_add_epi32(c1), t2 = _mm512_reduce_add_epi32(c2);
#endif
    for (; k < K; k++) {
        q[k] = code_of(x[k], s1, inv1, inv2, q2 + k);
        t1 += q[k], t2 += q2[k];
    }
    scale[0] = s1, scale[1] = s2, sum[0] = t1, sum[1] = t2;
}

/* ------------------------------------------------------------------ register blocks */
/* rows [m0, m0 + mb) of the activations times the 32-column block at w -> tile[mb][32] (before the weight scale),
 * prefetching pf_step bytes from pf a group (pf NULL: none) */
typedef void (*qblock_fn)(const qacts *, int, int64_t, const uint8_t *, float *, const char *, int);

static void finish_tile(const qacts *a, int m, const int32_t *acc /* [levels][32] */, float *tile) {
    for (int j = 0; j < COLS; j++) {
        float v = 0.0f;
        for (int l = 0; l < a->levels; l++) {
            const int64_t i = (int64_t)m * a->levels + l;
            v += a->scale[i] * (float)(acc[l * COLS + j] - a->bias * a->sum[i]);
        }
        tile[j] = v;
    }
}

/* Any CPU: the same integer arithmetic, one row at a time. */
static void qblock_plain(const qacts *a, int m0, int mb, int64_t G, const uint8_t *w, int bits, float *tile) {
    for (int m = 0; m < mb; m++) {
        int32_t acc[MAX_LEVELS * COLS] = {0};
        for (int l = 0; l < a->levels; l++) {
            const int8_t *q = a->q + ((int64_t)(m0 + m) * a->levels + l) * a->Kp;
            for (int64_t g = 0; g < G; g++)
                for (int c = 0; c < COLS; c++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = w[(g * COLS + c) * 4 + j];
                        if (bits == 8) {
                            acc[l * COLS + c] += (int32_t)byte * q[4 * g + j];
                        } else {
                            acc[l * COLS + c] += (int32_t)(byte & 15) * q[8 * g + j];
                            acc[l * COLS + c] += (int32_t)(byte >> 4) * q[8 * g + 4 + j];
                        }
                    }
        }
        finish_tile(a, m0 + m, acc, tile + m * COLS);
    }
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)

static inline __m512i broadcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* Row m's integer sums acc[level][half] (columns 0-15, 16-31), offset and scaled -> out[32], unscaled by the weight:
 * both the VNNI blocks and the AMX ones (qblock_amx) end here, so the two give the same floats. */
static inline void finish_row(const qacts *a, int m, const __m512i acc[2][2], float *out) {
    __m512 f0 = _mm512_setzero_ps(), f1 = _mm512_setzero_ps();
    for (int l = 0; l < a->levels; l++) {
        const int64_t i = (int64_t)m * a->levels + l;
        const __m512i off = _mm512_set1_epi32(a->bias * a->sum[i]);
        const __m512 sc = _mm512_set1_ps(a->scale[i]);
        f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[l][0], off)), sc, f0);
        f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[l][1], off)), sc, f1);
    }
    _mm512_storeu_ps(out, f0);
    _mm512_storeu_ps(out + 16, f1);
}

/* Rows [m0, m0 + mb), mb <= 16, times the int8 block at w on the tile unit (cpu_amx.c): TDPBSUD sums the same
 * integer products vpdpbusd does, exactly, 16 rows x 64 k an instruction. `tile_rows`: the rows its tiles hold, 8
 * (mb <= 8) or 16, one count for every group of a GEMM (each change reloads the tile configuration). */
static void qblock_amx(const qacts *a, int m0, int mb, int tile_rows, int64_t G, const uint8_t *w, float *tile,
                       const char *pf, int pf_step) {
    int32_t acc[MAX_LEVELS][16][COLS] __attribute__((aligned(64)));
    const int64_t row = (int64_t)m0 * a->levels * a->Kp;
    const int8_t *q[MAX_LEVELS] = {a->q + row, a->q + row + (a->levels > 1 ? a->Kp : 0)};
    ernie_amx_int8_rows(q, tile_rows, a->levels, (int64_t)a->levels * a->Kp, (int)G, w, &acc[0][0][0], pf, pf_step);
    for (int m = 0; m < mb; m++) {
        __m512i r[2][2];
        for (int l = 0; l < a->levels; l++) {
            r[l][0] = _mm512_load_si512(acc[l][m]);
            r[l][1] = _mm512_load_si512(acc[l][m] + 16);
        }
        finish_row(a, m0 + m, r, tile + m * COLS);
    }
}

/* Row m's level-l chains for one pair of weight vectors (X0: columns 0-15, X1: 16-31) and the codes at OFF. */
#define CHAIN(P, A0, A1, X0, X1, OFF)                                                                            \
    {                                                                                                            \
        const __m512i b = broadcast4((P) + (OFF));                                                               \
        A0 = _mm512_dpbusd_epi32(A0, X0, b);                                                                     \
        A1 = _mm512_dpbusd_epi32(A1, X1, b);                                                                     \
    }
#define CHAINS(MB, LV, X0, X1, OFF)                                                                              \
    CHAIN(q0, a00, a01, X0, X1, OFF)                                                                             \
    if (MB > 1) CHAIN(q1, a10, a11, X0, X1, OFF)                                                                 \
    if (MB > 2) CHAIN(q2, a20, a21, X0, X1, OFF)                                                                 \
    if (MB > 3) CHAIN(q3, a30, a31, X0, X1, OFF)                                                                 \
    if (LV > 1) {                                                                                                \
        CHAIN(r0, b00, b01, X0, X1, OFF)                                                                         \
        if (MB > 1) CHAIN(r1, b10, b11, X0, X1, OFF)                                                             \
        if (MB > 2) CHAIN(r2, b20, b21, X0, X1, OFF)                                                             \
        if (MB > 3) CHAIN(r3, b30, b31, X0, X1, OFF)                                                             \
    }

/* One instance per (bits, rows, levels). The accumulators are named variables, not an array: GCC 12 copied an
 * array's every element twice per iteration and spilled two (32 moves beside 16 vpdpbusd); named, the loop is the
 * loads, broadcasts and vpdpbusd alone. q*: level-1 codes of rows m0.., r*: level-2. */
#define QBLOCK(NAME, BITS, MB, LV)                                                                               \
static void NAME(const qacts *a, int m0, int64_t G, const uint8_t *w, float *tile, const char *pf, int pf_step) { \
    const __m512i z = _mm512_setzero_si512();                                                                    \
    __m512i a00 = z, a01 = z, a10 = z, a11 = z, a20 = z, a21 = z, a30 = z, a31 = z;                              \
    __m512i b00 = z, b01 = z, b10 = z, b11 = z, b20 = z, b21 = z, b30 = z, b31 = z;                              \
    const int8_t *row[2 * QROWS];                                                                                \
    for (int i = 0; i < 2 * QROWS; i++) {                                                                        \
        const int m = (i % QROWS) < MB ? i % QROWS : 0, l = i / QROWS < LV ? i / QROWS : 0;                      \
        row[i] = a->q + ((int64_t)(m0 + m) * LV + l) * a->Kp;                                                    \
    }                                                                                                            \
    const int8_t *q0 = row[0], *q1 = row[1], *q2 = row[2], *q3 = row[3];                                         \
    const int8_t *r0 = row[4], *r1 = row[5], *r2 = row[6], *r3 = row[7];                                         \
    const __m512i low4 = _mm512_set1_epi8(15);                                                                   \
    for (int64_t g = 0; g < G; g++, w += 4 * COLS) {                                                            \
        if (pf)                                                                                                  \
            for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pf + g * pf_step + o, _MM_HINT_T1);               \
        const __m512i v0 = _mm512_loadu_si512(w), v1 = _mm512_loadu_si512(w + 64);                               \
        if (BITS == 8) {                                                                                         \
            CHAINS(MB, LV, v0, v1, 4 * g)                                                                        \
        } else {                                                                                                 \
            const __m512i lo0 = _mm512_and_si512(v0, low4), lo1 = _mm512_and_si512(v1, low4);                    \
            const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4);                               \
            const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4);                               \
            CHAINS(MB, LV, lo0, lo1, 8 * g)                                                                      \
            CHAINS(MB, LV, hi0, hi1, 8 * g + 4)                                                                  \
        }                                                                                                        \
    }                                                                                                            \
    const __m512i acc[QROWS][2][2] = {{{a00, a01}, {b00, b01}}, {{a10, a11}, {b10, b11}},                        \
                                      {{a20, a21}, {b20, b21}}, {{a30, a31}, {b30, b31}}};                       \
    for (int m = 0; m < MB; m++) finish_row(a, m0 + m, acc[m], tile + m * COLS);                                \
}
#define QBLOCKS(P, BITS, LV) QBLOCK(P##1, BITS, 1, LV) QBLOCK(P##2, BITS, 2, LV) QBLOCK(P##3, BITS, 3, LV)          \
    QBLOCK(P##4, BITS, 4, LV) static const qblock_fn P##s[QROWS + 1] = {0, P##1, P##2, P##3, P##4};
QBLOCKS(qb8_l1_, 8, 1)
QBLOCKS(qb8_l2_, 8, 2)
QBLOCKS(qb4_l1_, 4, 1)
QBLOCKS(qb4_l2_, 4, 2)
#define HAVE_VNNI 1

#elif defined(__AVX2__)
#include <immintrin.h>
/* AVX2 has no vpdpbusd; vpmaddubsw + vpmaddwd do the same 4-byte dot products exactly as long as each product pair
 * fits int16, which holds for nibbles (2 x 15 x 127). So int4 codes go as they are and an int8 code is split into
 * its two nibbles, the high one's sum shifted by 4: the integer results equal vpdpbusd's (and qblock_plain's). */
static inline __m256i dot4_nibbles(__m256i w, __m256i b) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, b), _mm256_set1_epi16(1));
}

static inline __m256i broadcast4_256(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* One row and level at a time (4 accumulators of 8 columns); the block's weights stay in cache across them. */
static void qblock_avx2(const qacts *a, int m0, int mb, int64_t G, const uint8_t *w, int bits, float *tile) {
    const __m256i low4 = _mm256_set1_epi8(15);
    for (int m = 0; m < mb; m++) {
        int32_t acc[MAX_LEVELS * COLS];
        for (int l = 0; l < a->levels; l++) {
            const int8_t *q = a->q + ((int64_t)(m0 + m) * a->levels + l) * a->Kp;
            __m256i c[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256()};
            const uint8_t *wg = w;
            for (int64_t g = 0; g < G; g++, wg += 4 * COLS) {
                const __m256i b0 = broadcast4_256(q + (bits == 8 ? 4 : 8) * g);
                const __m256i b1 = bits == 8 ? b0 : broadcast4_256(q + 8 * g + 4);
                for (int i = 0; i < 4; i++) {  /* columns 8i .. 8i + 7 */
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * i));
                    const __m256i lo = _mm256_and_si256(v, low4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                    const __m256i dlo = dot4_nibbles(lo, b0), dhi = dot4_nibbles(hi, b1);
                    c[i] = _mm256_add_epi32(c[i], _mm256_add_epi32(dlo, bits == 8 ? _mm256_slli_epi32(dhi, 4) : dhi));
                }
            }
            for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(acc + l * COLS + 8 * i), c[i]);
        }
        finish_tile(a, m0 + m, acc, tile + m * COLS);
    }
}
#define HAVE_AVX2_QBLOCK 1

#ifdef __FMA__
/* Without VNNI the integer path costs ~10 instructions per 32 codes a row and level (the nibble split above), so
 * float activations take this one instead: each code widened to float32 in registers (a shift or a mask or both, and
 * a convert, per 8 codes, shared by the tile's rows) and multiplied in with FMAs, x exactly as given. 16 columns x up
 * to 4 rows a pass (8 accumulators, named: see QBLOCK). The codes are XORed with their offset's sign bits first,
 * which turns an offset code (w + 128, or the nibble w + 8) into w as a signed field.
 *
 * scaled_field: the width-bit field at bit `at` of each lane as float(w * 2^(32 - width)), i.e. the field moved to
 * the lane's top bits with the bits below it cleared (one already on top needs only the mask, one at bit 0 only the
 * shift): 3 shifts and 3 masks per 4 fields where sign-extending shift pairs took 8 shifts, and shifts, unlike masks,
 * are not issued on every vector port (scripts/bench_kernels_ab.py --bits 8,4 on an AVX2 CPU re-checks it). QF_STORE multiplies the
 * 2^(32 - width) back out, exactly: the sums are those of w * x scaled by a power of two (an |x| past ~1e29 would
 * now overflow float32, far beyond any activation). */
static inline __m256 scaled_field(__m256i v, int at, int width) {
    const __m256i top = _mm256_set1_epi32((int)(0xFFFFFFFFu << (32 - width)));
    if (at + width == 32) return _mm256_cvtepi32_ps(_mm256_and_si256(v, top));
    if (at == 0) return _mm256_cvtepi32_ps(_mm256_slli_epi32(v, 32 - width));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_slli_epi32(v, 32 - width - at), top));
}

#define QF_FMA(m)                                                                                                \
    if (rows > m) {                                                                                              \
        const __m256 b = _mm256_set1_ps(x[(int64_t)m * K + k]);                                                  \
        c##m##0 = _mm256_fmadd_ps(b, w0, c##m##0);                                                               \
        c##m##1 = _mm256_fmadd_ps(b, w1, c##m##1);                                                               \
    }
#define QF_STORE(m)                                                                                              \
    if (rows > m) {                                                                                              \
        _mm256_storeu_ps(tile + m * COLS + 16 * h, _mm256_mul_ps(c##m##0, unscale));                            \
        _mm256_storeu_ps(tile + m * COLS + 16 * h + 8, _mm256_mul_ps(c##m##1, unscale));                        \
    }
/* Rows x[0, MB) (row stride K) times the 32-column block of BITS-bit codes at w -> tile[MB][COLS], unscaled.
 * A group holds 4 k (int8: byte i) or 8 (int4: byte i's low nibble k = 8g + i, its high nibble 8g + 4 + i). */
#define QFBLOCK(NAME, BITS, MB)                                                                                  \
static void NAME(const float *x, int K, int64_t G, const uint8_t *w, float *tile, const char *pf, int pf_step) {  \
    enum { rows = MB, per = BITS == 8 ? 4 : 8, width = BITS == 8 ? 8 : 4 };                                     \
    const __m256i flip = _mm256_set1_epi32(BITS == 8 ? (int)0x80808080u : (int)0x88888888u);                     \
    const __m256 unscale = _mm256_set1_ps(BITS == 8 ? 0x1p-24f : 0x1p-28f);                                      \
    for (int h = 0; h < 2; h++) {                                                                                \
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,      \
               c31 = c00;                                                                                        \
        for (int64_t g = 0; g < G; g++) {                                                                        \
            const uint8_t *wg = w + (g * COLS + 16 * h) * 4;                                                     \
            if (pf)                                                                                              \
                for (int o = 0; o < pf_step; o += 64) _mm_prefetch(pf + (h * G + g) * pf_step + o, _MM_HINT_T0);   \
            const __m256i v0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wg), flip);                 \
            const __m256i v1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(wg + 32)), flip);          \
            const int64_t k0 = g * per, nk = K - k0 < per ? K - k0 : per;                                        \
            for (int i = 0; i < per; i++) {                                                                      \
                if (i >= nk) break;                                                                              \
                const int at = BITS == 8 ? 8 * i : (i < 4 ? 8 * i : 8 * (i - 4) + 4);                            \
                const __m256 w0 = scaled_field(v0, at, width), w1 = scaled_field(v1, at, width);                 \
                const int64_t k = k0 + i;                                                                        \
                QF_FMA(0) QF_FMA(1) QF_FMA(2) QF_FMA(3)                                                          \
            }                                                                                                    \
        }                                                                                                        \
        QF_STORE(0) QF_STORE(1) QF_STORE(2) QF_STORE(3)                                                          \
    }                                                                                                            \
}
typedef void (*qfblock_fn)(const float *, int, int64_t, const uint8_t *, float *, const char *, int);
QFBLOCK(qf8_1, 8, 1) QFBLOCK(qf8_2, 8, 2) QFBLOCK(qf8_3, 8, 3) QFBLOCK(qf8_4, 8, 4)
QFBLOCK(qf4_1, 4, 1) QFBLOCK(qf4_2, 4, 2) QFBLOCK(qf4_3, 4, 3) QFBLOCK(qf4_4, 4, 4)
static const qfblock_fn qf8[QROWS + 1] = {0, qf8_1, qf8_2, qf8_3, qf8_4};
static const qfblock_fn qf4[QROWS + 1] = {0, qf4_1, qf4_2, qf4_3, qf4_4};
#define HAVE_WIDENING_QBLOCK 1
#endif
#endif

/* pf, pf_step: the widening path prefetches pf_step bytes from pf a group of each half's pass, the VNNI one a group
 * of its one pass (cpu_gemm.c's rows_times_block says why); AVX2's integer path leaves it to the hardware. */
static void qblock(const qacts *a, int m0, int mb, int64_t G, const uint8_t *w, int bits, float *tile, const char *pf,
                   int pf_step) {
#ifdef HAVE_WIDENING_QBLOCK
    if (!a->q) {
        (bits == 8 ? qf8 : qf4)[mb](a->x + (int64_t)m0 * a->K, a->K, G, w, tile, pf, pf_step);
        return;
    }
#endif
#ifdef HAVE_VNNI
    const qblock_fn *fns = bits == 8 ? (a->levels == 1 ? qb8_l1_s : qb8_l2_s) : (a->levels == 1 ? qb4_l1_s : qb4_l2_s);
    fns[mb](a, m0, G, w, tile, pf, pf_step);
#elif defined(HAVE_AVX2_QBLOCK)
    (void)pf, (void)pf_step;
    qblock_avx2(a, m0, mb, G, w, bits, tile);
#else
    (void)pf, (void)pf_step;
    qblock_plain(a, m0, mb, G, w, bits, tile);
#endif
}

/* ------------------------------------------------------------------ tasks */
/* How M rows go through a block: `groups` row groups, of at most QROWS split evenly (5 as 3 + 2: a one-row pass
 * has too few accumulators to hide the FMA latency), or on AMX (amx set) of 16, the last one short; each group
 * prefetches an equal share of the next block. */
typedef struct {
    int groups, pf_step, amx, M;
    int64_t share;
} row_groups;

/* The most rows the integer path prefetches a block for. vpdpbusd multiplies 64 code pairs an instruction, so the
 * block stays memory-bound longer than on the widening path (PREFETCH_ROWS): with AVX-512 VNNI the prefetch pays up
 * to 16 rows. The VNNI passes prefetch into L2, not L1: the next block lies a whole block ahead (32 KB at K 1024),
 * which with the block being read overflows a 48 KB L1 and evicts lines before their use.
 * scripts/bench_kernels_ab.py --bits 8 / --bits 4 (GEMMs) and --workload uniform --dtype bfloat16 --quantization
 * wint8 (the engine) re-check it. */
#define INT_PREFETCH_ROWS 16

/* Whether M rows of int8 codes go through a block on AMX: from AMX_INT8_ROWS (amx.h: where the VNNI blocks run out of
 * cycles before memory runs out of bytes); K a multiple of 64 (a tile's 16 groups). */
static int int8_on_amx(int M, int64_t G) {
#ifdef HAVE_VNNI
    return M >= AMX_INT8_ROWS && G % 16 == 0 && ernie_amx_int8_ready();
#else
    (void)M, (void)G;
    return 0;
#endif
}

int ernie_int8_on_amx(int rows, int K) { return int8_on_amx(rows, groups(K, 8)); }

/* Whether M rows of these activations go to AMX-INT8: int8 codes on the integer path (a->q) and int8_on_amx. */
static int codes_on_amx(const qacts *a, int M, int64_t G, int bits) { return bits == 8 && a->q && int8_on_amx(M, G); }

static row_groups row_groups_of(const qacts *a, int M, int64_t G, int bits) {
    const int amx = codes_on_amx(a, M, G, bits), per = amx ? 16 : QROWS;
    row_groups r = {(M + per - 1) / per, 0, amx, M, 0};
    const int halves = a->q ? 1 : 2; /* the widening path reads a block in two halves a group, the integer one whole */
    const int most = a->q ? INT_PREFETCH_ROWS : PREFETCH_ROWS(bits);
    if (M > most) return r; /* compute-bound: no prefetch (share 0, so share_of gives NULL) */
    const int passes = r.groups > 0 ? halves * r.groups : 1;
    const int64_t pass = (G * 4 * COLS + passes - 1) / passes, steps = amx ? G / 16 : G; /* AMX: a step is 16 groups */
    r.share = halves * pass;
    r.pf_step = (int)((pass + steps - 1) / steps);
    return r;
}

static int rows_in_group(row_groups r, int i) {
    if (r.amx) return r.M - 16 * i < 16 ? r.M - 16 * i : 16;
    return r.M / r.groups + (i < r.M % r.groups);
}

/* Row group i's share of the next block, or NULL. */
static const char *share_of(const char *next, row_groups r, int i) { return next && r.share ? next + i * r.share : NULL; }

/* Rows [m0, m0 + mb) (a row group of r) times the block at w -> tile[mb][COLS], before the weight scale. */
static void group_times_block(const qacts *a, row_groups r, int m0, int mb, int64_t G, const uint8_t *w, int bits,
                              float *tile, const char *pf) {
#ifdef HAVE_VNNI
    if (r.amx) { /* a lone group of at most 8 rows (a MoE step's expert) on tiles of 8: half the activation reads */
        qblock_amx(a, m0, mb, r.M <= 8 ? 8 : 16, G, w, tile, pf, r.pf_step);
        return;
    }
#endif
    qblock(a, m0, mb, G, w, bits, tile, pf, r.pf_step);
}

/* Rows [r0, r0 + M) times column block b of one weight -> y rows (stride N), columns scaled by s; `next`: the block
 * this thread reads next, prefetched meanwhile (NULL: none). */
static void qcolumns(const qacts *a, int r0, int M, int K, const uint8_t *w, int N, const float *s, float *y, int b,
                     int bits, const char *next) {
    const int64_t G = groups(K, bits);
    const int n0 = b * COLS, nc = N - n0 < COLS ? N - n0 : COLS;
    const row_groups r = row_groups_of(a, M, G, bits);
    float tile[16 * COLS];
    for (int i = 0, m0 = 0, mb; i < r.groups; i++, m0 += mb) {
        mb = rows_in_group(r, i);
        group_times_block(a, r, r0 + m0, mb, G, w + (int64_t)b * G * 4 * COLS, bits, tile, share_of(next, r, i));
        for (int m = 0; m < mb; m++) {
            float *yr = y + (int64_t)(r0 + m0 + m) * N + n0;
            for (int j = 0; j < nc; j++) yr[j] = tile[m * COLS + j] * s[n0 + j];
        }
    }
}

/* SwiGLU fused: gate block b and up block b + I/32 of a [K, 2I] weight -> y rows of width I; the gate block's
 * passes prefetch the up block, the up block's `next`. */
static void qcolumns_swiglu(const qacts *a, int r0, int M, int K, const uint8_t *w, int N, const float *s, float *y,
                            int b, int bits, const char *next) {
    const int64_t G = groups(K, bits), block = G * 4 * COLS;
    const int I = N / 2, nb = I / COLS;
    const row_groups r = row_groups_of(a, M, G, bits);
    const char *up = (const char *)(w + (b + nb) * block);
    float g[16 * COLS], u[16 * COLS];
    for (int i = 0, m0 = 0, mb; i < r.groups; i++, m0 += mb) {
        mb = rows_in_group(r, i);
        group_times_block(a, r, r0 + m0, mb, G, w + b * block, bits, g, share_of(up, r, i));
        group_times_block(a, r, r0 + m0, mb, G, w + (b + nb) * block, bits, u, share_of(next, r, i));
        for (int m = 0; m < mb; m++) {
            for (int j = 0; j < COLS; j++) {
                g[m * COLS + j] *= s[b * COLS + j];
                u[m * COLS + j] *= s[I + b * COLS + j];
            }
            silu_mul_row(g + m * COLS, u + m * COLS, y + (int64_t)(r0 + m0 + m) * I + b * COLS, COLS);
        }
    }
}

/* The activations as the blocks take them: room for every row quantized once (the tasks below share them), which
 * quantize_rows fills inside the GEMM's own parallel region, or, with the widening path and float x, the rows as
 * they are. Returns 0, or -1 out of memory. */
static int prepare(const float *x, int M, int K, int bits, int int_x, qacts *a) {
    *a = (qacts){0};
#ifdef HAVE_WIDENING_QBLOCK
    if (!int_x) {
        a->x = x, a->K = K;
        return 0;
    }
#endif
    const int levels = int_x ? 1 : 2, Kp = (int)groups(K, bits) * (bits == 4 ? 8 : 4);
    /* rows past the last, zeroed: an AMX tile loads 16 rows from a group's first (int8 codes from AMX_INT8_ROWS) */
    const int pad = bits == 8 && M >= AMX_INT8_ROWS ? 16 : 0;
    const size_t codes = (size_t)M * levels * Kp, tail = (size_t)pad * levels * Kp + 64;
    a->q = aligned_alloc(64, (codes + tail + 63) / 64 * 64); /* 64-aligned: a tile's rows are whole lines */
    a->scale = malloc(sizeof(float) * (size_t)M * levels + 4);
    a->sum = malloc(sizeof(int32_t) * (size_t)M * levels + 4);
    if (!a->q || !a->scale || !a->sum) {
        free(a->q), free(a->scale), free(a->sum);
        return -1;
    }
    memset(a->q + codes, 0, tail);
    a->x = x, a->int_x = int_x, a->K = K;
    a->levels = levels, a->Kp = Kp, a->bias = bits == 8 ? 128 : 8;
    return 0;
}

/* Every row of x into a's codes, the rows shared out among the threads of the parallel region this is called from
 * (an implicit barrier at the end: every block reads every row). A region of its own before the GEMM's cost a fork,
 * and below 2^18 elements (every decode step, and prefill chunks up to 255 rows of 1024) it ran on one core while the
 * other waited. scripts/bench_kernels_ab.py --bits 8 and --prefill --bits 8,4 re-check it. */
static void quantize_rows(const qacts *a, int M) {
    if (!a->q) return; /* the widening path: float rows as they are */
    #pragma omp for schedule(static)
    for (int m = 0; m < M; m++)
        quantize_row(a->x + (int64_t)m * a->K, a->K, a->Kp, a->levels, a->int_x, a->q + (int64_t)m * a->levels * a->Kp,
                     a->scale + m * a->levels, a->sum + m * a->levels);
}

static void release(qacts *a) { free(a->q), free(a->scale), free(a->sum); }

int ernie_qgemm(const float *x, int M, int K, const uint8_t *w, int N, const float *s, float *y, int bits, int swiglu,
                int int_x) {
    qacts a;
    if (prepare(x, M, K, bits, int_x, &a)) return -1;
    const int nb = swiglu ? N / 2 / COLS : (N + COLS - 1) / COLS;
    const int64_t block = groups(K, bits) * 4 * COLS;
    #pragma omp parallel THREADS
    {
        quantize_rows(&a, M);
        #pragma omp for schedule(static)
        for (int b = 0; b < nb; b++) {
            const char *next = b + 1 < nb ? (const char *)(w + (b + 1) * block) : NULL;
            if (swiglu) qcolumns_swiglu(&a, 0, M, K, w, N, s, y, b, bits, next);
            else qcolumns(&a, 0, M, K, w, N, s, y, b, bits, next);
        }
    }
    release(&a);
    return 0;
}

int ernie_moe_qgemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K,
                    const uint8_t *const *w, int N, const float *const *s, float *y, int bits, int swiglu, int int_x) {
    int64_t M = 0;
    for (int e = 0; e < E; e++) M = starts[e] + rows[e] > M ? starts[e] + rows[e] : M;
    qacts a;
    if (prepare(x, (int)M, K, bits, int_x, &a)) return -1;
    const int nb = swiglu ? N / 2 / COLS : (N + COLS - 1) / COLS;
    const int64_t block = groups(K, bits) * 4 * COLS;
    const int flat_from = codes_on_amx(&a, AMX_INT8_ROWS, groups(K, bits), bits) ? AMX_INT8_ROWS : 0;
    #pragma omp parallel THREADS
    {
        quantize_rows(&a, (int)M);
        int first, end;
        ernie_my_task_run(rows, E, nb, flat_from, &first, &end);
        for (int task = ernie_first_task(first, end, nb, rows), t; task >= 0; task = t) {
            const int e = task / nb, b = task % nb;
            t = ernie_next_task(task, end, nb, rows);
            const char *next = t < 0 ? NULL : (const char *)(w[t / nb] + t % nb * block);
            /* rows are addressed from x's first row: y's too, so each expert's output lands at its starts[e] */
            if (swiglu) qcolumns_swiglu(&a, (int)starts[e], (int)rows[e], K, w[e], N, s[e], y, b, bits, next);
            else qcolumns(&a, (int)starts[e], (int)rows[e], K, w[e], N, s[e], y, b, bits, next);
        }
    }
    release(&a);
    return 0;
}
