/* The bf16 compute copy of mixed precision (docs/mixed-precision.md, "The bf16 compute copy"):
 *  - the compute dtype rule of the parameter table: the GEMMs' matrices bf16, the rest fp32, regions of one
 *    dtype each;
 *  - a whole model with the copy gives bit for bit the losses and gradients of the same pass on fp32
 *    weights rounded inside each GEMM call, and its GEMMs read nothing else: with its fp32 GEMM matrices
 *    overwritten by NaN the pass gives the same bits;
 *  - under FSDP (+ EP) on mpirun -np 2: each rank's losses equal a single process's on fp32 weights rounded
 *    per call, the reduce-scattered gradients its ordered sum, bit for bit; gathering a group maps only the
 *    copy of its bf16 regions (2 bytes per element; fp32 regions as before) and the all-gathers carry 2
 *    bytes per element of them: half the bytes of the fp32 model's gathers for the layers' matrices;
 *  - memplan plans a sharded bf16 step byte for byte (planned == measured per category). */
#include "ds4/dist.h"
#include "ds4/memplan.h"
#include "ds4/model.h"
#include "ds4/trainer.h"
#include "test.h"
#include "test_fsdp_ref.h"
#include "test_mpi.h"

#include <math.h>

#define MAX_RANKS 2

/* The context of the bf16 passes: bf16 GEMMs, as mixed precision runs them. */
static const ds4_exec k_bf16_gemms = {.matmul_precision = DS4_MATMUL_BF16};

static bool load_cfg(const char *path, ds4_config *c) {
    ds4_status st = ds4_config_load(path, c);
    CHECK(st == DS4_OK, "%s", ds4_errmsg());
    return st == DS4_OK;
}

/* ------------------------------------------------------------------ the table's rule */

