/* SQLite's allocation discipline: fail the N-th allocation (N = 1, 2, ...) through a model load, a
 * training step, a checkpoint save and a checkpoint load, and check that every run ends cleanly: a
 * status with a message (no crash, abort or exit), every byte given back (ds4_mem_get here, LeakSanitizer
 * under `make asan`), nothing half-written, and, once N passes the operation's last allocation, exactly
 * the result of the run without injection. One thread, so the N-th allocation is always the same one. */
#include "ds4/io.h"
#include "ds4/offload.h"
#include "ds4/shard.h"
#include "ds4/trainer.h"
#include "test.h"
#include "test_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];
static ds4_config g_cfg;

/* ------------------------------------------------------------------ the loop */
/* One operation under test: setup and teardown run without injection, run with it. Teardown frees
 * everything the operation made and checks what it left (ok: run returned DS4_OK). */
typedef struct {
    const char *name;
    void *ctx;
    ds4_status (*setup)(void *ctx);
    ds4_status (*run)(void *ctx);
    void (*teardown)(void *ctx, bool ok);
    int64_t every;  /* every N up to this, then ... */
    int64_t stride; /* ... every stride-th N (so the slow operations stay fast under ASan) */
} alloc_op;

static bool same_live(const ds4_mem_stats *a, const ds4_mem_stats *b) {
    for (int c = 0; c < DS4_MEM_NCAT; c++)
        if (a->live[c] != b->live[c] || a->offload_live[c] != b->offload_live[c]) return false;
    return true;
}

/* Runs op with the N-th allocation failing for N = 1, 2, ... until a run no longer reaches its N-th
 * allocation; returns the number of runs that failed an allocation. */
static int64_t fail_each_allocation(const alloc_op *op) {
    int64_t injected = 0, benign = 0;
    const double t0 = ds4_now();
    const int failed_before = t_cur_failed; /* stop at this operation's first failure, not an earlier one's */
    t_cur_failed = 0;
    for (int64_t n = 1;; n = n < op->every ? n + 1 : n + op->stride) {
        ds4_mem_stats before, after;
        ds4_mem_get(&before);
        ds4_status st = op->setup ? op->setup(op->ctx) : DS4_OK;
        CHECK(st == DS4_OK, "%s: setup: %s", op->name, ds4_errmsg());
        if (st != DS4_OK) return injected;
        ds4_fail(DS4_OK, "%s", "");
        int64_t f0 = ds4_alloc_failures();
        ds4_alloc_fail_after(n);
        st = op->run(op->ctx);
        ds4_alloc_fail_after(0);
        bool hit = ds4_alloc_failures() > f0;
        if (hit && st != DS4_OK) /* says what happened: not "invalid JSON", not a stale message */
            CHECK(strstr(ds4_errmsg(), "memory") || strstr(ds4_errmsg(), "allocate"),
                  "%s: allocation %lld failed: status %s, message '%s'", op->name, (long long)n, ds4_status_name(st),
                  ds4_errmsg());
        if (!hit)
            CHECK(st == DS4_OK, "%s: failed without an injected failure: %s", op->name, ds4_errmsg());
        if (getenv("DS4_TEST_VERBOSE") && hit)
            fprintf(stderr, "  %s: allocation %lld: %s\n", op->name, (long long)n, st != DS4_OK ? ds4_errmsg() : "survived");
        op->teardown(op->ctx, st == DS4_OK);
        ds4_mem_get(&after);
        CHECK(same_live(&before, &after), "%s: allocation %lld failed: %lld bytes not given back", op->name,
              (long long)n, (long long)(after.live_total - before.live_total));
        injected += hit && st != DS4_OK;
        benign += hit && st == DS4_OK;
        if (!hit || t_cur_failed) {
            if (getenv("DS4_TEST_VERBOSE"))
                fprintf(stderr, "  %s: %lld runs, %lld failed cleanly, %lld survived the failure, last N %lld, %.2f s\n",
                        op->name, (long long)(injected + benign + 1), (long long)injected, (long long)benign,
                        (long long)n, ds4_now() - t0);
            t_cur_failed |= failed_before;
            return injected;
        }
    }
}

