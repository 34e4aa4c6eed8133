/* The offload store: an unlinked temporary file holding handles' bytes at page-aligned extents,
 * written with pwrite and read with pread; a first-fit free list reuses dropped extents so a store
 * that swaps the same buffers every step stays the size of its largest working set. */
#include "ds4/offload.h"

#include "ds4/config.h"
#include "ds4/model.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXTENT_ALIGN 4096 /* page-aligned extents: whole pages move between the file and memory */

typedef struct {
    int64_t off, len;     /* extent in the file (len rounded up to EXTENT_ALIGN) */
    int64_t bytes;        /* bytes the handle names (counted) */
    ds4_mem_cat cat;
    bool live;
} slot;

typedef struct {
    int64_t off, len;
} extent;

struct ds4_offload {
    ds4_exec exec;        /* the steps' context: the backend whose buffers put_dev / get_dev move */
    int fd;               /* -1: a plan store (no file, no I/O) */
    char dir[1024];
    char path[1100];      /* the file's name before it was unlinked, for messages */
    int64_t file_end;     /* extents cover [0, file_end) */
    slot *slots;          /* indexed by handle */
    int64_t nslots, cap_slots;
    extent *free;         /* free extents inside [0, file_end), sorted by offset, never adjacent */
    int64_t nfree, cap_free;
};

static const char *default_dir(void) {
    const char *t = getenv("TMPDIR");
    return t && *t ? t : "/tmp";
}

ds4_status ds4_offload_open(const ds4_exec *exec, const char *dir, ds4_offload **out) {
    *out = NULL;
    if (!dir || !*dir) dir = default_dir();
    if (strlen(dir) >= sizeof((ds4_offload *)0)->dir)
        return ds4_fail(DS4_ERR_ARG, "offload store: directory name of %zu bytes is too long", strlen(dir));
    ds4_offload *s = ds4_calloc(DS4_MEM_OTHER, sizeof *s);
    if (!s) return ds4_fail(DS4_ERR_OOM, "offload store in %s: out of memory", dir);
    s->fd = -1;
    s->exec = exec ? *exec : (ds4_exec){0};
    snprintf(s->dir, sizeof s->dir, "%s", dir);
    if (!(exec && exec->plan)) {
        snprintf(s->path, sizeof s->path, "%s/ds4-offload-XXXXXX", dir);
        s->fd = mkostemp(s->path, O_CLOEXEC);
        if (s->fd < 0) {
            ds4_status st = ds4_fail(DS4_ERR_IO, "offload store: cannot create a file in directory %s: %s", dir,
                                     strerror(errno));
            ds4_free(s);
            return st;
        }
        unlink(s->path); /* nameless from now on: the file goes with the descriptor, even on a crash */
    }
    *out = s;
    return DS4_OK;
}

void ds4_offload_close(ds4_offload *s) {
    if (!s) return;
    for (int64_t h = 0; h < s->nslots; h++) ds4_offload_drop(s, h);
    if (s->fd >= 0) close(s->fd);
    ds4_free(s->slots);
    ds4_free(s->free);
    ds4_free(s);
}

const char *ds4_offload_dir(const ds4_offload *s) { return s->dir; }
int64_t ds4_offload_file_bytes(const ds4_offload *s) { return s->file_end; }

static const slot *find_slot(const ds4_offload *s, int64_t h) {
    return h >= 0 && h < s->nslots && s->slots[h].live ? &s->slots[h] : NULL;
}

size_t ds4_offload_size(const ds4_offload *s, int64_t h) {
    const slot *sl = find_slot(s, h);
    return sl ? (size_t)sl->bytes : 0;
}

/* ------------------------------------------------------------------ file I/O */
static ds4_status io_fail(const ds4_offload *s, const char *what, size_t len, int64_t off, const char *why) {
    return ds4_fail(DS4_ERR_IO, "offload store %s (unlinked): %s of %zu bytes at offset %lld failed: %s", s->path,
                    what, len, (long long)off, why);
}

