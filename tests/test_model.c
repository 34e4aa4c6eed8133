/* The whole model in C: parameter table, init, determinism, a whole-model directional
 * finite-difference check of the gradient, bad token ids, and activation memory linear in T. */
#include "ds4/io.h"
#include "ds4/model.h"
#include "test.h"

static ds4_config g_cfg;
static bool g_have_cfg;

static ds4_model *tiny_model(uint64_t seed) {
    ds4_model *m = NULL;
    CHECK(g_have_cfg, "tests/configs/tiny-a.json did not load");
    if (!g_have_cfg) return NULL;
    ds4_status st = ds4_model_create(NULL, &g_cfg, false, &m);
    CHECK(st == DS4_OK, "model create: %s", ds4_errmsg());
    if (st != DS4_OK) return NULL;
    ds4_model_init_random(m, seed);
    return m;
}

static void make_ids(int32_t *ids, int64_t n, int64_t V, unsigned seed) {
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(ds4_rng_u64(seed, 99, (uint64_t)i) % (uint64_t)V);
}

/* Runs forward + backward (zeroing gradients first); returns the losses. */
static ds4_status fwd_bwd(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, ds4_losses *L) {
    ds4_pass_opts o = {.need_backward = true};
    ds4_pass *p;
    ds4_model_zero_grad(m);
    DS4_TRY(ds4_forward(m, ids, B, T, &o, &p));
    ds4_status st = ds4_backward(m, p);
    *L = *ds4_pass_losses(p);
    ds4_pass_free(p);
    return st;
}

static double total_loss_fwd(ds4_model *m, const int32_t *ids, int64_t B, int64_t T) {
    ds4_pass_opts o = {.need_backward = false};
    ds4_pass *p;
    if (ds4_forward(m, ids, B, T, &o, &p) != DS4_OK) return NAN;
    double v = ds4_pass_losses(p)->total_loss;
    ds4_pass_free(p);
    return v;
}

static void test_param_table(void) {
    ds4_model *m = tiny_model(1);
    if (!m) return;
    const char *names[] = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.hc_attn_fn",
                           "layers.0.ffn.gate.tid2eid", "layers.1.attn.indexer.compressor.ape",
                           "layers.2.attn.compressor.wkv.weight", "layers.3.ffn.gate.bias",
                           "layers.1.ffn.experts.7.w2.weight", "mtp.0.e_proj.weight", "mtp.0.ffn.gate.bias",
                           "mtp.0.attn.wo_a.weight", "mtp.0.hc_head_scale"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        CHECK(ds4_model_find(m, names[i]) != NULL, "missing %s", names[i]);
    CHECK(ds4_model_find(m, "layers.0.attn.compressor.wkv.weight") == NULL, "SWA layer has no compressor");
    CHECK(ds4_model_find(m, "layers.2.attn.indexer.wq_b.weight") == NULL, "HCA layer has no indexer");
    CHECK(ds4_model_find(m, "mtp.0.attn.compressor.wkv.weight") == NULL);
    ds4_param *p = ds4_model_find(m, "layers.1.attn.compressor.wkv.weight");
    CHECK(p && p->shape[0] == 64 && p->shape[1] == 64, "CSA compressor wkv is [2·head_dim, dim]");
    p = ds4_model_find(m, "layers.2.attn.compressor.ape");
    CHECK(p && p->shape[0] == 16 && p->shape[1] == 32, "HCA ape is [ratio, head_dim]");
    p = ds4_model_find(m, "layers.0.attn.wo_a.weight");
    CHECK(p && p->shape[0] == 32 && p->shape[1] == 64, "wo_a is [G·R, H·c/G]");
    /* init rules */
    CHECK(ds4_model_find(m, "norm.weight")->data[3] == 1.0f);
    CHECK(ds4_model_find(m, "layers.0.hc_attn_scale")->data[2] == 1.0f);
    CHECK(ds4_model_find(m, "layers.0.hc_attn_base")->data[5] == 0.0f);
    CHECK(ds4_model_find(m, "layers.1.attn.attn_sink")->data[0] == 0.0f);
    ds4_param *t = ds4_model_find(m, "layers.0.ffn.gate.tid2eid");
    bool distinct = true, in_range = true;
    for (int64_t v = 0; v < t->shape[0]; v++) {
        int64_t a = t->idata[v * 2], b = t->idata[v * 2 + 1];
        distinct &= a != b;
        in_range &= a >= 0 && a < 8 && b >= 0 && b < 8;
    }
    CHECK(distinct && in_range, "tid2eid rows hold distinct expert ids");
    ds4_param *w = ds4_model_find(m, "layers.0.attn.wq_a.weight");
    double s2 = 0;
    for (int64_t i = 0; i < w->numel; i++) s2 += (double)w->data[i] * w->data[i];
    CHECK(fabs(sqrt(s2 / (double)w->numel) - 0.02) < 0.002, "std %g", sqrt(s2 / (double)w->numel));
    ds4_model_free(m);
}