/* ------------------------------------------------------------------ helpers */
static void rm_rf(const char *path) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", path);
}

static inline bool exists(const char *path) { return access(path, F_OK) == 0; }

/* Entries of dir whose name starts with ".tmp" or holds ".tmp." (an unfinished atomic write). */
static inline int count_temporaries(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *de; d && (de = readdir(d));)
        n += !strncmp(de->d_name, ".tmp", 4) || strstr(de->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

static bool same_model(ds4_model *a, ds4_model *b) {
    if (memcmp(ds4_model_params_flat(a), ds4_model_params_flat(b), (size_t)ds4_model_numel(a) * sizeof(float)))
        return false;
    for (int64_t i = 0; i < ds4_model_nparams(a); i++) {
        const ds4_param *p = ds4_model_param(a, i), *q = ds4_model_param(b, i);
        if (p->is_int && memcmp(p->idata, q->idata, (size_t)p->numel * sizeof(int64_t))) return false;
    }
    return true;
}

/* ------------------------------------------------------------------ (a) model load */
typedef struct {
    char dir[512];
    ds4_model *ref; /* what the directory holds */
    ds4_model *m;
} load_ctx;

static ds4_status load_run(void *ctx) {
    load_ctx *c = ctx;
    ds4_model_dir *d;
    DS4_TRY(ds4_model_dir_open(c->dir, &d));
    ds4_status st = ds4_model_create(NULL, ds4_model_dir_config(d), false, &c->m);
    if (st == DS4_OK) st = ds4_model_load(c->m, d);
    ds4_model_dir_close(d);
    return st;
}

static void load_teardown(void *ctx, bool ok) {
    load_ctx *c = ctx;
    if (ok) CHECK(c->m && same_model(c->m, c->ref), "the loaded model differs from the saved one");
    ds4_model_free(c->m);
    c->m = NULL;
}

static void test_model_load(void) {
    load_ctx c = {0};
    snprintf(c.dir, sizeof c.dir, "%s/model", g_dir);
    CHECK(ds4_model_create(NULL, &g_cfg, false, &c.ref) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_init_random(c.ref, 21);
    mkdir(c.dir, 0755);
    CHECK(ds4_model_save(c.ref, c.dir, DS4_F32) == DS4_OK, "%s", ds4_errmsg());
    alloc_op op = {"model load", &c, NULL, load_run, load_teardown, 150, 53};
    CHECK(fail_each_allocation(&op) > 10, "a model load makes more than 10 allocations");
    ds4_model_free(c.ref);
}

/* ------------------------------------------------------------------ (b) one training step */
enum { T_SEQ = 16 };

/* A training state under one policy (recompute, offload) and the files around it: ckpt0 holds the
 * initial state (step 0, also a model directory, d0), ckpt1 the state after one step. Every run opens a
 * state of its own from d0 (so what it leaves behind is all given back with it). */
typedef struct {
    const char *name;
    char root[512], ckpt0[600], ckpt1[600], off[512];
    ds4_model_dir *d0;
    ds4_train_state_opts so;
    ds4_recompute_cfg rc;
    ds4_train_state *s;
    uint32_t masks[DS4_MAX_LAYERS];
    int32_t ids[T_SEQ];
    int64_t *loads;
    double total_loss, gnorm;
    /* the step without injection: its loss, norm and the parameters after it */
    double ref_loss, ref_gnorm;
    float *ref_params;
} step_ctx;

/* The trainer's step (ds4_train_step) on one micro-batch: forward, backward, clip, AdamW, the router bias rule. */
static ds4_status step_run(void *ctx) {
    step_ctx *c = ctx;
    static const ds4_adamw_cfg adamw = {3e-3, 0.9, 0.95, 1e-8, 0.1};
    const ds4_step_args a = {.step = 1, .micro_batches = 1, .B = 1, .T = T_SEQ, .ids = c->ids, .loads = c->loads,
                             .release_mask = ds4_recompute_any(&c->rc) ? c->masks : NULL, .adamw = &adamw,
                             .lr = 3e-3, .max_norm = 1.0, .router_bias_gamma = 1e-3};
    ds4_step_result r;
    DS4_TRY(ds4_train_step(c->s, &a, &r));
    c->total_loss = r.total_loss;
    c->gnorm = r.grad_norm;
    return DS4_OK;
}

static size_t param_bytes(void) {
    ds4_model *m;
    if (ds4_model_create(NULL, &g_cfg, false, &m) != DS4_OK) return 0;
    size_t b = (size_t)ds4_model_numel(m) * sizeof(float);
    ds4_model_free(m);
    return b;
}

static bool params_are_ref(step_ctx *c) {
    return !memcmp(ds4_model_params_flat(ds4_train_state_model(c->s)), c->ref_params, param_bytes());
}

/* The initial state: weights from d0, zero moments. */
static ds4_status step_setup(void *ctx) {
    step_ctx *c = ctx;
    return ds4_train_state_open(&g_cfg, c->d0, 0, ds4_comm_world(), &c->so, &c->s);
}

static void state_close(step_ctx *c) {
    ds4_train_state_free(c->s);
    c->s = NULL;
}

static void step_teardown(void *ctx, bool ok) {
    step_ctx *c = ctx;
    if (ok) {
        CHECK(c->total_loss == c->ref_loss && c->gnorm == c->ref_gnorm, "%s: loss %.17g, norm %.17g vs %.17g, %.17g",
              c->name, c->total_loss, c->gnorm, c->ref_loss, c->ref_gnorm);
        CHECK(params_are_ref(c), "%s: parameters differ after the step", c->name);
    }
    state_close(c);
}

static ds4_ckpt_meta meta_of_step2(void) {
    ds4_ckpt_meta meta = {.step = 2, .seed = 5};
    snprintf(meta.data_state, sizeof meta.data_state, "0 2 5 7");
    return meta;
}

/* The reference: a random initial state saved as ckpt0, one step, saved as ckpt1 and as ROOT-ref's step 2. */
static bool step_ctx_open(step_ctx *c, const char *name, bool swap, bool recompute, bool bf16) {
    const int64_t nb = g_cfg.n_layers + g_cfg.n_mtp_layers;
    c->name = name;
    snprintf(c->root, sizeof c->root, "%s/%s", g_dir, name);
    snprintf(c->off, sizeof c->off, "%s", g_dir);
    snprintf(c->ckpt0, sizeof c->ckpt0, "%s/step-00000000", c->root);
    snprintf(c->ckpt1, sizeof c->ckpt1, "%s/step-00000001", c->root);
    c->so = (ds4_train_state_opts){.ep = 1, .swap_optimizer = swap, .swap_layer_input = swap, .offload_dir = c->off,
                                   .bf16 = bf16};
    ds4_recompute_defaults(&c->rc);
    c->rc.csa_attention = c->rc.mhc = recompute;
    ds4_recompute_masks(&c->rc, &g_cfg, c->masks);
    for (int i = 0; i < T_SEQ; i++) c->ids[i] = (int32_t)(ds4_rng_u64(3, 1, (uint64_t)i) % 256);
    c->loads = malloc((size_t)(nb * g_cfg.n_routed_experts) * sizeof(int64_t));
    char ref[600];
    snprintf(ref, sizeof ref, "%s-ref", c->root);
    ds4_ckpt_meta meta2 = meta_of_step2();
    ds4_status st = ds4_train_state_open(&g_cfg, NULL, 5, ds4_comm_world(), &c->so, &c->s);
    if (st == DS4_OK) st = ds4_train_state_save(c->s, c->root, 0, &(ds4_ckpt_meta){.step = 0});
    if (st == DS4_OK) st = step_run(c);
    if (st == DS4_OK) st = ds4_train_state_save(c->s, c->root, 0, &(ds4_ckpt_meta){.step = 1});
    if (st == DS4_OK) st = ds4_train_state_save(c->s, ref, 0, &meta2);
    if (st == DS4_OK) {
        c->ref_loss = c->total_loss;
        c->ref_gnorm = c->gnorm;
        c->ref_params = malloc(param_bytes());
        memcpy(c->ref_params, ds4_model_params_flat(ds4_train_state_model(c->s)), param_bytes());
    }
    state_close(c);
    if (st == DS4_OK) st = ds4_model_dir_open(c->ckpt0, &c->d0);
    CHECK(st == DS4_OK, "%s: %s", name, ds4_errmsg());
    return st == DS4_OK;
}

static void step_ctx_close(step_ctx *c) {
    state_close(c);
    ds4_model_dir_close(c->d0);
    free(c->ref_params);
    free(c->loads);
}

/* ------------------------------------------------------------------ (c) checkpoint save */
/* The state after the step (loaded from ckpt1) saved as step 2 next to ckpt0 and ckpt1. A failed save
 * leaves them as they were and nothing else; a save that succeeds writes what the uninjected save wrote
 * (ROOT-ref/step-00000002). */
static const char *k_ckpt_files[] = {"config.json", "model.safetensors", "optim.state", "state.json"};

static ds4_status save_setup(void *ctx) {
    step_ctx *c = ctx;
    DS4_TRY(step_setup(c));
    ds4_ckpt_meta meta;
    return ds4_train_state_load(c->s, c->ckpt1, &meta);
}

static ds4_status save_run(void *ctx) {
    step_ctx *c = ctx;
    ds4_ckpt_meta meta = meta_of_step2();
    return ds4_train_state_save(c->s, c->root, 0, &meta);
}

/* Files of checkpoint a equal those of b (state.json too when with_state). */
static bool same_ckpt(const char *a, const char *b, bool with_state) {
    for (int i = 0; i < 4; i++) {
        if (i == 3 && !with_state) continue;
        char pa[700], pb[700];
        snprintf(pa, sizeof pa, "%s/%s", a, k_ckpt_files[i]);
        snprintf(pb, sizeof pb, "%s/%s", b, k_ckpt_files[i]);
        if (!t_files_equal(pa, pb)) return false;
    }
    return true;
}

static void save_teardown(void *ctx, bool ok) {
    step_ctx *c = ctx;
    char p2[600], ref2[700];
    snprintf(p2, sizeof p2, "%s/step-00000002", c->root);
    snprintf(ref2, sizeof ref2, "%s-ref/step-00000002", c->root);
    if (ok) CHECK(same_ckpt(p2, ref2, true), "%s: the saved checkpoint differs from the uninjected save", c->name);
    else CHECK(!exists(p2), "%s: a failed save left %s", c->name, p2);
    CHECK(count_temporaries(c->root) == 0, "%s: a save left a temporary in %s", c->name, c->root);
    CHECK(same_ckpt(c->ckpt1, ref2, false), "%s: a save changed %s", c->name, c->ckpt1);
    rm_rf(p2);
    state_close(c);
}

static void save_case(step_ctx *c, int64_t every, int64_t stride) {
    char name[64];
    snprintf(name, sizeof name, "%s: save", c->name);
    alloc_op op = {name, c, save_setup, save_run, save_teardown, every, stride};
    CHECK(fail_each_allocation(&op) > 5, "%s: a save makes more than 5 allocations", name);
}

/* ------------------------------------------------------------------ (d) checkpoint load */
/* From the initial state, load ckpt1: the parameters and the moments are those after the step. */
static ds4_status reload_run(void *ctx) {
    step_ctx *c = ctx;
    ds4_ckpt_meta meta;
    DS4_TRY(ds4_train_state_load(c->s, c->ckpt1, &meta));
    if (meta.step != 1) return ds4_fail(DS4_ERR_INTERNAL, "%s: meta step %lld, expected 1", c->ckpt1, (long long)meta.step);
    return DS4_OK;
}

static void reload_teardown(void *ctx, bool ok) {
    step_ctx *c = ctx;
    if (ok) {
        CHECK(params_are_ref(c), "%s: the loaded parameters differ from the saved ones", c->name);
        char again[600], p[700], q[700];
        snprintf(again, sizeof again, "%s-again", c->root); /* the moments, as the state saves them again */
        ds4_ckpt_meta meta = {.step = 1};
        CHECK(ds4_train_state_save(c->s, again, 0, &meta) == DS4_OK, "%s", ds4_errmsg());
        snprintf(p, sizeof p, "%s/step-00000001/optim.state", again);
        snprintf(q, sizeof q, "%s/optim.state", c->ckpt1);
        CHECK(t_files_equal(p, q), "%s: the loaded optimizer state differs from the saved one", c->name);
        rm_rf(again);
    }
    state_close(c);
}

static void load_case(step_ctx *c, int64_t every, int64_t stride) {
    char name[64];
    snprintf(name, sizeof name, "%s: load", c->name);
    alloc_op op = {name, c, step_setup, reload_run, reload_teardown, every, stride};
    CHECK(fail_each_allocation(&op) > 5, "%s: a load makes more than 5 allocations", name);
}

/* The step loop, then (with_ckpt) the save and load loops. */
static void step_case(const char *name, bool swap, bool recompute, bool bf16, bool with_ckpt, int64_t every,
                      int64_t stride) {
    step_ctx c = {0};
    if (step_ctx_open(&c, name, swap, recompute, bf16)) {
        alloc_op op = {name, &c, step_setup, step_run, step_teardown, every, stride};
        CHECK(fail_each_allocation(&op) > 10, "%s: a step makes more than 10 allocations", name);
        if (with_ckpt) save_case(&c, 20, 23);
        if (with_ckpt) load_case(&c, 40, 197);
    }
    step_ctx_close(&c);
}

/* ------------------------------------------------------------------ a first forward */
/* On a fresh model: it also builds the rope tables. */
typedef struct {
    ds4_model_dir *d;
    ds4_model *m;
    int32_t ids[T_SEQ];
    double loss, ref_loss;
    bool have_ref;
    int64_t live_before; /* bytes live once the model exists */
    int64_t cache;       /* bytes a forward leaves in the model: its rope tables */
} fresh_ctx;

static ds4_status fresh_setup(void *ctx) {
    fresh_ctx *c = ctx;
    DS4_TRY(ds4_model_create(NULL, &g_cfg, false, &c->m));
    DS4_TRY(ds4_model_load(c->m, c->d)); /* the weights of test_model_load's directory */
    for (int i = 0; i < T_SEQ; i++) c->ids[i] = (int32_t)(ds4_rng_u64(3, 2, (uint64_t)i) % 256);
    ds4_mem_stats ms;
    ds4_mem_get(&ms);
    c->live_before = ms.live_total;
    return DS4_OK;
}

static ds4_status fresh_run(void *ctx) {
    fresh_ctx *c = ctx;
    ds4_pass_opts o = {.need_backward = false};
    ds4_pass *p;
    DS4_TRY(ds4_forward(c->m, c->ids, 1, T_SEQ, &o, &p));
    c->loss = ds4_pass_losses(p)->total_loss;
    ds4_pass_free(p);
    return DS4_OK;
}

static void fresh_teardown(void *ctx, bool ok) {
    fresh_ctx *c = ctx;
    ds4_mem_stats ms;
    ds4_mem_get(&ms);
    const int64_t kept = ms.live_total - c->live_before;
    if (ok && !c->have_ref) c->ref_loss = c->loss, c->cache = kept, c->have_ref = true;
    else if (ok) CHECK(c->loss == c->ref_loss, "first forward: loss %.17g vs %.17g", c->loss, c->ref_loss);
    /* the rope tables stay in the model once built, but nothing half-built does */
    CHECK(kept == c->cache || (!ok && kept == 0), "first forward: %lld bytes left in the model, %lld expected",
          (long long)kept, (long long)c->cache);
    ds4_model_free(c->m);
    c->m = NULL;
}

static void test_first_forward(void) {
    fresh_ctx c = {0};
    char dir[600];
    snprintf(dir, sizeof dir, "%s/model", g_dir);
    CHECK(ds4_model_dir_open(dir, &c.d) == DS4_OK, "%s", ds4_errmsg());
    if (!c.d) return;
    if (fresh_setup(&c) == DS4_OK) fresh_teardown(&c, fresh_run(&c) == DS4_OK);
    CHECK(c.have_ref, "the forward without injection failed: %s", ds4_errmsg());
    alloc_op op = {"first forward", &c, fresh_setup, fresh_run, fresh_teardown, 20, 7};
    CHECK(fail_each_allocation(&op) > 10, "a forward makes more than 10 allocations");
    ds4_model_dir_close(c.d);
}

static void test_train_step_and_checkpoints(void) {
    step_case("step", false, false, false, true, 30, 17);
    step_case("step csa+mhc", false, true, false, false, 0, 23);
    step_case("step swap", true, false, false, true, 0, 19);
    step_case("step bf16 swap+csa+mhc", true, true, true, false, 0, 13); /* mixed precision's packs and widenings */
}

/* ------------------------------------------------------------------ (e) ds4 train resuming */
/* `ds4 train` from a model directory resuming step 1's checkpoint, one step, the final save. A run that
 * fails leaves step 1 as it was and no temporary; a step 2 that exists is the uninjected run's (so no step
 * ran on a half-loaded state), and so is the logged loss. */
typedef struct {
    ds4_train_cfg cfg;
    char root[512], ref[512], jsonl[512], ref_jsonl[512];
} resume_ctx;

/* Fields of the step-2 record of a JSONL file: loss, total_loss, grad_norm; false when absent. */
static bool step2_record(const char *path, double v[3]) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[2048];
    bool found = false;
    while (fgets(line, sizeof line, f)) {
        int st;
        double mtp, idx;
        found |= sscanf(line, "{\"step\": %d, \"loss\": %lf, \"mtp_loss\": %lf, \"indexer_loss\": %lf, \"total_loss\": %lf, "
                              "\"grad_norm\": %lf", &st, &v[0], &mtp, &idx, &v[1], &v[2]) == 6 && st == 2;
    }
    fclose(f);
    return found;
}

static ds4_status train_cfg(resume_ctx *c, const char *root, const char *jsonl, int steps, const char *model_dir) {
    char text[4096];
    snprintf(text, sizeof text,
             "[model]\ndir = \"%s\"\n"
             "[training]\nsteps = %d\nseq_len = 16\nglobal_batch_size = 1\nmicro_batch_size = 1\nseed = 5\nthreads = 1\n"
             "[optimizer]\nlr = 3e-3\n[lr_scheduler]\nwarmup_steps = 1\ndecay_steps = 2\n"
             "[data]\ntrain = \"%s/train.bin\"\n[checkpoint]\nfolder = \"%s\"\nkeep_latest_k = 3\n"
             "[metrics]\nlog_freq = 1\njsonl = \"%s\"\npeak_tflops = 1.0\n",
             model_dir, steps, g_dir, root, jsonl);
    ds4_toml *t;
    DS4_TRY(ds4_toml_parse(text, strlen(text), "allocfail.toml", &t));
    ds4_status st = ds4_train_cfg_from_toml(t, &c->cfg);
    ds4_toml_free(t);
    return st;
}

static ds4_status resume_run(void *ctx) { return ds4_train_run(&((resume_ctx *)ctx)->cfg); }

static void resume_teardown(void *ctx, bool ok) {
    resume_ctx *c = ctx;
    char p1[600], r1[600], p2[600], r2[600];
    snprintf(p1, sizeof p1, "%s/step-00000001", c->root);
    snprintf(r1, sizeof r1, "%s/step-00000001", c->ref);
    snprintf(p2, sizeof p2, "%s/step-00000002", c->root);
    snprintf(r2, sizeof r2, "%s/step-00000002", c->ref);
    CHECK(count_temporaries(c->root) == 0, "resume: a run left a temporary in %s", c->root);
    CHECK(same_ckpt(p1, r1, true), "resume: a run changed %s", p1);
    CHECK(!ok || exists(p2), "resume: the run succeeded without saving step 2");
    if (exists(p2)) CHECK(same_ckpt(p2, r2, true), "resume: step 2 differs from the uninjected run's");
    double v[3], ref[3];
    if (step2_record(c->jsonl, v)) {
        CHECK(step2_record(c->ref_jsonl, ref) && !memcmp(v, ref, sizeof v),
              "resume: step 2 logged loss %.6f, norm %.6f, the uninjected run %.6f, %.6f", v[0], v[2], ref[0], ref[2]);
    } else {
        CHECK(!ok, "resume: the run succeeded without logging step 2");
    }
    rm_rf(p2);
    unlink(c->jsonl);
}

static void test_train_resume(void) {
    resume_ctx c = {0};
    char model[600];
    snprintf(model, sizeof model, "%s/model", g_dir);
    snprintf(c.root, sizeof c.root, "%s/resume", g_dir);
    snprintf(c.ref, sizeof c.ref, "%s/resume-ref", g_dir);
    snprintf(c.jsonl, sizeof c.jsonl, "%s/resume.jsonl", g_dir);
    snprintf(c.ref_jsonl, sizeof c.ref_jsonl, "%s/resume-ref.jsonl", g_dir);
    fflush(stdout);
    int saved_stdout = dup(1), null = open("/dev/null", O_WRONLY);
    dup2(null, 1); /* the runs' progress lines */
    /* the uninjected runs: step 1 in both folders, then step 2 in the reference one */
    ds4_status st = train_cfg(&c, c.ref, c.ref_jsonl, 1, model);
    if (st == DS4_OK) st = ds4_train_run(&c.cfg);
    if (st == DS4_OK) st = train_cfg(&c, c.ref, c.ref_jsonl, 2, model);
    if (st == DS4_OK) st = ds4_train_run(&c.cfg);
    if (st == DS4_OK) st = train_cfg(&c, c.root, c.jsonl, 1, model);
    if (st == DS4_OK) st = ds4_train_run(&c.cfg);
    unlink(c.jsonl);
    if (st == DS4_OK) st = train_cfg(&c, c.root, c.jsonl, 2, model);
    CHECK(st == DS4_OK, "%s", ds4_errmsg());
    if (st == DS4_OK) {
        alloc_op op = {"train resume", &c, NULL, resume_run, resume_teardown, 0, 211};
        CHECK(fail_each_allocation(&op) > 10, "a resumed run makes more than 10 allocations");
    }
    fflush(stdout);
    dup2(saved_stdout, 1);
    close(saved_stdout);
    close(null);
}

/* A shard of 4 documents of 200 tokens. */
static ds4_status write_shard(const char *path) {
    ds4_shard_writer *w;
    DS4_TRY(ds4_shard_writer_open(path, 256, -1, 1, &w));
    int32_t doc[200];
    ds4_status st = DS4_OK;
    for (int d = 0; d < 4 && st == DS4_OK; d++) {
        for (int i = 0; i < 200; i++) doc[i] = (int32_t)(2 + ds4_rng_u64(7, (uint64_t)d, (uint64_t)i) % 254);
        st = ds4_shard_writer_add(w, doc, 200);
    }
    if (st != DS4_OK) {
        ds4_shard_writer_abort(w);
        return st;
    }
    return ds4_shard_writer_close(w);
}

int main(void) {
    /* /dev/shm where there is one: the loops save many checkpoints, and fsync there costs nothing */
    snprintf(g_dir, sizeof g_dir, "%s/ds4-test-allocfail-%d", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp",
             (int)getpid());
    mkdir(g_dir, 0755);
    ds4_set_threads(1); /* the N-th allocation is the same one in every run */
    if (ds4_config_load("tests/configs/tiny-a.json", &g_cfg) != DS4_OK) {
        fprintf(stderr, "cannot load tiny-a: %s\n", ds4_errmsg());
        return 1;
    }
    char shard[600];
    snprintf(shard, sizeof shard, "%s/train.bin", g_dir);
    if (write_shard(shard) != DS4_OK) {
        fprintf(stderr, "%s: %s\n", shard, ds4_errmsg());
        return 1;
    }
    RUN(test_model_load);
    RUN(test_first_forward);
    RUN(test_train_step_and_checkpoints);
    RUN(test_train_resume);
    if (!t_failed) rm_rf(g_dir);
    TEST_MAIN_END("test_allocfail");
}
