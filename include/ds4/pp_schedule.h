/* Pipeline schedules (docs/pipeline.md): the ordered actions of one pipeline rank for a step of m
 * micro-batches over pp stages of vpp virtual chunks each. Chunks are numbered in forward order, VPP-major
 * as in ds4/pipeline.h: global chunk k = vchunk · pp + rank. src/train/pp_schedule.c.
 *
 * vpp = 1: 1F1B (PipeDream-flush, Megatron's forward_backward_pipelining_without_interleaving): warm-up
 *   min(pp − rank − 1, m) forwards, then one forward and one backward in turn, then the cool-down backwards.
 * vpp > 1: Megatron's interleaved 1F1B (forward_backward_pipelining_with_interleaving): virtual micro-batch
 *   k runs chunk (k mod pp·vpp) / pp (the backward's counted from the last chunk) of micro-batch
 *   (k / (pp·vpp))·pp + k mod pp; warm-up (pp − rank − 1)·2 + (vpp − 1)·pp (all m·vpp when m = pp);
 *   m must be a multiple of pp.
 * Either way every chunk runs its forwards and its backwards in micro-batch order, so the gradient sums
 * into each parameter happen in one process's order. */
#ifndef DS4_PP_SCHEDULE_H
#define DS4_PP_SCHEDULE_H

#include "ds4/actstore.h"
#include "ds4/core.h"
#include "ds4/dist.h"
#include "ds4/model.h"
#include "ds4/pipeline.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { DS4_PP_FORWARD, DS4_PP_BACKWARD } ds4_pp_op;

/* One action. Forward of chunk k: its input stream X comes from chunk k − 1, its output goes to chunk k + 1.
 * Backward: the output stream's gradient comes from chunk k + 1, the input's goes to chunk k − 1. A side
 * with no chunk (the first chunk's input, the last chunk's output) is -1. */
typedef struct {
    ds4_pp_op op;
    int64_t vchunk;                /* virtual chunk on this rank, [0, vpp) */
    int64_t chunk;                 /* global chunk, vchunk · pp + rank */
    int64_t mb;                    /* micro-batch, [0, m) */
    int64_t from_rank, from_chunk; /* where the boundary tensor this action reads comes from; -1: none */
    int64_t to_rank, to_chunk;     /* where the boundary tensor it makes goes; -1: none */
} ds4_pp_action;

typedef struct {
    int64_t pp, vpp, m, rank;
    int64_t warmup; /* forwards before the first backward */
    int64_t n;      /* 2 · vpp · m */
    ds4_pp_action *a; /* [n] in execution order */
} ds4_pp_schedule;

/* The schedule of `rank`: 1F1B for vpp = 1, interleaved 1F1B for vpp > 1. Errors (one line): pp, vpp or m
 * below 1, a rank outside [0, pp), interleaving with m not a multiple of pp. */
ds4_status ds4_pp_schedule_make(int64_t pp, int64_t vpp, int64_t m, int64_t rank, ds4_pp_schedule *out);
void ds4_pp_schedule_free(ds4_pp_schedule *s);

/* Where the executor over MPI lets go of what a backward sends (its input's gradient to chunk k − 1; on the
 * last chunk with mtp, the MTP rows to rank 0: each a copy of the pass's buffer, counted as comm): at a fixed
 * point of the schedule, not when the send happens to complete, so what a rank holds is the same in every
 * run and in its plan. release [s->n]: for each backward of s that sends, the index of s's action before
 * which its sends are waited for and its copies freed, s->n for the end of the step; -1 for an action that
 * sends nothing. The point: the first action of the rank that starts, in the run of every rank's list with
 * unit costs (forward 1, backward 2, transfers free), strictly after each receiving action started. Every
 * wait then follows its receive's posting in that run, as every other dependency of the lists does, so the
 * waits add no cycle: no deadlock, whatever the actions cost; with those costs none of them blocks. */
ds4_status ds4_pp_send_release(const ds4_pp_schedule *s, bool mtp, int64_t *release);

/* ------------------------------------------------------------------ one process runs every rank
 * A step's micro-batches through the schedule of every pipeline rank of the layout, in one process, on one
 * model: each chunk a stage pass (ds4_stage_forward / ds4_stage_backward_rows) of its layers, its
 * embedding and head. The ranks' lists advance in turn, an action running once what it receives exists
 * (the previous chunk's stream, the next chunk's gradient), as blocking receives of a multi-process run
 * would let it; the head's chunk hands the MTP rows' gradient to the embedding's chunk (mtp_rows_out).
 * ACCUMULATES into the model's gradients (unscaled, as the micro-batches' backwards of ds4_train_step do);
 * *mean: the losses of each micro-batch (the head chunk's, every chunk's indexer KL, ds4_losses_combine)
 * / micro_batches, summed in micro-batch order; loads [n_layers + n_mtp_layers, n_routed_experts] (NULL: not
 * wanted): the routing counts added. src/train/pp_local.c. */
