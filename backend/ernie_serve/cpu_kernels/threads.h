/* How many threads the kernels' parallel loops use: set once per process (ernie_set_num_threads, called by
 * ernie_serve._env.setup_model_process), not taken from the calling thread's OpenMP settings.
 *
 * Why: OpenMP keeps its thread count per calling thread, and Paddle sets OMP_NUM_THREADS=1 at import, so a loop
 * started from any thread but the one that called omp_set_num_threads ran on one core. The served engine steps
 * from its own thread (engine/async_engine.py), so inside tritonserver the kernels ran on one of the two cores
 * and the served engine fell far behind the same engine offline (README "Serving benchmark (online)").
 * THREADS is the clause every parallel loop here carries. */
#ifndef ERNIE_THREADS_H
#define ERNIE_THREADS_H

#include <stdint.h>

int ernie_threads(void);
/* The static schedule's chunk for E experts x nb column-block tasks with rows[e] rows each (threads.c). */
int ernie_task_chunk(const int64_t *rows, int E, int nb);
/* The next task of the thread running `task` under that schedule, skipping experts without rows; -1: none. */
int ernie_next_task(int task, int chunk, int E, int nb, const int64_t *rows);

#define THREADS num_threads(ernie_threads())
#endif
