/* Reference of the bf16 (mixed precision) GEMMs: operands rounded to bf16 exactly as the AMX packer
 * rounds them, products (exact) summed in double, one rounding to float at the end. The oracle of
 * x86/gemm_amx.c: the AMX result differs from it only by fp32 accumulation error. */
#include <string.h>

#include "kernels/cpu/cpu.h"

#define GEMM_BF16_REF_PAR_MIN ((int64_t)1 << 18) /* below this many multiply-adds, one thread */

/* Same results as VCVTNE2PS2BF16 (Intel SDM, convert_fp32_to_bfloat16): zero and denormal inputs
 * give a zero of the same sign, Inf passes, NaN keeps its top bits with the quiet bit set, and
 * normal numbers round to nearest even (which may overflow to Inf, as it should). */
uint16_t gemm_bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)(bf16_round_u32(u) >> 16);
}

float gemm_bf16_round(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    u = bf16_round_u32(u);
    memcpy(&x, &u, sizeof x);
    return x;
}

/* C[M,N] = beta·C + A·B with A[i,k] = A[i·ars + k·acs] and B[k,j] at k·brs + j·bcs, in B (fp32, rounded
 * here) or, when Bh is set, in Bh (bf16 bits, read as they are: a weight's compute copy); beta 0 does not
 * read C. Each element: double sum over k ascending of bf16(A)·bf16(B). */
static void gemm_bf16_strided(int64_t M, int64_t N, int64_t K, const float *A, int64_t ars, int64_t acs,
                              const float *B, const uint16_t *Bh, int64_t brs, int64_t bcs, float *C, int64_t ldc,
                              float beta) {
#pragma omp parallel for schedule(static) if (M * N * K > GEMM_BF16_REF_PAR_MIN)
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double acc = 0;
            for (int64_t k = 0; k < K; k++) {
                const int64_t b = k * brs + j * bcs;
                const float bv = Bh ? bf16_widen(Bh[b]) : gemm_bf16_round(B[b]);
                acc += (double)gemm_bf16_round(A[i * ars + k * acs]) * bv;
            }
            float *c = &C[i * ldc + j];
            *c = beta == 0 ? (float)acc : (float)((double)beta * *c + acc);
        }
}

/* C[M,N] = beta*C + A[M,K] · B[N,K]^T */
void cpu_gemm_nt_bf16_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float *C, int64_t ldc, float beta) {
    gemm_bf16_strided(M, N, K, A, lda, 1, B, NULL, 1, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N] */
void cpu_gemm_nn_bf16_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float *C, int64_t ldc, float beta) {
    gemm_bf16_strided(M, N, K, A, lda, 1, B, NULL, ldb, 1, C, ldc, beta);
}

/* C[M,N] = beta*C + A[K,M]^T · B[K,N] */
void cpu_gemm_tn_bf16_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                          float *C, int64_t ldc, float beta) {
    gemm_bf16_strided(M, N, K, A, 1, lda, B, NULL, ldb, 1, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[N,K]^T, B: bf16 bits */
void cpu_gemm_nt_hb_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B, int64_t ldb,
                        float *C, int64_t ldc, float beta) {
    gemm_bf16_strided(M, N, K, A, lda, 1, NULL, B, 1, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N], B: bf16 bits */
void cpu_gemm_nn_hb_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B, int64_t ldb,
                        float *C, int64_t ldc, float beta) {
    gemm_bf16_strided(M, N, K, A, lda, 1, NULL, B, ldb, 1, C, ldc, beta);
}
