/* Token shards: the writer (atomic) and the validating reader (mmap). Layout in ds4/shard.h. */
#include "ds4/shard.h"
#include "ds4/io.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ds4 token shards are little-endian; this reader maps them directly"
#endif

static uint32_t rd_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t rd_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void wr_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void wr_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

static int64_t width_for_vocab(int64_t vocab) { return vocab <= 65536 ? 2 : 4; }

/* ---------------------------------------------------------------- reader */

ds4_status ds4_shard_check(const void *data, size_t len, const char *name, int64_t expect_vocab, ds4_shard *out) {
    const uint8_t *p = data;
    memset(out, 0, sizeof *out);
    if (len < DS4_SHARD_HEADER_BYTES)
        return ds4_fail(DS4_ERR_FORMAT, "%s: truncated: %zu bytes, a shard header is %d", name, len, DS4_SHARD_HEADER_BYTES);
    if (memcmp(p, DS4_SHARD_MAGIC, 8) != 0) return ds4_fail(DS4_ERR_FORMAT, "%s: not a ds4 token shard (bad magic)", name);
    uint32_t version = rd_u32(p + 8), vocab = rd_u32(p + 12), width = rd_u32(p + 16), reserved = rd_u32(p + 28);
    int32_t bos = (int32_t)rd_u32(p + 20), eos = (int32_t)rd_u32(p + 24);
    uint64_t n_tokens = rd_u64(p + 32), n_docs = rd_u64(p + 40);
    if (version != DS4_SHARD_VERSION)
        return ds4_fail(DS4_ERR_FORMAT, "%s: shard version %u, this build reads version %u", name, version, DS4_SHARD_VERSION);
    if (vocab == 0 || vocab > INT32_MAX) return ds4_fail(DS4_ERR_FORMAT, "%s: bad vocab size %u", name, vocab);
    if (expect_vocab > 0 && (int64_t)vocab != expect_vocab)
        return ds4_fail(DS4_ERR_FORMAT, "%s: vocab size %u, expected %lld (tokenized with another tokenizer?)", name, vocab,
                        (long long)expect_vocab);
    if ((int64_t)width != width_for_vocab(vocab))
        return ds4_fail(DS4_ERR_FORMAT, "%s: %u-byte tokens, but vocab %u takes %lld-byte tokens", name, width, vocab,
                        (long long)width_for_vocab(vocab));
    if (bos < -1 || bos >= (int64_t)vocab || eos < -1 || eos >= (int64_t)vocab)
        return ds4_fail(DS4_ERR_FORMAT, "%s: bos_id %d / eos_id %d outside [-1, %u)", name, bos, eos, vocab);
    if (reserved != 0) return ds4_fail(DS4_ERR_FORMAT, "%s: reserved header field is %u, expected 0", name, reserved);
    /* sizes, in a width that cannot overflow for any real file */
    uint64_t room = (uint64_t)len - DS4_SHARD_HEADER_BYTES;
    if (n_docs >= room / 8)
        return ds4_fail(DS4_ERR_FORMAT, "%s: truncated: header says %llu documents, the file has room for %llu offsets", name,
                        (unsigned long long)n_docs, (unsigned long long)(room / 8));
    uint64_t off_bytes = 8 * (n_docs + 1);
    uint64_t tok_room = room - off_bytes;
    if (n_tokens > tok_room / width)
        return ds4_fail(DS4_ERR_FORMAT, "%s: truncated: header says %llu tokens, the file holds %llu", name,
                        (unsigned long long)n_tokens, (unsigned long long)(tok_room / width));
    if (tok_room != n_tokens * width)
        return ds4_fail(DS4_ERR_FORMAT, "%s: %llu bytes after the last token (file size %zu does not match the header)", name,
                        (unsigned long long)(tok_room - n_tokens * width), len);
    const uint8_t *offs = p + DS4_SHARD_HEADER_BYTES;
    if (rd_u64(offs) != 0) return ds4_fail(DS4_ERR_FORMAT, "%s: doc_offsets[0] = %llu, expected 0", name, (unsigned long long)rd_u64(offs));
    for (uint64_t i = 1; i <= n_docs; i++) {
        uint64_t a = rd_u64(offs + 8 * (i - 1)), b = rd_u64(offs + 8 * i);
        if (b > n_tokens)
            return ds4_fail(DS4_ERR_FORMAT, "%s: doc_offsets[%llu] = %llu is past the %llu tokens", name, (unsigned long long)i,
                            (unsigned long long)b, (unsigned long long)n_tokens);
        if (b < a)
            return ds4_fail(DS4_ERR_FORMAT, "%s: doc_offsets[%llu] = %llu goes back from %llu", name, (unsigned long long)i,
                            (unsigned long long)b, (unsigned long long)a);
    }
    if (rd_u64(offs + 8 * n_docs) != n_tokens)
        return ds4_fail(DS4_ERR_FORMAT, "%s: doc_offsets[%llu] = %llu, expected n_tokens = %llu", name, (unsigned long long)n_docs,
                        (unsigned long long)rd_u64(offs + 8 * n_docs), (unsigned long long)n_tokens);
    out->vocab_size = vocab;
    out->token_bytes = width;
    out->bos_id = bos;
    out->eos_id = eos;
    out->n_tokens = (int64_t)n_tokens;
    out->n_docs = (int64_t)n_docs;
    out->doc_offsets = (const uint64_t *)(const void *)offs; /* 8-aligned: header 48 + mmap base */
    out->tokens = offs + off_bytes;
    /* every token < vocab: one pass, the first offender reported */
    int64_t bad = -1;
    if (width == 2) {
        const uint16_t *t = out->tokens;
        for (uint64_t i = 0; i < n_tokens && bad < 0; i++)
            if (t[i] >= vocab) bad = (int64_t)i;
    } else {
        const uint32_t *t = out->tokens;
        for (uint64_t i = 0; i < n_tokens && bad < 0; i++)
            if (t[i] >= vocab) bad = (int64_t)i;
    }
    if (bad >= 0) {
        uint32_t v = ds4_shard_token(out, bad);
        memset(out, 0, sizeof *out);
        return ds4_fail(DS4_ERR_FORMAT, "%s: token %lld is id %u, not below the vocab size %u", name, (long long)bad, v, vocab);
    }
    return DS4_OK;
}

