/* Atomic training checkpoints: ROOT/step-NNNNNNNN/{config.json, model.safetensors, optim.state,
 * state.json} (or, written by every rank, shard files and their index: ckpt_shards.c). Written into ROOT/.tmp-step-NNNNNNNN, each file fsynced, then the directory is renamed
 * into place and ROOT fsynced. Only directories named step-* count, so a half-written one is ignored. */
#include "ds4/io.h"
#include "ds4/train.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stddef.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

static ds4_status fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ds4_fail(DS4_ERR_IO, "%s: cannot open to fsync: %s", path, strerror(errno));
    int rc = fsync(fd);
    close(fd);
    return rc == 0 ? DS4_OK : ds4_fail(DS4_ERR_IO, "%s: fsync failed: %s", path, strerror(errno));
}

/* Removes a checkpoint directory (only the files a checkpoint holds, then the directory). */
static void remove_ckpt_dir(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char p[4096];
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

/* The step of a checkpoint directory name: exactly step-NNNNNNNN (at least 8 digits, as saved). */
static bool parse_step_name(const char *name, int64_t *step) {
    if (strncmp(name, "step-", 5) != 0) return false;
    const char *d = name + 5;
    size_t n = strlen(d);
    if (n < 8 || n > 15) return false; /* at most 10^15 - 1: exact in the double of state.json */
    int64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (d[i] < '0' || d[i] > '9') return false;
        v = v * 10 + (d[i] - '0');
    }
    if (n > 8 && d[0] == '0') return false; /* step-000000012 is not a name ds4 writes */
    *step = v;
    return true;
}

typedef struct {
    int64_t *v; /* [n] ascending */
    int64_t n, cap;
} step_list;

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Steps of the complete checkpoints under root, ascending (as many as there are). */
static ds4_status list_steps(const char *root, step_list *l) {
    *l = (step_list){0};
    DIR *d = opendir(root);
    if (!d) return DS4_OK;
    struct dirent *e;
    ds4_status st = DS4_OK;
    while (st == DS4_OK && (e = readdir(d)) != NULL) {
        int64_t s;
        if (!parse_step_name(e->d_name, &s)) continue;
        if (!ds4_grow((void **)&l->v, &l->cap, l->n + 1, sizeof(int64_t)))
            st = ds4_fail(DS4_ERR_OOM, "%s: out of memory listing checkpoints", root);
        else l->v[l->n++] = s;
    }
    closedir(d);
    if (l->n > 1) qsort(l->v, (size_t)l->n, sizeof(int64_t), cmp_i64);
    return st;
}

static ds4_status write_optim(const char *path, const ds4_optim *o) { return ds4_optim_state_save(o, path); }

static ds4_status write_state(const char *path, const ds4_ckpt_meta *meta) {
    cJSON *j = cJSON_CreateObject();
    char seed[32];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)meta->seed);
    /* a key that failed to go in would make a complete-looking state.json without it */
    bool built = j && cJSON_AddNumberToObject(j, "step", (double)meta->step) &&
                 cJSON_AddStringToObject(j, "seed", seed) && cJSON_AddStringToObject(j, "data_state", meta->data_state) &&
                 cJSON_AddStringToObject(j, "format", "ds4-checkpoint-1");
    char *txt = built ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    if (!txt) return ds4_fail(DS4_ERR_OOM, "%s: out of memory building the JSON", path);
    ds4_status st = ds4_write_file_atomic(path, txt, strlen(txt));
    free(txt);
    return st;
}

void ds4_checkpoint_tmp_name(const char *root, int64_t step, char *tmp, size_t n) {
    snprintf(tmp, n, "%s/.tmp-step-%08lld", root, (long long)step);
}

ds4_status ds4_checkpoint_begin(const char *root, int64_t step, char *tmp, size_t n) {
    DS4_TRY(ds4_mkdirs(root, "checkpoint folder"));
    ds4_checkpoint_tmp_name(root, step, tmp, n);
    remove_ckpt_dir(tmp); /* leftovers of an interrupted save */
    if (mkdir(tmp, 0755) != 0)
        return ds4_fail(DS4_ERR_IO, "%s: cannot create checkpoint directory: %s", tmp, strerror(errno));
    return DS4_OK;
}

