/* memplan: the plan run of one training step predicts the measured peak of a real step byte
 * for byte, per category, on the small configs and under recompute policies; and it plans the real
 * DeepSeek-V4-Flash and -Pro configurations at 4K and 64K quickly. */
#include "ds4/actstore.h"
#include "ds4/dist.h"
#include "ds4/io.h"
#include "ds4/memplan.h"
#include "ds4/train.h"
#include "ds4/recompute.h"
#include "test.h"

#include <string.h>

static void masks_for(const ds4_config *c, const char *const *flags, int n, uint32_t *masks) {
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    for (int i = 0; i < n; i++) {
        bool used;
        CHECK(ds4_recompute_parse_arg(&r, n, (char **)flags, &i, &used) == DS4_OK && used);
    }
    CHECK(ds4_recompute_validate(&r, c) == DS4_OK, "%s", ds4_errmsg());
    ds4_recompute_masks(&r, c, masks);
}

static void plan_equals_measured(const char *cfg, int64_t B, int64_t T, const char *const *flags, int nflags) {
    ds4_config c;
    CHECK(ds4_config_load(cfg, &c) == DS4_OK, "%s", ds4_errmsg());
    uint32_t masks[DS4_MAX_LAYERS];
    masks_for(&c, flags, nflags, masks);
    ds4_step_memory plan, real;
    CHECK(ds4_step_memory_run(&c, B, T, nflags ? masks : NULL, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run(&c, B, T, nflags ? masks : NULL, false, &real) == DS4_OK, "%s", ds4_errmsg());
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        CHECK(plan.peak[k] == real.peak[k], "%s T=%lld %s: %s planned %lld, measured %lld", cfg, (long long)T,
              nflags ? flags[0] : "off", ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.peak[k],
              (long long)real.peak[k]);
    CHECK(plan.peak_total == real.peak_total && plan.peak_total > 0, "%s: total planned %lld, measured %lld", cfg,
          (long long)plan.peak_total, (long long)real.peak_total);
    CHECK(plan.after_step == real.after_step);
}

static void test_plan_equals_measured_tiny_a(void) {
    const char *csa_mhc[] = {"--recompute-csa-attention", "--mhc-recompute", "--recompute-norm"};
    const char *full[] = {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"};
    plan_equals_measured("tests/configs/tiny-a.json", 2, 64, NULL, 0);
    plan_equals_measured("tests/configs/tiny-a.json", 2, 64, csa_mhc, 3);
    plan_equals_measured("tests/configs/tiny-a.json", 1, 100, full, 6);
}

static void test_plan_equals_measured_tiny_b(void) {
    const char *csa_mhc[] = {"--recompute-csa-attention", "--mhc-recompute"};
    plan_equals_measured("tests/configs/tiny-b.json", 2, 150, NULL, 0);
    plan_equals_measured("tests/configs/tiny-b.json", 2, 150, csa_mhc, 2);
}

/* With the offload options, plan and measured step agree per category in both tiers. */
static void swap_plan_equals_measured(const char *cfg, int64_t B, int64_t T, ds4_step_opts so, const char *what) {
    ds4_config c;
    CHECK(ds4_config_load(cfg, &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_step_memory plan, real;
    CHECK(ds4_step_memory_run_opts(&c, B, T, &so, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run_opts(&c, B, T, &so, false, &real) == DS4_OK, "%s", ds4_errmsg());
    for (int k = 0; k < DS4_MEM_NCAT; k++) {
        CHECK(plan.peak[k] == real.peak[k], "%s %s: %s planned %lld, measured %lld", cfg, what,
              ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.peak[k], (long long)real.peak[k]);
        CHECK(plan.offload_peak[k] == real.offload_peak[k], "%s %s: offloaded %s planned %lld, measured %lld", cfg,
              what, ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.offload_peak[k], (long long)real.offload_peak[k]);
    }
    CHECK(plan.peak_total == real.peak_total && plan.after_step == real.after_step, "%s %s: totals", cfg, what);
    CHECK(plan.offload_peak_total == real.offload_peak_total && plan.offload_peak_total > 0 &&
              plan.offload_after_step == real.offload_after_step, "%s %s: offload total planned %lld, measured %lld",
          cfg, what, (long long)plan.offload_peak_total, (long long)real.offload_peak_total);
}

/* The matmul precision is the context's: a plan of a step with bf16 GEMMs on fp32 weights (memplan
 * --matmul-precision bf16) equals that step measured, per category; where the CPU has a bf16 engine with
 * panels of its own its workspace differs from the fp32 step's, which proves the plan saw the precision. */
static void test_matmul_precision_plan_equals_measured(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_step_memory plan, real, fp32;
    const ds4_step_opts bf16 = {.matmul_precision = DS4_MATMUL_BF16}, f32 = {0};
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &bf16, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &bf16, false, &real) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &f32, true, &fp32) == DS4_OK, "%s", ds4_errmsg());
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        CHECK(plan.peak[k] == real.peak[k], "bf16 GEMMs: %s planned %lld, measured %lld",
              ds4_mem_cat_name((ds4_mem_cat)k), (long long)plan.peak[k], (long long)real.peak[k]);
    CHECK(plan.peak_total == real.peak_total && plan.after_step == real.after_step, "bf16 GEMMs: totals");
    CHECK(plan.peak[DS4_MEM_PARAM] == fp32.peak[DS4_MEM_PARAM] && plan.peak[DS4_MEM_ACT] == fp32.peak[DS4_MEM_ACT],
          "bf16 GEMMs on fp32 weights hold fp32 parameters and activations");
}

static void test_swap_plan_equals_measured(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    const char *full[] = {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"};
    uint32_t masks[DS4_MAX_LAYERS];
    masks_for(&c, full, 6, masks);
    ds4_step_memory off, opt, act;
    swap_plan_equals_measured("tests/configs/tiny-a.json", 2, 64, (ds4_step_opts){.swap_optimizer = true}, "swap-opt");
    swap_plan_equals_measured("tests/configs/tiny-a.json", 2, 64, (ds4_step_opts){.swap_layer_input = true}, "swap-in");
    swap_plan_equals_measured("tests/configs/tiny-a.json", 1, 100,
                              (ds4_step_opts){.masks = masks, .swap_optimizer = true, .swap_layer_input = true,
                                              .swap_chunk_bytes = 1 << 16}, "full+both");
    swap_plan_equals_measured("tests/configs/tiny-b.json", 2, 150,
                              (ds4_step_opts){.swap_optimizer = true, .swap_layer_input = true}, "both");
    /* what each option moves: the optimizer's 8 B/param (m and v), one [N, n, D] stream per main layer */
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    const int64_t n = m ? ds4_model_numel(m) : 0;
    ds4_model_free(m);
    const size_t chunk = 1 << 16;
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &(ds4_step_opts){0}, true, &off) == DS4_OK);
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &(ds4_step_opts){.swap_optimizer = true, .swap_chunk_bytes = chunk},
                                   true, &opt) == DS4_OK);
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &(ds4_step_opts){.swap_layer_input = true}, true, &act) == DS4_OK);
    CHECK(off.peak[DS4_MEM_OPTIM] == 8 * n && off.offload_peak[DS4_MEM_OPTIM] == 0,
          "resident optimizer state %lld bytes for %lld parameters", (long long)off.peak[DS4_MEM_OPTIM], (long long)n);
    CHECK(opt.offload_peak[DS4_MEM_OPTIM] == 8 * n && opt.peak[DS4_MEM_OPTIM] == (int64_t)chunk,
          "swapped: the whole state goes out (%lld offloaded), only the update's buffers stay (%lld resident)",
          (long long)opt.offload_peak[DS4_MEM_OPTIM], (long long)opt.peak[DS4_MEM_OPTIM]);
    CHECK(off.after_step - opt.after_step >= off.peak[DS4_MEM_OPTIM] - 8192,
          "and none of it stays resident (but the store's few KiB of metadata): %lld -> %lld",
          (long long)off.after_step, (long long)opt.after_step);
    CHECK(act.offload_peak[DS4_MEM_ACT] == c.n_layers * 2 * 64 * c.hc_mult * c.dim * (int64_t)sizeof(float));
    CHECK(act.peak[DS4_MEM_ACT] < off.peak[DS4_MEM_ACT] && act.offload_after_step == 0);
}

