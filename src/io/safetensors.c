/* safetensors reader (mmap, fully validated header) and writer (atomic).
 *
 * Layout: u64 little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ..., "__metadata__": {...}}
 * then the data section; offsets are relative to its start. */
#include "ds4/io.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER (100u * 1000u * 1000u)   /* the limit the reference implementation uses */
#define ST_MAX_INT 9007199254740992.0          /* 2^53: largest integer a JSON double holds exactly */

struct ds4_st_file {
    char *path;
    uint8_t *map;           /* whole file, read-only (or an owned copy of a memory image) */
    size_t map_len;
    bool owned;             /* map is a ds4_alloc'ed copy, not an mmap */
    const uint8_t *data;    /* start of the data section */
    uint64_t data_len;
    int64_t n;
    ds4_st_entry *entries;  /* [n], header order */
    int64_t *slots;         /* [cap] open-addressing table of entry index + 1 (0 = empty) */
    int64_t cap;
};

/* ---------------------------------------------------------------- small helpers */

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = ds4_alloc(DS4_MEM_OTHER, n);
    if (p) memcpy(p, s, n);
    return p;
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 1469598103934665603ull;   /* FNV-1a */
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

int64_t ds4_st_entry_numel(const ds4_st_entry *e) {
    int64_t n = 1;
    for (int i = 0; i < e->ndim; i++) n *= e->shape[i];
    return n;
}

/* A JSON number that is an integer in [0, 2^53]. */
static bool json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return false;
    double v = j->valuedouble;
    if (!(v >= 0.0 && v <= ST_MAX_INT) || floor(v) != v) return false;
    *out = (uint64_t)v;
    return true;
}

/* Inserts entry i into the table; returns false if its name is already present. */
static bool table_insert(ds4_st_file *f, int64_t i) {
    uint64_t mask = (uint64_t)f->cap - 1;
    for (uint64_t h = name_hash(f->entries[i].name) & mask;; h = (h + 1) & mask) {
        int64_t s = f->slots[h];
        if (s == 0) {
            f->slots[h] = i + 1;
            return true;
        }
        if (strcmp(f->entries[s - 1].name, f->entries[i].name) == 0) return false;
    }
}

const ds4_st_entry *ds4_st_find(const ds4_st_file *f, const char *name) {
    if (!f || f->cap == 0) return NULL;
    uint64_t mask = (uint64_t)f->cap - 1;
    for (uint64_t h = name_hash(name) & mask;; h = (h + 1) & mask) {
        int64_t s = f->slots[h];
        if (s == 0) return NULL;
        if (strcmp(f->entries[s - 1].name, name) == 0) return &f->entries[s - 1];
    }
}

int64_t ds4_st_count(const ds4_st_file *f) { return f->n; }
const ds4_st_entry *ds4_st_entry_at(const ds4_st_file *f, int64_t i) {
    return i >= 0 && i < f->n ? &f->entries[i] : NULL;
}
const void *ds4_st_bytes(const ds4_st_file *f, const ds4_st_entry *e) { return f->data + e->begin; }
const char *ds4_st_path(const ds4_st_file *f) { return f->path; }

void ds4_st_close(ds4_st_file *f) {
    if (!f) return;
    for (int64_t i = 0; i < f->n; i++) ds4_free(f->entries[i].name);
    ds4_free(f->entries);
    ds4_free(f->slots);
    if (f->map && f->owned) ds4_free(f->map);
    else if (f->map) munmap(f->map, f->map_len);
    ds4_free(f->path);
    ds4_free(f);
}

/* ---------------------------------------------------------------- header parsing */

