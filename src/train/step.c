/* One optimizer step (ds4/trainer.h ds4_train_step): the one code path of `ds4 train` and of `ds4 memplan`,
 * which runs it on a plan state. The step does not know which form the state has (whole or an FSDP + EP
 * shard) nor whether it is a plan: the state and what it holds honour their execution context.
 *
 * Micro-batches run one after another (forward, backward, next), or with MoE forward-backward overlap
 * (--moe-fb-overlap) in MindSpeed's 1F1B pairing: forward(0); then for i = 1 .. M-1 forward(i) beside
 * backward(i - 1), the two taking turns at each EP all-to-all (fbo.h), so one's rows travel while the
 * other computes; then backward(M - 1). Backward i - 1 still ends before backward i starts and each pass
 * computes what it did alone, so the gradients accumulate in the same order: the same bits. */
#include "ds4/trainer.h"

#include "fbo.h"

#include "ds4/pp_schedule.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* What the passes of one step share; pol[k] is the store of the passes in slot k (overlapped: micro-batch
 * mod 2, each slot with its own layer-input swap, so a forward's swapped X[l] never takes the entry of the
 * backward beside it; one after another: slot 0), alive as long as they are. */
typedef struct {
    ds4_train_state *s;
    const ds4_step_args *a;
    const ds4_param_hooks *hooks;
    ds4_act_policies pol[2];
    ds4_step_result *out;
} step_ctx;

/* Forward of micro-batch `micro` (its ids fetched first). */
static ds4_status pass_forward(step_ctx *c, int64_t micro, ds4_pass **p) {
    const ds4_step_args *a = c->a;
    *p = NULL;
    if (a->next_ids) DS4_TRY(a->next_ids(a->ctx, a->ids));
    ds4_pass_opts o = {.need_backward = true,
                       .csa_dense = a->csa_dense,
                       .moe_force_balance = a->moe_force_balance,
                       .hooks = c->hooks,
                       .store = ds4_act_store_of(&c->pol[a->moe_fb_overlap ? micro % 2 : 0]),
                       .bf16_acts = ds4_train_state_bf16(c->s)};
    return ds4_forward(ds4_train_state_model(c->s), a->ids, a->B, a->T, &o, p);
}

/* Backward of micro-batch `micro`: its losses / micro_batches added to out, its expert loads to loads
 * [nb, E]; the pass is freed. */
static ds4_status pass_backward(step_ctx *c, int64_t micro, ds4_pass *p) {
    const ds4_step_args *a = c->a;
    ds4_model *m = ds4_train_state_model(c->s);
    const ds4_config *mc = ds4_model_config(m);
    const int64_t nb = mc->n_layers + mc->n_mtp_layers, E = mc->n_routed_experts, accum = a->micro_batches;
    ds4_status st = ds4_backward(m, p);
    if (st == DS4_OK) {
        const ds4_losses *L = ds4_pass_losses(p);
        ds4_step_result *out = c->out;
        out->loss += L->loss / (double)accum;
        out->mtp_loss += L->mtp_loss / (double)accum;
        out->indexer_loss += L->indexer_loss / (double)accum;
        out->total_loss += L->total_loss / (double)accum;
        for (int64_t l = 0; l < nb; l++) {
            const int64_t *ld = ds4_pass_expert_load(p, l);
            for (int64_t e = 0; e < E; e++) a->loads[l * E + e] += ld[e];
        }
        if (a->on_pass) a->on_pass(a->ctx, micro, p);
    }
    ds4_pass_free(p);
    return st;
}

/* ------------------------------------------------------------------ MoE forward-backward overlap */
/* The two halves of a pair, as fbo_pair runs them. */
typedef struct {
    step_ctx *c;
    int64_t micro;
    ds4_pass *p; /* forward: made here; backward: consumed (freed) */
} pass_job;