void ds4_checkpoint_abort(const char *tmp) {
    if (tmp && tmp[0]) remove_ckpt_dir(tmp);
}

ds4_status ds4_checkpoint_save(const char *root, int64_t keep_latest_k, ds4_model *m, const ds4_optim *o,
                               const ds4_ckpt_meta *meta) {
    char tmp[4096], p[4200];
    DS4_TRY(ds4_checkpoint_begin(root, meta->step, tmp, sizeof tmp));
    ds4_status st = ds4_model_save(m, tmp, DS4_F32);
    if (st == DS4_OK && o) {
        snprintf(p, sizeof p, "%s/optim.state", tmp);
        st = write_optim(p, o);
    }
    if (st != DS4_OK) {
        ds4_checkpoint_abort(tmp); /* a failed save (full disk, no memory) leaves the checkpoints as they were */
        return st;
    }
    return ds4_checkpoint_commit(root, keep_latest_k, tmp, meta);
}

/* keep_latest_k: removes all but the newest k checkpoints, never the one just saved. */
static ds4_status rotate(const char *root, int64_t keep_latest_k, int64_t saved) {
    if (keep_latest_k <= 0) return DS4_OK;
    step_list l;
    DS4_TRY(list_steps(root, &l));
    char p[4200];
    for (int64_t i = 0; i + keep_latest_k < l.n; i++) {
        if (l.v[i] == saved) continue;
        snprintf(p, sizeof p, "%s/step-%08lld", root, (long long)l.v[i]);
        remove_ckpt_dir(p);
    }
    ds4_free(l.v);
    return DS4_OK;
}

static ds4_status commit_tmp(const char *root, const char *tmp, const ds4_ckpt_meta *meta) {
    char fin[4096], p[4200];
    snprintf(fin, sizeof fin, "%s/step-%08lld", root, (long long)meta->step);
    snprintf(p, sizeof p, "%s/state.json", tmp);
    ds4_status st = write_state(p, meta); /* state.json last: its presence marks a complete set */
    if (st == DS4_OK) st = fsync_path(tmp);
    if (st != DS4_OK) {
        remove_ckpt_dir(tmp); /* a failed save leaves the checkpoints as they were */
        return st;
    }
    remove_ckpt_dir(fin); /* re-saving the same step replaces it */
    if (rename(tmp, fin) != 0)
        return ds4_fail(DS4_ERR_IO, "%s: cannot rename to %s: %s", tmp, fin, strerror(errno));
    return DS4_OK;
}

ds4_status ds4_checkpoint_commit(const char *root, int64_t keep_latest_k, const char *tmp, const ds4_ckpt_meta *meta) {
    ds4_status st = commit_tmp(root, tmp, meta);
    if (st != DS4_OK) {
        ds4_checkpoint_abort(tmp);
        return st;
    }
    DS4_TRY(fsync_path(root));
    return rotate(root, keep_latest_k, meta->step);
}

ds4_status ds4_checkpoint_find(const char *root, int64_t step, char *path, size_t n) {
    step_list l;
    DS4_TRY(list_steps(root, &l));
    bool found = false;
    int64_t latest = l.n ? l.v[l.n - 1] : -1, want = step >= 0 ? step : latest;
    for (int64_t i = 0; i < l.n && !found; i++) found = l.v[i] == want;
    ds4_free(l.v);
    if (latest < 0) return ds4_fail(DS4_ERR_MISSING, "%s: no checkpoint found (no step-* folder)", root);
    if (!found)
        return ds4_fail(DS4_ERR_MISSING, "%s: no checkpoint for step %lld (latest is %lld)", root, (long long)want,
                        (long long)latest);
    snprintf(path, n, "%s/step-%08lld", root, (long long)want);
    return DS4_OK;
}

#define MAX_CKPT_STEP 999999999999999.0 /* 10^15 - 1: the largest step-N name, exact in a double */

/* state.json "step": an integer in [0, MAX_CKPT_STEP]. */
static ds4_status state_step(const char *path, const cJSON *v, int64_t *out) {
    if (!cJSON_IsNumber(v)) return ds4_fail(DS4_ERR_FORMAT, "%s: key step: expected a number", path);
    double d = v->valuedouble;
    if (!(d >= 0 && d <= MAX_CKPT_STEP && d == floor(d)))
        return ds4_fail(DS4_ERR_FORMAT, "%s: key step = %g: expected an integer in [0, %.0f]", path, d, MAX_CKPT_STEP);
    *out = (int64_t)d;
    return DS4_OK;
}