typedef struct {
    const ds4_pp_layout *layout;
    int64_t micro_batches, B, T;
    const int32_t *ids;         /* [micro_batches, B, T] */
    const ds4_pass_opts *opts;  /* every stage pass's (need_backward is set here) */
    /* NULL: every pass's store is opts->store. Else opts->store is ds4_act_store_of(policies), and with
     * policies->swap (--swap-layer-input) each micro-batch's passes get a store of their own: these recompute
     * masks and a ds4_act_swap of the micro-batch on policies->swap's offload tier, made by the executor for
     * the step (policies->swap itself holds nothing). A pipeline keeps several micro-batches of a layer in
     * flight, and a swap holds one entry a layer; a micro-batch's chunks on a rank hold disjoint layers. */
    const ds4_act_policies *policies;
    int64_t *passes_peak;       /* NULL, or set by ds4_pp_run_rank: the most passes this rank held at once */
    double *bubble;             /* NULL or [pp], out (ds4_pp_run_rank only): each rank's bubble, on every rank */
} ds4_pp_local_args;
/* *mean += micro-batch mb's losses (its loss and MTP loss sums, each layer's indexer KL) / M, in the order
 * ds4_train_step adds them: what both executors end with, so they give its bits. */
void ds4_pp_mean_add(const ds4_config *c, ds4_losses *mean, double loss, double mtp_loss, const double *kl, int64_t M);
ds4_status ds4_pp_run_local(ds4_model *m, const ds4_pp_local_args *a, ds4_losses *mean, int64_t *loads);

/* The same step over MPI, world = pp: rank r of pipe (pp ranks, pipe's rank = the pipeline rank) runs its own
 * list on m, a whole model of which it computes only its chunks (their layers' gradients, the embedding's on
 * rank 0 with the MTP rows received from the head's rank, the head's and MTP's on the last rank; every
 * other gradient stays as it was). Boundary tensors go by ds4_comm_isend / ds4_comm_irecv (a receive waits
 * where the list needs it; a forward's send completes before that pass's backward frees its stream; a
 * backward's pass is freed when it is done, what it sends copied into host buffers that go once their sends
 * have completed, tested after each later action, waited at the end of the step). *mean and loads as ds4_pp_run_local, the same bits on every rank
 * (each micro-batch's loss parts and the loads summed over the ranks in rank order, each part nonzero on one
 * rank only). Refused with one line: pipe not of pp ranks, parameter hooks (FSDP / EP inside a stage are
 * not built yet), a model outside host memory. a->bubble: each rank's idle share of the schedule, the
 * seconds it spent blocked in the waits of its receives and sends, and after its list until every rank is
 * done (a barrier), over the wall time from its first action to then (monotonic clock; gathered over pipe,
 * nothing else changes). The trace (ds4_trace_span) gets each action ("F c1 mb3", "B c1 mb3"), each action's
 * waits ("wait F c1 mb3"), "wait sends" and "wait drain" at the end. src/train/pp_mpi.c. */
ds4_status ds4_pp_run_rank(ds4_model *m, ds4_comm *pipe, const ds4_pp_local_args *a, ds4_losses *mean,
                           int64_t *loads);

/* A forward-only pass over MPI, world = pp (validation under a pipeline): rank r of pipe runs the forwards of
 * its chunks (stage passes with need_backward false; no backward, no MTP rows handed on) in interleaved 1F1B's
 * forward order (micro-batches in groups of pp, each group through its chunks in forward order); a forward
 * receives the previous chunk's stream and sends its own, and its pass is freed once that send has completed.
 * *loss_sum += each micro-batch's LM loss (ds4_pass_losses()->loss of the head's chunk), added in micro-batch
 * order on every rank: the bits of a loop of ds4_forward over the micro-batches adding the same. a->opts: every pass's (need_backward is cleared);
 * refused as ds4_pp_run_rank, and beyond 32767 chunk-micro-batches. src/train/pp_eval.c. */
ds4_status ds4_pp_eval_rank(ds4_model *m, ds4_comm *pipe, const ds4_pp_local_args *a, double *loss_sum);

#ifdef __cplusplus
}
#endif
#endif