static ds4_status forward_job(void *ctx) {
    pass_job *j = ctx;
    return pass_forward(j->c, j->micro, &j->p);
}
static ds4_status backward_job(void *ctx) {
    pass_job *j = ctx;
    ds4_pass *p = j->p;
    j->p = NULL;
    return pass_backward(j->c, j->micro, p);
}

/* The hooks of the two passes, around the state's (or none): gather and drop are counted, as both passes
 * may hold one group (forward and backward at the same layer; the embedding, head and MTP groups) and its
 * weights must stay until the last holder drops them; the EP ops give way between each all-to-all's start
 * and wait. Without EP no all-to-all gives way: a gather does instead, so the passes still take turns,
 * layer by layer. */
typedef struct {
    const ds4_param_hooks *in; /* NULL: the whole model */
    fbo *f;
    int holders[DS4_MAX_LAYERS + 3]; /* [groups] passes between gather and drop */
    ds4_param_hooks hooks;
} turn_hooks;

static ds4_status turn_gather(void *ctx, int64_t g) {
    turn_hooks *t = ctx;
    ds4_status st = t->in && t->in->gather ? t->in->gather(t->in->ctx, g) : DS4_OK;
    if (st == DS4_OK) t->holders[g]++;
    if (!t->hooks.ep) fbo_yield(t->f);
    return st;
}
static void turn_drop(void *ctx, int64_t g) {
    turn_hooks *t = ctx;
    if (t->holders[g] > 0 && --t->holders[g] > 0) return; /* the other pass still reads it */
    if (t->in && t->in->drop) t->in->drop(t->in->ctx, g);
}
static ds4_status turn_grad_begin(void *ctx, int64_t g) {
    turn_hooks *t = ctx;
    return t->in && t->in->grad_begin ? t->in->grad_begin(t->in->ctx, g) : DS4_OK;
}
static ds4_status turn_grad_end(void *ctx, int64_t g) {
    turn_hooks *t = ctx;
    return t->in && t->in->grad_end ? t->in->grad_end(t->in->ctx, g) : DS4_OK;
}
static ds4_status turn_prefetch(void *ctx, const int64_t *next, int64_t n) {
    turn_hooks *t = ctx;
    return t->in && t->in->prefetch ? t->in->prefetch(t->in->ctx, next, n) : DS4_OK;
}
static ds4_status turn_sync(void *ctx) {
    turn_hooks *t = ctx;
    return t->in && t->in->sync ? t->in->sync(t->in->ctx) : DS4_OK;
}

static void turn_hooks_init(turn_hooks *t, const ds4_param_hooks *in, const ds4_ep_ops *ep, fbo *f) {
    memset(t, 0, sizeof *t);
    t->in = in;
    t->f = f;
    t->hooks = (ds4_param_hooks){.ctx = t, .gather = turn_gather, .drop = turn_drop, .grad_begin = turn_grad_begin,
                                 .grad_end = turn_grad_end, .prefetch = turn_prefetch, .sync = turn_sync, .ep = ep};
}

/* forward(0); forward(i) beside backward(i - 1) for i = 1 .. M-1; backward(M - 1). */
static ds4_status passes_overlapped(step_ctx *c, fbo *f) {
    const int64_t M = c->a->micro_batches;
    ds4_pass *prev = NULL;
    ds4_status st = pass_forward(c, 0, &prev);
    for (int64_t i = 1; st == DS4_OK && i < M; i++) {
        pass_job fwd = {c, i, NULL}, bwd = {c, i - 1, prev};
        ds4_status sf, sb;
        fbo_pair(f, forward_job, &fwd, backward_job, &bwd, &sf, &sb);
        prev = fwd.p;
        st = sb != DS4_OK ? sb : sf;
    }
    if (st == DS4_OK) return pass_backward(c, M - 1, prev);
    ds4_pass_free(prev);
    return st;
}

