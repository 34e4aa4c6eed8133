/* AdamW with fp32 master weights and moments, gradient clipping, the router bias rule, LR schedule. */
#include "ds4/train.h"

#include "ds4/io.h"
#include "ds4/offload.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The two moments, by index: resident pointer (NULL: in o->store) and store handle. */
enum { S_M = 0, S_V, S_COUNT };

static float *arr_mem(const ds4_adamw *o, int k) { return k == S_M ? o->m : o->v; }
static int64_t *arr_handle(ds4_adamw *o, int k) { return k == S_M ? &o->h_m : &o->h_v; }
static int64_t arr_h(const ds4_adamw *o, int k) { return k == S_M ? o->h_m : o->h_v; }
static void arr_set_mem(ds4_adamw *o, int k, float *p) {
    if (k == S_M) o->m = p;
    else o->v = p;
}

static void state_reset(ds4_adamw *o, int64_t n) {
    memset(o, 0, sizeof *o);
    o->n = n;
    for (int k = 0; k < S_COUNT; k++) *arr_handle(o, k) = -1;
}

/* ------------------------------------------------------------------ the rules, by range */
static int range_cmp(const void *a, const void *b) {
    const int64_t x = ((const ds4_adamw_range *)a)->off, y = ((const ds4_adamw_range *)b)->off;
    return x < y ? -1 : x > y;
}

/* The runs being laid out: written to out (NULL: only counted), the last one kept for merging. */
typedef struct {
    ds4_adamw_range *out;
    int64_t cnt;
    ds4_adamw_range last;
} run_list;

/* Appends [off, off + n) under a rule, merged into the last run when it continues it with the same rule. */
static void run_put(run_list *l, int64_t off, int64_t n, bool decay, bool frozen, bool muon) {
    if (n <= 0) return;
    if (l->cnt > 0 && l->last.decay == decay && l->last.frozen == frozen && l->last.muon == muon) l->last.n += n;
    else {
        l->last = (ds4_adamw_range){.off = off, .n = n, .decay = decay, .frozen = frozen, .muon = muon};
        l->cnt++;
    }
    if (l->out) l->out[l->cnt - 1] = l->last;
}

/* The runs covering [0, n) back to back: the sorted ranges r [nr], the gaps between them trained
 * without decay, neighbours of the same rule merged. Returns how many. */
static int64_t cover(const ds4_adamw_range *r, int64_t nr, int64_t n, ds4_adamw_range *out) {
    run_list l = {.out = out};
    int64_t at = 0;
    for (int64_t i = 0; i < nr; i++) {
        run_put(&l, at, r[i].off - at, false, false, false);
        run_put(&l, r[i].off, r[i].n, r[i].decay, r[i].frozen, r[i].muon);
        at = r[i].off + r[i].n;
    }
    run_put(&l, at, n - at, false, false, false);
    return l.cnt;
}

/* r [nr] sorted by offset: each inside [0, n), none overlapping the next. */
static ds4_status ranges_check(const ds4_adamw_range *r, int64_t nr, int64_t n) {
    for (int64_t i = 0; i < nr; i++) {
        if (r[i].off < 0 || r[i].n < 0 || r[i].off > n - r[i].n)
            return ds4_fail(DS4_ERR_ARG, "adamw: range [%lld, %lld) is outside the %lld elements of the state",
                            (long long)r[i].off, (long long)(r[i].off + r[i].n), (long long)n);
        if (i > 0 && r[i].off < r[i - 1].off + r[i - 1].n)
            return ds4_fail(DS4_ERR_ARG, "adamw: ranges [%lld, %lld) and [%lld, %lld) overlap",
                            (long long)r[i - 1].off, (long long)(r[i - 1].off + r[i - 1].n), (long long)r[i].off,
                            (long long)(r[i].off + r[i].n));
    }
    return DS4_OK;
}

