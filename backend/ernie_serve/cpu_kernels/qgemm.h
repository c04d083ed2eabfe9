/* cpu_qgemm.c's entry points, called by cpu_gemm.c's ernie_gemm / ernie_moe_gemm for the int8 / int4 formats. */
#ifndef ERNIE_QGEMM_H
#define ERNIE_QGEMM_H
#include <stdint.h>

int ernie_qgemm(const float *x, int M, int K, const uint8_t *w, int N, const float *s, float *y, int bits, int swiglu,
                int int_x);
int ernie_moe_qgemm(const float *x, const int64_t *rows, const int64_t *starts, int E, int K,
                    const uint8_t *const *w, int N, const float *const *s, float *y, int bits, int swiglu, int int_x);
#endif
