/* FSDP + expert parallelism around an unmapped model (ds4/dist.h): the shard layout. This file makes and
 * frees an FSDP (its three communicators, the pieces of every region this rank holds, the shard buffers)
 * and answers what lives where; the hooks, EP, shard I/O and the optimizer's needs are the other
 * fsdp_*.c files and ep.c (fsdp_impl.h lists them). */
#include "dist/fsdp_impl.h"
#include "ds4/kernels.h"

#include <string.h>

/* ------------------------------------------------------------------ create */
/* groups: [ngroups] the groups sharded here (a pipeline stage's), NULL: all. */
static ds4_status build_pieces(ds4_fsdp *f, const bool *groups) {
    ds4_model *m = f->m;
    int64_t nr = ds4_model_nregions(m), numel = ds4_model_numel(m);
    f->pieces = ds4_calloc(DS4_MEM_OTHER, (size_t)(nr + 1) * sizeof(piece));
    f->piece_of_region = ds4_alloc(DS4_MEM_OTHER, (size_t)(nr + 1) * sizeof(int64_t));
    if (!f->pieces || !f->piece_of_region) return DS4_ERR_OOM;
    for (int64_t i = 0; i < nr; i++) {
        const ds4_region *g = ds4_model_region(m, i);
        f->piece_of_region[i] = -1;
        if (groups && !groups[g->group]) continue; /* another pipeline stage's group */
        bool expert = g->expert >= 0;
        if (expert && (g->expert < f->ops.e0 || g->expert >= f->ops.e1)) continue; /* another EP rank's expert */
        ds4_comm *c = expert ? f->rep : f->fsdp;
        int n = ds4_comm_size(c), r = ds4_comm_rank(c);
        piece *p = &f->pieces[f->npieces];
        int64_t len = g->end - g->start;
        int64_t next = i + 1 < nr ? ds4_model_region(m, i + 1)->start : numel;
        *p = (piece){.region = i, .group = g->group, .start = g->start, .end = g->end, .map_end = next,
                     .expert = expert, .bf16 = g->bf16 && ds4_model_bf16_flat(m), .chunk = (len + n - 1) / n};
        p->off = (int64_t)r * p->chunk;
        p->len = piece_len(len, p->chunk, r);
        p->shard_off = f->ns;
        f->ns += p->len;
        f->piece_of_region[i] = f->npieces++;
    }
    /* on the model's backend; no bf16 copy: each gather casts its pieces */
    f->sp = ds4_dev_zalloc(fsdp_ex(f), DS4_MEM_PARAM, (size_t)f->ns * sizeof(float));
    const char *prev = ds4_mem_owner_enter(DS4_OWNER_GRAD_RESIDENT); /* memplan's split of the gradients */
    f->sg = ds4_dev_zalloc(fsdp_ex(f), DS4_MEM_GRAD, (size_t)f->ns * sizeof(float));
    ds4_mem_owner_leave(prev);
    return f->sp && f->sg ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory for a shard of %lld parameters", (long long)f->ns);
}

ds4_status ds4_fsdp_create(ds4_model *m, ds4_comm *world, int ep, ds4_fsdp **out) {
    return ds4_fsdp_create_groups(m, world, ep, NULL, out);
}

