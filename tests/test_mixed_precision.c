/* BF16 mixed precision (training.mixed_precision_param = "bfloat16", docs/mixed-precision.md):
 *  - every recompute and offload policy gives bitwise the same losses, grad norms and updated weights as
 *    keeping everything, over two optimizer steps of the trainer's own step;
 *  - the bf16-safe unit outputs are held in half the bytes, the fp32 ones in full; attention's and the
 *    indexer's keys from the moment they are made;
 *  - bf16 really computes something else than fp32, within the error bf16 rounding explains;
 *  - memplan plans a bf16 step byte for byte (planned == measured), and below the fp32 step;
 *  - the TOML keys: TorchTitan's names and values, bad values named. */
#include "ds4/actstore.h"
#include "ds4/io.h"
#include "ds4/memplan.h"
#include "ds4/model.h"
#include "ds4/recompute.h"
#include "ds4/trainer.h"
#include "test.h"

#include <math.h>

#define STEPS 2

/* Recompute and offload policies as memplan's list spells them (flags as on the command line). */
static const char *const k_off[] = {NULL};
static const char *const k_fine[] = {"--recompute-csa-attention", "--mhc-recompute", "--recompute-norm", NULL};
static const char *const k_full_block_csa_mhc[] = {"--recompute-granularity", "full", "--recompute-method", "block",
                                                   "--recompute-num-layers", "1", "--recompute-csa-attention",
                                                   "--mhc-recompute", NULL};
static const char *const k_full[] = {"--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1", NULL};
static const ds4_memplan_policy k_policies[] = {
    {"off", k_off, false, false},
    {"csa+mhc+norm", k_fine, false, false},
    {"full-block-1+csa+mhc", k_full_block_csa_mhc, false, false},
    {"full-uniform", k_full, false, false},
    {"swap-layer-input+full", k_full, false, true},
    {"swap-optimizer+swap-layer-input", k_off, true, true},
};
#define NPOL ((int)(sizeof k_policies / sizeof k_policies[0]))

/* masks [DS4_MAX_LAYERS] of policy p; *any: whether it recomputes anything. */
static ds4_status policy_masks(const ds4_memplan_policy *p, const ds4_config *c, uint32_t *masks, bool *any) {
    ds4_step_opts so = {0};
    DS4_TRY(ds4_memplan_policy_opts(p, c, masks, &so));
    *any = so.masks != NULL;
    return DS4_OK;
}

typedef struct {
    double loss[STEPS], total[STEPS], gnorm[STEPS];
    float *params; /* after the last step */
    int64_t n;
} run_result;

static const ds4_adamw_cfg k_adamw = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

/* STEPS trainer steps (ds4_train_step) of a whole state from seed 21 on fixed ids. */
static bool run_steps(const ds4_config *c, const ds4_memplan_policy *pol, bool bf16, int64_t B, int64_t T, run_result *out) {
    uint32_t masks[DS4_MAX_LAYERS];
    bool any = false;
    if (policy_masks(pol, c, masks, &any) != DS4_OK) return false;
    const ds4_train_state_opts so = {.ep = 1, .swap_optimizer = pol->swap_optimizer,
                                     .swap_layer_input = pol->swap_layer_input, .bf16 = bf16};
    ds4_train_state *s;
    if (ds4_train_state_open(c, NULL, 21, ds4_comm_self(), &so, &s) != DS4_OK) return false;
    const int64_t nb = c->n_layers + c->n_mtp_layers;
    int32_t *ids = malloc((size_t)(B * T) * sizeof(int32_t));
    int64_t *loads = calloc((size_t)(nb * c->n_routed_experts), sizeof(int64_t));
    for (int64_t i = 0; i < B * T; i++) ids[i] = (int32_t)(ds4_rng_u64(17, 5, (uint64_t)i) % (uint64_t)c->vocab_size);
    bool ok = true;
    for (int k = 0; k < STEPS && ok; k++) {
        const ds4_step_args a = {.step = k + 1, .micro_batches = 1, .B = B, .T = T, .ids = ids, .loads = loads,
                                 .release_mask = any ? masks : NULL, .adamw = &k_adamw, .lr = k_adamw.lr,
                                 .max_norm = 1.0, .router_bias_gamma = 1e-3};
        ds4_step_result r;
        ok = ds4_train_step(s, &a, &r) == DS4_OK;
        out->loss[k] = r.loss;
        out->total[k] = r.total_loss;
        out->gnorm[k] = r.grad_norm;
    }
    ds4_model *m = ds4_train_state_model(s);
    out->n = ds4_model_numel(m);
    out->params = malloc((size_t)out->n * sizeof(float));
    memcpy(out->params, ds4_model_params_flat(m), (size_t)out->n * sizeof(float));
    free(ids);
    free(loads);
    ds4_train_state_free(s);
    return ok;
}

