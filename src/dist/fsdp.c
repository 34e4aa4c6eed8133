/* FSDP + expert parallelism around an unmapped model (ds4/dist.h).
 *
 * Every region of the model's flat layout is cut into equal chunks over the ranks that hold it: dense
 * regions over the FSDP communicator (all ranks), expert regions over the ranks holding that expert
 * (one per EP group). A rank's pieces, concatenated, are its shard of parameters, gradients and
 * optimizer state. gather = all-gather of a group's pieces into the model's (mapped) flat range;
 * grad_end = reduce-scatter by all-to-all of the group's full gradients, each rank adding what it
 * receives in rank order (so the sum is the same bits whatever the MPI library does).
 * Communicators: FSDP, EP (all-to-all of token rows) and expert replicas are three separate ones. */
#include "dist/dist_kernels.h"
#include "ds4/dist.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t region, group;
    int64_t start, end, map_end; /* the region, and the end of its last page */
    bool expert;                 /* sharded over the expert-replica communicator, else FSDP */
    bool bf16;                   /* gathered from the shard's bf16 copy into the model's (region.bf16) */
    int64_t chunk;               /* elements of every rank's piece (the last ones may be shorter) */
    int64_t off, len;            /* this rank's piece: flat [start + off, start + off + len) */
    int64_t shard_off;           /* where it lives in the shard buffers */
} piece;

/* What overlap keeps in flight (prefetch depth > 0; made by ds4_fsdp_set_prefetch, so a blocking FSDP
 * holds none of it). */
typedef struct {
    int depth;
    bool *w_flight, *g_flight;   /* [ngroups] all-gather / reduce-scatter started, not completed */
    int64_t *gq, gq_head, gq_n;  /* [ngroups] ring: the groups whose reduce-scatter is in flight, oldest first */
    ds4_comm_req **wreq, **greq; /* [npieces] each piece's all-gather and reduce-scatter in flight */
    float **grecv;               /* [npieces] the reduce-scatter's receive buffer [n · len] while in flight */
} overlap;

struct ds4_fsdp {
    ds4_model *m;
    ds4_comm *world, *fsdp, *ep, *rep; /* rep: ranks holding the same experts (one per EP group) */
    int W, ep_size;
    int64_t eloc;                      /* experts per EP rank; this rank's are [ops.e0, ops.e1) */
    piece *pieces;
    int64_t npieces;
    int64_t *piece_of_region;          /* [nregions] piece index or -1 */
    bool *w_mapped, *g_mapped;         /* [ngroups] */
    overlap *ov;                       /* NULL: blocking collectives (prefetch depth 0) */
    float *sp, *sg;                    /* [ns]; a model with the bf16 copy: sp is followed by the shard's copy */
    int64_t ns;
    ds4_param_hooks hooks;
    ds4_ep_ops ops;
};

/* [ns] the bf16 copy of the shard's bf16 pieces, in the allocation of sp (a model with the copy), or NULL. */
static uint16_t *shard_bf16(const ds4_fsdp *f) {
    return ds4_model_bf16_flat(f->m) ? (uint16_t *)(f->sp + f->ns) : NULL;
}

/* On a plan communicator FSDP plans: shards and buffers are counted, no value is read, written or sent. */
static bool planning(const ds4_fsdp *f) { return ds4_comm_is_plan(f->world); }

static ds4_comm *piece_comm(const ds4_fsdp *f, const piece *p) { return p->expert ? f->rep : f->fsdp; }

/* Length of rank r's piece of a region of len elements cut in chunks. */
static int64_t piece_len(int64_t len, int64_t chunk, int r) {
    int64_t a = (int64_t)r * chunk, b = a + chunk < len ? a + chunk : len;
    return b > a ? b - a : 0;
}

/* counts/displs [n] of the pieces of one region over a communicator of n ranks. */
static void piece_layout(const piece *p, int n, int64_t *counts, int64_t *displs) {
    for (int r = 0; r < n; r++) {
        counts[r] = piece_len(p->end - p->start, p->chunk, r);
        displs[r] = (int64_t)r * p->chunk;
    }
}

/* ------------------------------------------------------------------ hooks: FSDP */
/* Maps piece p's range and all-gathers the ranks' parts of it there: blocking (req NULL) or started (*req).
 * A bf16 piece travels from the shard's bf16 copy into the model's, 2 bytes per element. */
