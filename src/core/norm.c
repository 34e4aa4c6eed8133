/* The per-element ops over flat fp32 arrays that the step runs above the model: the gradient norm, clipping
 * and the mean over micro-batches, the finite check, and the optimizer updates (AdamW, Muon's momentum and
 * apply). One place, each a function of plain pointers and explicit sizes that walks no struct, so a
 * backend can take them over as they are. The optimizers (src/train/optim.c, muon.c) walk their runs of
 * parameters and call these on each run. */
#include "ds4/core.h"

#include <math.h>
#include <string.h>

double ds4_sumsq(const float *x, int64_t n) {
    /* fixed-size chunks summed in order: the same bits for any thread count. The partial sums of up to
     * 256 chunks at a time sit on the stack, so the sum allocates nothing and cannot fail. */
    const int64_t chunk = 1 << 16, nchunks = (n + chunk - 1) / chunk;
    double part[256], total = 0;
    for (int64_t c0 = 0; c0 < nchunks; c0 += 256) {
        const int64_t nc = nchunks - c0 < 256 ? nchunks - c0 : 256;
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < nc; k++) {
            int64_t c = c0 + k, end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
            double s = 0;
            for (int64_t i = c * chunk; i < end; i++) s += (double)x[i] * x[i];
            part[k] = s;
        }
        for (int64_t k = 0; k < nc; k++) total += part[k];
    }
    return total;
}

/* An exact Σ x² of floats. x = mant·2^e with mant < 2^24, so x² = mant²·2^(2e) with mant² < 2^48; it is
 * added into a fixed-point number of 32-bit limbs whose lowest bit is 2^-298 (the square of the smallest
 * subnormal). Integer addition is associative: the sum does not depend on the order or on how the
 * elements are split over threads and ranks. */
static void sq_add(ds4_sumsq_acc *a, float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    uint32_t e = (bits >> 23) & 0xffu, frac = bits & 0x7fffffu;
    if (e == 255) {
        a->limb[DS4_SUMSQ_LIMBS]++;
        return;
    }
    uint64_t mant = e ? (frac | 0x800000u) : frac, sq = mant * mant;
    int64_t pos = 2 * ((e ? (int64_t)e : 1) - 150) + 298; /* bit of x²'s lowest mantissa bit, in [0, 506] */
    int64_t b = pos / 32, s = pos % 32;
    uint64_t lo = (sq & 0xffffffffu) << s, hi = (sq >> 32) << s; /* lo < 2^64, hi < 2^47 */
    a->limb[b] += (int64_t)(lo & 0xffffffffu);
    a->limb[b + 1] += (int64_t)((lo >> 32) + (hi & 0xffffffffu));
    a->limb[b + 2] += (int64_t)(hi >> 32);
}

/* Carries so that every limb but the top one is in [0, 2^32): a unique form of the same number. */
void ds4_sumsq_normalize(ds4_sumsq_acc *a) {
    for (int i = 0; i + 1 < DS4_SUMSQ_LIMBS; i++) {
        a->limb[i + 1] += a->limb[i] >> 32;
        a->limb[i] &= 0xffffffff;
    }
}

static void sq_merge(ds4_sumsq_acc *a, const ds4_sumsq_acc *b) {
    for (int i = 0; i <= DS4_SUMSQ_LIMBS; i++) a->limb[i] += b->limb[i];
}

/* Σ x² over x [n]: chunks of 2^28 elements (each limb gains < 2^34 per element: no overflow), merged in
 * any order. */
void ds4_sumsq_exact(const float *x, int64_t n, ds4_sumsq_acc *out) {
    memset(out, 0, sizeof *out);
    const int64_t chunk = (int64_t)1 << 28;
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        int64_t c1 = c0 + chunk < n ? c0 + chunk : n;
#pragma omp parallel
        {
            ds4_sumsq_acc t;
            memset(&t, 0, sizeof t);
#pragma omp for schedule(static)
            for (int64_t i = c0; i < c1; i++) sq_add(&t, x[i]);
            ds4_sumsq_normalize(&t);
#pragma omp critical(ds4_sq_merge)
            sq_merge(out, &t);
        }
        ds4_sumsq_normalize(out);
    }
}

double ds4_sumsq_value(const ds4_sumsq_acc *a) {
    double s = 0; /* from the top limb down: one rounding sequence for the one normalized form */
    for (int i = DS4_SUMSQ_LIMBS - 1; i >= 0; i--) s += ldexp((double)a->limb[i], 32 * i - 298);
    return a->limb[DS4_SUMSQ_LIMBS] ? NAN : s;
}

void ds4_scale_f32(float *x, int64_t n, float s) {
#pragma omp parallel for if (n >= 1 << 15) schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

bool ds4_clip_factor(double max_norm, double norm, float *s) {
    if (!(max_norm > 0 && norm > max_norm)) return false;
    *s = (float)(max_norm / (norm + 1e-6));
    return true;
}

void ds4_clip_scale(float *g, int64_t n, double max_norm, double norm) {
    float s;
    if (ds4_clip_factor(max_norm, norm, &s)) ds4_scale_f32(g, n, s);
}

int64_t ds4_count_nonfinite(const float *x, int64_t n) {
    int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
    for (int64_t i = 0; i < n; i++) bad += !isfinite(x[i]);
    return bad;
}

void ds4_adamw_update(int64_t n, float *w, const float *g, float *m, float *v, ds4_adamw_consts k, bool decay) {
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        m[i] = k.b1 * m[i] + k.omb1 * gi;
        v[i] = k.b2 * v[i] + k.omb2 * gi * gi;
        float denom = sqrtf(v[i]) * k.inv_sqrt_bc2 + k.eps;
        if (decay) w[i] -= k.decay * w[i];
        w[i] -= k.step_size * m[i] / denom;
    }
}

void ds4_muon_momentum(int64_t n, const float *g, float *mom, float *u, float mu, bool nesterov) {
    for (int64_t i = 0; i < n; i++) {
        mom[i] = mu * mom[i] + g[i];
        u[i] = nesterov ? g[i] + mu * mom[i] : mom[i];
    }
}

void ds4_muon_apply(int64_t n, float *w, const float *o, float decay, float step) {
    for (int64_t i = 0; i < n; i++) {
        w[i] -= decay * w[i];
        w[i] -= step * o[i];
    }
}
