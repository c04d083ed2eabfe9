/* Attention straight from the paged KV cache (float32, or bfloat16 with --dtype bfloat16) for decodes and short
 * prefill chunks, CPU serving path.
 *
 *   out[t, h] = softmax_j(q[t, h] . K[j, h / G] * scale) @ V[j, h / G]     over the keys row t sees
 *
 * Why: the Paddle path gathers every decode's blocks into a contiguous [B, kv_heads, L, head_dim] copy per
 * layer, then runs a padded batched matmul pair under an additive mask: at 16 decodes that was a large share
 * of the decode step, and a short prefill chunk went through ~15 small ops a layer. Here
 * each (sequence, KV head) task walks its block table, scores tiles of 4 (query row, head) pairs against 4
 * keys in registers (each key and query vector loaded once a tile; the G heads sharing a KV head are pairs of
 * the same task), and folds the blocks with an online softmax (flash attention's running max and sum), so no
 * copy, mask or score matrix of the whole context exists. Its dot-product tiles run far below the matmul
 * path's rate on long chunks, which stay there (model/attention.NATIVE_CHUNK_WORK).
 *
 * Layout: cache [num_blocks, block_size, kv_heads, head_dim]; q [T, heads, head_dim] with sequence s's rows
 * at [query_start_loc[s], query_start_loc[s + 1]); row i of a sequence with seq_len visible tokens and q_len
 * new ones sees keys j <= seq_len - q_len + i (the causal rule of model/attention.py). Any head_dim, block
 * size and GQA ratio; the (sequence, KV head) tasks, or with enough sequences one task a sequence, are split across
 * the OpenMP threads. A bfloat16 cache's rows are widened as the tiles load them, so both caches share one arithmetic
 * (a bfloat16 cache's values give a float32 cache's result bit for bit); a head_dim the vector loops do not take
 * widens a block into float32 scratch first. Each score tile's 16 dot products are summed across their lanes together
 * (sum16, in the order one reduction each used): reduced one by one they cost as much as their FMAs.
 * `scripts/bench_kernels_ab.py --attention [--dtype bfloat16]`: 1.2-1.5x over the widening pass and one-by-one sums on
 * the prefills and decodes it times.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "threads.h"
#include "vec16.h"
#include "vec_math.h"

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    #pragma omp simd reduction(+ : s)
    for (int d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

#define RT 4  /* (row, head) pairs per register tile */
#ifdef ERNIE_VF16
#define VEC_HD(hd) ((hd) % 16 == 0) /* head_dims the vector loops take */
#else
#define VEC_HD(hd) 0
#endif
#ifdef __AVX512F__
#define KT 4  /* keys per score tile: RT x KT accumulators, 16 of AVX-512's 32 registers */
#define SRT RT
#else
#define KT 2  /* AVX2: a vf16 is two of its 16 registers, so a score tile of 2 x 2 (4 x 4 spilled in its loop) */
#define SRT 2
#endif

#ifdef __AVX512F__
/* The lane sums of 16 vectors at once, out[4j + e] = the sum of x[j + 4e]'s 16 lanes, each added in
 * _mm512_reduce_add_ps's order (lanes i and i + 8, then i + 4, i + 2, i + 1), so the scores are the ones 16 separate
 * reductions gave, bit for bit (checked against it on random vectors), in 45 instructions where those took ~130. */
