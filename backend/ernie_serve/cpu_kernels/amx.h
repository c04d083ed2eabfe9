/* cpu_amx.c's entry points, for cpu_gemm.c. */
#ifndef ERNIE_AMX_H
#define ERNIE_AMX_H
#include <stdint.h>

/* From how many rows a bfloat16 column block goes to AMX. Fewer rows are memory-bound, and there cpu_gemm.c's
 * widening tiles stream the block faster than cpu_amx.c interleaves it for the tile unit (16 experts at 1-8 rows:
 * 0.56-0.86x of the widening tiles' GB/s; a 1024 x 1536 layer at 16 rows 1.24x; scripts/bench_kernels_ab.py
 * --bits 16). */
#define AMX_ROWS 16

/* 1 once this process may use AMX tiles (built for a CPU with AMX-BF16, allowed, and Linux granted the tile state). */
int ernie_amx_ready(void);
/* Allow AMX (1, the default) or not (0: ERNIE_CPU_AMX=0, and A/B runs in one process). */
void ernie_set_amx(int on);
/* y[b][m * ldy + j] = sum over k of xh[m * K + k] * w[b][k * 32 + j], m < M, j < 32, for nw (1 or 2) [K, 32]
 * bfloat16 column blocks that share each load of x: bfloat16 x (rows readable 16 past M), K % 32 == 0, prefetching
 * `next` (a block, or NULL) at decode sizes. */
void ernie_amx_blocks(const uint16_t *xh, int M, int K, const uint16_t *const *w, int nw, float *const *y,
                      int64_t ldy, const char *next);
#endif
