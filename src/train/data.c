/* The data loader: shards -> one stream of [BOS] doc [EOS] -> rows of T tokens -> shuffled
 * batches, with a resumable position. See include/ds4/data.h for the contract. */
#include "ds4/data.h"
#include "ds4/shard.h"

#include <dirent.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

struct ds4_dataloader {
    ds4_shard *shards;
    int64_t n_shards;
    int64_t *shard_start;   /* [n_shards + 1] stream offset where each shard begins */
    int64_t extra;          /* tokens added per document: (bos >= 0) + (eos >= 0) */
    int32_t bos, eos;
    int64_t vocab;
    int64_t T, B;
    int64_t row_begin;      /* this split is rows [row_begin, row_begin + n_rows) of the stream */
    int64_t n_rows;
    bool shuffle;
    uint64_t seed;
    int dp_rank, dp_size;
    uint64_t epoch, position;
    int64_t *perm;          /* [n_rows] the order of perm_epoch, when shuffling */
    uint64_t perm_epoch;
    bool perm_valid;
};

ds4_data_opts ds4_data_defaults(void) {
    ds4_data_opts o = {0};
    o.batch_size = 1;
    o.shuffle = true;
    o.bos_id = DS4_DATA_FROM_SHARDS;
    o.eos_id = DS4_DATA_FROM_SHARDS;
    o.dp_size = 1;
    return o;
}

/* ---------------------------------------------------------------- finding shards */

typedef struct {
    char **p;
    int64_t n, cap;
} path_list;

static ds4_status path_add(path_list *l, const char *s) {
    if (l->n == l->cap) {
        int64_t nc = l->cap ? 2 * l->cap : 16;
        char **np = ds4_alloc(DS4_MEM_OTHER, (size_t)nc * sizeof(char *));
        if (!np) return ds4_fail(DS4_ERR_OOM, "data: out of memory listing shards");
        if (l->p) memcpy(np, l->p, (size_t)l->n * sizeof(char *));
        ds4_free(l->p);
        l->p = np;
        l->cap = nc;
    }
    size_t n = strlen(s) + 1;
    if (!(l->p[l->n] = ds4_alloc(DS4_MEM_OTHER, n))) return ds4_fail(DS4_ERR_OOM, "data: out of memory listing shards");
    memcpy(l->p[l->n++], s, n);
    return DS4_OK;
}