ds4_status ds4_fsdp_create_groups(ds4_model *m, ds4_comm *world, int ep, const bool *groups, ds4_fsdp **out) {
    *out = NULL;
    const ds4_config *c = ds4_model_config(m);
    int W = ds4_comm_size(world), rank = ds4_comm_rank(world);
    if (ep < 1 || W % ep || c->n_routed_experts % ep)
        return ds4_fail(DS4_ERR_ARG, "--ep %d must divide the number of ranks (%d) and of routed experts (%lld)", ep, W,
                        (long long)c->n_routed_experts);
    ds4_fsdp *f = ds4_calloc(DS4_MEM_OTHER, sizeof *f);
    if (!f) return DS4_ERR_OOM;
    f->m = m;
    f->world = world;
    f->W = W;
    f->ep_size = ep;
    f->eloc = c->n_routed_experts / ep;
    const int64_t e0 = (rank % ep) * f->eloc;
    fsdp_ep_init(f, e0);
    int64_t ng = ds4_model_ngroups(m);
    f->w_mapped = ds4_calloc(DS4_MEM_OTHER, (size_t)ng * sizeof(bool));
    f->g_mapped = ds4_calloc(DS4_MEM_OTHER, (size_t)(groups ? 2 * ng : ng) * sizeof(bool)); /* + the stage's groups */
    ds4_status st = f->w_mapped && f->g_mapped ? DS4_OK : DS4_ERR_OOM;
    /* three communicators of their own: FSDP (all ranks), EP groups, expert replicas. The shards live on the
     * model's backend: on a device, FSDP's and the replicas' collectives stage through host copies (EP
     * stages its rows itself, ep.c). */
    const bool device = !fsdp_planning(f) && !ds4_exec_host_memory(fsdp_ex(f));
    if (st == DS4_OK && device) st = ds4_comm_staged(world, fsdp_ex(f), &f->staged);
    ds4_comm *shards = f->staged ? f->staged : world;
    if (st == DS4_OK) st = ds4_comm_split(shards, 0, rank, W, rank, &f->fsdp);
    if (st == DS4_OK) st = ds4_comm_split(world, rank / ep, rank, ep, rank % ep, &f->ep);
    if (st == DS4_OK) st = ds4_comm_split(shards, rank % ep, rank, W / ep, rank / ep, &f->rep);
    if (st == DS4_OK) {
        ds4_comm_set_lane(f->fsdp, DS4_LANE_FSDP);
        ds4_comm_set_lane(f->rep, DS4_LANE_FSDP);
        ds4_comm_set_lane(f->ep, DS4_LANE_EP);
        st = build_pieces(f, groups);
        f->whole = !groups;
        for (int64_t g = 0; groups && g < ng; g++) f->g_mapped[ng + g] = groups[g];
    }
    if (st != DS4_OK) {
        ds4_fsdp_free(f);
        return st;
    }
    fsdp_hooks_init(f, ep > 1 ? &f->ops : NULL);
    *out = f;
    return DS4_OK;
}

void ds4_fsdp_free(ds4_fsdp *f) {
    if (!f) return;
    fsdp_hooks_release(f); /* nothing may stay in flight or mapped */
    ds4_comm_free(f->fsdp);
    ds4_comm_free(f->ep);
    ds4_comm_free(f->rep);
    ds4_comm_free(f->staged);
    ds4_free(f->pieces);
    ds4_free(f->piece_of_region);
    ds4_free(f->w_mapped);
    ds4_free(f->g_mapped);
    ds4_dev_free(fsdp_ex(f), f->sp);
    ds4_dev_free(fsdp_ex(f), f->sg);
    ds4_free(f);
}

const ds4_param_hooks *ds4_fsdp_hooks(ds4_fsdp *f) { return &f->hooks; }
bool ds4_fsdp_holds_group(const ds4_fsdp *f, int64_t group) {
    return f->whole || f->g_mapped[ds4_model_ngroups(f->m) + group];
}
int64_t ds4_fsdp_shard_numel(const ds4_fsdp *f) { return f->ns; }
const ds4_exec *ds4_fsdp_exec(const ds4_fsdp *f) { return ds4_model_exec(f->m); }
float *ds4_fsdp_shard_params(ds4_fsdp *f) { return f->sp; }
float *ds4_fsdp_shard_grads(ds4_fsdp *f) { return f->sg; }
/* Nothing to refresh: the shard keeps no bf16 copy (as FSDP2's mixed precision); every gather of a bf16
 * piece casts it from the fp32 shard, the same bits the copy held. The gathered groups are dropped before
 * the optimizer writes the shard, so none holds stale bits. */
void ds4_fsdp_refresh_bf16(ds4_fsdp *f) { (void)f; }

void ds4_fsdp_zero_grads(ds4_fsdp *f) {
    if (!fsdp_planning(f)) ds4_dev_zero(fsdp_ex(f), f->sg, (size_t)f->ns * sizeof(float));
}

/* fn for every (float parameter, piece) overlap: elements [k0, k1) of the parameter are shard
 * elements [s0, s0 + k1 - k0). */
void ds4_fsdp_for_each_piece(const ds4_fsdp *f, ds4_fsdp_piece_fn fn, void *ctx) {
    ds4_model *m = f->m;
    const float *flat = ds4_model_params_flat(m);
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_in_flat(p)) continue;
        int64_t a = p->data - flat, b = a + p->numel;
        for (int64_t j = 0; j < f->npieces; j++) {
            const piece *q = &f->pieces[j];
            int64_t lo = q->start + q->off, hi = lo + q->len;
            int64_t x = a > lo ? a : lo, y = b < hi ? b : hi;
            if (x < y) fn(ctx, p, x - a, y - a, q->shard_off + (x - lo));
        }
    }
}
