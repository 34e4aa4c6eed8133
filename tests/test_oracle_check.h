/* Shared helpers of the oracle tests (tests/test_oracle_*.c): inputs in float and the same values in
 * double, an element-wise check of a float kernel against a double oracle under a per-element bound,
 * and central finite differences of an oracle's own forward.
 *
 * Tolerances. The production kernels round in float32, whose unit roundoff is U = 2^-24; the oracles
 * run in double on the same (exactly widened) inputs, so their own error (2^-53 per operation) is
 * ~5e8 times smaller and is covered by the +1 or +2 added to each count of rounding steps below.
 * Each test derives, per element, a bound  tol = (number of float roundings on the path)·U·(the sum
 * of the absolute values of the terms on that path), the classic a-priori bound |fl(Σ x_i) − Σ x_i|
 * <= γ_k·Σ|x_i|, γ_k = k·U/(1 − k·U), which holds for any summation order (blocked, vector lanes,
 * FMA or not). glibc's expf/logf/sqrtf are within 1 ulp (<= 2U relative), counted as 2 roundings. */
#ifndef DS4_TEST_ORACLE_CHECK_H
#define DS4_TEST_ORACLE_CHECK_H

#include <stdint.h>

#include "test.h"

#define U_F32 0x1p-24 /* float32 unit roundoff */

/* Finite differences: central, step FD_H, on double oracles. Error of a central difference:
 * h²/6·|f'''| (~1e-13 here) + 2^-53·|f|/h (~1e-10·|f|): for objectives and gradients of order 1-100,
 * the relative error ‖analytic − FD‖/‖FD‖ is below ~1e-8; FD_TOL = 1e-6 leaves margin for kinks'
 * neighbourhoods while a wrong derivative (a dropped term, a sign) gives an error of order 1e-2..1. */
#define FD_H 1e-6
#define FD_TOL 1e-6

static inline double *oc_dalloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }
static inline float *oc_falloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

/* A float input in [-amp, amp) and its exact double copy. */
typedef struct {
    float *f;
    double *d;
    int64_t n;
} oc_buf;

static inline oc_buf oc_rand(int64_t n, unsigned seed, float amp) {
    oc_buf b = {oc_falloc(n), oc_dalloc(n), n};
    t_fill(b.f, n, seed, amp);
    for (int64_t i = 0; i < n; i++) b.d[i] = b.f[i];
    return b;
}
static inline oc_buf oc_zero(int64_t n) { return (oc_buf){oc_falloc(n), oc_dalloc(n), n}; }
/* After editing b.f: the double copy follows. */
static inline void oc_sync(oc_buf *b) {
    for (int64_t i = 0; i < b->n; i++) b->d[i] = b->f[i];
}
static inline void oc_free(oc_buf *b) { free(b->f), free(b->d), b->f = NULL, b->d = NULL; }

static inline double oc_absmax_d(const double *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

/* |got_i − want_i| <= tol_i for every i (tol == NULL: exact equality). On failure, the worst element. */
static inline void oc_check(const char *what, const float *got, const double *want, const double *tol, int64_t n) {
    int64_t bad = 0, worst = -1;
    double worst_ratio = 0, used = 0; /* used: the largest err/bound among passing elements */
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]), t = tol ? tol[i] : 0;
        if (err <= t && t > 0) used = fmax(used, err / t);
        if (!(err <= t)) {
            bad++;
            double ratio = t > 0 ? err / t : INFINITY;
            if (worst < 0 || ratio > worst_ratio || ratio != ratio) worst = i, worst_ratio = ratio;
        }
    }
    CHECK(bad == 0, "%s: %lld of %lld elements off; worst [%lld]: got %.9g, oracle %.9g, bound %.3g", what,
          (long long)bad, (long long)n, (long long)worst, worst >= 0 ? (double)got[worst] : 0.0,
          worst >= 0 ? want[worst] : 0.0, worst >= 0 && tol ? tol[worst] : 0.0);
    if (getenv("DS4_TEST_VERBOSE")) t_note("  %s: largest error / bound = %.3g", what, used);
}

/* The same with one bound for every element. */
static inline void oc_check_all(const char *what, const float *got, const double *want, double tol, int64_t n) {
    double *t = oc_dalloc(n);
    for (int64_t i = 0; i < n; i++) t[i] = tol;
    oc_check(what, got, want, t, n);
    free(t);
}

/* Central differences of f(ctx) over x[0..n), compared with the analytic gradient `grad`. */
typedef double (*oc_objective)(void *ctx);
static inline void oc_fd_check(const char *what, oc_objective f, void *ctx, double *x, int64_t n,
                               const double *grad) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double xi = x[i];
        x[i] = xi + FD_H;
        double fp = f(ctx);
        x[i] = xi - FD_H;
        double fm = f(ctx);
        x[i] = xi;
        double fd = (fp - fm) / (2 * FD_H);
        num += (grad[i] - fd) * (grad[i] - fd);
        den += fd * fd;
    }
    double e = den > 0 ? sqrt(num / den) : sqrt(num);
    CHECK(den > 0, "%s: the finite-difference gradient is 0, the check proves nothing", what);
    CHECK(e <= FD_TOL, "%s: oracle backward vs finite differences of its forward: rel err %.3g > %g", what, e,
          FD_TOL);
}

/* Σ r_i·y_i: the scalar whose gradient a backward with dout = r computes. */
static inline double oc_dot(const double *r, const double *y, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += r[i] * y[i];
    return s;
}

#endif