/* Parses one tensor's header object into e (name already set). */
static ds4_status parse_entry(const ds4_st_file *f, const cJSON *obj, ds4_st_entry *e) {
    const char *p = f->path, *nm = e->name;
    if (!cJSON_IsObject(obj)) return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': header entry is not a JSON object", p, nm);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(obj, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(obj, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(obj, "data_offsets");
    if (!cJSON_IsString(dt)) return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': missing string \"dtype\"", p, nm);
    if (!ds4_dtype_from_name(dt->valuestring, &e->dtype))
        return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': unknown dtype \"%.40s\"", p, nm, dt->valuestring);
    if (!cJSON_IsArray(sh)) return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': missing array \"shape\"", p, nm);
    int nd = cJSON_GetArraySize(sh);
    if (nd > DS4_MAX_DIMS)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "%s: tensor '%s': %d dims, at most %d supported", p, nm, nd, DS4_MAX_DIMS);
    e->ndim = nd;
    int d = 0;
    for (const cJSON *c = sh->child; c; c = c->next, d++) {
        uint64_t v;
        if (!json_uint(c, &v))
            return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not a non-negative integer below 2^53", p, nm, d);
        e->shape[d] = (int64_t)v;
    }
    /* Zero dims included (a [0, 2^40, 2^40] tensor holds no bytes, but readers take rows x columns of
     * it): the non-zero dims times 8 bytes, the widest element a reader writes, must fit in 64 bits. */
    int64_t numel;
    char b[160];
    if (!ds4_shape_fits(nd, e->shape, 8, &numel))
        return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': shape %s is too large: its size overflows (the product of its "
                        "non-zero dims must stay below 2^60)", p, nm, ds4_dims_str(nd, e->shape, b, sizeof b));
    uint64_t bytes = (uint64_t)numel * ds4_dtype_size(e->dtype);
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 || !json_uint(off->child, &e->begin) ||
        !json_uint(off->child->next, &e->end))
        return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': \"data_offsets\" must be [begin, end] integers", p, nm);
    if (e->begin > e->end || e->end > f->data_len)
        return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] out of range (data section is %" PRIu64 " bytes)",
                        p, nm, e->begin, e->end, f->data_len);
    if (e->end - e->begin != bytes)
        return ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s': %" PRIu64 " bytes stored, but %s %s needs %" PRIu64, p, nm,
                        e->end - e->begin, ds4_dtype_name(e->dtype), ds4_dims_str(e->ndim, e->shape, (char[128]){0}, 128),
                        bytes);
    return DS4_OK;
}

/* Names and keys are UTF-8 (the safetensors format says so); other bytes are refused, not carried
 * into checkpoints, listings and messages. */
static ds4_status check_utf8(const char *path, const char *what, const char *text) {
    if (ds4_utf8_valid(text, strlen(text))) return DS4_OK;
    return ds4_fail(DS4_ERR_FORMAT, "%s: %s '%.80s' is not valid UTF-8", path, what, text);
}

static int cmp_begin(const void *a, const void *b, void *ctx) {
    const ds4_st_entry *e = ctx;
    const ds4_st_entry *x = &e[*(const int64_t *)a], *y = &e[*(const int64_t *)b];
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* Non-empty ranges must not share a byte. */
static ds4_status check_overlaps(const ds4_st_file *f) {
    int64_t *ord = ds4_alloc(DS4_MEM_OTHER, (size_t)f->n * sizeof(int64_t));
    if (!ord) return ds4_fail(DS4_ERR_OOM, "%s: out of memory", f->path);
    int64_t m = 0;
    for (int64_t i = 0; i < f->n; i++)
        if (f->entries[i].end > f->entries[i].begin) ord[m++] = i;
    qsort_r(ord, (size_t)m, sizeof(int64_t), cmp_begin, f->entries);
    ds4_status s = DS4_OK;
    for (int64_t k = 1; k < m; k++) {
        const ds4_st_entry *a = &f->entries[ord[k - 1]], *b = &f->entries[ord[k]];
        if (b->begin < a->end) {
            s = ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s' bytes [%" PRIu64 ", %" PRIu64 ") overlap tensor '%s' [%" PRIu64 ", %" PRIu64 ")",
                         f->path, b->name, b->begin, b->end, a->name, a->begin, a->end);
            break;
        }
    }
    ds4_free(ord);
    return s;
}

