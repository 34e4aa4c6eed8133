/* The offload tier: the store round-trips bytes through its file, reuses dropped space, counts its bytes
 * in the offload tier only, and names the directory and OS error when it fails; --swap-optimizer gives
 * bitwise the in-memory AdamW with ~no optimizer bytes resident, and its checkpoint file is the same;
 * --swap-layer-input gives bitwise the same losses and gradients, alone and with recompute, and lowers
 * the activation peak by the streams it moved out. */
#include "ds4/actstore.h"
#include "ds4/io.h"
#include "ds4/model.h"
#include "ds4/offload.h"
#include "ds4/recompute.h"
#include "ds4/train.h"
#include "test.h"
#include "test_models.h"
#include "test_files.h"

#include <errno.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];

/* A fresh directory for this run's files. */
static const char *tmpdir(void) {
    if (!g_dir[0]) {
        snprintf(g_dir, sizeof g_dir, "/tmp/ds4-test-offload-XXXXXX");
        if (!mkdtemp(g_dir)) g_dir[0] = 0;
    }
    return g_dir;
}

static void fill_bytes(uint8_t *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)(ds4_rng_u64(seed, 1, i) & 0xff);
}

/* ------------------------------------------------------------------ store */
static void test_store_round_trip(void) {
    ds4_mem_stats s0, s1;
    ds4_mem_get(&s0);
    ds4_offload *s;
    CHECK(ds4_offload_open(NULL, tmpdir(), &s) == DS4_OK, "%s", ds4_errmsg());
    if (!s) return;
    const size_t sizes[3] = {10000, 1, 3 * 4096};
    uint8_t *src[3], *dst = malloc(3 * 4096);
    int64_t h[3];
    for (int i = 0; i < 3; i++) {
        src[i] = malloc(sizes[i]);
        fill_bytes(src[i], sizes[i], 7 + (unsigned)i);
        CHECK(ds4_offload_put(s, DS4_MEM_ACT, src[i], sizes[i], &h[i]) == DS4_OK, "%s", ds4_errmsg());
    }
    ds4_mem_get(&s1);
    CHECK(s1.offload_live[DS4_MEM_ACT] - s0.offload_live[DS4_MEM_ACT] == 10000 + 1 + 3 * 4096,
          "offload tier counts the bytes put: %lld", (long long)(s1.offload_live[DS4_MEM_ACT] - s0.offload_live[DS4_MEM_ACT]));
    CHECK(s1.live[DS4_MEM_ACT] == s0.live[DS4_MEM_ACT], "the memory tier does not see offloaded bytes");
    for (int i = 2; i >= 0; i--) { /* any order */
        memset(dst, 0xcd, 3 * 4096);
        CHECK(ds4_offload_get(s, h[i], dst) == DS4_OK, "%s", ds4_errmsg());
        CHECK(memcmp(dst, src[i], sizes[i]) == 0, "handle %d round trip", i);
        CHECK(ds4_offload_size(s, h[i]) == sizes[i]);
    }
    /* ranged access inside one handle */
    uint8_t patch[100];
    fill_bytes(patch, sizeof patch, 99);
    CHECK(ds4_offload_write(s, h[0], 5000, patch, sizeof patch) == DS4_OK, "%s", ds4_errmsg());
    memcpy(src[0] + 5000, patch, sizeof patch);
    CHECK(ds4_offload_read(s, h[0], 4990, dst, 200) == DS4_OK && memcmp(dst, src[0] + 4990, 200) == 0);
    CHECK(ds4_offload_read(s, h[0], 9990, dst, 20) == DS4_ERR_ARG && strstr(ds4_errmsg(), "outside handle"),
          "a range past the handle is refused: %s", ds4_errmsg());
    /* reuse after drop: a smaller handle fits in the dropped space, alloc is zero even there */
    const int64_t file0 = ds4_offload_file_bytes(s);
    ds4_offload_drop(s, h[0]);
    CHECK(ds4_offload_get(s, h[0], dst) == DS4_ERR_ARG, "a dropped handle is unknown");
    int64_t hz;
    CHECK(ds4_offload_alloc(s, DS4_MEM_OPTIM, 8000, &hz) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_offload_file_bytes(s) == file0, "dropped space reused: file %lld -> %lld", (long long)file0,
          (long long)ds4_offload_file_bytes(s));
    CHECK(ds4_offload_get(s, hz, dst) == DS4_OK, "%s", ds4_errmsg());
    bool zero = true;
    for (int i = 0; i < 8000; i++) zero = zero && dst[i] == 0;
    CHECK(zero, "alloc on reused space reads zero");
    for (int i = 1; i < 3; i++) {
        CHECK(ds4_offload_get(s, h[i], dst) == DS4_OK && memcmp(dst, src[i], sizes[i]) == 0,
              "handle %d intact after reuse", i);
        ds4_offload_drop(s, h[i]);
    }
    ds4_offload_drop(s, hz);
    ds4_mem_get(&s1);
    CHECK(s1.offload_live_total == s0.offload_live_total, "every byte left the tier");
    CHECK(ds4_offload_file_bytes(s) == 0, "a store with nothing in it has an empty file");
    ds4_offload_close(s);
    for (int i = 0; i < 3; i++) free(src[i]);
    free(dst);
}

