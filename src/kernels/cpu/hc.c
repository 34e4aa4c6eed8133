/* mHC kernels (§3): hc_split_sinkhorn, hc_pre, hc_post, hc_head, forward and backward.
 * The code is in hc.inc, compiled here in float (cpu_<op>, cpu.h) and in double (`_f64` twins for
 * finite-difference tests, kernels_f64.h). */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

enum {
    HC_LANES = 16,          /* accumulator lanes of a dot product */
    HC_COLS = 16,           /* dfn tile of the backward: columns (one AVX-512 vector) */
    HC_ROWS = 8,            /* and rows */
    HC_CHUNK_REALS = 16384, /* per-chunk stack scratch of the backward, in reals */
};

/* Number of Sinkhorn normalisations: one column step, then (iters-1) × (row, column).
 * Step s is a row step iff s is odd. */
static inline int64_t hc_sk_steps(int64_t iters) { return 1 + 2 * (iters > 1 ? iters - 1 : 0); }

/* Backward scratch per token: pre [n], gm [M], dbase part [M], dscale part [3]; tokens per chunk. */
static inline int64_t hc_ws_width(int64_t n, int64_t M) { return n + 2 * M + 3; }
static inline int64_t hc_chunk_tokens(int64_t W) { return HC_CHUNK_REALS / W > 0 ? HC_CHUNK_REALS / W : 1; }

/* Elementwise loops (no reductions): vectorised without changing any result bit. */
#define HC_SIMD _Pragma("omp simd")
#define HC_INLINE static inline __attribute__((always_inline))

#define KERNEL_TEMPLATE "hc.inc"
#include "twin.h"
