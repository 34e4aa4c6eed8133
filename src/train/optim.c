/* AdamW with fp32 master weights and moments, gradient clipping, the router bias rule, LR schedule. */
#include "ds4/train.h"

#include "ds4/io.h"
#include "ds4/offload.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* The four state arrays, by index: resident pointer (NULL: in o->store) and store handle. */
enum { S_M = 0, S_V, S_DECAY, S_FROZEN, S_COUNT };
static const size_t k_elem[S_COUNT] = {sizeof(float), sizeof(float), 1, 1};

static void *arr_mem(const ds4_adamw *o, int k) {
    return k == S_M ? (void *)o->m : k == S_V ? (void *)o->v : k == S_DECAY ? (void *)o->decay : (void *)o->frozen;
}
static int64_t *arr_handle(ds4_adamw *o, int k) {
    return k == S_M ? &o->h_m : k == S_V ? &o->h_v : k == S_DECAY ? &o->h_decay : &o->h_frozen;
}
static int64_t arr_h(const ds4_adamw *o, int k) {
    return k == S_M ? o->h_m : k == S_V ? o->h_v : k == S_DECAY ? o->h_decay : o->h_frozen;
}
static void arr_set_mem(ds4_adamw *o, int k, void *p) {
    if (k == S_M) o->m = p;
    else if (k == S_V) o->v = p;
    else if (k == S_DECAY) o->decay = p;
    else o->frozen = p;
}

static void state_reset(ds4_adamw *o, int64_t n) {
    memset(o, 0, sizeof *o);
    o->n = n;
    for (int k = 0; k < S_COUNT; k++) *arr_handle(o, k) = -1;
}

ds4_status ds4_adamw_init_n(ds4_adamw *o, int64_t n) {
    state_reset(o, n);
    for (int k = 0; k < S_COUNT; k++) {
        void *p = ds4_calloc(DS4_MEM_OPTIM, (size_t)n * k_elem[k]);
        if (!p) {
            ds4_adamw_free(o);
            return ds4_fail(DS4_ERR_OOM, "out of memory for the optimizer state (%lld parameters)", (long long)n);
        }
        arr_set_mem(o, k, p);
    }
    return DS4_OK;
}

/* decay / frozen from the parameter table (both resident). */
static void fill_masks(ds4_adamw *o, ds4_model *m) {
    const float *base = ds4_model_params_flat(m);
    for (int64_t i = 0; i < (ds4_shape_only() ? 0 : ds4_model_nparams(m)); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (p->is_int) continue;
        int64_t off = p->data - base;
        memset(o->decay + off, p->no_decay ? 0 : 1, (size_t)p->numel);
        memset(o->frozen + off, p->no_grad ? 1 : 0, (size_t)p->numel);
    }
}

ds4_status ds4_adamw_init(ds4_adamw *o, ds4_model *m) {
    DS4_TRY(ds4_adamw_init_n(o, ds4_model_numel(m)));
    fill_masks(o, m);
    return DS4_OK;
}

