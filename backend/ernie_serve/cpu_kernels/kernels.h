/* The entry points of cpu_ops.c, cpu_gemm.c and cpu_attention.c, for cpu_layer.c, which composes them into a whole
 * decoder layer (Python reaches them through build.py's signature table). */
#ifndef ERNIE_KERNELS_H
#define ERNIE_KERNELS_H
#include <stdint.h>

int ernie_gemm(const float *x, int M, int K, const void *w, int N, const float *s, float *y, int bits, int swiglu,
               int int_x);
int ernie_moe_gemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K, const void *const *w,
                   int N, const float *const *s, float *y, int bits, int swiglu, int int_x);
int ernie_gemm_swiglu_fits(int N);
int ernie_paged_attention(const float *q, const void *k_cache, const void *v_cache, int kv_bf16,
                          const int64_t *block_tables, int table_stride, const int64_t *query_start_loc,
                          const int64_t *seq_lens, int num_seqs, int nh, int nkv, int hd, int bs, float scale,
                          float *out);
void ernie_rms_norm(const float *x, const float *w, int T, int H, float eps, float *out);
void ernie_split_rope(const float *qkv, const int64_t *positions, const float *cos_t, const float *sin_t, int T,
                      int nh, int nkv, int hd, float *q, float *k, float *v);
void ernie_silu_and_mul(const float *gate_up, int T, int I, float *out);
void ernie_gather_rows(const float *x, const int64_t *idx, int n, int H, float *out);
void ernie_weighted_combine(const float *ys, const int64_t *src, const float *w, int T, int k, int H, float *out);
void ernie_route(const float *x, const float *w, const float *bias, int T, int H, int E, int k, float norm_min,
                 int64_t *ids, float *weights);
#endif
