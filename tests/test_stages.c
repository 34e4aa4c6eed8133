/* Stage passes (ds4_stage_forward / ds4_stage_backward, docs/pipeline.md): the pass cut at layer boundaries
 * and run stage after stage in one process, handing the residual stream forward and its gradient back,
 * gives bitwise the losses and every gradient of the whole ds4_forward / ds4_backward: 2 and 4 stages,
 * uneven cuts, a stage of the embedding alone and one of the head alone, with and without a recompute
 * policy, fp32 and bf16 activations, and on cpu-guard. The stage checks refuse what a cut cannot be; the
 * parameter hooks see each stage's own groups only; stages on models holding only their own groups (a
 * pipeline rank's, ds4_model_hold) give the same gradients. */
#include "ds4/actstore.h"
#include "ds4/kernels.h"
#include "ds4/model.h"
#include "ds4/recompute.h"
#include "test.h"
#include "test_models.h"

#define B 2
#define T 32

typedef struct {
    ds4_losses losses;
    float *grads; /* [numel] */
} result;

static void make_ids(int32_t *ids, int64_t n, int64_t V) {
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(ds4_rng_u64(41, 3, (uint64_t)i) % (uint64_t)V);
}

static float *grads_copy(ds4_model *m) {
    const size_t bytes = (size_t)ds4_model_numel(m) * sizeof(float);
    float *g = malloc(bytes);
    if (g) ds4_model_to_host(m, g, ds4_model_grads_flat(m), bytes); /* a device model's too */
    return g;
}

static bool run_whole(ds4_model *m, const int32_t *ids, const ds4_pass_opts *o, result *r) {
    ds4_pass *p;
    ds4_model_zero_grad(m);
    if (ds4_forward(m, ids, B, T, o, &p) != DS4_OK) return false;
    bool ok = ds4_backward(m, p) == DS4_OK;
    r->losses = *ds4_pass_losses(p);
    ds4_pass_free(p);
    r->grads = ok ? grads_copy(m) : NULL;
    return ok && r->grads;
}

/* cut[0..n]: the stage boundaries (0 = cut[0] <= ... <= cut[n] = n_layers). hand_rows: the last stage hands
 * the MTP rows' gradient to the first (ds4_stage.mtp_rows_out), which scatters it. */
static bool run_stages(ds4_model *m, const int32_t *ids, const ds4_pass_opts *o, const int64_t *cut, int n,
                       bool hand_rows, result *r) {
    const ds4_config *c = ds4_model_config(m);
    ds4_pass *p[8] = {0};
    bool ok = true;
    ds4_model_zero_grad(m);
    for (int s = 0; s < n && ok; s++) {
        const ds4_stage st = {.layer_begin = cut[s], .layer_end = cut[s + 1], .embedding = s == 0, .head = s == n - 1,
                              .mtp_rows_out = hand_rows && s == n - 1 && s > 0};
        ok = ds4_stage_forward(m, ids, B, T, o, &st, s ? ds4_pass_stream_out(p[s - 1]) : NULL, &p[s]) == DS4_OK;
        CHECK(ok, "stage %d forward: %s", s, ds4_errmsg());
    }
    for (int s = n - 1; s >= 0 && ok; s--) {
        const float *rows = hand_rows && s == 0 && n > 1 ? ds4_pass_mtp_rows_grad(p[n - 1]) : NULL;
        CHECK(!hand_rows || s > 0 || n == 1 || rows, "the head stage handed no MTP rows");
        ok = ds4_stage_backward_rows(m, p[s], s < n - 1 ? ds4_pass_stream_grad(p[s + 1]) : NULL, rows) == DS4_OK;
        CHECK(ok, "stage %d backward: %s", s, ds4_errmsg());
        CHECK(!ok || (ds4_pass_stream_grad(p[s]) != NULL) == (s > 0), "stage %d: the input's gradient", s);
    }
    if (ok) {
        double kl[DS4_MAX_LAYERS] = {0};
        for (int s = 0; s < n; s++)
            for (int64_t l = cut[s]; l < cut[s + 1]; l++) kl[l] = ds4_pass_layer_kl(p[s], l);
        const ds4_losses *last = ds4_pass_losses(p[n - 1]);
        r->losses = ds4_losses_combine(c, last->loss, last->mtp_loss, kl);
        r->grads = grads_copy(m);
        ok = r->grads != NULL;
    }
    for (int s = 0; s < n; s++) ds4_pass_free(p[s]);
    return ok;
}