static ds4_status parse_header(ds4_st_file *f, const char *text, size_t len) {
    const char *p = f->path;
    if (memchr(text, '\0', len)) return ds4_fail(DS4_ERR_FORMAT, "%s: header contains a NUL byte", p);
    const char *end = NULL;
    const int64_t oom = ds4_alloc_failures(); /* cJSON says "invalid" also when it ran out of memory */
    cJSON *root = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!root && ds4_alloc_failures() != oom) return ds4_fail(DS4_ERR_OOM, "%s: out of memory parsing the header", p);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        size_t pos = at && at >= text && at <= text + len ? (size_t)(at - text) : 0;
        return ds4_fail(DS4_ERR_FORMAT, "%s: header is not valid JSON (near byte %zu)", p, pos);
    }
    ds4_status s = DS4_OK;
    for (const char *q = end; q && q < text + len; q++)
        if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') {
            s = ds4_fail(DS4_ERR_FORMAT, "%s: trailing bytes after the header JSON (byte %zu)", p, (size_t)(q - text));
            goto done;
        }
    if (!cJSON_IsObject(root)) {
        s = ds4_fail(DS4_ERR_FORMAT, "%s: header is not a JSON object", p);
        goto done;
    }
    int64_t n = 0;
    for (const cJSON *c = root->child; c; c = c->next) n++;
    f->entries = ds4_calloc(DS4_MEM_OTHER, (size_t)(n ? n : 1) * sizeof(ds4_st_entry));
    int64_t cap = 16;
    while (cap < 2 * n) cap *= 2;
    f->cap = cap;
    f->slots = ds4_calloc(DS4_MEM_OTHER, (size_t)cap * sizeof(int64_t));
    if (!f->entries || !f->slots) {
        s = ds4_fail(DS4_ERR_OOM, "%s: out of memory for %" PRId64 " header entries", p, n);
        goto done;
    }
    bool seen_meta = false;
    for (const cJSON *c = root->child; c; c = c->next) {
        if ((s = check_utf8(p, "tensor name", c->string)) != DS4_OK) goto done;
        if (strcmp(c->string, "__metadata__") == 0) {
            if (seen_meta) { s = ds4_fail(DS4_ERR_FORMAT, "%s: duplicate \"__metadata__\"", p); goto done; }
            seen_meta = true;
            if (!cJSON_IsObject(c)) { s = ds4_fail(DS4_ERR_FORMAT, "%s: \"__metadata__\" is not an object", p); goto done; }
            for (const cJSON *m = c->child; m; m = m->next) {
                if ((s = check_utf8(p, "__metadata__ key", m->string)) != DS4_OK) goto done;
                if (!cJSON_IsString(m)) {
                    s = ds4_fail(DS4_ERR_FORMAT, "%s: __metadata__ key '%s' is not a string", p, m->string);
                    goto done;
                }
                if ((s = check_utf8(p, "__metadata__ value", m->valuestring)) != DS4_OK) goto done;
            }
            continue;
        }
        ds4_st_entry *e = &f->entries[f->n];
        if (!(e->name = dup_str(c->string))) { s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", p); goto done; }
        f->n++;
        if ((s = parse_entry(f, c, e)) != DS4_OK) goto done;
        if (!table_insert(f, f->n - 1)) {
            s = ds4_fail(DS4_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", p, e->name);
            goto done;
        }
    }
    s = check_overlaps(f);
done:
    cJSON_Delete(root);
    return s;
}

/* Validates the length field and parses the header of f->map[0, map_len). */
static ds4_status st_parse(ds4_st_file *f) {
    const char *path = f->path;
    uint64_t size = f->map_len;
    if (size < 8)
        return ds4_fail(DS4_ERR_FORMAT, "%s: file is %" PRIu64 " bytes, too short for the 8-byte header length", path, size);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)f->map[i] << (8 * i);
    if (hlen > ST_MAX_HEADER)
        return ds4_fail(DS4_ERR_FORMAT, "%s: header length %" PRIu64 " exceeds the 100 MB limit", path, hlen);
    if (hlen > size - 8)
        return ds4_fail(DS4_ERR_FORMAT, "%s: header length %" PRIu64 " exceeds the file size %" PRIu64 " (truncated file?)", path,
                        hlen, size);
    if (hlen < 2) return ds4_fail(DS4_ERR_FORMAT, "%s: header length %" PRIu64 " is too short for a JSON object", path, hlen);
    f->data = f->map + 8 + hlen;
    f->data_len = size - 8 - hlen;
    /* NUL-terminated copy: the parser never reads past the mapped header. */
    char *text = ds4_alloc(DS4_MEM_OTHER, (size_t)hlen + 1);
    if (!text) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for a %" PRIu64 "-byte header", path, hlen);
    memcpy(text, f->map + 8, (size_t)hlen);
    text[hlen] = '\0';
    ds4_status s = parse_header(f, text, (size_t)hlen);
    ds4_free(text);
    return s;
}

static ds4_st_file *st_new(const char *path) {
    ds4_st_file *f = ds4_calloc(DS4_MEM_OTHER, sizeof *f);
    if (f && !(f->path = dup_str(path))) {
        ds4_free(f);
        f = NULL;
    }
    return f;
}

