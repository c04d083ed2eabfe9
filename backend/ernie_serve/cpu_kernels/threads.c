/* The kernels' thread count (threads.h). */
#ifdef _OPENMP
#include <omp.h>
#endif

#include <stdint.h>

#include "threads.h"

static int num_threads = 0;  /* 0: not set, the OpenMP default of the calling thread */

/* Intel OpenMP's (libiomp5, which the library links): weak, so a build on another OpenMP runtime runs without. */
extern int kmp_get_blocktime(void) __attribute__((weak));
extern void kmp_set_blocktime(int msec) __attribute__((weak));

void ernie_set_num_threads(int n) { num_threads = n > 0 ? n : 0; }

/* The workers go to sleep now instead of spinning out their blocktime: one empty parallel region under a
 * blocktime of 0 (the runtime hands a region's workers the blocktime of the thread that starts it), then the
 * caller's blocktime again. Called at the end of a step (_env.py says why). */
void ernie_park_threads(void) {
#ifdef _OPENMP
    if (!kmp_get_blocktime || !kmp_set_blocktime) return;
    const int blocktime = kmp_get_blocktime();
    if (blocktime == 0) return;
    kmp_set_blocktime(0);
    #pragma omp parallel THREADS
    __asm__ volatile("" ::: "memory"); /* a body the compiler keeps: an empty region is left out */
    kmp_set_blocktime(blocktime);
#endif
}

int ernie_threads(void) {
    if (num_threads > 0) return num_threads;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* What a task of `rows` rows costs, in quarter rows: its block's bytes weigh as much as TASK_BLOCK_ROWS rows of
 * arithmetic. At decode a block is memory-bound and rows add little (scripts/bench_kernels_ab.py prints each row
 * count's GB/s); in a prefill chunk the arithmetic dominates. From `flat_from` rows (0: never) a row costs a quarter:
 * int8 codes go to AMX there (amx.h's AMX_INT8_ROWS), whose extra rows cost little until far past a decode's; costed
 * at a row each they left one thread waiting at the barrier. scripts/bench_kernels_ab.py --bits 8 and
 * --workload uniform --dtype bfloat16 --quantization wint8 re-check the weights. */
#define TASK_BLOCK_ROWS 16

static int64_t task_cost(int64_t rows, int flat_from) {
    if (!rows) return 0;
    if (flat_from <= 0 || rows <= flat_from) return 4 * (TASK_BLOCK_ROWS + rows);
    return 4 * (TASK_BLOCK_ROWS + flat_from) + (rows - flat_from);
}

/* The first task whose earlier tasks cost `part` / `parts` of `total` or more (E * nb if none). */
static int task_at(const int64_t *rows, int E, int nb, int flat_from, int64_t total, int part, int parts) {
    const int64_t target = total * part; /* compared against cost * parts: integers, no rounding */
    int64_t before = 0;
    for (int e = 0; e < E; e++) {
        const int64_t c = task_cost(rows[e], flat_from);
        if (c && (before + nb * c) * parts >= target) {
            const int64_t need = target - before * parts, b = need <= 0 ? 0 : (need + c * parts - 1) / (c * parts);
            return e * nb + (int)b;
        }
        before += nb * c;
    }
    return E * nb;
}

void ernie_task_run(const int64_t *rows, int E, int nb, int flat_from, int t, int threads, int *first, int *end) {
    int64_t total = 0;
    for (int e = 0; e < E; e++) total += nb * task_cost(rows[e], flat_from);
    *first = t == 0 ? 0 : task_at(rows, E, nb, flat_from, total, t, threads);
    *end = t + 1 >= threads ? E * nb : task_at(rows, E, nb, flat_from, total, t + 1, threads);
}

void ernie_my_task_run(const int64_t *rows, int E, int nb, int flat_from, int *first, int *end) {
#ifdef _OPENMP
    ernie_task_run(rows, E, nb, flat_from, omp_get_thread_num(), omp_get_num_threads(), first, end);
#else
    ernie_task_run(rows, E, nb, flat_from, 0, 1, first, end);
#endif
}

int ernie_next_task(int task, int end, int nb, const int64_t *rows) {
    for (int t = task + 1; t < end; t = (t / nb + 1) * nb) /* an expert without rows: on to the next expert's first */
        if (rows[t / nb]) return t;
    return -1;
}
