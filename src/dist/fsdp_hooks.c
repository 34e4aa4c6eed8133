/* FSDP's parameter hooks (ds4_param_hooks, ds4/model.h): gather = all-gather of a group's pieces into the
 * model's (mapped) flat range, drop gives the range back; grad_end = reduce-scatter by all-to-all of the
 * group's full gradients, each rank adding what it receives in rank order (the backend's rank_sum_add), so the sum
 * is the same bits whatever the transport does. With a prefetch depth d > 0 the next groups' all-gathers
 * start early and up to d reduce-scatters stay in flight (docs/overlap.md); this file owns that state. */
#include "dist/fsdp_impl.h"

/* ------------------------------------------------------------------ weights: gather, prefetch, drop */
/* counts/displs [n] of the pieces of one region over a communicator of n ranks. */
static void piece_layout(const piece *p, int n, int64_t *counts, int64_t *displs) {
    for (int r = 0; r < n; r++) {
        counts[r] = piece_len(p->end - p->start, p->chunk, r);
        displs[r] = (int64_t)r * p->chunk;
    }
}

/* Maps piece p's range and all-gathers the ranks' parts of it there: blocking (req NULL) or started (*req,
 * with *cast the buffer to free once it completes). A bf16 piece is cast from the fp32 shard into a buffer
 * of its own [len] just before, and travels 2 bytes per element into the model's bf16 copy. */
static ds4_status gather_piece(ds4_fsdp *f, const piece *p, ds4_comm_req **req, uint16_t **cast) {
    ds4_comm *c = piece_comm(f, p);
    int n = ds4_comm_size(c);
    const bool h = p->bf16;
    if (h && n == 1) { /* a piece nobody else holds (an expert without replicas): cast straight into place */
        DS4_TRY(ds4_model_map_bf16(f->m, p->start, p->map_end));
        if (!fsdp_planning(f)) ds4_model_pack_bf16(f->m, ds4_model_bf16_flat(f->m) + p->start, f->sp + p->shard_off, p->len);
        return DS4_OK;
    }
    int64_t *cd = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 2 * (size_t)n);
    uint16_t *hs = h ? ds4_dev_alloc(fsdp_ex(f), DS4_MEM_COMM, (size_t)(p->len > 0 ? p->len : 1) * sizeof(uint16_t)) : NULL;
    if (!cd || (h && !hs)) {
        ds4_free(cd);
        ds4_dev_free(fsdp_ex(f), hs);
        return ds4_fail(DS4_ERR_OOM, "out of memory gathering parameters");
    }
    piece_layout(p, n, cd, cd + n);
    if (h && !fsdp_planning(f)) ds4_model_pack_bf16(f->m, hs, f->sp + p->shard_off, p->len);
    const size_t elem = h ? sizeof(uint16_t) : sizeof(float);
    const void *src = h ? (const void *)hs : (const void *)(f->sp + p->shard_off);
    void *dst = h ? (void *)(ds4_model_bf16_flat(f->m) + p->start) : (void *)(ds4_model_params_flat(f->m) + p->start);
    ds4_status st = h ? ds4_model_map_bf16(f->m, p->start, p->map_end) : ds4_model_map(f->m, p->start, p->map_end, false);
    if (st == DS4_OK)
        st = req ? ds4_comm_iallgatherv(c, src, p->len, dst, cd, cd + n, elem, req)
                 : ds4_comm_allgatherv(c, src, p->len, dst, cd, cd + n, elem);
    ds4_free(cd);
    if (req && st == DS4_OK) *cast = hs;
    else ds4_dev_free(fsdp_ex(f), hs);
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
        if (f->pieces[i].group == group) st = gather_piece(f, &f->pieces[i], &o->wreq[i], &o->wsrc[i]);
    return st;
}

