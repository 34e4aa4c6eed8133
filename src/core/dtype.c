/* Element types as safetensors names them, and the 16-bit float conversions. */
#include "ds4/core.h"

#include <math.h>
#include <string.h>

static const struct {
    const char *name;
    size_t size;
} k_dtypes[DS4_DTYPE_COUNT] = {
    [DS4_F32] = {"F32", 4},      [DS4_BF16] = {"BF16", 2},       [DS4_F16] = {"F16", 2},
    [DS4_F64] = {"F64", 8},      [DS4_I8] = {"I8", 1},           [DS4_U8] = {"U8", 1},
    [DS4_I16] = {"I16", 2},      [DS4_I32] = {"I32", 4},         [DS4_I64] = {"I64", 8},
    [DS4_BOOL] = {"BOOL", 1},    [DS4_F8_E4M3] = {"F8_E4M3", 1}, [DS4_F8_E5M2] = {"F8_E5M2", 1},
    [DS4_F8_E8M0] = {"F8_E8M0", 1},
};

const char *ds4_dtype_name(ds4_dtype t) {
    return (unsigned)t < DS4_DTYPE_COUNT ? k_dtypes[t].name : "?";
}

size_t ds4_dtype_size(ds4_dtype t) { return (unsigned)t < DS4_DTYPE_COUNT ? k_dtypes[t].size : 0; }

bool ds4_dtype_from_name(const char *s, ds4_dtype *out) {
    for (int i = 0; i < DS4_DTYPE_COUNT; i++)
        if (strcmp(s, k_dtypes[i].name) == 0) {
            *out = (ds4_dtype)i;
            return true;
        }
    return false;
}

float ds4_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t ds4_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float ds4_f16_to_f32(uint16_t h) {
    uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = ldexpf((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = ldexpf((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
