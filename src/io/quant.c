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

void ds4_dequant_fp8_block(const uint8_t *w, const float *scale, int64_t rows, int64_t cols, float *out) {
    float lut[256];
    for (int i = 0; i < 256; i++) lut[i] = ds4_e4m3_to_f32((uint8_t)i);
    int64_t sc = (cols + 127) / 128;   /* scale columns */
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const float *srow = scale + (i / 128) * sc;
        const uint8_t *wr = w + i * cols;
        float *o = out + i * cols;
        for (int64_t j = 0; j < cols; j++) o[j] = lut[wr[j]] * srow[j / 128];
    }
}

void ds4_dequant_fp4_row32(const uint8_t *packed, const float *scale, int64_t rows, int64_t cols, float *out) {
    float lut[16];
    for (int i = 0; i < 16; i++) lut[i] = ds4_e2m1_to_f32((uint8_t)i);
    int64_t half = cols / 2, sc = (cols + 31) / 32;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; i++) {
        const uint8_t *pr = packed + i * half;
        const float *srow = scale + i * sc;
        float *o = out + i * cols;
        for (int64_t k = 0; k < half; k++) {
            o[2 * k] = lut[pr[k] & 15] * srow[(2 * k) / 32];
            o[2 * k + 1] = lut[pr[k] >> 4] * srow[(2 * k + 1) / 32];
        }
    }
}

/* Scale tensor -> float [n]. */
static ds4_status read_scales(const ds4_st_file *sf, const ds4_st_entry *se, float *s) {
    const uint8_t *src = ds4_st_bytes(sf, se);
    int64_t n = ds4_st_entry_numel(se);
    switch (se->dtype) {
    case DS4_F8_E8M0:
        for (int64_t i = 0; i < n; i++) s[i] = ds4_e8m0_to_f32(src[i]);
        return DS4_OK;
    case DS4_F32:
        memcpy(s, src, (size_t)n * 4);
        return DS4_OK;
    case DS4_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            s[i] = ds4_bf16_to_f32(h);
        }
        return DS4_OK;
    default:
        return ds4_fail(DS4_ERR_SHAPE, "%s: scale tensor '%s' has dtype %s, expected F8_E8M0, F32 or BF16", ds4_st_path(sf),
                        se->name, ds4_dtype_name(se->dtype));
    }
}

ds4_status ds4_st_read_dequant(const ds4_st_file *wf, const ds4_st_entry *we, const ds4_st_file *sf,
                               const ds4_st_entry *se, int ndim, const int64_t *shape, float *out) {
    const char *wp = ds4_st_path(wf);
    char b1[128], b2[128];
    if (ndim != 2)
        return ds4_fail(DS4_ERR_SHAPE, "%s: quantized tensor '%s' requested with shape %s; only 2-D weights are quantized", wp,
                        we->name, ds4_dims_str(ndim, shape, b1, sizeof b1));
    int64_t rows = shape[0], cols = shape[1];
    int64_t want_scale[2];
    if (we->dtype == DS4_F8_E4M3) {
        DS4_TRY(ds4_st_check_shape(wf, we, 2, shape));
        want_scale[0] = (rows + 127) / 128;
        want_scale[1] = (cols + 127) / 128;
    } else if (we->dtype == DS4_I8) {
        int64_t packed[2] = {rows, cols / 2};
        if (cols % 2 != 0 || we->ndim != 2 || we->shape[0] != packed[0] || we->shape[1] != packed[1])
            return ds4_fail(DS4_ERR_SHAPE, "%s: FP4 tensor '%s' is stored as %s, expected %s (two E2M1 per byte of logical %s)", wp,
                            we->name, ds4_dims_str(we->ndim, we->shape, b1, sizeof b1),
                            ds4_dims_str(2, packed, (char[128]){0}, 128), ds4_dims_str(2, shape, b2, sizeof b2));
        want_scale[0] = rows;
        want_scale[1] = (cols + 31) / 32;
    } else
        return ds4_fail(DS4_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s, which has no dequantization (expected F8_E4M3 or I8/FP4)",
                        wp, we->name, ds4_dtype_name(we->dtype));
    if (se->ndim != 2 || se->shape[0] != want_scale[0] || se->shape[1] != want_scale[1])
        return ds4_fail(DS4_ERR_SHAPE, "%s: scale tensor '%s' of '%s' has shape %s, expected %s", ds4_st_path(sf), se->name,
                        we->name, ds4_dims_str(se->ndim, se->shape, b1, sizeof b1), ds4_dims_str(2, want_scale, b2, sizeof b2));
    float *s = ds4_alloc(DS4_MEM_WORK, (size_t)(want_scale[0] * want_scale[1]) * sizeof(float));
    if (!s) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the scales of '%s'", wp, we->name);
    ds4_status st = read_scales(sf, se, s);
    if (st == DS4_OK) {
        if (we->dtype == DS4_F8_E4M3) ds4_dequant_fp8_block(ds4_st_bytes(wf, we), s, rows, cols, out);
        else ds4_dequant_fp4_row32(ds4_st_bytes(wf, we), s, rows, cols, out);
    }
    ds4_free(s);
    return st;
}