static ds4_status gather_finish(ds4_fsdp *f, int64_t group) {
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    for (int64_t i = 0; i < f->npieces; i++) {
        if (f->pieces[i].group != group) continue;
        ds4_status w = ds4_comm_wait(o->wreq[i]);
        o->wreq[i] = NULL;
        ds4_dev_free(fsdp_ex(f), o->wsrc[i]);
        o->wsrc[i] = NULL;
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
        if (f->pieces[i].group == group) st = gather_piece(f, &f->pieces[i], NULL, NULL);
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

/* ------------------------------------------------------------------ gradients: reduce-scatter */
static ds4_status reduce_finish(ds4_fsdp *f, int64_t group);

/* A group's full gradient range, mapped (map) or given back, counted under owner: open in the backward
 * (DS4_OWNER_GRAD_OPEN) or in flight, so memplan splits the gradients at their peak by what holds them;
 * the owner's items are its groups. */
static ds4_status group_grads(ds4_fsdp *f, int64_t group, bool map, const char *owner) {
    const char *prev = ds4_mem_owner_enter(owner);
    ds4_status st = DS4_OK;
    if (map) ds4_mem_owner_items(DS4_MEM_GRAD, owner, 1); /* counted before its bytes, which may be a peak */
    for (int64_t i = 0; st == DS4_OK && i < f->npieces; i++) {
        const piece *p = &f->pieces[i];
        if (p->group != group) continue;
        if (map) st = ds4_model_map(f->m, p->start, p->map_end, true);
        else ds4_model_unmap(f->m, p->start, p->map_end, true);
    }
    ds4_mem_owner_leave(prev);
    if (!map || st != DS4_OK) ds4_mem_owner_items(DS4_MEM_GRAD, owner, -1);
    return st;
}

static ds4_status hook_grad_begin(void *ctx, int64_t group) {
    ds4_fsdp *f = ctx;
    if (f->ov && f->ov->g_flight[group]) DS4_TRY(reduce_finish(f, group)); /* its last reduce-scatter still runs */
    if (f->g_mapped[group]) return DS4_OK;
    DS4_TRY(group_grads(f, group, true, DS4_OWNER_GRAD_OPEN));
    f->g_mapped[group] = true;
    return DS4_OK;
}

/* Reduce-scatter of one region's full gradient: piece q goes to rank q; this rank sums the n versions
 * of its piece it receives, in rank order, and adds the sum to its shard gradient. Summing the pass
 * first makes the accumulation over micro-batches the same bits for any EP degree: with EP an expert's
 * gradient of the pass arrives already summed over the source ranks (in rank order).
 * start: the all-to-all of piece p's full gradient range, into *recv [n][len] (allocated here). */
static ds4_status reduce_piece_start(ds4_fsdp *f, const piece *p, float **recv, ds4_comm_req **req) {
    ds4_comm *c = piece_comm(f, p);
    int n = ds4_comm_size(c);
    int64_t *v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 4 * (size_t)n);
    *recv = ds4_dev_alloc(fsdp_ex(f), DS4_MEM_COMM, (size_t)(n * p->len) * sizeof(float));
    ds4_status st = v && *recv ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory reducing gradients");
    if (st == DS4_OK) {
        piece_layout(p, n, v, v + n);
        for (int r = 0; r < n; r++) {
            v[2 * n + r] = p->len;
            v[3 * n + r] = (int64_t)r * p->len;
        }
        st = ds4_comm_ialltoallv(c, ds4_model_grads_flat(f->m) + p->start, v, v + n, *recv, v + 2 * n, v + 3 * n,
                                 sizeof(float), req);
        ds4_comm_req_label(*req, "reduce-scatter");
    }
    ds4_free(v);
    return st;
}

/* finish: waits for it and, when add (and the wait succeeded), adds the rank-ordered sum to the shard
 * gradient; recv is freed. */
static ds4_status reduce_piece_finish(ds4_fsdp *f, const piece *p, float *recv, ds4_comm_req *req, bool add) {
    ds4_status st = ds4_comm_wait(req);
    if (st == DS4_OK && add && !fsdp_planning(f) && recv)
        ds4_dev_rank_sum_add(fsdp_ex(f), f->sg + p->shard_off, recv, ds4_comm_size(piece_comm(f, p)), p->len);
    ds4_dev_free(fsdp_ex(f), recv);
    return st;
}

/* Blocking (depth 0): start and finish at once. */
static ds4_status reduce_piece(ds4_fsdp *f, const piece *p) {
    float *recv = NULL;
    ds4_comm_req *q = NULL;
    ds4_status st = reduce_piece_start(f, p, &recv, &q);
    if (st != DS4_OK) {
        ds4_dev_free(fsdp_ex(f), recv);
        return st;
    }
    return reduce_piece_finish(f, p, recv, q, true);
}

/* Overlapped reduce-scatter (depth > 0): start sends every piece's full gradient, the receive buffers and
 * the group's gradient range stay until finish adds the pieces in rank order, as reduce_piece does. */
static ds4_status reduce_start(ds4_fsdp *f, int64_t group) {
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    o->g_flight[group] = true;
    o->gq[(o->gq_head + o->gq_n++) % ds4_model_ngroups(f->m)] = group;
    for (int64_t i = 0; i < f->npieces; i++)
        if (f->pieces[i].group == group)
            ds4_model_grads_hand_over(f->m, f->pieces[i].start, f->pieces[i].map_end, DS4_OWNER_GRAD_OPEN,
                                      DS4_OWNER_GRAD_FLIGHT);
    ds4_mem_owner_items(DS4_MEM_GRAD, DS4_OWNER_GRAD_OPEN, -1);
    ds4_mem_owner_items(DS4_MEM_GRAD, DS4_OWNER_GRAD_FLIGHT, 1);
    for (int64_t i = 0; st == DS4_OK && i < f->npieces; i++)
        if (f->pieces[i].group == group) st = reduce_piece_start(f, &f->pieces[i], &o->grecv[i], &o->greq[i]);
    return st;
}

static ds4_status reduce_finish(ds4_fsdp *f, int64_t group) {
    overlap *o = f->ov;
    ds4_status st = DS4_OK;
    for (int64_t i = 0; i < f->npieces; i++) {
        if (f->pieces[i].group != group) continue;
        ds4_status w = reduce_piece_finish(f, &f->pieces[i], o->grecv[i], o->greq[i], st == DS4_OK);
        o->greq[i] = NULL;
        o->grecv[i] = NULL;
        if (st == DS4_OK) st = w;
    }
    (void)group_grads(f, group, false, DS4_OWNER_GRAD_FLIGHT);
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
    (void)group_grads(f, group, false, DS4_OWNER_GRAD_OPEN);
    f->g_mapped[group] = false;
    return st;
}

/* ------------------------------------------------------------------ the overlap state (prefetch depth) */
static void overlap_free(overlap *o) {
    if (!o) return;
    ds4_free(o->w_flight);
    ds4_free(o->g_flight);
    ds4_free(o->gq);
    ds4_free(o->wreq);
    ds4_free(o->wsrc);
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
    o->wsrc = ds4_calloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(uint16_t *));
    o->greq = ds4_calloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(ds4_comm_req *));
    o->grecv = ds4_calloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(float *));
    if (!o->w_flight || !o->g_flight || !o->gq || !o->wreq || !o->wsrc || !o->greq || !o->grecv) {
        overlap_free(o);
        return ds4_fail(DS4_ERR_OOM, "out of memory for --prefetch-depth %d", depth);
    }
    f->ov = o;
    return DS4_OK;
}

/* ------------------------------------------------------------------ the table, and letting go */
void fsdp_hooks_init(ds4_fsdp *f, const ds4_ep_ops *ep) {
    f->hooks = (ds4_param_hooks){.ctx = f, .gather = hook_gather, .drop = hook_drop, .grad_begin = hook_grad_begin,
                                 .grad_end = hook_grad_end, .prefetch = hook_prefetch, .sync = hook_sync, .ep = ep};
}

void fsdp_hooks_release(ds4_fsdp *f) {
    int64_t ng = ds4_model_ngroups(f->m);
    (void)hook_sync(f); /* nothing may stay in flight */
    for (int64_t g = 0; f->w_mapped && g < ng; g++) {
        hook_drop(f, g);
        if (f->g_mapped[g]) {
            (void)group_grads(f, g, false, DS4_OWNER_GRAD_OPEN);
            f->g_mapped[g] = false;
        }
    }
    overlap_free(f->ov);
    f->ov = NULL;
}
