/* The kernels' thread count (threads.h). */
#ifdef _OPENMP
#include <omp.h>
#endif

#include "threads.h"

static int num_threads = 0;  /* 0: not set, the OpenMP default of the calling thread */

void ernie_set_num_threads(int n) { num_threads = n > 0 ? n : 0; }

int ernie_threads(void) {
    if (num_threads > 0) return num_threads;
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