static ds4_status gather_piece(ds4_fsdp *f, const piece *p, ds4_comm_req **req) {
    ds4_comm *c = piece_comm(f, p);
    int n = ds4_comm_size(c);
    int64_t *cd = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 2 * (size_t)n);
    if (!cd) return DS4_ERR_OOM;
    piece_layout(p, n, cd, cd + n);
    const bool h = p->bf16;
    const size_t elem = h ? sizeof(uint16_t) : sizeof(float);
    const void *src = h ? (const void *)(shard_bf16(f) + p->shard_off) : (const void *)(f->sp + p->shard_off);
    void *dst = h ? (void *)(ds4_model_bf16_flat(f->m) + p->start) : (void *)(ds4_model_params_flat(f->m) + p->start);
    ds4_status st = h ? ds4_model_map_bf16(f->m, p->start, p->map_end) : ds4_model_map(f->m, p->start, p->map_end, false);
    if (st == DS4_OK)
        st = req ? ds4_comm_iallgatherv(c, src, p->len, dst, cd, cd + n, elem, req)
                 : ds4_comm_allgatherv(c, src, p->len, dst, cd, cd + n, elem);
    ds4_free(cd);
    return st;
}

/* Gives piece p's gathered range back (its bf16 copy's for a bf16 piece). */
static void drop_piece(ds4_fsdp *f, const piece *p) {
    if (p->bf16) ds4_model_unmap_bf16(f->m, p->start, p->map_end);
    else ds4_model_unmap(f->m, p->start, p->map_end, false);
}

/* Overlapped gathers (depth > 0): start maps the group's ranges and starts one all-gather per piece;
 * finish waits for them. */
static ds4_status gather_start(ds4_fsdp *f, int64_t group) {
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    o->w_flight[group] = true;
    for (int64_t i = 0; st == DS4_OK && i < f->npieces; i++)
        if (f->pieces[i].group == group) st = gather_piece(f, &f->pieces[i], &o->wreq[i]);
    return st;
}

static ds4_status gather_finish(ds4_fsdp *f, int64_t group) {
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    for (int64_t i = 0; i < f->npieces; i++) {
        if (f->pieces[i].group != group) continue;
        ds4_status w = ds4_comm_wait(o->wreq[i]);
        o->wreq[i] = NULL;
        if (st == DS4_OK) st = w;
    }
    o->w_flight[group] = false;
    f->w_mapped[group] = true;
    return st;
}

static ds4_status hook_prefetch(void *ctx, const int64_t *next, int64_t n) {
    ds4_fsdp *f = ctx;
    if (!f->ov) return DS4_OK;
    ds4_comm_progress();
    ds4_status st = DS4_OK;
    for (int64_t k = 0; st == DS4_OK && k < n && k < f->ov->depth; k++)
        if (!f->w_mapped[next[k]] && !f->ov->w_flight[next[k]]) st = gather_start(f, next[k]);
    return st;
}

static ds4_status hook_gather(void *ctx, int64_t group) {
    ds4_fsdp *f = ctx;
    ds4_comm_progress();
    if (f->w_mapped[group]) return DS4_OK;
    if (f->ov) {
        ds4_status st = f->ov->w_flight[group] ? DS4_OK : gather_start(f, group);
        ds4_status w = gather_finish(f, group);
        return st != DS4_OK ? st : w;
    }
    ds4_status st = DS4_OK;
    for (int64_t i = 0; st == DS4_OK && i < f->npieces; i++)
        if (f->pieces[i].group == group) st = gather_piece(f, &f->pieces[i], NULL);
    f->w_mapped[group] = true;
    return st;
}

static void hook_drop(void *ctx, int64_t group) {
    ds4_fsdp *f = ctx;
    if (f->ov && f->ov->w_flight[group]) (void)gather_finish(f, group); /* a prefetch the pass did not use (a failure) */
    if (!f->w_mapped[group]) return;
    for (int64_t i = 0; i < f->npieces; i++)
        if (f->pieces[i].group == group) drop_piece(f, &f->pieces[i]);
    f->w_mapped[group] = false;
}

static ds4_status reduce_finish(ds4_fsdp *f, int64_t group);

static ds4_status hook_grad_begin(void *ctx, int64_t group) {
    ds4_fsdp *f = ctx;
    if (f->ov && f->ov->g_flight[group]) DS4_TRY(reduce_finish(f, group)); /* its last reduce-scatter still runs */
    if (f->g_mapped[group]) return DS4_OK;
    for (int64_t i = 0; i < f->npieces; i++)
        if (f->pieces[i].group == group) DS4_TRY(ds4_model_map(f->m, f->pieces[i].start, f->pieces[i].map_end, true));
    f->g_mapped[group] = true;
    return DS4_OK;
}

