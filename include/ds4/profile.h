/* The kernel profile: time per op of the kernel table (src/kernels/ops.def), opt-in. When on, every op
 * call a real context makes (the generated wrappers, src/kernels/kernels.h) is timed with a monotonic clock
 * and added to its op's calls, seconds and estimated FLOPs; off (the default) it costs one predictable
 * branch per call. Timing never changes what an op computes. The counters are updated atomically, but the
 * times of calls made at once from several threads overlap (the model calls the ops from one thread).
 * docs/benchmarking.md shows a profile of a step. */
#ifndef DS4_PUBLIC_PROFILE_H
#define DS4_PUBLIC_PROFILE_H

#include <stdio.h>

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* On or off from now on. Counters are kept while off: ds4_profile_reset clears them. */
void ds4_profile_enable(bool on);
bool ds4_profile_enabled(void);
void ds4_profile_reset(void);

/* One op's totals since the last reset. flops: the op's arithmetic estimated from its arguments (2 per
 * multiply-add of its GEMM-like products: the GEMMs, linear layers, routed experts, sparse attention, the
 * indexer and its KL); 0 for ops whose FLOPs are not counted. */
typedef struct {
    const char *name; /* the op's name in ops.def */
    int64_t calls;
    double seconds;
    double flops;
} ds4_profile_op;
int ds4_profile_op_count(void);       /* entries of ops.def */
ds4_profile_op ds4_profile_get(int i); /* i < ds4_profile_op_count(), in ops.def order */

/* A markdown table of the ops that ran, slowest first: calls, ms and GFLOP per step, GFLOP/s, share of the
 * step (the ops under 0.1% of it share one row); then the ops' total and the rest of the step (what runs
 * outside the ops: the optimizer, clipping, host code). wall_seconds: the wall time of the `steps`
 * profiled steps together. */
void ds4_profile_print(FILE *f, double wall_seconds, int64_t steps);

#ifdef __cplusplus
}
#endif
#endif
