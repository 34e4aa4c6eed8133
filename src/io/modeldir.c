/* A model directory in the Hugging Face layout: config.json + *.safetensors shards. The shards are
 * those listed by model.safetensors.index.json ("weight_map": {tensor: file}) when it exists,
 * otherwise every *.safetensors file in the directory (sorted by name). Tensor names are unique
 * across shards and looked up through one hash table. */
#include "ds4/io.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    int32_t file;    /* index into files, -1 = empty slot */
    int32_t entry;   /* index into that file's entries */
} dir_slot;

struct ds4_model_dir {
    char *path;
    ds4_config cfg;
    bool mtp_absent;      /* the config's MTP block is not stored (transformers drops it): cfg has none */
    int64_t nfiles;
    ds4_st_file **files;
    dir_slot *slots;
    int64_t cap;
};

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = ds4_alloc(DS4_MEM_OTHER, n);
    if (p) memcpy(p, s, n);
    return p;
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static const char *slot_name(const ds4_model_dir *d, dir_slot s) {
    return ds4_st_entry_at(d->files[s.file], s.entry)->name;
}

const ds4_st_file *ds4_model_dir_find(const ds4_model_dir *d, const char *name, const ds4_st_entry **entry) {
    if (entry) *entry = NULL;
    if (!d || d->cap == 0) return NULL;
    uint64_t mask = (uint64_t)d->cap - 1;
    for (uint64_t h = name_hash(name) & mask;; h = (h + 1) & mask) {
        dir_slot s = d->slots[h];
        if (s.file < 0) return NULL;
        if (strcmp(slot_name(d, s), name) == 0) {
            if (entry) *entry = ds4_st_entry_at(d->files[s.file], s.entry);
            return d->files[s.file];
        }
    }
}

/* Adds every tensor of every shard; a name in two shards is an error naming both. */
static ds4_status build_table(ds4_model_dir *d) {
    int64_t total = 0;
    for (int64_t i = 0; i < d->nfiles; i++) total += ds4_st_count(d->files[i]);
    int64_t cap = 16;
    while (cap < 2 * total) cap *= 2;
    d->slots = ds4_alloc(DS4_MEM_OTHER, (size_t)cap * sizeof(dir_slot));
    if (!d->slots) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for %" PRId64 " tensor names", d->path, total);
    d->cap = cap;
    for (int64_t i = 0; i < cap; i++) d->slots[i] = (dir_slot){-1, -1};
    uint64_t mask = (uint64_t)cap - 1;
    for (int64_t f = 0; f < d->nfiles; f++)
        for (int64_t e = 0; e < ds4_st_count(d->files[f]); e++) {
            const char *nm = ds4_st_entry_at(d->files[f], e)->name;
            uint64_t h = name_hash(nm) & mask;
            for (; d->slots[h].file >= 0; h = (h + 1) & mask)
                if (strcmp(slot_name(d, d->slots[h]), nm) == 0)
                    return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s' is in two shards: %s and %s", d->path, nm,
                                    ds4_st_path(d->files[d->slots[h].file]), ds4_st_path(d->files[f]));
            d->slots[h] = (dir_slot){(int32_t)f, (int32_t)e};
        }
    return DS4_OK;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Shard file names, sorted and unique: from the index's weight_map, or every *.safetensors. */
