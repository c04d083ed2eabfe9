/* 16 floats as one vector, for the CPU kernels' inner loops: AVX-512's __m512, or a pair of AVX2 __m256 halves.
 *
 * Why: the kernels were written for AVX-512 and fell back to scalar loops anywhere else, so on an AVX2-only CPU
 * (AMD Zen 3) the whole CPU path ran an order of magnitude slower than NumPy's own matmul. Written once against
 * vf16, a kernel compiles to the same AVX-512 instructions as before (so its results there are unchanged) and to
 * two AVX2 + FMA instructions per operation elsewhere.
 * ERNIE_VF16 is defined when one of the two is available; code without it keeps its scalar loop.
 */
#ifndef ERNIE_VEC16_H
#define ERNIE_VEC16_H
#include <stdint.h>
#include <string.h>

/* One bfloat16 (its bits) as the float32 it is exactly: the float's high half. */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* A float32 rounded to bfloat16 (nearest, ties to even, as ml_dtypes and the GPU's conversion do; NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define ERNIE_VF16 1
typedef __m512 vf16;

static inline vf16 vf16_load(const float *p) { return _mm512_loadu_ps(p); }
/* 16 bfloat16 values (their bits) widened to float32: a bfloat16 is a float32's high half */
static inline vf16 vf16_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void vf16_store(float *p, vf16 v) { _mm512_storeu_ps(p, v); }
/* 16 float32 rounded to bfloat16 as f32_to_bf16 rounds one (AVX-512F alone: no AVX512-BF16 needed) */
static inline __m256i f32_to_bf16_16(vf16 v) {
    const __m512i u = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i even = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                          _mm512_and_si512(_mm512_srli_epi32(u, 16), one));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i r = _mm512_mask_or_epi32(_mm512_srli_epi32(even, 16), nan, _mm512_srli_epi32(u, 16),
                                           _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}
static inline vf16 vf16_set1(float x) { return _mm512_set1_ps(x); }
static inline vf16 vf16_zero(void) { return _mm512_setzero_ps(); }
static inline vf16 vf16_add(vf16 a, vf16 b) { return _mm512_add_ps(a, b); }
static inline vf16 vf16_sub(vf16 a, vf16 b) { return _mm512_sub_ps(a, b); }
static inline vf16 vf16_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
static inline vf16 vf16_div(vf16 a, vf16 b) { return _mm512_div_ps(a, b); }
static inline vf16 vf16_min(vf16 a, vf16 b) { return _mm512_min_ps(a, b); }
static inline vf16 vf16_max(vf16 a, vf16 b) { return _mm512_max_ps(a, b); }
static inline vf16 vf16_fmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }   /* a * b + c */
static inline vf16 vf16_fnmadd(vf16 a, vf16 b, vf16 c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
static inline vf16 vf16_round(vf16 a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* a * 2^n for integer-valued n in [-150, 128] */
static inline vf16 vf16_scale2(vf16 a, vf16 n) { return _mm512_scalef_ps(a, n); }
static inline float vf16_reduce_add(vf16 a) { return _mm512_reduce_add_ps(a); }
/* Whether some lane is > b, or is a NaN (the tests an argmax needs before it looks at the lanes one by one). */
static inline int vf16_any_above_or_nan(vf16 a, float b) {
    return _mm512_cmp_ps_mask(a, _mm512_set1_ps(b), _CMP_NLE_UQ) != 0;
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ERNIE_VF16 1
typedef struct { __m256 lo, hi; } vf16;

#define VF16_BINARY(name, op) \
    static inline vf16 name(vf16 a, vf16 b) { vf16 r = {op(a.lo, b.lo), op(a.hi, b.hi)}; return r; }
#define VF16_TERNARY(name, op) \
    static inline vf16 name(vf16 a, vf16 b, vf16 c) { vf16 r = {op(a.lo, b.lo, c.lo), op(a.hi, b.hi, c.hi)}; return r; }

static inline vf16 vf16_load(const float *p) { vf16 r = {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; return r; }
static inline __m256 bf16_8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vf16 vf16_load_bf16(const uint16_t *p) { vf16 r = {bf16_8(p), bf16_8(p + 8)}; return r; }
static inline void vf16_store(float *p, vf16 v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline vf16 vf16_set1(float x) { vf16 r = {_mm256_set1_ps(x), _mm256_set1_ps(x)}; return r; }
static inline vf16 vf16_zero(void) { vf16 r = {_mm256_setzero_ps(), _mm256_setzero_ps()}; return r; }
VF16_BINARY(vf16_add, _mm256_add_ps)
VF16_BINARY(vf16_sub, _mm256_sub_ps)
VF16_BINARY(vf16_mul, _mm256_mul_ps)
VF16_BINARY(vf16_div, _mm256_div_ps)
VF16_BINARY(vf16_min, _mm256_min_ps)
VF16_BINARY(vf16_max, _mm256_max_ps)
VF16_TERNARY(vf16_fmadd, _mm256_fmadd_ps)
VF16_TERNARY(vf16_fnmadd, _mm256_fnmadd_ps)

static inline vf16 vf16_round(vf16 a) {
    const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    vf16 r = {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
    return r;
}

/* 2^k for integer k in [-126, 127], built in the exponent field */
static inline __m256 pow2_8(__m256i k) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23));
}

/* a * 2^n for integer-valued n in [-150, 128]: as two factors 2^(n/2) 2^(n - n/2), each a normal float */
static inline __m256 scale2_8(__m256 a, __m256 n) {
    const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    return _mm256_mul_ps(_mm256_mul_ps(a, pow2_8(k1)), pow2_8(k2));
}
VF16_BINARY(vf16_scale2, scale2_8)

/* in the order _mm512_reduce_add_ps adds: halves, then quarters, then pairs */
static inline float vf16_reduce_add(vf16 a) {
    const __m256 h = _mm256_add_ps(a.lo, a.hi);
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
static inline int vf16_any_above_or_nan(vf16 a, float b) {
    const __m256 v = _mm256_set1_ps(b);
    return (_mm256_movemask_ps(_mm256_cmp_ps(a.lo, v, _CMP_NLE_UQ))
            | _mm256_movemask_ps(_mm256_cmp_ps(a.hi, v, _CMP_NLE_UQ))) != 0;
}
#undef VF16_BINARY
#undef VF16_TERNARY
#endif

#endif
