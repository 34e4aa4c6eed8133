/* Per-rank checkpoints (checkpoint.per_rank): every rank of a sharded state writes its own file, at the
 * same time as the others, into the same hidden ROOT/.tmp-step-N that the one-writer save uses:
 *   shard-RRRRR-of-WWWWW.safetensors  "params" F32 [k]: the rank's elements of the packed layout (ds4/dist.h);
 *                                     the optimizer's arrays ("adamw.m", "adamw.v", Muon's "muon.momentum"),
 *                                     each over its group's elements alone; "adamw.step" I64 [1] (and the
 *                                     optimizer's mark);
 *                                     shard 0 also holds the integer tables and carried tensors by name;
 *   shards.json                       the index (rank 0): for each file, the packed ranges it holds as
 *                                     [packed offset, offset in the file's params, length].
 * Rank 0 commits (state.json, rename) only after every rank reported its file written, so a failure on
 * any rank leaves no step-N behind. A reader serves any packed range from the files, so a checkpoint
 * written by N ranks loads on any world, EP degree, or in one process. */
#include "ds4/io.h"
#include "ds4/train.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define INDEX_FORMAT "ds4-per-rank-1"

void ds4_checkpoint_shard_name(char *buf, size_t n, int rank, int world) {
    snprintf(buf, n, "shard-%05d-of-%05d.safetensors", rank, world);
}

bool ds4_checkpoint_is_per_rank(const char *path) {
    char p[4200];
    snprintf(p, sizeof p, "%s/" DS4_CKPT_INDEX, path);
    return access(p, F_OK) == 0;
}

/* ------------------------------------------------------------------ writing */
ds4_status ds4_checkpoint_write_shard(const char *tmp, int rank, int world, const ds4_ckpt_shard_data *d) {
    char name[64], path[4200];
    ds4_checkpoint_shard_name(name, sizeof name, rank, world);
    snprintf(path, sizeof path, "%s/%s", tmp, name);
    ds4_st_writer *w;
    DS4_TRY(ds4_st_writer_new(&w));
    int64_t shape[1] = {d->n}, one = 1;
    ds4_status st = ds4_st_writer_add(w, "adamw.step", DS4_I64, 1, &one, &d->step);
    if (st == DS4_OK && d->mark) st = ds4_st_writer_add(w, d->mark, DS4_I64, 1, &one, &d->step);
    if (st == DS4_OK) st = ds4_st_writer_add(w, "params", DS4_F32, 1, shape, d->params);
    for (int a = 0; st == DS4_OK && a < d->narrays; a++)
        st = ds4_st_writer_add(w, d->names[a], DS4_F32, 1, &d->lens[a], d->arrays[a]);
    for (int64_t i = 0; st == DS4_OK && d->tables && i < ds4_model_nparams(d->tables); i++) {
        const ds4_param *p = ds4_model_param(d->tables, i);
        if (p->is_int) st = ds4_st_writer_add(w, p->name, DS4_I64, p->ndim, p->shape, p->idata);
        else if (p->carried) st = ds4_st_writer_add(w, p->name, DS4_F32, p->ndim, p->shape, p->data);
    }
    if (st == DS4_OK) st = ds4_st_writer_write(w, path);
    ds4_st_writer_free(w);
    return st;
}

/* One file of the index: its name, element count and its `count` ranges (triples from `ranges`). */
static cJSON *index_file(int rank, int world, int64_t count, int64_t elements, const int64_t *ranges) {
    char name[64];
    ds4_checkpoint_shard_name(name, sizeof name, rank, world);
    cJSON *f = cJSON_CreateObject();
    bool ok = f && cJSON_AddStringToObject(f, "file", name) && cJSON_AddNumberToObject(f, "elements", (double)elements);
    cJSON *rs = ok ? cJSON_AddArrayToObject(f, "ranges") : NULL;
    ok = ok && rs;
    for (int64_t i = 0; ok && i < count; i++) {
        const double t[3] = {(double)ranges[3 * i], (double)ranges[3 * i + 1], (double)ranges[3 * i + 2]};
        cJSON *r = cJSON_CreateDoubleArray(t, 3);
        ok = r && cJSON_AddItemToArray(rs, r);
        if (!ok) cJSON_Delete(r);
    }
    if (ok) return f;
    cJSON_Delete(f);
    return NULL;
}