static void test_store_errors(void) {
    ds4_offload *s = NULL;
    CHECK(ds4_offload_open(NULL, "/nonexistent-ds4-dir/x", &s) == DS4_ERR_IO && !s);
    CHECK(strstr(ds4_errmsg(), "/nonexistent-ds4-dir/x") && strstr(ds4_errmsg(), "No such file"),
          "names the directory and the OS error: %s", ds4_errmsg());
    /* a file where the directory should be (root ignores permission bits, not this) */
    char file[128];
    snprintf(file, sizeof file, "%s/plain-file", tmpdir());
    FILE *f = fopen(file, "w");
    if (f) fclose(f);
    CHECK(ds4_offload_open(NULL, file, &s) == DS4_ERR_IO && strstr(ds4_errmsg(), file) &&
              strstr(ds4_errmsg(), "Not a directory"), "%s", ds4_errmsg());
    unlink(file);
    /* the file cannot grow (as on a full disk): the error names the file and the OS error */
    CHECK(ds4_offload_open(NULL, tmpdir(), &s) == DS4_OK, "%s", ds4_errmsg());
    if (!s) return;
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = 1 << 16;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &lim);
    uint8_t *big = calloc(1, 1 << 20);
    int64_t h;
    ds4_status st = ds4_offload_put(s, DS4_MEM_ACT, big, 1 << 20, &h);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    CHECK(st == DS4_ERR_IO && h == -1, "a put past the file size limit fails");
    CHECK(strstr(ds4_errmsg(), tmpdir()) && strstr(ds4_errmsg(), "File too large"), "%s", ds4_errmsg());
    ds4_mem_stats m;
    ds4_mem_get(&m);
    CHECK(ds4_offload_file_bytes(s) == 0 && m.offload_live_total == 0, "a failed put holds nothing");
    CHECK(ds4_offload_put(s, DS4_MEM_ACT, big, 1 << 20, &h) == DS4_OK, "usable again: %s", ds4_errmsg());
    free(big);
    ds4_offload_close(s);
}

/* A plan store: counts, no file. */
static void test_store_plan(void) {
    const ds4_exec plan = {.plan = true};
    ds4_offload *s;
    ds4_status st = ds4_offload_open(&plan, "/nonexistent-ds4-dir", &s);
    int64_t h = -1;
    if (st == DS4_OK) st = ds4_offload_alloc(s, DS4_MEM_OPTIM, 1 << 30, &h);
    ds4_mem_stats m;
    ds4_mem_get(&m);
    CHECK(st == DS4_OK, "a plan store opens no file: %s", ds4_errmsg());
    CHECK(m.offload_live[DS4_MEM_OPTIM] == 1 << 30, "and counts the bytes");
    if (st == DS4_OK) ds4_offload_close(s);
}

