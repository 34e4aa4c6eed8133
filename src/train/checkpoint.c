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

static ds4_status write_optim(const char *path, const ds4_adamw *o) {
    if (o->store) return ds4_adamw_state_save(o, path); /* --swap-optimizer: streamed from the offload store */
    ds4_st_writer *w;
    DS4_TRY(ds4_st_writer_new(&w));
    int64_t shape[1] = {o->n}, one = 1;
    ds4_status st = ds4_st_writer_add(w, "adamw.m", DS4_F32, 1, shape, o->m);
    if (st == DS4_OK) st = ds4_st_writer_add(w, "adamw.v", DS4_F32, 1, shape, o->v);
    if (st == DS4_OK) st = ds4_st_writer_add(w, "adamw.step", DS4_I64, 1, &one, &o->step);
    if (st == DS4_OK && o->muon) st = ds4_st_writer_add(w, DS4_CKPT_MUON_MARK, DS4_I64, 1, &one, &o->step);
    if (st == DS4_OK) st = ds4_st_writer_write(w, path);
    ds4_st_writer_free(w);
    return st;
}

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

ds4_status ds4_checkpoint_save(const char *root, int64_t keep_latest_k, ds4_model *m, const ds4_adamw *o,
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

static ds4_status read_optim(const char *path, ds4_adamw *o) {
    if (o->store) return ds4_adamw_state_load(o, path); /* --swap-optimizer: streamed into the offload store */
    ds4_st_file *f;
    DS4_TRY(ds4_st_open(path, &f));
    int64_t shape[1] = {o->n}, one = 1, step = 0;
    ds4_status st = ds4_st_read_f32(f, "adamw.m", 1, shape, o->m);
    if (st == DS4_OK) st = ds4_st_read_f32(f, "adamw.v", 1, shape, o->v);
    if (st == DS4_OK) st = ds4_st_read_i64(f, "adamw.step", 1, &one, &step);
    if (st == DS4_OK) st = check_optim_step(path, step);
    if (st == DS4_OK) o->step = step;
    ds4_st_close(f);
    return st;
}

ds4_status ds4_checkpoint_load_meta(const char *path, ds4_ckpt_meta *meta) {
    char p[4200];
    snprintf(p, sizeof p, "%s/state.json", path);
    DS4_TRY(read_state(p, meta));
    /* which optimizer wrote optim.state: Muon marks its file (a missing file is the optimizer load's error) */
    snprintf(p, sizeof p, "%s/optim.state", path);
    meta->muon = false;
    if (ds4_checkpoint_is_per_rank(path)) { /* the mark is in every rank's file */
        ds4_ckpt_shards *s;
        DS4_TRY(ds4_ckpt_shards_open(path, -1, &s));
        meta->muon = ds4_ckpt_shards_muon(s);
        ds4_ckpt_shards_close(s);
        return DS4_OK;
    }
    ds4_st_file *f;
    if (access(p, F_OK) != 0) return DS4_OK;
    DS4_TRY(ds4_st_open(p, &f));
    meta->muon = ds4_st_find(f, DS4_CKPT_MUON_MARK) != NULL;
    ds4_st_close(f);
    return DS4_OK;
}

struct ds4_ckpt_moment {
    ds4_st_file *f;
    ds4_tensor_loc loc;
};

ds4_status ds4_checkpoint_moment_open(const char *path, const char *name, int64_t n, ds4_ckpt_moment **out,
                                      int64_t *step) {
    *out = NULL;
    char p[4200];
    snprintf(p, sizeof p, "%s/optim.state", path);
    ds4_ckpt_moment *mo = ds4_calloc(DS4_MEM_OTHER, sizeof *mo);
    if (!mo) return DS4_ERR_OOM;
    int64_t shape[1] = {n}, one = 1;
    ds4_status st = ds4_st_open(p, &mo->f);
    if (st == DS4_OK) st = ds4_st_locate(mo->f, name, &mo->loc);
    if (st == DS4_OK) st = ds4_tensor_loc_check_shape(&mo->loc, 1, shape);
    if (st == DS4_OK && mo->loc.entry->dtype != DS4_F32)
        st = ds4_fail(DS4_ERR_SHAPE, "%s: tensor %s: expected F32, got %s", p, name, ds4_dtype_name(mo->loc.entry->dtype));
    if (st == DS4_OK) st = ds4_st_read_i64(mo->f, "adamw.step", 1, &one, step);
    if (st == DS4_OK) st = check_optim_step(p, *step);
    if (st != DS4_OK) {
        ds4_ckpt_moment_close(mo);
        return st;
    }
    *out = mo;
    return DS4_OK;
}

ds4_status ds4_ckpt_moment_read(void *moment, int64_t off, int64_t n, float *dst) {
    ds4_ckpt_moment *mo = moment;
    return ds4_tensor_loc_read_rows(&mo->loc, off, off + n, dst);
}

void ds4_ckpt_moment_close(ds4_ckpt_moment *mo) {
    if (!mo) return;
    if (mo->f) ds4_tensor_loc_release(&mo->loc); /* the pages read go back */
    ds4_st_close(mo->f);
    ds4_free(mo);
}

/* One moment of a per-rank checkpoint into o (resident or swapped), a chunk at a time. */
static ds4_status read_moment_shards(ds4_ckpt_shards *s, ds4_ckpt_array which, ds4_adamw *o) {
    ds4_ckpt_shards_select(s, which);
    float *mem = which == DS4_CKPT_ADAMW_M ? o->m : o->v;
    if (mem) return ds4_ckpt_shards_read(s, 0, o->n, mem);
    const int64_t C = (int64_t)(DS4_ADAMW_SWAP_CHUNK / sizeof(float));
    float *buf = ds4_alloc(DS4_MEM_OPTIM, (size_t)C * sizeof(float));
    if (!buf) return ds4_fail(DS4_ERR_OOM, "out of memory loading the optimizer state");
    ds4_status st = DS4_OK;
    for (int64_t i0 = 0; i0 < o->n && st == DS4_OK; i0 += C) {
        const int64_t n = o->n - i0 < C ? o->n - i0 : C;
        st = ds4_ckpt_shards_read(s, i0, n, buf);
        if (st == DS4_OK) st = ds4_adamw_moment_write(o, which == DS4_CKPT_ADAMW_M ? 0 : 1, i0, n, buf);
    }
    ds4_free(buf);
    return st;
}

/* A per-rank checkpoint into a whole model: every packed range read from the files that hold it. */
static ds4_status load_per_rank(const char *path, ds4_model *m, ds4_adamw *o) {
    ds4_ckpt_shards *s;
    DS4_TRY(ds4_ckpt_shards_open(path, ds4_model_numel(m), &s));
    ds4_status st = ds4_ckpt_shards_read(s, 0, ds4_model_numel(m), ds4_model_params_flat(m));
    if (st == DS4_OK) st = ds4_ckpt_shards_load_tables(s, m);
    if (st == DS4_OK && o) st = read_moment_shards(s, DS4_CKPT_ADAMW_M, o);
    if (st == DS4_OK && o) st = read_moment_shards(s, DS4_CKPT_ADAMW_V, o);
    if (st == DS4_OK && o) o->step = ds4_ckpt_shards_step(s);
    ds4_ckpt_shards_close(s);
    return st;
}

ds4_status ds4_checkpoint_load(const char *path, ds4_model *m, ds4_adamw *o, ds4_ckpt_meta *meta) {
    char p[4200];
    DS4_TRY(ds4_checkpoint_load_meta(path, meta));
    if (ds4_checkpoint_is_per_rank(path)) return load_per_rank(path, m, o);
    ds4_model_dir *d;
    DS4_TRY(ds4_model_dir_open(path, &d));
    ds4_status st = ds4_model_load(m, d);
    ds4_model_dir_close(d);
    if (st != DS4_OK) return ds4_fail_prefix(st, "checkpoint %s", path);
    if (o) {
        snprintf(p, sizeof p, "%s/optim.state", path);
        DS4_TRY(read_optim(p, o));
    }
    return DS4_OK;
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
