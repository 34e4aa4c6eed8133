/* Dequantization of the official DeepSeek-V4 checkpoint formats (docs/dsv4-architecture.md §8.2):
 *   FP8 linear:  W[i,j] = e4m3(W8[i,j]) · S[i/128, j/128]          S: [ceil(R/128), ceil(C/128)]
 *   FP4 expert:  W[i,j] = e2m1(nibble(i,j)) · S[i, j/32]            S: [R, ceil(C/32)]
 *                byte k of a row holds column 2k in its low nibble, 2k+1 in its high nibble.
 * S is F8_E8M0 (2^(b-127)) in the released checkpoints; F32 or BF16 scales are accepted too. */
#include "ds4/io.h"

#include <inttypes.h>
#include <math.h>
#include <string.h>

float ds4_e4m3_to_f32(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = NAN;                  /* E4M3FN: no inf, one NaN pattern per sign */
    else if (e == 0) v = ldexpf((float)m, -9);       /* subnormal: m/8 · 2^-6 */
    else v = ldexpf((float)(8 + m), e - 10);         /* (1 + m/8) · 2^(e-7) */
    return s ? -v : v;
}

float ds4_e5m2_to_f32(uint8_t b) {
    int s = b >> 7, e = (b >> 2) & 31, m = b & 3;
    float v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexpf((float)m, -16);      /* m/4 · 2^-14 */
    else v = ldexpf((float)(4 + m), e - 17);         /* (1 + m/4) · 2^(e-15) */
    return s ? -v : v;
}

float ds4_e8m0_to_f32(uint8_t b) { return b == 255 ? NAN : ldexpf(1.0f, (int)b - 127); }

float ds4_e2m1_to_f32(uint8_t nib) {
    static const float k[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    float v = k[nib & 7];
    return (nib & 8) ? -v : v;
}

void ds4_dequant_fp8_rows(const uint8_t *w, const float *scale, int64_t cols, int64_t r0, int64_t n, float *out) {
    float lut[256];
    for (int i = 0; i < 256; i++) lut[i] = ds4_e4m3_to_f32((uint8_t)i);
    int64_t sc = (cols + 127) / 128;   /* scale columns */
    int64_t off = r0 % 128;            /* position of row r0 inside its block row */
    #pragma omp parallel for schedule(static) if (n * cols > (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        const float *srow = scale + ((off + i) / 128) * sc;
        const uint8_t *wr = w + i * cols;
        float *o = out + i * cols;
        for (int64_t jb = 0; jb < sc; jb++) {
            float sv = srow[jb];
            int64_t j1 = (jb + 1) * 128 < cols ? (jb + 1) * 128 : cols;
            for (int64_t j = jb * 128; j < j1; j++) o[j] = lut[wr[j]] * sv;
        }
    }
}

void ds4_dequant_fp8_block(const uint8_t *w, const float *scale, int64_t rows, int64_t cols, float *out) {
    ds4_dequant_fp8_rows(w, scale, cols, 0, rows, out);
}

void ds4_dequant_fp4_row32(const uint8_t *packed, const float *scale, int64_t rows, int64_t cols, float *out) {
    float lut[16];
    for (int i = 0; i < 16; i++) lut[i] = ds4_e2m1_to_f32((uint8_t)i);
    int64_t half = cols / 2, sc = (cols + 31) / 32;
    #pragma omp parallel for schedule(static) if (rows * cols > (1 << 16))
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *pr = packed + i * half;
        const float *srow = scale + i * sc;
        float *o = out + i * cols;
        for (int64_t kb = 0; kb < sc; kb++) {   /* 16 bytes = 32 columns share one scale */
            float sv = srow[kb];
            int64_t k1 = (kb + 1) * 16 < half ? (kb + 1) * 16 : half;
            for (int64_t k = kb * 16; k < k1; k++) {
                o[2 * k] = lut[pr[k] & 15] * sv;
                o[2 * k + 1] = lut[pr[k] >> 4] * sv;
            }
        }
    }
}
