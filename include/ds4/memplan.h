/* memplan: the peak memory of one training step, by category, without running it. The trainer's own step
 * (ds4_train_step, ds4/trainer.h) runs on a state opened under a plan context (ds4_exec: allocations
 * counted, no data, no arithmetic), so the prediction equals the measured peak of a real step byte for
 * byte (tested on small configs). src/train/memplan.c. */
#ifndef DS4_MEMPLAN_H
#define DS4_MEMPLAN_H

#include "ds4/config.h"
#include "ds4/trainer.h"

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
    /* what stays in memory between steps, by category (their sum is after_step), and the parameter elements
     * this process holds (the whole model, or its FSDP + EP shard with the shard's padding): resident bytes
     * per parameter = after_step / params_held */
    int64_t resident[DS4_MEM_NCAT];
    int64_t params_held;
} ds4_step_memory;

/* What the step runs under (zero: no recompute, no offload). */
typedef struct {
    const uint32_t *masks;    /* per-layer recompute release masks (ds4/recompute.h); NULL: none */
    bool swap_optimizer;      /* --swap-optimizer: AdamW state in the offload store between updates */
    bool swap_layer_input;    /* --swap-layer-input: layer input streams in the store until their backward */
    const char *offload_dir;  /* the store's directory; NULL: $TMPDIR or /tmp (no file in a plan) */
    size_t swap_chunk_bytes;  /* optimizer update buffer; 0: DS4_ADAMW_SWAP_CHUNK */
    bool muon;                /* Muon for the Muon group (ds4/train.h, DeepSeek-V4's settings), AdamW for the rest */
    bool bf16;                /* bf16 mixed precision (training.mixed_precision_param = "bfloat16"); implies bf16 GEMMs */
    ds4_matmul_precision matmul_precision; /* of the GEMMs on fp32 weights (training.matmul_precision) */
    const struct ds4_kernel_backend *backend; /* the backend planned for (its plan twin runs); NULL: cpu */
    int prefetch_depth;       /* FSDP: communication in flight while computing (ds4/dist.h); 0: blocking */
    int64_t micro_batches;    /* micro-batches of the step, all the same ids (0: one) */
    bool moe_fb_overlap;      /* --moe-fb-overlap: forward(i) beside backward(i - 1), two passes alive (>= 2
                               * micro_batches) */
} ds4_step_opts;

/* One training step — the state opened (model, AdamW state, offload store), ds4_train_step on one [B, T]
 * micro-batch under the release masks (NULL: no recompute): forward + backward, gradient scaling, clipping,
 * the AdamW update, the router bias rule — measured with the allocator's counters (memory and offload
 * tiers). plan = true: memplan; false: a real step on random weights. Who held each category at its
 * peak is read after it with ds4_mem_owners_get (ds4/core.h), until the next step measured. */
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

/* The plan of world rank `rank` of a pipeline of the layout pp (pp->pp >= 2 stages) on world = pp x fsdp
 * ranks (rank = stage * fsdp + data rank): its stage's state (the groups of its chunks, ds4_train_state_opts
 * .pipeline; fsdp > 1: their FSDP shard over the stage's data ranks, with EP of degree ep inside that group)
 * and opts->micro_batches micro-batches of [B, T] per data rank (0: pp of them) through its schedule
 * (ds4_pp_run_rank) on a plan communicator of world ranks (balanced routing); opts->masks: the recompute masks
 * of the layout's priorities. */
ds4_status ds4_step_memory_run_stage(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                     const ds4_pp_cfg *pp, int world, int ep, int rank, ds4_step_memory *out);

/* The first step of the run `run` describes (`ds4 train --config`'s description: model, batch, sequence,
 * precision, device, optimizer, recompute, offload, parallel settings, training.csa_dense_steps), on one
 * rank of comm: the world (every rank calls it) or a plan communicator (ds4_comm_plan: plan must be true;
 * routing balanced). run is resolved and checked for comm's world and the model as `ds4 train` does it
 * (ds4_run_model), and planned through the same builders the trainer runs its steps with. A run with
 * parallel.pp > 1 is one stage of its pipeline: comm has pp x fsdp ranks (a plan communicator, or the world
 * under mpirun; rank = stage * fsdp + data rank), and the step is that rank's state (its stage's groups; fsdp
 * > 1: their FSDP shard over the stage's data ranks, parallel.ep inside that group) and its schedule
 * (ds4_pp_run_rank), with balanced routing in a real step too (as its plan routes). */
ds4_status ds4_step_memory_of_run(ds4_train_cfg *run, ds4_comm *comm, bool plan, ds4_step_memory *out);

/* ------------------------------------------------------------------ a device budget
 * Whether a planned step fits a device of device_bytes: what the device holds is the memory tier (the
 * offload tier is the host's), so the step needs its peak_total. margin = device_bytes - peak_total: the
 * bytes left free at the peak, negative when the step is that many bytes over. */
typedef struct {
    int64_t need;   /* peak_total */
    int64_t margin; /* device_bytes - need */
    bool fits;      /* margin >= 0 */
} ds4_device_fit;
ds4_device_fit ds4_step_memory_fit(const ds4_step_memory *m, int64_t device_bytes);

/* ------------------------------------------------------------------ the policies to compare
 * The recompute settings of the RFC's acceptance table (off, csa, mhc, norm, csa+mhc, csa+mhc+norm, full
 * uniform recompute of every layer), each alone, with --swap-optimizer, with --swap-layer-input and with
 * both, in that order (the first DS4_MEMPLAN_RECOMPUTE_POLICIES entries have no offload). `ds4 memplan
 * --policies` and bench/recompute plan this one list. */
typedef struct {
    const char *name;           /* "csa+mhc", "full +swap-opt", ... */
    const char *const *flags;   /* the recompute flags as on the command line, NULL-terminated */
    bool swap_optimizer, swap_layer_input;
} ds4_memplan_policy;
#define DS4_MEMPLAN_RECOMPUTE_POLICIES 7
int ds4_memplan_policy_count(void);
const ds4_memplan_policy *ds4_memplan_policy_at(int i);
/* The step options of policy p on config c: masks [DS4_MAX_LAYERS] filled from its flags, so->masks set
 * (NULL for off) and its swap options; the other fields of *so (muon, ...) are left as they are. */
ds4_status ds4_memplan_policy_opts(const ds4_memplan_policy *p, const ds4_config *c, uint32_t *masks,
                                   ds4_step_opts *so);
/* The same on a pipeline: the priorities of pipe's layout (its pipe and per_pp_rank fields; NULL: none). */
ds4_status ds4_memplan_policy_opts_pipe(const ds4_memplan_policy *p, const ds4_config *c,
                                        const ds4_recompute_cfg *pipe, uint32_t *masks, ds4_step_opts *so);

#ifdef __cplusplus
}
#endif
#endif
