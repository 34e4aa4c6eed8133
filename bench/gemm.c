/* GEMM throughput: reference vs fast AVX-512 fp32 kernels vs the AMX bf16 path (matmul precision
 * bf16: bf16 operands, fp32 accumulation), GFLOP/s as the median of timed calls, on 1 thread and on
 * all threads. fp32 and bf16 calls alternate (drift of a shared machine hits both alike). The reference
 * is timed on the shapes marked for it only (it is slow), and not at all with --fast-only.
 * Usage: gemm [--fast-only] [--runs N] */
#include <omp.h>
#include <stdbool.h>
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
    bool ref; /* time the reference too */
} shape;

static const shape SHAPES[] = {
    {"linear fwd  tokens x out x in", 'n', 4096, 1024, 256, true},
    {"linear dinp tokens x in x out", 'm', 4096, 256, 1024, true},
    {"linear dw   out x in x tokens", 't', 1024, 256, 4096, true},
    {"square", 'n', 1024, 1024, 1024, true},
    {"small", 'n', 256, 64, 32, true},
    {"small nn", 'm', 256, 64, 32, true},
    {"small tn", 't', 256, 64, 32, true},
    {"odd", 'n', 333, 97, 131, true},
    /* a small model's linear layers at 2048 tokens (d = 256..1024), forward and both backward GEMMs */
    {"2k tok fwd  d=256", 'n', 2048, 256, 256, false},
    {"2k tok fwd  d=512", 'n', 2048, 512, 512, false},
    {"2k tok fwd  d=1024", 'n', 2048, 1024, 1024, false},
    {"2k tok dinp d=1024", 'm', 2048, 1024, 1024, false},
    {"2k tok dw   d=1024", 't', 1024, 1024, 2048, false},
    {"2k tok fwd  256->1024", 'n', 2048, 1024, 256, false},
    {"2k tok fwd  1024->256", 'n', 2048, 256, 1024, false},
    /* one routed expert (512 tokens of 2048 x top-4 / 16 experts): up/gate 256->512, down 512->256 */
    {"expert up   512 tok 256->512", 'n', 512, 512, 256, false},
    {"expert down 512 tok 512->256", 'n', 512, 256, 512, false},
    {"expert dw   up", 't', 512, 256, 512, false},
};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *t, int n) {
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    return t[n / 2];
}

static void call(gemm_fn f, const shape *s, const float *A, const float *B, float *C) {
    int64_t lda = s->op == 't' ? s->M : s->K, ldb = s->op == 'n' ? s->K : s->N;
    f(s->M, s->N, s->K, A, lda, B, ldb, C, s->N, 0);
}

/* Median seconds of `runs` calls of f in the current precision (after one warm-up call). */
static double time_gemm(gemm_fn f, const shape *s, const float *A, const float *B, float *C, int runs) {
    double t[64];
    if (runs > 64) runs = 64;
    call(f, s, A, B, C);
    for (int r = 0; r < runs; r++) {
        double t0 = ds4_now();
        call(f, s, A, B, C);
        t[r] = ds4_now() - t0;
    }
    return median(t, runs);
}

/* Median seconds of f in fp32 (*t32) and in bf16 (*t16), calls alternating; *t16 = 0 without bf16. */
static void time_fp32_bf16(gemm_fn f, const shape *s, const float *A, const float *B, float *C, int runs,
                           bool bf16, double *t32, double *t16) {
    double a[64], b[64];
    if (runs > 64) runs = 64;
    *t16 = 0;
    for (int r = -1; r < runs; r++) /* r = -1: warm-up of both */
        for (int p = 0; p < (bf16 ? 2 : 1); p++) {
            ds4_set_matmul_precision(p ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32);
            double t0 = ds4_now();
            call(f, s, A, B, C);
            if (r >= 0) (p ? b : a)[r] = ds4_now() - t0;
        }
    ds4_set_matmul_precision(DS4_MATMUL_FP32);
    *t32 = median(a, runs);
    if (bf16) *t16 = median(b, runs);
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
    bool bf16 = ds4_set_matmul_precision(DS4_MATMUL_BF16) == DS4_OK;
    if (!bf16) printf("bf16 (AMX) not measured: %s\n", ds4_errmsg());
    ds4_set_matmul_precision(DS4_MATMUL_FP32);
    int max_threads = omp_get_max_threads();
    printf("%-30s %-3s %6s %6s %6s %4s %9s %10s %10s %6s\n", "shape", "op", "M", "N", "K", "thr", "ref GF/s",
           "fp32 GF/s", "bf16 GF/s", "x");
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
            double t32, t16;
            time_fp32_bf16(fast, s, A, B, C, runs * 4, bf16, &t32, &t16);
            double tr = fast_only || !s->ref ? 0 : time_gemm(ref, s, A, B, C, runs);
            char rs[16] = "-", bs[16] = "-", xs[16] = "-";
            if (tr > 0) snprintf(rs, sizeof rs, "%.2f", flop / tr * 1e-9);
            if (t16 > 0) {
                snprintf(bs, sizeof bs, "%.1f", flop / t16 * 1e-9);
                snprintf(xs, sizeof xs, "%.2f", t32 / t16);
            }
            printf("%-30s %-3s %6lld %6lld %6lld %4d %9s %10.1f %10s %6s\n", s->what, opname, (long long)s->M,
                   (long long)s->N, (long long)s->K, th, rs, flop / t32 * 1e-9, bs, xs);
            fflush(stdout);
        }
        omp_set_num_threads(max_threads);
        ds4_free(A);
        ds4_free(B);
        ds4_free(C);
    }
    return 0;
}
