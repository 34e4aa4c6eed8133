/* The parameter table: every tensor of a DeepSeek-V4 model under its official checkpoint name
 * (docs/dsv4-architecture.md §8.1), laid out in one flat fp32 buffer with a matching gradient
 * buffer; initialisation per docs/contract.md; load from and save to model directories. */
#include "model/model_internal.h"

#include "ds4/io.h"

#include <errno.h>
#include <stdarg.h>
#include <sys/mman.h>
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
 * region never touches its neighbours. */
#define REGION_ALIGN 1024

/* Starts a new region of `group` (expert -1: dense) at the current end of the flat layout. */
static void region_begin(table_builder *tb, int64_t group, int64_t expert) {
    ds4_model *m = tb->m;
    if (tb->st != DS4_OK) return;
    if (m->unmapped) m->numel = (m->numel + REGION_ALIGN - 1) / REGION_ALIGN * REGION_ALIGN;
    if (m->nregions > 0) m->regions[m->nregions - 1].end = m->numel;
    if (!ds4_grow((void **)&m->regions, &tb->capreg, m->nregions + 1, sizeof *m->regions)) {
        tb->st = DS4_ERR_OOM;
        return;
    }
    m->regions[m->nregions++] = (ds4_region){group, expert, m->numel, m->numel};
}

static void regions_finish(table_builder *tb) {
    ds4_model *m = tb->m;
    if (m->unmapped) m->numel = (m->numel + REGION_ALIGN - 1) / REGION_ALIGN * REGION_ALIGN;
    if (m->nregions > 0) m->regions[m->nregions - 1].end = m->numel;
}

static ds4_param *add_entry(table_builder *tb, int ndim, const int64_t *shape, const char *fmt, va_list ap) {
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
    vsnprintf(p->name, sizeof p->name, fmt, ap);
    p->ndim = ndim;
    p->numel = 1;
    for (int i = 0; i < ndim; i++) {
        p->shape[i] = shape[i];
        p->numel *= shape[i];
    }
    return p;
}

/* Registers a float parameter; value/grad pointers are bound once the flat buffer exists. */
static ds4_param *reg(table_builder *tb, float **w, float **g, int ndim, int64_t d0, int64_t d1, int64_t d2,
                      const char *fmt, ...) __attribute__((format(printf, 8, 9)));
