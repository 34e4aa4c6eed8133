/* memplan: one training step's memory, read from the allocator's counters around the trainer's own step
 * (ds4_train_step) on a training state opened under a plan context, or a real one to measure. memplan has
 * no step of its own: plan and run are one code path. */
#include "ds4/memplan.h"

#include "ds4/recompute.h"
#include "ds4/trainer.h"

#include <stdio.h>
#include <string.h>

/* The optimizer settings of a step planned from ds4_step_opts (the allocations do not depend on them). */
static const ds4_adamw_cfg k_adamw = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

/* Where the step runs: the whole model on this process alone, one rank of FSDP + EP on comm, or one stage of
 * a pipeline whose ranks are comm's (pipeline). */
typedef struct {
    ds4_comm *comm; /* NULL: whole */
    int ep;
    bool force_balance;
    bool pipeline;
} step_world;

/* What one step runs: its context, the state's options and the step's settings (ids and loads are added
 * here), made from a run description. */
typedef struct {
    ds4_exec exec;
    ds4_train_state_opts state;
    ds4_step_args args;
} step_setup;

/* Sets the state up, runs the step (ids [B, T], loads [n_blocks, E] scratch); *end: the counters after the
 * step, with what stays between steps (parameters, gradients, optimizer state) live. */
static ds4_status one_step(ds4_train_state *s, const ds4_config *c, const step_setup *u, const step_world *w,
                           int32_t *ids, int64_t *loads, ds4_mem_stats *end, int64_t *held) {
    ds4_train_state_opts o = u->state;
    o.ep = w->comm ? w->ep : 1; /* a pipeline's EP divides each stage's FSDP group (pp x fsdp) */
    o.shard = w->comm != NULL && !w->pipeline;
    ds4_status st = ds4_train_state_setup(s, c, NULL, 1, w->comm ? w->comm : ds4_comm_self(), &o);
    ds4_step_args a = u->args;
    if (w->pipeline && st == DS4_OK) a.pipe = ds4_train_state_pipe(s); /* pp x fsdp: this data rank's stages */
    a.ids = ids;
    a.loads = loads;
    a.moe_force_balance = w->force_balance;
    ds4_step_result r;
    if (st == DS4_OK) st = ds4_train_step(s, &a, &r);
    ds4_mem_get(end);
    *held = st == DS4_OK ? ds4_train_state_held_numel(s) : 0;
    return st;
}