/* Muon: plan == measured, resident and swapped; its state is its own, 4 B per element of its group (the
 * momentum) beside AdamW's 8 B per element of the rest, planned and measured alike, and on top, while a
 * matrix [A, B] is updated, the matrix (n floats) and the Newton-Schulz workspace (2r^2 + n floats,
 * r = min(A, B), + n for the transposed copy when A > B): the optimizer peak is the state plus the largest
 * matrix's. */
static void test_muon_plan_equals_measured(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    swap_plan_equals_measured("tests/configs/tiny-a.json", 2, 64, (ds4_step_opts){.muon = true, .swap_optimizer = true},
                              "muon swap-opt");
    ds4_step_memory plan, real, adamw;
    const ds4_step_opts so = {.muon = true};
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &so, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &so, false, &real) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &(ds4_step_opts){0}, true, &adamw) == DS4_OK, "%s", ds4_errmsg());
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        CHECK(plan.peak[k] == real.peak[k], "muon %s: planned %lld, measured %lld", ds4_mem_cat_name((ds4_mem_cat)k),
              (long long)plan.peak[k], (long long)real.peak[k]);
    CHECK(plan.after_step == real.after_step, "Muon after the step: planned %lld, measured %lld",
          (long long)plan.after_step, (long long)real.after_step);
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    int64_t most = 0, nm = 0;
    for (int64_t i = 0; m && i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_is_muon(p)) continue;
        nm += p->numel;
        const int64_t r = p->shape[0] < p->shape[1] ? p->shape[0] : p->shape[1];
        const int64_t bytes = 4 * (2 * p->numel + 2 * r * r + (p->shape[0] > p->shape[1] ? p->numel : 0));
        if (bytes > most) most = bytes;
    }
    const int64_t n = m ? ds4_model_numel(m) : 0;
    CHECK(adamw.resident[DS4_MEM_OPTIM] == 8 * n, "AdamW keeps %lld optimizer bytes for %lld elements",
          (long long)adamw.resident[DS4_MEM_OPTIM], (long long)n);
    CHECK(plan.resident[DS4_MEM_OPTIM] == 4 * nm + 8 * (n - nm) && real.resident[DS4_MEM_OPTIM] == plan.resident[DS4_MEM_OPTIM],
          "Muon keeps %lld (planned) / %lld (measured) optimizer bytes: expected 4 x %lld Muon + 8 x %lld AdamW elements",
          (long long)plan.resident[DS4_MEM_OPTIM], (long long)real.resident[DS4_MEM_OPTIM], (long long)nm,
          (long long)(n - nm));
    CHECK(plan.peak[DS4_MEM_OPTIM] - plan.resident[DS4_MEM_OPTIM] == most,
          "Muon's optimizer peak %lld over its state %lld: expected the largest matrix's %lld",
          (long long)plan.peak[DS4_MEM_OPTIM], (long long)plan.resident[DS4_MEM_OPTIM], (long long)most);
    ds4_model_free(m);
}

