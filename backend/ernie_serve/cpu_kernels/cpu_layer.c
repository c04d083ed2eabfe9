/* ERNIE-4.5 decoder layers, each in one pass of C over the kernels of cpu_ops.c, cpu_gemm.c / cpu_qgemm.c and
 * cpu_attention.c, for the CPU serving path's steps that every one of those kernels covers.
 *
 * Why: with Python layers a decode step spends a large share of its time between the matmuls (the "rest of the
 * runner" that `.venv/bin/python scripts/bench_decode_step.py` reports for the Python layers): ~60 calls into the
 * small fused ops a step, almost all of it Python, ctypes and Paddle tensor creation around microseconds of
 * arithmetic, plus the layers' own dispatch, residual adds, the KV write and the experts' dispatch in NumPy. Here a layer is the same kernels called
 * back to back on buffers of one allocation. model/cpu_layers.py builds the descriptors below once at load and runs
 * the layers through here; the Python layers (model/ernie.py) remain the definition the tests hold this to, and
 * serve every step this does not.
 */
#include <math.h>
#include <string.h>

#include "kernels.h"
#include "vec16.h"

/* One projection in a serving layout: float32 column-blocked (bits 32, scale NULL) or int8 / int4 codes with one
 * scale a column (cpu_qgemm.c's layout), [k, n]. act_scale > 0 (w4a8): the input is first rounded to the int8
 * levels of that static scale and the product scaled back by it, as quantization/layers.QuantLinear does. */
typedef struct {
    const void *w;
    const float *scale;
    int32_t k, n, bits;
    float act_scale;
} ernie_linear;

/* The routed experts of a MoE layer: each expert's gate-up [hidden, 2I] and down [I, hidden] weights. */
typedef struct {
    const void *const *up_gate, *const *down;
    const float *const *up_gate_scale, *const *down_scale;  /* NULL for float32 */
    const float *up_gate_act, *down_act;                    /* w4a8: each expert's static activation scale; else NULL */
    const float *router, *router_bias;                      /* [hidden, E], [E] */
    int32_t num_experts, top_k, up_gate_cols, bits;
    float norm_min, _pad;
} ernie_experts;

typedef struct {
    const float *input_norm, *post_norm;
    ernie_linear qkv, o;
    ernie_linear mlp_up_gate, mlp_down;  /* the dense MLP, or a MoE layer's shared experts (w NULL: none) */
    const ernie_experts *experts;        /* NULL: a dense layer */
    void *k_cache, *v_cache;             /* [num_blocks, block_size, kv_heads, head_dim] float32, or bfloat16 bits */
} ernie_layer;

typedef struct {
    int32_t hidden, num_heads, num_kv_heads, head_dim;
    float eps, attn_scale;
    int32_t kv_bf16, _pad;  /* the KV cache holds bfloat16 (rounded to nearest even as it is written) */
} ernie_dims;

/* The step's index data (model/attention_metadata.py), the same for every layer. */
typedef struct {
    int32_t num_tokens, num_seqs, block_size, table_stride;
    const int64_t *positions, *slot_mapping, *block_tables, *query_start_loc, *seq_lens;
    const float *cos, *sin;  /* [positions, head_dim] */
    int64_t num_positions, num_blocks; /* the rows of cos / sin, the blocks of each layer's cache */
} ernie_step;

/* Whether every index the layers read through is in range: sequences tile the tokens in order, each sees at least its
 * own new tokens and at most its table's blocks, and the positions, slots and the table entries it reads lie within
 * cos / sin and the cache. Checked here, not in Python, where each NumPy reduction cost more than this loop does. */
static int step_in_range(const ernie_step *S) {
    const int64_t T = S->num_tokens, bs = S->block_size, slots = S->num_blocks * bs;
    if (T < 0 || S->num_seqs < 0 || bs <= 0 || S->query_start_loc[0] != 0 || S->query_start_loc[S->num_seqs] != T)
        return 0;
    for (int64_t t = 0; t < T; t++)
        if (S->positions[t] < 0 || S->positions[t] >= S->num_positions || S->slot_mapping[t] < 0
            || S->slot_mapping[t] >= slots)
            return 0;
    for (int s = 0; s < S->num_seqs; s++) {
        const int64_t q_len = S->query_start_loc[s + 1] - S->query_start_loc[s], len = S->seq_lens[s];
        if (q_len < 0 || len < q_len || len > (int64_t)S->table_stride * bs) return 0;
        const int64_t *table = S->block_tables + (int64_t)s * S->table_stride;
        for (int64_t b = 0; b < (len + bs - 1) / bs; b++)
            if (table[b] < 0 || table[b] >= S->num_blocks) return 0;
    }
    return 1;
}

/* The int8 levels of x [T, K] at a static scale a (quantization/formats.round_half_away, clipped to +-127). */
static void int8_levels(const float *x, int64_t n, float a, float *q) {
    for (int64_t i = 0; i < n; i++) {
        const float v = x[i] / a, r = copysignf(floorf(fabsf(v) + 0.5f), v);
        q[i] = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
    }
}

static void scale_rows(float *y, int64_t n, float a) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] *= a;
}