static void test_compute_dtypes(void) {
    ds4_config c;
    if (!load_cfg("tests/configs/tiny-a.json", &c)) return;
    ds4_model *m = NULL;
    CHECK(ds4_model_create_bf16(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    static const struct {
        const char *name;
        bool gemm;
    } k[] = {
        {"embed.weight", false},                      /* a lookup */
        {"head.weight", true},
        {"hc_head_fn", false},                        /* mixed by hc_head in fp32 */
        {"norm.weight", false},
        {"layers.0.attn.wq_a.weight", true},
        {"layers.0.attn.wo_a.weight", true},          /* the grouped projection */
        {"layers.0.attn.attn_sink", false},
        {"layers.0.hc_attn_fn", false},
        {"layers.0.ffn.gate.weight", true},           /* the router's GEMM */
        {"layers.0.ffn.experts.0.w2.weight", true},
        {"layers.0.ffn.shared_experts.w1.weight", true},
        {"mtp.0.e_proj.weight", true},
    };
    for (size_t i = 0; i < sizeof k / sizeof *k; i++) {
        const ds4_param *p = ds4_model_find(m, k[i].name);
        CHECK(p && p->gemm == k[i].gemm, "%s: compute dtype %s, expected %s", k[i].name,
              p ? (p->gemm ? "bf16" : "fp32") : "(missing)", k[i].gemm ? "bf16" : "fp32");
    }
    /* every float parameter lies in a region of its own compute dtype */
    const float *flat = ds4_model_params_flat(m);
    int64_t bad = 0, nbf16 = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_in_flat(p)) continue;
        const int64_t a = p->data - flat;
        for (int64_t r = 0; r < ds4_model_nregions(m); r++) {
            const ds4_region *g = ds4_model_region(m, r);
            if (a >= g->start && a < g->end) bad += g->bf16 != p->gemm || a + p->numel > g->end;
        }
        nbf16 += p->gemm;
    }
    CHECK(bad == 0 && nbf16 > 0, "%lld parameters in a region of the other compute dtype", (long long)bad);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------ a whole model */

static int64_t differing(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += memcmp(a + i, b + i, sizeof(float)) != 0;
    return d;
}

/* The same pass on the copy and on fp32 weights rounded per call; then on the copy with the fp32 GEMM
 * matrices destroyed. */
static void copy_matches_per_call(const char *cfg_path) {
    ds4_config c;
    if (!load_cfg(cfg_path, &c)) return;
    ds4_model *ref = NULL, *m = NULL;
    CHECK(ds4_model_create(&k_bf16_gemms, &c, false, &ref) == DS4_OK &&
              ds4_model_create_bf16(&k_bf16_gemms, &c, false, &m) == DS4_OK,
          "%s", ds4_errmsg());
    if (!ref || !m) return;
    ds4_model_init_random(ref, 11);
    ds4_model_init_random(m, 11);
    ds4_model_refresh_bf16(m);
    const int64_t n = ds4_model_numel(m);
    CHECK(n == ds4_model_numel(ref), "a whole model has no region padding: same layout");
    int32_t ids[64];
    ref_batch_ids(&c, 77, 0, ids);
    double lref = 0, lcopy = 0, lnan = 0;
    ds4_model_zero_grad(ref);
    ds4_model_zero_grad(m);
    bool ok = ref_pass(ref, ids, NULL, true, &lref) && ref_pass(m, ids, NULL, true, &lcopy);
    CHECK(ok && lref == lcopy, "%s: total loss %.17g on the copy, %.17g rounded per call", cfg_path, lcopy, lref);
    int64_t d = differing(ds4_model_grads_flat(ref), ds4_model_grads_flat(m), n);
    CHECK(d == 0, "%s: %lld gradient elements differ between the copy and per-call rounding", cfg_path, (long long)d);
    /* the GEMMs read only the copy: NaN in every fp32 GEMM matrix changes no bit */
    float *g1 = malloc((size_t)n * sizeof(float));
    memcpy(g1, ds4_model_grads_flat(m), (size_t)n * sizeof(float));
    int64_t nan_elems = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_in_flat(p) || !p->gemm) continue;
        for (int64_t k = 0; k < p->numel; k++) p->data[k] = NAN;
        nan_elems += p->numel;
    }
    ds4_model_zero_grad(m);
    ok = ref_pass(m, ids, NULL, true, &lnan);
    CHECK(ok && lnan == lcopy && differing(g1, ds4_model_grads_flat(m), n) == 0,
          "%s: with NaN fp32 matrices (%lld elements) the pass changed: loss %.17g vs %.17g", cfg_path,
          (long long)nan_elems, lnan, lcopy);
    /* new weights reach the GEMMs through a refresh, and again give the per-call bits */
    ds4_model_init_random(ref, 12);
    ds4_model_init_random(m, 12);
    ds4_model_refresh_bf16(m);
    ds4_model_zero_grad(ref);
    ds4_model_zero_grad(m);
    double l12 = 0, lref12 = 0;
    ok = ref_pass(ref, ids, NULL, true, &lref12) && ref_pass(m, ids, NULL, true, &l12);
    CHECK(ok && l12 == lref12 && l12 != lcopy, "%s: after new weights and a refresh: loss %.17g, per call %.17g, before %.17g",
          cfg_path, l12, lref12, lcopy);
    CHECK(differing(ds4_model_grads_flat(ref), ds4_model_grads_flat(m), n) == 0, "%s: gradients after a refresh", cfg_path);
    free(g1);
    ds4_model_free(ref);
    ds4_model_free(m);
}

static void test_whole_tiny_a(void) { copy_matches_per_call("tests/configs/tiny-a.json"); }
static void test_whole_tiny_b(void) { copy_matches_per_call("tests/configs/tiny-b.json"); }

/* ------------------------------------------------------------------ FSDP (+ EP) */

