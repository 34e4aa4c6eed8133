/* What the pipeline's executors share (private to src/train): a chunk's stage pass, and for the executors
 * over MPI (pp_mpi.c, a training step; pp_eval.c, a forward-only pass) the checks of a rank's run and a
 * boundary tensor's receive. src/train/pp_rank.c. */
#ifndef DS4_TRAIN_PP_IMPL_H
#define DS4_TRAIN_PP_IMPL_H

#include "ds4/pp_schedule.h"

/* Chunk k of layout L as a stage pass of m: its layers, the embedding, the head; the head's chunk without the
 * embedding hands the MTP rows' gradient on (a model with MTP). */
ds4_stage pp_stage_of(const ds4_model *m, const ds4_pp_layout *L, int64_t k);

/* The checks of a run on one rank over pipe (world = pp), one line each: pipe not of the layout's pp ranks,
 * a model outside host memory, a layout of another model, no micro-batch or a batch too
 * small, more than 32767 tags (`kinds` tags per chunk and micro-batch). */
/* The layout is the model's and the micro-batches make sense: what both executors check first. */
ds4_status pp_check_args(const ds4_model *m, const ds4_pp_local_args *a);
ds4_status pp_check_rank(const ds4_model *m, const ds4_comm *pipe, const ds4_pp_local_args *a, int64_t kinds);

/* *buf := a new buffer of count floats (comm; free: ds4_free) received from rank from_rank with tag; waits.
 * The caller frees it once its stage pass has copied it in: a fixed point, counted alike in a plan. */
ds4_status pp_recv_into(ds4_comm *pipe, float **buf, int64_t count, int64_t from_rank, int tag);

/* The stores of a step's micro-batches under --swap-layer-input (ds4_pp_local_args.policies): one
 * ds4_act_policies and ds4_act_swap a micro-batch, none without a swap. */
typedef struct {
    int64_t M;
    ds4_act_policies *pol; /* [M] NULL: no swap */
    ds4_act_swap **swap;   /* [M] */
} pp_swaps;
ds4_status pp_swaps_make(const ds4_pp_local_args *a, pp_swaps *out);
/* The options of micro-batch mb's passes: *a->opts, its store micro-batch mb's under a swap; need_backward. */
ds4_pass_opts pp_opts_of(const ds4_pp_local_args *a, const pp_swaps *s, int64_t mb);
/* Frees the swaps (after every pass that uses them: a pass's free releases its layers' entries). */
void pp_swaps_free(pp_swaps *s);

#endif