static void policies_equal(const char *cfg_path, int64_t B, int64_t T) {
    ds4_config c;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    run_result base = {0};
    CHECK(run_steps(&c, &k_policies[0], true, B, T, &base), "%s", ds4_errmsg());
    for (int k = 1; k < NPOL && base.params; k++) {
        run_result r = {0};
        CHECK(run_steps(&c, &k_policies[k], true, B, T, &r), "%s: %s", k_policies[k].name, ds4_errmsg());
        for (int s = 0; s < STEPS; s++)
            CHECK(r.loss[s] == base.loss[s] && r.total[s] == base.total[s] && r.gnorm[s] == base.gnorm[s],
                  "%s bf16 %s step %d: loss %.9g vs %.9g, grad norm %.9g vs %.9g", cfg_path, k_policies[k].name, s + 1,
                  r.total[s], base.total[s], r.gnorm[s], base.gnorm[s]);
        CHECK(r.params && memcmp(r.params, base.params, (size_t)r.n * sizeof(float)) == 0,
              "%s bf16 %s: updated weights differ", cfg_path, k_policies[k].name);
        free(r.params);
    }
    free(base.params);
}

static void test_policies_bitwise_tiny_a(void) { policies_equal("tests/configs/tiny-a.json", 2, 64); }

/* bf16 is a different computation (the losses move), but only by what bf16 rounding explains: the
 * operands of every GEMM and the saved activations carry a relative error of at most u = 2^-8 each (8 bits of precision), and the
 * loss of a random-init model (~ln V) moves by a small multiple of that. 4·2^-8 allows for the rounding
 * points one token's loss passes through (about 4 per sub-layer that adds up, not compounding). */
static void test_bf16_moves_within_rounding(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    run_result f32 = {0}, b16 = {0};
    CHECK(run_steps(&c, &k_policies[0], false, 2, 64, &f32) && run_steps(&c, &k_policies[0], true, 2, 64, &b16),
          "%s", ds4_errmsg());
    const double rel = fabs(b16.loss[0] - f32.loss[0]) / f32.loss[0];
    CHECK(b16.loss[0] != f32.loss[0], "bf16 gave the fp32 loss %.9g bit for bit: nothing was rounded", f32.loss[0]);
    CHECK(rel < 8.0 / 512.0, "bf16 loss %.9g vs fp32 %.9g: relative %.3g beyond bf16 rounding", b16.loss[0],
          f32.loss[0], rel);
    free(f32.params);
    free(b16.params);
}

/* The context of the mixed-precision passes below: bf16 GEMMs (bf16 activations imply them). */
static const ds4_exec k_bf16_gemms = {.matmul_precision = DS4_MATMUL_BF16};

/* After forward, a unit's saved outputs hold 2 bytes per element for its bf16 slots and 4 for the others:
 * q_up keeps qraw and q [N, H, hd] in bf16 and rstd [N, H] in fp32; the router keeps everything fp32. */