ds4_status ds4_adamw_set_ranges(ds4_adamw *o, const ds4_adamw_range *r, int64_t nr) {
    if (nr < 0) return ds4_fail(DS4_ERR_ARG, "adamw: %lld ranges", (long long)nr);
    ds4_adamw_range *sorted = ds4_alloc(DS4_MEM_OTHER, (size_t)nr * sizeof *sorted);
    if (!sorted) return ds4_fail(DS4_ERR_OOM, "out of memory for %lld optimizer ranges", (long long)nr);
    int64_t ns = 0; /* the non-empty ones: an empty range has no element to rule */
    for (int64_t i = 0; i < nr; i++)
        if (r[i].n != 0) sorted[ns++] = r[i];
    nr = ns;
    qsort(sorted, (size_t)nr, sizeof *sorted, range_cmp);
    ds4_status st = ranges_check(sorted, nr, o->n);
    ds4_adamw_range *runs = NULL;
    if (st == DS4_OK && !(runs = ds4_alloc(DS4_MEM_OTHER, (size_t)cover(sorted, nr, o->n, NULL) * sizeof *runs)))
        st = ds4_fail(DS4_ERR_OOM, "out of memory for %lld optimizer ranges", (long long)nr);
    if (st == DS4_OK) {
        ds4_free(o->ranges);
        o->ranges = runs;
        o->nranges = cover(sorted, nr, o->n, runs);
    }
    ds4_free(sorted);
    return st;
}

/* The rules of the model's float parameters, from its table (offsets into the flat layout); with
 * o->muon the Muon group's matrices marked as Muon's. */
static ds4_status ranges_from_model(ds4_adamw *o, ds4_model *m) {
    const float *base = ds4_model_params_flat(m);
    ds4_adamw_range *r = ds4_alloc(DS4_MEM_OTHER, (size_t)ds4_model_nparams(m) * sizeof *r);
    if (!r) return ds4_fail(DS4_ERR_OOM, "out of memory for the optimizer ranges");
    int64_t nr = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (ds4_param_in_flat(p))
            r[nr++] = (ds4_adamw_range){.off = p->data - base, .n = p->numel, .decay = !p->no_decay,
                                        .frozen = p->no_grad, .muon = o->muon && ds4_param_is_muon(p)};
    }
    ds4_status st = ds4_adamw_set_ranges(o, r, nr);
    ds4_free(r);
    return st;
}

ds4_status ds4_adamw_init_n(ds4_adamw *o, int64_t n) {
    state_reset(o, n);
    ds4_status st = ds4_adamw_set_ranges(o, NULL, 0);
    for (int k = 0; k < S_COUNT && st == DS4_OK; k++) {
        float *p = ds4_calloc(DS4_MEM_OPTIM, (size_t)n * sizeof(float));
        if (!p) st = ds4_fail(DS4_ERR_OOM, "out of memory for the optimizer state (%lld parameters)", (long long)n);
        arr_set_mem(o, k, p);
    }
    if (st != DS4_OK) ds4_adamw_free(o);
    return st;
}

ds4_status ds4_adamw_group_muon(ds4_adamw *o, ds4_model *m) {
    o->muon = true;
    return ranges_from_model(o, m);
}

ds4_status ds4_adamw_init(ds4_adamw *o, ds4_model *m) {
    DS4_TRY(ds4_adamw_init_n(o, ds4_model_numel(m)));
    ds4_status st = ranges_from_model(o, m);
    if (st != DS4_OK) ds4_adamw_free(o);
    return st;
}

void ds4_adamw_free(ds4_adamw *o) {
    for (int k = 0; k < S_COUNT; k++) {
        float *mem = arr_mem(o, k);
        if (mem) ds4_free(mem);
        else if (o->store) ds4_offload_drop(o->store, arr_h(o, k)); /* -1 (never made): no-op */
    }
    ds4_free(o->ranges);
    memset(o, 0, sizeof *o);
}

/* ------------------------------------------------------------------ the update */
/* Per-step constants, the same for every element. */
typedef struct {
    float b1, b2, eps, step_size, inv_sqrt_bc2, decay;
} adamw_k;

static adamw_k adamw_consts(int64_t step, const ds4_adamw_cfg *c, double lr) {
    const double bc1 = 1.0 - pow(c->beta1, (double)step), bc2 = 1.0 - pow(c->beta2, (double)step);
    return (adamw_k){.b1 = (float)c->beta1, .b2 = (float)c->beta2, .eps = (float)c->eps,
                     .step_size = (float)(lr / bc1), .inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2)),
                     .decay = (float)(lr * c->weight_decay)};
}

/* The update of n trained elements of one rule. The resident and the swapped step both run exactly
 * this per element, so their bits agree whatever the chunking and the split over threads. */
