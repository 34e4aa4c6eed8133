/* The machine's peak FLOP/s as the model sees it, the denominator of the trainer's MFU: one core's rate
 * of the GEMM on a 512³ product, timed in the probing thread's own CPU time (CLOCK_THREAD_CPUTIME_ID), the
 * best of several repeats, times the run's thread count. CPU time leaves out the time other processes
 * hold the core, so a machine busy at start-up does not lower the peak (wall time did: 13 GFLOP/s
 * measured where the engine runs 100, and an MFU above 100%). */
#include <stdio.h>
#include <time.h>

#include "model/model_internal.h"

enum {
    PEAK_N = 512,       /* the product's size */
    PEAK_MIN_REPS = 3,  /* repeats at least */
    PEAK_MAX_REPS = 9,  /* and at most, */
};
#define PEAK_BUDGET_S 0.3 /* stopping once this much wall time is spent */

static double thread_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

ds4_peak ds4_probe_peak(const ds4_exec *ex) {
    ds4_peak pk = {.threads = ds4_get_threads()};
    const int64_t n = PEAK_N;
    float *a = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    float *b = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    float *c = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    int reps = 0;
    if (a && b && c && !(ex && ex->plan)) {
        for (int64_t i = 0; i < n * n; i++) a[i] = b[i] = (float)((i % 7) - 3) * 0.01f;
        ds4_set_threads(1); /* the GEMM runs on this thread alone: its CPU time is the product's */
        /* its packing buffers reserved for the probe, as a model's are for its passes: the products then
         * allocate nothing, so page faults (whose cost grows when the core is shared) stay out of the timing */
        gemm_workspace_reserve(ex);
        gemm_nt(ex, n, n, n, a, n, b, n, c, n, 0.0f); /* warm up */
        const double start = ds4_now();
        while (reps < PEAK_MAX_REPS && (reps < PEAK_MIN_REPS || ds4_now() - start < PEAK_BUDGET_S)) {
            const double t0 = thread_cpu_seconds();
            gemm_nt(ex, n, n, n, a, n, b, n, c, n, 0.0f);
            const double dt = thread_cpu_seconds() - t0;
            const double f = dt > 0 ? 2.0 * (double)n * n * n / dt : 0;
            if (f > pk.core_flops) pk.core_flops = f;
            reps++;
        }
        gemm_workspace_release(ex);
        ds4_set_threads(pk.threads);
    }
    ds4_free(a);
    ds4_free(b);
    ds4_free(c);
    pk.flops = pk.core_flops * pk.threads;
    snprintf(pk.how, sizeof pk.how,
             "GEMM probe: %.1f GFLOP/s on one core (%s GEMM, ISA level %s, best of %d %lld^3 products timed in the "
             "thread's CPU time) x %d threads",
             pk.core_flops / 1e9, ds4_matmul_precision_name(ex ? ex->matmul_precision : DS4_MATMUL_FP32),
             ds4_isa_name(ds4_isa_current()), reps, (long long)n, pk.threads);
    return pk;
}