/* state.json "seed": the decimal text of a uint64 (a JSON number cannot hold every uint64). */
static ds4_status state_seed(const char *path, const cJSON *v, uint64_t *out) {
    if (!cJSON_IsString(v)) return ds4_fail(DS4_ERR_FORMAT, "%s: key seed: expected a string", path);
    const char *t = v->valuestring;
    size_t n = strlen(t);
    bool digits = n >= 1 && n <= 20 && strspn(t, "0123456789") == n;
    errno = 0;
    unsigned long long x = digits ? strtoull(t, NULL, 10) : 0;
    if (!digits || errno == ERANGE)
        return ds4_fail(DS4_ERR_FORMAT, "%s: key seed = \"%.40s\": expected a decimal integer in [0, 2^64)", path, t);
    *out = x;
    return DS4_OK;
}

static ds4_status read_state(const char *path, ds4_ckpt_meta *meta) {
    char *txt;
    size_t len;
    DS4_TRY(ds4_read_file(path, &txt, &len));
    const int64_t oom = ds4_alloc_failures(); /* cJSON says "invalid" also when it ran out of memory */
    cJSON *j = cJSON_ParseWithLength(txt, len);
    ds4_free(txt);
    if (!j && ds4_alloc_failures() != oom) return ds4_fail(DS4_ERR_OOM, "%s: out of memory parsing the JSON", path);
    if (!j) return ds4_fail(DS4_ERR_FORMAT, "%s: not valid JSON", path);
    const cJSON *ds = cJSON_GetObjectItemCaseSensitive(j, "data_state");
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(j, "format");
    ds4_status rc = state_step(path, cJSON_GetObjectItemCaseSensitive(j, "step"), &meta->step);
    if (rc == DS4_OK) rc = state_seed(path, cJSON_GetObjectItemCaseSensitive(j, "seed"), &meta->seed);
    if (rc == DS4_OK && (!cJSON_IsString(ds) || strlen(ds->valuestring) >= sizeof meta->data_state))
        rc = ds4_fail(DS4_ERR_FORMAT, "%s: key data_state: expected a string of at most %zu bytes", path,
                      sizeof meta->data_state - 1);
    if (rc == DS4_OK && fmt && !(cJSON_IsString(fmt) && !strcmp(fmt->valuestring, "ds4-checkpoint-1")))
        rc = ds4_fail(DS4_ERR_FORMAT, "%s: key format: expected \"ds4-checkpoint-1\"", path);
    if (rc == DS4_OK) snprintf(meta->data_state, sizeof meta->data_state, "%s", ds->valuestring);
    cJSON_Delete(j);
    return rc;
}

/* optim.state "adamw.step": the optimizer steps taken, in [0, MAX_CKPT_STEP] (it sets the bias correction). */
static ds4_status check_optim_step(const char *path, int64_t step) {
    if (step >= 0 && (double)step <= MAX_CKPT_STEP) return DS4_OK;
    return ds4_fail(DS4_ERR_FORMAT, "%s: tensor adamw.step = %lld: expected an integer in [0, %.0f]", path,
                    (long long)step, MAX_CKPT_STEP);
}

/* The entry whose mark the file holds (AdamW: none). */
static const ds4_optimizer *writer_of(const ds4_st_file *f) {
    for (int i = 0; ds4_optimizer_at(i); i++) {
        const ds4_optimizer *e = ds4_optimizer_at(i);
        if (e->mark && ds4_st_find(f, e->mark)) return e;
    }
    return &ds4_optimizer_adamw;
}

/* A checkpoint folder named step-N holds state.json's step N: a hand-edited step that disagrees with the
 * folder would resume the data order and the schedule at the wrong place. */
static ds4_status check_step_matches_folder(const char *path, const char *state, int64_t step) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    for (size_t n = strlen(dir); n > 1 && dir[n - 1] == '/'; n--) dir[n - 1] = 0;
    const char *base = strrchr(dir, '/') ? strrchr(dir, '/') + 1 : dir;
    int64_t named;
    if (!parse_step_name(base, &named) || named == step) return DS4_OK;
    return ds4_fail(DS4_ERR_FORMAT, "%s: key step = %lld disagrees with its folder %s (step %lld)", state,
                    (long long)step, base, (long long)named);
}

