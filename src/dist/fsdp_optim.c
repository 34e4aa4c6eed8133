/* What the optimizer step needs from an FSDP's shards (ds4/dist.h): the global grad norm and clipping, the
 * router bias rule on the shard's bias pieces, and whole matrices for Muon (gathered on an owner rank,
 * scattered back). */
#include "dist/fsdp_impl.h"

#include <math.h>

/* ------------------------------------------------------------------ clipping, router bias */
/* The shard's squares summed exactly on the backend (limbs read back once), the limbs summed over ranks as
 * integers, so the norm is the same bits for any layout; the scale, when it clips, on the backend. */
ds4_status ds4_fsdp_clip_grad_norm(ds4_fsdp *f, double max_norm, double *norm) {
    return ds4_fsdp_clip_grad_norm_over(f, f->world, max_norm, norm);
}

ds4_status ds4_fsdp_clip_grad_norm_over(ds4_fsdp *f, ds4_comm *all, double max_norm, double *norm) {
    ds4_sumsq_acc a;
    DS4_TRY(ds4_dev_sumsq_exact(fsdp_ex(f), f->sg, f->ns, &a)); /* a plan: zero */
    DS4_TRY(ds4_comm_sum_i64(all, a.limb, DS4_SUMSQ_LIMBS + 1));
    ds4_sumsq_normalize(&a);
    *norm = sqrt(ds4_sumsq_value(&a));
    float s;
    if (!fsdp_planning(f) && ds4_clip_factor(max_norm, *norm, &s)) ds4_dev_scale(fsdp_ex(f), f->sg, f->ns, s);
    return DS4_OK;
}

/* The rule on the host: each bias piece [k1 - k0] (at most E floats) brought over and back. */
typedef struct {
    ds4_fsdp *f;
    const int64_t *loads;
    double gamma;
    float *host; /* [E] */
} bias_ctx;
static void bias_overlap(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    bias_ctx *c = ctx;
    const ds4_config *cfg = ds4_model_config(c->f->m);
    const int64_t E = cfg->n_routed_experts, b = ds4_param_router_block(cfg, p);
    if (b < 0) return;
    const size_t bytes = (size_t)(k1 - k0) * sizeof(float);
    ds4_dev_to_host(fsdp_ex(c->f), c->host, c->f->sp + s0, bytes);
    ds4_router_bias_rule(c->loads + b * E, E, c->gamma, k0, k1, c->host);
    ds4_dev_to_device(fsdp_ex(c->f), c->f->sp + s0, c->host, bytes);
}

ds4_status ds4_fsdp_router_bias_update(ds4_fsdp *f, const int64_t *loads, double gamma) {
    if (fsdp_planning(f)) return DS4_OK;
    const int64_t E = ds4_model_config(f->m)->n_routed_experts;
    bias_ctx c = {f, loads, gamma, ds4_alloc(DS4_MEM_OTHER, (size_t)(E > 0 ? E : 1) * sizeof(float))};
    if (!c.host) return ds4_fail(DS4_ERR_OOM, "out of memory for the router bias update");
    ds4_fsdp_for_each_piece(f, bias_overlap, &c);
    ds4_free(c.host);
    return DS4_OK;
}

/* ------------------------------------------------------------------ whole matrices (Muon) */
/* Where one selected parameter p lives: its region's communicator, every rank's elements of p (counts,
 * displacements in p, v: [2n]) and this rank's [k0, k0 + counts[me]) at shard offset s0. */
typedef struct {
    ds4_comm *c;
    int n, me;
    int64_t *counts, *displs;
    int64_t k0, s0;
} matrix_home;

static void matrix_layout(const ds4_fsdp *f, const piece *q, int64_t a, int64_t numel, matrix_home *h) {
    h->c = piece_comm(f, q);
    h->n = ds4_comm_size(h->c);
    h->me = ds4_comm_rank(h->c);
    for (int r = 0; r < h->n; r++) {
        const int64_t lo = q->start + (int64_t)r * q->chunk, hi = lo + piece_len(q->end - q->start, q->chunk, r);
        const int64_t x = a > lo ? a : lo, y = a + numel < hi ? a + numel : hi;
        h->counts[r] = x < y ? y - x : 0;
        h->displs[r] = x < y ? x - a : 0;
    }
    h->k0 = h->displs[h->me];
    h->s0 = h->counts[h->me] ? q->shard_off + (a + h->k0 - (q->start + q->off)) : q->shard_off; /* none: unused */
}

/* One matrix: parts out, gathered on owner, whole there, scattered back, parts in; the parts and the
 * matrix are buffers of ex's backend (a plan's are counted, not backed). v: [4n] scratch. */