static void compare(const char *what, const result *a, const result *b, int64_t numel) {
    CHECK(memcmp(&a->losses, &b->losses, sizeof a->losses) == 0,
          "%s: losses %.17g %.17g %.17g %.17g vs %.17g %.17g %.17g %.17g", what, a->losses.loss, a->losses.mtp_loss,
          a->losses.indexer_loss, a->losses.total_loss, b->losses.loss, b->losses.mtp_loss, b->losses.indexer_loss,
          b->losses.total_loss);
    if (!a->grads || !b->grads) return;
    int64_t first = -1;
    for (int64_t i = 0; i < numel && first < 0; i++)
        if (memcmp(&a->grads[i], &b->grads[i], sizeof(float))) first = i;
    CHECK(first < 0, "%s: gradients differ first at element %lld (%.9g vs %.9g)", what, (long long)first,
          first < 0 ? 0.0 : a->grads[first], first < 0 ? 0.0 : b->grads[first]);
}

static const struct {
    const char *name;
    int n;
    int64_t cut[6];
} k_cuts[] = {
    {"2 stages", 2, {0, 2, 4}},
    {"4 stages", 4, {0, 1, 2, 3, 4}},
    {"uneven 3+1", 2, {0, 3, 4}},
    {"uneven 1+3", 2, {0, 1, 4}},
    {"embedding alone, head alone", 4, {0, 0, 2, 4, 4}},
};

static void check_cuts(const char *cfg, bool bf16, const char *const *flags) {
    ds4_model *m = tiny_model(cfg, 5);
    if (!m) return;
    const ds4_config *c = ds4_model_config(m);
    int32_t ids[B * T];
    make_ids(ids, B * T, c->vocab_size);
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_act_policies pol = {0};
    if (flags) {
        ds4_recompute_cfg rc;
        ds4_recompute_defaults(&rc);
        int argc = 0;
        while (flags[argc]) argc++;
        for (int i = 0; i < argc; i++) {
            bool used;
            CHECK(ds4_recompute_parse_arg(&rc, argc, (char **)flags, &i, &used) == DS4_OK && used, "%s", flags[i]);
        }
        CHECK(ds4_recompute_validate(&rc, c) == DS4_OK, "%s", ds4_errmsg());
        ds4_recompute_masks(&rc, c, masks);
        pol.recompute = masks;
    }
    const ds4_pass_opts o = {.need_backward = true, .bf16_acts = bf16, .store = ds4_act_store_of(&pol)};
    result whole = {0};
    CHECK(run_whole(m, ids, &o, &whole), "whole pass: %s", ds4_errmsg());
    CHECK(whole.losses.indexer_loss > 0 && whole.losses.mtp_loss > 0, "the losses have every part");
    for (size_t k = 0; k < 2 * (sizeof k_cuts / sizeof k_cuts[0]); k++) {
        const size_t ci = k / 2;
        const bool rows = k % 2;
        result r = {0};
        if (run_stages(m, ids, &o, k_cuts[ci].cut, k_cuts[ci].n, rows, &r)) {
            char what[160];
            snprintf(what, sizeof what, "%s %s%s%s%s", cfg, k_cuts[ci].name, bf16 ? " bf16" : "",
                     flags ? " recompute" : "", rows ? " MTP rows handed" : "");
            compare(what, &r, &whole, ds4_model_numel(m));
        }
        free(r.grads);
    }
    free(whole.grads);
    ds4_model_free(m);
}

static const char *const k_recompute[] = {"--recompute-granularity", "full", "--recompute-method", "block",
                                          "--recompute-num-layers", "1", "--recompute-csa-attention", "--mhc-recompute",
                                          "--recompute-norm", NULL};

static void test_cuts_fp32(void) { check_cuts("tests/configs/tiny-a.json", false, NULL); }
static void test_cuts_recompute(void) { check_cuts("tests/configs/tiny-a.json", false, k_recompute); }
static void test_cuts_bf16_recompute(void) { check_cuts("tests/configs/tiny-a.json", true, k_recompute); }

/* On cpu-guard (buffers the host cannot touch outside an op): the streams handed across are device buffers,
 * and the stages give the cpu's whole pass bit for bit. */
