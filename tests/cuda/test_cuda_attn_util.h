/* Host-side helpers the attention-family and mHC CUDA tests share (test_cuda_attn.cu, test_cuda_hc.cu),
 * on top of cuda_check.h: float buffers up to the device, back, and cloned on the host (never NULL, so
 * a size-0 tensor still has a pointer). */
#ifndef DS4_TESTS_CUDA_ATTN_UTIL_H
#define DS4_TESTS_CUDA_ATTN_UTIL_H

#include "cuda_check.h"

/* False when DS4_CUDA_SMALL is set (not "0"): scripts/gpu-check.sh asks for the small cases under the
 * sanitizers, which run kernels hundreds of times slower; the large shapes then are skipped. */
static inline bool ta_full(void) {
    const char *e = getenv("DS4_CUDA_SMALL");
    return !(e && *e && strcmp(e, "0") != 0);
}

/* Device copy of n host floats. */
static inline float *up_f(const float *h, int64_t n) { return cc_upf(h, n > 0 ? n : 1); }
/* Host copy of n device floats (after the device finished). */
static inline float *down_f(const float *d, int64_t n) {
    float *h = cc_hostf(n > 0 ? n : 1);
    cc_down(h, d, (size_t)n * sizeof(float));
    return h;
}
/* Host copy of n host floats. */
static inline float *hclone(const float *x, int64_t n) {
    float *y = cc_hostf(n > 0 ? n : 1);
    memcpy(y, x, (size_t)n * sizeof(float));
    return y;
}

#endif
