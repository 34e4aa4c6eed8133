/* memplan: the peak memory of one training step, by category, without running it. The same code
 * path as a real step runs in shape-only mode (allocations counted, no data, no arithmetic), so
 * the prediction equals the measured peak of a real step byte for byte (tested on small configs). */
#ifndef DS4_MEMPLAN_H
#define DS4_MEMPLAN_H

#include "ds4/config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int64_t peak[DS4_MEM_NCAT]; /* peak bytes of each category during the step */
    int64_t peak_total;         /* peak of the sum over categories */
    int64_t after_step;         /* bytes live after the update (params, grads, optimizer state, ...) */
    double seconds;             /* wall time of the run */
} ds4_step_memory;

/* One training step — model creation, AdamW state, forward + backward of a [B, T] micro-batch under
 * the release masks (NULL: no recompute), gradient clipping, optimizer update — measured with the
 * allocator's counters. shape_only = true: memplan; false: a real step on random weights. */
ds4_status ds4_step_memory_run(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                               ds4_step_memory *out);

/* The same step on one rank of FSDP + expert parallelism (ds4/dist.h): comm is the world (a real run,
 * every rank calls it) or a plan communicator (ds4_comm_plan: shape_only must be true; routing is
 * then balanced, as force_balance makes a real run). Micro-batch [B, T] per rank. */
typedef struct ds4_comm ds4_comm;
ds4_status ds4_step_memory_run_dist(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                                    ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out);

#ifdef __cplusplus
}
#endif
#endif