/* The FSDP + EP path: a one-rank world measured against its plan, with both options. */
static void test_swap_plan_equals_measured_dist(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(1, 0, &sim) == DS4_OK, "%s", ds4_errmsg());
    const ds4_step_opts so = {.swap_optimizer = true, .swap_layer_input = true};
    ds4_step_memory plan, real;
    CHECK(ds4_step_memory_run_dist_opts(&c, 2, 64, &so, false, ds4_comm_world(), 1, true, &real) == DS4_OK, "%s",
          ds4_errmsg());
    CHECK(ds4_step_memory_run_dist_opts(&c, 2, 64, &so, true, sim, 1, true, &plan) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm_free(sim);
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        CHECK(plan.peak[k] == real.peak[k] && plan.offload_peak[k] == real.offload_peak[k],
              "dist %s: planned %lld + %lld offloaded, measured %lld + %lld", ds4_mem_cat_name((ds4_mem_cat)k),
              (long long)plan.peak[k], (long long)plan.offload_peak[k], (long long)real.peak[k],
              (long long)real.offload_peak[k]);
    CHECK(plan.peak_total == real.peak_total && plan.offload_peak_total == real.offload_peak_total &&
          real.offload_peak[DS4_MEM_OPTIM] > 0 && real.offload_peak[DS4_MEM_ACT] > 0);
}

/* A run description as ds4 train reads it (2 micro-batches, dense CSA on step 1, Muon, swapped optimizer,
 * CSA recompute, bf16 mixed precision): planned == measured, byte for byte, through the trainer's builders. */
static void test_run_description_plan_equals_measured(void) {
    static const char text[] = "[model]\nconfig = \"tests/configs/tiny-a.json\"\n[training]\nsteps = 1\nseq_len = 64\n"
                               "micro_batch_size = 2\nglobal_batch_size = 4\ncsa_dense_steps = 1\n"
                               "mixed_precision_param = \"bfloat16\"\n[optimizer]\nname = \"Muon\"\n"
                               "[data]\ntrain = \"unused\"\n";
    ds4_toml *t = NULL;
    ds4_train_cfg run;
    CHECK(ds4_toml_parse(text, sizeof text - 1, "run.toml", &t) == DS4_OK && ds4_train_cfg_from_toml(t, &run) == DS4_OK,
          "%s", ds4_errmsg());
    ds4_toml_free(t);
    run.swap_optimizer = true;
    run.recompute.csa_attention = true;
    ds4_train_cfg a = run, b = run; /* each is resolved for its world in place */
    ds4_step_memory plan, real;
    CHECK(ds4_step_memory_of_run(&a, ds4_comm_self(), true, &plan) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_of_run(&b, ds4_comm_self(), false, &real) == DS4_OK, "%s", ds4_errmsg());
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        CHECK(plan.peak[k] == real.peak[k] && plan.offload_peak[k] == real.offload_peak[k],
              "run %s: planned %lld + %lld offloaded, measured %lld + %lld", ds4_mem_cat_name((ds4_mem_cat)k),
              (long long)plan.peak[k], (long long)plan.offload_peak[k], (long long)real.peak[k],
              (long long)real.offload_peak[k]);
    CHECK(plan.peak_total == real.peak_total && real.offload_peak[DS4_MEM_OPTIM] > 0, "peak %lld vs %lld",
          (long long)plan.peak_total, (long long)real.peak_total);
}

/* The real configurations plan in seconds; activations grow with T, parameters do not. */
static void test_plans_flash_and_pro(void) {
    const char *cfgs[] = {"configs/deepseek-v4-flash.json", "configs/deepseek-v4-pro.json"};
    const char *csa_mhc[] = {"--recompute-csa-attention", "--mhc-recompute"};
    for (int i = 0; i < 2; i++) {
        ds4_config c;
        CHECK(ds4_config_load(cfgs[i], &c) == DS4_OK, "%s", ds4_errmsg());
        uint32_t masks[DS4_MAX_LAYERS];
        masks_for(&c, csa_mhc, 2, masks);
        ds4_step_memory a, b, r;
        CHECK(ds4_step_memory_run(&c, 1, 4096, NULL, true, &a) == DS4_OK, "%s", ds4_errmsg());
        CHECK(ds4_step_memory_run(&c, 1, 65536, NULL, true, &b) == DS4_OK, "%s", ds4_errmsg());
        CHECK(ds4_step_memory_run(&c, 1, 65536, masks, true, &r) == DS4_OK, "%s", ds4_errmsg());
        CHECK(a.seconds < 5 && b.seconds < 5 && r.seconds < 5, "%s planned in %.1f / %.1f s", cfgs[i], a.seconds,
              b.seconds);
        CHECK(a.peak[DS4_MEM_PARAM] == b.peak[DS4_MEM_PARAM] && a.peak[DS4_MEM_PARAM] > (int64_t)1e12,
              "%s: parameter bytes %lld", cfgs[i], (long long)a.peak[DS4_MEM_PARAM]);
        CHECK(b.peak[DS4_MEM_ACT] > 8 * a.peak[DS4_MEM_ACT], "activations must grow with T");
        CHECK(r.peak[DS4_MEM_ACT] < b.peak[DS4_MEM_ACT], "recompute must lower the activation peak");
    }
}

