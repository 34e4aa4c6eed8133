/* The parameter table: every tensor of a DeepSeek-V4 model under its official checkpoint name
 * (docs/dsv4-architecture.md §8.1), laid out in one flat fp32 buffer with a matching gradient
 * buffer; initialisation per docs/contract.md; load from and save to model directories. */
#include "model/param_table.h"

#include "ds4/io.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

/* Pending binding of a float parameter to its value/gradient slots. */
typedef struct {
    float **wslot, **gslot;
    int64_t offset; /* in the flat layout, region padding included */
    int64_t param;  /* index in the table */
} binding;

typedef struct {
    ds4_model *m;
    binding *binds;
    int64_t nbind, capbind;
    int64_t capreg;
    ds4_status st;
} table_builder;

/* Floats per page: in an unmapped model every region starts on a page, so mapping or unmapping one
 * region never touches its neighbours; with the bf16 copy on a page of the copy too (2 bytes each). */
#define REGION_ALIGN 1024

static int64_t region_align(const ds4_model *m) { return !m->unmapped ? 1 : m->bf16 ? 2 * REGION_ALIGN : REGION_ALIGN; }

/* Bytes of each reserved range of an unmapped model (the bf16 copy's: half). */
static size_t reserved_bytes(const ds4_model *m) { return (size_t)m->numel * sizeof(float); }

/* Starts a new region of `group` (expert -1: dense) at the current end of the flat layout. */
static void region_begin(table_builder *tb, int64_t group, int64_t expert) {
    ds4_model *m = tb->m;
    if (tb->st != DS4_OK) return;
    m->numel = (m->numel + region_align(m) - 1) / region_align(m) * region_align(m);
    if (m->nregions > 0) m->regions[m->nregions - 1].end = m->numel;
    if (!ds4_grow((void **)&m->regions, &tb->capreg, m->nregions + 1, sizeof *m->regions)) {
        tb->st = DS4_ERR_OOM;
        return;
    }
    m->regions[m->nregions++] = (ds4_region){.group = group, .expert = (int32_t)expert,
                                                .start = m->numel, .end = m->numel};
}

/* With the bf16 copy a region holds one compute dtype: the first tensor sets it, a tensor of the other
 * starts a new region of the same group and expert. */
static void region_dtype(table_builder *tb, bool bf16) {
    ds4_model *m = tb->m;
    if (!m->bf16 || tb->st != DS4_OK || m->nregions == 0) return;
    ds4_region *r = &m->regions[m->nregions - 1];
    if (r->start < m->numel && r->bf16 != bf16) region_begin(tb, r->group, r->expert);
    m->regions[m->nregions - 1].bf16 = bf16;
}

static void regions_finish(table_builder *tb) {
    ds4_model *m = tb->m;
    m->numel = (m->numel + region_align(m) - 1) / region_align(m) * region_align(m);
    if (m->nregions > 0) m->regions[m->nregions - 1].end = m->numel;
}

static ds4_param *add_entry(table_builder *tb, const param_entry *e) {
    ds4_model *m = tb->m;
    if (tb->st != DS4_OK) return NULL;
    if (m->nparams == m->cap) {
        int64_t cap = m->cap ? 2 * m->cap : 256;
        ds4_param *np = ds4_calloc(DS4_MEM_OTHER, (size_t)cap * sizeof *np);
        if (!np) {
            tb->st = DS4_ERR_OOM;
            return NULL;
        }
        if (m->params) memcpy(np, m->params, (size_t)m->nparams * sizeof *np);
        ds4_free(m->params);
        m->params = np;
        m->cap = cap;
    }
    ds4_param *p = &m->params[m->nparams++];
    snprintf(p->name, sizeof p->name, "%s", e->name);
    p->ndim = e->ndim;
    p->numel = 1;
    for (int i = 0; i < e->ndim; i++) {
        p->shape[i] = e->shape[i];
        p->numel *= e->shape[i];
    }
    return p;
}

/* Registers a float parameter; value/grad pointers are bound once the flat buffer exists. */
static ds4_param *reg(table_builder *tb, float **w, float **g, const param_entry *e) {
    ds4_param *p = add_entry(tb, e);
    if (!p) return NULL;
    if (tb->nbind == tb->capbind) {
        int64_t cap = tb->capbind ? 2 * tb->capbind : 256;
        binding *nb = ds4_alloc(DS4_MEM_OTHER, (size_t)cap * sizeof *nb);
        if (!nb) {
            tb->st = DS4_ERR_OOM;
            return NULL;
        }
        if (tb->binds) memcpy(nb, tb->binds, (size_t)tb->nbind * sizeof *nb);
        ds4_free(tb->binds);
        tb->binds = nb;
        tb->capbind = cap;
    }
    tb->binds[tb->nbind++] = (binding){w, g, tb->m->numel, tb->m->nparams - 1};
    tb->m->numel += p->numel;
    return p;
}

