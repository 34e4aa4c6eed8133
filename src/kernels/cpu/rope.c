/* RoPE (§4.1): YaRN-corrected frequencies, the cos/sin table, and the rotation in float
 * (cpu_<op>, cpu.h) and double (kernels_f64.h). */
#include <math.h>

#include "ds4/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define ROPE_PAR_MIN ((int64_t)1 << 15) /* below this many rotated elements, one thread */

/* The rope dim index at which frequency i completes `nrot` turns over original_seq_len positions,
 * solved from 2π·nrot = L·base^(−2i/rd):  i = rd·ln(L / (nrot·2π)) / (2·ln base). */
static double find_correction_dim(double nrot, int64_t rd, double base, int64_t original_seq_len) {
    return (double)rd * log((double)original_seq_len / (nrot * 2.0 * M_PI)) / (2.0 * log(base));
}

/* θ_i = base^(−2i/rd), i < rd/2. YaRN (original_seq_len > 0): frequencies below the `low` dim keep
 * θ, above `high` become θ/factor, linear ramp between. */
void rope_freqs(double *theta, int64_t rd, double base, double factor, int64_t original_seq_len, double beta_fast,
                double beta_slow) {
    int64_t half = rd / 2;
    for (int64_t i = 0; i < half; i++) theta[i] = pow(base, -(double)(2 * i) / (double)rd);
    if (original_seq_len <= 0) return;
    double low = floor(find_correction_dim(beta_fast, rd, base, original_seq_len));
    double high = ceil(find_correction_dim(beta_slow, rd, base, original_seq_len));
    if (low < 0) low = 0;
    if (high > (double)(rd - 1)) high = (double)(rd - 1);
    if (low == high) high += 0.001; /* avoid a zero-width ramp */
    for (int64_t i = 0; i < half; i++) {
        double ramp = ((double)i - low) / (high - low);
        ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
        double smooth = 1.0 - ramp;
        theta[i] = theta[i] / factor * (1.0 - smooth) + theta[i] * smooth;
    }
}

/* cos/sin: [max_pos, rd/2], angle pos·θ_i in double, stored as float. */
bool rope_table_init(ds4_rope *r, int64_t rd, int64_t max_pos, double base, double factor,
                     int64_t original_seq_len, double beta_fast, double beta_slow) {
    r->rd = rd;
    r->max_pos = max_pos;
    r->cos = r->sin = NULL;
    int64_t half = rd / 2;
    if (rd <= 0 || rd % 2 != 0 || max_pos <= 0) {
        ds4_fail(DS4_ERR_ARG, "rope_table_init: rd %lld must be even and > 0, max_pos %lld > 0", (long long)rd,
                 (long long)max_pos);
        return false;
    }
    if (!ds4_shape_fits(2, (const int64_t[]){max_pos, half}, sizeof(float), NULL)) { /* a length from a caller's input */
        ds4_fail(DS4_ERR_ARG, "rope_table_init: %lld positions x %lld frequencies overflow", (long long)max_pos, (long long)half);
        return false;
    }
    double *theta = ds4_alloc(DS4_MEM_OTHER, (size_t)half * sizeof(double)); /* real even in a plan */
    r->cos = ds4_alloc(DS4_MEM_OTHER, (size_t)(max_pos * half) * sizeof(float));
    r->sin = ds4_alloc(DS4_MEM_OTHER, (size_t)(max_pos * half) * sizeof(float));
    if (!theta || !r->cos || !r->sin) {
        ds4_free(theta);
        rope_table_free(r);
        return false;
    }
    rope_freqs(theta, rd, base, factor, original_seq_len, beta_fast, beta_slow);
    for (int64_t p = 0; p < max_pos; p++)
        for (int64_t i = 0; i < half; i++) {
            double a = (double)p * theta[i];
            r->cos[p * half + i] = (float)cos(a);
            r->sin[p * half + i] = (float)sin(a);
        }
    ds4_free(theta);
    return true;
}

void rope_table_free(ds4_rope *r) {
    ds4_free(r->cos);
    ds4_free(r->sin);
    r->cos = r->sin = NULL;
}

#define KERNEL_TEMPLATE "rope.inc"
#include "twin.h"