static ds4_status passes_fb_overlap(step_ctx *c) {
    DS4_TRY(ds4_train_state_swap_slot(c->s, 1, &c->pol[1].swap));
    fbo *f = fbo_new();
    if (!f) return ds4_fail(DS4_ERR_OOM, "--moe-fb-overlap: out of memory for the second pass's stack");
    turn_hooks th;
    turn_hooks_init(&th, c->hooks, ds4_train_state_yielding_ep(c->s, fbo_yield, f), f);
    c->hooks = &th.hooks;
    ds4_status st = passes_overlapped(c, f);
    fbo_free(f);
    return st;
}

/* ------------------------------------------------------------------ a pipeline (world = pp x fsdp) */
/* The gradients of a pipelined step: every micro-batch's ids fetched first (every stage reads them), the
 * schedule run by ds4_pp_run_rank (this rank's chunks, whose gradients alone it holds), / micro-batches.
 * world = pp: nothing is merged, each rank updates its own groups. pp x fsdp: each data rank runs its own
 * pipeline over its micro-batches; the stage's FSDP hooks reduce-scatter each chunk's gradients inside the
 * stage's data ranks at every backward, in micro-batch order (each chunk runs its backwards in that order on
 * every data rank), so the shard's sums are FSDP's without a pipeline; / all data ranks' micro-batches. The
 * losses and loads come from the executor, the same on every stage, then made means over the data ranks. */
static ds4_status pipeline_gradients(ds4_train_state *s, const ds4_step_args *a, ds4_step_result *out) {
    ds4_model *m = ds4_train_state_model(s);
    const int64_t M = a->micro_batches, N = a->B * a->T;
    if (a->moe_fb_overlap)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline: --moe-fb-overlap is not built yet under pp");
    int32_t *ids = malloc((size_t)(M * N) * sizeof *ids); /* [M, B, T] */
    if (!ids) return ds4_fail(DS4_ERR_OOM, "pipeline: out of memory for %lld micro-batches' ids", (long long)M);
    ds4_status st = DS4_OK;
    for (int64_t mb = 0; st == DS4_OK && mb < M; mb++) {
        if (a->next_ids) st = a->next_ids(a->ctx, a->ids);
        if (st == DS4_OK) memcpy(ids + mb * N, a->ids, (size_t)N * sizeof *ids);
    }
    /* --swap-layer-input: the executor gives each micro-batch a swap of its own on the state's offload tier */
    ds4_act_policies pol = {.recompute = a->release_mask, .swap = ds4_train_state_swap(s)};
    const ds4_pass_opts o = {.need_backward = true, .csa_dense = a->csa_dense,
                             .moe_force_balance = a->moe_force_balance, .store = ds4_act_store_of(&pol),
                             .bf16_acts = ds4_train_state_bf16(s), .hooks = ds4_train_state_hooks(s)};
    const ds4_pp_local_args pa = {.layout = a->layout, .micro_batches = M, .B = a->B, .T = a->T, .ids = ids,
                                  .opts = &o, .policies = &pol, .bubble = a->pp_bubble};
    ds4_losses mean;
    if (st == DS4_OK) st = ds4_pp_run_rank(m, a->pipe, &pa, &mean, a->loads);
    free(ids);
    if (st != DS4_OK) return st;
    ds4_train_state_scale_grads(s, M * ds4_train_state_data_ranks(s)); /* the mean over the global batch */
    double v[4] = {mean.loss, mean.mtp_loss, mean.indexer_loss, mean.total_loss};
    DS4_TRY(ds4_train_state_mean(s, v, 4)); /* pp x fsdp: over the data ranks, in their order */
    out->loss = v[0], out->mtp_loss = v[1], out->indexer_loss = v[2], out->total_loss = v[3];
    return DS4_OK;
}

/* ------------------------------------------------------------------ the step */
/* The gradients of the step: zeroed, accumulated over this rank's micro-batches, divided by the
 * micro-batches of all ranks; the losses made means over ranks. */
