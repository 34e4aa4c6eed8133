/* ds4 convert / ds4 export: rewrite a model directory as BF16 or F32, official or HF names (and the
 * config.json keys in DeepSeek's or the transformers spelling to match).
 *
 * Plan, then stream:
 *   1. sources: every stored tensor of the input as logical tensors under official names (scale
 *      siblings folded into their weights, fused HF experts split into one source per expert part);
 *   2. outputs: sources renamed to the target layout; in the HF layout the 2E parts w1/w3 of a layer
 *      fuse into gate_up_proj [E, 2I, D] and the E parts w2 into down_proj [E, D, I];
 *   3. shards: an output lives in the input shard of its first source (same file name);
 *   4. each shard is declared to the streaming writer and filled chunk by chunk (at most CHUNK
 *      values in memory), the input pages of each chunk dropped once written; then committed.
 * Per-shard resume: OUT/.ds4-convert-progress.json records the shards completed with the options
 * and the source file's size and mtime; such a shard is kept if its header matches the plan. The file
 * is removed once the directory is complete (config.json written). */
#include "ds4/io.h"
#include "ds4/tensors.h"
#include "ds4/tokenizer.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHUNK ((int64_t)1 << 22)          /* values per read/convert/write chunk (16 MB of f32) */
#define TILE ((int64_t)1 << 15)           /* values per dequantize+round tile (stays in cache) */
#define RAW_CHUNK ((uint64_t)64 << 20)    /* bytes per chunk of a verbatim copy */
#define PROGRESS_FILE ".ds4-convert-progress.json"

typedef struct {
    ds4_tensor_loc loc;   /* loc.name: the official name */
    int64_t home;         /* input shard index */
    int64_t out;          /* output index */
    int64_t key;          /* position inside a fused output: expert * nparts + part */
} source;

typedef struct {
    char name[192];
    ds4_dtype dtype;
    int ndim;
    int64_t shape[DS4_MAX_DIMS];
    bool raw;             /* copied verbatim (non-float tensors) */
    int fused;            /* parts per expert of a fused HF output, else 0 */
    int64_t home;
    int64_t first, n;     /* its sources: order[first .. first + n) */
    uint64_t bytes;
} output;

typedef struct {
    ds4_model_dir *d;
    const ds4_convert_opts *o;
    source *src;
    int64_t nsrc, capsrc;
    output *out;
    int64_t nout, capout;
    int64_t *order;       /* source indices grouped by output */
    int64_t *slots;       /* name -> output index + 1, open addressing */
    int64_t cap;
} plan;

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* A `.scale` / `_scale_inv` tensor whose weight is FP8 or packed FP4: folded into that weight. */
static bool is_scale_sibling(const ds4_model_dir *d, const char *name) {
    char base[256];
    const ds4_st_entry *e = NULL;
    size_t n = strlen(name);
    if (n >= sizeof base) return false;
    if (ends_with(name, ".scale")) {
        snprintf(base, sizeof base, "%.*s.weight", (int)(n - 6), name);
        if (!ds4_model_dir_find(d, base, &e)) {
            snprintf(base, sizeof base, "%.*s", (int)(n - 6), name);
            ds4_model_dir_find(d, base, &e);
        }
    } else if (ends_with(name, "_scale_inv")) {
        snprintf(base, sizeof base, "%.*s", (int)(n - 10), name);
        ds4_model_dir_find(d, base, &e);
    }
    return e && (e->dtype == DS4_F8_E4M3 || e->dtype == DS4_I8);
}

/* ---------------------------------------------------------------- plan: sources */

static ds4_status add_source(plan *p, const char *official, int64_t home, const char *stored) {
    const char *dp = ds4_model_dir_path(p->d);
    /* the same logical tensor under both names would be converted twice */
    if (strcmp(official, stored) != 0 && ds4_model_dir_find(p->d, official, NULL))
        return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s' is stored under both its official name and its Hugging Face name '%s'", dp,
                        official, stored);
    if (p->nsrc == p->capsrc) {
        int64_t cap = p->capsrc ? 2 * p->capsrc : 1024;
        source *ns = ds4_alloc(DS4_MEM_OTHER, (size_t)cap * sizeof *ns);
        if (!ns) return ds4_fail(DS4_ERR_OOM, "%s: out of memory planning the conversion", dp);
        if (p->nsrc) memcpy(ns, p->src, (size_t)p->nsrc * sizeof *ns);
        ds4_free(p->src);
        p->src = ns;
        p->capsrc = cap;
    }
    source *s = &p->src[p->nsrc];
    DS4_TRY(ds4_model_dir_locate(p->d, official, &s->loc));
    s->home = home;
    s->out = -1;
    s->key = 0;
    p->nsrc++;
    return DS4_OK;
}

static ds4_status collect_sources(plan *p) {
    for (int64_t fi = 0; fi < ds4_model_dir_nfiles(p->d); fi++) {
        const ds4_st_file *f = ds4_model_dir_file(p->d, fi);
        for (int64_t i = 0; i < ds4_st_count(f); i++) {
            const ds4_st_entry *e = ds4_st_entry_at(f, i);
            if (is_scale_sibling(p->d, e->name)) continue;
            char off[192];
            int parts = ds4_name_hf_fused_parts(e->name);
            if (parts > 0) {
                if (e->ndim != 3)
                    return ds4_fail(DS4_ERR_SHAPE, "%s: fused expert tensor '%s' has %d dims, expected [E, rows, cols]", ds4_st_path(f),
                                    e->name, e->ndim);
                for (int64_t x = 0; x < e->shape[0]; x++)
                    for (int k = 0; k < parts; k++) {
                        ds4_name_hf_fused_part(e->name, x, k, off, sizeof off);
                        DS4_TRY(add_source(p, off, fi, e->name));
                    }
                continue;
            }
            if (!ds4_name_from_hf(e->name, off, sizeof off) && !ds4_name_from_hf_saved(e->name, off, sizeof off))
                snprintf(off, sizeof off, "%s", e->name);
            DS4_TRY(add_source(p, off, fi, e->name));
        }
    }
    return DS4_OK;
}