/* Reduce-scatter of one region's full gradient: piece q goes to rank q; this rank sums the n versions
 * of its piece it receives, in rank order, and adds the sum to its shard gradient. Summing the pass
 * first makes the accumulation over micro-batches the same bits for any EP degree: with EP an expert's
 * gradient of the pass arrives already summed over the source ranks (in rank order). */
static ds4_status reduce_piece(ds4_fsdp *f, const piece *p) {
    ds4_comm *c = piece_comm(f, p);
    int n = ds4_comm_size(c);
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 4 * (size_t)n);
    float *recv = ds4_alloc(DS4_MEM_COMM, (size_t)(n * p->len) * sizeof(float));
    ds4_status st = v && recv ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory reducing gradients");
    if (st == DS4_OK) {
        piece_layout(p, n, v, v + n);
        for (int r = 0; r < n; r++) {
            v[2 * n + r] = p->len;
            v[3 * n + r] = (int64_t)r * p->len;
        }
        ds4_comm_req *q = NULL;
        st = ds4_comm_ialltoallv(c, ds4_model_grads_flat(f->m) + p->start, v, v + n, recv, v + 2 * n, v + 3 * n,
                                 sizeof(float), &q);
        ds4_comm_req_label(q, "reduce-scatter");
        if (st == DS4_OK) st = ds4_comm_wait(q);
    }
    if (st == DS4_OK && !planning(f)) rank_sum_add_f32(f->sg + p->shard_off, recv, n, p->len);
    ds4_free(v);
    ds4_free(recv);
    return st;
}

/* Overlapped reduce-scatter (depth > 0): start sends every piece's full gradient, the receive buffers and
 * the group's gradient range stay until finish adds the pieces in rank order, as reduce_piece does. */
static ds4_status reduce_start(ds4_fsdp *f, int64_t group) {
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    o->g_flight[group] = true;
    o->gq[(o->gq_head + o->gq_n++) % ds4_model_ngroups(f->m)] = group;
    for (int64_t i = 0; st == DS4_OK && i < f->npieces; i++) {
        piece *p = &f->pieces[i];
        if (p->group != group) continue;
        ds4_comm *c = piece_comm(f, p);
        int n = ds4_comm_size(c);
        int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 4 * (size_t)n);
        o->grecv[i] = ds4_alloc(DS4_MEM_COMM, (size_t)(n * p->len) * sizeof(float));
        st = v && o->grecv[i] ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory reducing gradients");
        if (st == DS4_OK) {
            piece_layout(p, n, v, v + n);
            for (int r = 0; r < n; r++) {
                v[2 * n + r] = p->len;
                v[3 * n + r] = (int64_t)r * p->len;
            }
            st = ds4_comm_ialltoallv(c, ds4_model_grads_flat(f->m) + p->start, v, v + n, o->grecv[i], v + 2 * n,
                                     v + 3 * n, sizeof(float), &o->greq[i]);
        ds4_comm_req_label(o->greq[i], "reduce-scatter");
        }
        ds4_free(v);
    }
    return st;
}

static ds4_status reduce_finish(ds4_fsdp *f, int64_t group) {
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    for (int64_t i = 0; i < f->npieces; i++) {
        const piece *p = &f->pieces[i];
        if (p->group != group) continue;
        ds4_status w = ds4_comm_wait(o->greq[i]);
        o->greq[i] = NULL;
        if (st == DS4_OK) st = w;
        const float *recv = o->grecv[i];
        if (st == DS4_OK && !planning(f) && recv)
            rank_sum_add_f32(f->sg + p->shard_off, recv, ds4_comm_size(piece_comm(f, p)), p->len);
        ds4_free(o->grecv[i]);
        o->grecv[i] = NULL;
    }
    for (int64_t i = 0; i < f->npieces; i++)
        if (f->pieces[i].group == group) ds4_model_unmap(f->m, f->pieces[i].start, f->pieces[i].map_end, true);
    f->g_mapped[group] = false;
    o->g_flight[group] = false;
    /* out of the ring: the oldest, except after a grad_begin that could not wait (then anywhere) */
    int64_t ng = ds4_model_ngroups(f->m);
    for (int64_t k = 0; k < o->gq_n; k++)
        if (o->gq[(o->gq_head + k) % ng] == group) {
            for (int64_t j = k; j > 0; j--) o->gq[(o->gq_head + j) % ng] = o->gq[(o->gq_head + j - 1) % ng];
            o->gq_head = (o->gq_head + 1) % ng;
            o->gq_n--;
            break;
        }
    return st;
}