/* ------------------------------------------------------------------ --swap-optimizer */
static bool moments_equal(const ds4_optim *a, const ds4_optim *b) {
    float *x = malloc((size_t)a->n * sizeof(float)), *y = malloc((size_t)a->n * sizeof(float));
    bool eq = a->n == b->n;
    for (int k = 0; k < 2 && eq; k++)
        eq = ds4_optim_read(a, DS4_OPT_ADAMW, k, 0, a->n, x) == DS4_OK &&
             ds4_optim_read(b, DS4_OPT_ADAMW, k, 0, b->n, y) == DS4_OK &&
             memcmp(x, y, (size_t)a->n * sizeof(float)) == 0;
    free(x);
    free(y);
    return eq && a->step == b->step;
}

static void test_swap_optimizer_equals_resident(void) {
    const size_t chunk = 1 << 16; /* 8192 elements of m and v: chunks straddle parameters */
    ds4_model *ma = tiny_model("tests/configs/tiny-a.json", 3), *mb = tiny_model("tests/configs/tiny-a.json", 3);
    ds4_offload *s = NULL;
    CHECK(ds4_offload_open(NULL, tmpdir(), &s) == DS4_OK, "%s", ds4_errmsg());
    if (!ma || !mb || !s) return;
    const int64_t n = ds4_model_numel(ma);
    ds4_optim ra, sb;
    ds4_mem_stats m0, m1, m2;
    CHECK(ds4_optim_init(&ra, NULL, ma, NULL, 0) == DS4_OK);
    ds4_mem_get(&m0);
    CHECK(ds4_optim_init(&sb, NULL, mb, s, chunk) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_get(&m1);
    CHECK(m1.live[DS4_MEM_OPTIM] == m0.live[DS4_MEM_OPTIM], "no optimizer byte resident between steps");
    CHECK(m1.offload_live[DS4_MEM_OPTIM] - m0.offload_live[DS4_MEM_OPTIM] == 8 * n,
          "m and v (4 B each) in the store, nothing else per element: %lld for %lld parameters",
          (long long)(m1.offload_live[DS4_MEM_OPTIM] - m0.offload_live[DS4_MEM_OPTIM]), (long long)n);
    ds4_adamw_cfg ac = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    for (int step = 0; step < 3; step++) {
        t_fill(ds4_model_grads_flat(ma), (long)n, 40 + (unsigned)step, 0.5f);
        memcpy(ds4_model_grads_flat(mb), ds4_model_grads_flat(ma), (size_t)n * sizeof(float));
        CHECK(ds4_adamw_step(&ra, ma, &ac, 1e-3) == DS4_OK);
        ds4_mem_get(&m1);
        ds4_mem_reset_peak();
        CHECK(ds4_adamw_step(&sb, mb, &ac, 1e-3) == DS4_OK, "%s", ds4_errmsg());
        ds4_mem_get(&m2);
        CHECK(m2.peak[DS4_MEM_OPTIM] - m1.live[DS4_MEM_OPTIM] == (int64_t)chunk,
              "step %d: optimizer memory during the update %lld, not the chunk's buffers %zu", step,
              (long long)(m2.peak[DS4_MEM_OPTIM] - m1.live[DS4_MEM_OPTIM]), chunk);
        CHECK(m2.live[DS4_MEM_OPTIM] == m1.live[DS4_MEM_OPTIM], "buffers freed after the update");
        CHECK(memcmp(ds4_model_params_flat(ma), ds4_model_params_flat(mb), (size_t)n * sizeof(float)) == 0,
              "step %d: parameters differ", step);
        CHECK(moments_equal(&ra, &sb), "step %d: moments differ", step);
    }
    /* resident, then moved out (default chunk), then moments brought back: the same bits at every step */
    ds4_optim rc;
    ds4_model *mc = tiny_model("tests/configs/tiny-a.json", 3);
    CHECK(ds4_optim_init(&rc, NULL, mc, NULL, 0) == DS4_OK);
    for (int step = 0; step < 3 && mc; step++) {
        t_fill(ds4_model_grads_flat(mc), (long)n, 40 + (unsigned)step, 0.5f);
        if (step == 1) CHECK(ds4_optim_swap_out(&rc, s, 0) == DS4_OK && rc.swapped && !rc.g[0].mem[0], "%s", ds4_errmsg());
        if (step == 2) CHECK(ds4_optim_swap_in(&rc) == DS4_OK && !rc.swapped && rc.g[0].mem[1], "%s", ds4_errmsg());
        CHECK(ds4_adamw_step(&rc, mc, &ac, 1e-3) == DS4_OK, "%s", ds4_errmsg());
    }
    CHECK(moments_equal(&rc, &ra), "swap in / out: moments differ");
    CHECK(ds4_optim_swap_out(&rc, NULL, 0) == DS4_OK && rc.swapped && !rc.g[0].mem[1], "%s", ds4_errmsg());
    CHECK(mc && memcmp(ds4_model_params_flat(ma), ds4_model_params_flat(mc), (size_t)n * sizeof(float)) == 0,
          "default chunk: parameters differ");
    ds4_optim_free(&rc);
    ds4_optim_free(&ra);
    ds4_optim_free(&sb);
    ds4_mem_get(&m2);
    CHECK(m2.offload_live[DS4_MEM_OPTIM] == m0.offload_live[DS4_MEM_OPTIM], "free drops the state from the store");
    ds4_offload_close(s);
    ds4_model_free(ma);
    ds4_model_free(mb);
    ds4_model_free(mc);
}

/* A checkpoint of a swapped optimizer is byte for byte that of the resident one, and loads back into
 * either form. */
static void test_swap_optimizer_checkpoint(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 5);
    ds4_offload *s = NULL;
    CHECK(ds4_offload_open(NULL, tmpdir(), &s) == DS4_OK, "%s", ds4_errmsg());
    if (!m || !s) return;
    const int64_t n = ds4_model_numel(m);
    ds4_optim r, w;
    ds4_adamw_cfg ac = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    float *p0 = malloc((size_t)n * sizeof(float));
    memcpy(p0, ds4_model_params_flat(m), (size_t)n * sizeof(float));
    CHECK(ds4_optim_init(&r, NULL, m, NULL, 0) == DS4_OK && ds4_optim_init(&w, NULL, m, s, 10000) == DS4_OK, "%s",
          ds4_errmsg());
    for (int step = 0; step < 2; step++) {
        t_fill(ds4_model_grads_flat(m), (long)n, 60 + (unsigned)step, 0.5f);
        memcpy(ds4_model_params_flat(m), p0, (size_t)n * sizeof(float));
        ds4_adamw_step(&r, m, &ac, 1e-3);
        memcpy(ds4_model_params_flat(m), p0, (size_t)n * sizeof(float));
        ds4_adamw_step(&w, m, &ac, 1e-3);
    }
    char ra[128], rb[128], fa[200], fb[200], path[200];
    snprintf(ra, sizeof ra, "%s/ckpt-resident", tmpdir());
    snprintf(rb, sizeof rb, "%s/ckpt-swapped", tmpdir());
    ds4_ckpt_meta meta = {.step = 2, .seed = 1};
    CHECK(ds4_checkpoint_save(ra, 1, m, &r, &meta) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_checkpoint_save(rb, 1, m, &w, &meta) == DS4_OK, "%s", ds4_errmsg());
    snprintf(fa, sizeof fa, "%s/step-00000002/optim.state", ra);
    snprintf(fb, sizeof fb, "%s/step-00000002/optim.state", rb);
    CHECK(t_files_equal(fa, fb), "optim.state of the swapped optimizer differs from the resident one's");
    /* load the resident one's file into a fresh swapped optimizer and a fresh resident one */
    ds4_optim ls, lr;
    CHECK(ds4_optim_init(&ls, NULL, m, s, 0) == DS4_OK && ds4_optim_init(&lr, NULL, m, NULL, 0) == DS4_OK);
    snprintf(path, sizeof path, "%s/step-00000002", ra);
    CHECK(ds4_checkpoint_load(path, m, &ls, &meta) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_checkpoint_load(path, m, &lr, &meta) == DS4_OK, "%s", ds4_errmsg());
    CHECK(moments_equal(&ls, &r) && moments_equal(&lr, &r), "loaded moments differ");
    CHECK(ls.swapped && !ls.g[0].mem[0] && !ls.g[0].mem[1], "loading keeps the swapped state in the store");
    ds4_optim_free(&ls);
    ds4_optim_free(&lr);
    ds4_optim_free(&r);
    ds4_optim_free(&w);
    ds4_offload_close(s);
    ds4_model_free(m);
    free(p0);
}

