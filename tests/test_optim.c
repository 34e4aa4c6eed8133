/* AdamW: the update takes its rules (weight decay or not, frozen or trained) from ranges of parameters,
 * and is bit for bit the per-element update written out below with one decay / frozen flag per element,
 * over several steps, resident, swapped through small chunks, and on a slice cut in the middle of
 * parameters (an FSDP shard); the state is exactly 8 bytes per element (m and v) wherever it lives,
 * its rules O(parameters); bad ranges fail with one clear message; optim.state holds only
 * adamw.step, adamw.m and adamw.v. */
#include "ds4/io.h"
#include "ds4/model.h"
#include "ds4/offload.h"
#include "ds4/train.h"
#include "test.h"
#include "test_models.h"

#include <unistd.h>

static const ds4_adamw_cfg k_cfg = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
static const double k_lr[] = {1e-3, 3e-3, 2e-3, 5e-4, 1e-3};
enum { STEPS = 5 };

/* ------------------------------------------------------------------ the reference */
/* One flag of each kind per element of the flat layout, from the parameter table (0 between params). */
typedef struct {
    int64_t n;
    uint8_t *decay, *frozen;
    float *m, *v;
} ref_state;

static ref_state ref_new(ds4_model *model) {
    ref_state r = {.n = ds4_model_numel(model)};
    r.decay = calloc((size_t)r.n, 1);
    r.frozen = calloc((size_t)r.n, 1);
    r.m = calloc((size_t)r.n, sizeof(float));
    r.v = calloc((size_t)r.n, sizeof(float));
    const float *base = ds4_model_params_flat(model);
    for (int64_t i = 0; i < ds4_model_nparams(model); i++) {
        const ds4_param *p = ds4_model_param(model, i);
        if (p->is_int) continue;
        memset(r.decay + (p->data - base), p->no_decay ? 0 : 1, (size_t)p->numel);
        memset(r.frozen + (p->data - base), p->no_grad ? 1 : 0, (size_t)p->numel);
    }
    return r;
}

static void ref_free(ref_state *r) {
    free(r->decay);
    free(r->frozen);
    free(r->m);
    free(r->v);
}

/* Step `step` (from 1) on elements [a, b): the per-element AdamW, written out plainly. */
static void ref_step(ref_state *r, int64_t step, double lr, float *w, const float *g, int64_t a, int64_t b) {
    const double bc1 = 1.0 - pow(k_cfg.beta1, (double)step), bc2 = 1.0 - pow(k_cfg.beta2, (double)step);
    const float b1 = (float)k_cfg.beta1, b2 = (float)k_cfg.beta2, eps = (float)k_cfg.eps;
    const float omb1 = (float)(1.0 - k_cfg.beta1), omb2 = (float)(1.0 - k_cfg.beta2); /* rounded once */
    const float step_size = (float)(lr / bc1), inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    const float decay = (float)(lr * k_cfg.weight_decay);
    for (int64_t i = a; i < b; i++) {
        if (r->frozen[i]) continue;
        float gi = g[i];
        r->m[i] = b1 * r->m[i] + omb1 * gi;
        r->v[i] = b2 * r->v[i] + omb2 * gi * gi;
        float denom = sqrtf(r->v[i]) * inv_sqrt_bc2 + eps;
        if (r->decay[i]) w[i] -= decay * w[i];
        w[i] -= step_size * r->m[i] / denom;
    }
}

/* The model's gradients of step s, with zeros, negative zeros and large values among them. */
static void fill_grads(ds4_model *m, int s) {
    float *g = ds4_model_grads_flat(m);
    const int64_t n = ds4_model_numel(m);
    t_fill(g, (long)n, 70 + (unsigned)s, 0.5f);
    for (int64_t i = s; i < n; i += 97) g[i] = (i / 97) % 3 == 0 ? 0.0f : (i / 97) % 3 == 1 ? -0.0f : 1e4f;
}

