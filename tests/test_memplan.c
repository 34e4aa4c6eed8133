/* memplan: the shape-only run of one training step predicts the measured peak of a real step byte
 * for byte, per category, on the small configs and under recompute policies; and it plans the real
 * DeepSeek-V4-Flash and -Pro configurations at 4K and 64K quickly. */
#include "ds4/io.h"
#include "ds4/memplan.h"
#include "ds4/recompute.h"
#include "test.h"

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

int main(void) {
    ds4_set_threads(2);
    RUN(test_plan_equals_measured_tiny_a);
    RUN(test_plan_equals_measured_tiny_b);
    RUN(test_plans_flash_and_pro);
    TEST_MAIN_END("test_memplan");
}