static ds4_status list_shards(const char *dir, const cJSON *weight_map, char ***names_out, int64_t *n_out) {
    int64_t n = 0, cap = 16;
    char **names = ds4_alloc(DS4_MEM_OTHER, (size_t)cap * sizeof(char *));
    if (!names) return ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir);
    ds4_status s = DS4_OK;
    DIR *dh = NULL;
    const cJSON *wm = weight_map ? weight_map->child : NULL;
    if (!weight_map && !(dh = opendir(dir))) {
        ds4_free(names);
        return ds4_fail(DS4_ERR_IO, "%s: cannot open directory", dir);
    }
    for (;;) {
        const char *nm;
        if (weight_map) {
            if (!wm) break;
            nm = wm->valuestring;
            wm = wm->next;
        } else {
            struct dirent *de = readdir(dh);
            if (!de) break;
            nm = de->d_name;
            size_t l = strlen(nm);
            if (nm[0] == '.' || l <= 12 || strcmp(nm + l - 12, ".safetensors") != 0) continue;
        }
        if (n == cap) {
            char **nn = ds4_alloc(DS4_MEM_OTHER, (size_t)(2 * cap) * sizeof(char *));
            if (!nn) { s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir); break; }
            memcpy(nn, names, (size_t)n * sizeof(char *));
            ds4_free(names);
            names = nn;
            cap *= 2;
        }
        if (!(names[n] = dup_str(nm))) { s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir); break; }
        n++;
    }
    if (dh) closedir(dh);
    qsort(names, (size_t)n, sizeof(char *), cmp_str);
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        if (u > 0 && strcmp(names[u - 1], names[i]) == 0) ds4_free(names[i]);
        else names[u++] = names[i];
    }
    *names_out = names;
    *n_out = u;
    return s;
}

/* Reads model.safetensors.index.json if present: *root gets the parsed JSON (or NULL). */
static ds4_status read_index(const char *ipath, cJSON **root, const cJSON **weight_map) {
    *root = NULL;
    *weight_map = NULL;
    struct stat st;
    if (stat(ipath, &st) != 0) return DS4_OK;
    char *text;
    size_t len;
    DS4_TRY(ds4_read_file(ipath, &text, &len));
    const int64_t oom = ds4_alloc_failures(); /* cJSON says "invalid" also when it ran out of memory */
    cJSON *r = cJSON_ParseWithLength(text, len);
    ds4_free(text);
    if (!r && ds4_alloc_failures() != oom) return ds4_fail(DS4_ERR_OOM, "%s: out of memory parsing the JSON", ipath);
    if (!r) return ds4_fail(DS4_ERR_FORMAT, "%s: not valid JSON", ipath);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(r, "weight_map");
    if (!cJSON_IsObject(wm)) {
        cJSON_Delete(r);
        return ds4_fail(DS4_ERR_FORMAT, "%s: missing object \"weight_map\"", ipath);
    }
    for (const cJSON *c = wm->child; c; c = c->next) {
        /* A plain file name in this directory, never a path elsewhere. */
        if (!cJSON_IsString(c) || !c->valuestring[0] || strchr(c->valuestring, '/') || c->valuestring[0] == '.') {
            ds4_status s = ds4_fail(DS4_ERR_FORMAT, "%s: weight_map entry for tensor '%s' must be a plain file name in the directory",
                                    ipath, c->string);
            cJSON_Delete(r);
            return s;
        }
    }
    *root = r;
    *weight_map = wm;
    return DS4_OK;
}

void ds4_model_dir_close(ds4_model_dir *d) {
    if (!d) return;
    for (int64_t i = 0; i < d->nfiles; i++) ds4_st_close(d->files[i]);
    ds4_free(d->files);
    ds4_free(d->slots);
    ds4_free(d->path);
    ds4_free(d);
}

/* A folder in transformers' layout (model.layers.*) whose config declares an MTP block but that stores no
 * mtp.* tensor: transformers does not load the MTP block, so its save_pretrained writes none. The folder
 * is read as the model it holds, without MTP (ds4_model_dir_mtp_absent says so). */
static void drop_absent_mtp(ds4_model_dir *d) {
    if (d->cfg.n_mtp_layers == 0) return;
    bool hf = false;
    for (int64_t i = 0; i < d->nfiles; i++)
        for (int64_t j = 0; j < ds4_st_count(d->files[i]); j++) {
            const char *name = ds4_st_entry_at(d->files[i], j)->name;
            if (!strncmp(name, "mtp.", 4)) return;
            hf |= !strncmp(name, "model.layers.", 13);
        }
    if (!hf) return;
    d->cfg.n_mtp_layers = 0;
    d->mtp_absent = true;
}

