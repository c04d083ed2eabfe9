/* The small ops of an ERNIE-4.5 decoder layer, fused, for the CPU serving path.
 *
 * Why: between its matmuls a layer ran ~40 Paddle ops (norm, split, rotary embedding by a rotation matmul,
 * SwiGLU, the experts' gather / weighting / index_add), each a pass over memory and an op dispatch, and at
 * prefill as at decode they took a large share of the step beside the matmuls.
 * Each function here is one pass, split across Paddle's OpenMP threads by rows when it is big enough
 * (PARALLEL): waking another thread after the main thread did anything else can cost far more than a
 * decode-sized op (an RMSNorm over 16 x 1024) takes on one thread, notably under a hypervisor.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "threads.h"
#include "vec_math.h"

#define PARALLEL(elements) if ((int64_t)(elements) >= (1 << 18))

/* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w */
void ernie_rms_norm(const float *x, const float *w, int T, int H, float eps, float *out) {
    #pragma omp parallel for THREADS schedule(static) PARALLEL((int64_t)T * H)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (int64_t)t * H;
        float *o = out + (int64_t)t * H, ss = 0.0f;
        #pragma omp simd reduction(+ : ss)
        for (int i = 0; i < H; i++) ss += xr[i] * xr[i];
        const float r = 1.0f / sqrtf(ss / H + eps);
        #pragma omp simd
        for (int i = 0; i < H; i++) o[i] = xr[i] * r * w[i];
    }
}

/* qkv [T, (nh + 2 nkv) * hd] ([Q | K | V] per row) -> q [T, nh, hd], k and v [T, nkv, hd], with ERNIE's
 * interleaved rotary embedding applied to q and k: pair (2i, 2i+1) rotates by the angle of its position.
 * cos / sin: [positions, hd] tables with both entries of a pair equal (layers.RotaryEmbedding's). */
void ernie_split_rope(const float *qkv, const int64_t *positions, const float *cos_t, const float *sin_t, int T,
                      int nh, int nkv, int hd, float *q, float *k, float *v) {
    const int64_t row = (int64_t)(nh + 2 * nkv) * hd;
    #pragma omp parallel for THREADS schedule(static) PARALLEL(T * row)
    for (int t = 0; t < T; t++) {
        const float *src = qkv + t * row, *c = cos_t + positions[t] * hd, *s = sin_t + positions[t] * hd;
        for (int h = 0; h < nh + nkv; h++) {
            const float *x = src + (int64_t)h * hd;
            float *o = h < nh ? q + ((int64_t)t * nh + h) * hd : k + ((int64_t)t * nkv + h - nh) * hd;
            for (int d = 0; d < hd; d += 2) {
                o[d] = x[d] * c[d] - x[d + 1] * s[d];
                o[d + 1] = x[d + 1] * c[d + 1] + x[d] * s[d + 1];
            }
        }
        const float *vs = src + (int64_t)(nh + nkv) * hd;
        float *vo = v + (int64_t)t * nkv * hd;
        #pragma omp simd
        for (int d = 0; d < nkv * hd; d++) vo[d] = vs[d];
    }
}

/* gate_up [T, 2I] (gate half first) -> silu(gate) * up [T, I] */
void ernie_silu_and_mul(const float *gate_up, int T, int I, float *out) {
    #pragma omp parallel for THREADS schedule(static) PARALLEL((int64_t)T * I * 8)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + (int64_t)t * 2 * I;
        silu_mul_row(g, g + I, out + (int64_t)t * I, I);
    }
}

/* out[i] = x[idx[i]], or zeros where idx[i] < 0 (the padding rows of a batched expert input) */
void ernie_gather_rows(const float *x, const int64_t *idx, int n, int H, float *out) {
    #pragma omp parallel for THREADS schedule(static) PARALLEL((int64_t)n * H)
    for (int i = 0; i < n; i++) {
        float *o = out + (int64_t)i * H;
        if (idx[i] < 0) {
            for (int j = 0; j < H; j++) o[j] = 0.0f;
            continue;
        }
        const float *xr = x + idx[i] * H;
        #pragma omp simd
        for (int j = 0; j < H; j++) o[j] = xr[j];
    }
}

/* The mixture: out[t] = sum_j w[t, j] * ys[src[t, j]] over the k choices of token t whose src >= 0 (choices of
 * another expert-parallel rank's experts are -1). Summed in choice order, so no two threads write a row. */
void ernie_weighted_combine(const float *ys, const int64_t *src, const float *w, int T, int k, int H, float *out) {
    #pragma omp parallel for THREADS schedule(static) PARALLEL((int64_t)T * k * H)
    for (int t = 0; t < T; t++) {
        float *o = out + (int64_t)t * H;
        for (int j = 0; j < H; j++) o[j] = 0.0f;
        for (int c = 0; c < k; c++) {
            const int64_t r = src[(int64_t)t * k + c];
            if (r < 0) continue;
            const float wc = w[(int64_t)t * k + c], *y = ys + r * H;
            #pragma omp simd
            for (int j = 0; j < H; j++) o[j] += wc * y[j];
        }
    }
}

/* ERNIE-4.5's router: probs = softmax(x[t] @ W) over E experts (W [H, E]); the k experts with the largest
 * probs + bias (ties: the lower id), in that order; their weights = probs renormalized to sum to one (the sum
 * clipped below at norm_min). The bias only chooses. */
void ernie_route(const float *x, const float *w, const float *bias, int T, int H, int E, int k, float norm_min,
                 int64_t *ids, float *weights) {
    #pragma omp parallel for THREADS schedule(static) PARALLEL((int64_t)T * H * E)
    for (int t = 0; t < T; t++) {
        float probs[E], score[E];
        for (int e = 0; e < E; e++) probs[e] = 0.0f;
        const float *xr = x + (int64_t)t * H;
        for (int h = 0; h < H; h++) {
            const float xv = xr[h], *wr = w + (int64_t)h * E;
            #pragma omp simd
            for (int e = 0; e < E; e++) probs[e] += xv * wr[e];
        }
        float mx = probs[0];
        for (int e = 1; e < E; e++) mx = probs[e] > mx ? probs[e] : mx;
        const float inv = 1.0f / exp_shifted_sum(probs, E, mx);
        for (int e = 0; e < E; e++) { probs[e] *= inv; score[e] = probs[e] + bias[e]; }
        float total = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (score[e] != -INFINITY && (best < 0 || score[e] > score[best])) best = e;
            score[best] = -INFINITY;
            ids[(int64_t)t * k + j] = best;
            weights[(int64_t)t * k + j] = probs[best];
            total += probs[best];
        }
        total = total > norm_min ? total : norm_min;
        for (int j = 0; j < k; j++) weights[(int64_t)t * k + j] /= total;
    }
}