/* The walk's callbacks: regions start where it says, each tensor is registered with its rule's flags
 * (constants are not decayed; the router bias and tid2eid get no gradient; tid2eid is an int table
 * with no float storage). */
static void on_region(param_walk *w, int64_t group, int64_t expert) { region_begin(w->ctx, group, expert); }

static bool on_tensor(param_walk *w, const param_entry *e) {
    table_builder *tb = w->ctx;
    bool own = e->init == DS4_INIT_EXPERT_IDS || e->carried; /* storage of its own, not in the flat layout */
    if (!own) region_dtype(tb, e->gemm);
    ds4_param *p = own ? add_entry(tb, e) : reg(tb, e->w, e->g, e);
    if (p) {
        p->gemm = e->gemm;
        p->init = e->init;
        p->is_int = e->init == DS4_INIT_EXPERT_IDS;
        p->carried = e->carried;
        p->no_decay = e->init != DS4_INIT_NORMAL || e->carried;
        p->no_grad = e->init == DS4_INIT_ZERO_FROZEN || e->init == DS4_INIT_EXPERT_IDS || e->carried;
    }
    return tb->st == DS4_OK;
}

static void reg_model(table_builder *tb) {
    ds4_model *m = tb->m;
    param_walk w = {.c = &m->cfg, .W = &m->w, .G = &m->g, .ctx = tb, .region = on_region, .tensor = on_tensor};
    param_walk_run(&w);
    regions_finish(tb);
}

static ds4_status model_create(const ds4_exec *exec, const ds4_config *cfg, bool unmapped, bool bf16,
                               ds4_model **out) {
    *out = NULL;
    DS4_TRY(ds4_config_validate(cfg, "config"));
    ds4_model *m = ds4_calloc(DS4_MEM_OTHER, sizeof *m);
    if (!m) return DS4_ERR_OOM;
    m->cfg = *cfg;
    m->unmapped = unmapped;
    m->bf16 = bf16;
    m->exec = exec ? *exec : (ds4_exec){0};
    int64_t nb = n_blocks(cfg), E = cfg->n_routed_experts;
    m->w.blocks = ds4_calloc(DS4_MEM_OTHER, (size_t)nb * sizeof(block_w));
    m->g.blocks = ds4_calloc(DS4_MEM_OTHER, (size_t)nb * sizeof(block_w));
    m->tid2eid = ds4_calloc(DS4_MEM_OTHER, (size_t)nb * sizeof(int64_t *));
    if (!m->w.blocks || !m->g.blocks || !m->tid2eid) goto oom;
    for (int64_t l = 0; l < nb; l++) {
        m->w.blocks[l].experts = ds4_calloc(DS4_MEM_OTHER, (size_t)E * sizeof(expert_w));
        m->g.blocks[l].experts = ds4_calloc(DS4_MEM_OTHER, (size_t)E * sizeof(expert_w));
        if (!m->w.blocks[l].experts || !m->g.blocks[l].experts) goto oom;
    }
    table_builder tb = {.m = m};
    reg_model(&tb);
    if (tb.st != DS4_OK) {
        ds4_free(tb.binds);
        goto oom;
    }
    gemm_workspace_reserve(&m->exec);
    m->gemm_ws = true;
    if (unmapped) {
        m->flat = range_reserve(&m->exec, reserved_bytes(m)); /* pieces are made resident by ds4_model_map */
        m->gflat = range_reserve(&m->exec, reserved_bytes(m));
        if (bf16) m->hflat = range_reserve(&m->exec, reserved_bytes(m) / 2);
    } else {
        m->flat = dev_zalloc(m, DS4_MEM_PARAM, (size_t)m->numel * sizeof(float)); /* on the model's backend */
        const char *prev = ds4_mem_owner_enter(DS4_OWNER_GRAD_RESIDENT); /* memplan's split of the gradients */
        m->gflat = dev_zalloc(m, DS4_MEM_GRAD, (size_t)m->numel * sizeof(float));
        ds4_mem_owner_leave(prev);
        if (bf16) m->hflat = dev_zalloc(m, DS4_MEM_PARAM, (size_t)m->numel * sizeof(uint16_t));
    }
    if (!m->flat || !m->gflat || (bf16 && !m->hflat)) {
        ds4_free(tb.binds);
        goto oom;
    }
    /* the table and the named slots point at the same place (offsets include the region padding) */
    for (int64_t i = 0; i < tb.nbind; i++) {
        ds4_param *p = &m->params[tb.binds[i].param];
        p->data = *tb.binds[i].wslot = m->flat + tb.binds[i].offset;
        p->grad = *tb.binds[i].gslot = m->gflat + tb.binds[i].offset;
    }
    ds4_free(tb.binds);
    /* the carried tensors (fp32, no gradient) and the integer tables */
    for (int64_t i = 0; i < m->nparams; i++) {
        ds4_param *p = &m->params[i];
        if (p->carried && !(p->data = ds4_calloc(DS4_MEM_PARAM, (size_t)p->numel * sizeof(float)))) goto oom;
        if (!p->is_int) continue;
        p->idata = dev_zalloc(m, DS4_MEM_PARAM, (size_t)p->numel * sizeof(int64_t)); /* read by the router */
        if (!p->idata) goto oom;
        int64_t l = -1;
        if (sscanf(p->name, "layers.%lld.", (long long *)&l) == 1 && l >= 0 && l < nb) m->tid2eid[l] = p->idata;
    }
    *out = m;
    return DS4_OK;
oom:
    ds4_model_free(m);
    return ds4_fail(DS4_ERR_OOM, "out of memory creating the model parameter table");
}

