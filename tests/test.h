/* A small test harness: each test is a function; CHECK records a failure with file:line and goes on.
 * TEST_MAIN prints "<binary>: N passed, N failed" and exits non-zero when anything failed. */
#ifndef DS4_TEST_H
#define DS4_TEST_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <stdarg.h>

static int t_passed, t_failed, t_cur_failed;

static inline void t_note(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

/* The context of a kernel test: real (data and arithmetic) on the cpu backend. */
#define CPU_EXEC (&(const ds4_exec){.plan = false})

#define CHECK(cond, ...)                                               \
    do {                                                               \
        if (!(cond)) {                                                 \
            t_cur_failed = 1;                                          \
            fprintf(stderr, "  FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
            t_note(" " __VA_ARGS__);                                   \
        }                                                              \
    } while (0)

/* CHECK that two doubles agree to a relative tolerance (|a-b| <= tol·max(|a|,|b|,floor)). */
#define CHECK_CLOSE(a, b, tol, floor_)                                                    \
    do {                                                                                  \
        double ca_ = (a), cb_ = (b);                                                      \
        double cm_ = fmax(fmax(fabs(ca_), fabs(cb_)), (floor_));                          \
        CHECK(fabs(ca_ - cb_) <= (tol) * cm_, "%s = %.9g vs %s = %.9g (tol %g)", #a, ca_, #b, cb_, (double)(tol)); \
    } while (0)

#define RUN(fn)                                                  \
    do {                                                         \
        t_cur_failed = 0;                                        \
        fn();                                                    \
        if (t_cur_failed) {                                      \
            t_failed++;                                          \
            fprintf(stderr, "not ok %s\n", #fn);                 \
        } else {                                                 \
            t_passed++;                                          \
            if (getenv("DS4_TEST_VERBOSE")) fprintf(stderr, "ok %s\n", #fn); \
        }                                                        \
    } while (0)

#define TEST_MAIN_END(name)                                              \
    do {                                                                 \
        printf("%s: %d passed, %d failed\n", name, t_passed, t_failed);  \
        return t_failed ? 1 : 0;                                         \
    } while (0)

/* Max relative error ‖a−b‖/‖b‖ over n floats. */
static inline double t_rel_err(const float *a, const float *b, long n) {
    double num = 0, den = 0;
    for (long i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Deterministic pseudo-random fill in [-amp, amp). */
static inline void t_fill(float *x, long n, unsigned seed, float amp) {
    unsigned long s = seed * 2654435761u + 12345u;
    for (long i = 0; i < n; i++) {
        s = s * 6364136223846793005ul + 1442695040888963407ul;
        x[i] = amp * (2.0f * (float)((s >> 40) & 0xffffff) / 16777216.0f - 1.0f);
    }
}

#endif