/* Every rule occurs in the model: decayed, not decayed, frozen (else the test proves less). */
static void check_has_every_rule(const ref_state *r) {
    int64_t cnt[3] = {0};
    for (int64_t i = 0; i < r->n; i++) cnt[r->frozen[i] ? 2 : r->decay[i]]++;
    CHECK(cnt[0] > 0 && cnt[1] > 0 && cnt[2] > 0, "no decay %lld, decay %lld, frozen %lld elements", (long long)cnt[0],
          (long long)cnt[1], (long long)cnt[2]);
}

/* The state's moments equal the reference's on [a, b) (the state holding elements [a, b)). */
static bool moments_match(const ds4_optim *o, const ref_state *r, int64_t a) {
    float *x = malloc((size_t)o->n * sizeof(float));
    bool eq = true;
    for (int k = 0; k < 2 && eq; k++)
        eq = ds4_optim_read(o, DS4_OPT_ADAMW, k, 0, o->n, x) == DS4_OK &&
             memcmp(x, (k ? r->v : r->m) + a, (size_t)o->n * sizeof(float)) == 0;
    free(x);
    return eq;
}

/* STEPS updates of o (resident or swapped, over the whole model) against the reference. */
static void run_against_reference(const char *cfg, ds4_offload *store, size_t chunk_bytes, const char *what) {
    ds4_model *m = tiny_model(cfg, 3);
    if (!m) return;
    const int64_t n = ds4_model_numel(m);
    ref_state r = ref_new(m);
    check_has_every_rule(&r);
    float *w = malloc((size_t)n * sizeof(float));
    memcpy(w, ds4_model_params_flat(m), (size_t)n * sizeof(float));
    ds4_optim o;
    CHECK(ds4_optim_init(&o, NULL, m, store, chunk_bytes) == DS4_OK, "%s", ds4_errmsg());
    for (int s = 0; s < STEPS; s++) {
        fill_grads(m, s);
        CHECK(ds4_adamw_step(&o, m, &k_cfg, k_lr[s]) == DS4_OK, "%s", ds4_errmsg());
        ref_step(&r, s + 1, k_lr[s], w, ds4_model_grads_flat(m), 0, n);
        CHECK(memcmp(w, ds4_model_params_flat(m), (size_t)n * sizeof(float)) == 0, "%s %s step %d: weights differ",
              cfg, what, s + 1);
        CHECK(moments_match(&o, &r, 0), "%s %s step %d: moments differ", cfg, what, s + 1);
    }
    CHECK(o.step == STEPS);
    ds4_optim_free(&o);
    ref_free(&r);
    free(w);
    ds4_model_free(m);
}

static void test_resident_equals_reference(void) {
    run_against_reference("tests/configs/tiny-a.json", NULL, 0, "resident");
}

static void test_swapped_equals_reference(void) {
    ds4_offload *s = NULL;
    CHECK(ds4_offload_open(NULL, NULL, &s) == DS4_OK, "%s", ds4_errmsg());
    if (!s) return;
    run_against_reference("tests/configs/tiny-a.json", s, 1000, "chunks of 125"); /* cut inside parameters */
    run_against_reference("tests/configs/tiny-a.json", s, 0, "default chunk");
    ds4_offload_close(s);
}

/* The float parameters' rules, intersected with [a, b) and shifted to start at 0: what a shard of
 * those elements holds. Given in reverse order (any order is accepted). */
static int64_t slice_ranges(ds4_model *m, int64_t a, int64_t b, ds4_opt_run *out) {
    const float *base = ds4_model_params_flat(m);
    int64_t nr = 0;
    for (int64_t i = ds4_model_nparams(m) - 1; i >= 0; i--) {
        const ds4_param *p = ds4_model_param(m, i);
        if (p->is_int) continue;
        int64_t x = p->data - base, y = x + p->numel;
        x = x > a ? x : a;
        y = y < b ? y : b;
        if (x < y) out[nr++] = (ds4_opt_run){.off = x - a, .n = y - x, .decay = !p->no_decay, .frozen = p->no_grad};
    }
    return nr;
}

/* Whether element x lies strictly inside a float parameter (not at its start). */
static bool cuts_param(ds4_model *m, int64_t x) {
    const float *base = ds4_model_params_flat(m);
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (!p->is_int && p->data - base < x && x < p->data - base + p->numel) return true;
    }
    return false;
}