static ds4_status gradients(ds4_train_state *s, const ds4_step_args *a, ds4_step_result *out) {
    const ds4_config *mc = ds4_model_config(ds4_train_state_model(s));
    const int64_t accum = a->micro_batches, nb = mc->n_layers + mc->n_mtp_layers;
    memset(a->loads, 0, (size_t)(nb * mc->n_routed_experts) * sizeof(int64_t));
    ds4_train_state_zero_grads(s);
    if (a->pipe) return pipeline_gradients(s, a, out);
    step_ctx c = {.s = s, .a = a, .hooks = ds4_train_state_hooks(s), .out = out};
    for (int k = 0; k < 2; k++) /* slot 1's swap: made by the overlap, which alone uses it */
        c.pol[k] = (ds4_act_policies){.recompute = a->release_mask, .swap = k ? NULL : ds4_train_state_swap(s)};
    if (a->moe_fb_overlap) DS4_TRY(passes_fb_overlap(&c));
    else
        for (int64_t micro = 0; micro < accum; micro++) {
            ds4_pass *p;
            DS4_TRY(pass_forward(&c, micro, &p));
            DS4_TRY(pass_backward(&c, micro, p));
        }
    ds4_train_state_scale_grads(s, accum * ds4_train_state_ranks(s)); /* the mean over the global batch */
    double v[4] = {out->loss, out->mtp_loss, out->indexer_loss, out->total_loss};
    DS4_TRY(ds4_train_state_mean(s, v, 4)); /* the mean over ranks */
    out->loss = v[0], out->mtp_loss = v[1], out->indexer_loss = v[2], out->total_loss = v[3];
    return DS4_OK;
}

/* The step after the gradients: clip, check, AdamW (and Muon), router bias. */
static ds4_status update(ds4_train_state *s, const ds4_step_args *a, ds4_step_result *out) {
    DS4_TRY(ds4_train_state_clip(s, a->max_norm, &out->grad_norm));
    /* both are global (the same on every rank); a plan has no values to check */
    if (!ds4_train_state_exec(s)->plan && (!isfinite(out->total_loss) || !isfinite(out->grad_norm))) {
        out->agreed = true;
        return ds4_fail(DS4_ERR_INTERNAL, "step %lld: loss %g / grad norm %g is not finite", (long long)a->step,
                        out->total_loss, out->grad_norm);
    }
    DS4_TRY(ds4_train_state_adamw_step(s, a->adamw, a->lr));
    if (a->own_cfg) DS4_TRY(ds4_train_state_own_step(s, a->own_cfg, a->adamw->weight_decay, a->lr));
    DS4_TRY(ds4_train_state_share(s)); /* a pipeline: the embedding's new values to the MTP block's rank */
    ds4_train_state_refresh_bf16(s); /* the next passes read the updated weights' bf16 copy */
    DS4_TRY(ds4_train_state_router_bias(s, a->loads, a->router_bias_gamma));
    return ds4_dev_status(ds4_train_state_exec(s)); /* the update's ops, checked before the step counts */
}

ds4_status ds4_train_step(ds4_train_state *s, const ds4_step_args *a, ds4_step_result *out) {
    memset(out, 0, sizeof *out);
    if (a->micro_batches < 1 || a->B < 1 || a->T < 2)
        return ds4_fail(DS4_ERR_ARG, "train step: %lld micro-batches of %lld x %lld tokens (need >= 1, >= 1, >= 2)",
                        (long long)a->micro_batches, (long long)a->B, (long long)a->T);
    if (a->moe_fb_overlap && a->micro_batches < 2)
        return ds4_fail(DS4_ERR_ARG, "--moe-fb-overlap (parallel.moe_fb_overlap) needs 2 or more micro-batches per "
                        "rank (training.global_batch_size / (training.micro_batch_size x ranks)), got %lld",
                        (long long)a->micro_batches);
    /* the GEMMs run in the state's matmul precision (bf16 under mixed precision, a plan too: the engines'
     * buffers differ): its model was made in the state's context */
    ds4_status st = gradients(s, a, out);
    if (st == DS4_OK) st = update(s, a, out);
    return st;
}