static void test_held_bytes(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m;
    CHECK(ds4_model_create(&k_bf16_gemms, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_init_random(m, 3);
    const int64_t B = 2, T = 64, N = B * T;
    int32_t ids[2 * 64];
    for (int64_t i = 0; i < N; i++) ids[i] = (int32_t)(i * 7 % c.vocab_size);
    for (int bf16 = 0; bf16 < 2; bf16++) {
        ds4_pass_opts o = {.need_backward = true, .bf16_acts = bf16};
        ds4_pass *p;
        CHECK(ds4_forward(m, ids, B, T, &o, &p) == DS4_OK, "%s", ds4_errmsg());
        const int64_t q = N * c.n_heads * c.head_dim, e = (bf16 ? 2 : 4);
        const ds4_unit_report qu = ds4_pass_unit_report(p, 0, ds4_unit_find("q_up"));
        CHECK(qu.bytes == 2 * q * e + N * c.n_heads * 4, "bf16 %d: q_up holds %lld bytes, expected %lld", bf16,
              (long long)qu.bytes, (long long)(2 * q * e + N * c.n_heads * 4));
        const ds4_unit_report rt0 = ds4_pass_unit_report(p, 0, ds4_unit_find("router"));
        static int64_t router_fp32;
        if (!bf16) router_fp32 = rt0.bytes;
        else CHECK(rt0.bytes == router_fp32, "the router's outputs stay fp32: %lld vs %lld bytes", (long long)rt0.bytes,
                   (long long)router_fp32);
        CHECK(ds4_backward(m, p) == DS4_OK, "%s", ds4_errmsg());
        ds4_pass_free(p);
    }
    ds4_model_free(m);
}

/* A store that recomputes the units that make attention's and the indexer's keys: a released unit reports
 * the bytes it held right after it ran. */
static ds4_act_policy recompute_key_units(void *ctx, int64_t layer, int unit) {
    (void)ctx, (void)layer;
    return unit == ds4_unit_find("kv") || unit == ds4_unit_find("compressor") || unit == ds4_unit_find("indexer")
               ? DS4_ACT_RECOMPUTE
               : DS4_ACT_KEEP;
}
static void release_nothing(void *ctx, int64_t layer, int unit, int slot) { (void)ctx, (void)layer, (void)unit, (void)slot; }

/* The keys attention and the indexer read (kv [N, hd], kvc [B, Nc, hd], ki [B, Nc, dI]) are bf16 from the
 * moment their unit has made them: right after the unit ran it holds 2 bytes less per key element under
 * mixed precision than in fp32 (its other bf16-safe outputs are still fp32 then, packed only after their last
 * forward reader), and backward, which replays those units, reads them as bf16 as well. CSA layer 1 of tiny-a. */
static void test_keys_bf16_when_made(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m;
    CHECK(ds4_model_create(&k_bf16_gemms, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_init_random(m, 3);
    const int64_t B = 2, T = 64, N = B * T, Nc = T / 4;
    CHECK(ds4_layer_ratio(&c, 1) == 4, "tiny-a's layer 1 is CSA");
    int32_t ids[2 * 64];
    for (int64_t i = 0; i < N; i++) ids[i] = (int32_t)(i * 5 % c.vocab_size);
    static const ds4_act_store_ops ops = {.policy = recompute_key_units, .release = release_nothing};
    const char *units[3] = {"kv", "compressor", "indexer"};
    const int64_t keys[3] = {N * c.head_dim, B * Nc * c.head_dim, B * Nc * c.index_head_dim};
    int64_t bytes[2][3];
    double loss[2];
    for (int bf16 = 0; bf16 < 2; bf16++) {
        ds4_pass_opts o = {.need_backward = true, .bf16_acts = bf16, .store = {.ops = &ops}};
        ds4_pass *p;
        CHECK(ds4_forward(m, ids, B, T, &o, &p) == DS4_OK, "%s", ds4_errmsg());
        for (int k = 0; k < 3; k++) {
            const ds4_unit_report r = ds4_pass_unit_report(p, 1, ds4_unit_find(units[k]));
            CHECK(r.released == 1, "bf16 %d: %s not released", bf16, units[k]);
            bytes[bf16][k] = r.bytes;
        }
        CHECK(ds4_backward(m, p) == DS4_OK, "%s", ds4_errmsg());
        for (int k = 0; k < 3; k++)
            CHECK(ds4_pass_unit_report(p, 1, ds4_unit_find(units[k])).replays == 1, "bf16 %d: %s not replayed", bf16,
                  units[k]);
        loss[bf16] = ds4_pass_losses(p)->total_loss;
        ds4_pass_free(p);
    }
    for (int k = 0; k < 3; k++)
        CHECK(bytes[0][k] - bytes[1][k] == 2 * keys[k], "%s held %lld bytes in fp32 and %lld in bf16 after its run: "
              "expected %lld less", units[k], (long long)bytes[0][k], (long long)bytes[1][k], (long long)(2 * keys[k]));
    CHECK(isfinite(loss[1]) && loss[1] != loss[0], "bf16 loss %.9g vs fp32 %.9g", loss[1], loss[0]);
    ds4_model_free(m);
}

/* memplan's plan of a bf16 step equals the measured real step in every category, and its activation
 * peak is below the fp32 step's. */
static void test_memplan_bf16(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    uint32_t masks[DS4_MAX_LAYERS];
    bool any;
    CHECK(policy_masks(&k_policies[1], &c, masks, &any) == DS4_OK);
    for (int rec = 0; rec < 2; rec++) {
        ds4_step_memory plan, real, f32;
        const ds4_step_opts bf = {.masks = rec ? masks : NULL, .bf16 = true}, fp = {.masks = rec ? masks : NULL};
        CHECK(ds4_step_memory_run_opts(&c, 2, 64, &bf, true, &plan) == DS4_OK, "%s", ds4_errmsg());
        CHECK(ds4_step_memory_run_opts(&c, 2, 64, &bf, false, &real) == DS4_OK, "%s", ds4_errmsg());
        CHECK(ds4_step_memory_run_opts(&c, 2, 64, &fp, true, &f32) == DS4_OK, "%s", ds4_errmsg());
        for (int k = 0; k < DS4_MEM_NCAT; k++)
            CHECK(plan.peak[k] == real.peak[k], "recompute %d: %s planned %lld, measured %lld", rec,
                  ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.peak[k], (long long)real.peak[k]);
        CHECK(plan.peak_total == real.peak_total, "recompute %d: peak planned %lld, measured %lld", rec,
              (long long)plan.peak_total, (long long)real.peak_total);
        CHECK(plan.peak[DS4_MEM_ACT] < f32.peak[DS4_MEM_ACT], "recompute %d: bf16 activations %lld not below fp32 %lld",
              rec, (long long)plan.peak[DS4_MEM_ACT], (long long)f32.peak[DS4_MEM_ACT]);
    }
}

/* The TOML keys. */
static ds4_status cfg_of(const char *training, ds4_train_cfg *c) {
    char toml[1024];
    snprintf(toml, sizeof toml, "[model]\nconfig = \"tests/configs/tiny-a.json\"\n[data]\ntrain = \"x.bin\"\n"
             "[training]\nsteps = 1\nseq_len = 16\n%s", training + strlen("[training]\n"));
    ds4_toml *t;
    DS4_TRY(ds4_toml_parse(toml, strlen(toml), "test.toml", &t));
    ds4_status st = ds4_train_cfg_from_toml(t, c);
    ds4_toml_free(t);
    return st;
}

static void test_keys(void) {
    ds4_train_cfg c;
    CHECK(cfg_of("[training]\nmixed_precision_param = \"bfloat16\"\nmixed_precision_reduce = \"float32\"\n", &c) ==
          DS4_OK, "%s", ds4_errmsg());
    CHECK(c.bf16_params && c.matmul_precision == DS4_MATMUL_BF16, "bfloat16 params imply bf16 GEMMs");
    CHECK(cfg_of("[training]\n", &c) == DS4_OK && !c.bf16_params && c.matmul_precision == DS4_MATMUL_FP32,
          "float32 is the default");
    CHECK(cfg_of("[training]\nmixed_precision_param = \"float16\"\n", &c) == DS4_ERR_CONFIG &&
          strstr(ds4_errmsg(), "training.mixed_precision_param"), "%s", ds4_errmsg());
    CHECK(cfg_of("[training]\nmixed_precision_reduce = \"bfloat16\"\n", &c) == DS4_ERR_CONFIG &&
          strstr(ds4_errmsg(), "training.mixed_precision_reduce"), "%s", ds4_errmsg());
    CHECK(cfg_of("[training]\nmixed_precision_param = \"bfloat16\"\nmatmul_precision = \"fp32\"\n", &c) ==
          DS4_ERR_CONFIG && strstr(ds4_errmsg(), "training.matmul_precision"), "%s", ds4_errmsg());
}

int main(void) {
    RUN(test_keys);
    RUN(test_held_bytes);
    RUN(test_keys_bf16_when_made);
    RUN(test_bf16_moves_within_rounding);
    RUN(test_policies_bitwise_tiny_a);
    RUN(test_memplan_bf16);
    TEST_MAIN_END("test_mixed_precision");
}
