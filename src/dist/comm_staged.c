/* The host-staged communicator: collectives on a device backend's buffers over a communicator that moves
 * host memory (MPI, self). Each start copies the send side to a host buffer (an explicit copy on the
 * backend, then a wait for it), runs the inner communicator's collective there, and the completion copies
 * what arrived back into the device buffer, segment by segment, so device bytes outside the received
 * counts stay as they were. Sums and barriers carry host values and pass straight through; so do the
 * count exchanges (host arrays). A device communicator that reads device memory itself (NCCL) needs none
 * of this: it is one more table. */
#include "dist/comm_impl.h"
#include "ds4/model.h"

#include <string.h>

typedef struct {
    ds4_comm base;
    ds4_comm *inner;
    const ds4_exec *ex;
    bool owns; /* inner made by a split of this one */
} staged_comm;

/* What a completion copies back: n segments (counts, displs in elements) of host → device. */
typedef struct {
    ds4_comm_req base;
    ds4_comm_req *inner; /* NULL: the inner collective completed at its start */
    const ds4_exec *ex;
    char *send, *recv;   /* host buffers */
    void *dst;           /* the device buffer; NULL: nothing arrives on this rank */
    int64_t *v;          /* [2n] the received segments' counts and displacements */
    int n;
    size_t elem;
} staged_req;

static staged_comm *staged(ds4_comm *c) { return (staged_comm *)c; }

/* Elements of the extent counts/displs [n] cover. */
static int64_t extent(const int64_t *counts, const int64_t *displs, int n) {
    int64_t e = 0;
    for (int r = 0; r < n; r++)
        if (counts[r] > 0 && displs[r] + counts[r] > e) e = displs[r] + counts[r];
    return e;
}

/* Host copy of the segments of device buffer src (counts/displs [n], elements of elem bytes): *out. */
static ds4_status stage_out(const ds4_exec *ex, const void *src, const int64_t *counts, const int64_t *displs, int n,
                            size_t elem, char **out) {
    const int64_t e = extent(counts, displs, n);
    *out = ds4_alloc(DS4_MEM_COMM, (size_t)(e > 0 ? e : 1) * elem);
    if (!*out) return ds4_fail(DS4_ERR_OOM, "out of memory staging %lld elements for a collective", (long long)e);
    for (int r = 0; r < n; r++)
        if (counts[r] > 0)
            ds4_dev_to_host(ex, *out + (size_t)displs[r] * elem, (const char *)src + (size_t)displs[r] * elem,
                            (size_t)counts[r] * elem);
    return DS4_OK;
}

static void staged_req_free(ds4_comm_req *r) {
    staged_req *q = (staged_req *)r;
    if (q->inner) q->inner->c->ops->req_free(q->inner);
    ds4_free(q->send);
    ds4_free(q->recv);
    ds4_free(q->v);
    ds4_free(q);
}

/* The received segments into the device buffer. */
static void deliver(staged_req *q) {
    if (!q->dst) return;
    for (int r = 0; r < q->n; r++)
        if (q->v[r] > 0)
            ds4_dev_to_device(q->ex, (char *)q->dst + (size_t)q->v[q->n + r] * q->elem,
                              q->recv + (size_t)q->v[q->n + r] * q->elem, (size_t)q->v[r] * q->elem);
}

/* A request for a collective whose n received segments rcounts/rdispls [n] land in dst (NULL: none here). */
static ds4_status req_new(staged_comm *s, void *dst, int n, const int64_t *rcounts, const int64_t *rdispls,
                          size_t elem, staged_req **out) {
    staged_req *q = ds4_calloc(DS4_MEM_OTHER, sizeof *q);
    if (q) q->v = ds4_alloc(DS4_MEM_OTHER, sizeof(int64_t) * 2 * (size_t)n);
    if (!q || !q->v) {
        if (q) ds4_free(q);
        return ds4_fail(DS4_ERR_OOM, "out of memory for a staged collective");
    }
    q->ex = s->ex;
    q->n = n;
    q->elem = elem;
    q->dst = dst;
    if (dst) {
        memcpy(q->v, rcounts, sizeof(int64_t) * (size_t)n);
        memcpy(q->v + n, rdispls, sizeof(int64_t) * (size_t)n);
        const int64_t e = extent(rcounts, rdispls, n);
        q->recv = ds4_alloc(DS4_MEM_COMM, (size_t)(e > 0 ? e : 1) * elem);
        if (!q->recv) {
            staged_req_free(&q->base);
            return ds4_fail(DS4_ERR_OOM, "out of memory staging %lld elements for a collective", (long long)e);
        }
    }
    *out = q;
    return DS4_OK;
}