/* ---------------------------------------------------------------- plan: outputs */

/* Tensors DeepSeek's checkpoint and Hugging Face keep in F32 whatever the weights' dtype: the mHC
 * mixing parameters (fn, base, scale of every hyper-connection, the heads' included), the attention
 * sinks, the compressors' positional bias `ape` and the router bias (f32 = 1 in ds4/tensors.h). They
 * stay F32 (bit-exact) in a BF16 output: bf16 would move them by up to 4e-3 relative. Matched on the
 * official name: the whole name or its part after a dot. */
#define F32_NAME(field, nd, a, b, official, hf, rule, f32) f32 ? official : NULL,
static const char *const k_f32_names[] = {
    DS4_BLOCK_TENSORS(F32_NAME) DS4_COMPRESSOR_TENSORS(F32_NAME) DS4_ROUTER_BIAS_TENSORS(F32_NAME)
    DS4_HEAD_TENSORS(F32_NAME) DS4_MTP_TENSORS(F32_NAME)};

static bool keeps_f32(const char *official) {
    size_t n = strlen(official);
    for (size_t i = 0; i < sizeof k_f32_names / sizeof k_f32_names[0]; i++) {
        const char *k = k_f32_names[i];
        size_t m = k ? strlen(k) : 0;
        if (k && n >= m && strcmp(official + n - m, k) == 0 && (n == m || official[n - m - 1] == '.')) return true;
    }
    return false;
}

static int64_t find_output(const plan *p, const char *name, uint64_t *slot) {
    uint64_t mask = (uint64_t)p->cap - 1, h = name_hash(name) & mask;
    for (;; h = (h + 1) & mask) {
        if (p->slots[h] == 0 || strcmp(p->out[p->slots[h] - 1].name, name) == 0) break;
    }
    *slot = h;
    return p->slots[h] - 1;
}

static ds4_status new_output(plan *p, const char *name, uint64_t slot, int64_t *idx) {
    if (p->nout == p->capout) {
        int64_t cap = p->capout ? 2 * p->capout : 1024;
        output *no = ds4_alloc(DS4_MEM_OTHER, (size_t)cap * sizeof *no);
        if (!no) return ds4_fail(DS4_ERR_OOM, "out of memory planning the conversion");
        if (p->nout) memcpy(no, p->out, (size_t)p->nout * sizeof *no);
        ds4_free(p->out);
        p->out = no;
        p->capout = cap;
    }
    output *o = &p->out[p->nout];
    memset(o, 0, sizeof *o);
    snprintf(o->name, sizeof o->name, "%s", name);
    p->slots[slot] = p->nout + 1;
    *idx = p->nout++;
    return DS4_OK;
}

static int cmp_key(const void *a, const void *b, void *ctx) {
    const source *s = ctx;
    int64_t x = s[*(const int64_t *)a].key, y = s[*(const int64_t *)b].key;
    return x < y ? -1 : x > y;
}

/* A fused output's parts must be experts 0..E-1 x parts 0..P-1, all of one shape. */
static ds4_status finish_fused(plan *p, output *o) {
    const int64_t *ord = p->order + o->first;
    const ds4_tensor_loc *l0 = &p->src[ord[0]].loc;
    for (int64_t k = 0; k < o->n; k++) {
        const ds4_tensor_loc *l = &p->src[ord[k]].loc;
        if (p->src[ord[k]].key != k)
            return ds4_fail(DS4_ERR_MISSING, "%s: fused output '%s' lacks part %" PRId64 " (expert %" PRId64 ", %s) before '%s'",
                            ds4_model_dir_path(p->d), o->name, k, k / o->fused, o->fused == 1 ? "w2" : k % 2 ? "w3" : "w1", l->name);
        if (l->ndim != 2 || l->shape[0] != l0->shape[0] || l->shape[1] != l0->shape[1]) {
            char a[128], b[128];
            return ds4_fail(DS4_ERR_SHAPE, "%s: expert tensor '%s' has shape %s, but '%s' has %s; they cannot fuse into '%s'",
                            ds4_model_dir_path(p->d), l->name, ds4_dims_str(l->ndim, l->shape, a, sizeof a), l0->name,
                            ds4_dims_str(l0->ndim, l0->shape, b, sizeof b), o->name);
        }
    }
    if (o->n % o->fused != 0)
        return ds4_fail(DS4_ERR_MISSING, "%s: fused output '%s': expert %" PRId64 " is incomplete", ds4_model_dir_path(p->d), o->name,
                        o->n / o->fused);
    o->ndim = 3;
    o->shape[0] = o->n / o->fused;
    o->shape[1] = o->fused * l0->shape[0];
    o->shape[2] = l0->shape[1];
    o->home = p->src[ord[0]].home;
    return DS4_OK;
}