ds4_status ds4_model_create(const ds4_exec *exec, const ds4_config *cfg, bool unmapped, ds4_model **out) {
    return model_create(exec, cfg, unmapped, false, out);
}

ds4_status ds4_model_create_bf16(const ds4_exec *exec, const ds4_config *cfg, bool unmapped, ds4_model **out) {
    return model_create(exec, cfg, unmapped, true, out);
}

static void free_range(const ds4_model *m, void *p, size_t bytes) {
    if (!p) return;
    if (m->unmapped) range_release(&m->exec, p, bytes);
    else dev_free(m, p);
}

static void unhold_all(ds4_model *m);

void ds4_model_free(ds4_model *m) {
    if (!m) return;
    unhold_all(m);
    for (int64_t i = 0; i < m->nparams; i++) {
        dev_free(m, m->params[i].idata);
        if (m->params[i].carried) ds4_free(m->params[i].data);
    }
    ds4_free(m->params);
    if (m->w.blocks)
        for (int64_t l = 0; l < n_blocks(&m->cfg); l++) ds4_free(m->w.blocks[l].experts);
    if (m->g.blocks)
        for (int64_t l = 0; l < n_blocks(&m->cfg); l++) ds4_free(m->g.blocks[l].experts);
    ds4_free(m->w.blocks);
    ds4_free(m->g.blocks);
    ds4_free(m->tid2eid);
    free_range(m, m->flat, reserved_bytes(m));
    free_range(m, m->gflat, reserved_bytes(m));
    free_range(m, m->hflat, reserved_bytes(m) / 2);
    ds4_free(m->regions);
    model_rope_free(m, &m->rope_main);
    model_rope_free(m, &m->rope_cmp);
    if (m->gemm_ws) gemm_workspace_release(&m->exec);
    ds4_free(m);
}

const ds4_config *ds4_model_config(const ds4_model *m) { return &m->cfg; }
int64_t ds4_model_nparams(const ds4_model *m) { return m->nparams; }
ds4_param *ds4_model_param(ds4_model *m, int64_t i) { return &m->params[i]; }
int64_t ds4_model_numel(const ds4_model *m) { return m->numel; }
float *ds4_model_params_flat(ds4_model *m) { return m->flat; }
float *ds4_model_grads_flat(ds4_model *m) { return m->gflat; }
uint16_t *ds4_model_bf16_flat(ds4_model *m) { return m->hflat; }

void ds4_model_pack_bf16(const ds4_model *m, uint16_t *dst, const float *src, int64_t n) {
    tensor_pack_bf16(&m->exec, dst, src, n);
}

const ds4_exec *ds4_model_exec(const ds4_model *m) { return &m->exec; }

void ds4_model_to_host(const ds4_model *m, void *dst, const void *src, size_t bytes) {
    copy_to_host(&m->exec, dst, src, bytes);
    synchronize(&m->exec);
}

void ds4_model_to_device(const ds4_model *m, void *dst, const void *src, size_t bytes) {
    copy_to_device(&m->exec, dst, src, bytes);
    synchronize(&m->exec);
}