ds4_status ds4_st_open(const char *path, ds4_st_file **out) {
    *out = NULL;
    int fd;
    uint64_t size;
    DS4_TRY(ds4_open_input(path, NULL, &fd, &size));
    if (size < 8) {
        close(fd);
        return ds4_fail(DS4_ERR_FORMAT, "%s: file is %" PRIu64 " bytes, too short for the 8-byte header length", path, size);
    }
    ds4_st_file *f = st_new(path);
    if (!f) {
        close(fd);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    }
    void *m = mmap(NULL, (size_t)size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED) {
        ds4_st_close(f);
        return ds4_fail(DS4_ERR_IO, "%s: mmap of %" PRIu64 " bytes failed: %s", path, size, strerror(e));
    }
    f->map = m;
    f->map_len = (size_t)size;
    ds4_status s = st_parse(f);
    if (s != DS4_OK) {
        ds4_st_close(f);
        return s;
    }
    /* Read-ahead of the whole file only when it is small; a 4 GB shard is paged in as it is read. */
    if (f->map_len <= ((size_t)64 << 20)) madvise(f->map, f->map_len, MADV_WILLNEED);
    *out = f;
    return DS4_OK;
}

ds4_status ds4_st_open_memory(const void *data, size_t len, const char *name, ds4_st_file **out) {
    *out = NULL;
    ds4_st_file *f = st_new(name);
    if (!f || !(f->map = ds4_alloc(DS4_MEM_OTHER, len))) {
        ds4_st_close(f);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory for a %zu-byte image", name, len);
    }
    f->owned = true;
    f->map_len = len;
    if (len) memcpy(f->map, data, len);
    ds4_status s = st_parse(f);
    if (s != DS4_OK) {
        ds4_st_close(f);
        return s;
    }
    *out = f;
    return DS4_OK;
}

void ds4_st_release(const ds4_st_file *f, uint64_t begin, uint64_t end) {
    if (!f || f->owned || end <= begin || end > f->data_len) return;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)(f->data + begin) & ~(page - 1);
    uintptr_t b = ((uintptr_t)(f->data + end) + page - 1) & ~(page - 1);
    uintptr_t lim = ((uintptr_t)f->map + f->map_len + page - 1) & ~(page - 1);
    if (b > lim) b = lim;
    /* Read-only private mapping, never written: dropped pages are re-read from the file. */
    madvise((void *)a, (size_t)(b - a), MADV_DONTNEED);
}

/* ---------------------------------------------------------------- shapes */

ds4_status ds4_st_check_shape(const ds4_st_file *f, const ds4_st_entry *e, int ndim, const int64_t *shape) {
    bool ok = e->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = e->shape[i] == shape[i];
    if (ok) return DS4_OK;
    char got[128], want[128];
    return ds4_fail(DS4_ERR_SHAPE, "%s: tensor '%s' has shape %s, expected %s", f->path, e->name,
                    ds4_dims_str(e->ndim, e->shape, got, sizeof got), ds4_dims_str(ndim, shape, want, sizeof want));
}

/* ---------------------------------------------------------------- writer */

typedef struct {
    char *name;
    ds4_dtype dtype;
    int ndim;
    int64_t shape[DS4_MAX_DIMS];
    const void *data;   /* NULL for a declared (streamed) tensor */
    uint64_t bytes;
    int64_t order;      /* insertion index */
} st_wentry;

struct ds4_st_writer {
    st_wentry *e;
    int64_t n, cap;
    bool streaming;       /* tensors were declared: data comes through put */
    bool begun;
    ds4_atomic_file af;
    uint64_t total, done; /* data-section bytes expected / written so far */
};

ds4_status ds4_st_writer_new(ds4_st_writer **w) {
    *w = ds4_calloc(DS4_MEM_OTHER, sizeof **w);
    if (*w) (*w)->af.fd = -1;
    return *w ? DS4_OK : ds4_fail(DS4_ERR_OOM, "safetensors writer: out of memory");
}

void ds4_st_writer_free(ds4_st_writer *w) {
    if (!w) return;
    if (w->begun) ds4_atomic_abort(&w->af);
    for (int64_t i = 0; i < w->n; i++) ds4_free(w->e[i].name);
    ds4_free(w->e);
    ds4_free(w);
}