/* A state over a slice [a, b) cut in the middle of parameters, resident and swapped, steps as the
 * reference does on those elements. */
static void test_slice_equals_reference(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 4);
    ds4_offload *store = NULL;
    CHECK(ds4_offload_open(NULL, NULL, &store) == DS4_OK, "%s", ds4_errmsg());
    if (!m || !store) return;
    const int64_t n = ds4_model_numel(m), a = n / 3 + 7, b = 2 * n / 3 + 11;
    CHECK(cuts_param(m, a) && cuts_param(m, b), "the slice [%lld, %lld) must cut parameters", (long long)a, (long long)b);
    ref_state r = ref_new(m);
    ref_state part = {.n = b - a, .decay = r.decay + a, .frozen = r.frozen + a};
    check_has_every_rule(&part);
    ds4_opt_run *rg = malloc((size_t)ds4_model_nparams(m) * sizeof *rg);
    const int64_t nr = slice_ranges(m, a, b, rg);
    float *w0 = malloc((size_t)n * sizeof(float)), *w1 = malloc((size_t)n * sizeof(float));
    memcpy(w0, ds4_model_params_flat(m), (size_t)n * sizeof(float));
    memcpy(w1, w0, (size_t)n * sizeof(float));
    ds4_optim res, sw;
    CHECK(ds4_optim_init_runs(&res, NULL, NULL, b - a, rg, nr, NULL, 0) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_optim_init_runs(&sw, NULL, NULL, b - a, rg, nr, store, 4096) == DS4_OK, "%s", ds4_errmsg());
    for (int s = 0; s < STEPS; s++) {
        fill_grads(m, s);
        const float *g = ds4_model_grads_flat(m);
        CHECK(ds4_adamw_step_flat(&res, w0 + a, g + a, &k_cfg, k_lr[s]) == DS4_OK, "%s", ds4_errmsg());
        CHECK(ds4_adamw_step_flat(&sw, w1 + a, g + a, &k_cfg, k_lr[s]) == DS4_OK, "%s", ds4_errmsg());
        ref_step(&r, s + 1, k_lr[s], ds4_model_params_flat(m), g, a, b);
        CHECK(memcmp(w0, ds4_model_params_flat(m), (size_t)n * sizeof(float)) == 0, "slice step %d: weights differ",
              s + 1);
        CHECK(memcmp(w1, w0, (size_t)n * sizeof(float)) == 0, "swapped slice step %d: weights differ", s + 1);
        CHECK(moments_match(&res, &r, a) && moments_match(&sw, &r, a), "slice step %d: moments differ", s + 1);
    }
    ds4_optim_free(&res);
    ds4_optim_free(&sw);
    ds4_offload_close(store);
    ref_free(&r);
    free(rg);
    free(w0);
    free(w1);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------ bytes */
/* Resident: exactly m and v, 4 + 4 bytes per element, and nothing else counted as optimizer state; the
 * rules are a few runs per parameter at most, back to back over [0, n). */