/* Opens dir with the shards listed by its index (or all *.safetensors), or exactly `shards[nshards]`
 * when shards != NULL. */
static ds4_status open_dir(const char *dir, const char *const *shards, int64_t nshards, ds4_model_dir **out) {
    *out = NULL;
    ds4_model_dir *d = ds4_calloc(DS4_MEM_OTHER, sizeof *d);
    if (!d || !(d->path = dup_str(dir))) {
        ds4_free(d);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir);
    }
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    ds4_status s = ds4_config_load(p, &d->cfg);
    cJSON *index = NULL;
    const cJSON *wm = NULL;
    char **names = NULL;
    int64_t n = 0;
    char ipath[4096];
    snprintf(ipath, sizeof ipath, "%s/model.safetensors.index.json", dir);
    if (s == DS4_OK && !shards) s = read_index(ipath, &index, &wm);
    if (s == DS4_OK && !shards) s = list_shards(dir, wm, &names, &n);
    if (s == DS4_OK && shards) {
        names = ds4_calloc(DS4_MEM_OTHER, (size_t)(nshards ? nshards : 1) * sizeof(char *));
        if (!names) s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir);
        for (int64_t i = 0; s == DS4_OK && i < nshards; i++, n++)
            if (!(names[i] = dup_str(shards[i]))) s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir);
    }
    if (s == DS4_OK && n == 0) s = ds4_fail(DS4_ERR_MISSING, "%s: no *.safetensors files", dir);
    if (s == DS4_OK) {
        d->files = ds4_calloc(DS4_MEM_OTHER, (size_t)n * sizeof(ds4_st_file *));
        if (!d->files) s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir);
    }
    for (int64_t i = 0; s == DS4_OK && i < n; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        s = ds4_st_open(p, &d->files[i]);
        if (s == DS4_OK) d->nfiles++;
    }
    if (s == DS4_OK) s = build_table(d);
    if (s == DS4_OK) drop_absent_mtp(d);
    /* The index must tell the truth about where each tensor lives. */
    for (const cJSON *c = wm ? wm->child : NULL; s == DS4_OK && c; c = c->next) {
        const ds4_st_file *f = ds4_model_dir_find(d, c->string, NULL);
        const char *fp = f ? ds4_st_path(f) : NULL;
        const char *base = fp ? strrchr(fp, '/') + 1 : NULL;
        if (!f || strcmp(base, c->valuestring) != 0)
            s = ds4_fail(DS4_ERR_FORMAT, "%s: index lists tensor '%s' in %s, but %s", ipath, c->string, c->valuestring,
                         f ? "it is in another shard" : "no shard holds it");
    }
    for (int64_t i = 0; i < n; i++) ds4_free(names[i]);
    ds4_free(names);
    cJSON_Delete(index);
    if (s != DS4_OK) {
        ds4_model_dir_close(d);
        return s;
    }
    *out = d;
    return DS4_OK;
}

ds4_status ds4_model_dir_open(const char *dir, ds4_model_dir **out) { return open_dir(dir, NULL, 0, out); }

ds4_status ds4_model_dir_open_shards(const char *dir, const char *const *shards, int64_t n, ds4_model_dir **out) {
    return open_dir(dir, shards, n, out);
}

const ds4_config *ds4_model_dir_config(const ds4_model_dir *d) { return &d->cfg; }
bool ds4_model_dir_mtp_absent(const ds4_model_dir *d) { return d->mtp_absent; }
const char *ds4_model_dir_path(const ds4_model_dir *d) { return d->path; }
int64_t ds4_model_dir_nfiles(const ds4_model_dir *d) { return d->nfiles; }
const ds4_st_file *ds4_model_dir_file(const ds4_model_dir *d, int64_t i) {
    return i >= 0 && i < d->nfiles ? d->files[i] : NULL;
}