/* A device budget: the step fits when the device holds its whole peak (margin 0 included), one byte less is
 * one byte over; the offload tier does not count against the device. */
static void test_device_budget(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_step_memory r;
    const ds4_step_opts so = {.swap_optimizer = true};
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &so, true, &r) == DS4_OK, "%s", ds4_errmsg());
    CHECK(r.offload_peak_total > 0 && r.peak_total > 0);
    ds4_device_fit f = ds4_step_memory_fit(&r, r.peak_total);
    CHECK(f.fits && f.margin == 0 && f.need == r.peak_total, "exactly the peak: fits with margin %lld",
          (long long)f.margin);
    f = ds4_step_memory_fit(&r, r.peak_total - 1);
    CHECK(!f.fits && f.margin == -1, "a byte short: over by %lld", (long long)-f.margin);
    f = ds4_step_memory_fit(&r, (int64_t)64 << 30);
    CHECK(f.fits && f.margin == ((int64_t)64 << 30) - r.peak_total);
    f = ds4_step_memory_fit(&r, 0);
    CHECK(!f.fits && f.margin == -r.peak_total);
}

/* What stays between steps, per category, and the parameters held: a whole model holds every parameter
 * (4 B weight + 4 B gradient + 8 B AdamW moments each, 16 B), --swap-optimizer takes the 8 B out; a rank
 * of FSDP 4 + EP 2 holds its shard, and the same 16 B and 8 B per element of it. */
static void test_resident_per_parameter(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    const int64_t n = m ? ds4_model_numel(m) : 0;
    ds4_model_free(m);
    ds4_step_memory a, b;
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &(ds4_step_opts){0}, true, &a) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_step_memory_run_opts(&c, 2, 64, &(ds4_step_opts){.swap_optimizer = true}, true, &b) == DS4_OK, "%s",
          ds4_errmsg());
    CHECK(a.params_held == n && b.params_held == n, "held %lld of %lld", (long long)a.params_held, (long long)n);
    int64_t sum = 0;
    for (int k = 0; k < DS4_MEM_NCAT; k++) sum += a.resident[k];
    CHECK(sum == a.after_step, "resident categories sum to %lld, after_step %lld", (long long)sum,
          (long long)a.after_step);
    CHECK(a.resident[DS4_MEM_PARAM] >= 4 * n && a.resident[DS4_MEM_GRAD] == 4 * n && a.resident[DS4_MEM_OPTIM] == 8 * n,
          "weights %lld, grads %lld, optimizer %lld for %lld parameters", (long long)a.resident[DS4_MEM_PARAM],
          (long long)a.resident[DS4_MEM_GRAD], (long long)a.resident[DS4_MEM_OPTIM], (long long)n);
    CHECK(b.resident[DS4_MEM_OPTIM] < 8192 && b.resident[DS4_MEM_GRAD] == 4 * n,
          "swapped: %lld optimizer bytes stay", (long long)b.resident[DS4_MEM_OPTIM]);
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(4, 1, &sim) == DS4_OK, "%s", ds4_errmsg());
    ds4_step_memory d;
    CHECK(ds4_step_memory_run_dist_opts(&c, 1, 64, &(ds4_step_opts){0}, true, sim, 2, true, &d) == DS4_OK, "%s",
          ds4_errmsg());
    ds4_comm_free(sim);
    CHECK(d.params_held > 0 && d.params_held < n, "a rank holds %lld of %lld", (long long)d.params_held,
          (long long)n);
    CHECK(d.resident[DS4_MEM_GRAD] == 4 * d.params_held && d.resident[DS4_MEM_OPTIM] == 8 * d.params_held,
          "shard: grads %lld, optimizer %lld for %lld elements", (long long)d.resident[DS4_MEM_GRAD],
          (long long)d.resident[DS4_MEM_OPTIM], (long long)d.params_held);
}

/* The policy list: 7 recompute settings, then each with --swap-optimizer, --swap-layer-input and both, names
 * unique; each plans, and its options are what its name says: off has no masks and the most activations of
 * its block, a swap-opt row keeps no optimizer state resident, a swap-in row puts activations in the store. */