static ds4_status writer_push(ds4_st_writer *w, const char *name, ds4_dtype dt, int ndim, const int64_t *shape,
                              const void *data, bool need_data) {
    if (w->begun) return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s' added after begin", name ? name : "(null)");
    if (!name || !*name || strcmp(name, "__metadata__") == 0 || !ds4_utf8_valid(name, strlen(name)))
        return ds4_fail(DS4_ERR_ARG, "safetensors writer: bad tensor name '%s' (must be non-empty UTF-8, not __metadata__)",
                        name ? name : "(null)");
    if ((unsigned)dt >= DS4_DTYPE_COUNT) return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s': bad dtype %d", name, (int)dt);
    if (ndim < 0 || ndim > DS4_MAX_DIMS)
        return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s': %d dims (0..%d allowed)", name, ndim, DS4_MAX_DIMS);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || (double)shape[i] > ST_MAX_INT)
            return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s': bad dim %d = %" PRId64, name, i, shape[i]);
    int64_t numel;   /* the bound the reader applies, so every file written reads back */
    if (!ds4_shape_fits(ndim, shape, 8, &numel))
        return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s': shape too large (byte size overflows)", name);
    uint64_t bytes = (uint64_t)numel * ds4_dtype_size(dt);
    if (need_data && bytes > 0 && !data) return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s': NULL data", name);
    if (w->n == w->cap) {
        int64_t cap = w->cap ? 2 * w->cap : 64;
        st_wentry *ne = ds4_alloc(DS4_MEM_OTHER, (size_t)cap * sizeof *ne);
        if (!ne) return ds4_fail(DS4_ERR_OOM, "safetensors writer: out of memory");
        if (w->n) memcpy(ne, w->e, (size_t)w->n * sizeof *ne);
        ds4_free(w->e);
        w->e = ne;
        w->cap = cap;
    }
    st_wentry *e = &w->e[w->n];
    memset(e, 0, sizeof *e);
    if (!(e->name = dup_str(name))) return ds4_fail(DS4_ERR_OOM, "safetensors writer: out of memory");
    e->dtype = dt;
    e->ndim = ndim;
    for (int i = 0; i < ndim; i++) e->shape[i] = shape[i];
    e->data = data;
    e->bytes = bytes;
    e->order = w->n++;
    return DS4_OK;
}

ds4_status ds4_st_writer_add(ds4_st_writer *w, const char *name, ds4_dtype dt, int ndim, const int64_t *shape,
                             const void *data) {
    if (w->streaming) return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s': add and declare cannot be mixed", name);
    return writer_push(w, name, dt, ndim, shape, data, true);
}

ds4_status ds4_st_writer_declare(ds4_st_writer *w, const char *name, ds4_dtype dt, int ndim, const int64_t *shape) {
    if (w->n > 0 && !w->streaming)
        return ds4_fail(DS4_ERR_ARG, "safetensors writer: tensor '%s': add and declare cannot be mixed", name);
    w->streaming = true;
    return writer_push(w, name, dt, ndim, shape, NULL, false);
}

/* Growable text buffer for the header. */
typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n + 1) cap *= 2;
        char *np = ds4_alloc(DS4_MEM_OTHER, cap);
        if (!np) { b->oom = true; return; }
        if (b->len) memcpy(np, b->p, b->len);
        ds4_free(b->p);
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}
static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

/* JSON string literal (names are written byte for byte, control characters escaped). */
static void sb_json_string(sbuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        char esc[8];
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c;
            sb_put(b, esc, 2);
        } else if (c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", c);
            sb_put(b, esc, 6);
        } else sb_put(b, (const char *)&c, 1);
    }
    sb_put(b, "\"", 1);
}

/* Data order: larger element sizes first (keeps every tensor naturally aligned in the file),
 * then insertion order. */
