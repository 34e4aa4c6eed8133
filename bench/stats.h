/* The statistics every benchmark reports (header-only: each bench is one program). */
#ifndef DS4_BENCH_STATS_H
#define DS4_BENCH_STATS_H

#define BENCH_MAX_SAMPLES 256

/* Median of t [n] (1 <= n <= BENCH_MAX_SAMPLES; the mean of the middle two for even n); t unchanged. */
static inline double bench_median(const double *t, int n) {
    double s[BENCH_MAX_SAMPLES];
    if (n < 1) return 0;
    if (n > BENCH_MAX_SAMPLES) n = BENCH_MAX_SAMPLES;
    for (int i = 0; i < n; i++) { /* insertion sort of the copy: n is a handful of runs */
        double v = t[i];
        int j = i;
        for (; j > 0 && s[j - 1] > v; j--) s[j] = s[j - 1];
        s[j] = v;
    }
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
}

#endif
