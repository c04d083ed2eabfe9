/* exp over float vectors for the CPU kernels' SwiGLU and softmax loops.
 *
 * Why: without -ffast-math the compiler calls libm's scalar expf per element, which made SwiGLU over a
 * 1616-token prefill (2.3 M exps a layer) cost more than its memory traffic. This is
 * Cephes' expf: range reduction by ln 2 split in two, a degree-6 polynomial, 2^n applied by vscalefps
 * (1-2 ulp; inputs below -103.97, -inf included, give 0, as softmax's masked keys and first block need), on
 * vec16.h's vectors (AVX-512, or AVX2 + FMA).
 */
#ifndef ERNIE_VEC_MATH_H
#define ERNIE_VEC_MATH_H
#include <math.h>

#include "vec16.h"

#ifdef ERNIE_VF16
static inline vf16 exp16(vf16 x) {
    x = vf16_max(vf16_min(x, vf16_set1(88.3762626647949f)), vf16_set1(-103.972084f));
    vf16 n = vf16_round(vf16_mul(x, vf16_set1(1.44269504088896341f)));
    vf16 r = vf16_fnmadd(n, vf16_set1(0.693359375f), x);
    r = vf16_fnmadd(n, vf16_set1(-2.12194440e-4f), r);
    vf16 p = vf16_set1(1.9875691500e-4f);
    p = vf16_fmadd(p, r, vf16_set1(1.3981999507e-3f));
    p = vf16_fmadd(p, r, vf16_set1(8.3334519073e-3f));
    p = vf16_fmadd(p, r, vf16_set1(4.1665795894e-2f));
    p = vf16_fmadd(p, r, vf16_set1(1.6666665459e-1f));
    p = vf16_fmadd(p, r, vf16_set1(5.0000001201e-1f));
    p = vf16_add(vf16_fmadd(p, vf16_mul(r, r), r), vf16_set1(1.0f));
    return vf16_scale2(p, n);
}
#endif

/* The largest of p[0, n) as the scalar `v > m ? v : m` from -inf finds it (NaNs passed over): vmaxps(v, m) makes the
 * same choice lane by lane. Only a zero's sign may differ, and the callers only subtract the result. Vectors from 32
 * values: at 16 (a float32 cache's blocks) the lanes' own reduction cost what it saved (attention 0.93-1.00x). */
static inline float row_max(const float *p, int n) {
    float m = -INFINITY;
    int j = 0;
#ifdef ERNIE_VF16
    if (n >= 32) {
        vf16 mv = vf16_set1(-INFINITY);
        for (; j + 16 <= n; j += 16) mv = vf16_max(vf16_load(p + j), mv);
        float lanes[16];
        vf16_store(lanes, mv);
        for (int i = 0; i < 16; i++) m = lanes[i] > m ? lanes[i] : m;
    }
#endif
    for (; j < n; j++) m = p[j] > m ? p[j] : m;
    return m;
}

/* p[j] = exp(p[j] - shift) for j < n; returns their sum. */
static inline float exp_shifted_sum(float *p, int n, float shift) {
    float sum = 0.0f;
    int j = 0;
#ifdef ERNIE_VF16
    vf16 acc = vf16_zero(), m = vf16_set1(shift);
    for (; j + 16 <= n; j += 16) {
        vf16 e = exp16(vf16_sub(vf16_load(p + j), m));
        vf16_store(p + j, e);
        acc = vf16_add(acc, e);
    }
#ifdef __AVX512F__
    if (j < n) {  /* the tail in one masked vector */
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), m));
        _mm512_mask_storeu_ps(p + j, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
        j = n;
    }
#endif
    sum = vf16_reduce_add(acc);
#endif
    for (; j < n; j++) { p[j] = expf(p[j] - shift); sum += p[j]; }
    return sum;
}

/* out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u for i < n. */
static inline void silu_mul_row(const float *g, const float *u, float *out, int n) {
    int i = 0;
#ifdef ERNIE_VF16
    const vf16 one = vf16_set1(1.0f);
    for (; i + 16 <= n; i += 16) {
        vf16 gv = vf16_load(g + i);
        vf16 s = vf16_div(gv, vf16_add(one, exp16(vf16_sub(vf16_zero(), gv))));
        vf16_store(out + i, vf16_mul(s, vf16_load(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
#endif
