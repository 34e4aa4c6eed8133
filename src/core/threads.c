/* OpenMP thread count and a monotonic clock. */
#include "ds4/core.h"

#include <omp.h>
#include <time.h>

void ds4_set_threads(int n) {
    if (n > 0) omp_set_num_threads(n);
}

int ds4_get_threads(void) { return omp_get_max_threads(); }

double ds4_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