static void test_policies(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    const int n = ds4_memplan_policy_count();
    CHECK(n == 4 * DS4_MEMPLAN_RECOMPUTE_POLICIES && ds4_memplan_policy_at(n) == NULL &&
          ds4_memplan_policy_at(-1) == NULL, "%d policies", n);
    ds4_step_memory off = {0};
    for (int i = 0; i < n; i++) {
        const ds4_memplan_policy *p = ds4_memplan_policy_at(i);
        const int block = i / DS4_MEMPLAN_RECOMPUTE_POLICIES, in_block = i % DS4_MEMPLAN_RECOMPUTE_POLICIES;
        CHECK(p->swap_optimizer == (block == 1 || block == 3) && p->swap_layer_input == (block >= 2), "%s", p->name);
        CHECK(!strcmp(p->name, "off") == (i == 0), "%s", p->name);
        for (int j = 0; j < i; j++) CHECK(strcmp(p->name, ds4_memplan_policy_at(j)->name), "%s twice", p->name);
        uint32_t masks[DS4_MAX_LAYERS];
        ds4_step_opts so = {.muon = true, .bf16 = true}; /* kept */
        CHECK(ds4_memplan_policy_opts(p, &c, masks, &so) == DS4_OK, "%s: %s", p->name, ds4_errmsg());
        CHECK(so.muon && so.bf16 && (so.masks == NULL) == (in_block == 0), "%s", p->name);
        so.muon = so.bf16 = false;
        ds4_step_memory r;
        CHECK(ds4_step_memory_run_opts(&c, 2, 64, &so, true, &r) == DS4_OK, "%s: %s", p->name, ds4_errmsg());
        if (in_block == 0) off = r;
        CHECK(r.peak[DS4_MEM_ACT] + r.offload_peak[DS4_MEM_ACT] <= off.peak[DS4_MEM_ACT] + off.offload_peak[DS4_MEM_ACT],
              "%s: activations %lld above off's %lld", p->name, (long long)r.peak[DS4_MEM_ACT],
              (long long)off.peak[DS4_MEM_ACT]);
        CHECK((r.offload_peak[DS4_MEM_OPTIM] > 0) == p->swap_optimizer, "%s", p->name);
        CHECK((r.offload_peak[DS4_MEM_ACT] > 0) == p->swap_layer_input, "%s", p->name);
    }
}

/* ------------------------------------------------------------------ the saved activations' table */
/* Bytes the activation category holds at the end of a training forward outside the blocks (model.c:
 * ds4_forward, head_fwd, mtp_input_fwd): the token ids and their shift [N] int32 each, the last block's
 * output stream X[L] [N, n, D] (fp32: the heads read it), each head's mixes [N, n], rsqrt [N], y [N, D],
 * rstd [N], yn [N, D], logits [N, V] and targets [N] int32, and the MTP input's e, en [N, D], en_rstd [N],
 * hn [N, n, D], hn_rstd [N, n] and output stream [N, n, D] (its input stream is the MTP block's row). */
static int64_t outside_blocks(const ds4_config *c, int64_t N) {
    const int64_t n = c->hc_mult, D = c->dim, heads = 1 + (c->n_mtp_layers > 0);
    const int64_t head = N * n + N + N * D + N + N * D + N * c->vocab_size + N;
    const int64_t mtp = c->n_mtp_layers > 0 ? 2 * N * D + N + N * n * D + N * n + N * n * D : 0;
    return 4 * (2 * N + N * n * D + heads * head + mtp);
}

/* The table's rows of every block of a pass, against the pass a plan forward made: each kept unit's rows
 * sum to the bytes the block holds for it; summed over the blocks, the kept rows plus what lies outside
 * the blocks are the activation category at the end of the forward, the swapped rows the offload tier.
 * The category's peak over the step may pass the end of the forward only by the backward's transients. */
