/* Newton–Schulz orthogonalization, the matrix step of the Muon optimizer (ds4/model.h): the newton_schulz
 * op of the context's backend (quintic iterations on the short side of the matrix, every product on the
 * backend's GEMM engines), its arguments checked and its out-of-memory turned into a status. */
#include "model/model_internal.h"

ds4_status ds4_newton_schulz(const ds4_exec *ex, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                             int64_t iters, float eps) {
    if (rows < 1 || cols < 1 || iters < 0)
        return ds4_fail(DS4_ERR_ARG, "newton-schulz: a %lld x %lld matrix, %lld iterations", (long long)rows,
                        (long long)cols, (long long)iters);
    const ds4_exec real = {0};
    const int64_t failures = ds4_alloc_failures();
    newton_schulz(ex ? ex : &real, x, rows, cols, coef, iters, eps);
    if (ds4_alloc_failures() != failures)
        return ds4_fail(DS4_ERR_OOM, "newton-schulz: out of memory for a %lld x %lld matrix", (long long)rows,
                        (long long)cols);
    return DS4_OK;
}
