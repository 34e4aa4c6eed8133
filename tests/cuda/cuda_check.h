/* The CUDA tests' harness (tests/cuda/test_cuda_*.cu): each op runs on the cpu backend (the table
 * ds4_kernel_backend_cpu() of libds4.a) on host data and on the GPU through its launcher on device
 * copies of the same data; the two results are compared bit for bit (elementwise ops whose arithmetic is
 * the same) or within a bound derived per element from the sum length and magnitudes (reductions,
 * GEMMs, transcendental functions). Every launcher is also run twice: the two results must have the
 * same bits (determinism).
 *
 * Without a visible GPU a test binary prints one SKIP line and "0 passed, 0 failed" and exits 0, so CI
 * (no GPU) compiles and runs them. CUDA_TEST_BEGIN / CUDA_TEST_END frame main(); CUDA_TEST_END also
 * prints a hash of every result copied back, which two runs must share. */
#ifndef DS4_TESTS_CUDA_CHECK_H
#define DS4_TESTS_CUDA_CHECK_H

#include <cuda_runtime.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda.h" /* the launchers; brings kernels.h and backend.h (C linkage) */
#include "../test.h"

#define CC_U32 (1.0 / 16777216.0) /* 2^-24: unit roundoff of fp32 */

/* ---------------------------------------------------------------- framing */
/* True when a CUDA device is visible; otherwise prints "<name>: SKIP ..." once. */
static inline bool cc_gpu_visible(const char *name) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        printf("%s: SKIP (no CUDA device visible: %s)\n", name, e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return false;
    }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess)
        fprintf(stderr, "%s: on %s (sm_%d%d, %d SMs)\n", name, p.name, p.major, p.minor, p.multiProcessorCount);
    return true;
}
#define CUDA_TEST_BEGIN(name)                              \
    do {                                                   \
        if (!cc_gpu_visible(name)) {                       \
            printf("%s: 0 passed, 0 failed\n", name);      \
            return 0;                                      \
        }                                                  \
    } while (0)
/* Every byte the tests copy back from the device (cc_down) goes into one FNV-1a hash, printed at the end:
 * two runs of a test binary (two processes) must print the same hash (scripts/gpu-check.sh compares). */
static uint64_t cc_out_hash = 1469598103934665603ull, cc_out_bytes = 0;
static inline void cc_hash_bytes(const void *p, size_t n) {
    const unsigned char *b = (const unsigned char *)p;
    for (size_t i = 0; i < n; i++) cc_out_hash = (cc_out_hash ^ b[i]) * 1099511628211ull;
    cc_out_bytes += n;
}
#define CUDA_TEST_END(name)                                                                                 \
    do {                                                                                                    \
        printf("%s: device output hash %016llx over %llu bytes\n", name, (unsigned long long)cc_out_hash,     \
               (unsigned long long)cc_out_bytes);                                                           \
        TEST_MAIN_END(name);                                                                                \
    } while (0)

/* Whether test `fn` runs: all of them, unless DS4_CUDA_ONLY lists words (comma separated) of which one
 * is part of its name (scripts/gpu-check.sh runs the slow sanitizers on a few). */
