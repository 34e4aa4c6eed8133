/* One optimizer step (ds4/trainer.h ds4_train_step): the one code path of `ds4 train` and of `ds4 memplan`,
 * which runs it on a plan state. The step does not know which form the state has (whole or an FSDP + EP
 * shard) nor whether it is a plan: the state and what it holds honour their execution context. */
#include "ds4/trainer.h"

#include <math.h>
#include <string.h>

/* Forward + backward of micro-batch `micro`: its losses / accum added to out, its expert loads to loads
 * [nb, E]. */
static ds4_status micro_batch(ds4_train_state *s, const ds4_step_args *a, int64_t micro, int64_t accum,
                              ds4_step_result *out) {
    ds4_model *m = ds4_train_state_model(s);
    const ds4_config *mc = ds4_model_config(m);
    const int64_t nb = mc->n_layers + mc->n_mtp_layers, E = mc->n_routed_experts;
    if (a->next_ids) DS4_TRY(a->next_ids(a->ctx, a->ids));
    const ds4_act_policies pol = {.recompute = a->release_mask, .swap = ds4_train_state_swap(s)};
    ds4_pass_opts o = {.need_backward = true,
                       .csa_dense = a->csa_dense,
                       .moe_force_balance = a->moe_force_balance,
                       .hooks = ds4_train_state_hooks(s),
                       .store = ds4_act_store_of(&pol),
                       .bf16_acts = ds4_train_state_bf16(s)};
    ds4_pass *p;
    DS4_TRY(ds4_forward(m, a->ids, a->B, a->T, &o, &p));
    ds4_status st = ds4_backward(m, p);
    if (st == DS4_OK) {
        const ds4_losses *L = ds4_pass_losses(p);
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

/* The gradients of the step: zeroed, accumulated over this rank's micro-batches, divided by the
 * micro-batches of all ranks; the losses made means over ranks. */
static ds4_status gradients(ds4_train_state *s, const ds4_step_args *a, ds4_step_result *out) {
    const ds4_config *mc = ds4_model_config(ds4_train_state_model(s));
    const int64_t accum = a->micro_batches, nb = mc->n_layers + mc->n_mtp_layers;
    memset(a->loads, 0, (size_t)(nb * mc->n_routed_experts) * sizeof(int64_t));
    ds4_train_state_zero_grads(s);
    for (int64_t micro = 0; micro < accum; micro++) DS4_TRY(micro_batch(s, a, micro, accum, out));
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
    if (a->muon) DS4_TRY(ds4_train_state_muon_step(s, a->muon, a->adamw->weight_decay, a->lr));
    ds4_train_state_refresh_bf16(s); /* the next passes read the updated weights' bf16 copy */
    return ds4_train_state_router_bias(s, a->loads, a->router_bias_gamma);
}

ds4_status ds4_train_step(ds4_train_state *s, const ds4_step_args *a, ds4_step_result *out) {
    memset(out, 0, sizeof *out);
    if (a->micro_batches < 1 || a->B < 1 || a->T < 2)
        return ds4_fail(DS4_ERR_ARG, "train step: %lld micro-batches of %lld x %lld tokens (need >= 1, >= 1, >= 2)",
                        (long long)a->micro_batches, (long long)a->B, (long long)a->T);
    const ds4_exec prev = ds4_exec_enter(ds4_train_state_exec(s)); /* the allocator serves the state's context */
    /* mixed precision runs its GEMMs on bf16 operands (a plan too: the engines' buffers differ) */
    const ds4_matmul_precision prev_precision = ds4_get_matmul_precision();
    ds4_status st = ds4_train_state_bf16(s) ? ds4_set_matmul_precision(DS4_MATMUL_BF16) : DS4_OK;
    if (st == DS4_OK) st = gradients(s, a, out);
    if (st == DS4_OK) st = update(s, a, out);
    ds4_set_matmul_precision(prev_precision);
    ds4_exec_leave(prev);
    return st;
}