static void path_free(path_list *l) {
    for (int64_t i = 0; i < l->n; i++) ds4_free(l->p[i]);
    ds4_free(l->p);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static ds4_status expand_pattern(const char *pat, path_list *out) {
    struct stat sb;
    if (stat(pat, &sb) == 0 && S_ISREG(sb.st_mode)) return path_add(out, pat);
    if (stat(pat, &sb) == 0 && S_ISDIR(sb.st_mode)) { /* every *.bin inside, sorted */
        DIR *dir = opendir(pat);
        if (!dir) return ds4_fail(DS4_ERR_IO, "data: cannot read directory %s", pat);
        path_list found = {0};
        ds4_status s = DS4_OK;
        struct dirent *e;
        while (!s && (e = readdir(dir))) {
            size_t n = strlen(e->d_name);
            if (e->d_name[0] == '.' || n < 5 || strcmp(e->d_name + n - 4, ".bin") != 0) continue;
            char full[4096];
            snprintf(full, sizeof full, "%s/%s", pat, e->d_name);
            if (stat(full, &sb) == 0 && S_ISREG(sb.st_mode)) s = path_add(&found, full);
        }
        closedir(dir);
        if (!s && found.n == 0) s = ds4_fail(DS4_ERR_MISSING, "data: directory %s holds no .bin shards", pat);
        if (!s) qsort(found.p, (size_t)found.n, sizeof(char *), cmp_str);
        for (int64_t i = 0; i < found.n && !s; i++) s = path_add(out, found.p[i]);
        path_free(&found);
        return s;
    }
    glob_t g;
    int rc = glob(pat, 0, NULL, &g);
    if (rc == GLOB_NOMATCH) {
        globfree(&g);
        return ds4_fail(DS4_ERR_MISSING, "data: no shard matches '%s'", pat);
    }
    if (rc != 0) {
        globfree(&g);
        return ds4_fail(DS4_ERR_IO, "data: cannot expand '%s'", pat);
    }
    ds4_status s = DS4_OK;
    for (size_t i = 0; i < g.gl_pathc && !s; i++) s = path_add(out, g.gl_pathv[i]); /* glob sorts */
    globfree(&g);
    return s;
}

/* ---------------------------------------------------------------- open / close */

void ds4_data_close(ds4_dataloader *d) {
    if (!d) return;
    for (int64_t i = 0; i < d->n_shards; i++) ds4_shard_close(&d->shards[i]);
    ds4_free(d->shards);
    ds4_free(d->shard_start);
    ds4_free(d->perm);
    ds4_free(d);
}

static ds4_status check_opts(const ds4_data_opts *o) {
    if (o->seq_len < 2) return ds4_fail(DS4_ERR_ARG, "data: seq_len %lld, expected at least 2", (long long)o->seq_len);
    if (o->batch_size < 1) return ds4_fail(DS4_ERR_ARG, "data: batch_size %lld, expected at least 1", (long long)o->batch_size);
    if (o->dp_size < 1 || o->dp_rank < 0 || o->dp_rank >= o->dp_size)
        return ds4_fail(DS4_ERR_ARG, "data: dp_rank %d of dp_size %d", o->dp_rank, o->dp_size);
    if (o->split != DS4_SPLIT_ALL && !(o->val_fraction > 0 && o->val_fraction < 1))
        return ds4_fail(DS4_ERR_ARG, "data: val_fraction %g, expected a fraction in (0, 1) for a train/val split", o->val_fraction);
    if (o->bos_id < DS4_DATA_FROM_SHARDS || o->eos_id < DS4_DATA_FROM_SHARDS)
        return ds4_fail(DS4_ERR_ARG, "data: bos_id %d / eos_id %d", o->bos_id, o->eos_id);
    return DS4_OK;
}

/* Opens the shards and checks that they agree; fills vocab, bos/eos, stream offsets. */
static ds4_status open_shards(ds4_dataloader *d, const path_list *paths, const ds4_data_opts *o) {
    d->shards = ds4_calloc(DS4_MEM_OTHER, (size_t)paths->n * sizeof(ds4_shard));
    d->shard_start = ds4_calloc(DS4_MEM_OTHER, (size_t)(paths->n + 1) * sizeof(int64_t));
    if (!d->shards || !d->shard_start) return ds4_fail(DS4_ERR_OOM, "data: out of memory for %lld shards", (long long)paths->n);
    for (int64_t i = 0; i < paths->n; i++) {
        DS4_TRY(ds4_shard_open(paths->p[i], i ? d->shards[0].vocab_size : 0, &d->shards[i]));
        d->n_shards = i + 1;
        const ds4_shard *s = &d->shards[i], *s0 = &d->shards[0];
        if (s->bos_id != s0->bos_id || s->eos_id != s0->eos_id)
            return ds4_fail(DS4_ERR_FORMAT, "%s: bos/eos %d/%d, but %s has %d/%d (made by different tokenizers?)", s->path,
                            s->bos_id, s->eos_id, s0->path, s0->bos_id, s0->eos_id);
    }
    const ds4_shard *s0 = &d->shards[0];
    d->vocab = s0->vocab_size;
    if (o->max_vocab > 0 && d->vocab > o->max_vocab)
        return ds4_fail(DS4_ERR_CONFIG, "%s: vocab size %lld is larger than the model's %lld", s0->path, (long long)d->vocab,
                        (long long)o->max_vocab);
    d->bos = o->bos_id == DS4_DATA_FROM_SHARDS ? s0->bos_id : o->bos_id;
    d->eos = o->eos_id == DS4_DATA_FROM_SHARDS ? s0->eos_id : o->eos_id;
    if (d->bos >= d->vocab || d->eos >= d->vocab)
        return ds4_fail(DS4_ERR_ARG, "data: bos_id %d / eos_id %d outside the vocab of %lld", d->bos, d->eos, (long long)d->vocab);
    d->extra = (d->bos >= 0) + (d->eos >= 0);
    for (int64_t i = 0; i < d->n_shards; i++)
        d->shard_start[i + 1] = d->shard_start[i] + d->shards[i].n_tokens + d->extra * d->shards[i].n_docs;
    return DS4_OK;
}

/* Picks this split's rows out of all rows of the stream. */
static ds4_status choose_rows(ds4_dataloader *d, const ds4_data_opts *o) {
    int64_t total = d->shard_start[d->n_shards];
    int64_t all = total / d->T;
    if (all == 0)
        return ds4_fail(DS4_ERR_ARG, "data: the shards hold %lld tokens (with BOS/EOS), less than one row of seq_len %lld",
                        (long long)total, (long long)d->T);
    int64_t n_val = 0;
    if (o->split != DS4_SPLIT_ALL) {
        n_val = (int64_t)((double)all * o->val_fraction);
        if (n_val == 0) n_val = 1;
        if (n_val >= all)
            return ds4_fail(DS4_ERR_ARG, "data: %lld rows of %lld tokens cannot be split into train and val (fraction %g)",
                            (long long)all, (long long)d->T, o->val_fraction);
    }
    d->row_begin = o->split == DS4_SPLIT_VAL ? all - n_val : 0;
    d->n_rows = o->split == DS4_SPLIT_VAL ? n_val : all - n_val;
    return DS4_OK;
}

ds4_status ds4_data_open(const char *const *patterns, int64_t n_patterns, const ds4_data_opts *opts, ds4_dataloader **out) {
    *out = NULL;
    DS4_TRY(check_opts(opts));
    if (n_patterns < 1) return ds4_fail(DS4_ERR_ARG, "data: no shards given");
    path_list paths = {0};
    ds4_status s = DS4_OK;
    for (int64_t i = 0; i < n_patterns && !s; i++) s = expand_pattern(patterns[i], &paths);
    ds4_dataloader *d = s ? NULL : ds4_calloc(DS4_MEM_OTHER, sizeof *d);
    if (!s && !d) s = ds4_fail(DS4_ERR_OOM, "data: out of memory");
    if (!s) {
        d->T = opts->seq_len;
        d->B = opts->batch_size;
        d->seed = opts->seed;
        d->shuffle = opts->shuffle;
        d->dp_rank = opts->dp_rank;
        d->dp_size = opts->dp_size;
        s = open_shards(d, &paths, opts);
    }
    if (!s) s = choose_rows(d, opts);
    if (!s && d->shuffle && !(d->perm = ds4_alloc(DS4_MEM_OTHER, (size_t)d->n_rows * sizeof(int64_t))))
        s = ds4_fail(DS4_ERR_OOM, "data: out of memory for the order of %lld rows", (long long)d->n_rows);
    path_free(&paths);
    if (s) {
        ds4_data_close(d);
        return s;
    }
    *out = d;
    return DS4_OK;
}

/* ---------------------------------------------------------------- reading the stream */

/* Stream tokens [p, p + n) -> out. The range lies inside the stream. */
static void read_stream(const ds4_dataloader *d, int64_t p, int64_t n, int32_t *out) {
    /* the shard: the last one starting at or before p (empty shards share their start) */
    int64_t lo = 0, hi = d->n_shards - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (d->shard_start[mid] <= p) lo = mid;
        else hi = mid - 1;
    }
    int64_t k = lo;
    const ds4_shard *s = &d->shards[k];
    /* the document: the last one whose stream start (offset + extra per earlier doc) is <= q */
    int64_t q = p - d->shard_start[k];
    int64_t a = 0, b = s->n_docs - 1;
    while (a < b) {
        int64_t mid = (a + b + 1) / 2;
        if ((int64_t)s->doc_offsets[mid] + mid * d->extra <= q) a = mid;
        else b = mid - 1;
    }
    int64_t doc = a, w = q - ((int64_t)s->doc_offsets[doc] + doc * d->extra); /* w: place inside the document */
    int64_t head = d->bos >= 0;
    while (n > 0) {
        int64_t body = (int64_t)(s->doc_offsets[doc + 1] - s->doc_offsets[doc]);
        if (w == 0 && head) {
            *out++ = d->bos, w++, n--;
        } else if (w < head + body) {
            int64_t take = head + body - w < n ? head + body - w : n;
            ds4_shard_read(s, (int64_t)s->doc_offsets[doc] + w - head, take, out);
            out += take, w += take, n -= take;
        } else if (w == head + body && d->eos >= 0) {
            *out++ = d->eos, w++, n--;
        } else { /* next document, skipping shards that have none */
            doc++, w = 0;
            while (doc == s->n_docs) s = &d->shards[++k], doc = 0;
        }
    }
}

