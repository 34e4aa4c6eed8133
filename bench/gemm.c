/* GEMM throughput: reference vs fast AVX-512 kernels, GFLOP/s as the median of RUNS timed calls,
 * on 1 thread and on all threads. Usage: gemm [--fast-only] [--runs N] */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4/core.h"
#include "kernels/kernels.h"

typedef void (*gemm_fn)(int64_t, int64_t, int64_t, const float *, int64_t, const float *, int64_t, float *,
                        int64_t, float);

typedef struct {
    const char *what;
    char op; /* 'n' = nt, 'm' = nn, 't' = tn */
    int64_t M, N, K;
} shape;

static const shape SHAPES[] = {
    {"linear fwd  tokens x out x in", 'n', 4096, 1024, 256},
    {"linear dinp tokens x in x out", 'm', 4096, 256, 1024},
    {"linear dw   out x in x tokens", 't', 1024, 256, 4096},
    {"square", 'n', 1024, 1024, 1024},
    {"small", 'n', 256, 64, 32},
    {"small nn", 'm', 256, 64, 32},
    {"small tn", 't', 256, 64, 32},
    {"odd", 'n', 333, 97, 131},
};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median seconds of `runs` calls (after one warm-up call). */
static double time_gemm(gemm_fn f, const shape *s, const float *A, const float *B, float *C, int runs) {
    int64_t lda = s->op == 't' ? s->M : s->K, ldb = s->op == 'n' ? s->K : s->N;
    double t[64];
    if (runs > 64) runs = 64;
    f(s->M, s->N, s->K, A, lda, B, ldb, C, s->N, 0);
    for (int r = 0; r < runs; r++) {
        double t0 = ds4_now();
        f(s->M, s->N, s->K, A, lda, B, ldb, C, s->N, 0);
        t[r] = ds4_now() - t0;
    }
    qsort(t, (size_t)runs, sizeof(double), cmp_double);
    return t[runs / 2];
}

int main(int argc, char **argv) {
    int runs = 5, fast_only = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--fast-only")) fast_only = 1;
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--fast-only] [--runs N]\n", argv[0]);
            return 2;
        }
    }
    if (runs < 5) runs = 5;
    int max_threads = omp_get_max_threads();
    printf("%-32s %-3s %6s %6s %6s %4s %10s %10s\n", "shape", "op", "M", "N", "K", "thr", "ref GF/s", "fast GF/s");
    for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++) {
        const shape *s = &SHAPES[si];
        size_t na = (size_t)(s->M * s->K), nb = (size_t)(s->K * s->N), nc = (size_t)(s->M * s->N);
        float *A = ds4_alloc(DS4_MEM_WORK, na * sizeof(float));
        float *B = ds4_alloc(DS4_MEM_WORK, nb * sizeof(float));
        float *C = ds4_alloc(DS4_MEM_WORK, nc * sizeof(float));
        if (!A || !B || !C) {
            fprintf(stderr, "error: %s\n", ds4_errmsg());
            return 1;
        }
        for (size_t i = 0; i < na; i++) A[i] = ds4_rng_uniform(1, 1, i) - 0.5f;
        for (size_t i = 0; i < nb; i++) B[i] = ds4_rng_uniform(1, 2, i) - 0.5f;
        gemm_fn fast = s->op == 'n' ? gemm_nt : s->op == 'm' ? gemm_nn : gemm_tn;
        gemm_fn ref = s->op == 'n' ? gemm_nt_ref : s->op == 'm' ? gemm_nn_ref : gemm_tn_ref;
        const char *opname = s->op == 'n' ? "nt" : s->op == 'm' ? "nn" : "tn";
        double flop = 2.0 * (double)s->M * (double)s->N * (double)s->K;
        for (int th = 1; th <= max_threads; th = th == max_threads ? th + 1 : (th * 2 > max_threads ? max_threads : th * 2)) {
            omp_set_num_threads(th);
            double tf = time_gemm(fast, s, A, B, C, runs * 4);
            double tr = fast_only ? 0 : time_gemm(ref, s, A, B, C, runs);
            printf("%-32s %-3s %6lld %6lld %6lld %4d %10.2f %10.2f\n", s->what, opname, (long long)s->M,
                   (long long)s->N, (long long)s->K, th, fast_only ? 0.0 : flop / tr * 1e-9, flop / tf * 1e-9);
            fflush(stdout);
        }
        omp_set_num_threads(max_threads);
        ds4_free(A);
        ds4_free(B);
        ds4_free(C);
    }
    return 0;
}