ds4_status ds4_checkpoint_write_index(const char *tmp, int world, int64_t packed_numel, const int64_t *sizes,
                                      const int64_t *ranges) {
    char path[4200];
    snprintf(path, sizeof path, "%s/" DS4_CKPT_INDEX, tmp);
    cJSON *j = cJSON_CreateObject();
    bool ok = j && cJSON_AddStringToObject(j, "format", INDEX_FORMAT) && cJSON_AddNumberToObject(j, "world", world) &&
              cJSON_AddNumberToObject(j, "packed_numel", (double)packed_numel);
    cJSON *files = ok ? cJSON_AddArrayToObject(j, "files") : NULL;
    ok = ok && files;
    for (int64_t r = 0, at = 0; ok && r < world; at += sizes[2 * r], r++) {
        cJSON *f = index_file((int)r, world, sizes[2 * r], sizes[2 * r + 1], ranges + 3 * at);
        ok = f && cJSON_AddItemToArray(files, f);
        if (!ok) cJSON_Delete(f);
    }
    char *txt = ok ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    if (!txt) return ds4_fail(DS4_ERR_OOM, "%s: out of memory building the JSON", path);
    ds4_status st = ds4_write_file_atomic(path, txt, strlen(txt));
    free(txt);
    return st;
}

/* ------------------------------------------------------------------ reading */
typedef struct {
    int64_t poff, foff, len; /* packed [poff, poff + len) = the file's arrays [foff, foff + len) */
    int file;
} src_range;

struct ds4_ckpt_shards {
    char dir[4096];
    int nfiles;
    ds4_st_file **files;   /* [nfiles] */
    ds4_tensor_loc *locs;  /* [nfiles][NARRAYS]: params, adamw.m, adamw.v, muon.momentum (entry NULL: absent) */
    int64_t *elements;     /* [nfiles] length of each file's arrays */
    int64_t packed;        /* packed_numel of the index */
    src_range *ranges;     /* [nranges] ascending poff, tiling [0, packed_numel) */
    int64_t nranges, cap;
    int which;             /* the array ds4_ckpt_shards_read serves */
    int64_t step;
};

/* The arrays a shard file may hold; the first three are in every one. */
static const char *const k_arrays[] = {"params", "adamw.m", "adamw.v", "muon.momentum"};
enum { NARRAYS = sizeof k_arrays / sizeof *k_arrays, NREQUIRED = 3 };

static int cmp_range(const void *a, const void *b) {
    const src_range *x = a, *y = b;
    return (x->poff > y->poff) - (x->poff < y->poff);
}

/* A non-negative integer of the index (exact in a double). */
static bool json_i64(const cJSON *v, int64_t *out) {
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble <= 9007199254740992.0) ||
        v->valuedouble != (double)(int64_t)v->valuedouble)
        return false;
    *out = (int64_t)v->valuedouble;
    return true;
}

/* File i of the index: opened, its three arrays located and checked against "elements", its ranges added.
 * Every error names the index, the entry and the key at fault. */