static ds4_status build_outputs(plan *p) {
    int64_t cap = 16;
    while (cap < 2 * p->nsrc) cap *= 2;
    p->cap = cap;
    p->slots = ds4_calloc(DS4_MEM_OTHER, (size_t)cap * sizeof(int64_t));
    p->order = ds4_alloc(DS4_MEM_OTHER, (size_t)(p->nsrc ? p->nsrc : 1) * sizeof(int64_t));
    if (!p->slots || !p->order) return ds4_fail(DS4_ERR_OOM, "out of memory planning the conversion");
    for (int64_t i = 0; i < p->nsrc; i++) {
        source *s = &p->src[i];
        char name[192];
        int fused = 0;
        ds4_hf_ref ref;
        if (p->o->hf_names && ds4_name_to_hf(s->loc.name, &ref)) {
            snprintf(name, sizeof name, "%s", ref.name);
            if (ref.expert >= 0) fused = ref.nparts, s->key = ref.expert * ref.nparts + ref.part;
        } else snprintf(name, sizeof name, "%s", s->loc.name);
        uint64_t slot;
        int64_t oi = find_output(p, name, &slot);
        if (oi >= 0 && (!fused || p->out[oi].fused != fused))
            return ds4_fail(DS4_ERR_FORMAT, "%s: two tensors map to the output name '%s' (the second is '%s')", ds4_model_dir_path(p->d),
                            name, s->loc.name);
        if (oi < 0) {
            DS4_TRY(new_output(p, name, slot, &oi));
            output *o = &p->out[oi];
            o->fused = fused;
            o->home = s->home;
            o->raw = !ds4_tensor_loc_is_float(&s->loc);
            o->dtype = o->raw ? s->loc.entry->dtype : !fused && keeps_f32(s->loc.name) ? DS4_F32 : p->o->dtype;
            o->ndim = s->loc.ndim;
            for (int d = 0; d < o->ndim; d++) o->shape[d] = s->loc.shape[d];
        }
        s->out = oi;
        p->out[oi].n++;
    }
    /* group sources by output (stable), then order each fused group by expert and part */
    int64_t at = 0;
    for (int64_t oi = 0; oi < p->nout; oi++) {
        p->out[oi].first = at;
        at += p->out[oi].n;
        p->out[oi].n = 0;
    }
    for (int64_t i = 0; i < p->nsrc; i++) {
        output *o = &p->out[p->src[i].out];
        p->order[o->first + o->n++] = i;
    }
    for (int64_t oi = 0; oi < p->nout; oi++) {
        output *o = &p->out[oi];
        if (o->fused) {
            qsort_r(p->order + o->first, (size_t)o->n, sizeof(int64_t), cmp_key, p->src);
            DS4_TRY(finish_fused(p, o));
        }
        uint64_t numel = 1;
        for (int d = 0; d < o->ndim; d++) numel *= (uint64_t)o->shape[d];
        o->bytes = numel * ds4_dtype_size(o->dtype);
    }
    return DS4_OK;
}

static void plan_free(plan *p) {
    ds4_free(p->src);
    ds4_free(p->out);
    ds4_free(p->order);
    ds4_free(p->slots);
    ds4_model_dir_close(p->d);
}

/* ---------------------------------------------------------------- progress bar */

typedef struct {
    bool on, tty;   /* not a terminal (a log): only the final line */
    double t0, last;
    int64_t tensors, tensors_total;
    uint64_t bytes, bytes_total;
} progress;

static void progress_show(progress *pg, bool final) {
    if (!pg->on || (!pg->tty && !final)) return;
    double now = ds4_now();
    if (!final && now - pg->last < 0.2) return;
    pg->last = now;
    double frac = pg->bytes_total ? (double)pg->bytes / (double)pg->bytes_total : 1.0;
    char bar[31];
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '=' : i == fill ? '>' : ' ';
    bar[30] = '\0';
    double dt = now - pg->t0;
    fprintf(stderr, "%sconvert [%s] %3d%%  %" PRId64 "/%" PRId64 " tensors  %.2f/%.2f GB  %.0f MB/s ", pg->tty ? "\r" : "", bar, (int)(frac * 100),
            pg->tensors, pg->tensors_total, (double)pg->bytes / 1e9, (double)pg->bytes_total / 1e9,
            dt > 0 ? (double)pg->bytes / 1e6 / dt : 0.0);
    if (final || !pg->tty) fputc('\n', stderr);
}

/* ---------------------------------------------------------------- writing */

/* ds4_f32_to_bf16 (round to nearest even, NaN stays a quiet NaN), inlined here because the chunk
 * loop runs it over every value of the checkpoint; test_convert checks the two agree bitwise. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);   /* a select: the loop vectorizes */
}

typedef struct {
    float *f;
    uint16_t *h;
    int64_t cap;   /* values */
} buffers;

static ds4_status grow(buffers *b, int64_t n) {
    if (n <= b->cap) return DS4_OK;
    ds4_free(b->f);
    ds4_free(b->h);
    b->f = ds4_alloc(DS4_MEM_WORK, (size_t)n * sizeof(float));
    b->h = ds4_alloc(DS4_MEM_WORK, (size_t)n * sizeof(uint16_t));
    b->cap = b->f && b->h ? n : 0;
    return b->cap ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory for a %" PRId64 "-value conversion chunk", n);
}

