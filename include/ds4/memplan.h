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
    /* the offload tier (ds4/offload.h): peak bytes in the store by category and in all, and after the step */
    int64_t offload_peak[DS4_MEM_NCAT];
    int64_t offload_peak_total;
    int64_t offload_after_step;
} ds4_step_memory;

/* What the step runs under (zero: no recompute, no offload). */
typedef struct {
    const uint32_t *masks;    /* per-layer recompute release masks (ds4/recompute.h); NULL: none */
    bool swap_optimizer;      /* --swap-optimizer: AdamW state in the offload store between updates */
    bool swap_layer_input;    /* --swap-layer-input: layer input streams in the store until their backward */
    const char *offload_dir;  /* the store's directory; NULL: $TMPDIR or /tmp (no file when shape-only) */
    size_t swap_chunk_bytes;  /* optimizer update buffer; 0: DS4_ADAMW_SWAP_CHUNK */
} ds4_step_opts;

/* One training step — model creation, AdamW state, forward + backward of a [B, T] micro-batch under
 * the release masks (NULL: no recompute), gradient clipping, optimizer update — measured with the
 * allocator's counters (memory and offload tiers). shape_only = true: memplan; false: a real step on random weights. */
ds4_status ds4_step_memory_run(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                               ds4_step_memory *out);
/* The same under recompute and offload options. */
ds4_status ds4_step_memory_run_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                    bool shape_only, ds4_step_memory *out);

/* The same step on one rank of FSDP + expert parallelism (ds4/dist.h): comm is the world (a real run,
 * every rank calls it) or a plan communicator (ds4_comm_plan: shape_only must be true; routing is
 * then balanced, as force_balance makes a real run). Micro-batch [B, T] per rank. */
typedef struct ds4_comm ds4_comm;
ds4_status ds4_step_memory_run_dist(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                                    ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out);
ds4_status ds4_step_memory_run_dist_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                         bool shape_only, ds4_comm *comm, int ep, bool force_balance,
                                         ds4_step_memory *out);

#ifdef __cplusplus
}
#endif
#endif