static void saved_table_matches_pass(const char *cfg, int64_t B, int64_t T, const char *const *flags, int nflags,
                                     bool bf16, bool swap) {
    ds4_config c;
    CHECK(ds4_config_load(cfg, &c) == DS4_OK, "%s", ds4_errmsg());
    uint32_t masks[DS4_MAX_LAYERS];
    masks_for(&c, flags, nflags, masks);
    const ds4_exec plan = {.plan = true};
    ds4_model *m = NULL;
    ds4_offload *off = NULL;
    ds4_act_swap *sw = NULL;
    int32_t *ids = calloc((size_t)(B * T), sizeof *ids);
    CHECK(ds4_model_create(&plan, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (swap) CHECK(ds4_offload_open(&plan, "/nonexistent-ds4-dir", &off) == DS4_OK && ds4_act_swap_new(off, &sw) == DS4_OK);
    const ds4_act_policies pol = {.recompute = nflags ? masks : NULL, .swap = sw};
    const ds4_pass_opts o = {.need_backward = true, .store = ds4_act_store_of(&pol), .bf16_acts = bf16};
    ds4_mem_stats s0, s1, s2;
    ds4_pass *p = NULL;
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    CHECK(m && ids && ds4_forward(m, ids, B, T, &o, &p) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_get(&s1);
    int64_t kept = 0, swapped = 0;
    for (int64_t l = 0; p && l < c.n_layers + c.n_mtp_layers; l++) {
        const ds4_saved_opts so = {.B = B, .T = T, .release_mask = nflags && l < c.n_layers ? masks[l] : 0,
                                   .swap_input = swap, .bf16 = bf16};
        ds4_saved_tensor t[DS4_SAVED_MAX];
        int64_t unit_rows[DS4_NUM_UNITS + 1] = {0};
        const int n = ds4_block_saved(&c, l, &so, t);
        for (int i = 0; i < n; i++) {
            kept += t[i].policy == DS4_ACT_KEEP ? t[i].bytes : 0;
            swapped += t[i].policy == DS4_ACT_SWAP ? t[i].bytes : 0;
            unit_rows[t[i].unit] += t[i].policy == DS4_ACT_KEEP ? t[i].bytes : 0;
        }
        for (int u = 0; u < DS4_NUM_UNITS; u++) {
            const ds4_unit_report r = ds4_pass_unit_report(p, l, u);
            CHECK(r.released || r.bytes == unit_rows[u], "%s block %lld %s: the table says %lld bytes, the block "
                  "holds %lld", cfg, (long long)l, ds4_unit_name(u), (long long)unit_rows[u], (long long)r.bytes);
        }
    }
    const int64_t act = s1.live[DS4_MEM_ACT] - s0.live[DS4_MEM_ACT];
    CHECK(act == kept + outside_blocks(&c, B * T), "%s%s%s %s: after the forward %lld act bytes, the table's kept "
          "rows %lld + %lld outside the blocks", cfg, bf16 ? " bf16" : "", swap ? " swap" : "", nflags ? flags[0] : "off",
          (long long)act, (long long)kept, (long long)outside_blocks(&c, B * T));
    CHECK(s1.offload_live_total - s0.offload_live_total == swapped && (swapped > 0) == swap, "%s: swapped %lld, "
          "the table %lld", cfg, (long long)(s1.offload_live_total - s0.offload_live_total), (long long)swapped);
    CHECK(p && ds4_backward(m, p) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_get(&s2);
    CHECK(s2.peak[DS4_MEM_ACT] - s0.live[DS4_MEM_ACT] >= act);
    ds4_pass_free(p);
    ds4_act_swap_free(sw);
    if (off) ds4_offload_close(off);
    ds4_model_free(m);
    free(ids);
}

static void test_saved_table_matches_pass(void) {
    const char *csa_mhc[] = {"--recompute-csa-attention", "--mhc-recompute"};
    const char *norm[] = {"--recompute-norm", "--recompute-norm-num-layers", "2", "--recompute-csa-attention"};
    const char *full[] = {"--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"};
    for (int v = 0; v < 4; v++) {
        const bool bf16 = v & 1, swap = v & 2;
        saved_table_matches_pass("tests/configs/tiny-a.json", 2, 64, NULL, 0, bf16, swap);
        saved_table_matches_pass("tests/configs/tiny-a.json", 2, 64, csa_mhc, 2, bf16, swap);
        saved_table_matches_pass("tests/configs/tiny-a.json", 1, 100, norm, 4, bf16, swap);
        saved_table_matches_pass("tests/configs/tiny-b.json", 2, 150, full, 6, bf16, swap);
    }
}

/* ------------------------------------------------------------------ --memory-report */
/* What owner name held of cat at its peak (its groups in *items, may be NULL), from the last step measured. */
static int64_t at_peak(ds4_mem_cat cat, const char *name, int64_t *items) {
    ds4_mem_owner_stat o[DS4_MEM_OWNERS_MAX];
    const int n = ds4_mem_owners_get(cat, o, DS4_MEM_OWNERS_MAX);
    for (int i = 0; i < n; i++)
        if (o[i].name && !strcmp(o[i].name, name)) {
            if (items) *items = o[i].items_at_peak;
            return o[i].at_peak;
        }
    if (items) *items = 0;
    return 0;
}

/* The owners' bytes at cat's peak, summed; *unowned: those counted under no owner. */
static int64_t owners_sum(ds4_mem_cat cat, int64_t *unowned) {
    ds4_mem_owner_stat o[DS4_MEM_OWNERS_MAX];
    const int n = ds4_mem_owners_get(cat, o, DS4_MEM_OWNERS_MAX);
    int64_t sum = 0;
    *unowned = 0;
    for (int i = 0; i < n && i < DS4_MEM_OWNERS_MAX; i++) {
        sum += o[i].at_peak;
        if (!o[i].name) *unowned += o[i].max;
    }
    return sum;
}

/* The gradients at their peak: resident, open, in flight, MTP rows (groups open and in flight). */
typedef struct {
    int64_t resident, open, flight, rows, open_groups, flight_groups;
} grads_split;

static grads_split grads_split_now(const ds4_step_memory *r, const char *what) {
    grads_split g;
    g.resident = at_peak(DS4_MEM_GRAD, DS4_OWNER_GRAD_RESIDENT, NULL);
    g.open = at_peak(DS4_MEM_GRAD, DS4_OWNER_GRAD_OPEN, &g.open_groups);
    g.flight = at_peak(DS4_MEM_GRAD, DS4_OWNER_GRAD_FLIGHT, &g.flight_groups);
    g.rows = at_peak(DS4_MEM_GRAD, DS4_OWNER_GRAD_ROWS, NULL);
    int64_t unowned;
    const int64_t sum = owners_sum(DS4_MEM_GRAD, &unowned);
    CHECK(sum == r->peak[DS4_MEM_GRAD] && g.resident + g.open + g.flight + g.rows == sum && !unowned,
          "%s: grads peak %lld, owners %lld = resident %lld + open %lld + in flight %lld + rows %lld, %lld unowned",
          what, (long long)r->peak[DS4_MEM_GRAD], (long long)sum, (long long)g.resident, (long long)g.open,
          (long long)g.flight, (long long)g.rows, (long long)unowned);
    /* the resident gradients are exactly what stays after the step */
    CHECK(g.resident == r->resident[DS4_MEM_GRAD] && g.resident > 0, "%s: resident %lld, after the step %lld", what,
          (long long)g.resident, (long long)r->resident[DS4_MEM_GRAD]);
    return g;
}

/* One process holds its gradients resident, planned and measured; FSDP on tiny-a (2 ranks, EP 2) holds its
 * shard resident and unsharded groups, at most prefetch-depth of them in flight at the peak, none when
 * blocking; a plan splits them as the real step of one FSDP rank does. */
static void test_grads_split(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_step_memory r;
    for (int plan = 0; plan < 2; plan++) {
        CHECK(ds4_step_memory_run(&c, 2, 64, NULL, plan, &r) == DS4_OK, "%s", ds4_errmsg());
        const grads_split g = grads_split_now(&r, plan ? "one process, planned" : "one process, measured");
        CHECK(g.resident == r.peak[DS4_MEM_GRAD], "one process: all resident");
    }
    for (int depth = 0; depth <= 2; depth++) {
        ds4_comm *sim = NULL;
        CHECK(ds4_comm_plan(2, 0, &sim) == DS4_OK, "%s", ds4_errmsg());
        const ds4_step_opts so = {.prefetch_depth = depth};
        CHECK(ds4_step_memory_run_dist_opts(&c, 2, 64, &so, true, sim, 2, true, &r) == DS4_OK, "%s", ds4_errmsg());
        ds4_comm_free(sim);
        const grads_split g = grads_split_now(&r, "2 ranks");
        CHECK(g.open > 0 && g.open_groups > 0 && g.rows == 64 * 2 * c.dim * (int64_t)sizeof(float),
              "depth %d: open %lld (%lld groups), rows %lld", depth, (long long)g.open, (long long)g.open_groups,
              (long long)g.rows);
        CHECK(g.flight_groups <= depth && (g.flight > 0) == (depth > 0) && (g.flight > 0) == (g.flight_groups > 0),
              "depth %d: %lld bytes in flight, %lld groups", depth, (long long)g.flight, (long long)g.flight_groups);
    }
    /* one FSDP rank (self), planned and measured: the same split */
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(1, 0, &sim) == DS4_OK, "%s", ds4_errmsg());
    const ds4_step_opts so = {.prefetch_depth = 1};
    CHECK(ds4_step_memory_run_dist_opts(&c, 2, 64, &so, true, sim, 1, true, &r) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm_free(sim);
    const grads_split p = grads_split_now(&r, "one FSDP rank, planned");
    CHECK(ds4_step_memory_run_dist_opts(&c, 2, 64, &so, false, ds4_comm_self(), 1, true, &r) == DS4_OK, "%s",
          ds4_errmsg());
    const grads_split m = grads_split_now(&r, "one FSDP rank, measured");
    CHECK(!memcmp(&p, &m, sizeof p) && p.flight_groups == 1, "one FSDP rank: planned open %lld in flight %lld, "
          "measured open %lld in flight %lld", (long long)p.open, (long long)p.flight, (long long)m.open,
          (long long)m.flight);
}

/* Every workspace byte of a plan has an owner, and the owners at the peak sum to it; at twice the tokens
 * the block's gradient buffers, the stream gradients and sparse attention's workspace grow, the GEMM's
 * packing reservation does not. */
static void test_workspace_users(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    static const char *const grow[] = {"block backward: gradient buffers", "backward: stream gradients",
                                       "op sparse_attn_bwd", "head backward", "moe"};
    int64_t most[2][5], gemm[2];
    for (int t = 0; t < 2; t++) {
        ds4_step_memory r;
        CHECK(ds4_step_memory_run(&c, 1, 64 << t, NULL, true, &r) == DS4_OK, "%s", ds4_errmsg());
        int64_t unowned;
        const int64_t sum = owners_sum(DS4_MEM_WORK, &unowned);
        CHECK(sum == r.peak[DS4_MEM_WORK] && !unowned, "T=%d: workspace peak %lld, owners %lld, %lld unowned",
              64 << t, (long long)r.peak[DS4_MEM_WORK], (long long)sum, (long long)unowned);
        ds4_mem_owner_stat o[DS4_MEM_OWNERS_MAX];
        const int n = ds4_mem_owners_get(DS4_MEM_WORK, o, DS4_MEM_OWNERS_MAX);
        for (int k = 0; k < 5; k++) most[t][k] = 0;
        gemm[t] = 0;
        for (int i = 0; i < n && i < DS4_MEM_OWNERS_MAX; i++) {
            for (int k = 0; k < 5; k++)
                if (o[i].name && !strcmp(o[i].name, grow[k])) most[t][k] = o[i].max;
            if (o[i].name && !strcmp(o[i].name, "op gemm_workspace_reserve")) gemm[t] = o[i].max;
        }
    }
    for (int k = 0; k < 5; k++)
        CHECK(most[0][k] > 0 && most[1][k] > most[0][k], "%s: %lld at T=64, %lld at T=128", grow[k],
              (long long)most[0][k], (long long)most[1][k]);
    CHECK(gemm[0] > 0 && gemm[1] == gemm[0], "GEMM packing: %lld, %lld", (long long)gemm[0], (long long)gemm[1]);
}

/* The most bytes workspace owner `name` (a unit: its name alone) held in the last step measured (0: none). */
static int64_t owner_most(const char *name) {
    ds4_mem_owner_stat o[DS4_MEM_OWNERS_MAX];
    const int n = ds4_mem_owners_get(DS4_MEM_WORK, o, DS4_MEM_OWNERS_MAX);
    for (int i = 0; i < n && i < DS4_MEM_OWNERS_MAX; i++)
        if (o[i].name && !strcmp(o[i].name, name)) return o[i].max;
    return 0;
}

/* The workspace that need not scale with the whole [N, V] or [N, H, hd]: the head's backward holds its two
 * [N, D] gradients and no [N, V] (the logits' gradient overwrites the logits), the MTP input's no [N, n, D];
 * o_proj's forward copy is one tile of tokens whatever T, its backward's and q_up's borrow the block's
 * gradient buffers; each of the block's gradient buffers lives from its first writer to its last reader, so
 * they are never all held at once. Plan == measured at a T of several tiles and a partial one. */
static void test_workspace_bounds(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    const int64_t D = c.dim, V = c.vocab_size, n = c.hc_mult, H = c.n_heads, hd = c.head_dim;
    int64_t o_proj[3];
    for (int t = 0; t < 3; t++) {
        const int64_t T = 64 << t, N = T;
        ds4_step_memory r;
        CHECK(ds4_step_memory_run(&c, 1, T, NULL, true, &r) == DS4_OK, "%s", ds4_errmsg());
        const int64_t head = owner_most("head backward");
        CHECK(head == 2 * N * D * (int64_t)sizeof(float) && head < N * V * (int64_t)sizeof(float),
              "T=%lld: head backward %lld bytes, not 2 [N, D]", (long long)T, (long long)head);
        CHECK(owner_most("q_up") == 0, "T=%lld: q_up %lld bytes", (long long)T, (long long)owner_most("q_up"));
        /* the MTP input's backward: its two [N, D] and the embedded rows' gradient [N, D]; its [N, n, D] is the
         * MTP block's spent output gradient */
        CHECK(owner_most("MTP input") == 3 * N * D * (int64_t)sizeof(float), "T=%lld: MTP input %lld bytes",
              (long long)T, (long long)owner_most("MTP input"));
        o_proj[t] = owner_most("o_proj");
        const int64_t ffn = N * (n * D + D + n + n * n + 2 * D);
        const int64_t attn = N * (D + n + n * n + c.o_groups * c.o_lora_rank + 2 * H * hd + hd + c.q_lora_rank + 2 * D);
        const int64_t grads = owner_most("block backward: gradient buffers");
        CHECK(grads > 0 && grads < (ffn + attn) * (int64_t)sizeof(float),
              "T=%lld: block gradient buffers %lld, all of them %lld", (long long)T, (long long)grads,
              (long long)((ffn + attn) * (int64_t)sizeof(float)));
    }
    /* o_proj's tile is 128 tokens: T = 64 holds 64 of them, T = 128 and 256 one whole tile */
    CHECK(o_proj[0] == 64 * H * hd * (int64_t)sizeof(float) && o_proj[1] == 2 * o_proj[0] && o_proj[2] == o_proj[1],
          "o_proj: %lld, %lld, %lld at T 64, 128, 256", (long long)o_proj[0], (long long)o_proj[1],
          (long long)o_proj[2]);
    plan_equals_measured("tests/configs/tiny-a.json", 1, 300, NULL, 0);
    plan_equals_measured("tests/configs/tiny-b.json", 3, 70, NULL, 0);

    /* V4-Flash 4K, rank 0 of FSDP 128 + EP 128: the MoE's exchange buffers ([N·K, D] and [R, D], each ~384 MiB)
     * live two at a time and its backward scratch is one (expert, source) block's, so the unit holds less than
     * the four exchange buffers at once */
    ds4_config f;
    CHECK(ds4_config_load("configs/deepseek-v4-flash.json", &f) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm *sim = NULL;
    CHECK(ds4_comm_plan(128, 0, &sim) == DS4_OK, "%s", ds4_errmsg());
    const ds4_step_opts so = {.prefetch_depth = 1};
    ds4_step_memory r;
    CHECK(ds4_step_memory_run_dist_opts(&f, 1, 4096, &so, true, sim, 128, true, &r) == DS4_OK, "%s", ds4_errmsg());
    ds4_comm_free(sim);
    const int64_t NK = 4096 * f.n_activated_experts, moe = owner_most("moe");
    CHECK(moe > 0 && moe < 4 * NK * f.dim * (int64_t)sizeof(float), "V4-Flash moe %lld bytes, four exchange buffers %lld",
          (long long)moe, (long long)(4 * NK * f.dim * (int64_t)sizeof(float)));
    CHECK(owner_most("head backward") == 2 * 4096 * f.dim * (int64_t)sizeof(float), "V4-Flash head backward %lld",
          (long long)owner_most("head backward"));
}

int main(void) {
    ds4_set_threads(2);
    RUN(test_plan_equals_measured_tiny_a);
    RUN(test_plan_equals_measured_tiny_b);
    RUN(test_swap_plan_equals_measured);
    RUN(test_matmul_precision_plan_equals_measured);
    RUN(test_swap_plan_equals_measured_dist);
    RUN(test_muon_plan_equals_measured);
    RUN(test_run_description_plan_equals_measured);
    RUN(test_plans_flash_and_pro);
    RUN(test_device_budget);
    RUN(test_resident_per_parameter);
    RUN(test_policies);
    RUN(test_saved_table_matches_pass);
    RUN(test_grads_split);
    RUN(test_workspace_users);
    RUN(test_workspace_bounds);
    TEST_MAIN_END("test_memplan");
}