ds4_status ds4_data_row(const ds4_dataloader *d, int64_t i, int32_t *out) {
    if (i < 0 || i >= d->n_rows)
        return ds4_fail(DS4_ERR_ARG, "data: row %lld outside [0, %lld)", (long long)i, (long long)d->n_rows);
    read_stream(d, (d->row_begin + i) * d->T, d->T, out);
    return DS4_OK;
}

/* The row at place i of epoch e's order. */
static int64_t order_at(ds4_dataloader *d, uint64_t e, int64_t i) {
    if (!d->shuffle) return i;
    if (!d->perm_valid || d->perm_epoch != e) { /* Fisher-Yates from the counter RNG: a function of (seed, e) */
        uint64_t stream = ds4_hash_str("ds4.data.order") + e;
        for (int64_t j = 0; j < d->n_rows; j++) d->perm[j] = j;
        for (int64_t j = d->n_rows - 1; j > 0; j--) {
            int64_t r = (int64_t)(ds4_rng_u64(d->seed, stream, (uint64_t)j) % (uint64_t)(j + 1));
            int64_t t = d->perm[j];
            d->perm[j] = d->perm[r];
            d->perm[r] = t;
        }
        d->perm_epoch = e;
        d->perm_valid = true;
    }
    return d->perm[i];
}