static ds4_status measure(const ds4_config *c, const step_setup *u, const step_world *w, ds4_step_memory *out) {
    memset(out, 0, sizeof *out);
    /* token ids [B, T] and the router loads [n_blocks, E] are metadata-sized and real in both modes (the
     * forward validates the ids), made before the counting starts, as the trainer makes them before its
     * steps; B and T come from flags, so their product is checked before it sizes anything */
    const int64_t B = u->args.B, T = u->args.T;
    int64_t n, nl;
    if (B < 1 || T < 1 || !ds4_shape_fits(2, (const int64_t[]){B, T}, sizeof(int32_t), &n))
        return ds4_fail(DS4_ERR_ARG, "memplan: batch %lld x sequence %lld tokens: need both >= 1 and a product that fits",
                        (long long)B, (long long)T);
    if (!ds4_shape_fits(2, (const int64_t[]){c->n_layers + c->n_mtp_layers, c->n_routed_experts}, sizeof(int64_t), &nl))
        return ds4_fail(DS4_ERR_ARG, "memplan: %lld x %lld router loads do not fit",
                        (long long)(c->n_layers + c->n_mtp_layers), (long long)c->n_routed_experts);
    int32_t *ids = ds4_calloc(DS4_MEM_OTHER, (size_t)n * sizeof(int32_t));
    int64_t *loads = ds4_calloc(DS4_MEM_OTHER, (size_t)nl * sizeof(int64_t));
    ds4_train_state *s = NULL; /* made before the counting too: the handle the step runs through */
    ds4_status st = ids && loads ? ds4_train_state_new(&u->exec, &s)
                                 : ds4_fail(DS4_ERR_OOM, "memplan: out of memory for %lld token ids", (long long)n);
    if (st != DS4_OK) {
        ds4_free(ids);
        ds4_free(loads);
        return st;
    }
    double t0 = ds4_now();
    ds4_mem_stats s0, s1, end = {0};
    ds4_mem_reset_peak();
    ds4_mem_owners_start(); /* who holds each category at its peak (ds4_mem_owners_get, --memory-report) */
    ds4_mem_get(&s0);
    st = one_step(s, c, u, w, ids, loads, &end, &out->params_held);
    ds4_train_state_free(s);
    ds4_mem_get(&s1);
    ds4_mem_owners_stop();
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

/* The run a ds4_step_opts stands for: one step of micro-batches [B, T] on W ranks with the settings whose
 * allocations differ (the optimizer's numbers change no byte), made into a setup by the trainer's own
 * builders. */
static void setup_of_opts(int64_t B, int64_t T, const ds4_step_opts *so, bool plan, int W,
                          ds4_train_cfg *run, step_setup *u) {
    memset(run, 0, sizeof *run);
    ds4_recompute_defaults(&run->recompute);
    run->seq_len = T;
    run->micro_batch = B;
    run->global_batch = B * W * (so->micro_batches > 1 ? so->micro_batches : 1);
    run->ep = 1;
    run->swap_optimizer = so->swap_optimizer;
    run->swap_layer_input = so->swap_layer_input;
    snprintf(run->offload_dir, sizeof run->offload_dir, "%s", so->offload_dir ? so->offload_dir : "");
    run->optimizer = so->muon ? &ds4_optimizer_muon : &ds4_optimizer_adamw;
    run->muon = ds4_muon_defaults();
    run->adamw = k_adamw;
    run->max_norm = 1.0;
    run->router_bias_gamma = 1e-3;
    run->bf16_params = so->bf16;
    run->matmul_precision = so->matmul_precision;
    run->prefetch_depth = so->prefetch_depth;
    run->moe_fb_overlap = so->moe_fb_overlap;
    u->exec = (ds4_exec){.plan = plan, .backend = so->backend, .matmul_precision = run->matmul_precision};
    u->state = ds4_run_state_opts(run, &u->exec);
    u->state.swap_chunk_bytes = so->swap_chunk_bytes;
    u->args = ds4_run_step_args(run, W, 1, k_adamw.lr, so->masks);
}

/* A pipeline's rank: its stage's state (world = pp: its groups; pp x fsdp: their FSDP shard over the stage's
 * data ranks, EP inside them), the step's micro-batches through its schedule on its data rank's stages. */
static ds4_status measure_stage(ds4_train_cfg *run, const ds4_config *c, step_setup *u, ds4_comm *comm,
                                ds4_step_memory *out) {
    ds4_pp_layout *L = ds4_alloc(DS4_MEM_OTHER, sizeof *L); /* before the counting, as the trainer's */
    ds4_status st = L ? ds4_pp_layout_make(&run->recompute.pipe, c->n_layers, c->n_mtp_layers, L)
                      : ds4_fail(DS4_ERR_OOM, "memplan: out of memory for the pipeline layout");
    if (st == DS4_OK && ds4_comm_size(comm) % L->pp)
        st = ds4_fail(DS4_ERR_ARG, "memplan: a pipeline of pp %lld runs on pp x fsdp ranks; a world of %d is no "
                      "multiple of %lld", (long long)L->pp, ds4_comm_size(comm), (long long)L->pp);
    u->args.layout = L; /* args.pipe: the state's pipeline communicator, once it is set up (one_step) */
    const step_world w = {comm, (int)run->ep, true, true}; /* balanced routing, measured as planned */
    if (st == DS4_OK) st = measure(c, u, &w, out);
    ds4_free(L);
    return st;
}

ds4_status ds4_step_memory_of_run(ds4_train_cfg *run, ds4_comm *comm, bool plan, ds4_step_memory *out) {
    const int W = ds4_comm_size(comm);
    ds4_config c;
    ds4_model_dir *d = NULL;
    DS4_TRY(ds4_run_model(run, W, &c, &d));
    ds4_model_dir_close(d); /* a step's bytes do not depend on where the weights came from */
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_recompute_masks(&run->recompute, &c, masks);
    step_setup u;
    DS4_TRY(ds4_run_exec(run, plan, &u.exec));
    u.state = ds4_run_state_opts(run, &u.exec);
    u.args = ds4_run_step_args(run, W, 1, run->adamw.lr, ds4_recompute_any(&run->recompute) ? masks : NULL);
    const step_world w = {W > 1 || run->ep > 1 ? comm : NULL, (int)run->ep, ds4_comm_is_plan(comm), false};
    if (ds4_comm_is_plan(comm) && !plan) return ds4_fail(DS4_ERR_ARG, "memplan: a simulated world can only plan");
    if (run->recompute.pipe.pp > 1) return measure_stage(run, &c, &u, comm, out); /* world = pp x fsdp */
    return measure(&c, &u, &w, out);
}

ds4_status ds4_step_memory_run_opts(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts, bool plan,
                                    ds4_step_memory *out) {
    const step_world whole = {0};
    ds4_train_cfg run;
    step_setup u;
    setup_of_opts(B, T, opts, plan, 1, &run, &u);
    return measure(c, &u, &whole, out);
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
    const step_world w = {comm, ep, force_balance, false};
    ds4_train_cfg run;
    step_setup u;
    setup_of_opts(B, T, opts, plan, ds4_comm_size(comm), &run, &u);
    return measure(c, &u, &w, out);
}

ds4_status ds4_step_memory_run_stage(const ds4_config *c, int64_t B, int64_t T, const ds4_step_opts *opts,
                                     const ds4_pp_cfg *pp, int world, int ep, int rank, ds4_step_memory *out) {
    if (pp->pp < 2 || world < pp->pp || world % pp->pp || rank < 0 || rank >= world)
        return ds4_fail(DS4_ERR_ARG, "memplan: rank %d of a pipeline of %lld stages on %d ranks (pp x fsdp)", rank,
                        (long long)pp->pp, world);
    const int F = world / (int)pp->pp; /* the data ranks of each stage */
    if (ep < 1 || F % ep || c->n_routed_experts % ep || (ep > 1 && F == 1))
        return ds4_fail(DS4_ERR_ARG, "memplan: EP %d inside a stage of %d data ranks: EP divides the stage's FSDP "
                        "group (more than one rank) and the %lld routed experts", ep, F,
                        (long long)c->n_routed_experts);
    ds4_step_opts so = *opts;
    if (so.micro_batches < 1) so.micro_batches = pp->pp; /* as many as stages: every rank's warm-up fills */
    ds4_train_cfg run;
    step_setup u;
    setup_of_opts(B, T, &so, true, F, &run, &u); /* F data ranks, each with its pipeline */
    run.recompute.pipe = *pp;
    run.ep = ep;
    u.state = ds4_run_state_opts(&run, &u.exec);
    u.state.swap_chunk_bytes = so.swap_chunk_bytes;
    u.args = ds4_run_step_args(&run, world, 1, k_adamw.lr, so.masks);
    ds4_comm *sim = NULL;
    ds4_status st = ds4_comm_plan(world, rank, &sim);
    if (st == DS4_OK) st = measure_stage(&run, c, &u, sim, out);
    ds4_comm_free(sim);
    return st;
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
    return ds4_memplan_policy_opts_pipe(p, c, NULL, masks, so);
}

ds4_status ds4_memplan_policy_opts_pipe(const ds4_memplan_policy *p, const ds4_config *c,
                                        const ds4_recompute_cfg *pipe, uint32_t *masks, ds4_step_opts *so) {
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    if (pipe) { /* the layout's priorities: its chunks, per pp rank or per chunk */
        r.pipe = pipe->pipe;
        r.per_pp_rank = pipe->per_pp_rank;
    }
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