/* Rows [r0, r1) of l as BF16 into b->h. Each thread dequantizes a cache-sized tile of rows into
 * its part of b->f and rounds it at once (one pass over memory instead of two); tiles are
 * independent, so the result does not depend on the thread count. */
static ds4_status read_bf16(const ds4_tensor_loc *l, int64_t r0, int64_t r1, buffers *b) {
    int64_t C = l->cols, tile = TILE / C > 0 ? TILE / C : 1, ntiles = (r1 - r0 + tile - 1) / tile;
    int64_t failed = -1;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        int64_t a = r0 + t * tile, e = a + tile < r1 ? a + tile : r1;
        float *f = b->f + (a - r0) * C;
        uint16_t *h = b->h + (a - r0) * C;
        if (ds4_tensor_loc_read_rows(l, a, e, f) != DS4_OK) {
            #pragma omp critical
            if (failed < 0 || t < failed) failed = t;
            continue;
        }
        for (int64_t i = 0; i < (e - a) * C; i++) h[i] = to_bf16(f[i]);
    }
    if (failed < 0) return DS4_OK;
    /* the message was set on a worker thread: read the failing tile again here for it */
    int64_t a = r0 + failed * tile;
    return ds4_tensor_loc_read_rows(l, a, a + tile < r1 ? a + tile : r1, b->f);
}

static ds4_status write_source(ds4_st_writer *w, const source *s, const output *o, buffers *b, progress *pg,
                               uint64_t *bytes_in) {
    const ds4_tensor_loc *l = &s->loc;
    if (o->raw) {
        const uint8_t *src = ds4_st_bytes(l->file, l->entry);
        uint64_t n = l->entry->end - l->entry->begin;
        for (uint64_t at = 0; at < n; at += RAW_CHUNK) {
            uint64_t k = n - at < RAW_CHUNK ? n - at : RAW_CHUNK;
            DS4_TRY(ds4_st_writer_put(w, src + at, (size_t)k));
            ds4_st_release(l->file, l->entry->begin + at, l->entry->begin + at + k);
            pg->bytes += k;
            progress_show(pg, false);
        }
        *bytes_in += n;
        return DS4_OK;
    }
    int64_t C = l->cols, chunk = C > 0 ? CHUNK / C : l->rows;
    if (chunk < 1) chunk = 1;
    if (chunk > l->rows) chunk = l->rows;
    DS4_TRY(grow(b, chunk * C));
    for (int64_t r = 0; r < l->rows; r += chunk) {
        int64_t r1 = r + chunk < l->rows ? r + chunk : l->rows, n = (r1 - r) * C;
        if (o->dtype == DS4_BF16) {
            DS4_TRY(read_bf16(l, r, r1, b));
            DS4_TRY(ds4_st_writer_put(w, b->h, (size_t)n * 2));
        } else {
            DS4_TRY(ds4_tensor_loc_read_rows(l, r, r1, b->f));
            DS4_TRY(ds4_st_writer_put(w, b->f, (size_t)n * 4));
        }
        ds4_tensor_loc_release_rows(l, r, r1);
        pg->bytes += (uint64_t)n * ds4_dtype_size(o->dtype);
        progress_show(pg, false);
    }
    ds4_tensor_loc_release(l);
    *bytes_in += ds4_tensor_loc_bytes(l);
    return DS4_OK;
}

/* Outputs of one shard in file order: larger element sizes first (natural alignment), then plan order. */
typedef struct {
    const output *o;
    int64_t seq;
} shard_item;

static int cmp_item(const void *a, const void *b) {
    const shard_item *x = a, *y = b;
    size_t sx = ds4_dtype_size(x->o->dtype), sy = ds4_dtype_size(y->o->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

static ds4_status shard_items(const plan *p, int64_t shard, shard_item **items, int64_t *n) {
    *n = 0;
    *items = ds4_alloc(DS4_MEM_OTHER, (size_t)(p->nout ? p->nout : 1) * sizeof **items);
    if (!*items) return ds4_fail(DS4_ERR_OOM, "out of memory");
    for (int64_t i = 0; i < p->nout; i++)
        if (p->out[i].home == shard) (*items)[(*n)++] = (shard_item){&p->out[i], i};
    qsort(*items, (size_t)*n, sizeof **items, cmp_item);
    return DS4_OK;
}

static ds4_status write_shard(const plan *p, const char *path, const shard_item *it, int64_t n, buffers *b, progress *pg,
                              uint64_t *bytes_in) {
    ds4_st_writer *w;
    DS4_TRY(ds4_st_writer_new(&w));
    ds4_status s = DS4_OK;
    for (int64_t i = 0; s == DS4_OK && i < n; i++) s = ds4_st_writer_declare(w, it[i].o->name, it[i].o->dtype, it[i].o->ndim, it[i].o->shape);
    if (s == DS4_OK) s = ds4_st_writer_begin(w, path);
    for (int64_t i = 0; s == DS4_OK && i < n; i++) {
        const output *o = it[i].o;
        for (int64_t k = 0; s == DS4_OK && k < o->n; k++) s = write_source(w, &p->src[p->order[o->first + k]], o, b, pg, bytes_in);
        pg->tensors++;
    }
    if (s == DS4_OK) s = ds4_st_writer_finish(w);
    ds4_st_writer_free(w);   /* removes the temp file if anything failed */
    return s;
}

/* A shard written by an earlier run holds exactly the planned tensors. */
static bool shard_matches(const char *path, const shard_item *it, int64_t n) {
    ds4_st_file *f;
    if (ds4_st_open(path, &f) != DS4_OK) return false;
    bool ok = ds4_st_count(f) == n;
    for (int64_t i = 0; ok && i < n; i++) {
        const ds4_st_entry *e = ds4_st_find(f, it[i].o->name);
        ok = e && e->dtype == it[i].o->dtype && ds4_st_check_shape(f, e, it[i].o->ndim, it[i].o->shape) == DS4_OK;
    }
    ds4_st_close(f);
    return ok;
}


/* ---------------------------------------------------------------- progress file (resume) */

static const char *names_label(const ds4_convert_opts *o) { return o->hf_names ? "hf" : "official"; }

static cJSON *progress_load(const ds4_convert_opts *o) {
    char path[4096], *text;
    size_t len;
    snprintf(path, sizeof path, "%s/%s", o->out_dir, PROGRESS_FILE);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode) || ds4_read_file(path, &text, &len) != DS4_OK) return cJSON_CreateObject();
    cJSON *r = cJSON_ParseWithLength(text, len);
    ds4_free(text);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(r, "dtype"), *nm = cJSON_GetObjectItemCaseSensitive(r, "names");
    if (!cJSON_IsObject(r) || !cJSON_IsString(dt) || strcmp(dt->valuestring, ds4_dtype_name(o->dtype)) != 0 || !cJSON_IsString(nm) ||
        strcmp(nm->valuestring, names_label(o)) != 0 || !cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(r, "shards"))) {
        cJSON_Delete(r);   /* other options or unreadable: start over */
        return cJSON_CreateObject();
    }
    return r;
}

