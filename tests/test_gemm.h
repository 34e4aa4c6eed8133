/* The GEMM tests' shared pieces (test_kernels_basic, test_kernels_bf16): the three layouts, their names,
 * the reference signature, and the wrapper of a layout in a context. Include after kernels/kernels.h. */
#ifndef DS4_TEST_GEMM_H
#define DS4_TEST_GEMM_H

typedef void (*gemm_fn)(int64_t, int64_t, int64_t, const float *, int64_t, const float *, int64_t, float *,
                        int64_t, float);

enum { OP_NT, OP_NN, OP_TN };
static const char *OP_NAME[] = {"nt", "nn", "tn"};

/* The GEMM wrapper of op in context ex (the context's backend and matmul precision; a plan's mirrors). */
static inline void gemm_op(const ds4_exec *ex, int op, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    if (op == OP_NT) gemm_nt(ex, M, N, K, A, lda, B, ldb, C, ldc, beta);
    else if (op == OP_NN) gemm_nn(ex, M, N, K, A, lda, B, ldb, C, ldc, beta);
    else gemm_tn(ex, M, N, K, A, lda, B, ldb, C, ldc, beta);
}

#endif