static ds4_status open_file(ds4_ckpt_shards *s, const char *index, int i, const cJSON *f) {
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(f, "file");
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(f, "ranges");
    int64_t elements;
    if (!cJSON_IsObject(f))
        return ds4_fail(DS4_ERR_FORMAT, "%s: files[%d]: expected {\"file\": NAME, \"elements\": N, \"ranges\": [...]}",
                        index, i);
    /* a plain name of this folder: no path, nothing hidden (".", ".." included) */
    if (!cJSON_IsString(name) || !name->valuestring[0] || name->valuestring[0] == '.' || strchr(name->valuestring, '/'))
        return ds4_fail(DS4_ERR_FORMAT, "%s: files[%d]: key file: expected the name of a file in this folder", index, i);
    if (!json_i64(cJSON_GetObjectItemCaseSensitive(f, "elements"), &elements))
        return ds4_fail(DS4_ERR_FORMAT, "%s: files[%d] (%s): key elements: expected an integer in [0, 2^53]", index, i,
                        name->valuestring);
    if (!cJSON_IsArray(rs))
        return ds4_fail(DS4_ERR_FORMAT, "%s: files[%d] (%s): key ranges: expected an array", index, i, name->valuestring);
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", s->dir, name->valuestring);
    DS4_TRY(ds4_st_open(path, &s->files[i]));
    s->elements[i] = elements;
    for (int k = 0; k < NARRAYS; k++) {
        ds4_tensor_loc *loc = &s->locs[NARRAYS * i + k];
        if (k >= NREQUIRED && !ds4_st_find(s->files[i], k_arrays[k])) continue;
        DS4_TRY(ds4_st_locate(s->files[i], k_arrays[k], loc));
        if (loc->entry->dtype != DS4_F32)
            return ds4_fail(DS4_ERR_FORMAT, "%s: tensor %s: expected F32, got %s", path, k_arrays[k],
                            ds4_dtype_name(loc->entry->dtype));
        /* an optimizer array may hold its group's elements alone (checked against the groups on load) */
        if (k == 0 || loc->ndim != 1 || loc->shape[0] > elements) DS4_TRY(ds4_tensor_loc_check_shape(loc, 1, &elements));
    }
    const int64_t nr = cJSON_GetArraySize(rs);
    if (!ds4_grow((void **)&s->ranges, &s->cap, s->nranges + nr, sizeof(src_range)))
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory reading the index", index);
    const cJSON *r;
    int64_t j = 0;
    cJSON_ArrayForEach(r, rs) {
        src_range x = {.file = i};
        /* each value <= 2^53, so foff + len cannot overflow */
        if (!cJSON_IsArray(r) || cJSON_GetArraySize(r) != 3 || !json_i64(cJSON_GetArrayItem(r, 0), &x.poff) ||
            !json_i64(cJSON_GetArrayItem(r, 1), &x.foff) || !json_i64(cJSON_GetArrayItem(r, 2), &x.len) ||
            x.foff + x.len > elements)
            return ds4_fail(DS4_ERR_FORMAT,
                            "%s: files[%d] (%s): key ranges[%lld]: expected [packed offset, offset, length] "
                            "of non-negative integers with offset + length <= elements = %lld",
                            index, i, name->valuestring, (long long)j, (long long)elements);
        if (x.len > 0) s->ranges[s->nranges++] = x; /* an empty range holds nothing (and would confuse the search) */
        j++;
    }
    return DS4_OK;
}

/* The ranges of all files, sorted, tile [0, n) exactly: no gap, no overlap. */
static ds4_status check_tiling(const ds4_ckpt_shards *s, const char *index, int64_t n) {
    int64_t at = 0;
    for (int64_t i = 0; i < s->nranges && at <= n; i++) {
        if (s->ranges[i].poff > at)
            return ds4_fail(DS4_ERR_FORMAT, "%s: key ranges: packed elements [%lld, %lld) are in no file", index,
                            (long long)at, (long long)s->ranges[i].poff);
        if (s->ranges[i].poff < at) /* at > 0 here, so there is a range before */
            return ds4_fail(DS4_ERR_FORMAT, "%s: key ranges: packed element %lld is in files[%d] and files[%d]", index,
                            (long long)s->ranges[i].poff, s->ranges[i - 1].file, s->ranges[i].file);
        at += s->ranges[i].len;
    }
    if (at != n)
        return ds4_fail(DS4_ERR_FORMAT, "%s: key ranges: the files hold %lld packed elements, packed_numel is %lld", index,
                        (long long)at, (long long)n);
    return DS4_OK;
}

