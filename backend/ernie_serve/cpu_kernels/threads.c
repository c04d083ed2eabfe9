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

/* How the threads share E experts x nb column blocks: contiguous halves (each thread streams one run of the
 * weights) when the experts' row counts are even, as at decode; round robin (static chunks of 1) when a few experts
 * hold most rows, as with a prefill chunk in the step, which would otherwise leave a thread idle. */
int ernie_task_chunk(const int64_t *rows, int E, int nb) {
    int64_t total = 0, most = 0;
    for (int e = 0; e < E; e++) {
        total += rows[e];
        most = rows[e] > most ? rows[e] : most;
    }
    const int threads = ernie_threads();
    return most * E <= 2 * total ? (E * nb + threads - 1) / threads : 1;
}

/* The task the thread running `task` takes next under schedule(static, chunk), which deals the chunks of E * nb
 * tasks round robin; tasks of experts without rows (rows[task / nb] == 0) are passed over. -1: none. The GEMMs
 * prefetch that task's weights while they multiply this one's. */
int ernie_next_task(int task, int chunk, int E, int nb, const int64_t *rows) {
    const int later = (ernie_threads() - 1) * chunk;
    for (int t = task + 1 + ((task + 1) % chunk ? 0 : later); t < E * nb; t += 1 + ((t + 1) % chunk ? 0 : later))
        if (rows[t / nb]) return t;
    return -1;
}