static void test_state_is_8_bytes_per_element(void) {
    const char *cfgs[] = {"tests/configs/tiny-a.json", "tests/configs/tiny-b.json"};
    for (int c = 0; c < 2; c++) {
        ds4_model *m = tiny_model(cfgs[c], 1);
        if (!m) return;
        const int64_t n = ds4_model_numel(m);
        ds4_mem_stats s0, s1;
        ds4_mem_get(&s0);
        ds4_optim o;
        CHECK(ds4_optim_init(&o, NULL, m, NULL, 0) == DS4_OK, "%s", ds4_errmsg());
        ds4_mem_get(&s1);
        CHECK(s1.live[DS4_MEM_OPTIM] - s0.live[DS4_MEM_OPTIM] == 8 * n, "%s: %lld optimizer bytes for %lld elements",
              cfgs[c], (long long)(s1.live[DS4_MEM_OPTIM] - s0.live[DS4_MEM_OPTIM]), (long long)n);
        CHECK(o.nruns > 1 && o.nruns <= 2 * ds4_model_nparams(m) + 1, "%s: %lld ranges for %lld parameters",
              cfgs[c], (long long)o.nruns, (long long)ds4_model_nparams(m));
        int64_t at = 0;
        for (int64_t i = 0; i < o.nruns; i++) {
            CHECK(o.runs[i].off == at && o.runs[i].n > 0 && !o.runs[i].own && !o.soff,
                  "%s: range %lld is not back to back in AdamW's group", cfgs[c], (long long)i);
            at += o.runs[i].n;
        }
        CHECK(at == n, "%s: the ranges cover %lld of %lld elements", cfgs[c], (long long)at, (long long)n);
        /* a step allocates no optimizer memory */
        ds4_mem_reset_peak();
        ds4_mem_get(&s0);
        CHECK(ds4_adamw_step(&o, m, &k_cfg, 1e-3) == DS4_OK);
        ds4_mem_get(&s1);
        CHECK(s1.peak[DS4_MEM_OPTIM] == s0.live[DS4_MEM_OPTIM], "%s: the update allocated optimizer memory", cfgs[c]);
        ds4_optim_free(&o);
        ds4_model_free(m);
    }
}

/* Swapped: 8 bytes per element in the offload tier, nothing per element resident; the update holds
 * the two chunk buffers (m and v) and no more. */
