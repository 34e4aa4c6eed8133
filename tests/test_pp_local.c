/* A pipelined step in one process (ds4_pp_run_local): every rank's schedule (1F1B, interleaved) run on one
 * model gives the losses, every gradient and the expert loads of ds4_train_step's accumulation over the same
 * micro-batches bit for bit: pp 2 and 4, vpp 2, uneven and empty chunks, with a recompute policy, with the
 * layer-input swap (alone and with recompute). The
 * head's chunk hands the MTP rows' gradient to the embedding's chunk, so the embedding's gradient sums micro-
 * batch by micro-batch in one process's order even where the head's chunk runs a later micro-batch's
 * backward before the embedding's chunk runs an earlier one's (interleaving). Under mpirun, the same runs over
 * MPI (ds4_pp_run_rank) and the forward-only pass (ds4_pp_eval_rank) against a loop of whole forwards. Each
 * rank's memory plan (ds4_step_memory_of_run of a run with parallel.pp on a plan communicator) equals that
 * rank's measured step, byte for byte in every category and the offload tier's: pp 2 (also with
 * memory.swap_layer_input, 1F1B and vpp 2) under -np 2, pp 2 x fsdp 2 (with EP 2 inside
 * each stage) under -np 4. */
#include "ds4/dist.h"
#include "ds4/kernels.h"
#include "ds4/memplan.h"
#include "ds4/pp_schedule.h"
#include "ds4/recompute.h"
#include "ds4/trainer.h"
#include "test.h"
#include "test_mpi.h"

#define ROWS 2
#define SEQ 16
#define MAXM 8

typedef struct {
    const int32_t *ids; /* [M, B, T] */
    int64_t next;
} feed;

static ds4_status next_ids(void *ctx, int32_t *ids) {
    feed *f = ctx;
    memcpy(ids, f->ids + f->next++ * ROWS * SEQ, (size_t)(ROWS * SEQ) * sizeof(int32_t));
    return DS4_OK;
}

typedef struct {
    ds4_losses losses;
    float *grads;    /* [numel] */
    int64_t *loads;  /* [n_blocks, E] */
    int64_t numel;
} result;

static float *grads_of(ds4_train_state *s, int64_t *numel) {
    ds4_model *m = ds4_train_state_model(s);
    *numel = ds4_model_numel(m);
    const size_t bytes = (size_t)ds4_model_numel(m) * sizeof(float);
    float *g = malloc(bytes);
    if (g) ds4_model_to_host(m, g, ds4_model_grads_flat(m), bytes);
    return g;
}

static const ds4_exec *g_exec; /* the pipelined state's context (NULL: the cpu) */
static bool g_swap;            /* the pipelined run swaps its layer inputs (--swap-layer-input) */

static bool open_state_on(const ds4_config *c, const ds4_exec *ex, ds4_train_state **s) {
    ds4_train_state_opts so = {.ep = 1, .exec = ex};
    const bool ok = ds4_train_state_open(c, NULL, 11, ds4_comm_self(), &so, s) == DS4_OK;
    CHECK(ok, "%s", ds4_errmsg());
    return ok;
}
static bool open_state(const ds4_config *c, ds4_train_state **s) { return open_state_on(c, NULL, s); }

/* ds4_train_step over the M micro-batches (no clipping, lr 0); its gradients are read after the step,
 * which leaves them as accumulated and scaled by 1 / M. */
static bool reference(const ds4_config *c, const int32_t *ids, int64_t M, const uint32_t *masks, result *r) {
    ds4_train_state *s;
    if (!open_state(c, &s)) return false;
    const int64_t nb = c->n_layers + c->n_mtp_layers;
    r->loads = calloc((size_t)(nb * c->n_routed_experts), sizeof(int64_t));
    int32_t buf[ROWS * SEQ];
    feed f = {.ids = ids};
    ds4_adamw_cfg ac = {.lr = 0, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0};
    const ds4_step_args a = {.step = 1, .micro_batches = M, .B = ROWS, .T = SEQ, .ids = buf, .next_ids = next_ids,
                             .ctx = &f, .loads = r->loads, .release_mask = masks, .adamw = &ac, .lr = 0,
                             .max_norm = 0, .router_bias_gamma = 0};
    ds4_step_result out;
    bool ok = ds4_train_step(s, &a, &out) == DS4_OK;
    CHECK(ok, "train step: %s", ds4_errmsg());
    r->losses = (ds4_losses){out.loss, out.mtp_loss, out.indexer_loss, out.total_loss};
    r->grads = ok ? grads_of(s, &r->numel) : NULL;
    ds4_train_state_free(s);
    return ok && r->grads;
}

