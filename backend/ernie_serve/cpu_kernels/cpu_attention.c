/* Decode attention straight from the paged KV cache (float32), for the CPU serving path.
 *
 *   out[t, h] = softmax_j(q[t, h] . K[j, h / G] * scale) @ V[j, h / G]     over the keys row t sees
 *
 * Why: the Paddle path gathers every decode's blocks into a contiguous [B, kv_heads, L, head_dim] copy per
 * layer, then runs a padded batched matmul pair under an additive mask: at 16 decodes of ~130 tokens that
 * was ~2.4 ms a layer, 20% of the decode step. Here each (sequence, KV head) task walks its block table,
 * reads each key and value row once for the G query heads that share it (GQA) and the sequence's few query
 * rows (speculative verification), and folds the blocks with an online softmax (flash attention's running
 * max and sum), so no copy, mask or score matrix of the whole context exists.
 *
 * Layout: cache [num_blocks, block_size, kv_heads, head_dim]; q [T, heads, head_dim] with sequence s's rows
 * at [query_start_loc[s], query_start_loc[s + 1]); row i of a sequence with seq_len visible tokens and q_len
 * new ones sees keys j <= seq_len - q_len + i (the causal rule of model/attention.py). Any head_dim, block
 * size and GQA ratio; the (sequence, KV head) tasks are split across Paddle's OpenMP threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

/* One sequence's query rows for one KV head: `rows` = q_len * G (row, head) pairs, row-major in p [rows, bs].
 * Each key and value row is loaded once for all the pairs that see it. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                   int64_t q_start, int q_len, int64_t seq_len, int kvh, int nh, int nkv, int hd, int bs,
                   float scale, float *out, float *m, float *l, float *acc, float *p, int *seen) {
    const int G = nh / nkv, rows = q_len * G;
    const int64_t key_stride = (int64_t)nkv * hd;
    for (int r = 0; r < rows; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(acc, 0, sizeof(float) * rows * hd);
    for (int64_t b0 = 0; b0 < seq_len; b0 += bs) {
        const int64_t base = (table[b0 / bs] * bs * nkv + kvh) * (int64_t)hd;
        const float *kb = k_cache + base, *vb = v_cache + base;
        int nk_max = 0;
        for (int r = 0; r < rows; r++) {
            int64_t visible = seq_len - q_len + r / G + 1 - b0;  /* keys of this block row r sees */
            seen[r] = visible <= 0 ? 0 : visible < bs ? (int)visible : bs;
            nk_max = seen[r] > nk_max ? seen[r] : nk_max;
        }
        for (int j = 0; j < nk_max; j++) {
            const float *kr = kb + j * key_stride;
            for (int r = 0; r < rows; r++)
                if (j < seen[r])
                    p[r * bs + j] = dot(q + ((q_start + r / G) * nh + kvh * G + r % G) * (int64_t)hd, kr, hd) * scale;
        }
        for (int r = 0; r < rows; r++) {
            const int nk = seen[r];
            if (nk == 0) continue;
            float *pr = p + r * bs, mb = -INFINITY;
            for (int j = 0; j < nk; j++) mb = pr[j] > mb ? pr[j] : mb;
            const float m_new = mb > m[r] ? mb : m[r];
            const float alpha = expf(m[r] - m_new);  /* 0 on the first block (m = -inf) */
            const float sum = exp_shifted_sum(pr, nk, m_new);
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
            float *a = acc + (int64_t)r * hd;
            #pragma omp simd
            for (int d = 0; d < hd; d++) a[d] *= alpha;
        }
        for (int j = 0; j < nk_max; j++) {
            const float *vr = vb + j * key_stride;
            for (int r = 0; r < rows; r++) {
                if (j >= seen[r]) continue;
                const float pj = p[r * bs + j];
                float *a = acc + (int64_t)r * hd;
                #pragma omp simd
                for (int d = 0; d < hd; d++) a[d] += pj * vr[d];
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float *o = out + ((q_start + r / G) * nh + kvh * G + r % G) * (int64_t)hd;
        const float inv = 1.0f / l[r], *a = acc + (int64_t)r * hd;
        #pragma omp simd
        for (int d = 0; d < hd; d++) o[d] = a[d] * inv;
    }
}

/* Returns 0, or -1 when a work buffer could not be allocated (out is then incomplete). */
int ernie_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int64_t *block_tables, int table_stride, const int64_t *query_start_loc,
                               const int64_t *seq_lens, int num_seqs, int nh, int nkv, int hd, int bs, float scale,
                               float *out) {
    int failed = 0;
    #pragma omp parallel for schedule(static, 1) reduction(| : failed)
    for (int task = 0; task < num_seqs * nkv; task++) {
        const int s = task / nkv, kvh = task % nkv;
        const int q_len = (int)(query_start_loc[s + 1] - query_start_loc[s]);
        const int rows = q_len * (nh / nkv);
        float *buf = malloc(sizeof(float) * (size_t)rows * (hd + 3 + bs));
        if (!buf) { failed = 1; continue; }
        attend(q, k_cache, v_cache, block_tables + (int64_t)s * table_stride, query_start_loc[s], q_len,
               seq_lens[s], kvh, nh, nkv, hd, bs, scale, out, buf, buf + rows, buf + 2 * rows,
               buf + (size_t)rows * (hd + 2), (int *)(buf + (size_t)rows * (hd + 2 + bs)));
        free(buf);
    }
    return failed ? -1 : 0;
}