static ds4_status write_at(const ds4_offload *s, const void *src, size_t len, int64_t off) {
    const char *p = src;
    for (size_t done = 0; done < len;) {
        ssize_t n = pwrite(s->fd, p + done, len - done, (off_t)(off + (int64_t)done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return io_fail(s, "write", len, off, n < 0 ? strerror(errno) : "nothing written");
        done += (size_t)n;
    }
    return DS4_OK;
}

static ds4_status read_at(const ds4_offload *s, void *dst, size_t len, int64_t off) {
    char *p = dst;
    for (size_t done = 0; done < len;) {
        ssize_t n = pread(s->fd, p + done, len - done, (off_t)(off + (int64_t)done));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return io_fail(s, "read", len, off, strerror(errno));
        if (n == 0) {
            char why[96];
            snprintf(why, sizeof why, "short read (end of file after %zu bytes)", done);
            return io_fail(s, "read", len, off, why);
        }
        done += (size_t)n;
    }
    return DS4_OK;
}

/* Zeroes [off, off + len) of the file with a bounded buffer (a reused extent holds old bytes). */
static ds4_status zero_at(const ds4_offload *s, int64_t off, int64_t len) {
    static const char zeros[1 << 16];
    for (int64_t k = 0; k < len; k += (int64_t)sizeof zeros) {
        int64_t n = len - k < (int64_t)sizeof zeros ? len - k : (int64_t)sizeof zeros;
        DS4_TRY(write_at(s, zeros, (size_t)n, off + k));
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------ extents */
static void free_remove(ds4_offload *s, int64_t i) {
    memmove(s->free + i, s->free + i + 1, (size_t)(s->nfree - i - 1) * sizeof *s->free);
    s->nfree--;
}

/* Returns [off, off + len) to the free list, merging neighbours; space at the end shrinks the file. */
static void free_insert(ds4_offload *s, int64_t off, int64_t len) {
    int64_t i = 0;
    while (i < s->nfree && s->free[i].off < off) i++;
    if (i > 0 && s->free[i - 1].off + s->free[i - 1].len == off) {
        off = s->free[i - 1].off;
        len += s->free[i - 1].len;
        free_remove(s, --i);
    }
    if (i < s->nfree && off + len == s->free[i].off) {
        len += s->free[i].len;
        free_remove(s, i);
    }
    if (off + len == s->file_end) {
        s->file_end = off;
        if (s->fd >= 0 && ftruncate(s->fd, (off_t)off) != 0) { /* keeping the bytes is harmless */
        }
        return;
    }
    /* out of metadata memory: the extent stays unused until close, nothing else breaks */
    if (!ds4_grow((void **)&s->free, &s->cap_free, s->nfree + 1, sizeof *s->free)) return;
    memmove(s->free + i + 1, s->free + i, (size_t)(s->nfree - i) * sizeof *s->free);
    s->free[i] = (extent){off, len};
    s->nfree++;
}

/* An extent of len bytes: first fit in the free list (*fresh = false), else grown at the end of the
 * file, where the bytes read as zero (*fresh = true). */
static ds4_status extent_take(ds4_offload *s, int64_t len, int64_t *off, bool *fresh) {
    for (int64_t i = 0; i < s->nfree; i++)
        if (s->free[i].len >= len) {
            *off = s->free[i].off;
            *fresh = false;
            s->free[i].off += len;
            s->free[i].len -= len;
            if (s->free[i].len == 0) free_remove(s, i);
            return DS4_OK;
        }
    *off = s->file_end;
    *fresh = true;
    if (s->fd >= 0 && ftruncate(s->fd, (off_t)(s->file_end + len)) != 0)
        return io_fail(s, "growth", (size_t)len, s->file_end, strerror(errno));
    s->file_end += len;
    return DS4_OK;
}

static ds4_status slot_new(ds4_offload *s, int64_t *h) {
    for (int64_t i = 0; i < s->nslots; i++)
        if (!s->slots[i].live) {
            *h = i;
            return DS4_OK;
        }
    if (!ds4_grow((void **)&s->slots, &s->cap_slots, s->nslots + 1, sizeof *s->slots))
        return ds4_fail(DS4_ERR_OOM, "offload store in %s: out of memory for handles", s->dir);
    *h = s->nslots++;
    s->slots[*h] = (slot){.live = false}; /* stays free until handle_new fills it */
    return DS4_OK;
}

/* A new handle of `bytes` bytes; zero = true makes its contents zero, else they are unspecified. */
static ds4_status handle_new(ds4_offload *s, ds4_mem_cat cat, size_t bytes, bool zero, int64_t *handle) {
    *handle = -1;
    if ((unsigned)cat >= DS4_MEM_NCAT) return ds4_fail(DS4_ERR_ARG, "offload store: bad memory category %d", (int)cat);
    int64_t h = -1, off = 0;
    bool fresh = false;
    const int64_t len = ((int64_t)bytes + EXTENT_ALIGN - 1) / EXTENT_ALIGN * EXTENT_ALIGN;
    DS4_TRY(slot_new(s, &h));
    DS4_TRY(extent_take(s, len, &off, &fresh));
    if (zero && !fresh && s->fd >= 0) {
        ds4_status st = zero_at(s, off, len);
        if (st != DS4_OK) {
            free_insert(s, off, len);
            return st;
        }
    }
    s->slots[h] = (slot){.off = off, .len = len, .bytes = (int64_t)bytes, .cat = cat, .live = true};
    ds4_mem_track_offload(cat, (int64_t)bytes);
    *handle = h;
    return DS4_OK;
}

ds4_status ds4_offload_alloc(ds4_offload *s, ds4_mem_cat cat, size_t bytes, int64_t *handle) {
    return handle_new(s, cat, bytes, true, handle);
}

void ds4_offload_drop(ds4_offload *s, int64_t h) {
    if (!find_slot(s, h)) return;
    slot *sl = &s->slots[h];
    sl->live = false;
    ds4_mem_track_offload(sl->cat, -sl->bytes);
    free_insert(s, sl->off, sl->len);
}

/* The handle's slot if [off, off + len) lies inside it. */
static ds4_status range_slot(const ds4_offload *s, int64_t h, size_t off, size_t len, const slot **out) {
    const slot *sl = find_slot(s, h);
    if (!sl) return ds4_fail(DS4_ERR_ARG, "offload store in %s: unknown handle %lld", s->dir, (long long)h);
    if (off > (size_t)sl->bytes || len > (size_t)sl->bytes - off)
        return ds4_fail(DS4_ERR_ARG, "offload store in %s: bytes [%zu, %zu) outside handle %lld of %lld bytes", s->dir,
                        off, off + len, (long long)h, (long long)sl->bytes);
    *out = sl;
    return DS4_OK;
}

ds4_status ds4_offload_read(ds4_offload *s, int64_t h, size_t off, void *dst, size_t len) {
    const slot *sl = NULL;
    DS4_TRY(range_slot(s, h, off, len, &sl));
    return s->fd < 0 ? DS4_OK : read_at(s, dst, len, sl->off + (int64_t)off);
}

ds4_status ds4_offload_write(ds4_offload *s, int64_t h, size_t off, const void *src, size_t len) {
    const slot *sl = NULL;
    DS4_TRY(range_slot(s, h, off, len, &sl));
    return s->fd < 0 ? DS4_OK : write_at(s, src, len, sl->off + (int64_t)off);
}

ds4_status ds4_offload_put(ds4_offload *s, ds4_mem_cat cat, const void *src, size_t bytes, int64_t *handle) {
    DS4_TRY(handle_new(s, cat, bytes, false, handle));
    ds4_status st = ds4_offload_write(s, *handle, 0, src, bytes);
    if (st != DS4_OK) {
        ds4_offload_drop(s, *handle);
        *handle = -1;
    }
    return st;
}

ds4_status ds4_offload_get(ds4_offload *s, int64_t h, void *dst) {
    return ds4_offload_read(s, h, 0, dst, ds4_offload_size(s, h));
}

/* ------------------------------------------------------------------ device buffers
 * The file takes host bytes: a buffer of the backend crosses through a host buffer of STAGE_BYTES, a
 * chunk at a time. A plan allocates that buffer too (it is what the real run holds) and moves nothing. */
enum { STAGE_BYTES = 1 << 20 };

static ds4_status stage_new(const ds4_offload *s, size_t bytes, char **out) {
    *out = ds4_alloc(DS4_MEM_OTHER, bytes < STAGE_BYTES ? (bytes ? bytes : 1) : STAGE_BYTES);
    return *out ? DS4_OK : ds4_fail(DS4_ERR_OOM, "offload store in %s: out of memory for its staging buffer", s->dir);
}

ds4_status ds4_offload_write_dev(ds4_offload *s, int64_t h, size_t off, const void *src, size_t len) {
    const slot *sl = NULL;
    DS4_TRY(range_slot(s, h, off, len, &sl));
    char *buf;
    DS4_TRY(stage_new(s, len, &buf));
    ds4_status st = DS4_OK;
    for (size_t k = 0; k < len && st == DS4_OK && s->fd >= 0; k += STAGE_BYTES) {
        const size_t n = len - k < STAGE_BYTES ? len - k : STAGE_BYTES;
        ds4_dev_to_host(&s->exec, buf, (const char *)src + k, n);
        st = ds4_offload_write(s, h, off + k, buf, n);
    }
    ds4_free(buf);
    return st;
}

ds4_status ds4_offload_read_dev(ds4_offload *s, int64_t h, size_t off, void *dst, size_t len) {
    const slot *sl = NULL;
    DS4_TRY(range_slot(s, h, off, len, &sl));
    char *buf;
    DS4_TRY(stage_new(s, len, &buf));
    ds4_status st = DS4_OK;
    for (size_t k = 0; k < len && st == DS4_OK && s->fd >= 0; k += STAGE_BYTES) {
        const size_t n = len - k < STAGE_BYTES ? len - k : STAGE_BYTES;
        st = ds4_offload_read(s, h, off + k, buf, n);
        if (st == DS4_OK) ds4_dev_to_device(&s->exec, (char *)dst + k, buf, n);
    }
    ds4_free(buf);
    return st;
}

ds4_status ds4_offload_put_dev(ds4_offload *s, ds4_mem_cat cat, const void *src, size_t bytes, int64_t *handle) {
    DS4_TRY(handle_new(s, cat, bytes, false, handle));
    ds4_status st = ds4_offload_write_dev(s, *handle, 0, src, bytes);
    if (st != DS4_OK) {
        ds4_offload_drop(s, *handle);
        *handle = -1;
    }
    return st;
}

ds4_status ds4_offload_get_dev(ds4_offload *s, int64_t h, void *dst) {
    return ds4_offload_read_dev(s, h, 0, dst, ds4_offload_size(s, h));
}

const ds4_exec *ds4_offload_exec(const ds4_offload *s) { return &s->exec; }
