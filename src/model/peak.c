/* The machine's peak FLOP/s, the denominator of the trainer's MFU, and the GEMM engine's measured rate, the
 * denominator of the benchmarks' "of GEMM peak".
 *
 * The peak is theoretical, as a GPU's datasheet peak is for TorchTitan's MFU: the core's clock times the
 * FLOPs per cycle of the engine the run's GEMMs use (its vector width and FMA pipes), times the threads.
 * The clock is measured by a chain of dependent register-to-register integer adds (one cycle each on
 * every core), timed in the probing thread's own CPU time (CLOCK_THREAD_CPUTIME_ID), the best of several short chains: time other
 * processes hold the core is not counted and each chain fits in one time slice, so a machine busy at
 * start-up does not lower the peak. A GEMM probe timed the same way did not hold on a time-shared virtual
 * machine: after each wait for the core its caches and clock came back slowly, and it read 35 GFLOP/s where
 * the same probe read 78 alone; the add chain reads the same clock within 2% in both. A step's rate cannot
 * exceed this peak (tests/test_peak.c: the GEMM's measured rate is below it), so MFU stays a fraction. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "model/model_internal.h"
#include "kernels/backend.h"

enum {
    CLOCK_CHAIN = 1 << 18, /* iterations of four dependent adds: ~0.3 ms at 3 GHz, inside one time slice */
    CLOCK_REPS = 16,       /* chains timed; the fastest counts */
    GEMM_N = 512,          /* the GEMM probe's product size */
    GEMM_MIN_REPS = 3,     /* repeats at least */
    GEMM_MAX_REPS = 9,     /* and at most, */
};
#define GEMM_BUDGET_S 0.3 /* stopping once this much wall time is spent */

static double thread_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Cycles per second of CPU time of this thread's core: 4·CLOCK_CHAIN adds, each waiting for the one before.
 * The addend is a register the compiler cannot see (the empty asm), not an immediate: cores that fold an
 * immediate add at rename (Intel's Golden Cove) ran the immediate chain at 3-9 "GHz" on a 2.6 GHz Xeon;
 * the empty asm after each add makes x a fresh value, so the compiler can neither fold nor reorder them. */
static double core_clock_hz(void) {
    double best = 0;
    for (int r = 0; r < CLOCK_REPS; r++) {
        unsigned long x = 0, one = 1;
        __asm__ volatile("" : "+r"(one));
        const double t0 = thread_cpu_seconds();
        for (long i = 0; i < CLOCK_CHAIN; i++) {
            x += one;
            __asm__ volatile("" : "+r"(x));
            x += one;
            __asm__ volatile("" : "+r"(x));
            x += one;
            __asm__ volatile("" : "+r"(x));
            x += one;
            __asm__ volatile("" : "+r"(x));
        }
        const double dt = thread_cpu_seconds() - t0;
        if (dt > 0 && 4.0 * CLOCK_CHAIN / dt > best) best = 4.0 * CLOCK_CHAIN / dt;
    }
    return best;
}

/* The FLOPs per cycle an engine can issue at most on one core (two FMA pipes of its vector width, AMX: one
 * 16x16x32 bf16 tile product per 16 cycles), and in words what that is. An upper bound: cores with one pipe,
 * or with a lower clock under wide vectors, reach less. */
static int engine_flops_per_cycle(ds4_isa isa, ds4_matmul_precision p, const char **what) {
    const bool bf16 = p == DS4_MATMUL_BF16;
    if (isa >= DS4_ISA_AMX && bf16) return *what = "AMX bf16 tiles: 512 multiply-adds", 1024;
    if (isa >= DS4_ISA_AVX512BF16 && bf16) return *what = "two 32-pair bf16 dot-product pipes", 128;
    if (isa >= DS4_ISA_AVX512) return *what = "two 16-lane fp32 FMA pipes", 64;
    if (isa >= DS4_ISA_AVX2) return *what = "two 8-lane fp32 FMA pipes", 32;
    return *what = "two 4-lane fp32 FMA pipes (128-bit baseline vectors)", 16;
}

static bool runs_on_host_cores(const ds4_exec *ex) {
    return !ex || !ex->backend || !strncmp(ex->backend->name, "cpu", 3);
}

ds4_peak ds4_probe_peak(const ds4_exec *ex) {
    ds4_peak pk = {.threads = ds4_get_threads()};
    const ds4_matmul_precision p = ex ? ex->matmul_precision : DS4_MATMUL_FP32;
    if (!runs_on_host_cores(ex)) {
        snprintf(pk.how, sizeof pk.how, "no theoretical peak is known for the %s backend: set metrics.peak_tflops",
                 ex->backend->name);
        return pk;
    }
    const char *what;
    pk.flops_per_cycle = engine_flops_per_cycle(ds4_isa_current(), p, &what);
    pk.clock_hz = core_clock_hz();
    pk.core_flops = pk.clock_hz * pk.flops_per_cycle;
    pk.flops = pk.core_flops * pk.threads;
    snprintf(pk.how, sizeof pk.how,
             "theoretical FMA rate: %.2f GHz (a dependent-add chain, best of %d, in the thread's CPU time) x %d "
             "FLOP/cycle (%s %s: %s) x %d threads",
             pk.clock_hz / 1e9, CLOCK_REPS, pk.flops_per_cycle, ds4_isa_name(ds4_isa_current()),
             ds4_matmul_precision_name(p), what, pk.threads);
    return pk;
}

double ds4_probe_gemm_rate(const ds4_exec *ex) {
    const int threads = ds4_get_threads();
    const int64_t n = GEMM_N;
    float *a = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    float *b = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    float *c = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    double best = 0;
    if (a && b && c && !(ex && ex->plan) && runs_on_host_cores(ex)) {
        for (int64_t i = 0; i < n * n; i++) a[i] = b[i] = (float)((i % 7) - 3) * 0.01f;
        ds4_set_threads(1); /* the GEMM runs on this thread alone: its CPU time is the product's */
        /* its packing buffers reserved first, as a model's are for its passes: the products allocate nothing */
        gemm_workspace_reserve(ex);
        gemm_nt(ex, n, n, n, a, n, b, n, c, n, 0.0f); /* warm up */
        const double start = ds4_now();
        for (int reps = 0; reps < GEMM_MAX_REPS && (reps < GEMM_MIN_REPS || ds4_now() - start < GEMM_BUDGET_S);
             reps++) {
            const double t0 = thread_cpu_seconds();
            gemm_nt(ex, n, n, n, a, n, b, n, c, n, 0.0f);
            const double dt = thread_cpu_seconds() - t0;
            if (dt > 0 && 2.0 * (double)n * n * n / dt > best) best = 2.0 * (double)n * n * n / dt;
        }
        gemm_workspace_release(ex);
        ds4_set_threads(threads);
    }
    ds4_free(a);
    ds4_free(b);
    ds4_free(c);
    return best;
}
