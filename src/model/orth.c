/* Newton–Schulz orthogonalization, the matrix step of the Muon optimizer (ds4/model.h): quintic
 * iterations on the short side of the matrix, every product through the model's GEMM engines (fp32, or
 * bf16 operands under training.matmul_precision = "bf16"), so the result has the engines' fixed order. */
#include "model/model_internal.h"

#include <math.h>

/* out [c, r] := x [r, c] transposed. */
static void transpose(const float *x, int64_t r, int64_t c, float *out) {
#pragma omp parallel for if (r * c >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) out[j * r + i] = x[i * c + j];
}

/* One iteration on x [r, c] (r <= c): A = x·xᵀ [r, r], B = b·A + c·A·A [r, r], x = a·x + B·x. */
static void ns_iteration(const ds4_exec *ex, float *x, int64_t r, int64_t c, ds4_ns_coef k, float *A, float *B,
                         float *y) {
    gemm_nt(ex, r, r, c, x, c, x, c, A, r, 0.0f);
    gemm_nn(ex, r, r, r, A, r, A, r, B, r, 0.0f);
#pragma omp parallel for if (r * r >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < r * r; i++) B[i] = k.b * A[i] + k.c * B[i];
    gemm_nn(ex, r, c, r, B, r, x, c, y, c, 0.0f);
#pragma omp parallel for if (r * c >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < r * c; i++) x[i] = k.a * x[i] + y[i];
}

/* x [n] /= (‖x‖_F + eps): the spectral norm is then at most 1, where the iterations converge. */
static void normalize(float *x, int64_t n, float eps) {
    const float d = (float)sqrt(ds4_sumsq(x, n)) + eps;
#pragma omp parallel for if (n >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] = x[i] / d;
}

ds4_status ds4_newton_schulz(const ds4_exec *ex, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                             int64_t iters, float eps) {
    if (rows < 1 || cols < 1 || iters < 0)
        return ds4_fail(DS4_ERR_ARG, "newton-schulz: a %lld x %lld matrix, %lld iterations", (long long)rows,
                        (long long)cols, (long long)iters);
    const bool tall = rows > cols; /* work on xᵀ: the Gram matrix is then the small one */
    const int64_t r = tall ? cols : rows, c = tall ? rows : cols;
    float *A = ds4_alloc(DS4_MEM_OPTIM, (size_t)(r * r) * sizeof(float));
    float *B = ds4_alloc(DS4_MEM_OPTIM, (size_t)(r * r) * sizeof(float));
    float *y = ds4_alloc(DS4_MEM_OPTIM, (size_t)(r * c) * sizeof(float));
    float *t = tall ? ds4_alloc(DS4_MEM_OPTIM, (size_t)(r * c) * sizeof(float)) : x;
    ds4_status st = A && B && y && t ? DS4_OK
                                     : ds4_fail(DS4_ERR_OOM, "newton-schulz: out of memory for a %lld x %lld matrix",
                                                (long long)rows, (long long)cols);
    const bool plan = ex && ex->plan;
    if (st == DS4_OK && !plan) {
        if (tall) transpose(x, rows, cols, t);
        normalize(t, r * c, eps);
        for (int64_t i = 0; i < iters; i++) ns_iteration(ex, t, r, c, coef[i], A, B, y);
        if (tall) transpose(t, r, c, x);
    }
    ds4_free(A);
    ds4_free(B);
    ds4_free(y);
    if (tall) ds4_free(t);
    return st;
}