static void fsdp_matches_per_call(const char *cfg_path, int ep) {
    ds4_comm *world = ds4_comm_world();
    const int rank = ds4_comm_rank(world);
    ds4_config c;
    if (!load_cfg(cfg_path, &c)) return;
    reference ref;
    CHECK(reference_run(&c, ds4_comm_size(world), 77, true, &ref), "%s", ds4_errmsg());
    ds4_model *m = NULL;
    ds4_fsdp *f = NULL;
    CHECK(ds4_model_create_bf16(&k_bf16_gemms, &c, true, &m) == DS4_OK, "%s", ds4_errmsg());
    if (m) CHECK(ds4_fsdp_create(m, world, ep, &f) == DS4_OK, "%s", ds4_errmsg());
    if (f) {
        CHECK(ds4_fsdp_init_random(f, 7) == DS4_OK);
        ds4_fsdp_refresh_bf16(f);
        int32_t ids[64];
        ref_batch_ids(&c, 77, rank, ids);
        double got = 0;
        if (ref_pass(m, ids, ds4_fsdp_hooks(f), true, &got))
            CHECK(got == ref.total[rank], "%s ep=%d rank %d: total loss %.17g, single process %.17g", cfg_path, ep,
                  rank, got, ref.total[rank]);
        const int64_t n = ds4_model_numel(m);
        float *full = rank == 0 ? calloc((size_t)n, sizeof(float)) : NULL;
        CHECK(ds4_fsdp_collect(f, true, full, 0) == DS4_OK, "%s", ds4_errmsg());
        if (rank == 0) {
            const char *first = "";
            float *want = expected_grads(&ref, ep);
            int64_t bad = compare_params(m, full, ref.m, want, &first);
            CHECK(bad == 0, "%s ep=%d: %lld gradient elements differ from the ordered sum (first %s)", cfg_path, ep,
                  (long long)bad, first);
            free(want);
        }
        free(full);
    }
    ds4_fsdp_free(f);
    ds4_model_free(m);
    reference_free(&ref);
}

static void test_fsdp_tiny_a(void) { fsdp_matches_per_call("tests/configs/tiny-a.json", 1); }
static void test_fsdp_ep_tiny_b(void) { fsdp_matches_per_call("tests/configs/tiny-b.json", 2); }

/* Length of rank r's piece of a region of len elements over n ranks (FSDP's equal chunks). */
static int64_t piece_len(int64_t len, int n, int r) {
    const int64_t chunk = (len + n - 1) / n, a = (int64_t)r * chunk, b = a + chunk < len ? a + chunk : len;
    return b > a ? b - a : 0;
}

typedef struct {
    int64_t wire;   /* all-gather bytes received from the other ranks */
    int64_t mapped; /* DS4_MEM_PARAM bytes the gather mapped */
} group_cost;

/* Gathers group g of an FSDP (ep 1) model and drops it again, measuring what moved and what was mapped;
 * *want: the same predicted from the regions (2 bytes per element of a bf16 region, 4 otherwise). */