void ds4_model_refresh_bf16(ds4_model *m) {
    if (!m->hflat) return;
    for (int64_t i = 0; i < m->nregions; i++) {
        const ds4_region *r = &m->regions[i];
        if (r->bf16 && ds4_model_region_held(m, i, false))
            tensor_pack_bf16(&m->exec, m->hflat + r->start, m->flat + r->start, r->end - r->start);
    }
}
void ds4_model_zero_grad(ds4_model *m) {
    if (!m->unmapped) tensor_zero(&m->exec, m->gflat, (size_t)m->numel * sizeof(float)); /* a plan's: skipped */
    for (int64_t i = 0; m->unmapped && i < m->nregions; i++) {
        const ds4_region *r = &m->regions[i];
        if (r->held & DS4_HELD_GRADS)
            tensor_zero(&m->exec, m->gflat + r->start, (size_t)(r->end - r->start) * sizeof(float));
    }
}

/* ------------------------------------------------------------------ resident groups (a pipeline stage) */
static uint8_t held_flag(bool grads) { return grads ? DS4_HELD_GRADS : DS4_HELD_VALUES; }

bool ds4_model_region_held(const ds4_model *m, int64_t i, bool grads) {
    if (!m->unmapped) return true;
    return i >= 0 && i < m->nregions && (m->regions[i].held & held_flag(grads)) != 0;
}

int64_t ds4_model_region_at(const ds4_model *m, int64_t i) {
    int64_t lo = 0, hi = m->nregions - 1;
    while (lo < hi) { /* the last region starting at or before i */
        const int64_t mid = lo + (hi - lo + 1) / 2;
        if (m->regions[mid].start <= i) lo = mid;
        else hi = mid - 1;
    }
    return m->nregions > 0 && i >= 0 && i < m->numel ? lo : -1;
}

bool ds4_model_param_held(const ds4_model *m, const ds4_param *p, bool grads) {
    if (!ds4_param_in_flat(p)) return !grads;
    return ds4_model_region_held(m, ds4_model_region_at(m, p->data - m->flat), grads);
}

int64_t ds4_model_held_bytes(const ds4_model *m, bool grads) {
    int64_t bytes = 0;
    for (int64_t i = 0; m->unmapped && i < m->nregions; i++) {
        const ds4_region *r = &m->regions[i];
        if (!(r->held & held_flag(grads))) continue;
        bytes += (r->end - r->start) * (int64_t)sizeof(float);
        if (!grads && m->hflat && r->bf16) bytes += (r->end - r->start) * (int64_t)sizeof(uint16_t);
    }
    return bytes;
}

/* Region i's values (and bf16 copy) or gradients mapped for good and marked (a failure maps nothing), or
 * given back. */
static ds4_status region_hold(ds4_model *m, int64_t i, bool grads) {
    ds4_region *r = &m->regions[i];
    if (r->held & held_flag(grads)) return DS4_OK;
    DS4_TRY(ds4_model_map(m, r->start, r->end, grads));
    ds4_status st = !grads && m->hflat && r->bf16 ? ds4_model_map_bf16(m, r->start, r->end) : DS4_OK;
    if (st != DS4_OK) ds4_model_unmap(m, r->start, r->end, grads);
    else r->held |= held_flag(grads);
    return st;
}

static void region_unhold(ds4_model *m, int64_t i) {
    ds4_region *r = &m->regions[i];
    if (r->held & DS4_HELD_GRADS) ds4_model_unmap(m, r->start, r->end, true);
    if ((r->held & DS4_HELD_VALUES) && m->hflat && r->bf16) ds4_model_unmap_bf16(m, r->start, r->end);
    if (r->held & DS4_HELD_VALUES) ds4_model_unmap(m, r->start, r->end, false);
    r->held = 0;
}

ds4_status ds4_model_hold(ds4_model *m, int64_t group, bool grads) {
    if (!m->unmapped || group < 0 || group >= ds4_model_ngroups(m))
        return ds4_fail(DS4_ERR_INTERNAL, "model hold: group %lld of %s model", (long long)group,
                        m->unmapped ? "an unmapped" : "a whole");
    for (int64_t i = 0; i < m->nregions; i++) {
        if (m->regions[i].group != group) continue;
        DS4_TRY(region_hold(m, i, false));
        if (grads) {
            const char *prev = ds4_mem_owner_enter(DS4_OWNER_GRAD_RESIDENT); /* as a whole model's gradients */
            ds4_status st = region_hold(m, i, true);
            ds4_mem_owner_leave(prev);
            DS4_TRY(st);
        }
    }
    return DS4_OK;
}