/* y = x @ W, or silu(gate) * up of a gate-up W (y [T, n / 2]), fused where cpu_gemm.c can, else through tmp
 * ([T, n]); a w4a8 projection quantizes x into qx ([T, k]) first and never fuses. */
static int project(const ernie_linear *l, const float *x, int T, float *y, int swiglu, float *tmp, float *qx) {
    if (l->act_scale > 0.0f) {
        int8_levels(x, (int64_t)T * l->k, l->act_scale, qx);
        float *out = swiglu ? tmp : y;
        if (ernie_gemm(qx, T, l->k, l->w, l->n, l->scale, out, l->bits, 0, 1)) return -1;
        scale_rows(out, (int64_t)T * l->n, l->act_scale);
        if (swiglu) ernie_silu_and_mul(tmp, T, l->n / 2, y);
        return 0;
    }
    if (!swiglu || ernie_gemm_swiglu_fits(l->n)) return ernie_gemm(x, T, l->k, l->w, l->n, l->scale, y, l->bits, swiglu, 0);
    if (ernie_gemm(x, T, l->k, l->w, l->n, l->scale, tmp, l->bits, 0, 0)) return -1;
    ernie_silu_and_mul(tmp, T, l->n / 2, y);
    return 0;
}

static void add_rows(float *x, const float *y, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) x[i] += y[i];
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* x [T, H] += attention(input_norm(x)), K/V of the step's tokens written to the cache at their slots. */
static int attention_block(const ernie_dims *d, const ernie_layer *L, const ernie_step *S, float *x, float *buf) {
    const int T = S->num_tokens, H = d->hidden, nh = d->num_heads, nkv = d->num_kv_heads, hd = d->head_dim;
    const int64_t qd = (int64_t)nh * hd, kvd = (int64_t)nkv * hd;
    float *h = buf, *qkv = h + (int64_t)T * H, *q = qkv + T * (qd + 2 * kvd), *k = q + T * qd, *v = k + T * kvd;
    float *att = v + T * kvd, *o = att + T * qd, *qx = o + (int64_t)T * H;
    ernie_rms_norm(x, L->input_norm, T, H, d->eps, h);
    if (project(&L->qkv, h, T, qkv, 0, NULL, qx)) return -1;
    ernie_split_rope(qkv, S->positions, S->cos, S->sin, T, nh, nkv, hd, q, k, v);
    for (int t = 0; t < T; t++) {
        const int64_t at = S->slot_mapping[t] * kvd;
        if (d->kv_bf16) {
            uint16_t *kc = (uint16_t *)L->k_cache + at, *vc = (uint16_t *)L->v_cache + at;
            for (int64_t i = 0; i < kvd; i++) {
                kc[i] = f32_to_bf16(k[t * kvd + i]);
                vc[i] = f32_to_bf16(v[t * kvd + i]);
            }
        } else {
            memcpy((float *)L->k_cache + at, k + t * kvd, sizeof(float) * kvd);
            memcpy((float *)L->v_cache + at, v + t * kvd, sizeof(float) * kvd);
        }
    }
    if (ernie_paged_attention(q, L->k_cache, L->v_cache, d->kv_bf16, S->block_tables, S->table_stride,
                              S->query_start_loc, S->seq_lens, S->num_seqs, nh, nkv, hd, S->block_size, d->attn_scale,
                              att))
        return -1;
    if (project(&L->o, att, T, o, 0, NULL, qx)) return -1;
    add_rows(x, o, (int64_t)T * H);
    return 0;
}

static int64_t attention_work(const ernie_dims *d, int T) {
    const int64_t H = d->hidden, qd = (int64_t)d->num_heads * d->head_dim, kvd = (int64_t)d->num_kv_heads * d->head_dim;
    return T * (2 * H + 3 * qd + 4 * kvd + max64(H, qd));
}

/* Each expert's rows of y [*, width] in place: to the int8 levels of its activation scale, or scaled by it. */
static void per_expert(float *y, const int64_t *counts, const int64_t *starts, int E, int width, const float *a,
                       int levels) {
    for (int e = 0; e < E; e++) {
        float *r = y + starts[e] * width;
        if (levels) int8_levels(r, counts[e] * width, a[e], r);
        else scale_rows(r, counts[e] * width, a[e]);
    }
}

/* Whether the gate-up matmul of these experts carries SwiGLU (cpu_gemm.c's widths, not w4a8). */
static int experts_fuse(const ernie_experts *X) { return !X->up_gate_act && ernie_gemm_swiglu_fits(X->up_gate_cols); }

/* out [T, H] = sum over each token's top-k experts of weight * expert(h): tokens counted into per-expert runs
 * (stable, in token order), gathered, both matmuls over every expert in one call each, weighted back. */