ds4_status ds4_checkpoint_load_meta(const char *path, ds4_ckpt_meta *meta) {
    char p[4200];
    snprintf(p, sizeof p, "%s/state.json", path);
    DS4_TRY(read_state(p, meta));
    DS4_TRY(check_step_matches_folder(path, p, meta->step));
    /* which optimizer wrote optim.state: its mark says so (a missing file is the optimizer load's error) */
    meta->optimizer = &ds4_optimizer_adamw;
    if (ds4_checkpoint_is_per_rank(path)) { /* the mark is in every rank's file */
        ds4_ckpt_shards *s;
        DS4_TRY(ds4_ckpt_shards_open(path, -1, &s));
        meta->optimizer = writer_of(ds4_ckpt_shards_file(s, 0));
        ds4_ckpt_shards_close(s);
        return DS4_OK;
    }
    snprintf(p, sizeof p, "%s/optim.state", path);
    ds4_st_file *f;
    if (access(p, F_OK) != 0) return DS4_OK;
    DS4_TRY(ds4_st_open(p, &f));
    meta->optimizer = writer_of(f);
    ds4_st_close(f);
    return DS4_OK;
}

/* ------------------------------------------------------------------ the optimizer state, read back */
/* Where the arrays come from: one optim.state file (each tensor over every packed element, "full", or over
 * its group's elements only) or the per-rank files (every array full). */
typedef struct {
    const char *what;            /* for messages */
    ds4_st_file *f;              /* NULL: shards */
    ds4_ckpt_shards *shards;
    const ds4_optimizer *writer;
    const ds4_optimizer *reader;
    ds4_model *m;
    int64_t *poff;               /* [nparams] each float parameter's packed offset */
    int64_t *goff;               /* [nparams] its offset among the packed elements of its writer group */
    int64_t *flat, nflat;        /* [nflat] the float parameters (indices), in packed order */
    ds4_tensor_loc loc[DS4_OPT_NGROUPS][DS4_OPT_ARRAYS_MAX]; /* optim.state: each writer array */
    bool full[DS4_OPT_NGROUPS][DS4_OPT_ARRAYS_MAX];
    const char *name[DS4_OPT_NGROUPS][DS4_OPT_ARRAYS_MAX];   /* the tensor each writer array is read from */
    /* per-rank files whose optimizer arrays hold one group's elements each (the writer's own array is
     * there): the own group's intervals of every file, sorted by (file, offset), each with the own elements
     * of its file before it, and each file's arrays */
    bool grouped;
    int64_t (*own)[4];           /* [nown]: file, offset in the file's params, length, own elements before */
    int64_t nown, cap;
    ds4_tensor_loc *floc;        /* [nfiles][DS4_OPT_NGROUPS][DS4_OPT_ARRAYS_MAX] */
    ds4_optim *o;
    float *buf;                  /* [C] for a swapped state */
    int64_t C, switched;
    ds4_status st;
} optim_src;

static ds4_status own_intervals(optim_src *x);

static int writer_group(const optim_src *x, const ds4_param *p) {
    return ds4_optimizer_takes(x->writer, p) ? DS4_OPT_OWN : DS4_OPT_ADAMW;
}

/* The packed offsets, and each writer group's tensor names (a file of ds4 before Muon owned its state kept
 * the momentum in adamw.m) and, from optim.state, their locations and layouts. */
