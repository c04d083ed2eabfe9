/* cpu_amx.c's entry points, for cpu_gemm.c. */
#ifndef ERNIE_AMX_H
#define ERNIE_AMX_H
#include <stdint.h>

/* From how many rows a bfloat16 column block goes to AMX. Fewer rows are memory-bound, and there cpu_gemm.c's
 * widening tiles stream the block faster than cpu_amx.c interleaves it for the tile unit; from 16 rows AMX wins.
 * scripts/bench_kernels_ab.py --bits 16 re-checks this threshold. */
#define AMX_ROWS 16

/* 1 once this process may use AMX tiles (built for a CPU with AMX-BF16, allowed, and Linux granted the tile state). */
int ernie_amx_ready(void);
/* Every GEMM entry point calls this first: each thread then loads the tile configuration once in the call. */
void ernie_amx_new_call(void);
/* Allow AMX (1, the default) or not (0: ERNIE_CPU_AMX=0, and A/B runs in one process), bfloat16 and int8 alike. */
void ernie_set_amx(int on);
/* y[b][m * ldy + j] = sum over k of xh[m * K + k] * w[b][k * 32 + j], m < M, j < 32, for nw (1 or 2) [K, 32]
 * bfloat16 column blocks that share each load of x: bfloat16 x (rows readable 16 past M), K % 32 == 0, prefetching
 * at decode sizes the next call's blocks: its first at `next` (or NULL), a second as far from it as w[1] from w[0]. */
void ernie_amx_blocks(const uint16_t *xh, int M, int K, const uint16_t *const *w, int nw, float *const *y,
                      int64_t ldy, const char *next);
/* From how many rows an int8 column block goes to AMX (cpu_qgemm.c). The VNNI blocks take each row at two int8
 * levels, four vpdpbusd a row per 128 bytes of codes, at about one vpdpbusd a cycle: from ~5 rows they run out of
 * cycles before memory runs out of bytes, while AMX (its codes streamed through vector loads, cpu_amx.c) keeps
 * streaming at the memory's pace; 1-4 rows stay on VNNI, which is faster there. A wint8-bf16 decode step at 16
 * running gives many experts 5+ rows. scripts/bench_kernels_ab.py --bits 8 (experts at 1-12 rows) and
 * scripts/bench_cpu_dtypes.py --formats bfloat16,wint8-bf16 re-check this threshold. */
#define AMX_INT8_ROWS 5
/* 1 where AMX-INT8 is built in and ernie_amx_ready. */
int ernie_amx_int8_ready(void);
/* acc[l][m][j] = sum over k < 4G of q[l][m * ldq + k] * w[(k / 4 * 32 + j) * 4 + k % 4], m < rows (8 or 16), j < 32,
 * l < levels (1 or 2): rows of int8 activation codes per level (readable 16 past the caller's last) times one column
 * block of cpu_qgemm.c's int8 layout (unsigned, offset codes), exact int32 sums in acc's first rows (of 16 a level);
 * G % 16 == 0; prefetching pf_step bytes from pf (or NULL) every 64 k. */
void ernie_amx_int8_rows(const int8_t *const *q, int rows, int levels, int64_t ldq, int G, const uint8_t *w,
                         int32_t *acc, const char *pf, int pf_step);
#endif