/* Everything in flight completes: reduce-scatters oldest first, then unused prefetches are dropped. */
static ds4_status hook_sync(void *ctx) {
    ds4_fsdp *f = ctx;
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    if (!o) return DS4_OK;
    while (o->gq_n > 0) {
        ds4_status r = reduce_finish(f, o->gq[o->gq_head]);
        if (st == DS4_OK) st = r;
    }
    for (int64_t g = 0; g < ds4_model_ngroups(f->m); g++)
        if (o->w_flight[g]) hook_drop(f, g);
    return st;
}

static ds4_status hook_grad_end(void *ctx, int64_t group) {
    ds4_fsdp *f = ctx;
    ds4_comm_progress();
    if (!f->g_mapped[group] || (f->ov && f->ov->g_flight[group])) return DS4_OK;
    if (f->ov) {
        overlap *o = f->ov;
        ds4_status st = reduce_start(f, group);
        while (st == DS4_OK && o->gq_n > o->depth) st = reduce_finish(f, o->gq[o->gq_head]);
        return st;
    }
    ds4_status st = DS4_OK;
    for (int64_t i = 0; st == DS4_OK && i < f->npieces; i++)
        if (f->pieces[i].group == group) st = reduce_piece(f, &f->pieces[i]);
    for (int64_t i = 0; i < f->npieces; i++)
        if (f->pieces[i].group == group) ds4_model_unmap(f->m, f->pieces[i].start, f->pieces[i].map_end, true);
    f->g_mapped[group] = false;
    return st;
}

/* ------------------------------------------------------------------ hooks: EP */
/* EP rank owning expert e. */
static int expert_owner(const ds4_fsdp *f, int64_t e) { return (int)(e / f->eloc); }

/* Between the start of an EP all-to-all and its wait: y->yield(y->ctx) lets another pass compute while the
 * rows travel (--moe-fb-overlap); y NULL: nothing. A plan yields too: the same interleaving, the same peak. */
static void ep_yield(const ds4_fsdp_yielding *y) {
    if (y && y->yield) y->yield(y->ctx);
}

/* got [n][L] := the rows every source s of the EP group sends to each of this rank's L experts, from
 * this rank's cnt [n·L] (rows per expert of the whole model, in expert order). The one place a count
 * crosses to the host mid-step: dispatch and combine size their buffers and all-to-alls from it, so on a
 * device the counts the MoE kernel made are copied back here (a synchronization, once per MoE pass). */
static ds4_status ep_recv_counts(ds4_fsdp *f, const ds4_fsdp_yielding *y, const int64_t *cnt, int64_t *got) {
    ds4_comm_req *req = NULL;
    ds4_status st = ds4_comm_ialltoall_counts(f->ep, cnt, f->eloc, got, &req);
    ds4_comm_req_label(req, "route");
    if (st == DS4_OK) ep_yield(y);
    if (st == DS4_OK) st = ds4_comm_wait(req);
    return st;
}

/* The route of one MoE pass: what this rank sends each EP rank (cnt summed over that rank's experts) and
 * what it receives, per expert and source. */
static ds4_status route_rows(ds4_fsdp *f, const ds4_fsdp_yielding *y, const int64_t *cnt, ds4_ep_route **out) {
    ds4_comm_progress();
    const int n = f->ep_size;
    const int64_t L = f->eloc;
    ds4_ep_route *r = ds4_ep_route_new(n, f->ops.e0, f->ops.e1);
    int64_t *got = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * (size_t)((int64_t)n * L + 1)); /* [n][L] */
    if (!r || !got) {
        ds4_ep_route_free(r);
        ds4_free(got);
        return ds4_fail(DS4_ERR_OOM, "out of memory routing tokens");
    }
    for (int q = 0; q < n; q++) {
        r->send_cnt[q] = 0;
        for (int64_t e = q * L; e < (q + 1) * L; e++) r->send_cnt[q] += cnt[e];
    }
    ds4_status st = ep_recv_counts(f, y, cnt, got);
    r->rows = 0;
    for (int s = 0; s < n; s++) {
        r->recv_from[s] = 0;
        for (int64_t i = 0; i < L; i++) {
            r->recv_cnt[i * n + s] = got[(int64_t)s * L + i];
            r->recv_from[s] += got[(int64_t)s * L + i];
        }
        r->rows += r->recv_from[s];
    }
    ds4_free(got);
    if (st != DS4_OK) {
        ds4_ep_route_free(r);
        return st;
    }
    *out = r;
    return DS4_OK;
}