static int routed_experts(const ernie_experts *X, const float *h, int T, int H, float *out, float *buf) {
    const int E = X->num_experts, k = X->top_k, n = T * k, I = X->up_gate_cols / 2, w4a8 = X->up_gate_act != NULL;
    int64_t *ids = (int64_t *)buf, *order = ids + n, *src = order + n, *counts = src + n, *starts = counts + E;
    float *weights = (float *)(starts + E), *xs = weights + n, *act = xs + (int64_t)n * H;
    float *ys = act + (int64_t)n * I, *tmp = ys + (int64_t)n * H;
    ernie_route(h, X->router, X->router_bias, T, H, E, k, X->norm_min, ids, weights);
    memset(counts, 0, sizeof(int64_t) * E);
    for (int i = 0; i < n; i++) counts[ids[i]]++;
    for (int e = 0, at = 0; e < E; e++) { starts[e] = at; at += (int)counts[e]; }
    for (int i = 0; i < n; i++) {        /* starts[e] walks expert e's run as it fills, then is reset below */
        const int64_t row = starts[ids[i]]++;
        order[row] = i / k;              /* the token expert row `row` reads */
        src[i] = row;                    /* the expert row that (token, choice) i reads back */
    }
    for (int e = 0; e < E; e++) starts[e] -= counts[e];
    ernie_gather_rows(h, order, n, H, xs);
    const int fused = experts_fuse(X);
    if (w4a8) per_expert(xs, counts, starts, E, H, X->up_gate_act, 1);
    if (ernie_moe_gemm(xs, counts, starts, E, H, (const void *const *)X->up_gate, X->up_gate_cols, X->up_gate_scale,
                       fused ? act : tmp, X->bits, fused, w4a8))
        return -1;
    if (w4a8) per_expert(tmp, counts, starts, E, 2 * I, X->up_gate_act, 0);
    if (!fused) ernie_silu_and_mul(tmp, n, I, act);
    if (w4a8) per_expert(act, counts, starts, E, I, X->down_act, 1);
    if (ernie_moe_gemm(act, counts, starts, E, I, (const void *const *)X->down, H, X->down_scale, ys, X->bits, 0, w4a8))
        return -1;
    if (w4a8) per_expert(ys, counts, starts, E, H, X->down_act, 0);
    ernie_weighted_combine(ys, src, weights, T, k, H, out);
    return 0;
}

static int64_t experts_work(const ernie_experts *X, int64_t T, int64_t H) {
    const int64_t n = T * X->top_k, ug = X->up_gate_cols;
    return 2 * (3 * n + 2 * X->num_experts) + n + n * (2 * H + ug / 2 + (experts_fuse(X) ? 0 : ug));
}

/* x [T, H] += mlp(post_norm(x)): the routed experts plus the shared ones (summed before the residual, as
 * model/moe.MoE does), or the dense MLP. */
static int mlp_block(const ernie_dims *d, const ernie_layer *L, int T, float *x, float *buf) {
    const int64_t TH = (int64_t)T * d->hidden;
    float *h = buf, *out = h + TH, *shared = out + TH, *rest = shared + TH;
    ernie_rms_norm(x, L->post_norm, T, d->hidden, d->eps, h);
    if (L->experts && routed_experts(L->experts, h, T, d->hidden, out, rest)) return -1;
    if (L->mlp_up_gate.w) {
        const int64_t I = L->mlp_up_gate.n / 2;
        float *act = rest, *tmp = act + T * I, *qx = tmp + T * 2 * I, *y = L->experts ? shared : out;
        if (project(&L->mlp_up_gate, h, T, act, 1, tmp, qx) || project(&L->mlp_down, act, T, y, 0, NULL, qx))
            return -1;
        if (L->experts) add_rows(out, shared, TH);
    }
    add_rows(x, out, TH);
    return 0;
}

static int64_t mlp_work(const ernie_dims *d, const ernie_layer *L, int64_t T) {
    const int64_t H = d->hidden, I = L->mlp_up_gate.n / 2;
    const int64_t experts = L->experts ? experts_work(L->experts, T, H) : 0;
    const int64_t dense = L->mlp_up_gate.w ? T * (3 * I + max64(H, I)) : 0;
    return 3 * T * H + max64(experts, dense);
}

/* The floats of work buffer T tokens need (a bound over every layer; int64 index arrays count as two floats). */
int64_t ernie_decoder_layers_work(const ernie_dims *d, const ernie_layer *layers, int num_layers, int T) {
    int64_t need = attention_work(d, T);
    for (int i = 0; i < num_layers; i++) need = max64(need, mlp_work(d, &layers[i], T));
    return need;
}

/* Runs num_layers decoder layers over x [T, H] in place, with `work` of ernie_decoder_layers_work(T) floats (the
 * caller keeps it between steps: a fresh prefill-sized buffer would be faulted in page by page every step). Returns
 * 0; -2, x untouched, when an index of the step is out of range (step_in_range); -1 when a kernel ran out of memory
 * (x is then partly computed). The caller checked the arrays' shapes (model/cpu_layers.py). */
int ernie_decoder_layers(const ernie_dims *d, const ernie_layer *layers, int num_layers, const ernie_step *S,
                         float *x, float *work) {
    if (!step_in_range(S)) return -2;
    for (int i = 0; i < num_layers; i++)
        if (attention_block(d, &layers[i], S, x, work) || mlp_block(d, &layers[i], S->num_tokens, x, work)) return -1;
    return 0;
}