void ds4_adamw_free(ds4_adamw *o) {
    for (int k = 0; k < S_COUNT; k++) {
        void *mem = arr_mem(o, k);
        if (mem) ds4_free(mem);
        else if (o->store) ds4_offload_drop(o->store, arr_h(o, k)); /* -1 (never made): no-op */
    }
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

/* The update of n elements. The resident and the swapped step both run exactly this per element, so
 * their bits agree whatever the chunking. */
static void adamw_update(const adamw_k *k, int64_t n, float *m, float *v, const uint8_t *decay,
                         const uint8_t *frozen, float *w, const float *g) {
    /* small chunks run on one thread: a parallel region per few KiB costs more than it saves */
#pragma omp parallel for schedule(static) if (n >= 1 << 15)
    for (int64_t i = 0; i < n; i++) {
        if (frozen[i]) continue;
        float gi = g[i];
        m[i] = k->b1 * m[i] + (1.0f - k->b1) * gi;
        v[i] = k->b2 * v[i] + (1.0f - k->b2) * gi * gi;
        float denom = sqrtf(v[i]) * k->inv_sqrt_bc2 + k->eps;
        if (decay[i]) w[i] -= k->decay * w[i];
        w[i] -= k->step_size * m[i] / denom;
    }
}

/* Elements [i0, i0 + n) of state array k, from memory or the store, into buf / back from buf. */
static ds4_status span_read(const ds4_adamw *o, int k, int64_t i0, int64_t n, void *buf) {
    if (ds4_shape_only()) return DS4_OK;
    const void *mem = arr_mem(o, k);
    if (mem) {
        memcpy(buf, (const char *)mem + (size_t)i0 * k_elem[k], (size_t)n * k_elem[k]);
        return DS4_OK;
    }
    return ds4_offload_read(o->store, arr_h(o, k), (size_t)i0 * k_elem[k], buf, (size_t)n * k_elem[k]);
}
static ds4_status span_write(ds4_adamw *o, int k, int64_t i0, int64_t n, const void *buf) {
    if (ds4_shape_only()) return DS4_OK;
    void *mem = arr_mem(o, k);
    if (mem) {
        memcpy((char *)mem + (size_t)i0 * k_elem[k], buf, (size_t)n * k_elem[k]);
        return DS4_OK;
    }
    return ds4_offload_write(o->store, arr_h(o, k), (size_t)i0 * k_elem[k], buf, (size_t)n * k_elem[k]);
}

/* Swapped state: chunk by chunk, read m, v and the masks, update, write m and v back. The buffers
 * (o->chunk elements of each array) are all the optimizer holds in memory. */
static ds4_status step_swapped(ds4_adamw *o, float *w, const float *g, const adamw_k *k) {
    const int64_t C = o->n < o->chunk ? o->n : o->chunk;
    void *buf[S_COUNT];
    ds4_status st = DS4_OK;
    for (int a = 0; a < S_COUNT; a++)
        if (!(buf[a] = ds4_alloc(DS4_MEM_OPTIM, (size_t)C * k_elem[a])))
            st = ds4_fail(DS4_ERR_OOM, "swap-optimizer: out of memory for %lld-element update buffers", (long long)C);
    for (int64_t i0 = 0; i0 < (ds4_shape_only() ? 0 : o->n) && st == DS4_OK; i0 += C) {
        const int64_t n = o->n - i0 < C ? o->n - i0 : C;
        for (int a = 0; a < S_COUNT && st == DS4_OK; a++) st = span_read(o, a, i0, n, buf[a]);
        if (st != DS4_OK) break;
        adamw_update(k, n, buf[S_M], buf[S_V], buf[S_DECAY], buf[S_FROZEN], w + i0, g + i0);
        st = span_write(o, S_M, i0, n, buf[S_M]);
        if (st == DS4_OK) st = span_write(o, S_V, i0, n, buf[S_V]);
    }
    for (int a = 0; a < S_COUNT; a++) ds4_free(buf[a]);
    return st == DS4_OK ? DS4_OK : ds4_fail_prefix(st, "swap-optimizer step %lld", (long long)o->step);
}

ds4_status ds4_adamw_step(ds4_adamw *o, ds4_model *m, const ds4_adamw_cfg *c, double lr) {
    return ds4_adamw_step_flat(o, ds4_model_params_flat(m), ds4_model_grads_flat(m), c, lr);
}

ds4_status ds4_adamw_step_flat(ds4_adamw *o, float *w, const float *g, const ds4_adamw_cfg *c, double lr) {
    const bool resident = o->m && o->v && o->decay && o->frozen;
    if (ds4_shape_only() && resident) return DS4_OK;
    const adamw_k k = adamw_consts(o->step + 1, c, lr);
    ds4_status st = resident ? DS4_OK : step_swapped(o, w, g, &k);
    if (resident) adamw_update(&k, o->n, o->m, o->v, o->decay, o->frozen, w, g);
    if (st == DS4_OK && !ds4_shape_only()) o->step++;
    return st;
}

/* ------------------------------------------------------------------ --swap-optimizer */
static int64_t chunk_elems(size_t chunk_bytes) {
    const size_t per = 2 * sizeof(float) + 2; /* m, v, decay, frozen */
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
        void *mem = arr_mem(o, k);
        if (!mem) continue;
        DS4_TRY(ds4_offload_put(o->store, DS4_MEM_OPTIM, mem, (size_t)o->n * k_elem[k], arr_handle(o, k)));
        ds4_free(mem);
        arr_set_mem(o, k, NULL);
    }
    return DS4_OK;
}