/* Counts and displacements of the assignment-order side (by destination) and the wire side (by source). */
static int64_t *ep_layout(const ds4_ep_route *r, int64_t **sc, int64_t **sd, int64_t **rc, int64_t **rd) {
    const int n = r->nsrc;
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 4 * (size_t)n);
    if (!v) return NULL;
    *sc = v, *sd = v + n, *rc = v + 2 * n, *rd = v + 3 * n;
    int64_t so = 0, ro = 0;
    for (int q = 0; q < n; q++) {
        (*sc)[q] = r->send_cnt[q];
        (*sd)[q] = so;
        so += r->send_cnt[q];
        (*rc)[q] = r->recv_from[q];
        (*rd)[q] = ro;
        ro += r->recv_from[q];
    }
    return v;
}

/* Dispatch: rows in assignment order (in) → the owners, expert-major (out). Combine: the reverse, the
 * owners' results (in) → assignment order (out). */
static ds4_status ep_exchange(ds4_fsdp *f, const ds4_fsdp_yielding *y, const ds4_ep_route *r, const float *in,
                              float *out, int64_t width, bool dispatch) {
    int64_t *sc = NULL, *sd = NULL, *rc = NULL, *rd = NULL, *v = ep_layout(r, &sc, &sd, &rc, &rd);
    float *wire = ds4_alloc(DS4_MEM_COMM, (size_t)(r->rows * width) * sizeof(float));
    ds4_status st = v && wire ? DS4_OK
                              : ds4_fail(DS4_ERR_OOM, "out of memory %s tokens", dispatch ? "dispatching" : "combining");
    for (int q = 0; st == DS4_OK && q < r->nsrc; q++) {
        sc[q] *= width, sd[q] *= width, rc[q] *= width, rd[q] *= width;
    }
    const bool data = !planning(f);
    if (st == DS4_OK && !dispatch && data) ep_rows_experts_to_wire(r->recv_cnt, r->nsrc, r->e1 - r->e0, in, wire, width);
    ds4_comm_req *q = NULL;
    if (st == DS4_OK)
        st = dispatch ? ds4_comm_ialltoallv(f->ep, in, sc, sd, wire, rc, rd, sizeof(float), &q)
                      : ds4_comm_ialltoallv(f->ep, wire, rc, rd, out, sc, sd, sizeof(float), &q);
    ds4_comm_req_label(q, dispatch ? "dispatch" : "combine");
    if (st == DS4_OK) ep_yield(y);
    if (st == DS4_OK) st = ds4_comm_wait(q);
    if (st == DS4_OK && dispatch && data) ep_rows_wire_to_experts(r->recv_cnt, r->nsrc, r->e1 - r->e0, wire, out, width);
    ds4_free(v);
    ds4_free(wire);
    return st;
}

/* The EP ops: f's own (ctx f), and the yielding ones (ctx a ds4_fsdp_yielding). */
static ds4_status ep_route(void *ctx, const int64_t *cnt, ds4_ep_route **out) {
    return route_rows(ctx, NULL, cnt, out);
}
static ds4_status ep_dispatch(void *ctx, const ds4_ep_route *r, const float *send, float *recv, int64_t width) {
    return ep_exchange(ctx, NULL, r, send, recv, width, true);
}
static ds4_status ep_combine(void *ctx, const ds4_ep_route *r, const float *recv, float *send, int64_t width) {
    return ep_exchange(ctx, NULL, r, recv, send, width, false);
}
static ds4_status yielding_route(void *ctx, const int64_t *cnt, ds4_ep_route **out) {
    const ds4_fsdp_yielding *y = ctx;
    return route_rows(y->f, y, cnt, out);
}
static ds4_status yielding_dispatch(void *ctx, const ds4_ep_route *r, const float *send, float *recv, int64_t width) {
    const ds4_fsdp_yielding *y = ctx;
    return ep_exchange(y->f, y, r, send, recv, width, true);
}
static ds4_status yielding_combine(void *ctx, const ds4_ep_route *r, const float *recv, float *send, int64_t width) {
    const ds4_fsdp_yielding *y = ctx;
    return ep_exchange(y->f, y, r, recv, send, width, false);
}