static ds4_status parse_index(ds4_ckpt_shards *s, const char *index, const cJSON *j, int64_t n) {
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(j, "format");
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(j, "files");
    int64_t packed;
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, INDEX_FORMAT) != 0)
        return ds4_fail(DS4_ERR_FORMAT, "%s: key format: expected \"" INDEX_FORMAT "\"", index);
    if (!json_i64(cJSON_GetObjectItemCaseSensitive(j, "packed_numel"), &packed))
        return ds4_fail(DS4_ERR_FORMAT, "%s: key packed_numel: expected a non-negative integer", index);
    if (n >= 0 && packed != n)
        return ds4_fail(DS4_ERR_SHAPE, "%s: packed_numel = %lld, but this model has %lld float parameters", index,
                        (long long)packed, (long long)n);
    if (!cJSON_IsArray(files) || cJSON_GetArraySize(files) < 1)
        return ds4_fail(DS4_ERR_FORMAT, "%s: key files: expected a non-empty array", index);
    int64_t world;
    if (!json_i64(cJSON_GetObjectItemCaseSensitive(j, "world"), &world) || world != cJSON_GetArraySize(files))
        return ds4_fail(DS4_ERR_FORMAT, "%s: key world: expected the number of files (%d), one per rank", index,
                        cJSON_GetArraySize(files));
    s->nfiles = cJSON_GetArraySize(files);
    s->packed = packed;
    s->files = ds4_calloc(DS4_MEM_OTHER, (size_t)s->nfiles * sizeof *s->files);
    s->locs = ds4_calloc(DS4_MEM_OTHER, (size_t)s->nfiles * NARRAYS * sizeof *s->locs);
    s->elements = ds4_calloc(DS4_MEM_OTHER, (size_t)s->nfiles * sizeof *s->elements);
    if (!s->files || !s->locs || !s->elements) return ds4_fail(DS4_ERR_OOM, "%s: out of memory opening the files", index);
    for (int i = 0; i < s->nfiles; i++) DS4_TRY(open_file(s, index, i, cJSON_GetArrayItem(files, i)));
    if (s->nranges > 1) qsort(s->ranges, (size_t)s->nranges, sizeof *s->ranges, cmp_range);
    return check_tiling(s, index, packed);
}

/* adamw.step, from the first file (every rank writes the same). */
static ds4_status read_step(ds4_ckpt_shards *s) {
    int64_t one = 1;
    DS4_TRY(ds4_st_read_i64(s->files[0], "adamw.step", 1, &one, &s->step));
    if (s->step >= 0 && s->step <= 999999999999999LL) return DS4_OK;
    return ds4_fail(DS4_ERR_FORMAT, "%s: tensor adamw.step = %lld: expected an integer in [0, 10^15)",
                    ds4_st_path(s->files[0]), (long long)s->step);
}

ds4_status ds4_ckpt_shards_open(const char *path, int64_t packed_numel, ds4_ckpt_shards **out) {
    *out = NULL;
    ds4_ckpt_shards *s = ds4_calloc(DS4_MEM_OTHER, sizeof *s);
    if (!s) return ds4_fail(DS4_ERR_OOM, "%s: out of memory opening the checkpoint", path);
    snprintf(s->dir, sizeof s->dir, "%s", path);
    char index[4200], *txt = NULL;
    size_t len;
    snprintf(index, sizeof index, "%s/" DS4_CKPT_INDEX, path);
    ds4_status st = ds4_read_file(index, &txt, &len);
    cJSON *j = NULL;
    if (st == DS4_OK) {
        const int64_t oom = ds4_alloc_failures();
        j = cJSON_ParseWithLength(txt, len);
        if (!j) st = ds4_alloc_failures() != oom ? ds4_fail(DS4_ERR_OOM, "%s: out of memory parsing the JSON", index)
                                                 : ds4_fail(DS4_ERR_FORMAT, "%s: not valid JSON", index);
    }
    ds4_free(txt);
    if (st == DS4_OK) st = parse_index(s, index, j, packed_numel);
    cJSON_Delete(j);
    if (st == DS4_OK) st = read_step(s);
    if (st != DS4_OK) {
        ds4_ckpt_shards_close(s);
        return st;
    }
    *out = s;
    return DS4_OK;
}

void ds4_ckpt_shards_close(ds4_ckpt_shards *s) {
    if (!s) return;
    for (int i = 0; s->files && i < s->nfiles; i++) ds4_st_close(s->files[i]);
    ds4_free(s->files);
    ds4_free(s->locs);
    ds4_free(s->elements);
    ds4_free(s->ranges);
    ds4_free(s);
}

int64_t ds4_ckpt_shards_step(const ds4_ckpt_shards *s) { return s->step; }
const char *ds4_ckpt_shards_first_file(const ds4_ckpt_shards *s) { return ds4_st_path(s->files[0]); }

int ds4_ckpt_shards_nfiles(const ds4_ckpt_shards *s) { return s->nfiles; }
const ds4_st_file *ds4_ckpt_shards_file(const ds4_ckpt_shards *s, int i) { return s->files[i]; }
int64_t ds4_ckpt_shards_elements(const ds4_ckpt_shards *s, int i) { return s->elements[i]; }
int64_t ds4_ckpt_shards_packed_numel(const ds4_ckpt_shards *s) { return s->packed; }
int64_t ds4_ckpt_shards_nranges(const ds4_ckpt_shards *s) { return s->nranges; }
ds4_ckpt_range ds4_ckpt_shards_range(const ds4_ckpt_shards *s, int64_t i) {
    const src_range *r = &s->ranges[i];
    return (ds4_ckpt_range){.file = r->file, .poff = r->poff, .foff = r->foff, .len = r->len};
}