static group_cost gather_cost(ds4_model *m, ds4_fsdp *f, int64_t g, group_cost *want) {
    const ds4_param_hooks *h = ds4_fsdp_hooks(f);
    const int n = ds4_comm_size(ds4_comm_world()), me = ds4_comm_rank(ds4_comm_world());
    *want = (group_cost){0, 0};
    for (int64_t i = 0; i < ds4_model_nregions(m); i++) {
        const ds4_region *r = ds4_model_region(m, i);
        if (r->group != g) continue;
        const int64_t elem = r->bf16 ? 2 : 4, len = r->end - r->start;
        const int64_t next = i + 1 < ds4_model_nregions(m) ? ds4_model_region(m, i + 1)->start : ds4_model_numel(m);
        want->wire += (len - piece_len(len, n, me)) * elem;
        want->mapped += (next - r->start) * elem;
    }
    int64_t b0[DS4_NUM_LANES], b1[DS4_NUM_LANES];
    ds4_mem_stats s0, s1;
    ds4_comm_allgather_bytes(b0);
    ds4_mem_get(&s0);
    CHECK(h->gather(h->ctx, g) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_get(&s1);
    ds4_comm_allgather_bytes(b1);
    h->drop(h->ctx, g);
    return (group_cost){b1[DS4_LANE_FSDP] - b0[DS4_LANE_FSDP], s1.live[DS4_MEM_PARAM] - s0.live[DS4_MEM_PARAM]};
}

/* Per group: bytes on the wire and mapped, fp32 model vs bf16 model, each exactly as its regions predict:
 * 2 bytes an element of a bf16 region (its fp32 range unmapped), 4 of an fp32 one. (A tiny model's layer
 * is not mostly matrices: its mHC fn matrices, kept fp32, weigh as much as its projections.) */
static void test_gather_bytes(void) {
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    if (!load_cfg("tests/configs/tiny-a.json", &c)) return;
    ds4_model *m32 = NULL, *m16 = NULL;
    ds4_fsdp *f32 = NULL, *f16 = NULL;
    CHECK(ds4_model_create(NULL, &c, true, &m32) == DS4_OK && ds4_model_create_bf16(NULL, &c, true, &m16) == DS4_OK,
          "%s", ds4_errmsg());
    if (!m32 || !m16) return;
    CHECK(ds4_fsdp_create(m32, world, 1, &f32) == DS4_OK && ds4_fsdp_create(m16, world, 1, &f16) == DS4_OK, "%s",
          ds4_errmsg());
    if (!f32 || !f16) return;
    int64_t tot32 = 0, tot16 = 0;
    for (int64_t g = 0; g < ds4_model_ngroups(m16); g++) {
        group_cost w32, w16;
        const group_cost c32 = gather_cost(m32, f32, g, &w32), c16 = gather_cost(m16, f16, g, &w16);
        CHECK(c32.mapped == w32.mapped && c16.mapped == w16.mapped, "group %lld: mapped %lld / %lld, expected %lld / %lld",
              (long long)g, (long long)c32.mapped, (long long)c16.mapped, (long long)w32.mapped, (long long)w16.mapped);
        if (ds4_comm_size(world) > 1)
            CHECK(c32.wire == w32.wire && c16.wire == w16.wire, "group %lld: %lld / %lld bytes gathered, expected %lld / %lld",
                  (long long)g, (long long)c32.wire, (long long)c16.wire, (long long)w32.wire, (long long)w16.wire);
        tot32 += c32.wire, tot16 += c16.wire;
        if (g >= 1 && g <= c.n_layers && ds4_comm_size(world) > 1)
            CHECK(c16.wire < c32.wire && c16.mapped < c32.mapped, "layer group %lld: bf16 gathers %lld bytes into %lld, fp32 %lld into %lld",
                  (long long)g, (long long)c16.wire, (long long)c16.mapped, (long long)c32.wire, (long long)c32.mapped);
    }
    if (ds4_comm_rank(world) == 0 && ds4_comm_size(world) > 1)
        t_note("  tiny-a, %d ranks, one gather of every group: fp32 %lld bytes received, bf16 %lld (%.3f)",
               ds4_comm_size(world), (long long)tot32, (long long)tot16, (double)tot16 / (double)tot32);
    ds4_fsdp_free(f32);
    ds4_fsdp_free(f16);
    ds4_model_free(m32);
    ds4_model_free(m16);
}

/* Bytes this rank's all-gathers receive over one forward + backward pass (a step of one micro-batch) of an
 * FSDP (ep 1) model of tiny-a, fp32 or with the bf16 copy. */
static int64_t pass_gather_bytes(bool bf16) {
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    if (!load_cfg("tests/configs/tiny-a.json", &c)) return -1;
    ds4_model *m = NULL;
    ds4_fsdp *f = NULL;
    const ds4_exec ex = {.matmul_precision = bf16 ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32};
    CHECK((bf16 ? ds4_model_create_bf16 : ds4_model_create)(&ex, &c, true, &m) == DS4_OK, "%s", ds4_errmsg());
    if (m) CHECK(ds4_fsdp_create(m, world, 1, &f) == DS4_OK, "%s", ds4_errmsg());
    int64_t b0[DS4_NUM_LANES], b1[DS4_NUM_LANES];
    ds4_comm_allgather_bytes(b0);
    if (f) {
        CHECK(ds4_fsdp_init_random(f, 7) == DS4_OK);
        ds4_fsdp_refresh_bf16(f);
        int32_t ids[64];
        ref_batch_ids(&c, 77, ds4_comm_rank(world), ids);
        double loss;
        ref_pass(m, ids, ds4_fsdp_hooks(f), true, &loss);
        }
    ds4_comm_allgather_bytes(b1);
    ds4_fsdp_free(f);
    ds4_model_free(m);
    return b1[DS4_LANE_FSDP] - b0[DS4_LANE_FSDP];
}

static void test_step_gather_bytes(void) {
    const int64_t b32 = pass_gather_bytes(false), b16 = pass_gather_bytes(true);
    CHECK(b16 > 0 && b16 < b32, "one pass gathers %lld bytes in bf16, %lld in fp32", (long long)b16, (long long)b32);
    if (ds4_comm_rank(ds4_comm_world()) == 0)
        t_note("  tiny-a, 2 ranks, one forward + backward: rank 0 receives %lld bytes of parameters in fp32, %lld with "
               "the bf16 copy (%.3f)", (long long)b32, (long long)b16, (double)b16 / (double)b32);
}

/* memplan of this rank's bf16 step == the measured real step, per category. */
static void memplan_bf16_matches(int ep) {
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    if (!load_cfg("tests/configs/tiny-a.json", &c)) return;
    const ds4_step_opts so = {.bf16 = true};
    ds4_step_memory real, plan;
    CHECK(ds4_step_memory_run_dist_opts(&c, kB, kT, &so, false, world, ep, true, &real) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(ds4_comm_size(world), ds4_comm_rank(world), &sim) == DS4_OK);
    CHECK(ds4_step_memory_run_dist_opts(&c, kB, kT, &so, true, sim, ep, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm_free(sim);
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        if (k != DS4_MEM_OTHER)
            CHECK(real.peak[k] == plan.peak[k], "bf16 ep=%d rank %d %s: measured %lld, planned %lld", ep,
                  ds4_comm_rank(world), ds4_mem_cat_name((ds4_mem_cat)k), (long long)real.peak[k],
                  (long long)plan.peak[k]);
}
static void test_memplan_fsdp(void) { memplan_bf16_matches(1); }
static void test_memplan_fsdp_ep(void) { memplan_bf16_matches(2); }

static int child_main(void) {
    CHECK(ds4_dist_init() == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *world = ds4_comm_world();
    if (ds4_comm_size(world) != MAX_RANKS) {
        fprintf(stderr, "test_bf16_copy: expected %d ranks, got %d\n", MAX_RANKS, ds4_comm_size(world));
        return 1;
    }
    RUN(test_fsdp_tiny_a);
    RUN(test_fsdp_ep_tiny_b);
    RUN(test_gather_bytes);
    RUN(test_step_gather_bytes);
    RUN(test_memplan_fsdp);
    RUN(test_memplan_fsdp_ep);
    fprintf(stderr, "rank %d: %d ok, %d not ok\n", ds4_comm_rank(world), t_passed, t_failed);
    ds4_dist_finalize();
    return t_failed ? 1 : 0;
}

static void test_two_ranks(void) {
    const int ok = t_mpirun_self(2, "--child", 0);
    CHECK(ok == 2, "%d of 2 ranks passed all their checks", ok);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--child")) return child_main();
    RUN(test_compute_dtypes);
    RUN(test_whole_tiny_a);
    RUN(test_whole_tiny_b);
    /* a world of one process: sharding, hooks and the plan without MPI */
    RUN(test_fsdp_tiny_a);
    RUN(test_gather_bytes);
    RUN(test_memplan_fsdp);
    RUN(test_two_ranks);
    TEST_MAIN_END("test_bf16_copy");
}