void ds4_fsdp_yielding_init(ds4_fsdp *f, void (*yield)(void *ctx), void *ctx, ds4_fsdp_yielding *y) {
    *y = (ds4_fsdp_yielding){.f = f, .yield = yield, .ctx = ctx, .ops = f->ops};
    y->ops.ctx = y;
    y->ops.route = yielding_route;
    y->ops.dispatch = yielding_dispatch;
    y->ops.combine = yielding_combine;
}

static void overlap_free(overlap *o) {
    if (!o) return;
    ds4_free(o->w_flight);
    ds4_free(o->g_flight);
    ds4_free(o->gq);
    ds4_free(o->wreq);
    ds4_free(o->greq);
    ds4_free(o->grecv);
    ds4_free(o);
}

ds4_status ds4_fsdp_set_prefetch(ds4_fsdp *f, int depth) {
    if (depth < 0 || depth > DS4_PREFETCH_MAX)
        return ds4_fail(DS4_ERR_ARG, "--prefetch-depth %d: expected 0 (blocking) to %d", depth, DS4_PREFETCH_MAX);
    DS4_TRY(hook_sync(f)); /* nothing of the old depth stays in flight */
    overlap_free(f->ov);
    f->ov = NULL;
    if (depth == 0) return DS4_OK;
    const int64_t ng = ds4_model_ngroups(f->m), np = f->npieces;
    overlap *o = ds4_calloc(DS4_MEM_OTHER, sizeof *o);
    if (!o) return ds4_fail(DS4_ERR_OOM, "out of memory for --prefetch-depth %d", depth);
    o->depth = depth;
    o->w_flight = ds4_calloc(DS4_MEM_OTHER, (size_t)ng * sizeof(bool));
    o->g_flight = ds4_calloc(DS4_MEM_OTHER, (size_t)ng * sizeof(bool));
    o->gq = ds4_calloc(DS4_MEM_OTHER, (size_t)ng * sizeof(int64_t));
    o->wreq = ds4_calloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(ds4_comm_req *));
    o->greq = ds4_calloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(ds4_comm_req *));
    o->grecv = ds4_calloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(float *));
    if (!o->w_flight || !o->g_flight || !o->gq || !o->wreq || !o->greq || !o->grecv) {
        overlap_free(o);
        return ds4_fail(DS4_ERR_OOM, "out of memory for --prefetch-depth %d", depth);
    }
    f->ov = o;
    return DS4_OK;
}