/* ------------------------------------------------------------------ --swap-layer-input */
static void masks_from(const char *const *argv, const ds4_config *c, uint32_t *masks) {
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    int argc = 0;
    while (argv[argc]) argc++;
    for (int i = 0; i < argc; i++) {
        bool used;
        CHECK(ds4_recompute_parse_arg(&r, argc, (char **)argv, &i, &used) == DS4_OK && used, "%s", argv[i]);
    }
    CHECK(ds4_recompute_validate(&r, c) == DS4_OK, "%s", ds4_errmsg());
    ds4_recompute_masks(&r, c, masks);
}

typedef struct {
    ds4_losses loss[2];
    float *grads;        /* after 2 accumulated passes */
    int64_t act_peak;    /* activation peak of the passes, above what was live before */
    int64_t moved_peak;  /* offload-tier activation peak */
} pass_result;

/* npass (1 or 2) forward + backward passes (gradients accumulate; the second reuses the context) of one
 * model under masks, with or without the layer-input hooks. */
static void run_passes(ds4_model *m, const uint32_t *masks, ds4_act_swap *a, int64_t B, int64_t T, int npass,
                       pass_result *out) {
    const ds4_config *c = ds4_model_config(m);
    const int64_t n = ds4_model_numel(m);
    int32_t *ids = malloc((size_t)(B * T) * sizeof(int32_t));
    for (int64_t i = 0; i < B * T; i++) ids[i] = (int32_t)(ds4_rng_u64(9, 3, (uint64_t)i) % (uint64_t)c->vocab_size);
    ds4_model_zero_grad(m);
    ds4_mem_stats s0, s1;
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    for (int k = 0; k < npass; k++) {
        const ds4_act_policies pol = {.recompute = masks, .swap = a};
        ds4_pass_opts o = {.need_backward = true, .store = ds4_act_store_of(&pol)};
        ds4_pass *p = NULL;
        CHECK(ds4_forward(m, ids, B, T, &o, &p) == DS4_OK, "%s", ds4_errmsg());
        if (!p) break;
        CHECK(!a || ds4_act_swap_held(a) == c->n_layers, "every main layer's input is out after forward: %lld",
              (long long)(a ? ds4_act_swap_held(a) : 0));
        CHECK(ds4_backward(m, p) == DS4_OK, "%s", ds4_errmsg());
        CHECK(!a || ds4_act_swap_held(a) == 0, "every input came back in backward");
        out->loss[k] = *ds4_pass_losses(p);
        ds4_pass_free(p);
    }
    ds4_mem_get(&s1);
    out->act_peak = s1.peak[DS4_MEM_ACT] - s0.live[DS4_MEM_ACT];
    out->moved_peak = s1.offload_peak[DS4_MEM_ACT] - s0.offload_live[DS4_MEM_ACT];
    out->grads = malloc((size_t)n * sizeof(float));
    memcpy(out->grads, ds4_model_grads_flat(m), (size_t)n * sizeof(float));
    free(ids);
}