static void unhold_all(ds4_model *m) {
    for (int64_t i = 0; m->unmapped && i < m->nregions; i++) region_unhold(m, i);
}

int64_t ds4_model_ngroups(const ds4_model *m) { return m->cfg.n_layers + 2 + (m->cfg.n_mtp_layers > 0); }
int64_t ds4_model_nregions(const ds4_model *m) { return m->nregions; }
const ds4_region *ds4_model_region(const ds4_model *m, int64_t i) { return &m->regions[i]; }

static ds4_status check_range(const ds4_model *m, int64_t start, int64_t end) {
    if (!m->unmapped || start < 0 || end > m->numel || start > end || start % region_align(m) ||
        (end % region_align(m) && end != m->numel))
        return ds4_fail(DS4_ERR_INTERNAL, "model map: [%lld, %lld) is not a page-aligned range of an unmapped model",
                        (long long)start, (long long)end);
    return DS4_OK;
}

/* Bytes of [start, end) of the fp32 values or gradients: what map and unmap count. */
static size_t range_bytes(int64_t start, int64_t end) { return (size_t)(end - start) * sizeof(float); }

ds4_status ds4_model_map(ds4_model *m, int64_t start, int64_t end, bool grad) {
    DS4_TRY(check_range(m, start, end));
    size_t bytes = range_bytes(start, end);
    if (bytes == 0) return DS4_OK;
    if (!range_map(&m->exec, (grad ? m->gflat : m->flat) + start, bytes, grad ? DS4_MEM_GRAD : DS4_MEM_PARAM))
        return ds4_fail(DS4_ERR_OOM, "out of memory mapping %zu bytes of %s", bytes, grad ? "gradients" : "parameters");
    return DS4_OK;
}

void ds4_model_unmap(ds4_model *m, int64_t start, int64_t end, bool grad) {
    if (check_range(m, start, end) != DS4_OK) return;
    size_t bytes = range_bytes(start, end);
    if (bytes == 0) return;
    range_unmap(&m->exec, (grad ? m->gflat : m->flat) + start, bytes, grad ? DS4_MEM_GRAD : DS4_MEM_PARAM);
}

void ds4_model_grads_hand_over(ds4_model *m, int64_t start, int64_t end, const char *from, const char *to) {
    if (check_range(m, start, end) == DS4_OK) ds4_mem_owner_move(DS4_MEM_GRAD, from, to, (int64_t)range_bytes(start, end));
}

ds4_status ds4_model_map_bf16(ds4_model *m, int64_t start, int64_t end) {
    DS4_TRY(check_range(m, start, end));
    size_t bytes = (size_t)(end - start) * sizeof(uint16_t);
    if (!m->hflat) return ds4_fail(DS4_ERR_INTERNAL, "model map: the model has no bf16 copy");
    if (bytes == 0) return DS4_OK;
    if (!range_map(&m->exec, m->hflat + start, bytes, DS4_MEM_PARAM))
        return ds4_fail(DS4_ERR_OOM, "out of memory mapping %zu bytes of the bf16 parameter copy", bytes);
    return DS4_OK;
}

void ds4_model_unmap_bf16(ds4_model *m, int64_t start, int64_t end) {
    if (!m->hflat || check_range(m, start, end) != DS4_OK) return;
    size_t bytes = (size_t)(end - start) * sizeof(uint16_t);
    if (bytes) range_unmap(&m->exec, m->hflat + start, bytes, DS4_MEM_PARAM);
}