static void test_cuts_guard(void) {
    const struct ds4_kernel_backend *gb = NULL;
    CHECK(ds4_backend_find("--device", "cpu-guard", &gb) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *mc = tiny_model("tests/configs/tiny-a.json", 5), *mg = NULL;
    if (!gb || !mc) return;
    const ds4_config *c = ds4_model_config(mc);
    const ds4_exec on_guard = {.backend = gb};
    CHECK(ds4_model_create(&on_guard, c, false, &mg) == DS4_OK, "%s", ds4_errmsg());
    if (!mg) {
        ds4_model_free(mc);
        return;
    }
    ds4_model_to_device(mg, ds4_model_params_flat(mg), ds4_model_params_flat(mc),
                        (size_t)ds4_model_numel(mc) * sizeof(float));
    for (int64_t i = 0; i < ds4_model_nparams(mc); i++) { /* the hash layers' tables */
        const ds4_param *pc = ds4_model_param(mc, i), *pg = ds4_model_param(mg, i);
        if (pc->is_int) ds4_model_to_device(mg, pg->idata, pc->idata, (size_t)pc->numel * sizeof(int64_t));
    }
    int32_t ids[B * T];
    make_ids(ids, B * T, c->vocab_size);
    const ds4_pass_opts o = {.need_backward = true};
    result whole = {0};
    CHECK(run_whole(mc, ids, &o, &whole), "whole pass: %s", ds4_errmsg());
    for (size_t k = 0; k < sizeof k_cuts / sizeof k_cuts[0]; k += 2) {
        result r = {0};
        if (run_stages(mg, ids, &o, k_cuts[k].cut, k_cuts[k].n, k == 2, &r)) {
            char what[160];
            snprintf(what, sizeof what, "cpu-guard %s", k_cuts[k].name);
            compare(what, &r, &whole, ds4_model_numel(mc));
        }
        free(r.grads);
    }
    free(whole.grads);
    ds4_model_free(mg);
    ds4_model_free(mc);
}

/* What a stage cannot be: each refused with a line naming it. */
static void test_stage_checks(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 5);
    if (!m) return;
    int32_t ids[B * T];
    make_ids(ids, B * T, ds4_model_config(m)->vocab_size);
    const ds4_pass_opts o = {.need_backward = true};
    static const struct {
        ds4_stage s;
        bool input;
        const char *want;
    } bad[] = {
        {{1, 3, true, false, false}, false, "the embedding runs before layer 0"},
        {{0, 3, true, true, false}, false, "the head runs after the last layer 3"},
        {{2, 1, false, false, false}, true, "are not a range"},
        {{0, 5, true, true, false}, false, "are not a range"},
        {{1, 3, false, false, false}, false, "need an input stream"},
        {{0, 4, true, true, true}, false, "hands the MTP rows' gradient on"},
        {{1, 3, false, false, true}, true, "hands the MTP rows' gradient on"},
    };
    float *X = calloc((size_t)(B * T * 4 * 64), sizeof(float)); /* [B, T, hc_mult, dim] of tiny-a */
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ds4_pass *p = NULL;
        ds4_status st = ds4_stage_forward(m, ids, B, T, &o, &bad[i].s, bad[i].input ? X : NULL, &p);
        CHECK(st != DS4_OK && !p && strstr(ds4_errmsg(), bad[i].want), "case %zu: %s", i,
              st == DS4_OK ? "accepted" : ds4_errmsg());
        ds4_pass_free(p);
    }
    /* a middle stage's backward needs the next stage's gradient; ds4_backward takes whole passes only */
    ds4_pass *p = NULL;
    const ds4_stage mid = {1, 3, false, false, false};
    CHECK(ds4_stage_forward(m, ids, B, T, &o, &mid, X, &p) == DS4_OK, "%s", ds4_errmsg());
    if (p) {
        CHECK(ds4_pass_stream_out(p) != NULL);
        CHECK(ds4_backward(m, p) != DS4_OK && strstr(ds4_errmsg(), "ds4_stage_backward"), "%s", ds4_errmsg());
        CHECK(ds4_stage_backward(m, p, NULL) != DS4_OK && strstr(ds4_errmsg(), "needs the gradient"), "%s",
              ds4_errmsg());
        CHECK(ds4_stage_backward_rows(m, p, X, X) != DS4_OK && strstr(ds4_errmsg(), "only the embedding's stage"),
              "%s", ds4_errmsg());
    }
    ds4_pass_free(p);
    free(X);
    ds4_model_free(m);
}