static inline bool cc_selected(const char *fn) {
    const char *only = getenv("DS4_CUDA_ONLY");
    if (!only || !*only) return true;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", only);
    for (char *w = strtok(buf, ","); w; w = strtok(NULL, ","))
        if (*w && strstr(fn, w)) return true;
    return false;
}
/* RUN(fn) when fn is selected. */
#define CC_RUN(fn)                   \
    do {                             \
        if (cc_selected(#fn)) RUN(fn); \
    } while (0)

/* A ds4_status from a launcher: CHECKed, with ds4's message. */
#define CC_OK(expr)                                                                     \
    do {                                                                                \
        ds4_status cc_s_ = (expr);                                                      \
        CHECK(cc_s_ == DS4_OK, "%s: %s", #expr, cc_s_ == DS4_OK ? "" : ds4_errmsg());   \
    } while (0)
/* A cudaError_t: CHECKed, with the runtime's message. */
#define CC_CUDA(expr)                                                                          \
    do {                                                                                       \
        cudaError_t cc_e_ = (expr);                                                            \
        CHECK(cc_e_ == cudaSuccess, "%s: %s", #expr, cudaGetErrorString(cc_e_));               \
    } while (0)
/* Waits for the device and CHECKs that no launch failed. */
#define CC_SYNC() CC_CUDA(cudaDeviceSynchronize())

/* ---------------------------------------------------------------- buffers */
/* Host buffers: zeroed (never NULL for n = 0). */
static inline void *cc_host(size_t bytes) { return calloc(bytes ? bytes : 1, 1); }
static inline float *cc_hostf(int64_t n) { return (float *)cc_host((size_t)n * sizeof(float)); }
/* Device buffer of `bytes`, poisoned with 0xff bytes (NaN floats, -1 ints): an element the kernel
 * forgets to write shows up. */
static inline void *cc_dev(size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc of %zu bytes failed\n", bytes);
        exit(2);
    }
    cudaMemset(d, 0xff, bytes ? bytes : 1);
    cudaDeviceSynchronize(); /* ordered before work on any stream, blocking or not */
    return d;
}
/* Device copy of host data. */
static inline void *cc_up(const void *h, size_t bytes) {
    void *d = cc_dev(bytes);
    if (bytes) cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize(); /* a copy from pageable memory may return before its DMA is done */
    return d;
}
static inline float *cc_upf(const float *h, int64_t n) { return (float *)cc_up(h, (size_t)n * sizeof(float)); }
/* Device -> host after the device finished (a failed kernel shows up here as a CHECK failure). */
static inline void cc_down(void *h, const void *d, size_t bytes) {
    CC_CUDA(cudaDeviceSynchronize());
    if (bytes) CC_CUDA(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    cc_hash_bytes(h, bytes);
}
static inline void cc_poison(void *d, size_t bytes) {
    cudaMemset(d, 0xff, bytes ? bytes : 1);
    cudaDeviceSynchronize();
}
/* Host -> existing device buffer, finished on return. */
static inline void cc_reload(void *d, const void *h, size_t bytes) {
    if (bytes) CC_CUDA(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    CC_CUDA(cudaDeviceSynchronize());
}
static inline void cc_free(void *d) { cudaFree(d); }

/* Uniform values in [-amp, amp) (test.h's generator), and ints in [0, hi). */
static inline void cc_fill(float *x, int64_t n, unsigned seed, float amp) { t_fill(x, (long)n, seed, amp); }
static inline void cc_fill_ids(int32_t *x, int64_t n, unsigned seed, int32_t hi) {
    unsigned long s = seed * 2654435761u + 777u;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ul + 1442695040888963407ul;
        x[i] = (int32_t)((s >> 33) % (unsigned long)hi);
    }
}

/* ---------------------------------------------------------------- comparisons */
/* got == want bit for bit over `bytes`; on a mismatch reports the count and the first word. */
static inline bool cc_same_bits(const char *what, const void *got, const void *want, size_t bytes) {
    const unsigned char *a = (const unsigned char *)got, *b = (const unsigned char *)want;
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (a[i] != b[i] && bad++ == 0) first = i;
    if (bad) {
        size_t w = first / 4 * 4;
        uint32_t x = 0, y = 0;
        if (w + 4 <= bytes) {
            memcpy(&x, a + w, 4);
            memcpy(&y, b + w, 4);
        }
        float fx, fy;
        memcpy(&fx, &x, 4);
        memcpy(&fy, &y, 4);
        CHECK(bad == 0, "%s: %zu of %zu bytes differ; first at byte %zu (word %08x = %.9g vs %08x = %.9g)", what, bad,
              bytes, first, x, fx, y, fy);
    } else {
        t_note("  %s: bitwise equal (%zu bytes)", what, bytes);
    }
    return bad == 0;
}

/* Floats got == want bit for bit, except that any NaN equals any NaN: the GPU's arithmetic returns the
 * canonical NaN (0x7fffffff) where the CPU's keeps the input's payload and sign, a difference in NaN
 * bits only (a NaN stays a NaN). Reports how many NaNs differ in their bits. */
static inline bool cc_same_floats(const char *what, const float *got, const float *want, int64_t n) {
    int64_t bad = 0, first = -1, nan_bits = 0;
    for (int64_t i = 0; i < n; i++) {
        if (memcmp(&got[i], &want[i], 4) == 0) continue;
        if (got[i] != got[i] && want[i] != want[i]) {
            nan_bits++;
            continue;
        }
        if (bad++ == 0) first = i;
    }
    if (bad)
        CHECK(bad == 0, "%s: %lld of %lld floats differ; first [%lld] %.9g vs %.9g", what, (long long)bad, (long long)n,
              (long long)first, got[first], want[first]);
    else
        t_note("  %s: bitwise equal (%lld floats; %lld NaNs with other NaN bits)", what, (long long)n,
               (long long)nan_bits);
    return bad == 0;
}

/* |got[i] − want[i]| <= bound[i] for every i (NaN never passes); reports the largest absolute and relative
 * errors and the largest error / bound ratio, so the device log shows how much room the bound left. */
static inline bool cc_within(const char *what, const float *got, const float *want, const double *bound, int64_t n) {
    double max_abs = 0, max_rel = 0, max_ratio = 0;
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)want[i]);
        bool ok = d <= bound[i]; /* false for NaN */
        if (!ok && bad++ == 0) first = i;
        if (d > max_abs || d != d) max_abs = d;
        double r = want[i] != 0 ? d / fabs((double)want[i]) : (d > 0 ? d : 0);
        if (r > max_rel || r != r) max_rel = r;
        double q = bound[i] > 0 ? d / bound[i] : (d > 0 ? INFINITY : 0);
        if (q > max_ratio || q != q) max_ratio = q;
    }
    t_note("  %s: max abs err %.3g, max rel err %.3g, max err/bound %.3g (n %lld)", what, max_abs, max_rel, max_ratio,
           (long long)n);
    if (bad)
        CHECK(bad == 0, "%s: %lld of %lld outside the bound; first [%lld] %.9g vs %.9g (bound %.3g)", what,
              (long long)bad, (long long)n, (long long)first, got[first], want[first], bound[first]);
    return bad == 0;
}
/* The same with one relative bound per element, rel·|want[i]| + abs_floor. */
static inline bool cc_within_rel(const char *what, const float *got, const float *want, int64_t n, double rel,
                                 double abs_floor) {
    double *b = (double *)malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
    for (int64_t i = 0; i < n; i++) b[i] = rel * fabs((double)want[i]) + abs_floor;
    bool ok = cc_within(what, got, want, b, n);
    free(b);
    return ok;
}

/* Bound of a fp32 sum of K products computed in two different orders (each within gamma_(K+1)·Σ|a·b| of
 * the exact sum, gamma_k = k·u/(1 − k·u)): twice that, plus one rounding of the output. */
static inline double cc_dot_bound(int64_t K, double sum_abs) {
    const double g = (double)(K + 2) * CC_U32 / (1.0 - (double)(K + 2) * CC_U32);
    return 2.0 * g * sum_abs;
}

#endif