ds4_param *ds4_model_find(ds4_model *m, const char *name) {
    for (int64_t i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

/* ------------------------------------------------------------------ router bias */
int64_t ds4_param_router_block(const ds4_config *c, const ds4_param *p) {
    const char *suffix = ".ffn.gate.bias";
    if (p->carried) return -1; /* a DSpark stage's router is not balanced: it does not run */
    size_t n = strlen(p->name), k = strlen(suffix);
    if (n < k || strcmp(p->name + n - k, suffix) != 0) return -1;
    long long b;
    if (sscanf(p->name, "layers.%lld.", &b) == 1) return b;
    if (sscanf(p->name, "mtp.%lld.", &b) == 1) return c->n_layers + b;
    return -1;
}

void ds4_router_bias_rule(const int64_t *loads, int64_t E, double gamma, int64_t e0, int64_t e1, float *bias) {
    double mean = 0;
    for (int64_t e = 0; e < E; e++) mean += (double)loads[e];
    mean /= (double)E;
    for (int64_t e = e0; e < e1; e++) {
        double d = mean - (double)loads[e];
        bias[e - e0] += (float)(gamma * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0));
    }
}

/* ------------------------------------------------------------------ init (docs/contract.md) */
/* Value rule of the table (ds4/tensors.h): norms and mHC scales 1, mHC base, sinks, ape and the router
 * bias 0, everything else N(0, 0.02). */
static float init_value(const ds4_param *p, uint64_t seed, uint64_t stream, int64_t i) {
    switch (p->init) {
    case DS4_INIT_ONE: return 1.0f;
    case DS4_INIT_ZERO:
    case DS4_INIT_ZERO_FROZEN: return 0.0f;
    default: return 0.02f * ds4_rng_normal(seed, stream, (uint64_t)i);
    }
}

/* ------------------------------------------------------------------ host staging
 * Parameter bytes cross the host/device boundary in chunks of at most STAGE_BYTES through one host buffer:
 * init, load and save never read or write the model's buffers from the host. */
enum { STAGE_BYTES = 1 << 20 };

/* Fills host elements [k0, k1) of a tensor into out [k1 - k0] (elements of elt bytes). */
typedef ds4_status (*stage_fill_fn)(void *ctx, int64_t k0, int64_t k1, void *out);

/* dst [n] on the model's device = fill(...) chunk by chunk; a chunk is a multiple of `unit` elements (a
 * row of the file), at least one unit. A plan counts the buffer the real run holds and fills nothing (it
 * does not allocate it: a plan of V4-Pro stages ~10^5 tensors, and host pages per tensor cost seconds). */
static ds4_status stage_in(const ds4_model *m, void *dst, int64_t n, size_t elt, int64_t unit, stage_fill_fn fill,
                           void *ctx) {
    if (n == 0) return DS4_OK;
    int64_t chunk = (int64_t)(STAGE_BYTES / elt) / unit * unit;
    if (chunk < unit) chunk = unit;
    if (chunk > n) chunk = n;
    if (m->exec.plan) {
        ds4_mem_track(DS4_MEM_OTHER, (int64_t)((size_t)chunk * elt));
        ds4_mem_track(DS4_MEM_OTHER, -(int64_t)((size_t)chunk * elt));
        return DS4_OK;
    }
    char *buf = ds4_alloc(DS4_MEM_OTHER, (size_t)chunk * elt);
    if (!buf) return ds4_fail(DS4_ERR_OOM, "out of memory for a %lld-element parameter staging buffer", (long long)chunk);
    ds4_status st = DS4_OK;
    for (int64_t k0 = 0; k0 < n && st == DS4_OK; k0 += chunk) {
        const int64_t k1 = k0 + chunk < n ? k0 + chunk : n;
        st = fill(ctx, k0, k1, buf);
        if (st != DS4_OK) break;
        copy_to_device(&m->exec, (char *)dst + (size_t)k0 * elt, buf, (size_t)(k1 - k0) * elt);
        synchronize(&m->exec); /* the buffer is refilled next */
    }
    ds4_free(buf);
    return st;
}

/* tid2eid row: K distinct expert ids, drawn by a partial Fisher-Yates shuffle from the seed. */
typedef struct {
    const ds4_param *p;
    uint64_t seed, stream;
    int64_t E;
    int64_t *perm; /* [E] */
} tid2eid_init;

/* Rows [v0, v1) of tid2eid into out [(v1 - v0)·K] (the stage's units are rows: k0, k1 are multiples of K). */
static ds4_status fill_tid2eid(void *ctx, int64_t k0, int64_t k1, void *out) {
    const tid2eid_init *c = ctx;
    const int64_t K = c->p->shape[1], E = c->E;
    int64_t *ids = out;
    for (int64_t v = k0 / K; v < k1 / K; v++) {
        for (int64_t e = 0; e < E; e++) c->perm[e] = e;
        for (int64_t k = 0; k < K; k++) {
            int64_t j = k + (int64_t)(ds4_rng_u64(c->seed, c->stream, (uint64_t)(v * K + k)) % (uint64_t)(E - k));
            int64_t t = c->perm[k];
            c->perm[k] = c->perm[j];
            c->perm[j] = t;
            ids[v * K + k - k0] = c->perm[k];
        }
    }
    return DS4_OK;
}

static ds4_status init_tid2eid(const ds4_model *m, const ds4_param *p, uint64_t seed, uint64_t stream) {
    tid2eid_init c = {.p = p, .seed = seed, .stream = stream, .E = m->cfg.n_routed_experts};
    if (!(c.perm = ds4_alloc(DS4_MEM_OTHER, (size_t)c.E * sizeof(int64_t))))
        return ds4_fail(DS4_ERR_OOM, "out of memory initialising %s", p->name);
    ds4_status st = stage_in(m, p->idata, p->numel, sizeof(int64_t), p->shape[1], fill_tid2eid, &c);
    ds4_free(c.perm);
    return st;
}

void ds4_param_init_values(const ds4_param *p, uint64_t seed, int64_t k0, int64_t k1, float *out) {
    uint64_t stream = ds4_hash_str(p->name);
#pragma omp parallel for schedule(static)
    for (int64_t k = k0; k < k1; k++) out[k - k0] = init_value(p, seed, stream, k);
}

typedef struct {
    const ds4_param *p;
    uint64_t seed;
} float_init;
static ds4_status fill_init(void *ctx, int64_t k0, int64_t k1, void *out) {
    const float_init *c = ctx;
    ds4_param_init_values(c->p, c->seed, k0, k1, out);
    return DS4_OK;
}

ds4_status ds4_model_init_param(ds4_model *m, int64_t i, uint64_t seed) {
    ds4_param *p = &m->params[i];
    if (p->is_int) return init_tid2eid(m, p, seed, ds4_hash_str(p->name));
    float_init c = {.p = p, .seed = seed};
    return stage_in(m, p->data, p->numel, sizeof(float), 1, fill_init, &c);
}

ds4_status ds4_model_init_random(ds4_model *m, uint64_t seed) {
    for (int64_t i = 0; i < m->nparams; i++)
        if (!m->unmapped || ds4_model_param_held(m, &m->params[i], false)) DS4_TRY(ds4_model_init_param(m, i, seed));
    return DS4_OK;
}

/* ------------------------------------------------------------------ load / save */
typedef struct {
    const ds4_tensor_loc *loc;
} rows_read;
/* Elements [k0, k1) of a float tensor of the file: whole rows, decoded (dequantized) into out. */
static ds4_status fill_rows(void *ctx, int64_t k0, int64_t k1, void *out) {
    const ds4_tensor_loc *loc = ((const rows_read *)ctx)->loc;
    return ds4_tensor_loc_read_rows(loc, k0 / loc->cols, k1 / loc->cols, out);
}

typedef struct {
    const ds4_model *m;
    const ds4_model_dir *d;
    const ds4_param *p;
    int64_t *ids; /* the whole table, checked on the host */
} ids_read;
static ds4_status fill_ids(void *ctx, int64_t k0, int64_t k1, void *out) {
    const ids_read *c = ctx;
    memcpy(out, c->ids + k0, (size_t)(k1 - k0) * sizeof(int64_t));
    return DS4_OK;
}

static ds4_status load_ids(ds4_model *m, const ds4_model_dir *d, const ds4_param *p) {
    ids_read c = {.m = m, .d = d, .p = p, .ids = ds4_alloc(DS4_MEM_OTHER, (size_t)p->numel * sizeof(int64_t))};
    if (!c.ids) return ds4_fail(DS4_ERR_OOM, "%s: out of memory reading %s", ds4_model_dir_path(d), p->name);
    ds4_status st = ds4_model_dir_read_i64(d, p->name, p->ndim, p->shape, c.ids);
    for (int64_t k = 0; k < p->numel && st == DS4_OK; k++)
        if (c.ids[k] < 0 || c.ids[k] >= m->cfg.n_routed_experts)
            st = ds4_fail(DS4_ERR_FORMAT, "%s: tensor %s: expert id %lld out of range [0, %lld)", ds4_model_dir_path(d),
                          p->name, (long long)c.ids[k], (long long)m->cfg.n_routed_experts);
    if (st == DS4_OK) st = stage_in(m, p->idata, p->numel, sizeof(int64_t), 1, fill_ids, &c);
    ds4_free(c.ids);
    return st;
}

ds4_status ds4_model_load_param(ds4_model *m, const ds4_model_dir *d, int64_t i) {
    ds4_param *p = &m->params[i];
    if (p->is_int) return load_ids(m, d, p);
    ds4_tensor_loc loc;
    DS4_TRY(ds4_model_dir_locate(d, p->name, &loc));
    if (!ds4_tensor_loc_is_float(&loc)) return ds4_tensor_loc_read_rows(&loc, 0, 0, NULL); /* its dtype error */
    DS4_TRY(ds4_tensor_loc_check_shape(&loc, p->ndim, p->shape));
    if (m->exec.plan) return DS4_OK;
    rows_read c = {.loc = &loc};
    return stage_in(m, p->data, p->numel, sizeof(float), loc.cols > 0 ? loc.cols : 1, fill_rows, &c);
}

ds4_status ds4_model_load(ds4_model *m, const ds4_model_dir *d) {
    for (int64_t i = 0; i < m->nparams; i++)
        if (!m->unmapped || ds4_model_param_held(m, &m->params[i], false)) DS4_TRY(ds4_model_load_param(m, d, i));
    return DS4_OK;
}

/* Streams n elements of src (fp32 on the device) into the writer as fp32 or bf16, through buf (STAGE_BYTES
 * of fp32, then room for as many bf16). */
static ds4_status stage_out(const ds4_model *m, ds4_st_writer *w, const float *src, int64_t n, bool bf16, float *buf) {
    const int64_t chunk = STAGE_BYTES / sizeof(float);
    for (int64_t k0 = 0; k0 < n; k0 += chunk) {
        const int64_t k1 = k0 + chunk < n ? k0 + chunk : n;
        copy_to_host(&m->exec, buf, src + k0, (size_t)(k1 - k0) * sizeof(float));
        synchronize(&m->exec);
        uint16_t *h = (uint16_t *)(buf + chunk);
        for (int64_t k = 0; bf16 && k < k1 - k0; k++) h[k] = ds4_f32_to_bf16(buf[k]);
        DS4_TRY(ds4_st_writer_put(w, bf16 ? (const void *)h : buf, (size_t)(k1 - k0) * (bf16 ? 2 : sizeof(float))));
    }
    return DS4_OK;
}

/* model.safetensors streamed in ds4_st_writer_write's layout (8-byte integer tables first, then the floats
 * in table order), one staging buffer at a time. */
static ds4_status save_tensors(ds4_model *m, const char *path, bool bf16, float *buf) {
    ds4_st_writer *w = NULL;
    ds4_status st = ds4_st_writer_new(&w);
    for (int pass = 0; pass < 2 && st == DS4_OK; pass++)
        for (int64_t i = 0; i < m->nparams && st == DS4_OK; i++) {
            const ds4_param *p = &m->params[i];
            if (p->is_int == (pass == 0))
                st = ds4_st_writer_declare(w, p->name, p->is_int ? DS4_I64 : bf16 ? DS4_BF16 : DS4_F32, p->ndim, p->shape);
        }
    if (st == DS4_OK) st = ds4_st_writer_begin(w, path);
    for (int pass = 0; pass < 2 && st == DS4_OK; pass++)
        for (int64_t i = 0; i < m->nparams && st == DS4_OK; i++) {
            const ds4_param *p = &m->params[i];
            if (p->is_int != (pass == 0)) continue;
            if (!p->is_int) {
                st = stage_out(m, w, p->data, p->numel, bf16, buf);
                continue;
            }
            int64_t *ids = ds4_alloc(DS4_MEM_OTHER, (size_t)p->numel * sizeof(int64_t));
            if (!ids) st = ds4_fail(DS4_ERR_OOM, "%s: out of memory for %s", path, p->name);
            if (ids) {
                ds4_model_to_host(m, ids, p->idata, (size_t)p->numel * sizeof(int64_t));
                st = ds4_st_writer_put(w, ids, (size_t)p->numel * sizeof(int64_t));
            }
            ds4_free(ids);
        }
    if (st == DS4_OK) st = ds4_st_writer_finish(w);
    ds4_st_writer_free(w); /* removes the temp file of an unfinished stream */
    return st;
}

ds4_status ds4_model_save(ds4_model *m, const char *dir, ds4_dtype float_dtype) {
    if (float_dtype != DS4_F32 && float_dtype != DS4_BF16)
        return ds4_fail(DS4_ERR_ARG, "model save: dtype %s not supported (F32 or BF16)", ds4_dtype_name(float_dtype));
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return ds4_fail(DS4_ERR_IO, "%s: cannot create directory: %s", dir, strerror(errno));
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    DS4_TRY(ds4_config_save(&m->cfg, path));
    float *buf = ds4_alloc(DS4_MEM_OTHER, STAGE_BYTES + STAGE_BYTES / 2);
    if (!buf) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the save buffer", dir);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ds4_status st = save_tensors(m, path, float_dtype == DS4_BF16, buf);
    ds4_free(buf);
    return st;
}