/* ------------------------------------------------------------------ create */
static ds4_status build_pieces(ds4_fsdp *f) {
    ds4_model *m = f->m;
    int64_t nr = ds4_model_nregions(m), numel = ds4_model_numel(m);
    f->pieces = ds4_calloc(DS4_MEM_OTHER, (size_t)(nr + 1) * sizeof(piece));
    f->piece_of_region = ds4_alloc(DS4_MEM_OTHER, (size_t)(nr + 1) * sizeof(int64_t));
    if (!f->pieces || !f->piece_of_region) return DS4_ERR_OOM;
    for (int64_t i = 0; i < nr; i++) {
        const ds4_region *g = ds4_model_region(m, i);
        f->piece_of_region[i] = -1;
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
    const size_t copy = ds4_model_bf16_flat(m) ? (size_t)f->ns * sizeof(uint16_t) : 0; /* the shard's bf16 copy */
    f->sp = ds4_calloc(DS4_MEM_PARAM, (size_t)f->ns * sizeof(float) + copy);
    f->sg = ds4_calloc(DS4_MEM_GRAD, (size_t)f->ns * sizeof(float));
    return f->sp && f->sg ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory for a shard of %lld parameters", (long long)f->ns);
}

ds4_status ds4_fsdp_create(ds4_model *m, ds4_comm *world, int ep, ds4_fsdp **out) {
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
    f->ops = (ds4_ep_ops){.ctx = f, .e0 = e0, .e1 = e0 + f->eloc, .route = ep_route, .dispatch = ep_dispatch,
                          .combine = ep_combine};
    int64_t ng = ds4_model_ngroups(m);
    f->w_mapped = ds4_calloc(DS4_MEM_OTHER, (size_t)ng * sizeof(bool));
    f->g_mapped = ds4_calloc(DS4_MEM_OTHER, (size_t)ng * sizeof(bool));
    ds4_status st = f->w_mapped && f->g_mapped ? DS4_OK : DS4_ERR_OOM;
    /* three communicators of their own: FSDP (all ranks), EP groups, expert replicas */
    if (st == DS4_OK) st = ds4_comm_split(world, 0, rank, W, rank, &f->fsdp);
    if (st == DS4_OK) st = ds4_comm_split(world, rank / ep, rank, ep, rank % ep, &f->ep);
    if (st == DS4_OK) st = ds4_comm_split(world, rank % ep, rank, W / ep, rank / ep, &f->rep);
    if (st == DS4_OK) {
        ds4_comm_set_lane(f->fsdp, DS4_LANE_FSDP);
        ds4_comm_set_lane(f->rep, DS4_LANE_FSDP);
        ds4_comm_set_lane(f->ep, DS4_LANE_EP);
        st = build_pieces(f);
    }
    if (st != DS4_OK) {
        ds4_fsdp_free(f);
        return st;
    }
    f->hooks = (ds4_param_hooks){.ctx = f, .gather = hook_gather, .drop = hook_drop, .grad_begin = hook_grad_begin,
                                 .grad_end = hook_grad_end, .prefetch = hook_prefetch, .sync = hook_sync,
                                 .ep = ep > 1 ? &f->ops : NULL};
    *out = f;
    return DS4_OK;
}

void ds4_fsdp_free(ds4_fsdp *f) {
    if (!f) return;
    int64_t ng = ds4_model_ngroups(f->m);
    (void)hook_sync(f); /* nothing may stay in flight */
    for (int64_t g = 0; f->w_mapped && g < ng; g++) {
        hook_drop(f, g);
        if (f->g_mapped[g]) {
            for (int64_t i = 0; i < f->npieces; i++)
                if (f->pieces[i].group == g) ds4_model_unmap(f->m, f->pieces[i].start, f->pieces[i].map_end, true);
            f->g_mapped[g] = false;
        }
    }
    ds4_comm_free(f->fsdp);
    ds4_comm_free(f->ep);
    ds4_comm_free(f->rep);
    ds4_free(f->pieces);
    ds4_free(f->piece_of_region);
    ds4_free(f->w_mapped);
    ds4_free(f->g_mapped);
    overlap_free(f->ov);
    ds4_free(f->sp);
    ds4_free(f->sg);
    ds4_free(f);
}

const ds4_param_hooks *ds4_fsdp_hooks(ds4_fsdp *f) { return &f->hooks; }
int64_t ds4_fsdp_shard_numel(const ds4_fsdp *f) { return f->ns; }
float *ds4_fsdp_shard_params(ds4_fsdp *f) { return f->sp; }
float *ds4_fsdp_shard_grads(ds4_fsdp *f) { return f->sg; }
void ds4_fsdp_refresh_bf16(ds4_fsdp *f) {
    uint16_t *sh = shard_bf16(f);
    for (int64_t i = 0; sh && i < f->npieces; i++) {
        const piece *p = &f->pieces[i];
        if (p->bf16) ds4_model_pack_bf16(sh + p->shard_off, f->sp + p->shard_off, p->len);
    }
}

void ds4_fsdp_zero_grads(ds4_fsdp *f) {
    if (!planning(f)) memset(f->sg, 0, (size_t)f->ns * sizeof(float));
}

/* ------------------------------------------------------------------ shards: init, load, optimizer rules */
/* Calls fn for every (float parameter, piece) overlap: elements [k0, k1) of the parameter are shard
 * elements [s0, s0 + k1 - k0). */
typedef void (*overlap_fn)(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0);
static void for_each_overlap(const ds4_fsdp *f, overlap_fn fn, void *ctx) {
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

typedef struct {
    ds4_fsdp *f;
    uint64_t seed;
} init_ctx;
static void init_overlap(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    init_ctx *c = ctx;
    ds4_param_init_values(p, c->seed, k0, k1, c->f->sp + s0);
}

ds4_status ds4_fsdp_init_random(ds4_fsdp *f, uint64_t seed) {
    if (planning(f)) return DS4_OK;
    init_ctx c = {f, seed};
    for_each_overlap(f, init_overlap, &c);
    for (int64_t i = 0; i < ds4_model_nparams(f->m); i++) /* the tables and carried tensors: whole on every rank */
        if (!ds4_param_in_flat(ds4_model_param(f->m, i))) ds4_model_init_param(f->m, i, seed);
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
        if (st == DS4_OK && !planning(f))
            memcpy(f->sp + q->shard_off, flat + q->start + q->off, (size_t)q->len * sizeof(float));
        ds4_model_unmap(m, q->start, q->map_end, false);
        DS4_TRY(st);
    }
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) /* the tables and carried tensors: whole on every rank */
        if (!ds4_param_in_flat(ds4_model_param(m, i))) DS4_TRY(ds4_model_load_param(m, d, i));
    return DS4_OK;
}

