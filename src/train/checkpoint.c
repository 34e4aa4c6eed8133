/* Atomic training checkpoints: ROOT/step-NNNNNNNN/{config.json, model.safetensors, optim.safetensors,
 * state.json}. Written into ROOT/.tmp-step-NNNNNNNN, each file fsynced, then the directory is renamed
 * into place and ROOT fsynced. Only directories named step-* count, so a half-written one is ignored. */
#include "ds4/io.h"
#include "ds4/train.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* Steps of the complete checkpoints under root, ascending. */
static int64_t list_steps(const char *root, int64_t *steps, int64_t cap) {
    DIR *d = opendir(root);
    if (!d) return 0;
    int64_t n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long long s;
        char tail;
        if (sscanf(e->d_name, "step-%lld%c", &s, &tail) == 1 && n < cap) steps[n++] = s;
    }
    closedir(d);
    for (int64_t i = 1; i < n; i++)
        for (int64_t j = i; j > 0 && steps[j - 1] > steps[j]; j--) {
            int64_t t = steps[j];
            steps[j] = steps[j - 1];
            steps[j - 1] = t;
        }
    return n;
}

static ds4_status write_optim(const char *path, const ds4_adamw *o) {
    if (o->store) return ds4_adamw_state_save(o, path); /* --swap-optimizer: streamed from the offload store */
    ds4_st_writer *w;
    DS4_TRY(ds4_st_writer_new(&w));
    int64_t shape[1] = {o->n}, one = 1;
    ds4_status st = ds4_st_writer_add(w, "adamw.m", DS4_F32, 1, shape, o->m);
    if (st == DS4_OK) st = ds4_st_writer_add(w, "adamw.v", DS4_F32, 1, shape, o->v);
    if (st == DS4_OK) st = ds4_st_writer_add(w, "adamw.step", DS4_I64, 1, &one, &o->step);
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

ds4_status ds4_checkpoint_begin(const char *root, int64_t step, char *tmp, size_t n) {
    if (mkdir(root, 0755) != 0 && errno != EEXIST)
        return ds4_fail(DS4_ERR_IO, "%s: cannot create checkpoint folder: %s", root, strerror(errno));
    snprintf(tmp, n, "%s/.tmp-step-%08lld", root, (long long)step);
    remove_ckpt_dir(tmp); /* leftovers of an interrupted save */
    if (mkdir(tmp, 0755) != 0)
        return ds4_fail(DS4_ERR_IO, "%s: cannot create checkpoint directory: %s", tmp, strerror(errno));
    return DS4_OK;
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
        remove_ckpt_dir(tmp); /* a failed save leaves the checkpoints as they were */
        return st;
    }
    return ds4_checkpoint_commit(root, keep_latest_k, tmp, meta);
}

ds4_status ds4_checkpoint_commit(const char *root, int64_t keep_latest_k, const char *tmp, const ds4_ckpt_meta *meta) {
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
    DS4_TRY(fsync_path(root));
    if (keep_latest_k > 0) {
        int64_t steps[4096];
        int64_t n = list_steps(root, steps, 4096);
        for (int64_t i = 0; i + keep_latest_k < n; i++) {
            snprintf(p, sizeof p, "%s/step-%08lld", root, (long long)steps[i]);
            remove_ckpt_dir(p);
        }
    }
    return DS4_OK;
}

ds4_status ds4_checkpoint_find(const char *root, int64_t step, char *path, size_t n) {
    int64_t steps[4096];
    int64_t k = list_steps(root, steps, 4096);
    if (k == 0) return ds4_fail(DS4_ERR_MISSING, "%s: no checkpoint found (no step-* folder)", root);
    int64_t want = step >= 0 ? step : steps[k - 1];
    for (int64_t i = 0; i < k; i++)
        if (steps[i] == want) {
            snprintf(path, n, "%s/step-%08lld", root, (long long)want);
            return DS4_OK;
        }
    return ds4_fail(DS4_ERR_MISSING, "%s: no checkpoint for step %lld (latest is %lld)", root, (long long)want,
                    (long long)steps[k - 1]);
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
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(j, "step");
    const cJSON *sd = cJSON_GetObjectItemCaseSensitive(j, "seed");
    const cJSON *ds = cJSON_GetObjectItemCaseSensitive(j, "data_state");
    ds4_status rc = DS4_OK;
    if (!cJSON_IsNumber(st) || !cJSON_IsString(sd) || !cJSON_IsString(ds))
        rc = ds4_fail(DS4_ERR_FORMAT, "%s: expected keys step (number), seed (string), data_state (string)", path);
    else {
        meta->step = (int64_t)st->valuedouble;
        meta->seed = strtoull(sd->valuestring, NULL, 10);
        snprintf(meta->data_state, sizeof meta->data_state, "%s", ds->valuestring);
    }
    cJSON_Delete(j);
    return rc;
}

static ds4_status read_optim(const char *path, ds4_adamw *o) {
    if (o->store) return ds4_adamw_state_load(o, path); /* --swap-optimizer: streamed into the offload store */
    ds4_st_file *f;
    DS4_TRY(ds4_st_open(path, &f));
    int64_t shape[1] = {o->n}, one = 1, step = 0;
    ds4_status st = ds4_st_read_f32(f, "adamw.m", 1, shape, o->m);
    if (st == DS4_OK) st = ds4_st_read_f32(f, "adamw.v", 1, shape, o->v);
    if (st == DS4_OK) st = ds4_st_read_i64(f, "adamw.step", 1, &one, &step);
    if (st == DS4_OK) o->step = step;
    ds4_st_close(f);
    return st;
}

ds4_status ds4_checkpoint_load_meta(const char *path, ds4_ckpt_meta *meta) {
    char p[4200];
    snprintf(p, sizeof p, "%s/state.json", path);
    return read_state(p, meta);
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

ds4_status ds4_checkpoint_load(const char *path, ds4_model *m, ds4_adamw *o, ds4_ckpt_meta *meta) {
    char p[4200];
    DS4_TRY(ds4_checkpoint_load_meta(path, meta));
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