static ds4_status one_matrix(const ds4_exec *ex, const ds4_matrix_ops *ops, ds4_param *p, matrix_home *h, int owner,
                             int64_t *v) {
    const int64_t mine = h->counts[h->me], k0 = h->k0;
    const bool own = h->me == owner, alone = h->n == 1;
    float *part = alone ? NULL : ds4_dev_alloc(ex, DS4_MEM_OPTIM, (size_t)mine * sizeof(float));
    float *x = own ? ds4_dev_alloc(ex, DS4_MEM_OPTIM, (size_t)p->numel * sizeof(float)) : NULL;
    if (alone) part = x;
    ds4_status st = part && (x || !own) ? DS4_OK
                                        : ds4_fail(DS4_ERR_OOM, "%s: out of memory gathering the matrix", p->name);
    if (st == DS4_OK) st = ops->part_out(ops->ctx, p, k0, k0 + mine, h->s0, part);
    ds4_status cs = alone ? DS4_OK : ds4_comm_gatherv(h->c, part, mine, x, h->counts, h->displs, sizeof(float), owner);
    if (st == DS4_OK) st = cs;
    if (st == DS4_OK && own) st = ops->whole(ops->ctx, p, x);
    if (!alone) { /* the scatter: only the owner sends, every rank receives its part */
        for (int r = 0; r < h->n; r++) {
            v[r] = own ? h->counts[r] : 0;
            v[h->n + r] = r == owner ? mine : 0;
            v[2 * h->n + r] = 0;
        }
        cs = ds4_comm_alltoallv(h->c, x, v, h->displs, part, v + h->n, v + 2 * h->n, sizeof(float));
        if (st == DS4_OK) st = cs;
    }
    if (st == DS4_OK) st = ops->part_in(ops->ctx, p, k0, k0 + mine, h->s0, part);
    if (!alone) ds4_dev_free(ex, part);
    ds4_dev_free(ex, x);
    return st;
}

/* Over f's world: every rank's elements of p in its region (dense: all ranks; expert e: the ranks of its EP
 * rank, each EP group one piece), gathered on root. */
ds4_status ds4_fsdp_gather_param(ds4_fsdp *f, const float *shard, const ds4_param *p, float *out, int root) {
    ds4_model *m = f->m;
    const int64_t a = p->data - ds4_model_params_flat(m), ri = ds4_model_region_at(m, a);
    const ds4_region *g = ri >= 0 ? ds4_model_region(m, ri) : NULL;
    if (!g || (!f->whole && !ds4_fsdp_holds_group(f, g->group)))
        return ds4_fail(DS4_ERR_INTERNAL, "%s: not a parameter of this FSDP's groups", p->name);
    const int W = f->W, me = ds4_comm_rank(f->world);
    const bool expert = g->expert >= 0;
    const int64_t len = g->end - g->start, n = expert ? W / f->ep_size : W, chunk = (len + n - 1) / n;
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 2 * (size_t)W);
    if (!v) return ds4_fail(DS4_ERR_OOM, "out of memory gathering %s", p->name);
    for (int w = 0; w < W; w++) {
        const bool holds = !expert || g->expert / f->eloc == w % f->ep_size;
        const int idx = expert ? w / f->ep_size : w;
        const int64_t lo = g->start + (int64_t)idx * chunk, hi = lo + piece_len(len, chunk, idx);
        const int64_t x = a > lo ? a : lo, y = a + p->numel < hi ? a + p->numel : hi;
        v[w] = holds && x < y ? y - x : 0;
        v[W + w] = holds && x < y ? x - a : 0;
    }
    const int64_t j = f->piece_of_region[ri];
    const float *mine = NULL;
    if (v[me] > 0 && j >= 0) {
        const piece *q = &f->pieces[j];
        mine = shard + q->shard_off + (a + v[W + me] - (q->start + q->off));
    }
    ds4_status st = ds4_comm_gatherv(f->world, mine, v[me], out, v, v + W, sizeof(float), root);
    ds4_free(v);
    return st;
}

ds4_status ds4_fsdp_for_each_matrix(ds4_fsdp *f, const ds4_matrix_ops *ops) {
    ds4_model *m = f->m;
    const float *flat = ds4_model_params_flat(m);
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 5 * (size_t)f->W);
    if (!v) return ds4_fail(DS4_ERR_OOM, "out of memory for the matrix exchange");
    matrix_home h = {.counts = v, .displs = v + f->W};
    int64_t turn[2] = {0, 0}, ri = 0; /* round-robin counters: dense, expert */
    ds4_status st = DS4_OK;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (p->is_int || !ops->pick(p)) continue;
        const int64_t a = p->data - flat;
        while (ds4_model_region(m, ri)->end <= a) ri++;
        const int64_t j = f->piece_of_region[ri];
        if (j < 0) continue; /* another EP rank's expert */
        const piece *q = &f->pieces[j];
        matrix_layout(f, q, a, p->numel, &h);
        const int owner = (int)(turn[q->expert]++ % h.n);
        ds4_status ms = one_matrix(fsdp_ex(f), ops, p, &h, owner, v + 2 * f->W);
        if (st == DS4_OK) st = ms;
    }
    ds4_free(v);
    return st;
}