static bool progress_done(const cJSON *pr, const char *shard, const struct stat *src, const char *out_path) {
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(pr, "shards"), shard);
    const cJSON *ss = cJSON_GetObjectItemCaseSensitive(e, "source_size"), *sz = cJSON_GetObjectItemCaseSensitive(e, "size");
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(e, "source_mtime_s"), *mn = cJSON_GetObjectItemCaseSensitive(e, "source_mtime_nsec");
    struct stat st;
    if (!cJSON_IsNumber(ss) || !cJSON_IsNumber(ms) || !cJSON_IsNumber(mn) || !cJSON_IsNumber(sz) || stat(out_path, &st) != 0) return false;
    /* every number here is an integer below 2^53, printed and read back exactly */
    return ss->valuedouble == (double)src->st_size && ms->valuedouble == (double)src->st_mtim.tv_sec &&
           mn->valuedouble == (double)src->st_mtim.tv_nsec && sz->valuedouble == (double)st.st_size;
}

static ds4_status progress_record(cJSON *pr, const ds4_convert_opts *o, const char *shard, const struct stat *src,
                                  const char *out_path) {
    cJSON_DeleteItemFromObjectCaseSensitive(pr, "dtype");
    cJSON_DeleteItemFromObjectCaseSensitive(pr, "names");
    cJSON_AddStringToObject(pr, "dtype", ds4_dtype_name(o->dtype));
    cJSON_AddStringToObject(pr, "names", names_label(o));
    cJSON *sh = cJSON_GetObjectItemCaseSensitive(pr, "shards");
    if (!sh) sh = cJSON_AddObjectToObject(pr, "shards");
    struct stat st;
    if (stat(out_path, &st) != 0) return ds4_fail(DS4_ERR_IO, "%s: cannot stat the shard just written: %s", out_path, strerror(errno));
    cJSON_DeleteItemFromObjectCaseSensitive(sh, shard);
    cJSON *e = cJSON_AddObjectToObject(sh, shard);
    cJSON_AddNumberToObject(e, "source_size", (double)src->st_size);
    cJSON_AddNumberToObject(e, "source_mtime_s", (double)src->st_mtim.tv_sec);
    cJSON_AddNumberToObject(e, "source_mtime_nsec", (double)src->st_mtim.tv_nsec);
    cJSON_AddNumberToObject(e, "size", (double)st.st_size);
    char *text = cJSON_Print(pr);
    if (!text) return ds4_fail(DS4_ERR_OOM, "out of memory writing %s", PROGRESS_FILE);
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", o->out_dir, PROGRESS_FILE);
    ds4_status s = ds4_write_file_atomic(path, text, strlen(text));
    cJSON_free(text);
    return s;
}

/* ---------------------------------------------------------------- index, config, small files */

static int cmp_out_name(const void *a, const void *b) { return strcmp((*(output *const *)a)->name, (*(output *const *)b)->name); }


static ds4_status write_index(const plan *p) {
    output **by = ds4_alloc(DS4_MEM_OTHER, (size_t)(p->nout ? p->nout : 1) * sizeof *by);
    if (!by) return ds4_fail(DS4_ERR_OOM, "out of memory");
    uint64_t total = 0;
    for (int64_t i = 0; i < p->nout; i++) by[i] = &p->out[i], total += p->out[i].bytes;
    qsort(by, (size_t)p->nout, sizeof *by, cmp_out_name);
    cJSON *root = cJSON_CreateObject();
    cJSON *meta = cJSON_AddObjectToObject(root, "metadata");
    cJSON_AddNumberToObject(meta, "total_size", (double)total);
    cJSON *wm = cJSON_AddObjectToObject(root, "weight_map");
    for (int64_t i = 0; i < p->nout; i++)
        cJSON_AddStringToObject(wm, by[i]->name, base_name(ds4_st_path(ds4_model_dir_file(p->d, by[i]->home))));
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", p->o->out_dir);
    ds4_status s = ds4_write_json_atomic(path, root);
    cJSON_Delete(root);
    ds4_free(by);
    return s;
}

