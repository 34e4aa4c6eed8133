/* Shared by the AVX-512 tile kernels (gemm_avx512.c, gemm_avx512bf16.c). Include it inside the file's
 * AVX-512 target region only: the functions use AVX-512 instructions. */
#ifndef DS4_KERNELS_X86_AVX512_TILE_H
#define DS4_KERNELS_X86_AVX512_TILE_H

#include <immintrin.h>
#include <stdint.h>

/* The first n (clamped to 0..16) lanes. */
static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* One C row of a 32-column tile from its two accumulators: C = acc (cscale 0: C is not read), C + acc (1),
 * or cscale·C + acc; lanes m0, m1 only. */
static inline void store_row(float *c, __m512 lo, __m512 hi, __mmask16 m0, __mmask16 m1, float cscale) {
    if (cscale != 0) {
        __m512 c0 = _mm512_maskz_loadu_ps(m0, c), c1 = _mm512_maskz_loadu_ps(m1, c + 16);
        if (cscale != 1) {
            __m512 s = _mm512_set1_ps(cscale);
            c0 = _mm512_mul_ps(s, c0);
            c1 = _mm512_mul_ps(s, c1);
        }
        lo = _mm512_add_ps(c0, lo);
        hi = _mm512_add_ps(c1, hi);
    }
    _mm512_mask_storeu_ps(c, m0, lo);
    _mm512_mask_storeu_ps(c + 16, m1, hi);
}

#endif