static ds4_param *reg(table_builder *tb, float **w, float **g, int ndim, int64_t d0, int64_t d1, int64_t d2,
                      const char *fmt, ...) {
    int64_t shape[3] = {d0, d1, d2};
    va_list ap;
    va_start(ap, fmt);
    ds4_param *p = add_entry(tb, ndim, shape, fmt, ap);
    va_end(ap);
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

/* Registers an integer table [d0, d1] (tid2eid): no float storage, no gradient. */
static void reg_int(table_builder *tb, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void reg_int(table_builder *tb, int64_t d0, int64_t d1, const char *fmt, ...) {
    int64_t shape[2] = {d0, d1};
    va_list ap;
    va_start(ap, fmt);
    ds4_param *p = add_entry(tb, 2, shape, fmt, ap);
    va_end(ap);
    if (p) p->is_int = p->no_decay = p->no_grad = true;
}

static void mark_no_decay(ds4_param *p) {
    if (p) p->no_decay = true;
}

#define REGW(field, nd, a, b, c, ...) reg(tb, &W->field, &G->field, nd, a, b, c, __VA_ARGS__)

static void reg_compressor(table_builder *tb, compressor_w *W, compressor_w *G, const char *pre, int64_t r,
                           int64_t d, int64_t D) {
    int64_t coff = r == 4 ? 2 : 1;
    REGW(wkv, 2, coff * d, D, 0, "%s.wkv.weight", pre);
    REGW(wgate, 2, coff * d, D, 0, "%s.wgate.weight", pre);
    mark_no_decay(REGW(ape, 2, r, coff * d, 0, "%s.ape", pre));
    mark_no_decay(REGW(norm, 1, d, 0, 0, "%s.norm.weight", pre));
}

static void reg_block(table_builder *tb, block_w *W, block_w *G, int64_t l, const char *pre, int64_t group) {
    const ds4_config *c = &tb->m->cfg;
    region_begin(tb, group, -1);
    int64_t D = c->dim, n = c->hc_mult, M = mix_hc(c), H = c->n_heads, hd = c->head_dim;
    int64_t r = ds4_layer_ratio(c, l), E = c->n_routed_experts, I = c->moe_inter_dim;
    int64_t Is = I * c->n_shared_experts, GR = c->o_groups * c->o_lora_rank;
    mark_no_decay(REGW(attn_norm, 1, D, 0, 0, "%s.attn_norm.weight", pre));
    mark_no_decay(REGW(ffn_norm, 1, D, 0, 0, "%s.ffn_norm.weight", pre));
    REGW(hc_attn_fn, 2, M, n * D, 0, "%s.hc_attn_fn", pre);
    mark_no_decay(REGW(hc_attn_base, 1, M, 0, 0, "%s.hc_attn_base", pre));
    mark_no_decay(REGW(hc_attn_scale, 1, 3, 0, 0, "%s.hc_attn_scale", pre));
    REGW(hc_ffn_fn, 2, M, n * D, 0, "%s.hc_ffn_fn", pre);
    mark_no_decay(REGW(hc_ffn_base, 1, M, 0, 0, "%s.hc_ffn_base", pre));
    mark_no_decay(REGW(hc_ffn_scale, 1, 3, 0, 0, "%s.hc_ffn_scale", pre));
    mark_no_decay(REGW(attn_sink, 1, H, 0, 0, "%s.attn.attn_sink", pre));
    REGW(wq_a, 2, c->q_lora_rank, D, 0, "%s.attn.wq_a.weight", pre);
    mark_no_decay(REGW(q_norm, 1, c->q_lora_rank, 0, 0, "%s.attn.q_norm.weight", pre));
    REGW(wq_b, 2, H * hd, c->q_lora_rank, 0, "%s.attn.wq_b.weight", pre);
    REGW(wkv, 2, hd, D, 0, "%s.attn.wkv.weight", pre);
    mark_no_decay(REGW(kv_norm, 1, hd, 0, 0, "%s.attn.kv_norm.weight", pre));
    REGW(wo_a, 2, GR, H * hd / c->o_groups, 0, "%s.attn.wo_a.weight", pre);
    REGW(wo_b, 2, D, GR, 0, "%s.attn.wo_b.weight", pre);
    char sub[128];
    if (r > 0) {
        snprintf(sub, sizeof sub, "%s.attn.compressor", pre);
        reg_compressor(tb, &W->cmp, &G->cmp, sub, r, hd, D);
    }
    if (r == 4) {
        REGW(idx_wq_b, 2, c->index_n_heads * c->index_head_dim, c->q_lora_rank, 0, "%s.attn.indexer.wq_b.weight",
             pre);
        REGW(idx_weights_proj, 2, c->index_n_heads, D, 0, "%s.attn.indexer.weights_proj.weight", pre);
        snprintf(sub, sizeof sub, "%s.attn.indexer.compressor", pre);
        reg_compressor(tb, &W->idx_cmp, &G->idx_cmp, sub, 4, c->index_head_dim, D);
    }
    REGW(gate, 2, E, D, 0, "%s.ffn.gate.weight", pre);
    if (!block_is_hash(c, l)) {
        ds4_param *b = REGW(gate_bias, 1, E, 0, 0, "%s.ffn.gate.bias", pre);
        if (b) b->no_decay = b->no_grad = true;
    } else {
        reg_int(tb, c->vocab_size, c->n_activated_experts, "%s.ffn.gate.tid2eid", pre);
    }
    for (int64_t e = 0; e < E; e++) {
        region_begin(tb, group, e);
        REGW(experts[e].w1, 2, I, D, 0, "%s.ffn.experts.%lld.w1.weight", pre, (long long)e);
        REGW(experts[e].w2, 2, D, I, 0, "%s.ffn.experts.%lld.w2.weight", pre, (long long)e);
        REGW(experts[e].w3, 2, I, D, 0, "%s.ffn.experts.%lld.w3.weight", pre, (long long)e);
    }
    region_begin(tb, group, -1);
    REGW(shared.w1, 2, Is, D, 0, "%s.ffn.shared_experts.w1.weight", pre);
    REGW(shared.w2, 2, D, Is, 0, "%s.ffn.shared_experts.w2.weight", pre);
    REGW(shared.w3, 2, Is, D, 0, "%s.ffn.shared_experts.w3.weight", pre);
}

static void reg_model(table_builder *tb) {
    ds4_model *m = tb->m;
    const ds4_config *c = &m->cfg;
    model_w *W = &m->w, *G = &m->g;
    int64_t D = c->dim, V = c->vocab_size, n = c->hc_mult;
    region_begin(tb, 0, -1);
    REGW(embed, 2, V, D, 0, "embed.weight");
    for (int64_t l = 0; l < c->n_layers; l++) {
        char pre[32];
        snprintf(pre, sizeof pre, "layers.%lld", (long long)l);
        reg_block(tb, &W->blocks[l], &G->blocks[l], l, pre, group_of_layer(l));
    }
    region_begin(tb, group_head(c), -1);
    mark_no_decay(REGW(norm, 1, D, 0, 0, "norm.weight"));
    REGW(head, 2, V, D, 0, "head.weight");
    REGW(hc_head_fn, 2, n, n * D, 0, "hc_head_fn");
    mark_no_decay(REGW(hc_head_base, 1, n, 0, 0, "hc_head_base"));
    mark_no_decay(REGW(hc_head_scale, 1, 1, 0, 0, "hc_head_scale"));
    if (c->n_mtp_layers > 0) {
        int64_t l = c->n_layers;
        reg_block(tb, &W->blocks[l], &G->blocks[l], l, "mtp.0", group_mtp(c));
        region_begin(tb, group_mtp(c), -1);
        REGW(e_proj, 2, D, D, 0, "mtp.0.e_proj.weight");
        REGW(h_proj, 2, D, D, 0, "mtp.0.h_proj.weight");
        mark_no_decay(REGW(enorm, 1, D, 0, 0, "mtp.0.enorm.weight"));
        mark_no_decay(REGW(hnorm, 1, D, 0, 0, "mtp.0.hnorm.weight"));
        mark_no_decay(REGW(mtp_norm, 1, D, 0, 0, "mtp.0.norm.weight"));
        REGW(mtp_hc_head_fn, 2, n, n * D, 0, "mtp.0.hc_head_fn");
        mark_no_decay(REGW(mtp_hc_head_base, 1, n, 0, 0, "mtp.0.hc_head_base"));
        mark_no_decay(REGW(mtp_hc_head_scale, 1, 1, 0, 0, "mtp.0.hc_head_scale"));
    }
    regions_finish(tb);
}

/* An address range of `bytes` with no memory behind it (pages are made resident by ds4_model_map). */
static float *reserve_range(size_t bytes) {
    void *p = mmap(NULL, bytes ? bytes : 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static ds4_status model_create(const ds4_config *cfg, bool unmapped, ds4_model **out) {
    *out = NULL;
    DS4_TRY(ds4_config_validate(cfg, "config"));
    ds4_model *m = ds4_calloc(DS4_MEM_OTHER, sizeof *m);
    if (!m) return DS4_ERR_OOM;
    m->cfg = *cfg;
    m->unmapped = unmapped;
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
    gemm_workspace_reserve();
    m->gemm_ws = true;
    if (unmapped) {
        m->reserved_bytes = (size_t)m->numel * sizeof(float);
        m->flat = reserve_range(m->reserved_bytes);
        m->gflat = reserve_range(m->reserved_bytes);
    } else {
        m->flat = ds4_calloc(DS4_MEM_PARAM, (size_t)m->numel * sizeof(float));
        m->gflat = ds4_calloc(DS4_MEM_GRAD, (size_t)m->numel * sizeof(float));
    }
    if (!m->flat || !m->gflat) {
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
    /* the integer tables */
    for (int64_t i = 0; i < m->nparams; i++) {
        ds4_param *p = &m->params[i];
        if (!p->is_int) continue;
        p->idata = ds4_calloc(DS4_MEM_PARAM, (size_t)p->numel * sizeof(int64_t));
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

ds4_status ds4_model_create(const ds4_config *cfg, ds4_model **out) { return model_create(cfg, false, out); }
ds4_status ds4_model_create_unmapped(const ds4_config *cfg, ds4_model **out) { return model_create(cfg, true, out); }

static void free_range(float *p, size_t bytes, bool unmapped) {
    if (!p) return;
    if (unmapped) munmap(p, bytes ? bytes : 4096);
    else ds4_free(p);
}

void ds4_model_free(ds4_model *m) {
    if (!m) return;
    for (int64_t i = 0; i < m->nparams; i++) ds4_free(m->params[i].idata);
    ds4_free(m->params);
    if (m->w.blocks)
        for (int64_t l = 0; l < n_blocks(&m->cfg); l++) ds4_free(m->w.blocks[l].experts);
    if (m->g.blocks)
        for (int64_t l = 0; l < n_blocks(&m->cfg); l++) ds4_free(m->g.blocks[l].experts);
    ds4_free(m->w.blocks);
    ds4_free(m->g.blocks);
    ds4_free(m->tid2eid);
    free_range(m->flat, m->reserved_bytes, m->unmapped);
    free_range(m->gflat, m->reserved_bytes, m->unmapped);
    ds4_free(m->regions);
    rope_table_free(&m->rope_main);
    rope_table_free(&m->rope_cmp);
    if (m->gemm_ws) gemm_workspace_release();
    ds4_free(m);
}

const ds4_config *ds4_model_config(const ds4_model *m) { return &m->cfg; }
int64_t ds4_model_nparams(const ds4_model *m) { return m->nparams; }
ds4_param *ds4_model_param(ds4_model *m, int64_t i) { return &m->params[i]; }
int64_t ds4_model_numel(const ds4_model *m) { return m->numel; }
float *ds4_model_params_flat(ds4_model *m) { return m->flat; }
float *ds4_model_grads_flat(ds4_model *m) { return m->gflat; }
void ds4_model_zero_grad(ds4_model *m) {
    if (!ds4_shape_only() && !m->unmapped) memset(m->gflat, 0, (size_t)m->numel * sizeof(float));
}

int64_t ds4_model_ngroups(const ds4_model *m) { return m->cfg.n_layers + 2 + (m->cfg.n_mtp_layers > 0); }
int64_t ds4_model_nregions(const ds4_model *m) { return m->nregions; }
const ds4_region *ds4_model_region(const ds4_model *m, int64_t i) { return &m->regions[i]; }

static ds4_status check_range(const ds4_model *m, int64_t start, int64_t end) {
    if (!m->unmapped || start < 0 || end > m->numel || start > end || start % REGION_ALIGN ||
        (end % REGION_ALIGN && end != m->numel))
        return ds4_fail(DS4_ERR_INTERNAL, "model map: [%lld, %lld) is not a page-aligned range of an unmapped model",
                        (long long)start, (long long)end);
    return DS4_OK;
}

ds4_status ds4_model_map(ds4_model *m, int64_t start, int64_t end, bool grad) {
    DS4_TRY(check_range(m, start, end));
    size_t bytes = (size_t)(end - start) * sizeof(float);
    if (bytes == 0) return DS4_OK;
    if (!ds4_shape_only() && mprotect((grad ? m->gflat : m->flat) + start, bytes, PROT_READ | PROT_WRITE) != 0)
        return ds4_fail(DS4_ERR_OOM, "out of memory mapping %zu bytes of %s", bytes, grad ? "gradients" : "parameters");
    ds4_mem_track(grad ? DS4_MEM_GRAD : DS4_MEM_PARAM, (int64_t)bytes);
    return DS4_OK;
}

void ds4_model_unmap(ds4_model *m, int64_t start, int64_t end, bool grad) {
    if (check_range(m, start, end) != DS4_OK) return;
    size_t bytes = (size_t)(end - start) * sizeof(float);
    if (bytes == 0) return;
    if (!ds4_shape_only()) {
        float *p = (grad ? m->gflat : m->flat) + start;
        madvise(p, bytes, MADV_DONTNEED); /* the pages go back; the next map reads zeros */
        mprotect(p, bytes, PROT_NONE);     /* a read after unmap faults instead of seeing stale data */
    }
    ds4_mem_track(grad ? DS4_MEM_GRAD : DS4_MEM_PARAM, -(int64_t)bytes);
}

ds4_param *ds4_model_find(ds4_model *m, const char *name) {
    for (int64_t i = 0; i < m->nparams; i++)
        if (strcmp(m->params[i].name, name) == 0) return &m->params[i];
    return NULL;
}

/* ------------------------------------------------------------------ router bias */
int64_t ds4_param_router_block(const ds4_config *c, const ds4_param *p) {
    const char *suffix = ".ffn.gate.bias";
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
static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

/* Value rule by name: norms 1, hc base 0, hc scale 1, sink/ape/bias 0, everything else N(0, 0.02). */
static float init_value(const ds4_param *p, uint64_t seed, uint64_t stream, int64_t i) {
    const char *nm = p->name;
    if (ends_with(nm, "norm.weight")) return 1.0f;
    if (ends_with(nm, "_base") || ends_with(nm, "attn_sink") || ends_with(nm, ".ape") || ends_with(nm, "gate.bias"))
        return 0.0f;
    if (ends_with(nm, "_scale")) return 1.0f;
    return 0.02f * ds4_rng_normal(seed, stream, (uint64_t)i);
}

/* tid2eid row: K distinct expert ids, drawn by a partial Fisher-Yates shuffle from the seed. */
static void init_tid2eid(ds4_param *p, uint64_t seed, uint64_t stream, int64_t E) {
    int64_t V = p->shape[0], K = p->shape[1];
    int64_t *perm = ds4_alloc(DS4_MEM_WORK, (size_t)E * sizeof(int64_t));
    if (!perm) return;
    for (int64_t v = 0; v < V; v++) {
        for (int64_t e = 0; e < E; e++) perm[e] = e;
        for (int64_t k = 0; k < K; k++) {
            int64_t j = k + (int64_t)(ds4_rng_u64(seed, stream, (uint64_t)(v * K + k)) % (uint64_t)(E - k));
            int64_t t = perm[k];
            perm[k] = perm[j];
            perm[j] = t;
            p->idata[v * K + k] = perm[k];
        }
    }
    ds4_free(perm);
}

void ds4_param_init_values(const ds4_param *p, uint64_t seed, int64_t k0, int64_t k1, float *out) {
    uint64_t stream = ds4_hash_str(p->name);
#pragma omp parallel for schedule(static)
    for (int64_t k = k0; k < k1; k++) out[k - k0] = init_value(p, seed, stream, k);
}

void ds4_model_init_param(ds4_model *m, int64_t i, uint64_t seed) {
    if (ds4_shape_only()) return;
    ds4_param *p = &m->params[i];
    uint64_t stream = ds4_hash_str(p->name);
    if (p->is_int) {
        init_tid2eid(p, seed, stream, m->cfg.n_routed_experts);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < p->numel; k++) p->data[k] = init_value(p, seed, stream, k);
}

void ds4_model_init_random(ds4_model *m, uint64_t seed) {
    for (int64_t i = 0; i < m->nparams; i++) ds4_model_init_param(m, i, seed);
}

/* ------------------------------------------------------------------ load / save */
ds4_status ds4_model_load_param(ds4_model *m, const ds4_model_dir *d, int64_t i) {
    ds4_param *p = &m->params[i];
    if (!p->is_int) return ds4_model_dir_read_f32(d, p->name, p->ndim, p->shape, p->data);
    DS4_TRY(ds4_model_dir_read_i64(d, p->name, p->ndim, p->shape, p->idata));
    for (int64_t k = 0; k < p->numel; k++)
        if (p->idata[k] < 0 || p->idata[k] >= m->cfg.n_routed_experts)
            return ds4_fail(DS4_ERR_FORMAT, "%s: tensor %s: expert id %lld out of range [0, %lld)",
                            ds4_model_dir_path(d), p->name, (long long)p->idata[k], (long long)m->cfg.n_routed_experts);
    return DS4_OK;
}

ds4_status ds4_model_load(ds4_model *m, const ds4_model_dir *d) {
    for (int64_t i = 0; i < m->nparams; i++) DS4_TRY(ds4_model_load_param(m, d, i));
    return DS4_OK;
}

ds4_status ds4_model_save(ds4_model *m, const char *dir, ds4_dtype float_dtype) {
    if (float_dtype != DS4_F32 && float_dtype != DS4_BF16)
        return ds4_fail(DS4_ERR_ARG, "model save: dtype %s not supported (F32 or BF16)", ds4_dtype_name(float_dtype));
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return ds4_fail(DS4_ERR_IO, "%s: cannot create directory: %s", dir, strerror(errno));
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    DS4_TRY(ds4_config_save(&m->cfg, path));
    uint16_t *bf = NULL;
    if (float_dtype == DS4_BF16) {
        bf = ds4_alloc(DS4_MEM_OTHER, (size_t)m->numel * 2);
        if (!bf) return DS4_ERR_OOM;
        for (int64_t i = 0; i < m->numel; i++) bf[i] = ds4_f32_to_bf16(m->flat[i]);
    }
    ds4_st_writer *w = NULL;
    ds4_status st = ds4_st_writer_new(&w);
    for (int64_t i = 0; st == DS4_OK && i < m->nparams; i++) {
        ds4_param *p = &m->params[i];
        if (p->is_int) st = ds4_st_writer_add(w, p->name, DS4_I64, p->ndim, p->shape, p->idata);
        else if (bf) st = ds4_st_writer_add(w, p->name, DS4_BF16, p->ndim, p->shape, bf + (p->data - m->flat));
        else st = ds4_st_writer_add(w, p->name, DS4_F32, p->ndim, p->shape, p->data);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (st == DS4_OK) st = ds4_st_writer_write(w, path);
    ds4_st_writer_free(w);
    ds4_free(bf);
    return st;
}