static ds4_status src_open(optim_src *x) {
    const int64_t np = ds4_model_nparams(x->m);
    x->poff = ds4_alloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(int64_t));
    x->goff = ds4_alloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(int64_t));
    x->flat = ds4_alloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(int64_t));
    if (!x->poff || !x->goff || !x->flat)
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory reading the optimizer state", x->what);
    int64_t packed = 0, count[DS4_OPT_NGROUPS] = {0, 0};
    for (int64_t i = 0; i < np; i++) {
        const ds4_param *p = ds4_model_param(x->m, i);
        if (!ds4_param_in_flat(p)) continue;
        const int g = writer_group(x, p);
        x->flat[x->nflat++] = i;
        x->poff[i] = packed, x->goff[i] = count[g];
        packed += p->numel, count[g] += p->numel;
    }
    for (int g = 0; g < DS4_OPT_NGROUPS; g++) {
        const ds4_optimizer *e = g == DS4_OPT_OWN ? x->writer : &ds4_optimizer_adamw;
        if (g == DS4_OPT_OWN && !e->takes) break;
        for (int a = 0; a < e->nstate && a < DS4_OPT_ARRAYS_MAX; a++) {
            const char *name = e->state_names[a];
            const bool present = x->f ? ds4_st_find(x->f, name) != NULL : ds4_ckpt_shards_has(x->shards, name);
            if (g == DS4_OPT_OWN && !present && x->writer == &ds4_optimizer_muon && a == 0) name = "adamw.m";
            x->name[g][a] = name;
            x->full[g][a] = !x->f || !present; /* the old momentum is adamw.m, over every element */
            x->grouped = x->grouped || (!x->f && g == DS4_OPT_OWN && present); /* per-rank: arrays by group */
            if (!x->f) continue;
            DS4_TRY(ds4_st_locate(x->f, name, &x->loc[g][a]));
            const ds4_tensor_loc *l = &x->loc[g][a];
            if (l->entry->dtype != DS4_F32 || l->ndim != 1 || (l->shape[0] != packed && l->shape[0] != count[g]))
                return ds4_fail(DS4_ERR_SHAPE, "%s: tensor %s: expected F32 [%lld] (every element) or [%lld] (its group's)",
                                x->what, name, (long long)packed, (long long)count[g]);
            x->full[g][a] = l->shape[0] == packed;
        }
    }
    return x->grouped ? own_intervals(x) : DS4_OK;
}

static int cmp_own(const void *a, const void *b) {
    const int64_t *x = a, *y = b;
    return x[0] != y[0] ? (x[0] > y[0]) - (x[0] < y[0]) : (x[1] > y[1]) - (x[1] < y[1]);
}

/* The file's range holding packed element off (the ranges tile [0, packed)). */
static ds4_ckpt_range range_at(const ds4_ckpt_shards *s, int64_t off) {
    int64_t lo = 0, hi = ds4_ckpt_shards_nranges(s) - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (ds4_ckpt_shards_range(s, mid).poff <= off) lo = mid;
        else hi = mid - 1;
    }
    return ds4_ckpt_shards_range(s, lo);
}

/* Grouped per-rank files: the writer's own-group intervals of each file, from the index ranges cut at
 * parameter boundaries, and each file's arrays located and checked against its group's elements. */
static ds4_status own_intervals(optim_src *x) {
    const ds4_ckpt_shards *s = x->shards;
    const int nf = ds4_ckpt_shards_nfiles(s);
    for (int64_t i = 0; i < ds4_ckpt_shards_nranges(s); i++) {
        const ds4_ckpt_range r = ds4_ckpt_shards_range(s, i);
        int64_t lo = 0, hi = x->nflat - 1; /* the last float parameter starting at or before the range */
        while (lo < hi) {
            const int64_t mid = (lo + hi + 1) / 2;
            if (x->poff[x->flat[mid]] <= r.poff) lo = mid;
            else hi = mid - 1;
        }
        for (int64_t k = lo, at = r.poff; k < x->nflat && at < r.poff + r.len; k++) { /* the parameters it covers */
            const int64_t p = x->flat[k];
            const ds4_param *q = ds4_model_param(x->m, p);
            const int64_t end = x->poff[p] + q->numel < r.poff + r.len ? x->poff[p] + q->numel : r.poff + r.len;
            if (end <= at) continue;
            if (writer_group(x, q) == DS4_OPT_OWN) {
                if (!ds4_grow((void **)&x->own, &x->cap, x->nown + 1, sizeof *x->own))
                    return ds4_fail(DS4_ERR_OOM, "%s: out of memory reading the optimizer state", x->what);
                x->own[x->nown][0] = r.file, x->own[x->nown][1] = r.foff + (at - r.poff), x->own[x->nown][2] = end - at;
                x->nown++;
            }
            at = end;
        }
    }
    if (x->nown > 1) qsort(x->own, (size_t)x->nown, sizeof *x->own, cmp_own);
    int64_t *total = ds4_calloc(DS4_MEM_OTHER, (size_t)nf * sizeof(int64_t));
    x->floc = ds4_calloc(DS4_MEM_OTHER, (size_t)nf * DS4_OPT_NGROUPS * DS4_OPT_ARRAYS_MAX * sizeof *x->floc);
    if (!total || !x->floc) {
        ds4_free(total);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory reading the optimizer state", x->what);
    }
    for (int64_t k = 0; k < x->nown; k++) {
        x->own[k][3] = total[x->own[k][0]];
        total[x->own[k][0]] += x->own[k][2];
    }
    ds4_status st = DS4_OK;
    for (int f = 0; f < nf && st == DS4_OK; f++)
        for (int g = 0; g < DS4_OPT_NGROUPS && st == DS4_OK; g++)
            for (int a = 0; a < DS4_OPT_ARRAYS_MAX && x->name[g][a] && st == DS4_OK; a++) {
                ds4_tensor_loc *l = &x->floc[(f * DS4_OPT_NGROUPS + g) * DS4_OPT_ARRAYS_MAX + a];
                const int64_t want = g == DS4_OPT_OWN ? total[f] : ds4_ckpt_shards_elements(s, f) - total[f];
                st = ds4_st_locate(ds4_ckpt_shards_file(s, f), x->name[g][a], l);
                if (st == DS4_OK) st = ds4_tensor_loc_check_shape(l, 1, &want);
            }
    ds4_free(total);
    return st;
}