static void swap_layer_input_equal(const char *cfg_path, int64_t B, int64_t T, int npass,
                                   const char *const *policy, const char *pname) {
    ds4_model *m = tiny_model(cfg_path, 11);
    ds4_offload *s = NULL;
    ds4_act_swap *a = NULL;
    CHECK(ds4_offload_open(NULL, tmpdir(), &s) == DS4_OK && ds4_act_swap_new(s, &a) == DS4_OK, "%s", ds4_errmsg());
    if (!m || !a) return;
    const ds4_config *c = ds4_model_config(m);
    uint32_t masks[DS4_MAX_LAYERS];
    masks_from(policy, c, masks);
    const uint32_t *mk = policy[0] ? masks : NULL;
    pass_result off = {0}, on = {0};
    run_passes(m, mk, NULL, B, T, npass, &off);
    run_passes(m, mk, a, B, T, npass, &on);
    const int64_t n = ds4_model_numel(m);
    for (int k = 0; k < npass; k++)
        CHECK(memcmp(&off.loss[k], &on.loss[k], sizeof off.loss[k]) == 0, "%s %s pass %d: losses %.9g vs %.9g",
              cfg_path, pname, k, on.loss[k].total_loss, off.loss[k].total_loss);
    CHECK(off.grads && on.grads && memcmp(off.grads, on.grads, (size_t)n * sizeof(float)) == 0,
          "%s %s: gradients differ", cfg_path, pname);
    /* one boundary stream [N, n, D] per main layer went out; the peak fell by all but about one of them */
    const int64_t S = B * T * c->hc_mult * c->dim * (int64_t)sizeof(float);
    CHECK(on.moved_peak == c->n_layers * S, "%s %s: moved %lld bytes, expected %lld layers x %lld", cfg_path, pname,
          (long long)on.moved_peak, (long long)c->n_layers, (long long)S);
    CHECK(off.act_peak - on.act_peak >= on.moved_peak - S, "%s %s: activation peak %lld -> %lld, moved out %lld",
          cfg_path, pname, (long long)off.act_peak, (long long)on.act_peak, (long long)on.moved_peak);
    CHECK(off.moved_peak == 0);
    const ds4_act_swap_stats mv = ds4_act_swap_moved(a); /* every stream out once per pass, and back */
    CHECK(mv.saves == npass * c->n_layers && mv.fetches == mv.saves && mv.bytes_out == mv.saves * S &&
          mv.bytes_in == mv.bytes_out, "%s %s: %lld saves, %lld fetches", cfg_path, pname, (long long)mv.saves,
          (long long)mv.fetches);
    free(off.grads);
    free(on.grads);
    ds4_act_swap_free(a);
    ds4_offload_close(s);
    ds4_model_free(m);
}

