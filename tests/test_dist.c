/* FSDP + expert parallelism over MPI. Run plainly, the test first checks FSDP on a world of one
 * process (where the sanitizers see every allocation), then launches itself under `mpirun -np 2`;
 * each rank then checks:
 *  - the sharded initialisation equals a single process's parameters, bit for bit;
 *  - each rank's losses equal a single process's losses on that rank's micro-batch, bit for bit;
 *  - the reduce-scattered gradients equal the single-process gradients of the ranks' micro-batches
 *    summed in ds4's fixed order, bit for bit: dense parameters in rank order; a routed expert first
 *    over the sources of each EP group in rank order (its owner accumulates them), then over the EP
 *    groups in order (FSDP alone, FSDP + EP over some ranks, over all ranks);
 *  - memplan's per-rank plan (a simulated world, plan) equals the measured memory of the real
 *    step on that rank, byte for byte per category (balanced routing in both);
 *  - AdamW on the shards (rules by ranges cut at the shard boundaries), resident and swapped, gives bit
 *    for bit the whole model's parameters and moments; its state is 8 bytes per shard element, counted
 *    once: resident, or with --swap-optimizer in the offload tier with only the update buffers resident;
 *  - MoE forward-backward overlap (--moe-fb-overlap: forward(i) beside backward(i - 1)) gives the
 *    sequential schedule's losses, grad norms and checkpoint bytes over two steps of 2 and 3 micro-batches,
 *    with EP, with recompute (csa + mhc, full) and --swap-layer-input; its plan equals its measured step
 *    and holds more activations than the sequential one (two passes alive);
 *  - the communicator tables (self, plan, MPI) fill every entry, a NULL one is refused naming table and
 *    entry; collectives through the self and plan tables deliver what they did before the tables; EP's
 *    receive counts (ds4_comm_ialltoall_counts) arrive from every rank under MPI.
 * Without mpirun on the machine the test fails: Open MPI is a dependency (scripts/install-deps.sh). */
#include "dist/comm_impl.h"
#include "ds4/dist.h"
#include "ds4/kernels.h"
#include "ds4/memplan.h"
#include "ds4/offload.h"
#include "ds4/recompute.h"
#include "ds4/train.h"
#include "ds4/trainer.h"
#include "test.h"
#include "test_files.h"
#include "test_fsdp_ref.h"
#include "test_mpi.h"

#include <cjson/cJSON.h>
#include <unistd.h>

#define MAX_RANKS 4
static void fsdp_matches_reference_at(const char *cfg_path, int ep, int depth) {
    ds4_comm *world = ds4_comm_world();
    int rank = ds4_comm_rank(world);
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    reference ref;
    CHECK(reference_run(&c, ds4_comm_size(world), 99, false, &ref), "%s", ds4_errmsg());
    ds4_model *m = NULL;
    ds4_fsdp *f = NULL;
    CHECK(ds4_model_create(NULL, &c, true, &m) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_fsdp_create(m, world, ep, &f) == DS4_OK, "%s", ds4_errmsg());
    if (!f) return;
    CHECK(ds4_fsdp_set_prefetch(f, depth) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_fsdp_init_random(f, 7) == DS4_OK);
    int64_t n = ds4_model_numel(m);
    float *full = rank == 0 ? calloc((size_t)n, sizeof(float)) : NULL;
    const char *first = "";
    CHECK(ds4_fsdp_collect(f, false, full, 0) == DS4_OK, "%s", ds4_errmsg());
    if (rank == 0) {
        int64_t bad = compare_params(m, full, ref.m, ds4_model_params_flat(ref.m), &first);
        CHECK(bad == 0, "ep=%d: %lld parameters differ from a single process's init (first %s)", ep, (long long)bad,
              first);
    }
    int32_t ids[64];
    ref_batch_ids(&c, 99, rank, ids);
    ds4_pass_opts o = {.need_backward = true, .hooks = ds4_fsdp_hooks(f)};
    ds4_pass *p = NULL;
    CHECK(ds4_forward(m, ids, kB, kT, &o, &p) == DS4_OK, "%s", ds4_errmsg());
    if (p) {
        CHECK(ds4_backward(m, p) == DS4_OK, "%s", ds4_errmsg());
        double got = ds4_pass_losses(p)->total_loss;
        CHECK(got == ref.total[rank], "ep=%d rank %d: total loss %.17g, single process %.17g", ep, rank, got,
              ref.total[rank]);
    }
    ds4_pass_free(p);
    CHECK(ds4_fsdp_collect(f, true, full, 0) == DS4_OK, "%s", ds4_errmsg());
    if (rank == 0) {
        float *want = expected_grads(&ref, ep);
        int64_t bad = compare_params(m, full, ref.m, want, &first);
        CHECK(bad == 0, "ep=%d: %lld gradient elements differ from the ordered sum (first %s)", ep, (long long)bad,
              first);
        free(want);
    }
    /* the global gradient norm is the same on every rank */
    double norm = 0;
    CHECK(ds4_fsdp_clip_grad_norm(f, 0, &norm) == DS4_OK);
    double all[1] = {norm};
    CHECK(ds4_comm_sum_f64(world, all, 1) == DS4_OK);
    CHECK(all[0] == ds4_comm_size(world) * norm, "grad norm differs between ranks");
    free(full);
    ds4_fsdp_free(f);
    ds4_model_free(m);
    reference_free(&ref);
}

static void fsdp_matches_reference(const char *cfg_path, int ep) { fsdp_matches_reference_at(cfg_path, ep, 0); }

static void test_fsdp_tiny_a(void) { fsdp_matches_reference("tests/configs/tiny-a.json", 1); }
/* Overlap changes no bit: prefetched all-gathers, reduce-scatters in flight (depth 1 and 2), with EP */
static void test_fsdp_overlap_tiny_a(void) { fsdp_matches_reference_at("tests/configs/tiny-a.json", 1, 1); }
static void test_fsdp_overlap_ep_tiny_b(void) { fsdp_matches_reference_at("tests/configs/tiny-b.json", 2, 2); }
static void test_fsdp_ep_tiny_a(void) { fsdp_matches_reference("tests/configs/tiny-a.json", 2); }
static void test_fsdp_ep_tiny_b(void) { fsdp_matches_reference("tests/configs/tiny-b.json", 2); }
/* EP over every rank (each expert whole on one rank), and on 4 ranks EP 2: experts sharded over replicas */
static void test_fsdp_ep_all_tiny_a(void) { fsdp_matches_reference("tests/configs/tiny-a.json", ds4_comm_size(ds4_comm_world())); }