/* The inner collective has started (st) with request inner: completed at once (delivered now) or in flight. */
static ds4_status started(staged_comm *s, staged_req *q, ds4_status st, ds4_comm_req *inner, ds4_comm_req **req) {
    if (st != DS4_OK) {
        staged_req_free(&q->base);
        return st;
    }
    if (inner) { /* the inner request's own table answers for it */
        inner->c = s->inner;
        inner->name = "staged collective";
    }
    q->inner = inner;
    if (!inner) {
        deliver(q);
        staged_req_free(&q->base);
        *req = NULL;
        return DS4_OK;
    }
    *req = &q->base;
    return DS4_OK;
}

/* ------------------------------------------------------------------ the entries */
static ds4_status staged_wrap(ds4_comm *inner, const ds4_exec *ex, bool owns, ds4_comm **out);

static ds4_status st_split(ds4_comm *c, int color, int key, int size, int rank, ds4_comm **out) {
    ds4_comm *in = NULL;
    DS4_TRY(ds4_comm_split(staged(c)->inner, color, key, size, rank, &in));
    ds4_status st = staged_wrap(in, staged(c)->ex, true, out);
    if (st != DS4_OK) ds4_comm_free(in);
    return st;
}

static void st_free(ds4_comm *c) {
    if (staged(c)->owns) ds4_comm_free(staged(c)->inner);
    ds4_free(c);
}

static ds4_status st_iallgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                                 const int64_t *rdispls, size_t elem, ds4_stream *stream, ds4_comm_req **req) {
    staged_comm *s = staged(c);
    staged_req *q;
    DS4_TRY(req_new(s, recv, c->size, rcounts, rdispls, elem, &q));
    const int64_t zero = 0;
    ds4_status st = stage_out(s->ex, send, &scount, &zero, 1, elem, &q->send);
    ds4_comm_req *in = NULL;
    if (st == DS4_OK)
        st = s->inner->ops->iallgatherv(s->inner, q->send, scount, q->recv, rcounts, rdispls, elem, stream, &in);
    return started(s, q, st, in, req);
}

static ds4_status st_igatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                              const int64_t *rdispls, size_t elem, int root, ds4_stream *stream, ds4_comm_req **req) {
    staged_comm *s = staged(c);
    staged_req *q;
    DS4_TRY(req_new(s, c->rank == root ? recv : NULL, c->size, rcounts, rdispls, elem, &q));
    const int64_t zero = 0;
    ds4_status st = stage_out(s->ex, send, &scount, &zero, 1, elem, &q->send);
    ds4_comm_req *in = NULL;
    if (st == DS4_OK)
        st = s->inner->ops->igatherv(s->inner, q->send, scount, q->recv, rcounts, rdispls, elem, root, stream, &in);
    return started(s, q, st, in, req);
}

static ds4_status st_ialltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                                void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem,
                                ds4_stream *stream, ds4_comm_req **req) {
    staged_comm *s = staged(c);
    staged_req *q;
    DS4_TRY(req_new(s, recv, c->size, rcounts, rdispls, elem, &q));
    ds4_status st = stage_out(s->ex, send, scounts, sdispls, c->size, elem, &q->send);
    ds4_comm_req *in = NULL;
    if (st == DS4_OK)
        st = s->inner->ops->ialltoallv(s->inner, q->send, scounts, sdispls, q->recv, rcounts, rdispls, elem, stream,
                                       &in);
    return started(s, q, st, in, req);
}