static const char *const k_off[] = {NULL};
static const char *const k_full[] = {"--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1", NULL};
static const char *const k_csa_mhc[] = {"--recompute-csa-attention", "--mhc-recompute", NULL};

static void test_swap_layer_input_tiny_a(void) {
    swap_layer_input_equal("tests/configs/tiny-a.json", 2, 64, 2, k_off, "off");
    swap_layer_input_equal("tests/configs/tiny-a.json", 2, 64, 2, k_full, "full uniform");
    swap_layer_input_equal("tests/configs/tiny-a.json", 2, 64, 2, k_csa_mhc, "csa+mhc");
}

static void test_swap_layer_input_tiny_b(void) {
    swap_layer_input_equal("tests/configs/tiny-b.json", 1, 150, 1, k_off, "off");
    swap_layer_input_equal("tests/configs/tiny-b.json", 1, 150, 1, k_full, "full uniform");
    swap_layer_input_equal("tests/configs/tiny-b.json", 1, 150, 1, k_csa_mhc, "csa+mhc");
}

/* Eval passes keep nothing for backward, so nothing is offloaded; a pass freed before its backward
 * leaves nothing behind in the store. */
static void test_swap_layer_input_eval_and_abandon(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 2);
    ds4_offload *s = NULL;
    ds4_act_swap *a = NULL;
    CHECK(ds4_offload_open(NULL, tmpdir(), &s) == DS4_OK && ds4_act_swap_new(s, &a) == DS4_OK, "%s", ds4_errmsg());
    if (!m || !a) return;
    int32_t ids[32];
    for (int i = 0; i < 32; i++) ids[i] = i * 7 % 256;
    const ds4_act_policies pol = {.swap = a};
    ds4_pass_opts o = {.need_backward = false, .store = ds4_act_store_of(&pol)};
    ds4_pass *p = NULL;
    CHECK(ds4_forward(m, ids, 1, 32, &o, &p) == DS4_OK && ds4_act_swap_held(a) == 0, "%s", ds4_errmsg());
    ds4_pass_free(p);
    o.need_backward = true;
    CHECK(ds4_forward(m, ids, 1, 32, &o, &p) == DS4_OK && ds4_act_swap_held(a) > 0, "%s", ds4_errmsg());
    ds4_pass_free(p);
    ds4_mem_stats st;
    ds4_mem_get(&st);
    CHECK(ds4_act_swap_held(a) == 0 && st.offload_live[DS4_MEM_ACT] == 0, "a freed pass drops its streams");
    ds4_act_swap_free(a);
    ds4_offload_close(s);
    ds4_model_free(m);
}

