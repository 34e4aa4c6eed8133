/* The machine's peak fp32 FLOP/s as the model sees it: the rate of its GEMM on a 512^3 product, the
 * denominator of the trainer's MFU. */
#include "model/model_internal.h"

double ds4_probe_peak_flops(const ds4_exec *ex) {
    const int64_t n = 512;
    float *a = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    float *b = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    float *c = ds4_alloc(DS4_MEM_WORK, (size_t)(n * n) * sizeof(float));
    double best = 0;
    if (a && b && c) {
        for (int64_t i = 0; i < n * n; i++) a[i] = b[i] = (float)((i % 7) - 3) * 0.01f;
        gemm_nt(ex, n, n, n, a, n, b, n, c, n, 0.0f); /* warm up */
        for (int rep = 0; rep < 5; rep++) {
            double t0 = ds4_now();
            gemm_nt(ex, n, n, n, a, n, b, n, c, n, 0.0f);
            double dt = ds4_now() - t0;
            double f = 2.0 * (double)n * n * n / dt;
            if (f > best) best = f;
        }
    }
    ds4_free(a);
    ds4_free(b);
    ds4_free(c);
    return best;
}