static int cmp_layout(const void *a, const void *b) {
    const st_wentry *x = *(st_wentry *const *)a, *y = *(st_wentry *const *)b;
    size_t sx = ds4_dtype_size(x->dtype), sy = ds4_dtype_size(y->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}
static int cmp_name(const void *a, const void *b) {
    return strcmp((*(st_wentry *const *)a)->name, (*(st_wentry *const *)b)->name);
}

/* Checks names are unique, builds the header for data in the order ord[0..n), opens the temp file
 * and writes length + header. On success *ord_out (caller frees) holds the data order. */
static ds4_status writer_start(ds4_st_writer *w, const char *path, bool layout_sort, st_wentry ***ord_out) {
    *ord_out = NULL;
    st_wentry **ord = ds4_alloc(DS4_MEM_OTHER, (size_t)(w->n ? w->n : 1) * sizeof *ord);
    if (!ord) return ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    for (int64_t i = 0; i < w->n; i++) ord[i] = &w->e[i];
    qsort(ord, (size_t)w->n, sizeof *ord, cmp_name);
    for (int64_t i = 1; i < w->n; i++)
        if (strcmp(ord[i - 1]->name, ord[i]->name) == 0) {
            ds4_status s = ds4_fail(DS4_ERR_ARG, "%s: tensor '%s' added twice", path, ord[i]->name);
            ds4_free(ord);
            return s;
        }
    if (layout_sort) qsort(ord, (size_t)w->n, sizeof *ord, cmp_layout);
    else
        for (int64_t i = 0; i < w->n; i++) ord[i] = &w->e[i];

    sbuf b = {0};
    sb_str(&b, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    char num[160];
    for (int64_t i = 0; i < w->n; i++) {
        const st_wentry *e = ord[i];
        sb_str(&b, ",");
        sb_json_string(&b, e->name);
        snprintf(num, sizeof num, ":{\"dtype\":\"%s\",\"shape\":[", ds4_dtype_name(e->dtype));
        sb_str(&b, num);
        for (int d = 0; d < e->ndim; d++) {
            snprintf(num, sizeof num, "%s%" PRId64, d ? "," : "", e->shape[d]);
            sb_str(&b, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off, off + e->bytes);
        sb_str(&b, num);
        off += e->bytes;
    }
    sb_str(&b, "}");
    while (!b.oom && (8 + b.len) % 8 != 0) sb_str(&b, " ");   /* data section starts 8-byte aligned */
    ds4_status s = DS4_OK;
    if (b.oom) s = ds4_fail(DS4_ERR_OOM, "%s: out of memory building the header", path);
    else if (b.len > ST_MAX_HEADER) s = ds4_fail(DS4_ERR_ARG, "%s: header of %zu bytes exceeds the 100 MB limit", path, b.len);
    if (s == DS4_OK) s = ds4_atomic_open(path, &w->af);
    if (s == DS4_OK) {
        uint8_t len8[8];
        for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)b.len >> (8 * i));
        s = ds4_atomic_write(&w->af, len8, 8);
        if (s == DS4_OK) s = ds4_atomic_write(&w->af, b.p, b.len);
        /* a failed write has already aborted the temp file */
    }
    ds4_free(b.p);
    if (s != DS4_OK) {
        ds4_free(ord);
        return s;
    }
    w->begun = true;
    w->total = off;
    w->done = 0;
    *ord_out = ord;
    return DS4_OK;
}

ds4_status ds4_st_writer_write(ds4_st_writer *w, const char *path) {
    if (w->streaming || w->begun) return ds4_fail(DS4_ERR_ARG, "%s: writer holds declared tensors; use begin/put/finish", path);
    st_wentry **ord;
    DS4_TRY(writer_start(w, path, true, &ord));
    ds4_status s = DS4_OK;
    for (int64_t i = 0; s == DS4_OK && i < w->n; i++) s = ds4_atomic_write(&w->af, ord[i]->data, ord[i]->bytes);
    if (s == DS4_OK) s = ds4_atomic_commit(&w->af);
    w->begun = false;   /* committed, or aborted by the failing call */
    ds4_free(ord);
    return s;
}

ds4_status ds4_st_writer_begin(ds4_st_writer *w, const char *path) {
    if (w->begun) return ds4_fail(DS4_ERR_ARG, "%s: safetensors writer already begun", path);
    st_wentry **ord;
    DS4_TRY(writer_start(w, path, false, &ord));
    ds4_free(ord);
    return DS4_OK;
}

ds4_status ds4_st_writer_put(ds4_st_writer *w, const void *data, size_t len) {
    if (!w->begun) return ds4_fail(DS4_ERR_ARG, "safetensors writer: put before begin");
    if (len > w->total - w->done) {
        ds4_status s = ds4_fail(DS4_ERR_ARG, "%s: %zu bytes put past the end of the declared data (%" PRIu64 " of %" PRIu64 " written)",
                                w->af.path, len, w->done, w->total);
        ds4_atomic_abort(&w->af);
        w->begun = false;
        return s;
    }
    ds4_status s = ds4_atomic_write(&w->af, data, len);
    if (s != DS4_OK) {
        w->begun = false;
        return s;
    }
    w->done += len;
    return DS4_OK;
}

ds4_status ds4_st_writer_finish(ds4_st_writer *w) {
    if (!w->begun) return ds4_fail(DS4_ERR_ARG, "safetensors writer: finish before begin");
    w->begun = false;
    if (w->done != w->total) {
        ds4_status s = ds4_fail(DS4_ERR_ARG, "%s: only %" PRIu64 " of %" PRIu64 " declared data bytes were put", w->af.path, w->done,
                                w->total);
        ds4_atomic_abort(&w->af);
        return s;
    }
    return ds4_atomic_commit(&w->af);
}