void ds4_ckpt_shards_select(ds4_ckpt_shards *s, ds4_ckpt_array which) { s->which = (int)which; }

ds4_status ds4_ckpt_shards_select_name(ds4_ckpt_shards *s, const char *name) {
    for (int k = 0; k < NARRAYS; k++) {
        if (strcmp(name, k_arrays[k]) != 0) continue;
        for (int i = 0; i < s->nfiles; i++)
            if (!s->locs[NARRAYS * i + k].entry)
                return ds4_fail(DS4_ERR_MISSING, "%s: tensor %s not found", ds4_st_path(s->files[i]), name);
        s->which = k;
        return DS4_OK;
    }
    return ds4_fail(DS4_ERR_ARG, "per-rank checkpoint %s: no array named %s", s->dir, name);
}

bool ds4_ckpt_shards_has(const ds4_ckpt_shards *s, const char *name) {
    for (int k = 0; k < NARRAYS; k++)
        if (!strcmp(name, k_arrays[k])) return s->locs[k].entry != NULL; /* as in the first file */
    return false;
}

ds4_status ds4_ckpt_shards_read(void *ctx, int64_t off, int64_t n, float *dst) {
    ds4_ckpt_shards *s = ctx;
    int64_t lo = 0, hi = s->nranges - 1; /* the last range starting at or before off */
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (s->ranges[mid].poff <= off) lo = mid;
        else hi = mid - 1;
    }
    for (int64_t i = lo; n > 0; i++) {
        if (i >= s->nranges || off < s->ranges[i].poff || off >= s->ranges[i].poff + s->ranges[i].len)
            return ds4_fail(DS4_ERR_ARG, "%s: packed element %lld is in no file", s->dir, (long long)off);
        const src_range *r = &s->ranges[i];
        int64_t take = r->poff + r->len - off < n ? r->poff + r->len - off : n, at = r->foff + (off - r->poff);
        const ds4_tensor_loc *loc = &s->locs[NARRAYS * r->file + s->which];
        DS4_TRY(ds4_tensor_loc_read_rows(loc, at, at + take, dst));
        ds4_tensor_loc_release_rows(loc, at, at + take); /* the pages read go back */
        off += take, n -= take, dst += take;
    }
    return DS4_OK;
}

/* The integer tables and carried tensors of m from the first file (all of the floats come from reads). */
ds4_status ds4_ckpt_shards_load_tables(const ds4_ckpt_shards *s, ds4_model *m) {
    const char *first = strrchr(ds4_ckpt_shards_first_file(s), '/');
    const char *names[1] = {first ? first + 1 : ds4_ckpt_shards_first_file(s)};
    ds4_model_dir *d;
    DS4_TRY(ds4_model_dir_open_shards(s->dir, names, 1, &d));
    ds4_status st = DS4_OK;
    for (int64_t i = 0; st == DS4_OK && i < ds4_model_nparams(m); i++)
        if (!ds4_param_in_flat(ds4_model_param(m, i))) st = ds4_model_load_param(m, d, i);
    ds4_model_dir_close(d);
    return st;
}

ds4_status ds4_checkpoint_load_model(const char *path, ds4_model *m) {
    if (!ds4_checkpoint_is_per_rank(path)) {
        ds4_model_dir *d;
        DS4_TRY(ds4_model_dir_open(path, &d));
        ds4_status st = ds4_model_load(m, d);
        ds4_model_dir_close(d);
        return st;
    }
    ds4_ckpt_shards *s;
    DS4_TRY(ds4_ckpt_shards_open(path, ds4_model_numel(m), &s));
    ds4_ckpt_shards_select(s, DS4_CKPT_PARAMS);
    ds4_status st = ds4_ckpt_shards_read(s, 0, ds4_model_numel(m), ds4_model_params_flat(m));
    if (st == DS4_OK) st = ds4_ckpt_shards_load_tables(s, m);
    ds4_ckpt_shards_close(s);
    return st;
}
