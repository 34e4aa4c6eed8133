/* GEMM throughput of every engine this CPU runs, side by side: for each ISA level from the best down to
 * generic (ds4_isa_select), the fp32 GEMM and the bf16 one (matmul precision bf16: bf16 operands, fp32
 * accumulation), GFLOP/s as the median of timed calls, on 1 thread and on all threads. The calls of all
 * engines alternate within each timed round, so drift of a shared machine hits them alike. The generic
 * level (the portable references) is timed on the shapes marked for it only (it is slow), and not at all
 * with --fast-only. The bf16 precision is also timed with B given as bf16 bits (column bf16w: a weight's
 * bf16 compute copy, cpu_gemm_nt_hb / nn_hb; nt and nn shapes), the same bits without rounding B per call.
 * Usage: gemm [--fast-only] [--runs N] */
#include <omp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels.h"
#include "stats.h"

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

/* f on shape s in precision prec; with Bh (nt, nn only) the bf16-B GEMM on those bits instead. */
static void call(gemm_driver_signature *f, ds4_matmul_precision prec, const shape *s, const float *A, const float *B,
                 const uint16_t *Bh, float *C) {
    int64_t lda = s->op == 't' ? s->M : s->K, ldb = s->op == 'n' ? s->K : s->N;
    if (Bh) (s->op == 'n' ? cpu_gemm_nt_hb : cpu_gemm_nn_hb)(s->M, s->N, s->K, A, lda, Bh, ldb, C, s->N, 0);
    else f(prec, s->M, s->N, s->K, A, lda, B, ldb, C, s->N, 0);
}

/* One engine: an ISA level and a matmul precision (hb: bf16 with B as bf16 bits). */
typedef struct {
    ds4_isa isa;
    ds4_matmul_precision prec;
    bool hb;
    double t[64];
} engine_run;

static bool runs_on(const engine_run *e, const shape *s) { return !e->hb || s->op != 't'; }

/* Median seconds of each engine on shape s, over `runs` rounds in which every engine is called once
 * (after a warm-up round). */
static void time_engines(engine_run *e, int ne, gemm_driver_signature *f, const shape *s, const float *A, const float *B,
                         const uint16_t *Bh, float *C, int runs) {
    for (int r = -1; r < runs; r++)
        for (int i = 0; i < ne; i++) {
            if (!runs_on(&e[i], s)) continue;
            ds4_isa_select(e[i].isa);
            double t0 = ds4_now();
            call(f, e[i].prec, s, A, B, e[i].hb ? Bh : NULL, C);
            if (r >= 0) e[i].t[r] = ds4_now() - t0;
        }
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
    if (runs > 64) runs = 64;
    ds4_isa best = ds4_isa_best();
    char info[4096];
    ds4_isa_describe(info, sizeof info);
    printf("%s\n", info);
    engine_run all[3 * DS4_ISA_COUNT];
    int nall = 0;
    for (int l = (int)best; l >= 0; l--)
        for (int p = 0; p < 3; p++)
            all[nall++] = (engine_run){.isa = (ds4_isa)l, .prec = p ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32, .hb = p == 2};
    printf("GFLOP/s, median of %d rounds; columns: ISA level / precision\n", runs);
    printf("%-30s %-3s %6s %6s %6s %4s", "shape", "op", "M", "N", "K", "thr");
    for (int i = 0; i < nall; i++) {
        char h[32];
        snprintf(h, sizeof h, "%s/%s", ds4_isa_name(all[i].isa),
                 all[i].hb ? "bf16w" : ds4_matmul_precision_name(all[i].prec));
        printf(" %15s", h);
    }
    printf("\n");
    int max_threads = omp_get_max_threads();
    for (size_t si = 0; si < sizeof SHAPES / sizeof SHAPES[0]; si++) {
        const shape *s = &SHAPES[si];
        size_t na = (size_t)(s->M * s->K), nb = (size_t)(s->K * s->N), nc = (size_t)(s->M * s->N);
        float *A = ds4_alloc(DS4_MEM_WORK, na * sizeof(float));
        float *B = ds4_alloc(DS4_MEM_WORK, nb * sizeof(float));
        float *C = ds4_alloc(DS4_MEM_WORK, nc * sizeof(float));
        uint16_t *Bh = ds4_alloc(DS4_MEM_WORK, nb * sizeof(uint16_t));
        if (!A || !B || !C || !Bh) {
            fprintf(stderr, "error: %s\n", ds4_errmsg());
            return 1;
        }
        for (size_t i = 0; i < na; i++) A[i] = ds4_rng_uniform(1, 1, i) - 0.5f;
        for (size_t i = 0; i < nb; i++) B[i] = ds4_rng_uniform(1, 2, i) - 0.5f;
        for (size_t i = 0; i < nb; i++) Bh[i] = gemm_bf16_bits(B[i]);
        gemm_driver_signature *f = s->op == 'n' ? cpu_gemm_nt : s->op == 'm' ? cpu_gemm_nn : cpu_gemm_tn;
        const char *opname = s->op == 'n' ? "nt" : s->op == 'm' ? "nn" : "tn";
        double flop = 2.0 * (double)s->M * (double)s->N * (double)s->K;
        /* the generic level only where the shape allows it */
        int ne = nall;
        while (ne > 0 && all[ne - 1].isa == DS4_ISA_GENERIC && (fast_only || !s->ref)) ne--;
        for (int th = 1; th <= max_threads; th = th == max_threads ? th + 1 : (th * 2 > max_threads ? max_threads : th * 2)) {
            omp_set_num_threads(th);
            time_engines(all, ne, f, s, A, B, Bh, C, runs);
            printf("%-30s %-3s %6lld %6lld %6lld %4d", s->what, opname, (long long)s->M, (long long)s->N,
                   (long long)s->K, th);
            for (int i = 0; i < nall; i++) {
                if (i < ne && runs_on(&all[i], s)) printf(" %15.1f", flop / bench_median(all[i].t, runs) * 1e-9);
                else printf(" %15s", "-");
            }
            printf("\n");
            fflush(stdout);
        }
        omp_set_num_threads(max_threads);
        ds4_free(A);
        ds4_free(B);
        ds4_free(C);
        ds4_free(Bh);
    }
    ds4_isa_select(best);
    return 0;
}
