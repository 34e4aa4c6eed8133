/* Times the CUDA backend's ground-floor ops at V4-Flash widths on one GPU (scripts/gpu-check.sh runs it):
 * the GEMMs in TFLOP/s (2·M·N·K per product; bf16 includes rounding the fp32 operands to bf16) and the
 * memory-bound ops in GB/s (the fewest bytes each must read and write). Each case: 2 warm-up runs, then
 * the mean of `reps` runs between two CUDA events. Inputs are pseudo-random, never zeros. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/cuda.h"

static cudaStream_t S;
static cuda_blas *BL;

#define TRY(expr)                                                                   \
    do {                                                                            \
        ds4_status st_ = (expr);                                                    \
        if (st_ != DS4_OK) {                                                        \
            fprintf(stderr, "%s: %s\n", #expr, ds4_errmsg());                       \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

/* x [n] = a hash of the index in [-amp, amp) */
static __global__ void fill_kernel(float *x, int64_t n, uint32_t seed, float amp) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        x[i] = amp * ((float)(h >> 8) / 8388608.0f - 1.0f);
    }
}
static float *rnd(int64_t n, uint32_t seed, float amp) {
    float *p = NULL;
    TRY(cuda_alloc((void **)&p, (size_t)n * sizeof(float)));
    fill_kernel<<<4096, 256, 0, S>>>(p, n, seed, amp);
    return p;
}
static int32_t *ids(int64_t n, int64_t hi) {
    int32_t *h = (int32_t *)malloc((size_t)n * 4), *d = NULL;
    uint64_t s = 12345;
    for (int64_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        h[i] = (int32_t)((s >> 33) % (uint64_t)hi);
    }
    TRY(cuda_alloc((void **)&d, (size_t)n * 4));
    TRY(cuda_copy_h2d(S, d, h, (size_t)n * 4));
    TRY(cuda_stream_sync(S));
    free(h);
    return d;
}

/* Mean milliseconds of one run of `op` (a statement) over reps runs after 2 warm-ups. */
#define TIME_MS(ms, reps, op)                                   \
    do {                                                        \
        cudaEvent_t a_, b_;                                     \
        cudaEventCreate(&a_);                                   \
        cudaEventCreate(&b_);                                   \
        for (int w_ = 0; w_ < 2; w_++) op;                      \
        cudaEventRecord(a_, S);                                 \
        for (int r_ = 0; r_ < (reps); r_++) op;                 \
        cudaEventRecord(b_, S);                                 \
        cudaEventSynchronize(b_);                               \
        float t_ = 0;                                           \
        cudaEventElapsedTime(&t_, a_, b_);                      \
        ms = t_ / (reps);                                       \
        cudaEventDestroy(a_);                                   \
        cudaEventDestroy(b_);                                   \
    } while (0)

static void gemm_rate(const char *name, ds4_matmul_precision p, bool hb, int64_t M, int64_t N, int64_t K) {
    float *A = rnd(M * K, 1, 1.0f), *B = rnd(N * K, 2, 1.0f), *C = rnd(M * N, 3, 1.0f);
    uint16_t *Bh = NULL;
    TRY(cuda_alloc((void **)&Bh, (size_t)(N * K) * 2));
    TRY(cuda_tensor_pack_bf16(S, Bh, B, N * K));
    double ms;
    if (hb) TIME_MS(ms, 10, TRY(cuda_gemm_nt_hb(BL, S, M, N, K, A, K, Bh, K, C, N, 0)));
    else TIME_MS(ms, 10, TRY(cuda_gemm_nt(BL, S, p, M, N, K, A, K, B, K, C, N, 0)));
    printf("%-34s M %5lld N %5lld K %5lld  %8.3f ms  %7.1f TFLOP/s\n", name, (long long)M, (long long)N, (long long)K,
           ms, 2.0 * M * N * K / (ms * 1e-3) / 1e12);
    cuda_free(A), cuda_free(B), cuda_free(C), cuda_free(Bh);
}