void ds4_fsdp_for_each_piece(const ds4_fsdp *f, ds4_fsdp_piece_fn fn, void *ctx) { for_each_overlap(f, fn, ctx); }

/* ------------------------------------------------------------------ whole-model views */
/* Gathers region i of a shard buffer on root into dst [end - start of the region] (root only). Who
 * holds which piece: dense regions over all ranks; expert e over the ranks of its EP rank. v: [2W]. */
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
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 2 * (size_t)f->W);
    if (!v) return DS4_ERR_OOM;
    ds4_status st = DS4_OK;
    for (int64_t i = 0; st == DS4_OK && i < ds4_model_nregions(m); i++)
        st = gather_region(f, i, shard, out ? out + ds4_model_region(m, i)->start : NULL, root, v);
    ds4_free(v);
    return st;
}

ds4_status ds4_fsdp_collect(ds4_fsdp *f, bool grads, float *out, int root) {
    return ds4_fsdp_collect_buf(f, grads ? f->sg : f->sp, out, root);
}

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
    ds4_model *m;
    const int64_t *poff;
    ds4_packed_read_fn read;
    void *ctx;
    float *shard;
    ds4_status st;
} scatter_ctx;
static void scatter_overlap(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    scatter_ctx *c = ctx;
    int64_t i = p - ds4_model_param(c->m, 0);
    if (c->st == DS4_OK) c->st = c->read(c->ctx, c->poff[i] + k0, k1 - k0, c->shard + s0);
}

ds4_status ds4_fsdp_scatter_packed(const ds4_fsdp *f, ds4_packed_read_fn read, void *ctx, float *shard) {
    if (planning(f)) return DS4_OK;
    int64_t *poff = packed_offsets(f->m);
    if (!poff) return ds4_fail(DS4_ERR_OOM, "out of memory scattering into a shard");
    scatter_ctx c = {f->m, poff, read, ctx, shard, DS4_OK};
    for_each_overlap(f, scatter_overlap, &c);
    ds4_free(poff);
    return c.st;
}

ds4_status ds4_fsdp_clip_grad_norm(ds4_fsdp *f, double max_norm, double *norm) {
    const int64_t n = planning(f) ? 0 : f->ns;
    ds4_sumsq_acc a;
    ds4_sumsq_exact(f->sg, n, &a);
    DS4_TRY(ds4_comm_sum_i64(f->world, a.limb, DS4_SUMSQ_LIMBS + 1));
    ds4_sumsq_normalize(&a);
    *norm = sqrt(ds4_sumsq_value(&a));
    ds4_clip_scale(f->sg, n, max_norm, *norm);
    return DS4_OK;
}

typedef struct {
    ds4_fsdp *f;
    const int64_t *loads;
    double gamma;
} bias_ctx;
static void bias_overlap(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    bias_ctx *c = ctx;
    const ds4_config *cfg = ds4_model_config(c->f->m);
    const int64_t E = cfg->n_routed_experts, b = ds4_param_router_block(cfg, p);
    if (b >= 0) ds4_router_bias_rule(c->loads + b * E, E, c->gamma, k0, k1, c->f->sp + s0);
}

void ds4_fsdp_router_bias_update(ds4_fsdp *f, const int64_t *loads, double gamma) {
    if (planning(f)) return;
    bias_ctx c = {f, loads, gamma};
    for_each_overlap(f, bias_overlap, &c);
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

/* One matrix: parts out, gathered on owner, whole there, scattered back, parts in. v: [4n] scratch. */
static ds4_status one_matrix(const ds4_matrix_ops *ops, ds4_param *p, matrix_home *h, int owner, int64_t *v) {
    const int64_t mine = h->counts[h->me], k0 = h->k0;
    const bool own = h->me == owner, alone = h->n == 1;
    float *part = alone ? NULL : ds4_alloc(DS4_MEM_OPTIM, (size_t)mine * sizeof(float));
    float *x = own ? ds4_alloc(DS4_MEM_OPTIM, (size_t)p->numel * sizeof(float)) : NULL;
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
    if (!alone) ds4_free(part);
    ds4_free(x);
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
        ds4_status ms = one_matrix(ops, p, &h, owner, v + 2 * f->W);
        if (st == DS4_OK) st = ms;
    }
    ds4_free(v);
    return st;
}
