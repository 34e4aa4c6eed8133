/* memplan: one training step's memory, read from the allocator's counters around the trainer's own step
 * (ds4_train_step) on a training state opened under a plan context, or a real one to measure. memplan has
 * no step of its own: plan and run are one code path. */
#include "ds4/memplan.h"

#include "ds4/recompute.h"
#include "ds4/trainer.h"

#include <string.h>

/* The optimizer settings of the step (the allocations do not depend on them). */
static const ds4_adamw_cfg k_adamw = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

/* Where the step runs: the whole model on this process alone, or one rank of FSDP + EP on comm. */
typedef struct {
    ds4_comm *comm; /* NULL: whole */
    int ep;
    bool force_balance;
} step_world;

/* Sets the state up, runs one step of so->micro_batches micro-batches ids [B, T] (loads: [n_blocks, E] scratch); *end: the
 * counters after the step, with what stays between steps (parameters, gradients, optimizer state) live. */
static ds4_status one_step(ds4_train_state *s, const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *so,
                           const step_world *w, int32_t *ids, int64_t *loads, ds4_mem_stats *end, int64_t *held) {
    const ds4_train_state_opts o = {.ep = w->comm ? w->ep : 1,
                                    .shard = w->comm != NULL,
                                    .swap_optimizer = so->swap_optimizer,
                                    .swap_layer_input = so->swap_layer_input,
                                    .offload_dir = so->offload_dir,
                                    .swap_chunk_bytes = so->swap_chunk_bytes,
                                    .optimizer = so->muon ? &ds4_optimizer_muon : NULL,
                                    .bf16 = so->bf16,
                                    .prefetch_depth = so->prefetch_depth};
    const ds4_muon_cfg muon = ds4_muon_defaults();
    ds4_status st = ds4_train_state_setup(s, c, NULL, 1, w->comm ? w->comm : ds4_comm_self(), &o);
    const ds4_step_args a = {.step = 1,
                             .micro_batches = so->micro_batches > 1 ? so->micro_batches : 1,
                             .B = B,
                             .T = T,
                             .ids = ids,
                             .loads = loads,
                             .release_mask = so->masks,
                             .moe_force_balance = w->force_balance,
                             .adamw = &k_adamw,
                             .own_cfg = so->muon ? &muon : NULL,
                             .lr = k_adamw.lr,
                             .max_norm = 1.0,
                             .router_bias_gamma = 1e-3,
                             .moe_fb_overlap = so->moe_fb_overlap};
    ds4_step_result r;
    if (st == DS4_OK) st = ds4_train_step(s, &a, &r);
    ds4_mem_get(end);
    *held = st == DS4_OK ? ds4_train_state_held_numel(s) : 0;
    return st;
}

static ds4_status measure(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *so, bool plan,
                          const step_world *w, ds4_step_memory *out) {
    memset(out, 0, sizeof *out);
    /* token ids [B, T] and the router loads [n_blocks, E] are metadata-sized and real in both modes (the
     * forward validates the ids), made before the counting starts, as the trainer makes them before its
     * steps; B and T come from flags, so their product is checked before it sizes anything */
    int64_t n, nl;
    if (B < 1 || T < 1 || !ds4_shape_fits(2, (const int64_t[]){B, T}, sizeof(int32_t), &n))
        return ds4_fail(DS4_ERR_ARG, "memplan: batch %lld x sequence %lld tokens: need both >= 1 and a product that fits",
                        (long long)B, (long long)T);
    if (!ds4_shape_fits(2, (const int64_t[]){c->n_layers + c->n_mtp_layers, c->n_routed_experts}, sizeof(int64_t), &nl))
        return ds4_fail(DS4_ERR_ARG, "memplan: %lld x %lld router loads do not fit",
                        (long long)(c->n_layers + c->n_mtp_layers), (long long)c->n_routed_experts);
    const ds4_exec x = {.plan = plan, .backend = so->backend, .matmul_precision = so->matmul_precision};
    int32_t *ids = ds4_calloc(DS4_MEM_OTHER, (size_t)n * sizeof(int32_t));
    int64_t *loads = ds4_calloc(DS4_MEM_OTHER, (size_t)nl * sizeof(int64_t));
    ds4_train_state *s = NULL; /* made before the counting too: the handle the step runs through */
    ds4_status st = ids && loads ? ds4_train_state_new(&x, &s)
                                 : ds4_fail(DS4_ERR_OOM, "memplan: out of memory for %lld token ids", (long long)n);
    if (st != DS4_OK) {
        ds4_free(ids);
        ds4_free(loads);
        return st;
    }
    double t0 = ds4_now();
    ds4_mem_stats s0, s1, end = {0};
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    st = one_step(s, c, B, T, so, w, ids, loads, &end, &out->params_held);
    ds4_train_state_free(s);
    ds4_mem_get(&s1);
    for (int k = 0; k < DS4_MEM_NCAT; k++) {
        out->peak[k] = s1.peak[k] - s0.live[k];
        out->offload_peak[k] = s1.offload_peak[k] - s0.offload_live[k];
        out->resident[k] = end.live[k] - s0.live[k];
    }
    out->peak_total = s1.peak_total - s0.live_total;
    out->after_step = end.live_total - s0.live_total;
    out->offload_peak_total = s1.offload_peak_total - s0.offload_live_total;
    out->offload_after_step = end.offload_live_total - s0.offload_live_total;
    out->seconds = ds4_now() - t0;
    ds4_free(ids);
    ds4_free(loads);
    return st;
}