ds4_status ds4_shard_open(const char *path, int64_t expect_vocab, ds4_shard *out) {
    memset(out, 0, sizeof *out);
    int fd;
    uint64_t size;
    DS4_TRY(ds4_open_input(path, "shard", &fd, &size));
    size_t len = (size_t)size;
    if (len < DS4_SHARD_HEADER_BYTES) {
        close(fd);
        return ds4_fail(DS4_ERR_FORMAT, "%s: truncated: %zu bytes, a shard header is %d", path, len, DS4_SHARD_HEADER_BYTES);
    }
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return ds4_fail(DS4_ERR_IO, "%s: mmap failed: %s", path, strerror(errno));
    ds4_status s = ds4_shard_check(map, len, path, expect_vocab, out);
    size_t n = strlen(path) + 1;
    char *p = s ? NULL : ds4_alloc(DS4_MEM_OTHER, n);
    if (!s && !p) s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    if (s) {
        munmap(map, len);
        memset(out, 0, sizeof *out);
        return s;
    }
    memcpy(p, path, n);
    out->path = p;
    out->map = map;
    out->map_bytes = len;
    return DS4_OK;
}

void ds4_shard_close(ds4_shard *s) {
    if (s->map) munmap(s->map, s->map_bytes);
    ds4_free(s->path);
    memset(s, 0, sizeof *s);
}

void ds4_shard_read(const ds4_shard *s, int64_t begin, int64_t n, int32_t *out) {
    if (s->token_bytes == 2) {
        const uint16_t *t = (const uint16_t *)s->tokens + begin;
        for (int64_t i = 0; i < n; i++) out[i] = t[i];
    } else {
        const uint32_t *t = (const uint32_t *)s->tokens + begin;
        for (int64_t i = 0; i < n; i++) out[i] = (int32_t)t[i];
    }
}

/* ---------------------------------------------------------------- writer */

struct ds4_shard_writer {
    char *path;
    int64_t vocab_size, width;
    int32_t bos, eos;
    uint8_t *tokens;       /* n_tokens * width bytes */
    int64_t n_tokens, tok_cap;
    uint64_t *offsets;     /* [n_docs + 1] */
    int64_t n_docs, off_cap;
};