static bool pipelined(const ds4_config *c, const int32_t *ids, int64_t M, const uint32_t *masks,
                      const ds4_pp_layout *L, result *r) {
    ds4_train_state *s;
    if (!open_state_on(c, g_exec, &s)) return false;
    const int64_t nb = c->n_layers + c->n_mtp_layers;
    r->loads = calloc((size_t)(nb * c->n_routed_experts), sizeof(int64_t));
    ds4_offload *tier = NULL;
    ds4_act_swap *swap = NULL; /* g_swap: the executor's stores, one a micro-batch, on its tier */
    if (g_swap)
        CHECK(ds4_offload_open(g_exec, NULL, &tier) == DS4_OK && ds4_act_swap_new(tier, &swap) == DS4_OK, "%s",
              ds4_errmsg());
    ds4_act_policies pol = {.recompute = masks, .swap = swap};
    const ds4_pass_opts o = {.store = ds4_act_store_of(&pol)};
    const ds4_pp_local_args a = {.layout = L, .micro_batches = M, .B = ROWS, .T = SEQ, .ids = ids, .opts = &o,
                                 .policies = &pol};
    ds4_train_state_zero_grads(s);
    ds4_mem_reset_peak();
    bool ok = ds4_pp_run_local(ds4_train_state_model(s), &a, &r->losses, r->loads) == DS4_OK;
    CHECK(ok, "pipelined: %s", ds4_errmsg());
    if (g_swap) { /* more than one micro-batch's layer inputs were out at once, none is left, the base held none */
        ds4_mem_stats ms;
        ds4_mem_get(&ms);
        const int64_t one = c->n_layers * ROWS * SEQ * c->hc_mult * c->dim * (int64_t)sizeof(float);
        CHECK(ms.offload_peak[DS4_MEM_ACT] > one && ms.offload_live[DS4_MEM_ACT] == 0 && ds4_act_swap_held(swap) == 0,
              "swap: offload peak %lld (one pass's inputs %lld), live %lld", (long long)ms.offload_peak[DS4_MEM_ACT],
              (long long)one, (long long)ms.offload_live[DS4_MEM_ACT]);
    }
    ds4_act_swap_free(swap);
    ds4_offload_close(tier);
    ds4_train_state_scale_grads(s, M); /* the step's mean over the micro-batches */
    r->grads = ok ? grads_of(s, &r->numel) : NULL;
    ds4_train_state_free(s);
    return ok && r->grads;
}

static void compare(const char *what, const result *a, const result *b, int64_t numel, int64_t nloads) {
    CHECK(memcmp(&a->losses, &b->losses, sizeof a->losses) == 0,
          "%s: losses %.17g %.17g %.17g %.17g vs %.17g %.17g %.17g %.17g", what, a->losses.loss, a->losses.mtp_loss,
          a->losses.indexer_loss, a->losses.total_loss, b->losses.loss, b->losses.mtp_loss, b->losses.indexer_loss,
          b->losses.total_loss);
    int64_t first = -1;
    for (int64_t i = 0; i < numel && first < 0; i++)
        if (memcmp(&a->grads[i], &b->grads[i], sizeof(float))) first = i;
    CHECK(first < 0, "%s: gradients differ first at element %lld (%.9g vs %.9g)", what, (long long)first,
          first < 0 ? 0.0 : a->grads[first], first < 0 ? 0.0 : b->grads[first]);
    CHECK(memcmp(a->loads, b->loads, (size_t)nloads * sizeof(int64_t)) == 0, "%s: expert loads differ", what);
}

static void result_free(result *r) {
    free(r->grads);
    free(r->loads);
}

static const struct {
    int64_t pp, vpp, M;
    const char *layout; /* "": the uniform split */
} k_runs[] = {
    {2, 1, 3, ""},                 /* 1F1B, m not a multiple of pp */
    {4, 1, 5, ""},                 /* 1F1B, one layer a stage */
    {2, 1, 4, "Ettt|tmL"},         /* uneven */
    {2, 2, 4, ""},                 /* interleaved */
    {2, 2, 2, "E|tt|t|tmL"},       /* interleaved, uneven, the embedding alone, m = pp (all warm-up) */
    {4, 2, 4, "Et|t||t|t|||mL"},   /* interleaved pp 4: empty chunks, the head alone */
};