static void test_swapped_bytes(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 1);
    ds4_offload *s = NULL;
    CHECK(ds4_offload_open(NULL, NULL, &s) == DS4_OK, "%s", ds4_errmsg());
    if (!m || !s) return;
    const int64_t n = ds4_model_numel(m);
    const size_t chunk = 4096; /* 512 elements of m and v */
    ds4_mem_stats s0, s1, s2;
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    ds4_optim o;
    CHECK(ds4_optim_init(&o, NULL, m, s, chunk) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_get(&s1);
    CHECK(s1.peak[DS4_MEM_OPTIM] == s0.live[DS4_MEM_OPTIM], "init made %lld optimizer bytes resident",
          (long long)(s1.peak[DS4_MEM_OPTIM] - s0.live[DS4_MEM_OPTIM]));
    CHECK(s1.offload_live[DS4_MEM_OPTIM] - s0.offload_live[DS4_MEM_OPTIM] == 8 * n,
          "%lld offloaded optimizer bytes for %lld elements",
          (long long)(s1.offload_live[DS4_MEM_OPTIM] - s0.offload_live[DS4_MEM_OPTIM]), (long long)n);
    CHECK(ds4_adamw_step(&o, m, &k_cfg, 1e-3) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_get(&s2);
    CHECK(s2.peak[DS4_MEM_OPTIM] - s0.live[DS4_MEM_OPTIM] == (int64_t)chunk, "the update held %lld bytes, not %zu",
          (long long)(s2.peak[DS4_MEM_OPTIM] - s0.live[DS4_MEM_OPTIM]), chunk);
    CHECK(s2.offload_peak[DS4_MEM_OPTIM] - s0.offload_live[DS4_MEM_OPTIM] == 8 * n, "the store grew in the update");
    ds4_optim_free(&o);
    ds4_offload_close(s);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------ errors */
static void expect_bad(const ds4_opt_run *r, int64_t nr, const char *want) {
    ds4_optim o;
    CHECK(ds4_optim_init_runs(&o, NULL, NULL, 100, r, nr, NULL, 0) == DS4_ERR_ARG, "accepted ranges that should fail with \"%s\"",
          want);
    CHECK(strstr(ds4_errmsg(), want) != NULL, "message \"%s\" lacks \"%s\"", ds4_errmsg(), want);
    CHECK(o.runs == NULL && o.g[0].mem[0] == NULL, "a failed init left something behind");
}

static void test_bad_ranges(void) {
    expect_bad((ds4_opt_run[]){{.off = 90, .n = 20}}, 1, "range [90, 110) is outside the 100 elements");
    expect_bad((ds4_opt_run[]){{.off = -1, .n = 5}}, 1, "range [-1, 4) is outside");
    expect_bad((ds4_opt_run[]){{.off = 50, .n = 10}, {.off = 10, .n = 45, .decay = true}}, 2,
               "ranges [10, 55) and [50, 60) overlap");
    expect_bad((ds4_opt_run[]){{.off = 0, .n = 1}}, -1, "-1 ranges");
    /* empty ranges are ignored; neighbours of one rule merge; gaps train without decay */
    ds4_optim o;
    CHECK(ds4_optim_init_runs(&o, NULL, NULL, 100,
                              (ds4_opt_run[]){{.off = 10, .n = 10, .decay = true}, {.off = 20, .n = 0},
                                              {.off = 20, .n = 5, .decay = true}, {.off = 40, .n = 60, .frozen = true}},
                              4, NULL, 0) == DS4_OK, "%s", ds4_errmsg());
    CHECK(o.nruns == 4 && o.runs[0].n == 10 && !o.runs[0].decay && o.runs[1].n == 15 && o.runs[1].decay &&
              o.runs[2].off == 25 && !o.runs[2].decay && !o.runs[2].frozen && o.runs[3].frozen,
          "%lld runs", (long long)o.nruns);
    ds4_optim_free(&o);
}

/* ------------------------------------------------------------------ the checkpoint file */
/* optim.state: adamw.step I64 [1], adamw.m and adamw.v F32 [n], nothing else (no per-element rules). */
static void test_optim_file_format(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 2);
    if (!m) return;
    ds4_optim o;
    CHECK(ds4_optim_init(&o, NULL, m, NULL, 0) == DS4_OK);
    fill_grads(m, 0);
    CHECK(ds4_adamw_step(&o, m, &k_cfg, 1e-3) == DS4_OK);
    char path[64];
    snprintf(path, sizeof path, "/tmp/ds4-test-optim-%d.state", (int)getpid());
    CHECK(ds4_optim_state_save(&o, path) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_file *f = NULL;
    CHECK(ds4_st_open(path, &f) == DS4_OK, "%s", ds4_errmsg());
    if (f) {
        CHECK(ds4_st_count(f) == 3, "%lld tensors", (long long)ds4_st_count(f));
        const char *names[] = {"adamw.step", "adamw.m", "adamw.v"};
        for (int i = 0; i < 3; i++) {
            const ds4_st_entry *e = ds4_st_find(f, names[i]);
            CHECK(e && ds4_st_entry_numel(e) == (i ? o.n : 1) && e->dtype == (i ? DS4_F32 : DS4_I64), "%s", names[i]);
        }
        ds4_st_close(f);
    }
    /* and it loads back into a fresh state: the same moments, the same next step */
    ds4_optim l;
    CHECK(ds4_optim_init(&l, NULL, m, NULL, 0) == DS4_OK &&
              ds4_optim_state_load(&l, m, NULL, &ds4_optimizer_adamw, path, NULL) == DS4_OK,
          "%s", ds4_errmsg());
    float *a = malloc((size_t)o.n * sizeof(float)), *b = malloc((size_t)o.n * sizeof(float));
    for (int k = 0; k < 2; k++) {
        CHECK(ds4_optim_read(&o, DS4_OPT_ADAMW, k, 0, o.n, a) == DS4_OK &&
              ds4_optim_read(&l, DS4_OPT_ADAMW, k, 0, l.n, b) == DS4_OK);
        CHECK(memcmp(a, b, (size_t)o.n * sizeof(float)) == 0 && l.step == o.step, "moment %d differs after load", k);
    }
    free(a);
    free(b);
    unlink(path);
    ds4_optim_free(&l);
    ds4_optim_free(&o);
    ds4_model_free(m);
}

int main(void) {
    ds4_set_threads(2);
    RUN(test_resident_equals_reference);
    RUN(test_swapped_equals_reference);
    RUN(test_slice_equals_reference);
    RUN(test_state_is_8_bytes_per_element);
    RUN(test_swapped_bytes);
    RUN(test_bad_ranges);
    RUN(test_optim_file_format);
    TEST_MAIN_END("test_optim");
}