static void rate_gb(const char *name, double ms, double bytes) {
    printf("%-34s %8.3f ms  %7.1f GB/s (%.0f MB moved at least)\n", name, ms, bytes / (ms * 1e-3) / 1e9, bytes / 1e6);
}

int main(void) {
    int n = 0;
    if (cuda_device_count(&n) != DS4_OK || n == 0) {
        printf("cuda_ops: no CUDA device visible\n");
        return 0;
    }
    char desc[256];
    TRY(cuda_device_describe(0, desc, sizeof desc));
    printf("%s\n", desc);
    TRY(cuda_stream_create(&S));
    TRY(cuda_blas_create(&BL, 0));
    gemm_rate("gemm_nt bf16 (fp32 operands)", DS4_MATMUL_BF16, false, 8192, 8192, 8192);
    gemm_rate("gemm_nt_hb bf16 (bf16 weight)", DS4_MATMUL_BF16, true, 8192, 8192, 8192);
    gemm_rate("gemm_nt fp32 (no TF32)", DS4_MATMUL_FP32, false, 4096, 4096, 4096);
    gemm_rate("linear q_down-like bf16", DS4_MATMUL_BF16, true, 8192, 1024, 4096);

    const int64_t T = 16384, D = 4096, V = 129280, I = 2048;
    double ms;
    float *x = rnd(T * D, 4, 2.0f), *y = rnd(T * D, 5, 1.0f), *w = rnd(D, 6, 1.0f), *r = rnd(T, 7, 1.0f);
    float *dy = rnd(T * D, 8, 1.0f), *dx = rnd(T * D, 9, 1.0f), *dw = rnd(D, 10, 1.0f);
    TIME_MS(ms, 10, TRY(cuda_rmsnorm_fwd(S, y, r, x, w, T, D, 1e-6f)));
    rate_gb("rmsnorm_fwd T 16384 D 4096", ms, 2.0 * T * D * 4);
    TIME_MS(ms, 10, TRY(cuda_rmsnorm_bwd(S, dx, NULL, dy, x, w, r, T, D)));
    rate_gb("rmsnorm_bwd dx", ms, 4.0 * T * D * 4);
    TIME_MS(ms, 5, TRY(cuda_rmsnorm_bwd(S, NULL, dw, dy, x, w, r, T, D)));
    rate_gb("rmsnorm_bwd dw (row-ordered tiles)", ms, 2.0 * T * D * 4);
    float *table = rnd(V * D, 11, 1.0f);
    int32_t *tok = ids(T, V);
    TIME_MS(ms, 10, TRY(cuda_embedding_fwd(S, y, table, tok, T, D)));
    rate_gb("embedding_fwd", ms, 2.0 * T * D * 4);
    TIME_MS(ms, 3, TRY(cuda_embedding_bwd(S, table, dy, tok, T, D)));
    rate_gb("embedding_bwd (windows of 32)", ms, 3.0 * T * D * 4);
    cuda_free(table);
    TIME_MS(ms, 10, TRY(cuda_swiglu_fwd(S, y, x, dy, T, I, 10.0f)));
    rate_gb("swiglu_fwd T 16384 I 2048", ms, 3.0 * T * I * 4);
    TIME_MS(ms, 10, TRY(cuda_swiglu_bwd(S, dx, y, dy, x, dy, T, I, 10.0f)));
    rate_gb("swiglu_bwd", ms, 7.0 * T * I * 4);

    const int64_t Nce = 4096;
    float *logits = rnd(Nce * V, 12, 8.0f), *dlog = NULL;
    double *loss = NULL, *rows = NULL;
    int64_t *cnt = NULL;
    TRY(cuda_alloc((void **)&dlog, (size_t)(Nce * V) * 4));
    TRY(cuda_alloc((void **)&loss, 8));
    TRY(cuda_alloc((void **)&cnt, 8));
    TRY(cuda_alloc((void **)&rows, cuda_cross_entropy_scratch_bytes(Nce)));
    int32_t *tg = ids(Nce, V);
    TIME_MS(ms, 5, TRY(cuda_cross_entropy_fwd_bwd(S, loss, cnt, dlog, logits, tg, Nce, V, 1.0f / Nce, rows)));
    rate_gb("cross_entropy N 4096 V 129280", ms, 2.0 * Nce * V * 4);
    cuda_free(logits), cuda_free(dlog), cuda_free(loss), cuda_free(cnt), cuda_free(rows), cuda_free(tg);

    const int64_t np = (int64_t)1 << 28; /* 268M parameters */
    float *pw = rnd(np, 13, 1.0f), *pg = rnd(np, 14, 0.01f), *pm = rnd(np, 15, 0.01f), *pv = rnd(np, 16, 0.0f);
    TRY(cuda_fill(S, pv, 0, (size_t)np * 4));
    const cuda_adamw_k k = cuda_adamw_consts(10, 0.9, 0.95, 1e-8, 0.1, 3e-4);
    TIME_MS(ms, 5, TRY(cuda_adamw_update(S, &k, np, pm, pv, 1, pw, pg)));
    rate_gb("adamw_update 268M parameters", ms, 7.0 * np * 4);
    double *sq = NULL, *part = NULL;
    ds4_sumsq_acc *acc = NULL;
    TRY(cuda_alloc((void **)&sq, 8));
    TRY(cuda_alloc((void **)&part, cuda_sumsq_scratch_bytes(np)));
    TRY(cuda_alloc((void **)&acc, sizeof *acc));
    TIME_MS(ms, 3, TRY(cuda_sumsq(S, sq, pg, np, part)));
    rate_gb("sumsq (chunked double) 268M", ms, 4.0 * np);
    TIME_MS(ms, 3, TRY(cuda_sumsq_exact(S, acc, pg, np)));
    rate_gb("sumsq_exact (limbs) 268M", ms, 4.0 * np);
    cuda_free(sq), cuda_free(part), cuda_free(acc);
    /* Muon's matrix step on a 4096 × 1024 weight: 5 quintic iterations */
    const float coef[15] = {3.4445f, -4.7750f, 2.0315f, 3.4445f, -4.7750f, 2.0315f, 3.4445f, -4.7750f, 2.0315f,
                            3.4445f, -4.7750f, 2.0315f, 3.4445f, -4.7750f, 2.0315f};
    void *nss = NULL;
    TRY(cuda_alloc(&nss, cuda_newton_schulz_scratch_bytes(4096, 1024)));
    for (int p = 0; p < 2; p++) {
        const ds4_matmul_precision prec = p ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32;
        TIME_MS(ms, 3, TRY(cuda_newton_schulz(BL, S, prec, x, 4096, 1024, coef, 5, 1e-7f, nss)));
        /* per iteration 2·r·r·c + 2·r³ + 2·r·r·c FLOPs, r = 1024, c = 4096 */
        const double fl = 5.0 * (4.0 * 1024.0 * 1024.0 * 4096.0 + 2.0 * 1024.0 * 1024.0 * 1024.0);
        printf("%-34s %8.3f ms  %7.1f TFLOP/s\n", p ? "newton_schulz 4096x1024 bf16" : "newton_schulz 4096x1024 fp32",
               ms, fl / (ms * 1e-3) / 1e12);
    }
    cuda_free(nss);
    cuda_free(pw), cuda_free(pg), cuda_free(pm), cuda_free(pv);
    cuda_free(x), cuda_free(y), cuda_free(w), cuda_free(r), cuda_free(dy), cuda_free(dx), cuda_free(dw), cuda_free(tok);
    TRY(cuda_stream_sync(S));
    cuda_blas_destroy(BL);
    cuda_stream_destroy(S);
    return 0;
}