/* Two stages on models that hold only their own groups (ds4_model_hold on unmapped models, no hooks): the
 * first the embedding and layers 0-1, the second layers 2-3, the head and the MTP block with the embedding's
 * values alone (the MTP rows handed back). Each parameter's gradient, in the model that trains it, equals
 * the whole model's of the same cut bit for bit; each holds less than the whole model. */
static void test_held_stages(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 5);
    if (!m) return;
    const ds4_config *c = ds4_model_config(m);
    int32_t ids[B * T];
    make_ids(ids, B * T, c->vocab_size);
    const ds4_pass_opts o = {.need_backward = true};
    const int64_t cut[3] = {0, 2, 4};
    result whole = {0};
    CHECK(run_stages(m, ids, &o, cut, 2, true, &whole), "the whole model's cut");
    ds4_model *h[2] = {0};
    for (int k = 0; k < 2; k++) {
        CHECK(ds4_model_create(NULL, c, true, &h[k]) == DS4_OK, "%s", ds4_errmsg());
        for (int64_t g = 0; h[k] && g < ds4_model_ngroups(h[k]); g++) {
            const bool first = g <= cut[1]; /* the embedding and layers [0, 2): groups 0..2 */
            if (first == (k == 0)) CHECK(ds4_model_hold(h[k], g, true) == DS4_OK, "%s", ds4_errmsg());
        }
        if (h[k] && k == 1) CHECK(ds4_model_hold(h[k], 0, false) == DS4_OK, "%s", ds4_errmsg());
        for (int64_t i = 0; h[k] && i < ds4_model_nparams(m); i++) { /* the held values, from the whole model */
            const ds4_param *p = ds4_model_param(m, i), *q = ds4_model_param(h[k], i);
            if (ds4_param_in_flat(p) && ds4_model_param_held(h[k], q, false))
                memcpy(q->data, p->data, (size_t)p->numel * sizeof(float));
            if (p->is_int) memcpy(q->idata, p->idata, (size_t)p->numel * sizeof(int64_t));
        }
        if (h[k]) ds4_model_zero_grad(h[k]);
        CHECK(!h[k] || (ds4_model_held_bytes(h[k], true) > 0 &&
                        ds4_model_held_bytes(h[k], true) < ds4_model_numel(m) * (int64_t)sizeof(float)),
              "stage %d holds %lld gradient bytes of %lld", k, (long long)(h[k] ? ds4_model_held_bytes(h[k], true) : 0),
              (long long)(ds4_model_numel(m) * (int64_t)sizeof(float)));
    }
    ds4_pass *p0 = NULL, *p1 = NULL;
    const ds4_stage s0 = {0, 2, true, false, false}, s1 = {2, 4, false, true, true};
    bool ok = h[0] && h[1] && ds4_stage_forward(h[0], ids, B, T, &o, &s0, NULL, &p0) == DS4_OK;
    ok = ok && ds4_stage_forward(h[1], ids, B, T, &o, &s1, ds4_pass_stream_out(p0), &p1) == DS4_OK;
    ok = ok && ds4_stage_backward(h[1], p1, NULL) == DS4_OK;
    ok = ok && ds4_stage_backward_rows(h[0], p0, ds4_pass_stream_grad(p1), ds4_pass_mtp_rows_grad(p1)) == DS4_OK;
    CHECK(ok, "the held stages: %s", ds4_errmsg());
    int64_t differ = 0, owned = 0;
    const float *flat = ds4_model_params_flat(m);
    for (int64_t i = 0; ok && whole.grads && i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_in_flat(p)) continue;
        for (int k = 0; k < 2; k++) {
            const ds4_param *q = ds4_model_param(h[k], i);
            if (!ds4_model_param_held(h[k], q, true)) continue;
            owned++;
            differ += memcmp(q->grad, whole.grads + (p->data - flat), (size_t)p->numel * sizeof(float)) != 0;
        }
    }
    int64_t floats = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) floats += ds4_param_in_flat(ds4_model_param(m, i));
    CHECK(ok && differ == 0 && owned == floats, "%lld of %lld parameters differ, %lld owned by one stage",
          (long long)differ, (long long)floats, (long long)owned);
    ds4_pass_free(p0);
    ds4_pass_free(p1);
    for (int k = 0; k < 2; k++) ds4_model_free(h[k]);
    free(whole.grads);
    ds4_model_free(m);
}

