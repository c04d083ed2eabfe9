/* Which instruction-set tier this build of the library runs (isa.py's ISAS, by index), read from the same
 * compiler-defined macros the kernels' #if branches test: vec16.h's AVX-512 or AVX2 + FMA vectors, cpu_qgemm.c's
 * AVX-512 VNNI integer blocks, cpu_amx.c's tiles (AMX also needs Linux to grant the tile state, and ernie_set_amx).
 * build.py checks a library built for a capped tier (ERNIE_CPU_ISA) against it, so a compiler switch that failed to
 * take a path out cannot pass for the tier it was asked for. */
#include "amx.h"

int ernie_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return ernie_amx_ready() ? 4 : 3;
#elif defined(__AVX512F__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
