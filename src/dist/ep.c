/* Expert parallelism (ds4_ep_ops, ds4/model.h): the route of one MoE pass (which rows go to which EP
 * rank, and how many come back per expert and source), dispatch of token rows to the experts' owners and
 * combine of their results back, all-to-all on the EP communicator of the FSDP; and the yielding variant
 * (--moe-fb-overlap) that lets another pass compute between an all-to-all's start and its wait. The row
 * permutes between the wire and the experts' layout are dist_kernels.c's. */
#include "dist/dist_kernels.h"
#include "dist/fsdp_impl.h"
#include "ds4/kernels.h"

/* ------------------------------------------------------------------ the route */
/* One allocation (the struct, then its three count arrays), so whoever holds it frees it with ds4_free. */
ds4_ep_route *ds4_ep_route_new(int nsrc, int64_t e0, int64_t e1) {
    const int64_t nrecv = (e1 - e0) * nsrc + 1;
    ds4_ep_route *r = ds4_calloc(DS4_MEM_OTHER, sizeof *r + (size_t)(nrecv + 2 * nsrc) * sizeof(int64_t));
    if (!r) return NULL;
    r->nsrc = nsrc;
    r->e0 = e0;
    r->e1 = e1;
    r->recv_cnt = (int64_t *)(r + 1); /* [(e1 - e0)·nsrc + 1] */
    r->send_cnt = r->recv_cnt + nrecv;  /* [nsrc] */
    r->recv_from = r->send_cnt + nsrc;  /* [nsrc] */
    return r;
}

void ds4_ep_route_free(ds4_ep_route *r) { ds4_free(r); }

/* Between the start of an EP all-to-all and its wait: y->yield(y->ctx) lets another pass compute while the
 * rows travel (--moe-fb-overlap); y NULL: nothing. A plan yields too: the same interleaving, the same peak. */
static void ep_yield(const ds4_fsdp_yielding *y) {
    if (y && y->yield) y->yield(y->ctx);
}

/* got [n][L] := the rows every source s of the EP group sends to each of this rank's L experts, from
 * this rank's cnt [n·L] (rows per expert of the whole model, in expert order; host memory: the MoE's
 * moe_expert_counts op brought them over, its one wait per MoE pass). Dispatch and combine size their
 * buffers and all-to-alls from these. */
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

/* ------------------------------------------------------------------ dispatch, combine */
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
 * owners' results (in) → assignment order (out). in and out are the model's buffers: on a backend whose
 * memory is not the host's (ds4_exec_host_memory) they cross through host copies (hin, hout), which the
 * communicator and the permutes work on. */
static ds4_status ep_exchange(ds4_fsdp *f, const ds4_fsdp_yielding *y, const ds4_ep_route *r, const float *in,
                              float *out, int64_t width, bool dispatch) {
    const bool plan = fsdp_planning(f), data = !plan;
    const ds4_exec *ex = ds4_fsdp_exec(f);
    const bool staged = !ds4_exec_host_memory(ex);
    int64_t *sc = NULL, *sd = NULL, *rc = NULL, *rd = NULL, *v = ep_layout(r, &sc, &sd, &rc, &rd);
    int64_t sent = 0; /* rows in assignment order */
    for (int q = 0; v && q < r->nsrc; q++) sent += sc[q];
    const size_t wire_bytes = (size_t)(r->rows * width) * sizeof(float), sent_bytes = (size_t)(sent * width) * sizeof(float);
    const size_t in_bytes = dispatch ? sent_bytes : wire_bytes, out_bytes = dispatch ? wire_bytes : sent_bytes;
    float *wire = ds4_alloc_for(plan, DS4_MEM_COMM, wire_bytes);
    float *hin = staged ? ds4_alloc_for(plan, DS4_MEM_COMM, in_bytes) : NULL;
    float *hout = staged ? ds4_alloc_for(plan, DS4_MEM_COMM, out_bytes) : NULL;
    ds4_status st = v && wire && (!staged || (hin && hout))
                        ? DS4_OK
                        : ds4_fail(DS4_ERR_OOM, "out of memory %s tokens", dispatch ? "dispatching" : "combining");
    for (int q = 0; st == DS4_OK && q < r->nsrc; q++) {
        sc[q] *= width, sd[q] *= width, rc[q] *= width, rd[q] *= width;
    }
    const float *src = in;
    float *dst = staged ? hout : out;
    if (st == DS4_OK && staged) {
        ds4_dev_to_host(ex, hin, in, in_bytes);
        src = hin;
    }
    const int64_t L = r->e1 - r->e0;
    if (st == DS4_OK && !dispatch && data) ep_rows_experts_to_wire(r->recv_cnt, r->nsrc, L, src, wire, width);
    ds4_comm_req *q = NULL;
    if (st == DS4_OK)
        st = dispatch ? ds4_comm_ialltoallv(f->ep, src, sc, sd, wire, rc, rd, sizeof(float), &q)
                      : ds4_comm_ialltoallv(f->ep, wire, rc, rd, dst, sc, sd, sizeof(float), &q);
    ds4_comm_req_label(q, dispatch ? "dispatch" : "combine");
    if (st == DS4_OK) ep_yield(y);
    if (st == DS4_OK) st = ds4_comm_wait(q);
    if (st == DS4_OK && dispatch && data) ep_rows_wire_to_experts(r->recv_cnt, r->nsrc, L, wire, dst, width);
    if (st == DS4_OK && staged) ds4_dev_to_device(ex, out, hout, out_bytes);
    ds4_free(v);
    ds4_free(wire);
    ds4_free(hin);
    ds4_free(hout);
    return st;
}

/* ------------------------------------------------------------------ the ops */
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

void fsdp_ep_init(ds4_fsdp *f, int64_t e0) {
    f->ops = (ds4_ep_ops){.ctx = f, .e0 = e0, .e1 = e0 + f->eloc, .route = ep_route, .dispatch = ep_dispatch,
                          .combine = ep_combine};
}
