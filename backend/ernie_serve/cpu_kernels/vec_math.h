/* exp over float vectors for the CPU kernels' SwiGLU and softmax loops.
 *
 * Why: without -ffast-math the compiler calls libm's scalar expf per element (~2.5 ns with two threads here),
 * which made SwiGLU over a 1616-token prefill (2.3 M exps a layer) cost more than its memory traffic. This is
 * Cephes' expf: range reduction by ln 2 split in two, a degree-6 polynomial, 2^n applied by vscalefps
 * (1-2 ulp; inputs below -103.97, -inf included, give 0, as softmax's masked keys and first block need).
 */
#ifndef ERNIE_VEC_MATH_H
#define ERNIE_VEC_MATH_H
#include <math.h>

#ifdef __AVX512F__
#include <immintrin.h>

static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-103.972084f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* p[j] = exp(p[j] - shift) for j < n; returns their sum. */
static inline float exp_shifted_sum(float *p, int n, float shift) {
    float sum = 0.0f;
    int j = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps(), m = _mm512_set1_ps(shift);
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), m));
        _mm512_storeu_ps(p + j, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (j < n) {
        __mmask16 k = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + j), m));
        _mm512_mask_storeu_ps(p + j, k, e);
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
        j = n;
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; j < n; j++) { p[j] = expf(p[j] - shift); sum += p[j]; }
    return sum;
}

/* out[i] = silu(g[i]) * u[i] = g / (1 + exp(-g)) * u for i < n. */
static inline void silu_mul_row(const float *g, const float *u, float *out, int n) {
    int i = 0;
#ifdef __AVX512F__
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
#endif
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
#endif