/* Grouped per-rank files: packed elements [off, off + n) of writer array (g, a), each piece read from its
 * file's array at its place among the group's elements there. */
static ds4_status grouped_read(optim_src *x, int g, int a, int64_t off, int64_t n, float *dst) {
    while (n > 0) {
        const ds4_ckpt_range r = range_at(x->shards, off);
        const int64_t fo = r.foff + (off - r.poff), take = r.poff + r.len - off < n ? r.poff + r.len - off : n;
        int64_t lo = 0, hi = x->nown - 1, before = 0; /* the last own interval of this file starting at or before fo */
        while (lo <= hi) {
            const int64_t mid = (lo + hi) / 2;
            if (x->own[mid][0] < r.file || (x->own[mid][0] == r.file && x->own[mid][1] <= fo)) lo = mid + 1;
            else hi = mid - 1;
        }
        if (hi >= 0 && x->own[hi][0] == r.file)
            before = x->own[hi][3] + (fo - x->own[hi][1] < x->own[hi][2] ? fo - x->own[hi][1] : x->own[hi][2]);
        const int64_t j = g == DS4_OPT_OWN ? before : fo - before;
        const ds4_tensor_loc *l = &x->floc[(r.file * DS4_OPT_NGROUPS + g) * DS4_OPT_ARRAYS_MAX + a];
        DS4_TRY(ds4_tensor_loc_read_rows(l, j, j + take, dst));
        ds4_tensor_loc_release_rows(l, j, j + take); /* the pages read go back */
        off += take, n -= take, dst += take;
    }
    return DS4_OK;
}

static void src_close(optim_src *x) {
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < DS4_OPT_ARRAYS_MAX; a++)
            if (x->loc[g][a].entry) ds4_tensor_loc_release(&x->loc[g][a]); /* the pages read go back */
    ds4_free(x->poff);
    ds4_free(x->goff);
    ds4_free(x->flat);
    ds4_free(x->buf);
    ds4_free(x->own);
    ds4_free(x->floc);
}

/* Writer array (g, a) of parameter i, elements [k0, k0 + n), into dst. */
static ds4_status src_read(optim_src *x, int g, int a, int64_t i, int64_t k0, int64_t n, float *dst) {
    const int64_t off = (x->full[g][a] ? x->poff[i] : x->goff[i]) + k0;
    if (x->f) return ds4_tensor_loc_read_rows(&x->loc[g][a], off, off + n, dst);
    if (x->grouped) return grouped_read(x, g, a, x->poff[i] + k0, n, dst);
    DS4_TRY(ds4_ckpt_shards_select_name(x->shards, x->name[g][a]));
    return ds4_ckpt_shards_read(x->shards, off, n, dst);
}

/* One piece of the state: elements [k0, k1) of p at flat offset s0 of o. Read when the writer trained p by
 * the rule o trains it by, else zero; a chunk at a time through the host buffer, into the state's memory
 * (on its backend) or into the store. */