/* ds4's own keys have no place in a Hugging Face config: the loss weights are training settings (the
 * TOML's training.* keys set them), and csa_dense changes the model in a way transformers cannot
 * express, so a model that needs it is not exported under HF names. */
static ds4_status drop_ds4_keys(cJSON *r, const char *path) {
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "csa_dense")))
        return ds4_fail(DS4_ERR_UNSUPPORTED, "%s: csa_dense = true (every CSA layer attends all compressed entries) has no "
                        "transformers equivalent; export with --names official", path);
    cJSON_DeleteItemFromObjectCaseSensitive(r, "mtp_loss_weight");
    cJSON_DeleteItemFromObjectCaseSensitive(r, "indexer_loss_coeff");
    cJSON_DeleteItemFromObjectCaseSensitive(r, "csa_dense");
    return DS4_OK;
}

/* The output config.json: the input's without quantization_config; expert_dtype null; the output
 * dtype as `dtype` (the transformers spelling) with HF names, `torch_dtype` with official ones;
 * the keys transformers types as float written as floats; its keys in the transformers spelling with
 * HF names (and no ds4-only keys), DeepSeek's with official ones (ds4_config_json_respell) plus
 * layer_types + compress_rates, with which transformers reads any compress ratio (it maps only 4 and
 * 128 of compress_ratios). Built before any shard is written, so a
 * config the target spelling cannot carry fails the conversion up front. */
static ds4_status make_config(const ds4_convert_opts *o, cJSON **out) {
    char in[4096], *text;
    size_t len;
    *out = NULL;
    snprintf(in, sizeof in, "%s/config.json", o->in_dir);
    DS4_TRY(ds4_check_input(in, NULL));
    DS4_TRY(ds4_read_file(in, &text, &len));
    cJSON *r = cJSON_ParseWithLength(text, len);
    ds4_free(text);
    if (!cJSON_IsObject(r)) {
        cJSON_Delete(r);
        return ds4_fail(DS4_ERR_FORMAT, "%s: not a JSON object", in);
    }
    cJSON_DeleteItemFromObjectCaseSensitive(r, "quantization_config");
    if (cJSON_GetObjectItemCaseSensitive(r, "expert_dtype")) cJSON_ReplaceItemInObjectCaseSensitive(r, "expert_dtype", cJSON_CreateNull());
    cJSON_DeleteItemFromObjectCaseSensitive(r, "torch_dtype");
    cJSON_DeleteItemFromObjectCaseSensitive(r, "dtype");
    cJSON_AddStringToObject(r, o->hf_names ? "dtype" : "torch_dtype", o->dtype == DS4_BF16 ? "bfloat16" : "float32");
    ds4_status s = ds4_config_json_respell(r, o->hf_names, in);
    if (s == DS4_OK && o->hf_names) s = drop_ds4_keys(r, in);
    bool added; /* official names: layer_types + compress_rates beside compress_ratios, for transformers */
    if (s == DS4_OK && !o->hf_names) s = ds4_config_json_add_layer_types(r, in, &added);
    ds4_config_json_floats(r);
    if (s == DS4_OK) *out = r;
    else cJSON_Delete(r);
    return s;
}

static ds4_status write_config(const ds4_convert_opts *o, cJSON *cfg) {
    char out[4096];
    snprintf(out, sizeof out, "%s/config.json", o->out_dir);
    return ds4_write_json_atomic(out, cfg);
}

/* Copies DIR/NAME to OUT/NAME when it exists. */
static ds4_status copy_if_there(const char *dir, const char *name, const char *out_dir) {
    char in[4096], out[4096], *data;
    size_t len;
    struct stat st;
    snprintf(in, sizeof in, "%s/%s", dir, name);
    snprintf(out, sizeof out, "%s/%s", out_dir, name);
    if (stat(in, &st) != 0) return DS4_OK;
    DS4_TRY(ds4_check_input(in, NULL));
    DS4_TRY(ds4_read_file(in, &data, &len));
    ds4_status s = ds4_write_file_atomic(out, data, len);
    ds4_free(data);
    return s;
}

/* The files of a Hugging Face tokenizer (the chat template is in tokenizer_config.json or a file of its own). */
static const char *const k_tokenizer_files[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                                "chat_template.jinja", "chat_template.json"};
#define N_TOKENIZER_FILES (sizeof k_tokenizer_files / sizeof k_tokenizer_files[0])

/* --tokenizer PATH (a tokenizer.json or its folder): one ds4 reads, with the files beside it; without a
 * tokenizer_config.json there, one naming its BOS and EOS. */