static void adamw_update(const adamw_k *k, int64_t n, float *m, float *v, bool decay, float *w, const float *g) {
    for (int64_t i = 0; i < n; i++) {
        float gi = g[i];
        m[i] = k->b1 * m[i] + (1.0f - k->b1) * gi;
        v[i] = k->b2 * v[i] + (1.0f - k->b2) * gi * gi;
        float denom = sqrtf(v[i]) * k->inv_sqrt_bc2 + k->eps;
        if (decay) w[i] -= k->decay * w[i];
        w[i] -= k->step_size * m[i] / denom;
    }
}

/* The first run of o->ranges that holds element i (0 <= i < n). */
static int64_t run_at(const ds4_adamw *o, int64_t i) {
    int64_t lo = 0, hi = o->nranges - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (o->ranges[mid].off <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* Elements [a, b) of a span that starts at element i0 (m, v, w, g point at i0), each under the rule of
 * its run. */
static void update_part(const ds4_adamw *o, const adamw_k *k, int64_t i0, int64_t a, int64_t b, float *m, float *v,
                        float *w, const float *g) {
    for (int64_t r = a < b ? run_at(o, a) : o->nranges; r < o->nranges && o->ranges[r].off < b; r++) {
        const ds4_adamw_range *q = &o->ranges[r];
        const int64_t x = q->off > a ? q->off : a, y = q->off + q->n < b ? q->off + q->n : b;
        if (!q->frozen && !q->muon) adamw_update(k, y - x, m + (x - i0), v + (x - i0), q->decay, w + (x - i0), g + (x - i0));
    }
}

/* Elements [i0, i0 + n): one parallel region, each thread an equal share walking the runs it meets
 * (small spans on one thread: a parallel region per few KiB costs more than it saves). */
static void update_span(const ds4_adamw *o, const adamw_k *k, int64_t i0, int64_t n, float *m, float *v, float *w,
                        const float *g) {
#pragma omp parallel if (n >= 1 << 15)
    {
        const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
        update_part(o, k, i0, i0 + n * t / T, i0 + n * (t + 1) / T, m, v, w, g);
    }
}

/* Elements [i0, i0 + n) of moment k, from memory or the store, into buf / back from buf. */
static ds4_status span_read(const ds4_adamw *o, int k, int64_t i0, int64_t n, float *buf) {
    if (o->plan) return DS4_OK;
    const float *mem = arr_mem(o, k);
    if (mem) {
        memcpy(buf, mem + i0, (size_t)n * sizeof(float));
        return DS4_OK;
    }
    return ds4_offload_read(o->store, arr_h(o, k), (size_t)i0 * sizeof(float), buf, (size_t)n * sizeof(float));
}
static ds4_status span_write(ds4_adamw *o, int k, int64_t i0, int64_t n, const float *buf) {
    if (o->plan) return DS4_OK;
    float *mem = arr_mem(o, k);
    if (mem) {
        memcpy(mem + i0, buf, (size_t)n * sizeof(float));
        return DS4_OK;
    }
    return ds4_offload_write(o->store, arr_h(o, k), (size_t)i0 * sizeof(float), buf, (size_t)n * sizeof(float));
}

/* Swapped state: chunk by chunk, read m and v, update, write them back. The two buffers (o->chunk
 * elements each, 8 bytes per element) are all the optimizer holds in memory. */
static ds4_status step_swapped(ds4_adamw *o, float *w, const float *g, const adamw_k *k) {
    const int64_t C = o->n < o->chunk ? o->n : o->chunk;
    float *buf[S_COUNT];
    ds4_status st = DS4_OK;
    for (int a = 0; a < S_COUNT; a++)
        if (!(buf[a] = ds4_alloc(DS4_MEM_OPTIM, (size_t)C * sizeof(float))))
            st = ds4_fail(DS4_ERR_OOM, "swap-optimizer: out of memory for %lld-element update buffers", (long long)C);
    for (int64_t i0 = 0; i0 < (o->plan ? 0 : o->n) && st == DS4_OK; i0 += C) {
        const int64_t n = o->n - i0 < C ? o->n - i0 : C;
        for (int a = 0; a < S_COUNT && st == DS4_OK; a++) st = span_read(o, a, i0, n, buf[a]);
        if (st != DS4_OK) break;
        update_span(o, k, i0, n, buf[S_M], buf[S_V], w + i0, g + i0);
        for (int a = 0; a < S_COUNT && st == DS4_OK; a++) st = span_write(o, a, i0, n, buf[a]);
    }
    for (int a = 0; a < S_COUNT; a++) ds4_free(buf[a]);
    return st == DS4_OK ? DS4_OK : ds4_fail_prefix(st, "swap-optimizer step %lld", (long long)o->step);
}

ds4_status ds4_adamw_step(ds4_adamw *o, ds4_model *m, const ds4_adamw_cfg *c, double lr) {
    return ds4_adamw_step_flat(o, ds4_model_params_flat(m), ds4_model_grads_flat(m), c, lr);
}

ds4_status ds4_adamw_step_flat(ds4_adamw *o, float *w, const float *g, const ds4_adamw_cfg *c, double lr) {
    const bool resident = o->m && o->v;
    if (o->plan && resident) return DS4_OK;
    const adamw_k k = adamw_consts(o->step + 1, c, lr);
    ds4_status st = resident ? DS4_OK : step_swapped(o, w, g, &k);
    if (resident) update_span(o, &k, 0, o->n, o->m, o->v, w, g);
    if (st == DS4_OK && !o->plan) o->step++;
    return st;
}

/* ------------------------------------------------------------------ --swap-optimizer */
static int64_t chunk_elems(size_t chunk_bytes) {
    const size_t per = 2 * sizeof(float); /* m, v */
    const int64_t n = (int64_t)((chunk_bytes ? chunk_bytes : DS4_ADAMW_SWAP_CHUNK) / per);
    return n > 0 ? n : 1;
}

ds4_status ds4_adamw_swap_out(ds4_adamw *o, ds4_offload *store, size_t chunk_bytes) {
    if (o->store && store && store != o->store)
        return ds4_fail(DS4_ERR_ARG, "swap-optimizer: the state is already in the offload store in %s",
                        ds4_offload_dir(o->store));
    if (!o->store && !store) return ds4_fail(DS4_ERR_ARG, "swap-optimizer: no offload store given");
    if (!o->store) o->store = store;
    if (chunk_bytes || !o->chunk) o->chunk = chunk_elems(chunk_bytes);
    for (int k = 0; k < S_COUNT; k++) {
        float *mem = arr_mem(o, k);
        if (!mem) continue;
        DS4_TRY(ds4_offload_put(o->store, DS4_MEM_OPTIM, mem, (size_t)o->n * sizeof(float), arr_handle(o, k)));
        ds4_free(mem);
        arr_set_mem(o, k, NULL);
    }
    return DS4_OK;
}

ds4_status ds4_adamw_swap_in(ds4_adamw *o) {
    for (int k = 0; k < S_COUNT && o->store; k++) {
        if (arr_mem(o, k)) continue;
        float *p = ds4_alloc(DS4_MEM_OPTIM, (size_t)o->n * sizeof(float));
        if (!p) return ds4_fail(DS4_ERR_OOM, "swap-optimizer: out of memory bringing back %lld moments", (long long)o->n);
        ds4_status st = ds4_offload_get(o->store, arr_h(o, k), p);
        if (st != DS4_OK) {
            ds4_free(p);
            return st;
        }
        ds4_offload_drop(o->store, arr_h(o, k));
        *arr_handle(o, k) = -1;
        arr_set_mem(o, k, p);
    }
    return DS4_OK;
}

ds4_status ds4_adamw_init_n_swapped(ds4_adamw *o, int64_t n, ds4_offload *store, size_t chunk_bytes) {
    state_reset(o, n);
    o->store = store;
    o->chunk = chunk_elems(chunk_bytes);
    ds4_status st = ds4_adamw_set_ranges(o, NULL, 0);
    for (int k = 0; k < S_COUNT && st == DS4_OK; k++)
        st = ds4_offload_alloc(store, DS4_MEM_OPTIM, (size_t)n * sizeof(float), arr_handle(o, k));
    if (st != DS4_OK) ds4_adamw_free(o);
    return st;
}

ds4_status ds4_adamw_init_swapped(ds4_adamw *o, ds4_model *m, ds4_offload *store, size_t chunk_bytes) {
    DS4_TRY(ds4_adamw_init_n_swapped(o, ds4_model_numel(m), store, chunk_bytes));
    ds4_status st = ranges_from_model(o, m);
    if (st != DS4_OK) ds4_adamw_free(o);
    return st;
}

static ds4_status moment_range(const ds4_adamw *o, int which, int64_t i0, int64_t n) {
    if ((which != 0 && which != 1) || i0 < 0 || n < 0 || i0 > o->n || n > o->n - i0)
        return ds4_fail(DS4_ERR_ARG, "adamw moment %d: elements [%lld, %lld) outside [0, %lld)", which, (long long)i0,
                        (long long)(i0 + n), (long long)o->n);
    return DS4_OK;
}

ds4_status ds4_adamw_moment_read(const ds4_adamw *o, int which, int64_t i0, int64_t n, float *dst) {
    DS4_TRY(moment_range(o, which, i0, n));
    return span_read(o, which == 0 ? S_M : S_V, i0, n, dst);
}

ds4_status ds4_adamw_moment_write(ds4_adamw *o, int which, int64_t i0, int64_t n, const float *src) {
    DS4_TRY(moment_range(o, which, i0, n));
    return span_write(o, which == 0 ? S_M : S_V, i0, n, src);
}

/* ------------------------------------------------------------------ optim.state */
static const char *const k_moment_names[2] = {"adamw.m", "adamw.v"};

/* Streams moment `which` into the writer: straight from memory, or through buf [C] from the store. */
static ds4_status moment_put(const ds4_adamw *o, int which, ds4_st_writer *w, float *buf, int64_t C) {
    const float *mem = which == 0 ? o->m : o->v;
    if (mem) return ds4_st_writer_put(w, mem, (size_t)o->n * sizeof(float));
    for (int64_t i0 = 0; i0 < o->n; i0 += C) {
        const int64_t n = o->n - i0 < C ? o->n - i0 : C;
        DS4_TRY(ds4_adamw_moment_read(o, which, i0, n, buf));
        DS4_TRY(ds4_st_writer_put(w, buf, (size_t)n * sizeof(float)));
    }
    return DS4_OK;
}

ds4_status ds4_adamw_state_save(const ds4_adamw *o, const char *path) {
    const int64_t C = o->chunk > 0 ? o->chunk : chunk_elems(0);
    float *buf = ds4_alloc(DS4_MEM_OPTIM, (size_t)C * sizeof(float));
    ds4_st_writer *w = NULL;
    if (!buf) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the optimizer save buffer", path);
    ds4_status st = ds4_st_writer_new(&w);
    int64_t shape[1] = {o->n}, one = 1;
    /* the order ds4_st_writer_write lays these out in (8-byte elements first): the same bytes as before */
    if (st == DS4_OK) st = ds4_st_writer_declare(w, "adamw.step", DS4_I64, 1, &one);
    if (st == DS4_OK && o->muon) st = ds4_st_writer_declare(w, DS4_CKPT_MUON_MARK, DS4_I64, 1, &one);
    for (int k = 0; k < 2 && st == DS4_OK; k++) st = ds4_st_writer_declare(w, k_moment_names[k], DS4_F32, 1, shape);
    if (st == DS4_OK) st = ds4_st_writer_begin(w, path);
    if (st == DS4_OK) st = ds4_st_writer_put(w, &o->step, sizeof o->step);
    if (st == DS4_OK && o->muon) st = ds4_st_writer_put(w, &o->step, sizeof o->step);
    for (int k = 0; k < 2 && st == DS4_OK; k++) st = moment_put(o, k, w, buf, C);
    if (st == DS4_OK) st = ds4_st_writer_finish(w);
    ds4_st_writer_free(w);
    ds4_free(buf);
    return st;
}

/* Moment `which` from the file: into memory as before, or in chunks from the mapping into the store
 * (each chunk's pages are dropped once copied, so the load holds no more than a chunk). */
static ds4_status moment_get(ds4_adamw *o, int which, const ds4_st_file *f) {
    const char *name = k_moment_names[which];
    int64_t shape[1] = {o->n};
    float *mem = which == 0 ? o->m : o->v;
    if (mem) return ds4_st_read_f32(f, name, 1, shape, mem);
    const ds4_st_entry *e = ds4_st_find(f, name);
    if (!e) return ds4_fail(DS4_ERR_MISSING, "%s: tensor %s not found", ds4_st_path(f), name);
    DS4_TRY(ds4_st_check_shape(f, e, 1, shape));
    if (e->dtype != DS4_F32)
        return ds4_fail(DS4_ERR_SHAPE, "%s: tensor %s: expected F32, got %s", ds4_st_path(f), name,
                        ds4_dtype_name(e->dtype));
    const float *src = ds4_st_bytes(f, e);
    const int64_t C = o->chunk > 0 ? o->chunk : chunk_elems(0);
    for (int64_t i0 = 0; i0 < o->n; i0 += C) {
        const int64_t n = o->n - i0 < C ? o->n - i0 : C;
        DS4_TRY(ds4_adamw_moment_write(o, which, i0, n, src + i0));
        ds4_st_release(f, e->begin + (uint64_t)i0 * sizeof(float), e->begin + (uint64_t)(i0 + n) * sizeof(float));
    }
    return DS4_OK;
}

ds4_status ds4_adamw_state_load(ds4_adamw *o, const char *path) {
    ds4_st_file *f;
    DS4_TRY(ds4_st_open(path, &f));
    int64_t one = 1, step = 0;
    ds4_status st = moment_get(o, 0, f);
    if (st == DS4_OK) st = moment_get(o, 1, f);
    if (st == DS4_OK) st = ds4_st_read_i64(f, "adamw.step", 1, &one, &step);
    if (st == DS4_OK) o->step = step;
    ds4_st_close(f);
    return st;
}

/* Each piece of an FSDP shard as an AdamW range in shard offsets: counted (r NULL) or written. */
typedef struct {
    ds4_adamw_range *r;
    int64_t n;
    bool muon;
} range_ctx;
static void range_piece(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    range_ctx *c = ctx;
    if (c->r)
        c->r[c->n] = (ds4_adamw_range){.off = s0, .n = k1 - k0, .decay = !p->no_decay, .frozen = p->no_grad,
                                       .muon = c->muon && ds4_param_is_muon(p)};
    c->n++;
}

ds4_status ds4_fsdp_adamw_ranges(const ds4_fsdp *f, ds4_adamw *o) {
    const int64_t ns = ds4_fsdp_shard_numel(f);
    if (o->n != ns)
        return ds4_fail(DS4_ERR_ARG, "fsdp: an optimizer state of %lld elements for a shard of %lld", (long long)o->n,
                        (long long)ns);
    range_ctx c = {.muon = o->muon};
    ds4_fsdp_for_each_piece(f, range_piece, &c);
    c.r = ds4_alloc(DS4_MEM_OTHER, (size_t)c.n * sizeof *c.r);
    if (!c.r) return ds4_fail(DS4_ERR_OOM, "fsdp: out of memory for %lld optimizer ranges", (long long)c.n);
    c.n = 0;
    ds4_fsdp_for_each_piece(f, range_piece, &c);
    ds4_status st = ds4_adamw_set_ranges(o, c.r, c.n);
    ds4_free(c.r);
    return st;
}

double ds4_clip_grad_norm(ds4_model *m, double max_norm) {
    float *g = ds4_model_grads_flat(m);
    const int64_t n = ds4_model_numel(m);
    double norm = sqrt(ds4_sumsq(g, n));
    ds4_clip_scale(g, n, max_norm, norm);
    return norm;
}

void ds4_router_bias_update(ds4_model *m, const int64_t *loads, double gamma) {
    const ds4_config *c = ds4_model_config(m);
    const int64_t E = c->n_routed_experts;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        int64_t b = ds4_param_router_block(c, p);
        if (b >= 0) ds4_router_bias_rule(loads + b * E, E, gamma, 0, E, p->data);
    }
}

double ds4_lr_at(const ds4_lr_schedule *s, int64_t step) {
    if (s->warmup_steps > 0 && step <= s->warmup_steps) return s->lr * (double)step / (double)s->warmup_steps;
    const int64_t d0 = s->decay_start > s->warmup_steps ? s->decay_start : s->warmup_steps;
    if (s->decay == DS4_DECAY_NONE || s->total_steps <= d0 || step <= d0) return s->lr;
    double prog = (double)(step - d0) / (double)(s->total_steps - d0);
    if (prog > 1) prog = 1;
    double f = s->decay == DS4_DECAY_COSINE ? 0.5 * (1.0 + cos(M_PI * prog)) : 1.0 - prog;
    return s->min_lr + (s->lr - s->min_lr) * f;
}