/* The store's policies as the model asks them, and a policy the model cannot follow: one clear error. */
static ds4_act_policy swap_everything(void *ctx, int64_t layer, int unit) {
    (void)ctx, (void)layer, (void)unit;
    return DS4_ACT_SWAP;
}
static void release_nothing(void *ctx, int64_t layer, int unit, int slot) {
    (void)ctx, (void)layer, (void)unit, (void)slot;
}

static void test_act_store_policies(void) {
    uint32_t masks[2] = {1u << 3, 0};
    ds4_offload *s = NULL;
    ds4_act_swap *a = NULL;
    CHECK(ds4_offload_open(NULL, tmpdir(), &s) == DS4_OK && ds4_act_swap_new(s, &a) == DS4_OK, "%s", ds4_errmsg());
    const ds4_act_policies pol = {.recompute = masks, .swap = a}, keep = {0};
    const ds4_act_store st = ds4_act_store_of(&pol), kst = ds4_act_store_of(&keep);
    CHECK(st.ops->policy(st.ctx, 0, 3) == DS4_ACT_RECOMPUTE && st.ops->policy(st.ctx, 0, 2) == DS4_ACT_KEEP &&
          st.ops->policy(st.ctx, 1, 3) == DS4_ACT_KEEP, "recompute follows the masks");
    CHECK(st.ops->policy(st.ctx, 1, DS4_UNIT_INPUT) == DS4_ACT_SWAP &&
          kst.ops->policy(kst.ctx, 1, DS4_UNIT_INPUT) == DS4_ACT_KEEP && kst.ops->policy(kst.ctx, 0, 3) == DS4_ACT_KEEP,
          "layer inputs swap only with a swap");
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 2);
    if (m) {
        int32_t ids[16];
        for (int i = 0; i < 16; i++) ids[i] = i * 5 % 256;
        const ds4_act_store_ops bad_ops = {.policy = swap_everything, .release = release_nothing};
        ds4_pass_opts o = {.need_backward = true, .store = {&bad_ops, NULL}};
        ds4_pass *p = NULL;
        CHECK(ds4_forward(m, ids, 1, 16, &o, &p) == DS4_ERR_ARG && !p &&
              strstr(ds4_errmsg(), "unit hc_pre_attn of layer 0 cannot be swapped"), "%s", ds4_errmsg());
        ds4_model_free(m);
    }
    ds4_act_swap_free(a);
    ds4_offload_close(s);
}

int main(void) {
    ds4_set_threads(2);
    RUN(test_store_round_trip);
    RUN(test_store_errors);
    RUN(test_store_plan);
    RUN(test_swap_optimizer_equals_resident);
    RUN(test_swap_optimizer_checkpoint);
    RUN(test_swap_layer_input_tiny_a);
    RUN(test_swap_layer_input_tiny_b);
    RUN(test_swap_layer_input_eval_and_abandon);
    RUN(test_act_store_policies);
    if (g_dir[0]) {
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    }
    TEST_MAIN_END("test_offload");
}
