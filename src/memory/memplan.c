/* memplan: one training step's memory, measured on the real code path in shape-only mode. */
#include "ds4/memplan.h"

#include "ds4/dist.h"
#include "ds4/model.h"
#include "ds4/train.h"

#include <string.h>

static ds4_status step(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, int32_t *ids,
                       ds4_mem_stats *end) {
    ds4_model *m;
    DS4_TRY(ds4_model_create(c, &m));
    ds4_model_init_random(m, 1);
    ds4_adamw opt;
    ds4_status st = ds4_adamw_init(&opt, m);
    if (st != DS4_OK) {
        ds4_model_free(m);
        return st;
    }
    ds4_pass_opts o = {.need_backward = true, .release_mask = masks};
    ds4_pass *p = NULL;
    st = ds4_forward(m, ids, B, T, &o, &p);
    if (st == DS4_OK) st = ds4_backward(m, p);
    ds4_pass_free(p);
    if (st == DS4_OK) {
        ds4_clip_grad_norm(m, 1.0);
        ds4_adamw_cfg ac = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
        ds4_adamw_step(&opt, m, &ac, 1e-4);
    }
    ds4_mem_get(end); /* what stays between steps: parameters, gradients, optimizer state */
    ds4_adamw_free(&opt);
    ds4_model_free(m);
    return st;
}

/* One step on a rank of FSDP + EP: the shard's AdamW, the model behind the hooks. */
typedef struct {
    ds4_comm *comm;
    int ep;
    bool force_balance;
} dist_args;

static ds4_status dist_step(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, int32_t *ids,
                            const dist_args *d, ds4_mem_stats *end) {
    ds4_model *m;
    DS4_TRY(ds4_model_create_unmapped(c, &m));
    ds4_fsdp *f = NULL;
    ds4_adamw opt = {0};
    ds4_status st = ds4_fsdp_create(m, d->comm, d->ep, &f);
    if (st == DS4_OK) st = ds4_fsdp_init_random(f, 1);
    if (st == DS4_OK) st = ds4_adamw_init_n(&opt, ds4_fsdp_shard_numel(f));
    if (st == DS4_OK) ds4_fsdp_masks(f, opt.decay, opt.frozen);
    ds4_pass_opts o = {.need_backward = true, .release_mask = masks, .moe_force_balance = d->force_balance};
    if (f) o.hooks = ds4_fsdp_hooks(f);
    ds4_pass *p = NULL;
    if (st == DS4_OK) st = ds4_forward(m, ids, B, T, &o, &p);
    if (st == DS4_OK) st = ds4_backward(m, p);
    ds4_pass_free(p);
    double norm;
    if (st == DS4_OK) st = ds4_fsdp_clip_grad_norm(f, 1.0, &norm);
    if (st == DS4_OK) {
        ds4_adamw_cfg ac = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
        ds4_adamw_step_flat(&opt, ds4_fsdp_shard_params(f), ds4_fsdp_shard_grads(f), &ac, 1e-4);
    }
    ds4_mem_get(end);
    ds4_adamw_free(&opt);
    ds4_fsdp_free(f);
    ds4_model_free(m);
    return st;
}

static ds4_status measure(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                          const dist_args *d, ds4_step_memory *out) {
    memset(out, 0, sizeof *out);
    /* token ids are metadata-sized and real in both modes (the forward validates them) */
    int32_t *ids = ds4_calloc(DS4_MEM_OTHER, (size_t)(B * T) * sizeof(int32_t));
    if (!ids) return ds4_fail(DS4_ERR_OOM, "memplan: out of memory for %lld token ids", (long long)(B * T));
    double t0 = ds4_now();
    ds4_mem_stats s0, s1, end = {0};
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    ds4_set_shape_only(shape_only);
    ds4_status st = d ? dist_step(c, B, T, masks, ids, d, &end) : step(c, B, T, masks, ids, &end);
    ds4_set_shape_only(false);
    ds4_mem_get(&s1);
    for (int k = 0; k < DS4_MEM_NCAT; k++) out->peak[k] = s1.peak[k] - s0.live[k];
    out->peak_total = s1.peak_total - s0.live_total;
    out->after_step = end.live_total - s0.live_total;
    out->seconds = ds4_now() - t0;
    ds4_free(ids);
    return st;
}

ds4_status ds4_step_memory_run(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                               ds4_step_memory *out) {
    return measure(c, B, T, masks, shape_only, NULL, out);
}

ds4_status ds4_step_memory_run_dist(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool shape_only,
                                    ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out) {
    if (ds4_comm_is_plan(comm) && !shape_only)
        return ds4_fail(DS4_ERR_ARG, "memplan: a simulated world can only plan (shape-only)");
    dist_args d = {comm, ep, force_balance};
    return measure(c, B, T, masks, shape_only, &d, out);
}
