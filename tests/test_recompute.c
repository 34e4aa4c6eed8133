/* Fine-grained recompute: every policy gives bitwise the same losses, grad norms and gradients as no
 * recompute over 3 optimizer steps; released bytes return to the allocator exactly; each released
 * unit is replayed exactly once; MTP never recomputes; bad flag combinations are rejected. */
#include "ds4/actstore.h"
#include "ds4/io.h"
#include "ds4/model.h"
#include "ds4/recompute.h"
#include "ds4/train.h"
#include "test.h"

typedef struct {
    const char *name;
    const char *argv[12];
} policy;

static const policy k_policies[] = {
    {"off", {NULL}},
    {"csa", {"--recompute-csa-attention", NULL}},
    {"mhc", {"--mhc-recompute", NULL}},
    {"csa+mhc", {"--recompute-csa-attention", "--mhc-recompute", NULL}},
    {"csa+mhc+norm", {"--recompute-csa-attention", "--mhc-recompute", "--recompute-norm", NULL}},
    {"norm-2", {"--recompute-norm", "--recompute-norm-num-layers", "2", NULL}},
    {"full-uniform", {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1", NULL}},
    {"full-block-2", {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2", NULL}},
    {"full-block-1+csa+mhc",
     {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1",
      "--recompute-csa-attention", "--mhc-recompute", NULL}},
};
#define NPOL ((int)(sizeof k_policies / sizeof k_policies[0]))

static ds4_status policy_masks(const policy *p, const ds4_config *c, uint32_t *masks) {
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    int argc = 0;
    while (p->argv[argc]) argc++;
    for (int i = 0; i < argc; i++) {
        bool used;
        DS4_TRY(ds4_recompute_parse_arg(&r, argc, (char **)p->argv, &i, &used));
        if (!used) return ds4_fail(DS4_ERR_ARG, "unknown flag %s", p->argv[i]);
    }
    DS4_TRY(ds4_recompute_validate(&r, c));
    ds4_recompute_masks(&r, c, masks);
    return DS4_OK;
}

typedef struct {
    double loss[3], total[3], gnorm[3];
    float *grads[3];
    int64_t n;
} run_result;

static void make_ids(int32_t *ids, int64_t n, int64_t V) {
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(ds4_rng_u64(17, 5, (uint64_t)i) % (uint64_t)V);
}

/* 3 AdamW steps from the same init under a policy. */
static bool run_steps(const ds4_config *c, const uint32_t *masks, int64_t B, int64_t T, run_result *out) {
    ds4_model *m;
    if (ds4_model_create(NULL, c, false, &m) != DS4_OK) return false;
    ds4_model_init_random(m, 21);
    ds4_optim opt;
    ds4_optim_init(&opt, NULL, m, NULL, 0);
    ds4_adamw_cfg ac = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    int32_t *ids = malloc((size_t)(B * T) * sizeof(int32_t));
    make_ids(ids, B * T, c->vocab_size);
    bool ok = true;
    out->n = ds4_model_numel(m);
    for (int s = 0; s < 3 && ok; s++) {
        const ds4_act_policies pol = {.recompute = masks};
        ds4_pass_opts o = {.need_backward = true, .store = ds4_act_store_of(&pol)};
        ds4_pass *p;
        ds4_model_zero_grad(m);
        ok = ds4_forward(m, ids + 0, B, T, &o, &p) == DS4_OK && ds4_backward(m, p) == DS4_OK;
        if (!ok) break;
        out->loss[s] = ds4_pass_losses(p)->loss;
        out->total[s] = ds4_pass_losses(p)->total_loss;
        ds4_pass_free(p);
        CHECK(ds4_clip_grad_norm(m, 1.0, &out->gnorm[s]) == DS4_OK, "%s", ds4_errmsg());
        out->grads[s] = malloc((size_t)out->n * sizeof(float));
        memcpy(out->grads[s], ds4_model_grads_flat(m), (size_t)out->n * sizeof(float));
        ds4_adamw_step(&opt, m, &ac, 1e-3);
    }
    free(ids);
    ds4_optim_free(&opt);
    ds4_model_free(m);
    return ok;
}

static void free_result(run_result *r) {
    for (int s = 0; s < 3; s++) free(r->grads[s]);
}

/* subset: bit k set = run k_policies[k] */
static void equality_matrix(const char *cfg_path, int64_t B, int64_t T, uint32_t subset) {
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    uint32_t masks[DS4_MAX_LAYERS];
    run_result base = {0};
    CHECK(run_steps(&c, NULL, B, T, &base), "%s", ds4_errmsg());
    for (int k = 1; k < NPOL; k++) {
        if (!(subset & (1u << k))) continue;
        CHECK(policy_masks(&k_policies[k], &c, masks) == DS4_OK, "%s: %s", k_policies[k].name, ds4_errmsg());
        run_result r = {0};
        CHECK(run_steps(&c, masks, B, T, &r), "%s: %s", k_policies[k].name, ds4_errmsg());
        for (int s = 0; s < 3 && r.grads[s]; s++) {
            CHECK(r.loss[s] == base.loss[s] && r.total[s] == base.total[s], "%s %s step %d: loss %.9g vs %.9g",
                  cfg_path, k_policies[k].name, s, r.total[s], base.total[s]);
            CHECK(r.gnorm[s] == base.gnorm[s], "%s %s step %d: grad norm %.9g vs %.9g", cfg_path,
                  k_policies[k].name, s, r.gnorm[s], base.gnorm[s]);
            CHECK(memcmp(r.grads[s], base.grads[s], (size_t)r.n * sizeof(float)) == 0,
                  "%s %s step %d: gradients differ", cfg_path, k_policies[k].name, s);
        }
        free_result(&r);
    }
    free_result(&base);
}

static void test_equality_tiny_a(void) { equality_matrix("tests/configs/tiny-a.json", 2, 64, ~0u); }
/* the larger config: the combined policies (each covers the units of the single ones) */
static void test_equality_tiny_b(void) {
    equality_matrix("tests/configs/tiny-b.json", 2, 150, (1u << 4) | (1u << 6) | (1u << 8));
}

/* Live activation bytes after forward drop by exactly the released units' bytes; each released unit
 * is replayed once in backward; nothing stays live after backward; MTP never releases. */
static void test_release_accounting(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK);
    ds4_model *m;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK);
    ds4_model_init_random(m, 2);
    int32_t ids[2 * 64];
    make_ids(ids, 128, c.vocab_size);
    uint32_t masks[DS4_MAX_LAYERS];
    CHECK(policy_masks(&k_policies[4], &c, masks) == DS4_OK); /* csa+mhc+norm */
    ds4_mem_stats s0, s1, s2, s3;
    ds4_pass *p;
    const ds4_act_policies pol = {.recompute = masks};
    ds4_pass_opts off = {.need_backward = true}, on = {.need_backward = true, .store = ds4_act_store_of(&pol)};
    ds4_mem_get(&s0);
    CHECK(ds4_forward(m, ids, 2, 64, &off, &p) == DS4_OK);
    ds4_mem_get(&s1);
    ds4_pass_free(p);
    CHECK(ds4_forward(m, ids, 2, 64, &on, &p) == DS4_OK);
    ds4_mem_get(&s2);
    int64_t released = 0;
    for (int64_t l = 0; l < c.n_layers + c.n_mtp_layers; l++)
        for (int u = 0; u < DS4_NUM_UNITS; u++) {
            ds4_unit_report r = ds4_pass_unit_report(p, l, u);
            if (r.released) released += r.bytes;
            if (l >= c.n_layers) CHECK(r.released == 0, "MTP unit %s released", ds4_unit_name(u));
        }
    int64_t saved = s1.live[DS4_MEM_ACT] - s2.live[DS4_MEM_ACT];
    CHECK(released > 0 && saved == released, "live bytes dropped by %lld, released units hold %lld",
          (long long)saved, (long long)released);
    ds4_model_zero_grad(m);
    CHECK(ds4_backward(m, p) == DS4_OK);
    for (int64_t l = 0; l < c.n_layers; l++)
        for (int u = 0; u < DS4_NUM_UNITS; u++) {
            ds4_unit_report r = ds4_pass_unit_report(p, l, u);
            CHECK(r.replays == r.released, "layer %lld unit %s: %lld releases, %lld replays", (long long)l,
                  ds4_unit_name(u), (long long)r.released, (long long)r.replays);
        }
    ds4_pass_free(p);
    ds4_mem_get(&s3);
    CHECK(s3.live[DS4_MEM_ACT] == s0.live[DS4_MEM_ACT], "activation bytes left after backward");
    ds4_model_free(m);
}

/* Peak of one training pass: recompute lowers it, full recompute lowers it most. */
static int64_t peak_of(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, const uint32_t *masks) {
    const ds4_act_policies pol = {.recompute = masks};
    ds4_pass_opts o = {.need_backward = true, .store = ds4_act_store_of(&pol)};
    ds4_pass *p;
    ds4_mem_stats a, b;
    ds4_mem_reset_peak();
    ds4_mem_get(&a);
    ds4_model_zero_grad(m);
    if (ds4_forward(m, ids, B, T, &o, &p) != DS4_OK || ds4_backward(m, p) != DS4_OK) return -1;
    ds4_pass_free(p);
    ds4_mem_get(&b);
    return b.peak_total - a.live_total;
}

static void test_peak_ordering(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-b.json", &c) == DS4_OK);
    ds4_model *m;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK);
    ds4_model_init_random(m, 2);
    int32_t ids[300];
    make_ids(ids, 300, c.vocab_size);
    uint32_t mk[DS4_MAX_LAYERS];
    int64_t off = peak_of(m, ids, 2, 150, NULL);
    policy_masks(&k_policies[3], &c, mk);
    int64_t cm = peak_of(m, ids, 2, 150, mk);
    policy_masks(&k_policies[6], &c, mk);
    int64_t full = peak_of(m, ids, 2, 150, mk);
    CHECK(off > 0 && cm > 0 && full > 0);
    CHECK(cm < off && full < cm, "peaks off %lld, csa+mhc %lld, full %lld", (long long)off, (long long)cm,
          (long long)full);
    ds4_model_free(m);
}

static void test_flag_validation(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK);
    const policy bad[] = {
        {"uniform+csa", {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1", "--recompute-csa-attention", NULL}},
        {"method-alone", {"--recompute-method", "block", NULL}},
        {"num-layers-alone", {"--recompute-num-layers", "2", NULL}},
        {"too-many", {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "9", NULL}},
        {"norm-layers-alone", {"--recompute-norm-num-layers", "1", NULL}},
        {"bad-gran", {"--recompute-granularity", "most", NULL}},
        {"no-method", {"--recompute-granularity", "full", "--recompute-num-layers", "1", NULL}},
        {"missing-value", {"--recompute-method", NULL}},
    };
    uint32_t masks[DS4_MAX_LAYERS];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK(policy_masks(&bad[i], &c, masks) != DS4_OK, "%s accepted", bad[i].name);
        CHECK(strstr(ds4_errmsg(), "--recompute") != NULL, "%s: message '%s' names no flag", bad[i].name,
              ds4_errmsg());
    }
}

static void test_priority_formula(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK);
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    for (int64_t l = 0; l < c.n_layers; l++) CHECK(ds4_recompute_priority(&r, &c, l) == l);
    c.n_layers = 8;
    r.pipe.pp = 2;
    r.pipe.vpp = 2; /* 2 layers per chunk, chunks VPP-major: stage 0 holds [0, 1] and [4, 5] */
    r.per_pp_rank = true;
    /* Megatron's example: recompute_num_layers 3 takes layers 0, 1, 4 on stage 0 (local · vpp + vpp_rank) */
    const int64_t want[8] = {0, 2, 0, 2, 1, 3, 1, 3};
    for (int64_t l = 0; l < 8; l++) CHECK(ds4_recompute_priority(&r, &c, l) == want[l], "layer %lld", (long long)l);
}

int main(void) {
    ds4_set_threads(2);
    RUN(test_equality_tiny_a);
    RUN(test_equality_tiny_b);
    RUN(test_release_accounting);
    RUN(test_peak_ordering);
    RUN(test_flag_validation);
    RUN(test_priority_formula);
    TEST_MAIN_END("test_recompute");
}
