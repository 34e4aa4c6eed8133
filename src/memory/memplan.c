/* memplan: one training step's memory, measured on the real code path in shape-only mode. */
#include "ds4/memplan.h"

#include "ds4/dist.h"
#include "ds4/model.h"
#include "ds4/offload.h"
#include "ds4/train.h"

#include <string.h>

/* The offload store and its users during one measured step (nothing when no swap option is on). */
typedef struct {
    ds4_offload *store;
    ds4_act_offload *act;
} swap_ctx;

/* Opens the store when an option needs it and hangs the layer-input hooks on the pass options. */
static ds4_status swap_open(const ds4_step_opts *so, swap_ctx *x, ds4_pass_opts *po) {
    memset(x, 0, sizeof *x);
    if (!so->swap_optimizer && !so->swap_layer_input) return DS4_OK;
    DS4_TRY(ds4_offload_open(so->offload_dir, &x->store));
    if (so->swap_layer_input) {
        DS4_TRY(ds4_act_offload_new(x->store, &x->act));
        po->act = ds4_act_offload_hooks(x->act);
    }
    return DS4_OK;
}

static void swap_close(swap_ctx *x) {
    ds4_act_offload_free(x->act);
    ds4_offload_close(x->store);
}

/* Forward + backward of one micro-batch [B, T]. */
static ds4_status pass(ds4_model *m, int64_t B, int64_t T, int32_t *ids, const ds4_pass_opts *o) {
    ds4_pass *p = NULL;
    ds4_status st = ds4_forward(m, ids, B, T, o, &p);
    if (st == DS4_OK) st = ds4_backward(m, p);
    ds4_pass_free(p);
    return st;
}

static const ds4_adamw_cfg k_adamw = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

static ds4_status step(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *so, int32_t *ids,
                       ds4_mem_stats *end) {
    ds4_model *m;
    DS4_TRY(ds4_model_create(c, &m));
    ds4_model_init_random(m, 1);
    ds4_adamw opt = {0};
    ds4_pass_opts o = {.need_backward = true, .release_mask = so->masks};
    swap_ctx x;
    ds4_status st = swap_open(so, &x, &o);
    if (st == DS4_OK)
        st = so->swap_optimizer ? ds4_adamw_init_swapped(&opt, m, x.store, so->swap_chunk_bytes)
                                : ds4_adamw_init(&opt, m);
    if (st == DS4_OK) st = pass(m, B, T, ids, &o);
    if (st == DS4_OK) {
        ds4_clip_grad_norm(m, 1.0);
        st = ds4_adamw_step(&opt, m, &k_adamw, 1e-4);
    }
    ds4_mem_get(end); /* what stays between steps: parameters, gradients, optimizer state */
    ds4_adamw_free(&opt);
    swap_close(&x);
    ds4_model_free(m);
    return st;
}

/* One step on a rank of FSDP + EP: the shard's AdamW, the model behind the hooks. */
typedef struct {
    ds4_comm *comm;
    int ep;
    bool force_balance;
} dist_args;

/* The shard's AdamW state: m and v resident, or made in the store (never resident); its rules by range. */
static ds4_status dist_adamw_init(ds4_adamw *opt, ds4_fsdp *f, const ds4_step_opts *so, ds4_offload *store) {
    const int64_t n = ds4_fsdp_shard_numel(f);
    DS4_TRY(so->swap_optimizer ? ds4_adamw_init_n_swapped(opt, n, store, so->swap_chunk_bytes)
                               : ds4_adamw_init_n(opt, n));
    return ds4_fsdp_adamw_ranges(f, opt);
}