/* The runs of k_runs whose bit is set in which. */
static void check_runs(const char *name, const char *const *flags, unsigned which) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(c.n_mtp_layers > 0, "tiny-a has MTP: the embedding's gradient comes from two chunks");
    uint32_t masks[DS4_MAX_LAYERS];
    const uint32_t *mp = NULL;
    if (flags) {
        ds4_recompute_cfg rc;
        ds4_recompute_defaults(&rc);
        int argc = 0;
        while (flags[argc]) argc++;
        for (int i = 0; i < argc; i++) {
            bool used;
            CHECK(ds4_recompute_parse_arg(&rc, argc, (char **)flags, &i, &used) == DS4_OK && used, "%s", flags[i]);
        }
        CHECK(ds4_recompute_validate(&rc, &c) == DS4_OK, "%s", ds4_errmsg());
        ds4_recompute_masks(&rc, &c, masks);
        mp = masks;
    }
    int32_t ids[MAXM * ROWS * SEQ];
    for (int64_t i = 0; i < MAXM * ROWS * SEQ; i++) ids[i] = (int32_t)(ds4_rng_u64(17, 5, (uint64_t)i) % (uint64_t)c.vocab_size);
    const int64_t nloads = (c.n_layers + c.n_mtp_layers) * c.n_routed_experts;
    for (size_t k = 0; k < sizeof k_runs / sizeof k_runs[0]; k++) {
        if (!(which >> k & 1)) continue;
        ds4_pp_cfg pc;
        ds4_pp_cfg_defaults(&pc);
        pc.pp = k_runs[k].pp;
        pc.vpp = k_runs[k].vpp;
        snprintf(pc.layout, sizeof pc.layout, "%s", k_runs[k].layout);
        ds4_pp_layout *L = malloc(sizeof *L);
        CHECK(L && ds4_pp_layout_make(&pc, c.n_layers, c.n_mtp_layers, L) == DS4_OK, "%s", ds4_errmsg());
        result want = {0}, got = {0};
        if (reference(&c, ids, k_runs[k].M, mp, &want) && pipelined(&c, ids, k_runs[k].M, mp, L, &got)) {
            char what[128];
            snprintf(what, sizeof what, "%s pp %lld vpp %lld m %lld '%s'", name, (long long)k_runs[k].pp,
                     (long long)k_runs[k].vpp, (long long)k_runs[k].M, k_runs[k].layout);
            CHECK(got.numel == want.numel);
            compare(what, &got, &want, want.numel, nloads);
            CHECK(want.losses.mtp_loss > 0 && want.losses.indexer_loss > 0, "%s: every loss part", what);
        }
        result_free(&want);
        result_free(&got);
        free(L);
    }
}

static const char *const k_recompute[] = {"--recompute-granularity", "full", "--recompute-method", "block",
                                          "--recompute-num-layers", "1", "--recompute-csa-attention", "--mhc-recompute",
                                          "--recompute-norm", NULL};

static void test_pipelined_equals_step(void) { check_runs("fp32", NULL, ~0u); }

/* On cpu-guard (buffers the host cannot touch outside an op): the streams, gradients and MTP rows handed
 * across are device buffers; the same bits as the cpu's step (interleaved `E|tt|t|tmL`, m 2). */
static void test_pipelined_guard(void) {
    const struct ds4_kernel_backend *gb = NULL;
    CHECK(ds4_backend_find("--device", "cpu-guard", &gb) == DS4_OK, "%s", ds4_errmsg());
    if (!gb) return;
    const ds4_exec on_guard = {.backend = gb};
    g_exec = &on_guard;
    check_runs("cpu-guard", NULL, 1u << 4); /* interleaved, uneven, m = pp (cpu-guard is slow) */
    g_exec = NULL;
}
/* the runs with the most passes in flight: pp 4, interleaved pp 2 and pp 4 */
static void test_pipelined_recompute(void) { check_runs("recompute", k_recompute, 1u << 1 | 1u << 3 | 1u << 5); }
/* --swap-layer-input: each micro-batch's layer inputs in a store of its own, the reference keeping them (1F1B
 * pp 2 m 3, interleaved pp 2; with the recompute policy the pp 4 runs) */
static void test_pipelined_swap(void) {
    g_swap = true;
    check_runs("swap", NULL, 1u << 0 | 1u << 3);
    check_runs("swap + recompute", k_recompute, 1u << 1 | 1u << 5);
    g_swap = false;
}