/* The parameter hooks a wrapper sees from a stage: the gathers of its own groups only, in the order the
 * whole pass has them, and prefetch hints that stay inside the stage. Groups: 0 embed, 1 + l layer l, 5 the
 * head, 6 the MTP block (tiny-a: 4 layers). */
typedef struct {
    char log[512];
    size_t n;
} hook_log;
static void logf_(hook_log *h, const char *fmt, int64_t v) {
    h->n += (size_t)snprintf(h->log + h->n, sizeof h->log - h->n, fmt, (long long)v);
}
static ds4_status h_gather(void *ctx, int64_t g) {
    logf_(ctx, "g%lld ", g);
    return DS4_OK;
}
static ds4_status h_grad_begin(void *ctx, int64_t g) {
    logf_(ctx, "b%lld ", g);
    return DS4_OK;
}
static ds4_status h_prefetch(void *ctx, const int64_t *next, int64_t n) {
    hook_log *h = ctx;
    h->n += (size_t)snprintf(h->log + h->n, sizeof h->log - h->n, "[");
    for (int64_t i = 0; i < n; i++) logf_(h, i ? ",%lld" : "%lld", next[i]);
    h->n += (size_t)snprintf(h->log + h->n, sizeof h->log - h->n, "] ");
    return DS4_OK;
}

static void test_stage_hooks(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 5);
    if (!m) return;
    int32_t ids[B * T];
    make_ids(ids, B * T, ds4_model_config(m)->vocab_size);
    static const struct {
        ds4_stage s;
        const char *fwd, *bwd;
    } k[] = {
        {{0, 1, true, false, false}, "g0 [1] g1 ", "g1 b1 b0 "},
        {{1, 3, false, false, false}, "g2 [3] g3 ", "g3 [2] b3 g2 b2 "},
        {{3, 4, false, true, false}, "g4 [5,6,0] g5 [6,0] g6 [0] g0 ", "g5 [6,4] b5 g6 [4] b6 g4 b4 "},
        {{0, 4, true, true, false}, "g0 [1,2,3,4,5,6,0] g1 [2,3,4,5,6,0] g2 [3,4,5,6,0] g3 [4,5,6,0] g4 [5,6,0] g5 [6,0] g6 [0] "
                             "g0 ", "g5 [6,4,3,2,1] b5 g6 [4,3,2,1] b6 g4 [3,2,1] b4 g3 [2,1] b3 g2 [1] b2 g1 b1 b0 "},
    };
    const size_t SN = (size_t)(B * T * 4 * 64) * sizeof(float);
    float *X = calloc(1, SN), *dX = calloc(1, SN);
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        hook_log h = {0};
        const ds4_param_hooks hooks = {.ctx = &h, .gather = h_gather, .grad_begin = h_grad_begin,
                                       .prefetch = h_prefetch};
        const ds4_pass_opts o = {.need_backward = true, .hooks = &hooks};
        ds4_pass *p = NULL;
        CHECK(ds4_stage_forward(m, ids, B, T, &o, &k[i].s, k[i].s.embedding ? NULL : X, &p) == DS4_OK, "%s",
              ds4_errmsg());
        CHECK(!strcmp(h.log, k[i].fwd), "stage %zu forward: '%s', want '%s'", i, h.log, k[i].fwd);
        h.n = 0;
        h.log[0] = 0;
        if (p) CHECK(ds4_stage_backward(m, p, k[i].s.head ? NULL : dX) == DS4_OK, "%s", ds4_errmsg());
        CHECK(!strcmp(h.log, k[i].bwd), "stage %zu backward: '%s', want '%s'", i, h.log, k[i].bwd);
        ds4_pass_free(p);
    }
    free(X);
    free(dX);
    ds4_model_free(m);
}

int main(void) {
    ds4_set_threads(2);
    RUN(test_cuts_fp32);
    RUN(test_cuts_recompute);
    RUN(test_cuts_bf16_recompute);
    RUN(test_cuts_guard);
    RUN(test_stage_checks);
    RUN(test_stage_hooks);
    RUN(test_held_stages);
    TEST_MAIN_END("test_stages");
}