ds4_status ds4_data_next(ds4_dataloader *d, int32_t *out) {
    uint64_t n = (uint64_t)d->n_rows;
    for (int64_t r = 0; r < d->B; r++) {
        uint64_t k = d->position + (uint64_t)d->dp_rank * (uint64_t)d->B + (uint64_t)r; /* place in the order */
        int64_t row = order_at(d, d->epoch + k / n, (int64_t)(k % n));
        read_stream(d, (d->row_begin + row) * d->T, d->T, out + r * d->T); /* out[r]: [T] */
    }
    uint64_t pos = d->position + (uint64_t)d->B * (uint64_t)d->dp_size;
    d->epoch += pos / n;
    d->position = pos % n;
    return DS4_OK;
}

void ds4_data_get_state(const ds4_dataloader *d, ds4_data_state *st) {
    st->epoch = d->epoch;
    st->position = d->position;
    st->seed = d->seed;
    st->n_rows = (uint64_t)d->n_rows;
}

ds4_status ds4_data_set_state(ds4_dataloader *d, const ds4_data_state *st) {
    if (st->seed != d->seed || st->n_rows != (uint64_t)d->n_rows)
        return ds4_fail(DS4_ERR_CONFIG, "data: the saved position belongs to seed %llu over %llu rows, this loader has seed "
                                        "%llu over %lld rows (other shards, seq_len or split?)",
                        (unsigned long long)st->seed, (unsigned long long)st->n_rows, (unsigned long long)d->seed,
                        (long long)d->n_rows);
    if (st->position >= st->n_rows)
        return ds4_fail(DS4_ERR_CONFIG, "data: saved position %llu is past the %llu rows", (unsigned long long)st->position,
                        (unsigned long long)st->n_rows);
    d->epoch = st->epoch;
    d->position = st->position;
    return DS4_OK;
}

int64_t ds4_data_n_rows(const ds4_dataloader *d) { return d->n_rows; }
int64_t ds4_data_n_shards(const ds4_dataloader *d) { return d->n_shards; }
int64_t ds4_data_stream_tokens(const ds4_dataloader *d) { return d->shard_start[d->n_shards]; }
int64_t ds4_data_vocab_size(const ds4_dataloader *d) { return d->vocab; }
int32_t ds4_data_bos(const ds4_dataloader *d) { return d->bos; }
int32_t ds4_data_eos(const ds4_dataloader *d) { return d->eos; }
