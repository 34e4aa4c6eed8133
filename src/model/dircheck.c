/* ds4 inspect --check: does a model directory hold exactly the tensors its config needs?
 *
 * Every expected (name, shape) of the config (ds4_model_expected_tensors) is located under its
 * official or Hugging Face name; each stored tensor it uses (weight, scale, fused expert tensor) is
 * marked, and whatever stays unmarked is extra. */
#include "ds4/io.h"
#include "ds4/model.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    const ds4_model_dir *d;
    ds4_check_fn fn;
    void *ctx;
    int64_t problems;
    bool **used;   /* [nfiles][entries of that file] */
} checker;

static void report(checker *c, const char *what, const char *name, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void report(checker *c, const char *what, const char *name, const char *fmt, ...) {
    char detail[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    c->problems++;
    if (c->fn) c->fn(c->ctx, what, name, detail);
}

static void mark(checker *c, const ds4_st_file *f, const ds4_st_entry *e) {
    for (int64_t i = 0; i < ds4_model_dir_nfiles(c->d); i++)
        if (ds4_model_dir_file(c->d, i) == f) c->used[i][e - ds4_st_entry_at(f, 0)] = true;
}

/* A weight that failed to locate (e.g. its scale has the wrong shape): mark it and its scale. */
static void mark_pair(checker *c, const char *name) {
    char hf[192], sn[256];
    ds4_hf_ref ref;
    const char *stored = ds4_model_dir_find(c->d, name, NULL) ? name
                         : ds4_name_to_hf(name, &ref) ? (snprintf(hf, sizeof hf, "%s", ref.name), hf)
                                                      : name;
    size_t n = strlen(stored);
    const char *cands[3] = {stored, sn, NULL};
    if (n >= 7 && strcmp(stored + n - 7, ".weight") == 0) snprintf(sn, sizeof sn, "%.*s.scale", (int)(n - 7), stored);
    else snprintf(sn, sizeof sn, "%s.scale", stored);
    char inv[256];
    snprintf(inv, sizeof inv, "%s_scale_inv", stored);
    cands[2] = inv;
    for (int k = 0; k < 3; k++) {
        const ds4_st_entry *e;
        const ds4_st_file *f = ds4_model_dir_find(c->d, cands[k], &e);
        if (f) mark(c, f, e);
    }
}

static ds4_status on_expected(void *vc, const char *name, int ndim, const int64_t *shape, bool is_int) {
    checker *c = vc;
    char want[128], got[128];
    ds4_dims_str(ndim, shape, want, sizeof want);
    ds4_tensor_loc loc;
    ds4_status s = ds4_model_dir_locate(c->d, name, &loc);
    if (s == DS4_ERR_OOM) return s;
    if (s == DS4_ERR_MISSING) {
        report(c, "missing", name, "expected %s %s", is_int ? "integer table" : "float tensor", want);
        return DS4_OK;
    }
    if (s != DS4_OK) {
        report(c, "bad", name, "%s", ds4_errmsg());
        mark_pair(c, name);   /* reported here, not again as extras */
        return DS4_OK;
    }
    mark(c, loc.file, loc.entry);
    if (loc.scale) mark(c, loc.scale_file, loc.scale);
    ds4_dtype t = loc.entry->dtype;
    if (is_int && t != DS4_I32 && t != DS4_I64)
        report(c, "dtype", name, "stored as %s in %s, expected I32 or I64", ds4_dtype_name(t), ds4_st_path(loc.file));
    else if (!is_int && !ds4_tensor_loc_is_float(&loc))
        report(c, "dtype", name, "stored as %s in %s, expected F32/BF16/F16 or a quantized weight with its scale%s",
               ds4_dtype_name(t), ds4_st_path(loc.file), t == DS4_F8_E4M3 ? " (the scale is absent)" : "");
    if (ds4_tensor_loc_check_shape(&loc, ndim, shape) != DS4_OK)
        report(c, "shape", name, "has shape %s, expected %s", ds4_dims_str(loc.ndim, loc.shape, got, sizeof got), want);
    /* a fused HF expert tensor must hold exactly the config's experts (reported once, with expert 0) */
    int64_t E = ds4_model_dir_config(c->d)->n_routed_experts;
    if (loc.expert == 0 && loc.entry->shape[0] != E)
        report(c, "shape", loc.entry->name, "fused expert tensor has %" PRId64 " experts, the config has %" PRId64,
               loc.entry->shape[0], E);
    return DS4_OK;
}

ds4_status ds4_model_dir_check(const ds4_model_dir *d, ds4_check_fn fn, void *ctx, int64_t *n_problems) {
    *n_problems = 0;
    int64_t nf = ds4_model_dir_nfiles(d);
    checker c = {d, fn, ctx, 0, ds4_calloc(DS4_MEM_OTHER, (size_t)(nf ? nf : 1) * sizeof(bool *))};
    ds4_status s = c.used ? DS4_OK : ds4_fail(DS4_ERR_OOM, "%s: out of memory", ds4_model_dir_path(d));
    for (int64_t i = 0; s == DS4_OK && i < nf; i++) {
        int64_t n = ds4_st_count(ds4_model_dir_file(d, i));
        if (!(c.used[i] = ds4_calloc(DS4_MEM_OTHER, (size_t)(n ? n : 1))))
            s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", ds4_model_dir_path(d));
    }
    if (s == DS4_OK) s = ds4_model_expected_tensors(ds4_model_dir_config(d), on_expected, &c);
    for (int64_t i = 0; s == DS4_OK && i < nf; i++) {
        const ds4_st_file *f = ds4_model_dir_file(d, i);
        for (int64_t j = 0; j < ds4_st_count(f); j++) {
            if (c.used[i][j]) continue;
            const ds4_st_entry *e = ds4_st_entry_at(f, j);
            char sh[128];
            report(&c, "extra", e->name, "%s %s in %s, not needed by the config", ds4_dtype_name(e->dtype),
                   ds4_dims_str(e->ndim, e->shape, sh, sizeof sh), ds4_st_path(f));
        }
    }
    for (int64_t i = 0; c.used && i < nf; i++) ds4_free(c.used[i]);
    ds4_free(c.used);
    *n_problems = c.problems;
    return s;
}
