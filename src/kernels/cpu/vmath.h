/* Vector math for the cpu kernels, in GCC vector types (8 floats): the same operations in the same order
 * on every ISA level (the build has -ffp-contract=off, so no multiply-add is fused), hence the same bits
 * whatever table runs. Static inline, no static data: each level's copy is its own. */
#ifndef DS4_KERNELS_CPU_VMATH_H
#define DS4_KERNELS_CPU_VMATH_H

#include <stdint.h>
#include <string.h>

typedef float vm_f8 __attribute__((vector_size(32)));
typedef int32_t vm_i8 __attribute__((vector_size(32)));

static inline vm_i8 vm_bits(vm_f8 x) {
    vm_i8 r;
    memcpy(&r, &x, sizeof r);
    return r;
}
static inline vm_f8 vm_float(vm_i8 x) {
    vm_f8 r;
    memcpy(&r, &x, sizeof r);
    return r;
}
/* m ? a : b per lane (m: all ones or all zeros per lane) */
static inline vm_f8 vm_select(vm_i8 m, vm_f8 a, vm_f8 b) { return vm_float((m & vm_bits(a)) | (~m & vm_bits(b))); }

/* exp per lane. x = n·ln2 + r with n = round(x·log2 e) (the 1.5·2²³ shift rounds to nearest) and
 * r = x − n·ln2 in two steps (ln2 = C1 + C2, C1 with few bits so n·C1 is exact), |r| <= ln2/2; e^r by a
 * degree-7 minimax polynomial (the coefficients of Cephes' expf); 2^n built in the exponent bits.
 * Within 2 ulp of the exact value (tests/test_kernels_attn.c measures it against double exp).
 * Outside the normal range: x < −126·ln2 gives 0 (no subnormals), x > 127.5·ln2 gives +inf; NaN stays NaN. */
static inline vm_f8 vm_exp8(vm_f8 x) {
    const vm_f8 lo = (vm_f8){0} - 87.33654475f, hi = (vm_f8){0} + 88.37626266f;
    const vm_f8 log2e = (vm_f8){0} + 1.44269504088896341f, shift = (vm_f8){0} + 12582912.0f;
    const vm_f8 c1 = (vm_f8){0} + 0.693359375f, c2 = (vm_f8){0} - 2.12194440e-4f;
    const vm_i8 under = x < lo, over = x > hi, nan = x != x;
    vm_f8 xc = vm_select(under, lo, vm_select(over, hi, x));
    vm_f8 n = (xc * log2e + shift) - shift;
    vm_f8 r = (xc - n * c1) - n * c2;
    vm_f8 p = (vm_f8){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = (p * (r * r) + r) + 1.0f;
    vm_f8 y = p * vm_float((__builtin_convertvector(n, vm_i8) + 127) << 23);
    y = vm_select(under, (vm_f8){0}, y);
    y = vm_select(over, (vm_f8){0} + __builtin_inff(), y);
    return vm_select(nan, x, y);
}

/* x[i] := exp(x[i] − m) for i < n (a last partial vector through a padded copy: the same bits as a
 * full one). */
static inline void vm_exp_sub(float *x, int64_t n, float m) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        vm_f8 v;
        memcpy(&v, x + i, sizeof v);
        v = vm_exp8(v - m);
        memcpy(x + i, &v, sizeof v);
    }
    if (i < n) {
        vm_f8 v = {0};
        memcpy(&v, x + i, (size_t)(n - i) * sizeof(float));
        v = vm_exp8(v - m);
        memcpy(x + i, &v, (size_t)(n - i) * sizeof(float));
    }
}

#endif