ds4_status ds4_adamw_swap_in(ds4_adamw *o) {
    for (int k = S_M; k <= S_V && o->store; k++) {
        if (arr_mem(o, k)) continue;
        void *p = ds4_alloc(DS4_MEM_OPTIM, (size_t)o->n * k_elem[k]);
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

/* n elements: arrays k < in_store created zero in the store, the others zero in memory. */
static ds4_status init_split(ds4_adamw *o, int64_t n, ds4_offload *store, size_t chunk_bytes, int in_store) {
    state_reset(o, n);
    o->store = store;
    o->chunk = chunk_elems(chunk_bytes);
    ds4_status st = DS4_OK;
    for (int k = 0; k < S_COUNT && st == DS4_OK; k++) {
        void *p = NULL;
        if (k < in_store) st = ds4_offload_alloc(store, DS4_MEM_OPTIM, (size_t)n * k_elem[k], arr_handle(o, k));
        else if (!(p = ds4_calloc(DS4_MEM_OPTIM, (size_t)n * k_elem[k])))
            st = ds4_fail(DS4_ERR_OOM, "out of memory for the optimizer masks (%lld parameters)", (long long)n);
        arr_set_mem(o, k, p);
    }
    if (st != DS4_OK) ds4_adamw_free(o);
    return st;
}

ds4_status ds4_adamw_init_n_swapped(ds4_adamw *o, int64_t n, ds4_offload *store, size_t chunk_bytes) {
    return init_split(o, n, store, chunk_bytes, S_DECAY);
}

/* Mask array k := 1 on [off, off + n), through a buffer of ones [C]. */
static ds4_status mask_ones(ds4_adamw *o, int k, int64_t off, int64_t n, const uint8_t *ones, int64_t C) {
    for (int64_t i = 0; i < n; i += C) DS4_TRY(span_write(o, k, off + i, n - i < C ? n - i : C, ones));
    return DS4_OK;
}

/* The masks written straight into the store, parameter by parameter: never resident. */
static ds4_status fill_masks_swapped(ds4_adamw *o, ds4_model *m) {
    const int64_t C = o->n < o->chunk ? o->n : o->chunk;
    uint8_t *ones = ds4_alloc(DS4_MEM_OPTIM, (size_t)C);
    if (!ones) return ds4_fail(DS4_ERR_OOM, "swap-optimizer: out of memory for the mask buffer");
    if (!ds4_shape_only()) memset(ones, 1, (size_t)C);
    const float *base = ds4_model_params_flat(m);
    ds4_status st = DS4_OK;
    for (int64_t i = 0; i < (ds4_shape_only() ? 0 : ds4_model_nparams(m)) && st == DS4_OK; i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (p->is_int) continue;
        if (!p->no_decay) st = mask_ones(o, S_DECAY, p->data - base, p->numel, ones, C);
        if (p->no_grad && st == DS4_OK) st = mask_ones(o, S_FROZEN, p->data - base, p->numel, ones, C);
    }
    ds4_free(ones);
    return st;
}

ds4_status ds4_adamw_init_swapped(ds4_adamw *o, ds4_model *m, ds4_offload *store, size_t chunk_bytes) {
    DS4_TRY(init_split(o, ds4_model_numel(m), store, chunk_bytes, S_COUNT));
    ds4_status st = fill_masks_swapped(o, m);
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
    for (int k = 0; k < 2 && st == DS4_OK; k++) st = ds4_st_writer_declare(w, k_moment_names[k], DS4_F32, 1, shape);
    if (st == DS4_OK) st = ds4_st_writer_begin(w, path);
    if (st == DS4_OK) st = ds4_st_writer_put(w, &o->step, sizeof o->step);
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

double ds4_clip_grad_norm(ds4_model *m, double max_norm) {
    float *g = ds4_model_grads_flat(m);
    int64_t n = ds4_model_numel(m);
    /* fixed-size chunks summed in order: the same bits for any thread count. The partial sums of up to
     * 256 chunks at a time sit on the stack, so the norm allocates nothing and cannot fail. */
    const int64_t chunk = 1 << 16, nchunks = (n + chunk - 1) / chunk;
    if (ds4_shape_only()) return 0;
    double part[256], total = 0;
    for (int64_t c0 = 0; c0 < nchunks; c0 += 256) {
        const int64_t nc = nchunks - c0 < 256 ? nchunks - c0 : 256;
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < nc; k++) {
            int64_t c = c0 + k, end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
            double s = 0;
            for (int64_t i = c * chunk; i < end; i++) s += (double)g[i] * g[i];
            part[k] = s;
        }
        for (int64_t k = 0; k < nc; k++) total += part[k];
    }
    double norm = sqrt(total);
    if (max_norm > 0 && norm > max_norm) {
        float s = (float)(max_norm / (norm + 1e-6));
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) g[i] *= s;
    }
    return norm;
}

void ds4_router_bias_update(ds4_model *m, const int64_t *loads, double gamma) {
    const ds4_config *c = ds4_model_config(m);
    int64_t E = c->n_routed_experts, nb = c->n_layers + c->n_mtp_layers;
    char name[64];
    for (int64_t l = 0; l < nb; l++) {
        if (l < c->n_layers) snprintf(name, sizeof name, "layers.%lld.ffn.gate.bias", (long long)l);
        else snprintf(name, sizeof name, "mtp.%lld.ffn.gate.bias", (long long)(l - c->n_layers));
        ds4_param *b = ds4_model_find(m, name);
        if (!b) continue; /* hash-routed layer */
        const int64_t *ld = loads + l * E;
        double mean = 0;
        for (int64_t e = 0; e < E; e++) mean += (double)ld[e];
        mean /= (double)E;
        for (int64_t e = 0; e < E; e++) {
            double d = mean - (double)ld[e];
            b->data[e] += (float)(gamma * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0));
        }
    }
}

double ds4_lr_at(const ds4_lr_schedule *s, int64_t step) {
    if (s->warmup_steps > 0 && step <= s->warmup_steps) return s->lr * (double)step / (double)s->warmup_steps;
    if (s->decay == DS4_DECAY_NONE || s->total_steps <= s->warmup_steps) return s->lr;
    double prog = (double)(step - s->warmup_steps) / (double)(s->total_steps - s->warmup_steps);
    if (prog > 1) prog = 1;
    double f = s->decay == DS4_DECAY_COSINE ? 0.5 * (1.0 + cos(M_PI * prog)) : 1.0 - prog;
    return s->min_lr + (s->lr - s->min_lr) * f;
}