static ds4_status copy_tokenizer(const char *spec, const char *out_dir) {
    ds4_tokenizer *t;
    DS4_TRY(ds4_tokenizer_load(spec, &t));   /* a tokenizer ds4 trains with, or the error naming the file */
    char dir[4096];
    struct stat st;
    const bool is_dir = stat(spec, &st) == 0 && S_ISDIR(st.st_mode);
    if (is_dir) snprintf(dir, sizeof dir, "%s", spec);
    else {
        const char *slash = strrchr(spec, '/');
        snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - spec) : 1, slash ? spec : ".");
    }
    ds4_status s = DS4_OK;
    char in[4200], out[4200];
    snprintf(in, sizeof in, "%s/tokenizer_config.json", dir);
    bool have_cfg = stat(in, &st) == 0;
    for (size_t i = 1; s == DS4_OK && i < N_TOKENIZER_FILES; i++) s = copy_if_there(dir, k_tokenizer_files[i], out_dir);
    if (s == DS4_OK) { /* tokenizer.json: the file given, whatever its name */
        char *data;
        size_t len;
        snprintf(in, sizeof in, "%s%s", spec, is_dir ? "/tokenizer.json" : "");
        snprintf(out, sizeof out, "%s/tokenizer.json", out_dir);
        s = ds4_read_file(in, &data, &len);
        if (s == DS4_OK) s = ds4_write_file_atomic(out, data, len), ds4_free(data);
    }
    if (s == DS4_OK && !have_cfg) {
        cJSON *c = cJSON_CreateObject();
        size_t n;
        const char *b = ds4_tokenizer_bos(t) >= 0 ? ds4_tokenizer_token(t, ds4_tokenizer_bos(t), &n) : NULL;
        const char *e = ds4_tokenizer_eos(t) >= 0 ? ds4_tokenizer_token(t, ds4_tokenizer_eos(t), &n) : NULL;
        cJSON_AddStringToObject(c, "tokenizer_class", "PreTrainedTokenizerFast");
        if (b) cJSON_AddStringToObject(c, "bos_token", b);
        if (e) cJSON_AddStringToObject(c, "eos_token", e);
        snprintf(out, sizeof out, "%s/tokenizer_config.json", out_dir);
        s = ds4_write_json_atomic(out, c);
        cJSON_Delete(c);
    }
    ds4_tokenizer_free(t);
    return s;
}

/* Tokenizer and generation files travel with the model; nothing else (never optimizer state). The
 * tokenizer: the input folder's files, or the one o->tokenizer names ("byte": ds4's byte tokenizer,
 * "none": no tokenizer files). */
static ds4_status copy_side_files(const ds4_convert_opts *o, const cJSON *cfg) {
    DS4_TRY(copy_if_there(o->in_dir, "generation_config.json", o->out_dir));
    if (!o->tokenizer) {
        for (size_t i = 0; i < N_TOKENIZER_FILES; i++) DS4_TRY(copy_if_there(o->in_dir, k_tokenizer_files[i], o->out_dir));
        return DS4_OK;
    }
    if (!strcmp(o->tokenizer, "none")) return DS4_OK;
    if (!strcmp(o->tokenizer, "byte")) {
        const cJSON *mp = cJSON_GetObjectItemCaseSensitive(cfg, "max_position_embeddings");
        return ds4_tokenizer_byte_write_hf(o->out_dir, cJSON_IsNumber(mp) ? (int64_t)mp->valuedouble : 0);
    }
    return copy_tokenizer(o->tokenizer, o->out_dir);
}

/* The finished directory keeps no progress file (it was for resuming an unfinished one). */
static ds4_status remove_progress(const ds4_convert_opts *o) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", o->out_dir, PROGRESS_FILE);
    if (unlink(path) != 0 && errno != ENOENT) return ds4_fail(DS4_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
    return DS4_OK;
}

/* Temp files left by a killed run ("<shard>.safetensors.tmp.<pid>.<n>"). */
static void remove_stale_temps(const char *dir) {
    DIR *dh = opendir(dir);
    if (!dh) return;
    for (struct dirent *de; (de = readdir(dh));) {
        if (!strstr(de->d_name, ".safetensors.tmp.")) continue;
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        unlink(p);
    }
    closedir(dh);
}

/* ---------------------------------------------------------------- input */

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* A checkpoint folder without an index: its model*.safetensors only. */
static ds4_status open_model_shards(const char *dir, ds4_model_dir **d) {
    DIR *dh = opendir(dir);
    if (!dh) return ds4_fail(DS4_ERR_IO, "%s: cannot open directory: %s", dir, strerror(errno));
    char *names[4096];
    int64_t n = 0;
    ds4_status s = DS4_OK;
    for (struct dirent *de; (de = readdir(dh));) {
        if (strncmp(de->d_name, "model", 5) != 0 || !ends_with(de->d_name, ".safetensors")) continue;
        if (n == 4096) {
            s = ds4_fail(DS4_ERR_UNSUPPORTED, "%s: more than 4096 model shards", dir);
            break;
        }
        size_t l = strlen(de->d_name) + 1;
        if (!(names[n] = ds4_alloc(DS4_MEM_OTHER, l))) {
            s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", dir);
            break;
        }
        memcpy(names[n++], de->d_name, l);
    }
    closedir(dh);
    qsort(names, (size_t)n, sizeof *names, cmp_str);
    if (s == DS4_OK && n == 0) s = ds4_fail(DS4_ERR_MISSING, "%s: no model*.safetensors files", dir);
    for (int64_t i = 0; s == DS4_OK && i < n; i++) {
        char p[4096];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        s = ds4_check_input(p, NULL);
    }
    if (s == DS4_OK) s = ds4_model_dir_open_shards(dir, (const char *const *)names, n, d);
    for (int64_t i = 0; i < n; i++) ds4_free(names[i]);
    return s;
}

