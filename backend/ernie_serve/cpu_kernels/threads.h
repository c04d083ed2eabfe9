/* How many threads the kernels' parallel loops use: set once per process (ernie_set_num_threads, called by
 * ernie_serve._env.setup_model_process), not taken from the calling thread's OpenMP settings.
 *
 * Why: OpenMP keeps its thread count per calling thread, and Paddle sets OMP_NUM_THREADS=1 at import, so a loop
 * started from any thread but the one that called omp_set_num_threads ran on one core. The served engine steps
 * from its own thread (engine/async_engine.py), so inside tritonserver the kernels ran on one of the two cores
 * and the served engine fell far behind the same engine offline (scripts/bench_serving.py shows it; docs/benchmarks.md).
 * THREADS is the clause every parallel loop here carries. */
#ifndef ERNIE_THREADS_H
#define ERNIE_THREADS_H

#include <stdint.h>

int ernie_threads(void);
/* Puts the OpenMP workers to sleep at once (threads.c). */
void ernie_park_threads(void);
/* How the threads share E experts x nb column blocks, (expert, block) tasks in that order, the experts having
 * rows[e] rows: thread t of `threads` takes the run [*first, *end), the runs of equal cost (threads.c's task_cost),
 * so each thread streams one stretch of the weights (a layer's experts lie one after another) and both finish
 * together. Contiguous halves of the tasks left a thread waiting at the barrier for as many experts as the halves'
 * row counts differed by at decode; round robin, for a step whose prefill chunk gave a few experts most rows, broke
 * the streams. */
void ernie_task_run(const int64_t *rows, int E, int nb, int flat_from, int t, int threads, int *first, int *end);
/* The calling thread's run, inside a parallel region. flat_from: from how many rows an extra row costs a quarter
 * (int8 codes on AMX; 0: every row a row). */
void ernie_my_task_run(const int64_t *rows, int E, int nb, int flat_from, int *first, int *end);
/* The next task of a run after `task`, skipping experts without rows; -1: none (the GEMMs prefetch its block). */
int ernie_next_task(int task, int end, int nb, const int64_t *rows);
/* The first task with rows of the run [first, end); -1: none. The loops go first_task, next_task, ... */
static inline int ernie_first_task(int first, int end, int nb, const int64_t *rows) {
    return ernie_next_task(first - 1, end, nb, rows);
}
/* The most rows a block of `bits`-bit weights is prefetched for (cpu_gemm.c's rows_times_block, cpu_qgemm.c's
 * widening passes; its VNNI passes have INT_PREFETCH_ROWS): up to bits / 2 rows (float32 16, bfloat16 8, int8 4,
 * int4 2) memory bounds the block on an AVX2 core; past that its arithmetic does and the prefetches cost more than
 * they save. scripts/bench_kernels_ab.py --bits 16,4 at 4-16 rows re-checks it. */
#define PREFETCH_ROWS(bits) ((bits) / 2)

/* How far ahead of its own reads a memory-bound pass prefetches (cpu_gemm.c's one-tile blocks, into L2; cpu_amx.c's
 * one row group, into L1): 4 KB; a whole block (32-128 KB) ahead into L1 overflows a 48 KB L1. */
#define PREFETCH_AHEAD 4096

#define THREADS num_threads(ernie_threads())
#endif