/* What the executor refuses: a layout of another model, interleaving with m not a multiple of pp. */
static void test_refusals(void) {
    ds4_model *m = NULL;
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    ds4_model_init_random(m, 3);
    int32_t ids[3 * ROWS * SEQ] = {0};
    ds4_pp_cfg pc;
    ds4_pp_cfg_defaults(&pc);
    pc.pp = 2;
    pc.vpp = 2;
    ds4_pp_layout *L = malloc(sizeof *L);
    CHECK(L && ds4_pp_layout_make(&pc, c.n_layers, c.n_mtp_layers, L) == DS4_OK, "%s", ds4_errmsg());
    const ds4_pass_opts o = {0};
    ds4_pp_local_args a = {.layout = L, .micro_batches = 3, .B = ROWS, .T = SEQ, .ids = ids, .opts = &o};
    ds4_losses l;
    CHECK(ds4_pp_run_local(m, &a, &l, NULL) != DS4_OK && strstr(ds4_errmsg(), "not a multiple of pp"), "%s",
          ds4_errmsg());
    ds4_pp_layout *L2 = malloc(sizeof *L2);
    CHECK(L2 && ds4_pp_layout_make(&pc, c.n_layers + 4, c.n_mtp_layers, L2) == DS4_OK, "%s", ds4_errmsg());
    a.layout = L2;
    a.micro_batches = 2;
    CHECK(ds4_pp_run_local(m, &a, &l, NULL) != DS4_OK && strstr(ds4_errmsg(), "the layout has 8 layers"), "%s",
          ds4_errmsg());
    free(L);
    free(L2);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------ over MPI (world = pp)
 * Under mpirun every rank computes the reference itself (ds4_train_step on a whole state of its own) and
 * runs its part of the pipeline (ds4_pp_run_rank) on another: the losses and the loads equal the reference's
 * on every rank; every gradient element is either the reference's bits (its owner) or untouched (0), and each
 * nonzero reference element has exactly one owner. */
/* The passes a rank held at once: at least the schedule's micro-batches in flight (a pass lives from its
 * forward to its backward: warm-up + 1, at most its vpp·M), at most vpp·M; on the rank of chunk 0 alone
 * (vpp 1), whose backwards send nothing, exactly that: each pass is freed once its backward's sends complete,
 * not at the end of the step. */
static void check_passes_peak(const char *what, const ds4_pp_layout *L, int64_t M, int64_t peak) {
    const int rank = ds4_comm_rank(ds4_comm_world());
    ds4_pp_schedule sch = {0};
    CHECK(ds4_pp_schedule_make(L->pp, L->vpp, M, rank, &sch) == DS4_OK, "%s", ds4_errmsg());
    const int64_t theory = sch.warmup + 1 < L->vpp * M ? sch.warmup + 1 : L->vpp * M;
    CHECK(peak >= theory && peak <= L->vpp * M, "%s: rank %d held %lld passes at once (in flight: %lld, at most %lld)",
          what, rank, (long long)peak, (long long)theory, (long long)(L->vpp * M));
    if (rank == 0 && L->vpp == 1)
        CHECK(peak == theory, "%s: rank 0 held %lld passes at once, the schedule keeps %lld in flight", what,
              (long long)peak, (long long)theory);
    ds4_pp_schedule_free(&sch);
}

static void check_rank_run(const ds4_config *c, const int32_t *ids, int64_t pp, int64_t vpp, int64_t M,
                           const char *layout, const uint32_t *masks) {
    ds4_comm *world = ds4_comm_world();
    char what[128];
    snprintf(what, sizeof what, "mpi pp %lld vpp %lld m %lld '%s'%s", (long long)pp, (long long)vpp, (long long)M,
             layout, masks ? " recompute" : "");
    ds4_pp_cfg pc;
    ds4_pp_cfg_defaults(&pc);
    pc.pp = pp;
    pc.vpp = vpp;
    snprintf(pc.layout, sizeof pc.layout, "%s", layout);
    ds4_pp_layout *L = malloc(sizeof *L);
    CHECK(L && ds4_pp_layout_make(&pc, c->n_layers, c->n_mtp_layers, L) == DS4_OK, "%s", ds4_errmsg());
    result want = {0}, got = {0};
    ds4_train_state *s = NULL;
    bool ok = reference(c, ids, M, masks, &want) && open_state(c, &s);
    if (ok) {
        const int64_t nb = c->n_layers + c->n_mtp_layers;
        got.loads = calloc((size_t)(nb * c->n_routed_experts), sizeof(int64_t));
        ds4_act_policies pol = {.recompute = masks};
        const ds4_pass_opts o = {.store = ds4_act_store_of(&pol)};
        int64_t peak = -1;
        const ds4_pp_local_args a = {.layout = L, .micro_batches = M, .B = ROWS, .T = SEQ, .ids = ids, .opts = &o,
                                     .passes_peak = &peak};
        ds4_train_state_zero_grads(s);
        ok = ds4_pp_run_rank(ds4_train_state_model(s), world, &a, &got.losses, got.loads) == DS4_OK;
        CHECK(ok, "%s: %s", what, ds4_errmsg());
        check_passes_peak(what, L, M, peak);
        ds4_train_state_scale_grads(s, M);
        got.grads = ok ? grads_of(s, &got.numel) : NULL;
    }
    if (ok && got.grads) {
        const int64_t n = want.numel;
        CHECK(memcmp(&got.losses, &want.losses, sizeof got.losses) == 0, "%s: losses %.17g vs %.17g", what,
              got.losses.total_loss, want.losses.total_loss);
        CHECK(memcmp(got.loads, want.loads, (size_t)((c->n_layers + c->n_mtp_layers) * c->n_routed_experts) *
                                                sizeof(int64_t)) == 0, "%s: expert loads differ", what);
        int64_t *owners = calloc((size_t)n, sizeof *owners), bad = -1;
        for (int64_t i = 0; i < n; i++) {
            const bool same = !memcmp(&got.grads[i], &want.grads[i], sizeof(float));
            if (!same && got.grads[i] != 0.0f && bad < 0) bad = i;
            owners[i] = same && want.grads[i] != 0.0f;
        }
        CHECK(bad < 0, "%s: rank %d's gradient element %lld is %.9g, one process's %.9g", what, ds4_comm_rank(world),
              (long long)bad, bad < 0 ? 0.0 : got.grads[bad], bad < 0 ? 0.0 : want.grads[bad]);
        CHECK(ds4_comm_sum_i64(world, owners, n) == DS4_OK, "%s", ds4_errmsg());
        int64_t orphan = -1, nonzero = 0;
        for (int64_t i = 0; i < n; i++) {
            nonzero += want.grads[i] != 0.0f;
            if (want.grads[i] != 0.0f && owners[i] != 1 && orphan < 0) orphan = i;
        }
        CHECK(orphan < 0 && nonzero > 0, "%s: element %lld has %lld owners", what, (long long)orphan,
              orphan < 0 ? 0LL : (long long)owners[orphan]);
        free(owners);
    }
    ds4_train_state_free(s);
    result_free(&want);
    result_free(&got);
    free(L);
}

static void test_mpi_runs(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    int32_t ids[MAXM * ROWS * SEQ];
    for (int64_t i = 0; i < MAXM * ROWS * SEQ; i++) ids[i] = (int32_t)(ds4_rng_u64(17, 5, (uint64_t)i) % (uint64_t)c.vocab_size);
    const int W = ds4_comm_size(ds4_comm_world());
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_recompute_cfg rc;
    ds4_recompute_defaults(&rc);
    const char *const *flags = k_recompute;
    int argc = 0;
    while (flags[argc]) argc++;
    for (int i = 0; i < argc; i++) {
        bool used;
        CHECK(ds4_recompute_parse_arg(&rc, argc, (char **)flags, &i, &used) == DS4_OK && used, "%s", flags[i]);
    }
    ds4_recompute_masks(&rc, &c, masks);
    for (size_t k = 0; k < sizeof k_runs / sizeof k_runs[0]; k++)
        if (k_runs[k].pp == W) check_rank_run(&c, ids, k_runs[k].pp, k_runs[k].vpp, k_runs[k].M, k_runs[k].layout, NULL);
    if (W == 2) check_rank_run(&c, ids, 2, 2, 4, "", masks);
}

/* The forward-only pass (ds4_pp_eval_rank): on every rank, the LM losses of the micro-batches added in
 * micro-batch order equal bitwise those of a loop of whole-model forwards (ds4_forward, forward only) on the
 * same model, with and without bf16 activations (a model with the bf16 copy), for every layout of this world
 * size, with k_runs' micro-batches and with 7 (not a multiple of pp: no schedule constrains a forward-only
 * pass). */
static void check_eval(const ds4_config *c, const int32_t *ids, int64_t pp, int64_t vpp, int64_t M,
                       const char *layout, bool bf16) {
    char what[128];
    snprintf(what, sizeof what, "eval pp %lld vpp %lld m %lld '%s'%s", (long long)pp, (long long)vpp, (long long)M,
             layout, bf16 ? " bf16" : "");
    ds4_pp_cfg pc;
    ds4_pp_cfg_defaults(&pc);
    pc.pp = pp;
    pc.vpp = vpp;
    snprintf(pc.layout, sizeof pc.layout, "%s", layout);
    ds4_pp_layout *L = malloc(sizeof *L);
    CHECK(L && ds4_pp_layout_make(&pc, c->n_layers, c->n_mtp_layers, L) == DS4_OK, "%s", ds4_errmsg());
    ds4_train_state *s = NULL;
    ds4_train_state_opts so = {.ep = 1, .bf16 = bf16};
    CHECK(ds4_train_state_open(c, NULL, 11, ds4_comm_self(), &so, &s) == DS4_OK, "%s", ds4_errmsg());
    if (s) {
        ds4_model *m = ds4_train_state_model(s);
        const ds4_pass_opts o = {.need_backward = false, .bf16_acts = bf16};
        double want = 0, got = 0;
        for (int64_t mb = 0; mb < M; mb++) {
            ds4_pass *p = NULL;
            CHECK(ds4_forward(m, ids + mb * ROWS * SEQ, ROWS, SEQ, &o, &p) == DS4_OK, "%s", ds4_errmsg());
            if (p) want += ds4_pass_losses(p)->loss;
            ds4_pass_free(p);
        }
        const ds4_pp_local_args a = {.layout = L, .micro_batches = M, .B = ROWS, .T = SEQ, .ids = ids, .opts = &o};
        CHECK(ds4_pp_eval_rank(m, ds4_comm_world(), &a, &got) == DS4_OK, "%s: %s", what, ds4_errmsg());
        CHECK(memcmp(&got, &want, sizeof got) == 0 && want > 0, "%s: rank %d's loss sum %.17g, one process's %.17g",
              what, ds4_comm_rank(ds4_comm_world()), got, want);
    }
    ds4_train_state_free(s);
    free(L);
}

static void test_mpi_eval(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    int32_t ids[MAXM * ROWS * SEQ];
    for (int64_t i = 0; i < MAXM * ROWS * SEQ; i++) ids[i] = (int32_t)(ds4_rng_u64(17, 5, (uint64_t)i) % (uint64_t)c.vocab_size);
    const int W = ds4_comm_size(ds4_comm_world());
    for (int bf16 = 0; bf16 < 2; bf16++)
        for (size_t k = 0; k < sizeof k_runs / sizeof k_runs[0]; k++)
            if (k_runs[k].pp == W) {
                check_eval(&c, ids, k_runs[k].pp, k_runs[k].vpp, k_runs[k].M, k_runs[k].layout, bf16);
                check_eval(&c, ids, k_runs[k].pp, k_runs[k].vpp, 7, k_runs[k].layout, bf16);
            }
}

/* Refused with one line, by the step and the forward-only pass: a communicator not of pp ranks (parameter
 * hooks run: FSDP + EP inside a stage, pp x fsdp, tests/test_pp_train.py). */
static void test_mpi_refusals(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    ds4_comm *world = ds4_comm_world();
    const int W = ds4_comm_size(world);
    ds4_pp_cfg pc;
    ds4_pp_cfg_defaults(&pc);
    pc.pp = W == 2 ? 4 : 2;
    ds4_pp_layout *L = malloc(sizeof *L);
    CHECK(L && ds4_pp_layout_make(&pc, c.n_layers, c.n_mtp_layers, L) == DS4_OK, "%s", ds4_errmsg());
    int32_t ids[ROWS * SEQ] = {0};
    const ds4_pass_opts o = {0};
    ds4_pp_local_args a = {.layout = L, .micro_batches = 1, .B = ROWS, .T = SEQ, .ids = ids, .opts = &o};
    ds4_losses l;
    char want[64];
    snprintf(want, sizeof want, "the communicator %d ranks", W);
    CHECK(ds4_pp_run_rank(m, world, &a, &l, NULL) != DS4_OK && strstr(ds4_errmsg(), want), "%s", ds4_errmsg());
    double sum = 0;
    CHECK(ds4_pp_eval_rank(m, world, &a, &sum) != DS4_OK && strstr(ds4_errmsg(), want), "%s", ds4_errmsg());
    pc.pp = W;
    CHECK(ds4_pp_layout_make(&pc, c.n_layers, c.n_mtp_layers, L) == DS4_OK, "%s", ds4_errmsg());
    free(L);
    ds4_model_free(m);
}

/* One rank of a pipelined run description (tiny-a, a global batch of 4 micro-batches of 1 x 64 over the data
 * ranks, AdamW or Muon; extra: the [parallel] lines): its plan on a plan communicator of W ranks (world = pp,
 * or pp x fsdp with the stage's groups sharded over its data ranks and EP inside them) equals its measured
 * step under mpirun in every category's peak and what stays after the step, and in the offload tier's (layer
 * inputs there exactly under memory.swap_layer_input, nothing after the step); the stage holds less than the
 * whole model. */
static void check_stage_plan(const char *what, const char *extra, const char *opt) {
    char text[1024];
    const int n = snprintf(text, sizeof text,
                           "[model]\nconfig = \"tests/configs/tiny-a.json\"\n[training]\nsteps = 1\nseq_len = 64\n"
                           "micro_batch_size = 1\nglobal_batch_size = 4\n[optimizer]\nname = \"%s\"\n"
                           "[data]\ntrain = \"unused\"\n[parallel]\n%s", opt, extra);
    ds4_toml *t = NULL;
    ds4_train_cfg run;
    CHECK(ds4_toml_parse(text, (size_t)n, "run.toml", &t) == DS4_OK && ds4_train_cfg_from_toml(t, &run) == DS4_OK,
          "%s: %s", what, ds4_errmsg());
    ds4_toml_free(t);
    ds4_comm *world = ds4_comm_world(), *sim = NULL;
    const int W = ds4_comm_size(world), rank = ds4_comm_rank(world);
    CHECK(ds4_comm_plan(W, rank, &sim) == DS4_OK, "%s", ds4_errmsg());
    ds4_train_cfg a = run, b = run, whole = run; /* each is resolved for its world in place */
    whole.recompute.pipe.pp = 1, whole.recompute.pipe.vpp = 0, whole.recompute.pipe.layout[0] = 0, whole.ep = 1;
    ds4_step_memory plan, real, one;
    CHECK(ds4_step_memory_of_run(&a, sim, true, &plan) == DS4_OK, "%s: %s", what, ds4_errmsg());
    CHECK(ds4_step_memory_of_run(&b, world, false, &real) == DS4_OK, "%s: %s", what, ds4_errmsg());
    CHECK(ds4_step_memory_of_run(&whole, ds4_comm_self(), true, &one) == DS4_OK, "%s: %s", what, ds4_errmsg());
    ds4_comm_free(sim);
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        CHECK(plan.peak[k] == real.peak[k] && plan.resident[k] == real.resident[k],
              "%s rank %d %s: planned peak %lld resident %lld, measured %lld / %lld", what, rank,
              ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.peak[k], (long long)plan.resident[k],
              (long long)real.peak[k], (long long)real.resident[k]);
    CHECK(plan.peak_total == real.peak_total && plan.after_step == real.after_step, "%s rank %d: peak %lld vs %lld",
          what, rank, (long long)plan.peak_total, (long long)real.peak_total);
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        CHECK(plan.offload_peak[k] == real.offload_peak[k], "%s rank %d %s: planned offload peak %lld, measured %lld",
              what, rank, ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.offload_peak[k],
              (long long)real.offload_peak[k]);
    CHECK(plan.offload_peak_total == real.offload_peak_total && plan.offload_after_step == real.offload_after_step,
          "%s rank %d: offload peak %lld vs %lld", what, rank, (long long)plan.offload_peak_total,
          (long long)real.offload_peak_total);
    const bool swap = strstr(extra, "swap_layer_input") != NULL; /* layer inputs in the tier, none without it */
    CHECK(swap == (plan.offload_peak[DS4_MEM_ACT] > 0) && plan.offload_after_step == 0,
          "%s rank %d: offload act peak %lld, after the step %lld", what, rank,
          (long long)plan.offload_peak[DS4_MEM_ACT], (long long)plan.offload_after_step);
    for (int k = DS4_MEM_PARAM; k <= DS4_MEM_OPTIM; k++)
        CHECK(plan.resident[k] > 0 && plan.resident[k] < one.resident[k], "%s rank %d %s: the stage holds %lld, the "
              "whole model %lld", what, rank, ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.resident[k],
              (long long)one.resident[k]);
    /* The boundary buffers are counted (comm): each rank of these 2-stage pipelines holds a stream
     * [B·T, hc_mult, dim] and the MTP rows [B·T, dim] at once (stage 0 receives both in its backward of chunk
     * 0; the last stage copies both out to send them). 1F1B's stage 0 of a pipeline alone (no FSDP, whose
     * buffers are comm too) holds exactly those two receives. */
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    const int64_t rows = 64 * c.dim * (int64_t)sizeof(float), stream = rows * c.hc_mult;
    CHECK(c.n_mtp_layers > 0 && plan.peak[DS4_MEM_COMM] >= stream + rows, "%s rank %d: comm peak %lld, one stream "
          "%lld + the MTP rows %lld", what, rank, (long long)plan.peak[DS4_MEM_COMM], (long long)stream, (long long)rows);
    if (W == 2 && rank == 0 && !strcmp(extra, "pp = 2\n"))
        CHECK(plan.peak[DS4_MEM_COMM] == stream + rows, "%s rank 0: comm peak %lld, its backward's receives %lld", what,
              (long long)plan.peak[DS4_MEM_COMM], (long long)(stream + rows));
}

static void test_mpi_stage_plans(void) {
    const int W = ds4_comm_size(ds4_comm_world());
    if (W == 2) {
        check_stage_plan("pp 2 1F1B AdamW", "pp = 2\n", "AdamW");
        check_stage_plan("pp 2 vpp 2 Muon", "pp = 2\nvpp = 2\n", "Muon");
        check_stage_plan("pp 2 E|tt|t|tmL AdamW", "pp = 2\nlayout = \"E|tt|t|tmL\"\n", "AdamW");
        /* the layer-input swap: each in-flight micro-batch's inputs in the offload tier, a store of its own */
        check_stage_plan("pp 2 1F1B AdamW swap-layer-input", "pp = 2\n[memory]\nswap_layer_input = true\n", "AdamW");
        check_stage_plan("pp 2 vpp 2 Muon swap-layer-input", "pp = 2\nvpp = 2\n[memory]\nswap_layer_input = true\n",
                         "Muon");
    }
    if (W == 4) { /* pp 2 x fsdp 2: each stage's groups sharded over its 2 data ranks, 2 micro-batches each */
        check_stage_plan("pp 2 x fsdp 2 1F1B AdamW", "pp = 2\n", "AdamW");
        check_stage_plan("pp 2 x fsdp 2 vpp 2 Muon", "pp = 2\nvpp = 2\n", "Muon");
        check_stage_plan("pp 2 x fsdp 2 EP 2 1F1B AdamW", "pp = 2\nep = 2\n", "AdamW");
        check_stage_plan("pp 2 x fsdp 2 EP 2 prefetch 0 Muon", "pp = 2\nep = 2\nprefetch_depth = 0\n", "Muon");
        check_stage_plan("pp 2 x fsdp 2 1F1B AdamW swap-layer-input", "pp = 2\n[memory]\nswap_layer_input = true\n",
                         "AdamW");
    }
}

static int child_main(void) {
    CHECK(ds4_dist_init() == DS4_OK, "%s", ds4_errmsg());
    RUN(test_mpi_runs);
    RUN(test_mpi_eval);
    RUN(test_mpi_refusals);
    RUN(test_mpi_stage_plans);
    fprintf(stderr, "rank %d: %d ok, %d not ok\n", ds4_comm_rank(ds4_comm_world()), t_passed, t_failed);
    ds4_dist_finalize();
    return t_failed ? 1 : 0;
}

static void test_two_ranks(void) { CHECK(t_mpirun_self(2, "--child", 4) == 2, "both ranks pass"); }
static void test_four_ranks(void) {
    if (t_mpirun_wanted(4)) CHECK(t_mpirun_self(4, "--child", 4) == 4, "all four ranks pass");
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--child")) return child_main();
    ds4_set_threads(2);
    RUN(test_pipelined_equals_step);
    RUN(test_pipelined_recompute);
    RUN(test_pipelined_swap);
    RUN(test_pipelined_guard);
    RUN(test_refusals);
    RUN(test_mpi_refusals); /* one process: the world has one rank */
    RUN(test_two_ranks);
    RUN(test_four_ranks);
    TEST_MAIN_END("test_pp_local");
}