static ds4_status st_ialltoall_counts(ds4_comm *c, const int64_t *send, int64_t per, int64_t *recv, ds4_stream *stream,
                                      ds4_comm_req **req) {
    staged_comm *s = staged(c);
    staged_req *q;
    DS4_TRY(req_new(s, NULL, 1, NULL, NULL, sizeof(int64_t), &q)); /* host counts: nothing to copy back */
    ds4_comm_req *in = NULL;
    ds4_status st = s->inner->ops->ialltoall_counts(s->inner, send, per, recv, stream, &in);
    return started(s, q, st, in, req);
}

static ds4_status st_isend(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                           ds4_stream *stream, ds4_comm_req **req) {
    staged_comm *s = staged(c);
    staged_req *q;
    DS4_TRY(req_new(s, NULL, 1, NULL, NULL, elem, &q));
    const int64_t zero = 0;
    ds4_status st = stage_out(s->ex, buf, &count, &zero, 1, elem, &q->send);
    ds4_comm_req *in = NULL;
    if (st == DS4_OK) st = s->inner->ops->isend(s->inner, q->send, count, elem, peer, tag, stream, &in);
    return started(s, q, st, in, req);
}

static ds4_status st_irecv(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag, ds4_stream *stream,
                           ds4_comm_req **req) {
    staged_comm *s = staged(c);
    staged_req *q;
    const int64_t zero = 0;
    DS4_TRY(req_new(s, buf, 1, &count, &zero, elem, &q));
    ds4_comm_req *in = NULL;
    ds4_status st = s->inner->ops->irecv(s->inner, q->recv, count, elem, peer, tag, stream, &in);
    return started(s, q, st, in, req);
}

static ds4_status st_sum_f64(ds4_comm *c, double *x, int64_t n, ds4_stream *stream) {
    return staged(c)->inner->ops->sum_f64(staged(c)->inner, x, n, stream);
}
static ds4_status st_sum_i64(ds4_comm *c, int64_t *x, int64_t n, ds4_stream *stream) {
    return staged(c)->inner->ops->sum_i64(staged(c)->inner, x, n, stream);
}
static ds4_status st_barrier(ds4_comm *c, ds4_stream *stream) {
    return staged(c)->inner->ops->barrier(staged(c)->inner, stream);
}

static bool st_test(ds4_comm_req *r) {
    staged_req *q = (staged_req *)r;
    return !q->inner || q->inner->c->ops->test(q->inner);
}

static ds4_status st_wait(ds4_comm_req *r, ds4_stream *stream) {
    staged_req *q = (staged_req *)r;
    ds4_status st = q->inner ? q->inner->c->ops->wait(q->inner, stream) : DS4_OK;
    if (st == DS4_OK) deliver(q);
    return st;
}

const ds4_comm_ops ds4_comm_ops_staged = {
    .name = "staged",
    .split = st_split,
    .free = st_free,
    .iallgatherv = st_iallgatherv,
    .igatherv = st_igatherv,
    .ialltoallv = st_ialltoallv,
    .ialltoall_counts = st_ialltoall_counts,
    .isend = st_isend,
    .irecv = st_irecv,
    .sum_f64 = st_sum_f64,
    .sum_i64 = st_sum_i64,
    .barrier = st_barrier,
    .test = st_test,
    .wait = st_wait,
    .req_free = staged_req_free,
};

static ds4_status staged_wrap(ds4_comm *inner, const ds4_exec *ex, bool owns, ds4_comm **out) {
    staged_comm *s = ds4_calloc(DS4_MEM_OTHER, sizeof *s);
    if (!s) return ds4_fail(DS4_ERR_OOM, "out of memory for a staged communicator");
    ds4_status st = comm_init(&s->base, &ds4_comm_ops_staged, inner->rank, inner->size, inner->lane);
    if (st != DS4_OK) {
        ds4_free(s);
        return st;
    }
    s->inner = inner;
    s->ex = ex;
    s->owns = owns;
    *out = &s->base;
    return DS4_OK;
}

ds4_status ds4_comm_staged(ds4_comm *inner, const ds4_exec *ex, ds4_comm **out) {
    *out = NULL;
    if (ds4_comm_is_plan(inner)) return ds4_fail(DS4_ERR_INTERNAL, "a plan communicator moves no data: nothing to stage");
    return staged_wrap(inner, ex, false, out);
}