/* memplan of this rank == the measured real step on this rank. */
static void memplan_matches(const char *cfg_path, int ep, bool recompute) {
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    uint32_t masks[64] = {0};
    if (recompute) {
        ds4_recompute_cfg rc;
        ds4_recompute_defaults(&rc);
        rc.csa_attention = rc.mhc = true;
        ds4_recompute_masks(&rc, &c, masks);
    }
    ds4_step_memory real, plan;
    CHECK(ds4_step_memory_run_dist(&c, kB, kT, masks, false, world, ep, true, &real) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(ds4_comm_size(world), ds4_comm_rank(world), &sim) == DS4_OK);
    CHECK(ds4_step_memory_run_dist(&c, kB, kT, masks, true, sim, ep, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm_free(sim);
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        if (k != DS4_MEM_OTHER)
            CHECK(real.peak[k] == plan.peak[k], "ep=%d rank %d %s: measured %lld, planned %lld", ep,
                  ds4_comm_rank(world), ds4_mem_cat_name((ds4_mem_cat)k), (long long)real.peak[k],
                  (long long)plan.peak[k]);
    CHECK(real.peak[DS4_MEM_PARAM] > 0 && real.peak[DS4_MEM_COMM] > 0, "the step has shards and communication");
}

/* This rank's measured step under so (into *real) and its plan on a simulated world: the same peak per
 * category, resident and offloaded (what: the case, for the message). */
static void plan_equals_measured(const ds4_config *c, const ds4_step_opts *so, int ep, const char *what,
                                 ds4_step_memory *real) {
    ds4_comm *world = ds4_comm_world();
    ds4_step_memory plan;
    CHECK(ds4_step_memory_run_dist_opts(c, kB, kT, so, false, world, ep, true, real) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(ds4_comm_size(world), ds4_comm_rank(world), &sim) == DS4_OK);
    CHECK(ds4_step_memory_run_dist_opts(c, kB, kT, so, true, sim, ep, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm_free(sim);
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        if (k != DS4_MEM_OTHER)
            CHECK(real->peak[k] == plan.peak[k] && real->offload_peak[k] == plan.offload_peak[k],
                  "%s ep=%d rank %d %s: measured %lld + %lld offloaded, planned %lld + %lld", what, ep,
                  ds4_comm_rank(world), ds4_mem_cat_name((ds4_mem_cat)k), (long long)real->peak[k],
                  (long long)real->offload_peak[k], (long long)plan.peak[k], (long long)plan.offload_peak[k]);
}

/* Muon under FSDP + EP: this rank's plan == its measured step, in memory and in the store (--swap-optimizer
 * streams the momentum), the whole matrices it gathers as their owner included. */
static void memplan_matches_muon(int ep, bool swap) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    const ds4_step_opts so = {.muon = true, .swap_optimizer = swap};
    ds4_step_memory real;
    plan_equals_measured(&c, &so, ep, swap ? "muon + swap-optimizer" : "muon", &real);
}
static void test_memplan_muon(void) { memplan_matches_muon(1, false); }
static void test_memplan_muon_ep_swap(void) { memplan_matches_muon(2, true); }

/* With overlap: this rank's plan == its measured step, the prefetched groups and the reduce-scatters in
 * flight included; and overlap costs memory (the next group's weights while one computes). */
static void memplan_matches_overlap(const char *cfg_path, int ep, int depth) {
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    const ds4_step_opts blocking = {0}, so = {.prefetch_depth = depth};
    ds4_step_memory real0, real;
    CHECK(ds4_step_memory_run_dist_opts(&c, kB, kT, &blocking, false, ds4_comm_world(), ep, true, &real0) == DS4_OK,
          "%s", ds4_errmsg());
    char what[32];
    snprintf(what, sizeof what, "depth %d", depth);
    plan_equals_measured(&c, &so, ep, what, &real);
    CHECK(real.peak[DS4_MEM_PARAM] > real0.peak[DS4_MEM_PARAM], "depth %d: parameter peak %lld, blocking %lld", depth,
          (long long)real.peak[DS4_MEM_PARAM], (long long)real0.peak[DS4_MEM_PARAM]);
    CHECK(real.peak[DS4_MEM_COMM] >= real0.peak[DS4_MEM_COMM], "depth %d: communication peak %lld < blocking %lld",
          depth, (long long)real.peak[DS4_MEM_COMM], (long long)real0.peak[DS4_MEM_COMM]);
}
static void test_memplan_overlap(void) { memplan_matches_overlap("tests/configs/tiny-a.json", 1, 1); }
static void test_memplan_overlap_ep_depth2(void) { memplan_matches_overlap("tests/configs/tiny-b.json", 2, 2); }

static void test_memplan_fsdp(void) { memplan_matches("tests/configs/tiny-a.json", 1, false); }
static void test_memplan_fsdp_ep(void) { memplan_matches("tests/configs/tiny-a.json", 2, false); }
static void test_memplan_fsdp_ep_recompute(void) { memplan_matches("tests/configs/tiny-b.json", 2, true); }
static void test_memplan_fsdp_recompute(void) { memplan_matches("tests/configs/tiny-b.json", 1, true); }
static void test_memplan_ep_all_recompute(void) {
    memplan_matches("tests/configs/tiny-b.json", ds4_comm_size(ds4_comm_world()), true);
}

/* ------------------------------------------------------------------ AdamW on the shards */
static const ds4_adamw_cfg k_adamw = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
enum { ADAMW_STEPS = 3 };

/* The gradient of step s at packed element i: the same on every rank and in the whole model. */
static float grad_value(int s, int64_t i) { return ds4_rng_uniform(50, (uint64_t)s, (uint64_t)i) - 0.5f; }
static ds4_status grad_read(void *ctx, int64_t off, int64_t n, float *dst) {
    const int s = *(const int *)ctx;
    for (int64_t i = 0; i < n; i++) dst[i] = grad_value(s, off + i);
    return DS4_OK;
}

/* Sink of ds4_fsdp_stream_packed on rank 0: counts parameters whose values differ from want (the flat
 * layout of the whole model ref). */
typedef struct {
    ds4_model *ref;
    const float *want;
    int64_t bad;
} packed_cmp;
static ds4_status compare_packed(void *ctx, int64_t param, const float *values, int64_t n) {
    packed_cmp *c = ctx;
    const ds4_param *p = ds4_model_param(c->ref, param);
    const float *want = c->want + (p->data - ds4_model_params_flat(c->ref));
    if (n != p->numel || memcmp(values, want, (size_t)n * sizeof(float))) c->bad++;
    return DS4_OK;
}

/* Whole-model AdamW (held to the per-element rule by test_optim) over ADAMW_STEPS steps. */
static void whole_adamw_run(const ds4_config *c, ds4_model **ref, ds4_optim *ro) {
    CHECK(ds4_model_create(NULL, c, false, ref) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_init_random(*ref, 7);
    CHECK(ds4_optim_init(ro, NULL, *ref, NULL, 0) == DS4_OK, "%s", ds4_errmsg());
    float *g = ds4_model_grads_flat(*ref);
    for (int s = 0; s < ADAMW_STEPS; s++) {
        for (int64_t i = 0; i < ds4_model_numel(*ref); i++) g[i] = grad_value(s, i);
        CHECK(ds4_adamw_step(ro, *ref, &k_adamw, 1e-3 * (s + 1)) == DS4_OK, "%s", ds4_errmsg());
    }
}

/* The shards' AdamW, its rules by ranges cut at the shard boundaries (FSDP and expert pieces), resident
 * or swapped through 512-element chunks: after ADAMW_STEPS steps the parameters and both moments,
 * gathered, are bit for bit the whole model's. */
static void fsdp_adamw_matches_whole(const char *cfg_path, int ep, bool swap) {
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *ref = NULL, *m = NULL;
    ds4_optim ro = {0}, so = {0};
    whole_adamw_run(&c, &ref, &ro);
    ds4_fsdp *f = NULL;
    ds4_offload *store = NULL;
    CHECK(ds4_model_create(NULL, &c, true, &m) == DS4_OK && ds4_fsdp_create(m, world, ep, &f) == DS4_OK, "%s",
          ds4_errmsg());
    if (!f || !ref) return;
    CHECK(ds4_fsdp_init_random(f, 7) == DS4_OK);
    const int64_t ns = ds4_fsdp_shard_numel(f);
    if (swap) CHECK(ds4_offload_open(NULL, NULL, &store) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_optim_init_shard(&so, NULL, f, swap ? store : NULL, 4096) == DS4_OK && so.n == ns, "%s", ds4_errmsg());
    for (int s = 0; s < ADAMW_STEPS; s++) {
        ds4_fsdp_zero_grads(f);
        CHECK(ds4_fsdp_scatter_packed(f, grad_read, &s, ds4_fsdp_shard_grads(f)) == DS4_OK, "%s", ds4_errmsg());
        CHECK(ds4_adamw_step_flat(&so, ds4_fsdp_shard_params(f), ds4_fsdp_shard_grads(f), &k_adamw, 1e-3 * (s + 1)) ==
                  DS4_OK, "%s", ds4_errmsg());
    }
    if (swap) CHECK(ds4_optim_swap_in(&so) == DS4_OK, "%s", ds4_errmsg());
    const float *shard[3] = {ds4_fsdp_shard_params(f), so.g[0].mem[0], so.g[0].mem[1]},
                *want[3] = {ds4_model_params_flat(ref), ro.g[0].mem[0], ro.g[0].mem[1]};
    const char *what[3] = {"parameters", "first moments", "second moments"};
    for (int k = 0; k < 3; k++) {
        packed_cmp pc = {ref, want[k], 0};
        CHECK(ds4_fsdp_stream_packed(f, shard[k], 0, compare_packed, &pc) == DS4_OK, "%s", ds4_errmsg());
        CHECK(pc.bad == 0, "ep=%d%s: %lld tensors of %s differ from the whole model's AdamW", ep,
              swap ? " swapped" : "", (long long)pc.bad, what[k]);
    }
    ds4_optim_free(&so);
    ds4_optim_free(&ro);
    ds4_offload_close(store);
    ds4_fsdp_free(f);
    ds4_model_free(m);
    ds4_model_free(ref);
}

static void test_fsdp_adamw(void) {
    fsdp_adamw_matches_whole("tests/configs/tiny-a.json", 1, false);
    fsdp_adamw_matches_whole("tests/configs/tiny-a.json", 1, true);
}
static void test_fsdp_ep_adamw(void) {
    fsdp_adamw_matches_whole("tests/configs/tiny-a.json", 2, false);
    fsdp_adamw_matches_whole("tests/configs/tiny-a.json", 2, true);
}

/* The optimizer state is counted once, 8 bytes per shard element: resident without --swap-optimizer;
 * with it, in the offload tier only, the resident optimizer memory being the update's two chunk buffers
 * (m and v). The measured step, and its plan. */
static void optimizer_counted_once(int ep) {
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m = NULL;
    ds4_fsdp *f = NULL;
    CHECK(ds4_model_create(NULL, &c, true, &m) == DS4_OK && ds4_fsdp_create(m, world, ep, &f) == DS4_OK, "%s",
          ds4_errmsg());
    const int64_t ns = f ? ds4_fsdp_shard_numel(f) : 0;
    ds4_fsdp_free(f);
    ds4_model_free(m);
    const size_t chunk = 4096;
    CHECK(ns > (int64_t)chunk / 8, "the shard (%lld elements) must span several chunks", (long long)ns);
    ds4_step_opts plain = {0}, swap = {.swap_optimizer = true, .swap_chunk_bytes = chunk};
    ds4_step_memory res, sw, plan;
    CHECK(ds4_step_memory_run_dist_opts(&c, kB, kT, &plain, false, world, ep, true, &res) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run_dist_opts(&c, kB, kT, &swap, false, world, ep, true, &sw) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(ds4_comm_size(world), ds4_comm_rank(world), &sim) == DS4_OK);
    CHECK(ds4_step_memory_run_dist_opts(&c, kB, kT, &swap, true, sim, ep, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm_free(sim);
    const int rank = ds4_comm_rank(world);
    CHECK(res.peak[DS4_MEM_OPTIM] == 8 * ns && res.offload_peak[DS4_MEM_OPTIM] == 0,
          "ep=%d rank %d resident: optimizer %lld bytes (+ %lld offloaded) for %lld shard elements", ep, rank,
          (long long)res.peak[DS4_MEM_OPTIM], (long long)res.offload_peak[DS4_MEM_OPTIM], (long long)ns);
    CHECK(sw.peak[DS4_MEM_OPTIM] == (int64_t)chunk && sw.offload_peak[DS4_MEM_OPTIM] == 8 * ns,
          "ep=%d rank %d swapped: optimizer %lld bytes resident (want the %zu-byte buffers), %lld offloaded "
          "(want %lld)", ep, rank, (long long)sw.peak[DS4_MEM_OPTIM], chunk, (long long)sw.offload_peak[DS4_MEM_OPTIM],
          (long long)(8 * ns));
    CHECK(plan.peak[DS4_MEM_OPTIM] == sw.peak[DS4_MEM_OPTIM] &&
              plan.offload_peak[DS4_MEM_OPTIM] == sw.offload_peak[DS4_MEM_OPTIM],
          "ep=%d rank %d: the plan counts the optimizer differently", ep, rank);
}

static void test_optimizer_counted_once(void) { optimizer_counted_once(1); }
static void test_optimizer_counted_once_ep(void) { optimizer_counted_once(2); }

/* Sharding really shrinks each rank's persistent state: a rank's shard is about 1/W of the parameters
 * (plus per-region rounding), whatever the EP degree. */
static void test_shard_sizes(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-b.json", &c) == DS4_OK);
    ds4_model *m = NULL;
    ds4_fsdp *f = NULL;
    CHECK(ds4_model_create(NULL, &c, true, &m) == DS4_OK);
    const int W = ds4_comm_size(ds4_comm_world());
    CHECK(ds4_fsdp_create(m, ds4_comm_world(), 2, &f) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *full = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &full) == DS4_OK);
    if (f && full) {
        double ratio = (double)ds4_fsdp_shard_numel(f) / (double)ds4_model_numel(full);
        CHECK(ratio > 0.9 / W && ratio < 1.1 / W, "shard holds %.3f of the parameters on %d ranks", ratio, W);
    }
    ds4_fsdp_free(f);
    ds4_model_free(m);
    ds4_model_free(full);
}

/* ------------------------------------------------------------------ MoE forward-backward overlap */
/* Each rank's micro-batches: a different sequence of ids per rank and per micro-batch. */
typedef struct {
    const ds4_config *c;
    int rank;
    int64_t next;
} mb_source;

static ds4_status mb_next(void *ctx, int32_t *ids) {
    mb_source *s = ctx;
    for (int64_t i = 0; i < kB * kT; i++)
        ids[i] = (int32_t)(ds4_rng_u64(77, (uint64_t)s->rank << 20 | (uint64_t)s->next, (uint64_t)i) %
                           (uint64_t)s->c->vocab_size);
    s->next++;
    return DS4_OK;
}

/* What two steps of a run give: per step the losses and grad norm; the state saved under root. */
typedef struct {
    double loss[2], total[2], norm[2];
} fbo_run;

/* Two steps of M micro-batches per rank on a sharded state (EP ep), overlapped or not. */
static void fbo_steps(const ds4_config *c, int ep, int64_t M, bool overlap, const uint32_t *masks, bool swap,
                      const char *root, fbo_run *r) {
    ds4_comm *world = ds4_comm_world();
    const ds4_train_state_opts so = {.ep = ep, .shard = true, .swap_layer_input = swap, .prefetch_depth = 1};
    ds4_train_state *s = NULL;
    CHECK(ds4_train_state_open(c, NULL, 7, world, &so, &s) == DS4_OK, "%s", ds4_errmsg());
    const int64_t nl = (c->n_layers + c->n_mtp_layers) * c->n_routed_experts;
    int64_t *loads = calloc((size_t)nl, sizeof *loads);
    int32_t ids[64];
    mb_source src = {c, ds4_comm_rank(world), 0};
    for (int k = 0; s && k < 2; k++) {
        const ds4_step_args a = {.step = k + 1, .micro_batches = M, .B = kB, .T = kT, .ids = ids, .next_ids = mb_next,
                                 .ctx = &src, .loads = loads, .release_mask = masks, .adamw = &k_adamw,
                                 .lr = k_adamw.lr, .max_norm = 1.0, .router_bias_gamma = 1e-3,
                                 .moe_fb_overlap = overlap};
        ds4_step_result out;
        CHECK(ds4_train_step(s, &a, &out) == DS4_OK, "overlap %d, %lld micro-batches: %s", overlap, (long long)M,
              ds4_errmsg());
        r->loss[k] = out.loss, r->total[k] = out.total_loss, r->norm[k] = out.grad_norm;
    }
    if (s) CHECK(ds4_train_state_save(s, root, 0, &(ds4_ckpt_meta){.step = 2}) == DS4_OK, "%s", ds4_errmsg());
    ds4_train_state_free(s);
    free(loads);
}

/* The overlapped schedule gives the sequential one's losses, grad norms and checkpoint bytes. */
static void fbo_matches_sequential(const char *cfg_path, int ep, int64_t M, int recompute, bool swap) {
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    uint32_t masks[64] = {0};
    ds4_recompute_cfg rc;
    ds4_recompute_defaults(&rc);
    if (recompute == 1) rc.csa_attention = rc.mhc = true;
    if (recompute == 2) rc.granularity = DS4_RECOMPUTE_GRAN_FULL, rc.method = DS4_RECOMPUTE_METHOD_UNIFORM, rc.num_layers = 1;
    ds4_recompute_masks(&rc, &c, masks);
    int64_t tag = ds4_comm_rank(world) == 0 ? (int64_t)getpid() : 0; /* one folder name on every rank */
    CHECK(ds4_comm_sum_i64(world, &tag, 1) == DS4_OK);
    char seq[128], fbo[128], a[320], b[320];
    snprintf(seq, sizeof seq, "/tmp/ds4-test-fbo-%lld-seq", (long long)tag);
    snprintf(fbo, sizeof fbo, "/tmp/ds4-test-fbo-%lld-fbo", (long long)tag);
    fbo_run x = {0}, y = {0};
    fbo_steps(&c, ep, M, false, recompute ? masks : NULL, swap, seq, &x);
    fbo_steps(&c, ep, M, true, recompute ? masks : NULL, swap, fbo, &y);
    for (int k = 0; k < 2; k++)
        CHECK(x.loss[k] == y.loss[k] && x.total[k] == y.total[k] && x.norm[k] == y.norm[k] && isfinite(x.norm[k]) &&
                  x.norm[k] > 0,
              "%s ep %d, %lld micro-batches, step %d: loss %.9g / %.9g, norm %.9g / %.9g (sequential / overlapped)",
              cfg_path, ep, (long long)M, k + 1, x.total[k], y.total[k], x.norm[k], y.norm[k]);
    if (ds4_comm_rank(world) == 0) {
        const char *files[] = {"model.safetensors", "optim.state"};
        for (int i = 0; i < 2; i++) {
            snprintf(a, sizeof a, "%s/step-00000002/%s", seq, files[i]);
            snprintf(b, sizeof b, "%s/step-00000002/%s", fbo, files[i]);
            CHECK(t_files_equal(a, b), "%s ep %d, %lld micro-batches: %s differs", cfg_path, ep, (long long)M, files[i]);
        }
        snprintf(a, sizeof a, "rm -rf '%s' '%s'", seq, fbo);
        CHECK(system(a) == 0);
    }
    CHECK(ds4_comm_barrier(world) == DS4_OK); /* the folders are gone before any rank starts the next test */
}

static void test_fbo_ep(void) { fbo_matches_sequential("tests/configs/tiny-b.json", 2, 2, 0, false); }
static void test_fbo_ep_recompute_swap(void) { fbo_matches_sequential("tests/configs/tiny-b.json", 2, 3, 1, true); }
static void test_fbo_full_recompute_swap(void) { fbo_matches_sequential("tests/configs/tiny-a.json", 1, 3, 2, true); }
static void test_fbo_ep_all(void) {
    fbo_matches_sequential("tests/configs/tiny-b.json", ds4_comm_size(ds4_comm_world()), 2, 1, true);
}

/* Planned == measured with overlap (two micro-batches), and the overlapped step holds more activations
 * than the sequential one: the second forward runs while the first pass is still alive. */
static void memplan_matches_fbo(const char *cfg_path, int ep) {
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    const ds4_step_opts seq = {.prefetch_depth = 1, .micro_batches = 2},
                        so = {.prefetch_depth = 1, .micro_batches = 2, .moe_fb_overlap = true};
    ds4_step_memory real0, real;
    CHECK(ds4_step_memory_run_dist_opts(&c, kB, kT, &seq, false, ds4_comm_world(), ep, true, &real0) == DS4_OK, "%s",
          ds4_errmsg());
    plan_equals_measured(&c, &so, ep, "moe-fb-overlap", &real);
    CHECK(real.peak[DS4_MEM_ACT] > real0.peak[DS4_MEM_ACT], "activation peak %lld overlapped, %lld sequential",
          (long long)real.peak[DS4_MEM_ACT], (long long)real0.peak[DS4_MEM_ACT]);
}
static void test_memplan_fbo(void) { memplan_matches_fbo("tests/configs/tiny-b.json", 1); }
static void test_memplan_fbo_ep(void) { memplan_matches_fbo("tests/configs/tiny-b.json", 2); }

/* ------------------------------------------------------------------ the communicator tables */
/* Every table fills every entry; a table with one entry NULL is refused by the check and by comm_init,
 * with an error naming the table and the entry (each entry in turn). */
static void test_comm_tables_complete(void) {
    const ds4_comm_ops *tables[] = {&ds4_comm_ops_self, &ds4_comm_ops_plan, &ds4_comm_ops_staged,
#ifdef DS4_HAVE_MPI
                                    &ds4_comm_ops_mpi,
#endif
    };
    const int nt = (int)(sizeof tables / sizeof *tables);
    for (int k = 0; k < nt; k++) {
        const ds4_comm_ops *t = tables[k];
        const char *missing = ds4_comm_ops_missing(t);
        CHECK(missing == NULL && ds4_comm_ops_check(t) == DS4_OK, "table %s: entry %s is NULL", t->name,
              missing ? missing : "-");
        int refused = 0, entries = 0;
#define NULL_ONE(e)                                                                                            \
    do {                                                                                                       \
        ds4_comm_ops broken = *t;                                                                              \
        broken.e = NULL;                                                                                       \
        ds4_comm c;                                                                                            \
        entries++;                                                                                             \
        const char *m = ds4_comm_ops_missing(&broken);                                                         \
        bool named = ds4_comm_ops_check(&broken) != DS4_OK && strstr(ds4_errmsg(), t->name) &&                 \
                     strstr(ds4_errmsg(), "'" #e "'");                                                         \
        CHECK(named, "table %s without %s: %s", t->name, #e, ds4_errmsg());                                   \
        refused += named && m && !strcmp(m, #e) && comm_init(&c, &broken, 0, 1, DS4_LANE_OTHER) != DS4_OK;    \
    } while (0);
        DS4_COMM_ENTRIES(NULL_ONE)
#undef NULL_ONE
        CHECK(entries == 14 && refused == entries, "table %s: %d of %d entries refused when NULL", t->name, refused,
              entries);
    }
    CHECK(!strcmp(ds4_comm_ops_self.name, "self") && !strcmp(ds4_comm_ops_plan.name, "plan"));
    CHECK(ds4_comm_self()->ops == &ds4_comm_ops_self && !ds4_comm_is_plan(ds4_comm_self()));
}

/* Collectives through the self table deliver what a one-rank exchange delivered before the tables: the
 * send block copied at the receive displacement, sums and barriers leaving everything as it is (-0.0
 * included), a split of one rank; and the plan table's answers: nothing moved, balanced routing counts,
 * a split of the size it is asked for. */
static void test_comm_self_and_plan(void) {
    ds4_comm *c = ds4_comm_self();
    ds4_comm_req *q = (ds4_comm_req *)&q; /* any non-NULL value: the start sets it */
    const float send[5] = {1, 2, 3, 4, 5};
    float recv[6] = {-1, -1, -1, -1, -1, -1};
    const int64_t cnt3[1] = {3}, at2[1] = {2}, at1[1] = {1};
    CHECK(ds4_comm_iallgatherv(c, send, 3, recv, cnt3, at2, sizeof(float), &q) == DS4_OK && q == NULL);
    CHECK(recv[0] == -1 && recv[1] == -1 && recv[2] == 1 && recv[3] == 2 && recv[4] == 3 && recv[5] == -1,
          "all-gather: %g %g %g %g %g %g", recv[0], recv[1], recv[2], recv[3], recv[4], recv[5]);
    float got[4] = {0};
    CHECK(ds4_comm_gatherv(c, send + 1, 3, got, cnt3, at1, sizeof(float), 0) == DS4_OK);
    CHECK(got[0] == 0 && got[1] == 2 && got[2] == 3 && got[3] == 4, "gather: %g %g %g %g", got[0], got[1], got[2],
          got[3]);
    float a2a[5] = {0};
    CHECK(ds4_comm_alltoallv(c, send, cnt3, at1, a2a, cnt3, at2, sizeof(float)) == DS4_OK);
    CHECK(a2a[0] == 0 && a2a[1] == 0 && a2a[2] == 2 && a2a[3] == 3 && a2a[4] == 4, "all-to-all: %g %g %g %g %g",
          a2a[0], a2a[1], a2a[2], a2a[3], a2a[4]);
    const int64_t counts[2] = {4, 7};
    int64_t rc[2] = {0, 0};
    q = (ds4_comm_req *)&q;
    CHECK(ds4_comm_ialltoall_counts(c, counts, 2, rc, &q) == DS4_OK && q == NULL && rc[0] == 4 && rc[1] == 7);
    double x[2] = {-0.0, 1.5};
    int64_t xi[2] = {-3, 5};
    CHECK(ds4_comm_sum_f64(c, x, 2) == DS4_OK && ds4_comm_sum_i64(c, xi, 2) == DS4_OK && ds4_comm_barrier(c) == DS4_OK);
    CHECK(signbit(x[0]) && x[0] == 0 && x[1] == 1.5 && xi[0] == -3 && xi[1] == 5, "sums changed one rank's values");
    ds4_comm *sub = NULL;
    CHECK(ds4_comm_split(c, 3, 0, 1, 0, &sub) == DS4_OK && sub && sub != c && ds4_comm_size(sub) == 1 &&
          ds4_comm_rank(sub) == 0 && sub->ops == &ds4_comm_ops_self);
    ds4_comm_free(sub);
    CHECK(ds4_comm_split(c, 0, 0, 2, 1, &sub) != DS4_OK && sub == NULL, "a split of one process into 2 ranks");
    /* the plan: 4 ranks seen from rank 1 */
    ds4_comm *p = NULL;
    CHECK(ds4_comm_plan(4, 1, &p) == DS4_OK && ds4_comm_is_plan(p));
    if (!p) return;
    const int64_t mine[8] = {10, 11, 12, 13, 14, 15, 16, 17}; /* [4 ranks][2 experts] */
    int64_t bal[8] = {0};
    CHECK(ds4_comm_ialltoall_counts(p, mine, 2, bal, &q) == DS4_OK && q == NULL);
    for (int s = 0; s < 4; s++)
        CHECK(bal[2 * s] == 12 && bal[2 * s + 1] == 13, "balanced routing from source %d: %lld %lld", s,
              (long long)bal[2 * s], (long long)bal[2 * s + 1]);
    float untouched[3] = {7, 7, 7};
    const int64_t c4[4] = {1, 1, 1, 0}, d4[4] = {0, 1, 2, 3};
    CHECK(ds4_comm_allgatherv(p, send, 1, untouched, c4, d4, sizeof(float)) == DS4_OK && untouched[0] == 7 &&
          untouched[1] == 7 && untouched[2] == 7, "a plan moves no data");
    double px[1] = {2.5};
    CHECK(ds4_comm_sum_f64(p, px, 1) == DS4_OK && px[0] == 2.5);
    q = (ds4_comm_req *)&q;
    CHECK(ds4_comm_isend(p, send, 2, sizeof(float), 2, 0, &q) == DS4_OK && q == NULL &&
              ds4_comm_irecv(p, untouched, 2, sizeof(float), 0, 0, &q) == DS4_OK && q == NULL && untouched[0] == 7,
          "a plan's point to point moves nothing and completes at once");
    CHECK(ds4_comm_isend(p, send, 2, sizeof(float), 1, 0, &q) != DS4_OK, "a send to this rank itself");
    CHECK(ds4_comm_isend(c, send, 2, sizeof(float), 0, 0, &q) != DS4_OK &&
              ds4_comm_irecv(c, got, 2, sizeof(float), 1, 0, &q) != DS4_OK,
          "one process has no peer: %s", ds4_errmsg());
    CHECK(ds4_comm_split(p, 0, 0, 2, 1, &sub) == DS4_OK && sub && ds4_comm_is_plan(sub) && ds4_comm_size(sub) == 2 &&
          ds4_comm_rank(sub) == 1);
    ds4_comm_free(sub);
    ds4_comm_free(p);
}

/* The host-staged communicator over one process, on cpu-guard buffers (unreachable from the host outside
 * the backend's calls): an all-gather lands its segment and leaves the device bytes around it as they
 * were; an all-to-all likewise. */
static void test_comm_staged_one_process(void) {
    const struct ds4_kernel_backend *gb = NULL;
    CHECK(ds4_backend_find("--device", "cpu-guard", &gb) == DS4_OK, "%s", ds4_errmsg());
    const ds4_exec ex = {.backend = gb};
    ds4_comm *s = NULL;
    CHECK(ds4_comm_staged(ds4_comm_self(), &ex, &s) == DS4_OK && s && s->ops == &ds4_comm_ops_staged, "%s",
          ds4_errmsg());
    float *dsend = ds4_dev_alloc(&ex, DS4_MEM_COMM, 5 * sizeof(float)), *drecv = ds4_dev_alloc(&ex, DS4_MEM_COMM, 6 * sizeof(float));
    if (!s || !dsend || !drecv) return;
    const float send[5] = {1, 2, 3, 4, 5}, before[6] = {-1, -1, -1, -1, -1, -1};
    float got[6];
    ds4_dev_to_device(&ex, dsend, send, sizeof send);
    ds4_dev_to_device(&ex, drecv, before, sizeof before);
    const int64_t cnt3[1] = {3}, at2[1] = {2}, at1[1] = {1};
    ds4_comm_req *q = (ds4_comm_req *)&q;
    CHECK(ds4_comm_iallgatherv(s, dsend, 3, drecv, cnt3, at2, sizeof(float), &q) == DS4_OK && q == NULL, "%s",
          ds4_errmsg());
    ds4_dev_to_host(&ex, got, drecv, sizeof got);
    CHECK(got[0] == -1 && got[1] == -1 && got[2] == 1 && got[3] == 2 && got[4] == 3 && got[5] == -1,
          "staged all-gather: %g %g %g %g %g %g", got[0], got[1], got[2], got[3], got[4], got[5]);
    CHECK(ds4_comm_alltoallv(s, dsend, cnt3, at1, drecv, cnt3, at2, sizeof(float)) == DS4_OK);
    ds4_dev_to_host(&ex, got, drecv, sizeof got);
    CHECK(got[0] == -1 && got[1] == -1 && got[2] == 2 && got[3] == 3 && got[4] == 4 && got[5] == -1,
          "staged all-to-all: %g %g %g %g %g %g", got[0], got[1], got[2], got[3], got[4], got[5]);
    ds4_comm *sub = NULL;
    CHECK(ds4_comm_split(s, 0, 0, 1, 0, &sub) == DS4_OK && sub && sub->ops == &ds4_comm_ops_staged, "a staged split");
    ds4_comm_free(sub);
    ds4_comm_free(s);
    ds4_dev_free(&ex, dsend);
    ds4_dev_free(&ex, drecv);
}

/* Point to point under MPI, around a ring: rank r sends {1000·r + i} to r + 1 and receives r − 1's, on the
 * host and through the staged communicator on cpu-guard buffers. */
static void test_comm_ring(void) {
    ds4_comm *world = ds4_comm_world();
    const int W = ds4_comm_size(world), me = ds4_comm_rank(world), next = (me + 1) % W, prev = (me + W - 1) % W;
    enum { N = 1000 };
    float out[N], in[N];
    for (int i = 0; i < N; i++) out[i] = (float)(1000 * me + i), in[i] = -1;
    ds4_comm_req *rq = NULL, *sq = NULL;
    CHECK(ds4_comm_irecv(world, in, N, sizeof(float), prev, 7, &rq) == DS4_OK && rq, "%s", ds4_errmsg());
    CHECK(ds4_comm_isend(world, out, N, sizeof(float), next, 7, &sq) == DS4_OK && sq, "%s", ds4_errmsg());
    CHECK(ds4_comm_wait(sq) == DS4_OK && ds4_comm_wait(rq) == DS4_OK, "%s", ds4_errmsg());
    int bad = 0;
    for (int i = 0; i < N; i++) bad += in[i] != (float)(1000 * prev + i);
    CHECK(bad == 0, "rank %d: %d of %d elements from rank %d wrong", me, bad, N, prev);
    /* ds4_comm_test: a receive whose sender has not sent yet (it sends after the barrier) is not complete;
     * once sent, testing (without blocking) finds it complete, and then the send too; NULL is complete */
    CHECK(ds4_comm_test(NULL));
    CHECK(ds4_comm_irecv(world, in, N, sizeof(float), prev, 9, &rq) == DS4_OK && rq, "%s", ds4_errmsg());
    CHECK(!ds4_comm_test(rq), "rank %d: a receive complete before anything was sent", me);
    CHECK(ds4_comm_barrier(world) == DS4_OK && ds4_comm_isend(world, out, N, sizeof(float), next, 9, &sq) == DS4_OK);
    long tries = 0;
    while (!(ds4_comm_test(rq) && ds4_comm_test(sq)) && tries < 100000000) tries++;
    CHECK(ds4_comm_test(rq) && ds4_comm_test(sq), "rank %d: the ring's send and receive never tested complete", me);
    CHECK(ds4_comm_wait(sq) == DS4_OK && ds4_comm_wait(rq) == DS4_OK, "%s", ds4_errmsg());
    const struct ds4_kernel_backend *gb = NULL;
    CHECK(ds4_backend_find("--device", "cpu-guard", &gb) == DS4_OK);
    const ds4_exec ex = {.backend = gb};
    ds4_comm *s = NULL;
    CHECK(ds4_comm_staged(world, &ex, &s) == DS4_OK && s, "%s", ds4_errmsg());
    float *dout = ds4_dev_alloc(&ex, DS4_MEM_COMM, sizeof out), *din = ds4_dev_alloc(&ex, DS4_MEM_COMM, sizeof in);
    if (!s || !dout || !din) return;
    ds4_dev_to_device(&ex, dout, out, sizeof out);
    CHECK(ds4_comm_irecv(s, din, N, sizeof(float), prev, 8, &rq) == DS4_OK && ds4_comm_isend(s, dout, N, sizeof(float),
                                                                                           next, 8, &sq) == DS4_OK);
    CHECK(ds4_comm_wait(sq) == DS4_OK && ds4_comm_wait(rq) == DS4_OK, "%s", ds4_errmsg());
    ds4_dev_to_host(&ex, in, din, sizeof in);
    bad = 0;
    for (int i = 0; i < N; i++) bad += in[i] != (float)(1000 * prev + i);
    CHECK(bad == 0, "rank %d, staged: %d of %d elements from rank %d wrong", me, bad, N, prev);
    ds4_comm_free(s);
    ds4_dev_free(&ex, dout);
    ds4_dev_free(&ex, din);
}

/* EP's receive counts under MPI: rank r sends rank q the block {100·r + 10·q, 100·r + 10·q + 1}; each
 * rank receives, from every source s, the block s addressed to it. */
static void test_comm_alltoall_counts(void) {
    ds4_comm *world = ds4_comm_world();
    const int W = ds4_comm_size(world), me = ds4_comm_rank(world);
    int64_t send[2 * MAX_RANKS], recv[2 * MAX_RANKS] = {0};
    for (int q = 0; q < W; q++) send[2 * q] = 100 * me + 10 * q, send[2 * q + 1] = 100 * me + 10 * q + 1;
    ds4_comm_req *q = NULL;
    CHECK(ds4_comm_ialltoall_counts(world, send, 2, recv, &q) == DS4_OK && q != NULL, "%s", ds4_errmsg());
    CHECK(ds4_comm_wait(q) == DS4_OK, "%s", ds4_errmsg());
    for (int s = 0; s < W; s++)
        CHECK(recv[2 * s] == 100 * s + 10 * me && recv[2 * s + 1] == 100 * s + 10 * me + 1,
              "rank %d from %d: %lld %lld", me, s, (long long)recv[2 * s], (long long)recv[2 * s + 1]);
}

/* ------------------------------------------------------------------ simulated link, exposed time, trace */
static double now_s(void) { return ds4_now(); }

/* A 0.1 Gb/s link with 20 ms latency under a 64 KiB-per-rank all-gather: a blocking one lasts at least
 * the modelled time and counts it as exposed; two started back to back share the link (the second ends
 * a transfer later); one left in flight while this rank computes (sleeps) longer than that costs
 * little to wait for. */
static void test_sim_link(void) {
    ds4_comm *world = ds4_comm_world();
    const int W = ds4_comm_size(world);
    const int64_t n = 16384; /* floats per rank */
    float *send = calloc((size_t)n, sizeof(float)), *recv = calloc((size_t)(n * W), sizeof(float));
    int64_t cnt[MAX_RANKS], dsp[MAX_RANKS];
    for (int r = 0; r < W; r++) cnt[r] = n, dsp[r] = r * n;
    const double model = 20e-3 + (double)((W - 1) * n * 4) * 8 / 0.1e9;
    CHECK(ds4_comm_set_link(0.1, 20000) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_comm_set_link(-1, 0) != DS4_OK, "a negative bandwidth is refused");
    double x0[DS4_NUM_LANES], x1[DS4_NUM_LANES];
    ds4_comm_exposed(x0);
    double t0 = now_s();
    CHECK(ds4_comm_allgatherv(world, send, n, recv, cnt, dsp, sizeof(float)) == DS4_OK, "%s", ds4_errmsg());
    double blocking = now_s() - t0;
    ds4_comm_exposed(x1);
    CHECK(blocking >= model, "blocking all-gather took %.4f s, the link model says >= %.4f s", blocking, model);
    CHECK(x1[DS4_LANE_OTHER] - x0[DS4_LANE_OTHER] >= model, "exposed %.4f s < %.4f s",
          x1[DS4_LANE_OTHER] - x0[DS4_LANE_OTHER], model);
    CHECK(x1[DS4_LANE_FSDP] == x0[DS4_LANE_FSDP] && x1[DS4_LANE_EP] == x0[DS4_LANE_EP], "the world's lane is 'other'");
    ds4_comm_req *a = NULL, *b = NULL;
    t0 = now_s();
    CHECK(ds4_comm_iallgatherv(world, send, n, recv, cnt, dsp, sizeof(float), &a) == DS4_OK);
    CHECK(ds4_comm_iallgatherv(world, send, n, recv, cnt, dsp, sizeof(float), &b) == DS4_OK);
    CHECK(a != NULL && b != NULL, "MPI collectives in flight have requests");
    CHECK(ds4_comm_wait(a) == DS4_OK && ds4_comm_wait(b) == DS4_OK);
    double two = now_s() - t0;
    CHECK(two >= 2 * model, "two transfers on one link took %.4f s < %.4f s", two, 2 * model);
    CHECK(ds4_comm_iallgatherv(world, send, n, recv, cnt, dsp, sizeof(float), &a) == DS4_OK);
    for (double until = now_s() + 4 * model; now_s() < until;) ds4_comm_progress(); /* "compute" */
    ds4_comm_exposed(x0);
    CHECK(ds4_comm_wait(a) == DS4_OK);
    ds4_comm_exposed(x1);
    CHECK(x1[DS4_LANE_OTHER] - x0[DS4_LANE_OTHER] < model, "a hidden transfer still exposed %.4f s (model %.4f s)",
          x1[DS4_LANE_OTHER] - x0[DS4_LANE_OTHER], model);
    CHECK(ds4_comm_set_link(0, 0) == DS4_OK);
    free(send);
    free(recv);
}

/* The trace of an overlapped FSDP + EP step: rank 0 writes one JSON file; every rank is a process with
 * the lanes compute, fsdp and ep, and complete events on them (all-gathers on fsdp, dispatches on ep). */
static void test_trace(void) {
    ds4_comm *world = ds4_comm_world();
    const int W = ds4_comm_size(world), rank = ds4_comm_rank(world);
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-b.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m = NULL;
    ds4_fsdp *f = NULL;
    CHECK(ds4_model_create(NULL, &c, true, &m) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_fsdp_create(m, world, 2, &f) == DS4_OK, "%s", ds4_errmsg());
    if (!f) return;
    CHECK(ds4_fsdp_set_prefetch(f, 1) == DS4_OK && ds4_fsdp_init_random(f, 7) == DS4_OK);
    CHECK(ds4_fsdp_set_prefetch(f, DS4_PREFETCH_MAX + 1) != DS4_OK, "a depth beyond the maximum is refused");
    int64_t pid = rank == 0 ? (int64_t)getpid() : 0; /* rank 0's file name, known to all */
    CHECK(ds4_comm_sum_i64(world, &pid, 1) == DS4_OK);
    char path[128];
    snprintf(path, sizeof path, "/tmp/ds4-test-dist-trace-%lld.json", (long long)pid);
    CHECK(ds4_trace_begin(world) == DS4_OK, "%s", ds4_errmsg());
    int32_t ids[64];
    ref_batch_ids(&c, 99, rank, ids);
    ds4_pass_opts o = {.need_backward = true, .hooks = ds4_fsdp_hooks(f)};
    ds4_pass *p = NULL;
    CHECK(ds4_forward(m, ids, kB, kT, &o, &p) == DS4_OK, "%s", ds4_errmsg());
    if (p) CHECK(ds4_backward(m, p) == DS4_OK, "%s", ds4_errmsg());
    ds4_pass_free(p);
    CHECK(ds4_trace_end(world, path) == DS4_OK, "%s", ds4_errmsg());
    ds4_fsdp_free(f);
    ds4_model_free(m);
    if (rank != 0) return;
    FILE *fp = fopen(path, "rb");
    CHECK(fp != NULL, "%s: no trace", path);
    if (!fp) return;
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    rewind(fp);
    char *text = malloc((size_t)len + 1);
    CHECK(fread(text, 1, (size_t)len, fp) == (size_t)len);
    fclose(fp);
    cJSON *root = cJSON_ParseWithLength(text, (size_t)len);
    CHECK(root != NULL, "%s is not JSON", path);
    const cJSON *ev = cJSON_GetObjectItemCaseSensitive(root, "traceEvents");
    CHECK(cJSON_IsArray(ev), "no traceEvents array");
    int lanes[MAX_RANKS][3] = {{0}}, gathers[MAX_RANKS] = {0}, alltoall_ep[MAX_RANKS] = {0}, compute[MAX_RANKS] = {0};
    int fsdp_tid[MAX_RANKS], ep_tid[MAX_RANKS], bad = 0;
    for (int r = 0; r < MAX_RANKS; r++) fsdp_tid[r] = ep_tid[r] = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, ev) { /* names of the lanes first */
        const cJSON *nm = cJSON_GetObjectItemCaseSensitive(e, "name"), *pid_ = cJSON_GetObjectItemCaseSensitive(e, "pid");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(e, "args"), *tid = cJSON_GetObjectItemCaseSensitive(e, "tid");
        int r = cJSON_IsNumber(pid_) ? pid_->valueint : -1;
        if (r < 0 || r >= W) {
            bad++;
            continue;
        }
        if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "thread_name") && args && cJSON_IsNumber(tid)) {
            const cJSON *lane = cJSON_GetObjectItemCaseSensitive(args, "name");
            const char *s = cJSON_IsString(lane) ? lane->valuestring : "";
            if (!strcmp(s, "compute")) lanes[r][0]++;
            if (!strcmp(s, "fsdp")) lanes[r][1]++, fsdp_tid[r] = tid->valueint;
            if (!strcmp(s, "ep")) lanes[r][2]++, ep_tid[r] = tid->valueint;
        }
    }
    cJSON_ArrayForEach(e, ev) {
        const cJSON *ph = cJSON_GetObjectItemCaseSensitive(e, "ph"), *nm = cJSON_GetObjectItemCaseSensitive(e, "name");
        const cJSON *tid = cJSON_GetObjectItemCaseSensitive(e, "tid"), *dur = cJSON_GetObjectItemCaseSensitive(e, "dur");
        int r = cJSON_GetObjectItemCaseSensitive(e, "pid")->valueint;
        if (!cJSON_IsString(ph) || strcmp(ph->valuestring, "X")) continue;
        if (!cJSON_IsNumber(dur) || dur->valuedouble < 0 || !cJSON_IsNumber(tid)) bad++;
        else if (tid->valueint == 0 && !strcmp(nm->valuestring, "compute")) compute[r]++;
        else if (tid->valueint == fsdp_tid[r] && !strcmp(nm->valuestring, "all-gather")) gathers[r]++;
        else if (tid->valueint == ep_tid[r] && !strcmp(nm->valuestring, "dispatch")) alltoall_ep[r]++;
    }
    CHECK(bad == 0, "%d malformed events", bad);
    for (int r = 0; r < W; r++) {
        CHECK(lanes[r][0] == 1 && lanes[r][1] == 1 && lanes[r][2] == 1, "rank %d: lanes compute %d fsdp %d ep %d", r,
              lanes[r][0], lanes[r][1], lanes[r][2]);
        CHECK(compute[r] > 0 && gathers[r] > 0 && alltoall_ep[r] > 0, "rank %d: %d compute, %d all-gather, %d EP events",
              r, compute[r], gathers[r], alltoall_ep[r]);
    }
    cJSON_Delete(root);
    free(text);
    remove(path);
}

static int child_main(void) {
    CHECK(ds4_dist_init() == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *world = ds4_comm_world();
    const int W = ds4_comm_size(world);
    if (W > MAX_RANKS || W % 2) {
        fprintf(stderr, "test_dist: expected an even number of ranks <= %d, got %d\n", MAX_RANKS, W);
        return 1;
    }
    RUN(test_comm_alltoall_counts);
    RUN(test_comm_ring);
    RUN(test_fsdp_tiny_a);
    RUN(test_fsdp_ep_tiny_a);
    RUN(test_fsdp_ep_tiny_b);
    RUN(test_memplan_fsdp);
    RUN(test_memplan_fsdp_ep);
    RUN(test_memplan_fsdp_ep_recompute);
    RUN(test_shard_sizes);
    RUN(test_fsdp_adamw);
    RUN(test_fsdp_ep_adamw);
    RUN(test_optimizer_counted_once_ep);
    RUN(test_memplan_muon);
    RUN(test_memplan_muon_ep_swap);
    RUN(test_fsdp_overlap_tiny_a);
    RUN(test_fsdp_overlap_ep_tiny_b);
    RUN(test_memplan_overlap);
    RUN(test_memplan_overlap_ep_depth2);
    RUN(test_sim_link);
    RUN(test_trace);
    RUN(test_fbo_ep);
    RUN(test_fbo_ep_recompute_swap);
    RUN(test_fbo_full_recompute_swap);
    RUN(test_memplan_fbo);
    RUN(test_memplan_fbo_ep);
    if (W > 2) {
        RUN(test_fbo_ep_all);
        RUN(test_fsdp_ep_all_tiny_a);
        RUN(test_memplan_ep_all_recompute);
    }
    fprintf(stderr, "rank %d: %d ok, %d not ok\n", ds4_comm_rank(world), t_passed, t_failed);
    ds4_dist_finalize();
    return t_failed ? 1 : 0;
}

/* The parent: runs `ranks` ranks under mpirun and checks that every rank passed all `checks`. */
static void under_mpirun(int ranks, int checks) {
    if (!t_mpirun_wanted(ranks)) return;
    const int ok = t_mpirun_self(ranks, "--child", checks);
    CHECK(ok == ranks, "%d of %d ranks passed all %d checks", ok, ranks, checks);
}

static void test_two_ranks(void) { under_mpirun(2, 25); }
static void test_four_ranks(void) { under_mpirun(4, 28); }

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--child")) return child_main();
    /* a world of one process: the communicator tables, sharding, hooks and the plan communicator without MPI */
    RUN(test_comm_tables_complete);
    RUN(test_comm_self_and_plan);
    RUN(test_comm_staged_one_process);
    RUN(test_fsdp_tiny_a);
    RUN(test_memplan_fsdp);
    RUN(test_memplan_fsdp_recompute);
    RUN(test_fsdp_overlap_tiny_a);
    RUN(test_memplan_overlap);
    RUN(test_fsdp_adamw);
    RUN(test_optimizer_counted_once);
    RUN(test_fbo_full_recompute_swap); /* one process: the passes take turns at the gathers */
    RUN(test_memplan_fbo);
    RUN(test_two_ranks);
    RUN(test_four_ranks);
    TEST_MAIN_END("test_dist");
}
