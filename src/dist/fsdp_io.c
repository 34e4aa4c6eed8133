/* Filling and reading an FSDP's shards (ds4/dist.h): random init and model-directory load into this
 * rank's pieces, the whole model gathered on one rank (ds4_fsdp_collect), and the packed layout that
 * checkpoints use: a shard streamed to root region by region, and this rank's elements read back from any
 * packed source. */
#include "dist/fsdp_impl.h"
#include "ds4/kernels.h"

#include <string.h>

/* ------------------------------------------------------------------ init, load */
/* The shard's elements are written on the host and copied to the backend a piece overlap at a time
 * (host: a buffer of the largest one). */
typedef struct {
    ds4_fsdp *f;
    uint64_t seed;
    float *host;
} init_ctx;
static void init_overlap(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    init_ctx *c = ctx;
    ds4_param_init_values(p, c->seed, k0, k1, c->host);
    ds4_dev_to_device(fsdp_ex(c->f), c->f->sp + s0, c->host, (size_t)(k1 - k0) * sizeof(float));
}

static void longest_overlap(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    (void)p, (void)s0;
    int64_t *n = ctx;
    if (k1 - k0 > *n) *n = k1 - k0;
}

/* A host buffer for the longest (parameter, piece) overlap of f. */
static float *overlap_buffer(const ds4_fsdp *f) {
    int64_t n = 1;
    ds4_fsdp_for_each_piece(f, longest_overlap, &n);
    return ds4_alloc(DS4_MEM_OTHER, (size_t)n * sizeof(float));
}

ds4_status ds4_fsdp_init_random(ds4_fsdp *f, uint64_t seed) {
    if (fsdp_planning(f)) return DS4_OK;
    init_ctx c = {f, seed, overlap_buffer(f)};
    if (!c.host) return ds4_fail(DS4_ERR_OOM, "out of memory initialising a shard");
    ds4_fsdp_for_each_piece(f, init_overlap, &c);
    ds4_free(c.host);
    for (int64_t i = 0; i < ds4_model_nparams(f->m); i++) /* the tables and carried tensors: whole on every rank */
        if (!ds4_param_in_flat(ds4_model_param(f->m, i))) DS4_TRY(ds4_model_init_param(f->m, i, seed));
    return DS4_OK;
}

ds4_status ds4_fsdp_load(ds4_fsdp *f, const ds4_model_dir *d) {
    ds4_model *m = f->m;
    const float *flat = ds4_model_params_flat(m);
    for (int64_t j = 0; j < f->npieces; j++) { /* one region resident at a time */
        const piece *q = &f->pieces[j];
        DS4_TRY(ds4_model_map(m, q->start, q->map_end, false));
        ds4_status st = DS4_OK;
        for (int64_t i = 0; st == DS4_OK && i < ds4_model_nparams(m); i++) {
            ds4_param *p = ds4_model_param(m, i);
            int64_t a = ds4_param_in_flat(p) ? p->data - flat : -1;
            if (a >= q->start && a < q->end) st = ds4_model_load_param(m, d, i);
        }
        if (st == DS4_OK && !fsdp_planning(f))
            ds4_dev_copy(fsdp_ex(f), f->sp + q->shard_off, flat + q->start + q->off, (size_t)q->len * sizeof(float));
        ds4_model_unmap(m, q->start, q->map_end, false);
        DS4_TRY(st);
    }
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) /* the tables and carried tensors: whole on every rank */
        if (!ds4_param_in_flat(ds4_model_param(m, i))) DS4_TRY(ds4_model_load_param(m, d, i));
    return DS4_OK;
}

/* ------------------------------------------------------------------ whole-model views */
/* EP rank owning expert e. */
static int expert_owner(const ds4_fsdp *f, int64_t e) { return (int)(e / f->eloc); }

/* Gathers region i of a shard buffer (host memory) on root into dst [end - start of the region] (root
 * only). Who holds which piece: dense regions over all ranks; expert e over the ranks of its EP rank.
 * v: [2W]. */
static ds4_status gather_region(ds4_fsdp *f, int64_t i, const float *shard, float *dst, int root, int64_t *v) {
    const ds4_region *g = ds4_model_region(f->m, i);
    const int W = f->W;
    int64_t len = g->end - g->start;
    int64_t n = g->expert >= 0 ? W / f->ep_size : W, chunk = (len + n - 1) / n;
    for (int w = 0; w < W; w++) {
        bool holds = g->expert < 0 || expert_owner(f, g->expert) == w % f->ep_size;
        int idx = g->expert < 0 ? w : w / f->ep_size;
        v[w] = holds ? piece_len(len, chunk, idx) : 0;
        v[W + w] = holds ? (int64_t)idx * chunk : 0;
    }
    int64_t j = f->piece_of_region[i];
    const float *mine = j >= 0 ? shard + f->pieces[j].shard_off : NULL;
    return ds4_comm_gatherv(f->world, mine, j >= 0 ? f->pieces[j].len : 0, dst, v, v + W, sizeof(float), root);
}