void ds4_shard_writer_abort(ds4_shard_writer *w) {
    if (!w) return;
    ds4_free(w->path);
    ds4_free(w->tokens);
    ds4_free(w->offsets);
    ds4_free(w);
}

ds4_status ds4_shard_writer_open(const char *path, int64_t vocab_size, int32_t bos_id, int32_t eos_id,
                                 ds4_shard_writer **out) {
    *out = NULL;
    if (vocab_size <= 0 || vocab_size > INT32_MAX)
        return ds4_fail(DS4_ERR_ARG, "%s: vocab size %lld out of range", path, (long long)vocab_size);
    if (bos_id < -1 || bos_id >= vocab_size || eos_id < -1 || eos_id >= vocab_size)
        return ds4_fail(DS4_ERR_ARG, "%s: bos_id %d / eos_id %d outside [-1, %lld)", path, bos_id, eos_id, (long long)vocab_size);
    ds4_shard_writer *w = ds4_calloc(DS4_MEM_OTHER, sizeof *w);
    size_t n = strlen(path) + 1;
    if (w) w->path = ds4_alloc(DS4_MEM_OTHER, n);
    if (!w || !w->path || !ds4_grow((void **)&w->offsets, &w->off_cap, 1, sizeof(uint64_t))) {
        ds4_shard_writer_abort(w);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    }
    memcpy(w->path, path, n);
    w->vocab_size = vocab_size;
    w->width = width_for_vocab(vocab_size);
    w->bos = bos_id;
    w->eos = eos_id;
    w->offsets[0] = 0;
    *out = w;
    return DS4_OK;
}

ds4_status ds4_shard_writer_add(ds4_shard_writer *w, const int32_t *tokens, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= w->vocab_size)
            return ds4_fail(DS4_ERR_ARG, "%s: document %lld token %lld is id %d, outside the vocab [0, %lld)", w->path,
                            (long long)w->n_docs, (long long)i, tokens[i], (long long)w->vocab_size);
    if (!ds4_grow((void **)&w->tokens, &w->tok_cap, (w->n_tokens + n) * w->width, 1) ||
        !ds4_grow((void **)&w->offsets, &w->off_cap, w->n_docs + 2, sizeof(uint64_t)))
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory holding %lld tokens", w->path, (long long)(w->n_tokens + n));
    uint8_t *dst = w->tokens + w->n_tokens * w->width;
    if (w->width == 2)
        for (int64_t i = 0; i < n; i++) {
            uint16_t v = (uint16_t)tokens[i];
            memcpy(dst + 2 * i, &v, 2);
        }
    else
        for (int64_t i = 0; i < n; i++) {
            uint32_t v = (uint32_t)tokens[i];
            memcpy(dst + 4 * i, &v, 4);
        }
    w->n_tokens += n;
    w->offsets[++w->n_docs] = (uint64_t)w->n_tokens;
    return DS4_OK;
}

int64_t ds4_shard_writer_tokens(const ds4_shard_writer *w) { return w->n_tokens; }
int64_t ds4_shard_writer_docs(const ds4_shard_writer *w) { return w->n_docs; }

ds4_status ds4_shard_writer_close(ds4_shard_writer *w) {
    uint8_t h[DS4_SHARD_HEADER_BYTES] = {0};
    memcpy(h, DS4_SHARD_MAGIC, 8);
    wr_u32(h + 8, DS4_SHARD_VERSION);
    wr_u32(h + 12, (uint32_t)w->vocab_size);
    wr_u32(h + 16, (uint32_t)w->width);
    wr_u32(h + 20, (uint32_t)w->bos);
    wr_u32(h + 24, (uint32_t)w->eos);
    wr_u64(h + 32, (uint64_t)w->n_tokens);
    wr_u64(h + 40, (uint64_t)w->n_docs);
    ds4_atomic_file af;
    ds4_status s = ds4_atomic_open(w->path, &af);
    if (!s) s = ds4_atomic_write(&af, h, sizeof h);
    if (!s) s = ds4_atomic_write(&af, w->offsets, (size_t)(w->n_docs + 1) * sizeof(uint64_t));
    if (!s) s = ds4_atomic_write(&af, w->tokens, (size_t)(w->n_tokens * w->width));
    if (!s) s = ds4_atomic_commit(&af); /* a failing write has already removed the temp file */
    ds4_shard_writer_abort(w);
    return s;
}