static ds4_status dist_step(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *so, int32_t *ids,
                            const dist_args *d, ds4_mem_stats *end) {
    ds4_model *m;
    DS4_TRY(ds4_model_create_unmapped(c, &m));
    ds4_fsdp *f = NULL;
    ds4_adamw opt = {0};
    ds4_pass_opts o = {.need_backward = true, .release_mask = so->masks, .moe_force_balance = d->force_balance};
    swap_ctx x;
    ds4_status st = swap_open(so, &x, &o);
    if (st == DS4_OK) st = ds4_fsdp_create(m, d->comm, d->ep, &f);
    if (st == DS4_OK) st = ds4_fsdp_init_random(f, 1);
    if (st == DS4_OK) st = dist_adamw_init(&opt, f, so, x.store);
    if (f) o.hooks = ds4_fsdp_hooks(f);
    if (st == DS4_OK) st = pass(m, B, T, ids, &o);
    double norm;
    if (st == DS4_OK) st = ds4_fsdp_clip_grad_norm(f, 1.0, &norm);
    if (st == DS4_OK) st = ds4_adamw_step_flat(&opt, ds4_fsdp_shard_params(f), ds4_fsdp_shard_grads(f), &k_adamw, 1e-4);
    ds4_mem_get(end);
    ds4_adamw_free(&opt);
    ds4_fsdp_free(f);
    swap_close(&x);
    ds4_model_free(m);
    return st;
}

static ds4_status measure(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *so, bool shape_only,
                          const dist_args *d, ds4_step_memory *out) {
    memset(out, 0, sizeof *out);
    /* token ids [B, T] are metadata-sized and real in both modes (the forward validates them); B and T
     * come from flags, so their product is checked before it sizes anything */
    int64_t n;
    if (B < 1 || T < 1 || !ds4_shape_fits(2, (const int64_t[]){B, T}, sizeof(int32_t), &n))
        return ds4_fail(DS4_ERR_ARG, "memplan: batch %lld x sequence %lld tokens: need both >= 1 and a product that fits",
                        (long long)B, (long long)T);
    int32_t *ids = ds4_calloc(DS4_MEM_OTHER, (size_t)n * sizeof(int32_t));
    if (!ids) return ds4_fail(DS4_ERR_OOM, "memplan: out of memory for %lld token ids", (long long)n);
    double t0 = ds4_now();
    ds4_mem_stats s0, s1, end = {0};
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    ds4_set_shape_only(shape_only);
    ds4_status st = d ? dist_step(c, B, T, so, ids, d, &end) : step(c, B, T, so, ids, &end);
    ds4_set_shape_only(false);
    ds4_mem_get(&s1);
    for (int k = 0; k < DS4_MEM_NCAT; k++) {
        out->peak[k] = s1.peak[k] - s0.live[k];
        out->offload_peak[k] = s1.offload_peak[k] - s0.offload_live[k];
    }
    out->peak_total = s1.peak_total - s0.live_total;
    out->after_step = end.live_total - s0.live_total;
    out->offload_peak_total = s1.offload_peak_total - s0.offload_live_total;
    out->offload_after_step = end.offload_live_total - s0.offload_live_total;
    out->seconds = ds4_now() - t0;
    ds4_free(ids);
    return st;
}

ds4_status ds4_step_memory_run_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                    bool shape_only, ds4_step_memory *out) {
    return measure(c, B, T, opts, shape_only, NULL, out);
}

ds4_status ds4_step_memory_run(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                               ds4_step_memory *out) {
    const ds4_step_opts so = {.masks = masks};
    return measure(c, B, T, &so, shape_only, NULL, out);
}

ds4_status ds4_step_memory_run_dist_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                         bool shape_only, ds4_comm *comm, int ep, bool force_balance,
                                         ds4_step_memory *out) {
    if (ds4_comm_is_plan(comm) && !shape_only)
        return ds4_fail(DS4_ERR_ARG, "memplan: a simulated world can only plan (shape-only)");
    dist_args d = {comm, ep, force_balance};
    return measure(c, B, T, opts, shape_only, &d, out);
}

ds4_status ds4_step_memory_run_dist(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                                    ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out) {
    const ds4_step_opts so = {.masks = masks};
    return ds4_step_memory_run_dist_opts(c, B, T, &so, shape_only, comm, ep, force_balance, out);
}