ds4_status ds4_step_memory_run_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts, bool plan,
                                    ds4_step_memory *out) {
    const step_world whole = {0};
    return measure(c, B, T, opts, plan, &whole, out);
}

ds4_status ds4_step_memory_run(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool plan,
                               ds4_step_memory *out) {
    const ds4_step_opts so = {.masks = masks};
    return ds4_step_memory_run_opts(c, B, T, &so, plan, out);
}

ds4_status ds4_step_memory_run_dist_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                         bool plan, ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out) {
    if (ds4_comm_is_plan(comm) && !plan)
        return ds4_fail(DS4_ERR_ARG, "memplan: a simulated world can only plan");
    const step_world w = {comm, ep, force_balance};
    return measure(c, B, T, opts, plan, &w, out);
}

ds4_status ds4_step_memory_run_dist(const ds4_config *c, int64_t B, int64_t T, const uint32_t *masks, bool plan,
                                    ds4_comm *comm, int ep, bool force_balance, ds4_step_memory *out) {
    const ds4_step_opts so = {.masks = masks};
    return ds4_step_memory_run_dist_opts(c, B, T, &so, plan, comm, ep, force_balance, out);
}

/* ------------------------------------------------------------------ a device budget */
ds4_device_fit ds4_step_memory_fit(const ds4_step_memory *m, int64_t device_bytes) {
    const int64_t margin = device_bytes - m->peak_total; /* both in [0, INT64_MAX]: no overflow */
    return (ds4_device_fit){.need = m->peak_total, .margin = margin, .fits = margin >= 0};
}

/* ------------------------------------------------------------------ the policies to compare */
static const char *const k_flags_off[] = {NULL};
static const char *const k_flags_csa[] = {"--recompute-csa-attention", NULL};
static const char *const k_flags_mhc[] = {"--mhc-recompute", NULL};
static const char *const k_flags_norm[] = {"--recompute-norm", NULL};
static const char *const k_flags_csa_mhc[] = {"--recompute-csa-attention", "--mhc-recompute", NULL};
static const char *const k_flags_fine[] = {"--recompute-csa-attention", "--mhc-recompute", "--recompute-norm", NULL};
static const char *const k_flags_full[] = {"--recompute-granularity", "full", "--recompute-method", "uniform",
                                           "--recompute-num-layers", "1", NULL};

/* The recompute settings, then each with the offload options: 4 blocks of DS4_MEMPLAN_RECOMPUTE_POLICIES. */
#define RECOMPUTE_ROWS(suffix, so, si)                                                                         \
    {"off" suffix, k_flags_off, so, si}, {"csa" suffix, k_flags_csa, so, si}, {"mhc" suffix, k_flags_mhc, so, si}, \
        {"norm" suffix, k_flags_norm, so, si}, {"csa+mhc" suffix, k_flags_csa_mhc, so, si},                    \
        {"csa+mhc+norm" suffix, k_flags_fine, so, si}, {"full" suffix, k_flags_full, so, si}
static const ds4_memplan_policy k_policies[] = {
    RECOMPUTE_ROWS("", false, false),
    RECOMPUTE_ROWS(" +swap-opt", true, false),
    RECOMPUTE_ROWS(" +swap-in", false, true),
    RECOMPUTE_ROWS(" +swap-opt+in", true, true),
};
#define NPOLICIES ((int)(sizeof k_policies / sizeof k_policies[0]))

int ds4_memplan_policy_count(void) { return NPOLICIES; }

const ds4_memplan_policy *ds4_memplan_policy_at(int i) { return i >= 0 && i < NPOLICIES ? &k_policies[i] : NULL; }

ds4_status ds4_memplan_policy_opts(const ds4_memplan_policy *p, const ds4_config *c, uint32_t *masks,
                                   ds4_step_opts *so) {
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    int argc = 0;
    while (p->flags[argc]) argc++;
    for (int i = 0; i < argc; i++) {
        bool used;
        DS4_TRY(ds4_recompute_parse_arg(&r, argc, (char **)p->flags, &i, &used));
        if (!used) return ds4_fail(DS4_ERR_INTERNAL, "memplan policy %s: %s is no recompute flag", p->name, p->flags[i]);
    }
    const ds4_status st = ds4_recompute_validate(&r, c);
    if (st != DS4_OK) return ds4_fail_prefix(st, "memplan policy %s", p->name);
    ds4_recompute_masks(&r, c, masks);
    so->masks = ds4_recompute_any(&r) ? masks : NULL;
    so->swap_optimizer = p->swap_optimizer;
    so->swap_layer_input = p->swap_layer_input;
    return DS4_OK;
}