ds4_status ds4_fsdp_collect_buf(ds4_fsdp *f, const float *shard, float *out, int root) {
    ds4_model *m = f->m;
    if (!f->whole) return ds4_fail(DS4_ERR_INTERNAL, "FSDP of a pipeline stage's groups: no whole-model collect");
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 2 * (size_t)f->W);
    if (!v) return DS4_ERR_OOM;
    ds4_status st = DS4_OK;
    for (int64_t i = 0; st == DS4_OK && i < ds4_model_nregions(m); i++)
        st = gather_region(f, i, shard, out ? out + ds4_model_region(m, i)->start : NULL, root, v);
    ds4_free(v);
    return st;
}

ds4_status ds4_fsdp_collect(ds4_fsdp *f, bool grads, float *out, int root) {
    const float *shard = grads ? f->sg : f->sp;
    const float *host = fsdp_planning(f) ? shard : ds4_dev_host_view(fsdp_ex(f), shard, (size_t)f->ns * sizeof(float));
    if (!host) return DS4_ERR_OOM;
    ds4_status st = ds4_fsdp_collect_buf(f, host, out, root);
    ds4_dev_host_view_free(fsdp_ex(f), host, shard);
    return st;
}

/* ------------------------------------------------------------------ the packed layout (checkpoints) */
/* Offset of every float parameter in the packed layout ([nparams], -1 for integer tables). */
static int64_t *packed_offsets(ds4_model *m) {
    int64_t np = ds4_model_nparams(m), off = 0;
    int64_t *o = ds4_alloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(int64_t));
    for (int64_t i = 0; o && i < np; i++) {
        ds4_param *p = ds4_model_param(m, i);
        o[i] = ds4_param_in_flat(p) ? off : -1;
        off += ds4_param_in_flat(p) ? p->numel : 0;
    }
    return o;
}

int64_t ds4_fsdp_packed_numel(const ds4_fsdp *f) {
    int64_t n = 0;
    for (int64_t i = 0; i < ds4_model_nparams(f->m); i++) {
        const ds4_param *p = ds4_model_param(f->m, i);
        n += ds4_param_in_flat(p) ? p->numel : 0;
    }
    return n;
}

/* Region by region: gather into a region-sized buffer on root, then hand each parameter of the region
 * to the sink (the region padding is dropped). Parameters and regions are both in flat order. */
ds4_status ds4_fsdp_stream_packed(ds4_fsdp *f, const float *shard, int root, ds4_packed_sink_fn sink, void *ctx) {
    ds4_model *m = f->m;
    if (!f->whole) return ds4_fail(DS4_ERR_INTERNAL, "FSDP of a pipeline stage's groups: no whole-model stream");
    const bool here = ds4_comm_rank(f->world) == root;
    const float *flat = ds4_model_params_flat(m);
    int64_t maxlen = 0, np = ds4_model_nparams(m), pi = 0;
    for (int64_t i = 0; i < ds4_model_nregions(m); i++) {
        const ds4_region *g = ds4_model_region(m, i);
        if (g->end - g->start > maxlen) maxlen = g->end - g->start;
    }
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 2 * (size_t)f->W);
    float *tmp = here ? ds4_alloc(DS4_MEM_COMM, (size_t)(maxlen > 0 ? maxlen : 1) * sizeof(float)) : NULL;
    ds4_status st = v && (tmp || !here) ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory collecting a shard");
    ds4_status sunk = DS4_OK; /* the sink's first failure: writing stops, gathering does not */
    for (int64_t i = 0; st == DS4_OK && i < ds4_model_nregions(m); i++) {
        const ds4_region *g = ds4_model_region(m, i);
        st = gather_region(f, i, shard, tmp, root, v);
        for (; st == DS4_OK && pi < np; pi++) { /* the parameters that start in this region */
            ds4_param *p = ds4_model_param(m, pi);
            if (!ds4_param_in_flat(p)) continue;
            int64_t a = p->data - flat;
            if (a >= g->end) break;
            if (here && sunk == DS4_OK) sunk = sink(ctx, pi, tmp + (a - g->start), p->numel);
        }
    }
    ds4_free(tmp);
    ds4_free(v);
    return st != DS4_OK ? st : sunk;
}

typedef struct {
    const ds4_fsdp *f;
    const int64_t *poff;
    ds4_packed_read_fn read;
    void *ctx;
    float *shard, *host; /* host: a buffer of the longest overlap, read into and copied to the shard */
    ds4_status st;
} scatter_ctx;
static void scatter_overlap(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    scatter_ctx *c = ctx;
    int64_t i = p - ds4_model_param(c->f->m, 0);
    if (c->st == DS4_OK) c->st = c->read(c->ctx, c->poff[i] + k0, k1 - k0, c->host);
    if (c->st == DS4_OK) ds4_dev_to_device(fsdp_ex(c->f), c->shard + s0, c->host, (size_t)(k1 - k0) * sizeof(float));
}

ds4_status ds4_fsdp_scatter_packed(const ds4_fsdp *f, ds4_packed_read_fn read, void *ctx, float *shard) {
    if (fsdp_planning(f)) return DS4_OK;
    int64_t *poff = packed_offsets(f->m);
    float *host = overlap_buffer(f);
    scatter_ctx c = {f, poff, read, ctx, shard, host, DS4_OK};
    if (poff && host) ds4_fsdp_for_each_piece(f, scatter_overlap, &c);
    else c.st = ds4_fail(DS4_ERR_OOM, "out of memory scattering into a shard");
    ds4_free(poff);
    ds4_free(host);
    return c.st;
}