static void test_initial_loss_and_determinism(void) {
    ds4_model *m = tiny_model(3);
    if (!m) return;
    int64_t B = 2, T = 64;
    int32_t ids[128];
    make_ids(ids, B * T, 256, 5);
    ds4_losses a, b;
    CHECK(fwd_bwd(m, ids, B, T, &a) == DS4_OK, "%s", ds4_errmsg());
    int64_t n = ds4_model_numel(m);
    float *g1 = malloc((size_t)n * sizeof(float));
    memcpy(g1, ds4_model_grads_flat(m), (size_t)n * sizeof(float));
    CHECK(fwd_bwd(m, ids, B, T, &b) == DS4_OK);
    CHECK(fabs(a.loss - log(256.0)) < 0.05, "initial loss %g vs ln V %g", a.loss, log(256.0));
    CHECK(a.indexer_loss > 0 && isfinite(a.indexer_loss), "indexer loss %g", a.indexer_loss);
    CHECK(a.total_loss == b.total_loss && a.indexer_loss == b.indexer_loss, "losses not bitwise repeatable");
    CHECK(memcmp(g1, ds4_model_grads_flat(m), (size_t)n * sizeof(float)) == 0, "gradients not bitwise repeatable");
    double gn = 0;
    for (int64_t i = 0; i < n; i++) gn += (double)g1[i] * g1[i];
    CHECK(gn > 0 && isfinite(gn));
    free(g1);
    ds4_model_free(m);
}

/* d/dε total_loss(θ + ε·u) at 0 equals ⟨g, u⟩ for u = g/|g| (central difference, float model). */
static void test_whole_model_directional_derivative(void) {
    ds4_model *m = tiny_model(11);
    if (!m) return;
    int64_t B = 1, T = 40;
    int32_t ids[40];
    make_ids(ids, B * T, 256, 8);
    ds4_losses L;
    CHECK(fwd_bwd(m, ids, B, T, &L) == DS4_OK, "%s", ds4_errmsg());
    int64_t n = ds4_model_numel(m);
    float *theta = ds4_model_params_flat(m), *g = ds4_model_grads_flat(m);
    float *t0 = malloc((size_t)n * sizeof(float)), *u = malloc((size_t)n * sizeof(float));
    memcpy(t0, theta, (size_t)n * sizeof(float));
    double gn = 0;
    for (int64_t i = 0; i < n; i++) gn += (double)g[i] * g[i];
    gn = sqrt(gn);
    for (int64_t i = 0; i < n; i++) u[i] = (float)(g[i] / gn);
    double h = 2e-3;
    for (int64_t i = 0; i < n; i++) theta[i] = t0[i] + (float)h * u[i];
    double lp = total_loss_fwd(m, ids, B, T);
    for (int64_t i = 0; i < n; i++) theta[i] = t0[i] - (float)h * u[i];
    double lm = total_loss_fwd(m, ids, B, T);
    memcpy(theta, t0, (size_t)n * sizeof(float));
    double fd = (lp - lm) / (2 * h);
    CHECK(fabs(fd - gn) <= 0.02 * gn, "finite difference %g vs |g| %g", fd, gn);
    free(t0);
    free(u);
    ds4_model_free(m);
}

static void test_bad_token_ids(void) {
    ds4_model *m = tiny_model(1);
    if (!m) return;
    int32_t ids[32];
    make_ids(ids, 32, 256, 1);
    ids[17] = 256;
    ds4_pass_opts o = {.need_backward = true};
    ds4_pass *p = NULL;
    CHECK(ds4_forward(m, ids, 1, 32, &o, &p) == DS4_ERR_ARG);
    CHECK(strstr(ds4_errmsg(), "input_ids[0, 17]") && strstr(ds4_errmsg(), "256"), "%s", ds4_errmsg());
    CHECK(p == NULL);
    ids[17] = -1;
    CHECK(ds4_forward(m, ids, 1, 32, &o, &p) == DS4_ERR_ARG);
    ds4_model_free(m);
}

/* Peak activation + workspace bytes of one training pass, measured with the allocator. */
static int64_t pass_peak(ds4_model *m, int64_t T) {
    int32_t *ids = malloc((size_t)T * sizeof(int32_t));
    make_ids(ids, T, 256, 2);
    ds4_mem_stats s0, s1;
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    ds4_losses L;
    ds4_status st = fwd_bwd(m, ids, 1, T, &L);
    ds4_mem_get(&s1);
    free(ids);
    if (st != DS4_OK) return -1;
    CHECK(s1.live[DS4_MEM_ACT] == s0.live[DS4_MEM_ACT], "activations leaked: %lld bytes",
          (long long)(s1.live[DS4_MEM_ACT] - s0.live[DS4_MEM_ACT]));
    return s1.peak_total - s0.live_total;
}

static void test_activation_bytes_linear_in_T(void) {
    ds4_model *m = tiny_model(4);
    if (!m) return;
    int64_t p1 = pass_peak(m, 128), p2 = pass_peak(m, 256), p3 = pass_peak(m, 512);
    printf("  activation+workspace peak: T=128 %lld B, T=256 %lld B, T=512 %lld B\n", (long long)p1,
           (long long)p2, (long long)p3);
    CHECK(p1 > 0 && p2 > p1 && p3 > p2);
    /* linear: the increments double exactly as T doubles (up to allocator-free rounding) */
    double r = (double)(p3 - p2) / (double)(p2 - p1);
    CHECK(fabs(r - 2.0) < 0.02, "increment ratio %g (2 for linear, 4 for quadratic)", r);
    ds4_model_free(m);
}

int main(void) {
    ds4_set_threads(2);
    g_have_cfg = ds4_config_load("tests/configs/tiny-a.json", &g_cfg) == DS4_OK;
    if (!g_have_cfg) fprintf(stderr, "cannot load tiny-a: %s\n", ds4_errmsg());
    RUN(test_param_table);
    RUN(test_initial_loss_and_determinism);
    RUN(test_whole_model_directional_derivative);
    RUN(test_bad_token_ids);
    RUN(test_activation_bytes_linear_in_T);
    TEST_MAIN_END("test_model");
}