static inline __m512 sum16(const __m512 x[16]) {
    __m512 p[8], q[4], r[2];
    for (int k = 0; k < 8; k++) /* lanes 0-7: x[2k]'s i + (i + 8), 8-15: x[2k + 1]'s */
        p[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xEE));
    for (int m = 0; m < 4; m++) /* 128-bit lane j: x[4m + j]'s four partial sums */
        q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(p[2 * m], p[2 * m + 1], 0xDD));
    for (int n = 0; n < 2; n++) { /* lane j: two partial sums of x[8n + j], two of x[8n + 4 + j] */
        const __m512d a = _mm512_castps_pd(q[2 * n]), b = _mm512_castps_pd(q[2 * n + 1]);
        r[n] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    return _mm512_add_ps(_mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(r[0], r[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

/* One KV head's rows in a cache block, for prefetching into L2 (k NULL: none). A step reaches a layer's cache from
 * memory (its weights have streamed through the caches since), and a block's rows of one head lie nkv * head_dim
 * apart, a pattern the hardware prefetcher ramps up on late: a 16-sequence decode read a cold bfloat16 cache at
 * ~6 GB/s without this. The next block's rows are prefetched a tile's keys at a time as the scores go (a burst of
 * all of them at once waited on fill buffers), a thread's next task's first block at once. */
typedef struct {
    const char *k, *v;
    int64_t stride;  /* bytes between rows */
    int rows, bytes; /* rows, and bytes a row */
} kv_rows;

static kv_rows rows_of(const void *k_cache, const void *v_cache, int kv_bf16, int64_t block, int kvh, int nkv, int hd,
                       int bs, int64_t nk) {
    const int64_t es = kv_bf16 ? 2 : 4, at = (block * bs * nkv + kvh) * (int64_t)hd * es;
    const kv_rows r = {(const char *)k_cache + at, (const char *)v_cache + at, (int64_t)nkv * hd * es, (int)nk,
                       (int)(hd * es)};
    return r;
}

/* Keys and values of rows [j0, j0 + n) of `a`, into L2. */
static inline void prefetch_rows(kv_rows a, int j0, int n) {
    if (!a.k) return;
    for (int j = j0; j < j0 + n && j < a.rows; j++)
        for (int o = 0; o < a.bytes; o += 64) {
            __builtin_prefetch(a.k + j * a.stride + o, 0, 2);
            __builtin_prefetch(a.v + j * a.stride + o, 0, 2);
        }
}

#ifdef ERNIE_VF16
/* 16 values of a key or value row from the cache: float32, or bfloat16 bits widened (bf16 is a constant in every
 * caller, so each form gets its own loop). */
static inline __attribute__((always_inline)) vf16 kv_load(const void *base, int64_t i, int bf16) {
    return bf16 ? vf16_load_bf16((const uint16_t *)base + i) : vf16_load((const float *)base + i);
}

/* p[r][j] = q_r . k_j * scale for the `rows` pairs (qp: their query vectors) and keys j < nk of a block, read
 * straight from the cache (hd % 16 == 0). RT x KT dot products at a time: each q and k vector loaded once a tile. */
static inline __attribute__((always_inline)) void scores_vec(const float *const *qp, int rows, const void *kb,
                                                             int64_t key_stride, int nk, int hd, float scale,
                                                             float *p, int ldp, int bf16, kv_rows ahead) {
    for (int r0 = 0; r0 < rows; r0 += SRT)
        for (int j0 = 0; j0 < nk; j0 += KT) {
            if (r0 == 0) /* the next block's rows, a tile's keys' worth (all of them by the last tile) */
                prefetch_rows(ahead, j0 * ahead.rows / nk, (j0 + KT) * ahead.rows / nk - j0 * ahead.rows / nk);
            const float *qr[SRT];
            int64_t kr[KT];
            for (int i = 0; i < SRT; i++) qr[i] = qp[r0 + i < rows ? r0 + i : rows - 1];
            for (int i = 0; i < KT; i++) kr[i] = (j0 + i < nk ? j0 + i : nk - 1) * key_stride;
            vf16 acc[SRT * KT];
            for (int i = 0; i < SRT * KT; i++) acc[i] = vf16_zero();
            for (int d = 0; d < hd; d += 16) {
                vf16 kv[KT];
                for (int b = 0; b < KT; b++) kv[b] = kv_load(kb, kr[b] + d, bf16);
                for (int a = 0; a < SRT; a++) {
                    vf16 qv = vf16_load(qr[a] + d);
                    for (int b = 0; b < KT; b++) acc[b * SRT + a] = vf16_fmadd(qv, kv[b], acc[b * SRT + a]);
                }
            }
#if defined(__AVX512F__) && SRT * KT == 16
            /* acc[b * SRT + a] (row r0 + a, key j0 + b) sums into lane a * KT + b: 128-bit lane a holds row a's 4 */
            const __m512 sums = _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale));
            float lanes[16] __attribute__((aligned(64)));
            _mm512_store_ps(lanes, sums);
            const __mmask8 keys = (__mmask8)((1u << (nk - j0 < KT ? nk - j0 : KT)) - 1);
            for (int a = 0; a < SRT && r0 + a < rows; a++)
                _mm_mask_storeu_ps(p + (r0 + a) * ldp + j0, keys, _mm_load_ps(lanes + a * KT));
#else
            for (int a = 0; a < SRT && r0 + a < rows; a++)
                for (int b = 0; b < KT && j0 + b < nk; b++)
                    p[(r0 + a) * ldp + j0 + b] = vf16_reduce_add(acc[b * SRT + a]) * scale;
#endif
        }
}

/* acc[r] += sum_j p[r][j] * v_j over keys j < nk (p is zero past what row r sees), values straight from the cache:
 * a tile of RT accumulators stays in registers across the block's keys. */
static inline __attribute__((always_inline)) void values_vec(const float *p, int ldp, int rows, const void *vb,
                                                             int64_t key_stride, int nk, int hd, float *acc,
                                                             int bf16) {
    for (int r0 = 0; r0 < rows; r0 += RT) {
        const int nr = rows - r0 < RT ? rows - r0 : RT;
        for (int d = 0; d < hd; d += 16) {
            vf16 a[RT];
            for (int i = 0; i < RT; i++) a[i] = i < nr ? vf16_load(acc + (int64_t)(r0 + i) * hd + d) : vf16_zero();
            for (int j = 0; j < nk; j++) {
                vf16 v = kv_load(vb, j * key_stride + d, bf16);
                for (int i = 0; i < RT; i++)
                    a[i] = vf16_fmadd(vf16_set1(p[(r0 + (i < nr ? i : 0)) * ldp + j]), v, a[i]);
            }
            for (int i = 0; i < nr; i++) vf16_store(acc + (int64_t)(r0 + i) * hd + d, a[i]);
        }
    }
}
#endif

/* p[r][j] = q_r . k_j * scale for the `rows` pairs and keys j < nk of a float32 block (kb), any head_dim. */
static void block_scores(const float *const *qp, int rows, const float *kb, int64_t key_stride, int nk, int hd,
                         float scale, float *p, int ldp, kv_rows ahead) {
#ifdef ERNIE_VF16
    if (VEC_HD(hd)) {
        scores_vec(qp, rows, kb, key_stride, nk, hd, scale, p, ldp, 0, ahead);
        return;
    }
#endif
    prefetch_rows(ahead, 0, ahead.rows);
    for (int j = 0; j < nk; j++)
        for (int r = 0; r < rows; r++) p[r * ldp + j] = dot(qp[r], kb + j * key_stride, hd) * scale;
}

/* acc[r] += sum_j p[r][j] * v_j over keys j < nk of a float32 block, any head_dim. */
static void block_values(const float *p, int ldp, int rows, const float *vb, int64_t key_stride, int nk, int hd,
                         float *acc) {
#ifdef ERNIE_VF16
    if (VEC_HD(hd)) {
        values_vec(p, ldp, rows, vb, key_stride, nk, hd, acc, 0);
        return;
    }
#endif
    for (int j = 0; j < nk; j++)
        for (int r = 0; r < rows; r++) {
            const float pj = p[r * ldp + j], *vr = vb + j * key_stride;
            float *a = acc + (int64_t)r * hd;
            #pragma omp simd
            for (int d = 0; d < hd; d++) a[d] += pj * vr[d];
        }
}

/* Rows [0, n) of a bfloat16 block's keys (or values) for one KV head, `stride` apart -> float32 rows hd apart (a
 * head_dim the vector loops do not take). */
static void widen_rows(const uint16_t *src, int64_t stride, int n, int hd, float *dst) {
    for (int j = 0; j < n; j++) {
        const uint16_t *s = src + j * stride;
        float *d = dst + (int64_t)j * hd;
        for (int i = 0; i < hd; i++) d[i] = bf16_to_f32(s[i]);
    }
}

/* One sequence's query rows for KV heads [kvh0, kvh0 + heads): per head `rows` = q_len * G (row, head) pairs, a
 * head's state (m, l, acc, p, qp) `rows` entries after the previous head's; p row-major [rows, bs]. Each key and value
 * row is read once per tile of pairs that see it, and a block's heads go one after another, so with every head in
 * one task a block's rows are read in order (a row holds the heads side by side). kw / vw: [bs, hd] float32 scratch
 * for a bfloat16 cache's block where the vector loops do not take head_dim. */
static void attend(const float *q, const void *k_cache, const void *v_cache, int kv_bf16, const int64_t *table,
                   int64_t q_start, int q_len, int64_t seq_len, int kvh0, int heads, int nh, int nkv, int hd, int bs,
                   float scale, float *out, float *m, float *l, float *acc, float *p, int *seen, const float **qp,
                   float *kw, float *vw) {
    const int G = nh / nkv, rows = q_len * G;
    const int64_t cache_stride = (int64_t)nkv * hd;
    /* a bfloat16 cache's rows go through the vector loops as they lie; else (a head_dim they do not take) a block
     * is widened into the scratch kw / vw first, its rows hd apart */
    const int direct = VEC_HD(hd);
    const int64_t key_stride = kv_bf16 && !direct ? hd : cache_stride;
    for (int i = 0; i < heads * rows; i++) {
        const int h = i / rows, r = i % rows;
        m[i] = -INFINITY;
        l[i] = 0.0f;
        qp[i] = q + ((q_start + r / G) * nh + (kvh0 + h) * G + r % G) * (int64_t)hd;
    }
    memset(acc, 0, sizeof(float) * heads * rows * hd);
    for (int64_t b0 = 0; b0 < seq_len; b0 += bs) {
        /* Rows see keys up to their own position, so the rows that see none of this block are the first r0: a
         * prefill chunk's rows before the block skip it (half of a long chunk's score and value work). */
        int nk_max = 0, r0 = rows;
        for (int r = 0; r < rows; r++) {
            int64_t visible = seq_len - q_len + r / G + 1 - b0;  /* keys of this block row r sees */
            seen[r] = visible <= 0 ? 0 : visible < bs ? (int)visible : bs;
            nk_max = seen[r] > nk_max ? seen[r] : nk_max;
            r0 = seen[r] && r < r0 ? r : r0;
        }
        if (r0 == rows) continue;
        for (int h = 0; h < heads; h++) {
            const int kvh = kvh0 + h;
            float *mh = m + h * rows, *lh = l + h * rows, *ah = acc + (int64_t)h * rows * hd;
            float *ph = p + (int64_t)h * rows * bs;
            const float *const *qh = qp + h * rows;
            const int64_t base = (table[b0 / bs] * bs * nkv + kvh) * (int64_t)hd;
            kv_rows ahead = {0}; /* the next block's rows of this head, prefetched as this one's scores go */
            if (b0 + bs < seq_len)
                ahead = rows_of(k_cache, v_cache, kv_bf16, table[b0 / bs + 1], kvh, nkv, hd, bs,
                                seq_len - b0 - bs < bs ? seq_len - b0 - bs : bs);
            const float *kb = (const float *)k_cache + base, *vb = (const float *)v_cache + base;
            const uint16_t *kh = (const uint16_t *)k_cache + base, *vh = (const uint16_t *)v_cache + base;
            if (kv_bf16 && !direct) {
                widen_rows(kh, cache_stride, nk_max, hd, kw);
                widen_rows(vh, cache_stride, nk_max, hd, vw);
                kb = kw;
                vb = vw;
            }
#ifdef ERNIE_VF16
            if (kv_bf16 && direct)
                scores_vec(qh + r0, rows - r0, kh, cache_stride, nk_max, hd, scale, ph + (int64_t)r0 * bs, bs, 1,
                           ahead);
            else
#endif
                block_scores(qh + r0, rows - r0, kb, key_stride, nk_max, hd, scale, ph + (int64_t)r0 * bs, bs, ahead);
            for (int r = r0; r < rows; r++) {
                const int nk = seen[r];
                float *pr = ph + r * bs;
                const float mb = row_max(pr, nk);
                const float m_new = mb > mh[r] ? mb : mh[r];
                const float alpha = expf(mh[r] - m_new);  /* 0 on the first block (m = -inf) */
                const float sum = exp_shifted_sum(pr, nk, m_new);
                for (int j = nk; j < nk_max; j++) pr[j] = 0.0f;  /* keys this row does not see */
                lh[r] = lh[r] * alpha + sum;
                mh[r] = m_new;
                float *a = ah + (int64_t)r * hd;
                #pragma omp simd
                for (int d = 0; d < hd; d++) a[d] *= alpha;
            }
#ifdef ERNIE_VF16
            if (kv_bf16 && direct)
                values_vec(ph + (int64_t)r0 * bs, bs, rows - r0, vh, cache_stride, nk_max, hd, ah + (int64_t)r0 * hd,
                           1);
            else
#endif
                block_values(ph + (int64_t)r0 * bs, bs, rows - r0, vb, key_stride, nk_max, hd,
                             ah + (int64_t)r0 * hd);
        }
    }
    for (int i = 0; i < heads * rows; i++) {
        const int h = i / rows, r = i % rows;
        float *o = out + ((q_start + r / G) * nh + (kvh0 + h) * G + r % G) * (int64_t)hd;
        const float inv = 1.0f / l[i], *a = acc + (int64_t)i * hd;
        #pragma omp simd
        for (int d = 0; d < hd; d++) o[d] = a[d] * inv;
    }
}

/* kv_bf16: the caches hold bfloat16 bits, else float32. Returns 0, or -1 when a work buffer could not be allocated
 * (out is then incomplete). */
int ernie_paged_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                          const int64_t *block_tables, int table_stride, const int64_t *query_start_loc,
                          const int64_t *seq_lens, int num_seqs, int nh, int nkv, int hd, int bs, float scale,
                          float *out) {
    int failed = 0;
    /* A task per sequence when there are enough of them to share out (a block's rows then read in order, every head
     * in turn: 16 decodes from memory 1.12-1.24x), else per (sequence, KV head): a lone long prefill still splits
     * across the threads (4 prefill chunks as 4 tasks were 0.92x). */
    const int heads = num_seqs >= 4 * ernie_threads() ? nkv : 1, per = nkv / heads, tasks = num_seqs * per;
    #pragma omp parallel for THREADS schedule(static, 1) reduction(| : failed)
    for (int task = 0; task < tasks; task++) {
        const int s = task / per, kvh0 = task % per * heads;
        const int q_len = (int)(query_start_loc[s + 1] - query_start_loc[s]);
        const int rows = q_len * (nh / nkv) * heads;
        /* qp [rows] pointers, then m, l [rows], acc [rows, hd], p [rows, bs] floats, seen [rows] ints, then for a
         * bfloat16 cache the widened block's keys and values [bs, hd] each */
        const size_t floats = (size_t)rows * (hd + 3 + bs) + (kv_bf16 && !VEC_HD(hd) ? 2 * (size_t)bs * hd : 0);
        const float **qp = malloc(sizeof(float *) * (size_t)rows + sizeof(float) * floats);
        if (!qp) { failed = 1; continue; }
        float *buf = (float *)(qp + rows), *kw = buf + (size_t)rows * (hd + 3 + bs), *vw = kw + (size_t)bs * hd;
        const int later = task + ernie_threads(); /* this thread's next task (schedule(static, 1)): its first block */
        if (later < tasks) {
            const int s2 = later / per;
            for (int h = 0; h < heads; h++)
                prefetch_rows(rows_of(k_cache, v_cache, kv_bf16, block_tables[(int64_t)s2 * table_stride],
                                      later % per * heads + h, nkv, hd, bs, seq_lens[s2] < bs ? seq_lens[s2] : bs),
                              0, bs);
        }
        attend(q, k_cache, v_cache, kv_bf16, block_tables + (int64_t)s * table_stride, query_start_loc[s], q_len,
               seq_lens[s], kvh0, heads, nh, nkv, hd, bs, scale, out, buf, buf + rows, buf + 2 * rows,
               buf + (size_t)rows * (hd + 2), (int *)(buf + (size_t)rows * (hd + 2 + bs)), qp, kw, vw);
        free(qp);
    }
    return failed ? -1 : 0;
}