static void src_piece(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    optim_src *x = ctx;
    if (x->st != DS4_OK || k1 == k0) return;
    int64_t j;
    const int gr = ds4_optim_locate(x->o, s0, &j), gw = writer_group(x, p);
    const bool same = gr == gw && (gr == DS4_OPT_ADAMW || x->writer == x->reader);
    const int64_t i = p - ds4_model_param(x->m, 0);
    if (!same) x->switched += k1 - k0;
    for (int a = 0; a < x->o->g[gr].k && x->st == DS4_OK; a++) {
        for (int64_t c0 = k0; c0 < k1 && x->st == DS4_OK; c0 += x->C) {
            const int64_t n = k1 - c0 < x->C ? k1 - c0 : x->C;
            if (same) x->st = src_read(x, gr, a, i, c0, n, x->buf);
            else memset(x->buf, 0, (size_t)n * sizeof(float));
            if (x->st == DS4_OK) x->st = ds4_optim_write(x->o, gr, a, j + (c0 - k0), n, x->buf);
        }
    }
}

/* Every piece of o: each float parameter whole (f NULL), or the shard's pieces. */
static ds4_status src_load(optim_src *x, const ds4_fsdp *f) {
    DS4_TRY(src_open(x));
    x->C = x->o->chunk > 0 ? x->o->chunk : (int64_t)(DS4_ADAMW_SWAP_CHUNK / (2 * sizeof(float)));
    if (!(x->buf = ds4_alloc(x->o->swapped ? DS4_MEM_OPTIM : DS4_MEM_OTHER, (size_t)x->C * sizeof(float))))
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory loading the optimizer state", x->what);
    if (f) ds4_fsdp_for_each_piece(f, src_piece, x);
    const float *flat = ds4_model_params_flat(x->m);
    for (int64_t i = 0; !f && i < ds4_model_nparams(x->m); i++) {
        ds4_param *p = ds4_model_param(x->m, i);
        if (ds4_param_in_flat(p) && ds4_optim_holds(x->o, p->data - flat)) /* a pipeline stage: its own */
            src_piece(x, p, 0, p->numel, p->data - flat);
    }
    return x->st;
}

ds4_status ds4_optim_state_load(ds4_optim *o, ds4_model *m, const ds4_fsdp *f, const ds4_optimizer *writer,
                                const char *path, int64_t *switched) {
    optim_src x = {.what = path, .writer = writer, .reader = o->opt, .m = m, .o = o};
    int64_t one = 1, step = 0;
    DS4_TRY(ds4_st_open(path, &x.f));
    ds4_status st = src_load(&x, f);
    if (st == DS4_OK) st = ds4_st_read_i64(x.f, "adamw.step", 1, &one, &step);
    if (st == DS4_OK) st = check_optim_step(path, step);
    if (st == DS4_OK) o->step = step;
    if (switched) *switched = x.switched;
    src_close(&x);
    ds4_st_close(x.f);
    return st;
}

ds4_status ds4_checkpoint_load_optim(const char *path, ds4_optim *o, ds4_model *m, const ds4_fsdp *f,
                                     const ds4_optimizer *writer, int64_t *switched) {
    char p[4200];
    if (!ds4_checkpoint_is_per_rank(path)) {
        snprintf(p, sizeof p, "%s/optim.state", path);
        return ds4_optim_state_load(o, m, f, writer, p, switched);
    }
    const int64_t packed = f ? ds4_fsdp_packed_numel(f) : ds4_model_numel(m);
    optim_src x = {.what = path, .writer = writer, .reader = o->opt, .m = m, .o = o};
    DS4_TRY(ds4_ckpt_shards_open(path, packed, &x.shards));
    ds4_status st = src_load(&x, f);
    if (st == DS4_OK) o->step = ds4_ckpt_shards_step(x.shards);
    if (switched) *switched = x.switched;
    src_close(&x);
    ds4_ckpt_shards_close(x.shards);
    return st;
}

/* A per-rank checkpoint's weights into a whole model: every packed range read from the files that hold it. */
static ds4_status load_per_rank_model(const char *path, ds4_model *m) {
    ds4_ckpt_shards *s;
    DS4_TRY(ds4_ckpt_shards_open(path, ds4_model_numel(m), &s));
    ds4_status st = ds4_ckpt_shards_read(s, 0, ds4_model_numel(m), ds4_model_params_flat(m));
    if (st == DS4_OK) st = ds4_ckpt_shards_load_tables(s, m);
    ds4_ckpt_shards_close(s);
    return st;
}