static ds4_status open_input(const ds4_convert_opts *o, ds4_model_dir **d) {
    char ip[4096];
    struct stat st;
    snprintf(ip, sizeof ip, "%s/config.json", o->in_dir);
    DS4_TRY(ds4_check_input(ip, NULL));
    snprintf(ip, sizeof ip, "%s/model.safetensors.index.json", o->in_dir);
    if (stat(ip, &st) == 0) DS4_TRY(ds4_check_input(ip, NULL));
    if (o->model_shards_only && stat(ip, &st) != 0) return open_model_shards(o->in_dir, d);
    return ds4_model_dir_open(o->in_dir, d);
}

/* ---------------------------------------------------------------- driver */

static ds4_status check_opts(const ds4_convert_opts *o) {
    if (!o->in_dir || !o->out_dir) return ds4_fail(DS4_ERR_ARG, "convert: input and output directories are required");
    if (o->dtype != DS4_BF16 && o->dtype != DS4_F32)
        return ds4_fail(DS4_ERR_ARG, "convert: output dtype %s not supported (BF16 or F32)", ds4_dtype_name(o->dtype));
    DS4_TRY(ds4_mkdirs(o->out_dir, "output folder"));
    struct stat a, b;
    if (stat(o->in_dir, &a) != 0) return ds4_fail(DS4_ERR_IO, "%s: %s", o->in_dir, strerror(errno));
    if (stat(o->out_dir, &b) != 0 || !S_ISDIR(b.st_mode)) return ds4_fail(DS4_ERR_IO, "%s: not a directory", o->out_dir);
    if (a.st_dev == b.st_dev && a.st_ino == b.st_ino)
        return ds4_fail(DS4_ERR_ARG, "convert: output directory %s is the input directory", o->out_dir);
    return DS4_OK;
}

ds4_status ds4_convert(const ds4_convert_opts *o, ds4_convert_report *rep) {
    memset(rep, 0, sizeof *rep);
    double t0 = ds4_now();
    DS4_TRY(check_opts(o));
    plan p = {.o = o};
    DS4_TRY(open_input(o, &p.d));
    cJSON *cfg = NULL;
    ds4_status s = make_config(o, &cfg);
    if (s == DS4_OK) s = collect_sources(&p);
    if (s == DS4_OK) s = build_outputs(&p);
    int64_t nf = ds4_model_dir_nfiles(p.d);
    rep->shards = nf;
    cJSON *pr = s == DS4_OK ? progress_load(o) : NULL;
    if (s == DS4_OK && !pr) s = ds4_fail(DS4_ERR_OOM, "out of memory");
    if (s == DS4_OK) remove_stale_temps(o->out_dir);

    /* which shards need writing, and how much that is (for the progress bar) */
    bool *todo = s == DS4_OK ? ds4_calloc(DS4_MEM_OTHER, (size_t)(nf ? nf : 1)) : NULL;
    struct stat *sst = s == DS4_OK ? ds4_calloc(DS4_MEM_OTHER, (size_t)(nf ? nf : 1) * sizeof *sst) : NULL;
    if (s == DS4_OK && (!todo || !sst)) s = ds4_fail(DS4_ERR_OOM, "out of memory");
    progress pg = {.on = o->progress, .tty = isatty(2) == 1, .t0 = ds4_now()};
    for (int64_t i = 0; s == DS4_OK && i < nf; i++) {
        const char *sp = ds4_st_path(ds4_model_dir_file(p.d, i));
        char op[4096];
        snprintf(op, sizeof op, "%s/%s", o->out_dir, base_name(sp));
        if (stat(sp, &sst[i]) != 0) s = ds4_fail(DS4_ERR_IO, "%s: %s", sp, strerror(errno));
        shard_item *it = NULL;
        int64_t n = 0;
        if (s == DS4_OK) s = shard_items(&p, i, &it, &n);
        if (s == DS4_OK) {
            todo[i] = !(progress_done(pr, base_name(sp), &sst[i], op) && shard_matches(op, it, n));
            for (int64_t k = 0; todo[i] && k < n; k++) pg.tensors_total++, pg.bytes_total += it[k].o->bytes;
        }
        ds4_free(it);
    }
    buffers buf = {0};
    for (int64_t i = 0; s == DS4_OK && i < nf; i++) {
        if (!todo[i]) {
            rep->shards_skipped++;
            continue;
        }
        const char *sp = ds4_st_path(ds4_model_dir_file(p.d, i));
        char op[4096];
        snprintf(op, sizeof op, "%s/%s", o->out_dir, base_name(sp));
        shard_item *it;
        int64_t n;
        s = shard_items(&p, i, &it, &n);
        if (s == DS4_OK) s = write_shard(&p, op, it, n, &buf, &pg, &rep->bytes_in);
        for (int64_t k = 0; s == DS4_OK && k < n; k++) rep->bytes_out += it[k].o->bytes;
        rep->tensors += s == DS4_OK ? n : 0;
        if (s == DS4_OK) s = progress_record(pr, o, base_name(sp), &sst[i], op);
        ds4_free(it);
    }
    progress_show(&pg, true);
    if (s == DS4_OK) s = write_index(&p);
    if (s == DS4_OK) s = copy_side_files(o, cfg);
    if (s == DS4_OK) s = write_config(o, cfg);   /* a config.json marks a complete directory */
    if (s == DS4_OK) s = remove_progress(o);      /* nothing of the conversion's own is left in it */
    cJSON_Delete(cfg);
    ds4_free(buf.f);
    ds4_free(buf.h);
    ds4_free(todo);
    ds4_free(sst);
    cJSON_Delete(pr);
    plan_free(&p);
    rep->seconds = ds4_now() - t0;
    return s;
}
