/* memplan: the peak memory of one training step, by category, without running it. The trainer's own step
 * (ds4_train_step, ds4/trainer.h) runs on a state opened under a plan context (ds4_exec: allocations
 * counted, no data, no arithmetic), so the prediction equals the measured peak of a real step byte for
 * byte (tested on small configs). src/train/memplan.c. */
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
    const char *offload_dir;  /* the store's directory; NULL: $TMPDIR or /tmp (no file in a plan) */
    size_t swap_chunk_bytes;  /* optimizer update buffer; 0: DS4_ADAMW_SWAP_CHUNK */
    bool muon;                /* Muon for the Muon group (ds4/train.h, DeepSeek-V4's settings), AdamW for the rest */
    int prefetch_depth;       /* FSDP: communication in flight while computing (ds4/dist.h); 0: blocking */
} ds4_step_opts;

/* One training step — the state opened (model, AdamW state, offload store), ds4_train_step on one [B, T]
 * micro-batch under the release masks (NULL: no recompute): forward + backward, gradient scaling, clipping,
 * the AdamW update, the router bias rule — measured with the allocator's counters (memory and offload
 * tiers). plan = true: memplan; false: a real step on random weights. */
ds4_status ds4_step_memory_run(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool plan,
                               ds4_step_memory *out);
/* The same under recompute and offload options. */
ds4_status ds4_step_memory_run_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts, bool plan,
                                    ds4_step_memory *out);

/* The same step on one rank of FSDP + expert parallelism (ds4/dist.h), also for one rank at ep 1: comm is
 * the world (a real run, every rank calls it; with plan = true its plan) or a plan communicator
 * (ds4_comm_plan: plan must be true; routing is then balanced, as force_balance makes a real run).
 * Micro-batch [B, T] per rank. */
typedef struct ds4_comm ds4_comm;
ds4_status ds4_step_memory_run_dist(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool plan,
                                    ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out);
ds4_status ds4_step_memory_run_dist_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                         bool plan, ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out);

#ifdef __cplusplus
}
#endif
#endif