ds4_status ds4_checkpoint_load(const char *path, ds4_model *m, ds4_optim *o, ds4_ckpt_meta *meta) {
    DS4_TRY(ds4_checkpoint_load_meta(path, meta));
    if (ds4_checkpoint_is_per_rank(path)) DS4_TRY(load_per_rank_model(path, m));
    else {
        ds4_model_dir *d;
        DS4_TRY(ds4_model_dir_open(path, &d));
        ds4_status st = ds4_model_load(m, d);
        ds4_model_dir_close(d);
        if (st != DS4_OK) return ds4_fail_prefix(st, "checkpoint %s", path);
    }
    return o ? ds4_checkpoint_load_optim(path, o, m, NULL, meta->optimizer, NULL) : DS4_OK;
}

/* ------------------------------------------------------------------ the run's config against the checkpoint's */
ds4_status ds4_checkpoint_check_config(const char *path, const ds4_config *run) {
    char p[4200];
    snprintf(p, sizeof p, "%s/config.json", path);
    ds4_config ck;
    DS4_TRY(ds4_config_load(p, &ck));
    const char *key;
    size_t off;
    bool is_float;
    for (int i = 0; ds4_config_resume_field(i, &key, &off, &is_float); i++) {
        const char *a = (const char *)&ck + off, *b = (const char *)run + off;
        if (is_float) {
            double x, y;
            memcpy(&x, a, sizeof x);
            memcpy(&y, b, sizeof y);
            if (x != y && !(isnan(x) && isnan(y)))
                return ds4_fail(DS4_ERR_CONFIG, "%s: %s = %.17g, but this run's model has %.17g: refusing to resume", p,
                                key, x, y);
        } else {
            int64_t x, y;
            memcpy(&x, a, sizeof x);
            memcpy(&y, b, sizeof y);
            if (x != y)
                return ds4_fail(DS4_ERR_CONFIG, "%s: %s = %lld, but this run's model has %lld: refusing to resume", p,
                                key, (long long)x, (long long)y);
        }
    }
    for (int64_t l = 0; l < run->n_layers + run->n_mtp_layers; l++)
        if (ck.compress_ratios[l] != run->compress_ratios[l])
            return ds4_fail(DS4_ERR_CONFIG, "%s: compress_ratios[%lld] = %lld, but this run's model has %lld: refusing to resume",
                            p, (long long)l, (long long)ck.compress_ratios[l], (long long)run->compress_ratios[l]);
    if (ck.csa_dense != run->csa_dense)
        return ds4_fail(DS4_ERR_CONFIG, "%s: csa_dense = %s, but this run's model has %s: refusing to resume", p,
                        ck.csa_dense ? "true" : "false", run->csa_dense ? "true" : "false");
    return DS4_OK;
}

/* ------------------------------------------------------------------ one writer per checkpoint folder */
ds4_status ds4_checkpoint_lock(const char *root, int *fd) {
    *fd = -1;
    DS4_TRY(ds4_mkdirs(root, "checkpoint folder"));
    struct stat sb;
    if (stat(root, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return ds4_fail(DS4_ERR_IO, "%s: the checkpoint folder is not a directory", root);
    if (access(root, W_OK | X_OK) != 0)
        return ds4_fail(DS4_ERR_IO, "%s: the checkpoint folder is not writable: %s", root, strerror(errno));
    char p[4200];
    snprintf(p, sizeof p, "%s/.lock", root);
    int f = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (f < 0) return ds4_fail(DS4_ERR_IO, "%s: cannot create the lock file: %s", p, strerror(errno));
    if (flock(f, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        close(f);
        if (e == EWOULDBLOCK)
            return ds4_fail(DS4_ERR_IO, "%s: another ds4 train run holds this checkpoint folder (lock %s)", root, p);
        return ds4_fail(DS4_ERR_IO, "%s: cannot lock: %s", p, strerror(e));
    }
    *fd = f;
    return DS4_OK;
}

void ds4_checkpoint_unlock(int fd) {
    if (fd >= 0) close(fd); /* closing releases the flock */
}
