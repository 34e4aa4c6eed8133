/* The MPI communicator (the world under mpirun, and its splits): every collective is MPI's non-blocking
 * one (MPI_Iallgatherv, MPI_Igatherv, MPI_Ialltoallv, MPI_Ialltoall) on elements of one contiguous
 * datatype, completed by MPI_Wait; sums gather and add in rank order (comm_sum_by_gather). MPI runs
 * FUNNELED: ds4 calls it from one thread. Without DS4_HAVE_MPI there is no table, and a process launched
 * by mpirun stops at ds4_dist_init with an error saying so. */
#include "dist/comm_impl.h"

#ifdef DS4_HAVE_MPI
#include <limits.h>
#include <mpi.h>
#include <stdlib.h>

/* An MPI communicator: the shared part, then its handle. */
typedef struct {
    ds4_comm base;
    MPI_Comm mpi;
} mpi_comm;

/* A request in flight: the shared part, MPI's request, the datatype it sends and the int counts MPI
 * reads until completion (plain malloc: metadata of the exchange, outside the counted step memory;
 * memplan has no requests). */
typedef struct {
    ds4_comm_req base;
    MPI_Request mpi;
    MPI_Datatype type;
    bool typed;
    int ints[];
} mpi_req;

static mpi_comm g_mpi_world;
static bool g_mpi_started;

static MPI_Comm handle(const ds4_comm *c) { return ((const mpi_comm *)c)->mpi; }

ds4_status comm_mpi_start(ds4_comm **world) {
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return ds4_fail(DS4_ERR_IO, "MPI_Init failed");
    g_mpi_started = true;
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    DS4_TRY(comm_init(&g_mpi_world.base, &ds4_comm_ops_mpi, rank, size, DS4_LANE_OTHER));
    g_mpi_world.mpi = MPI_COMM_WORLD;
    *world = &g_mpi_world.base;
    return DS4_OK;
}

void comm_mpi_stop(void) {
    if (g_mpi_started) MPI_Finalize();
    g_mpi_started = false;
}

/* A split's memory as the step counts it: the shared part, as a plan communicator's split counts it (MPI's
 * handle, like MPI's own state behind it, is MPI's metadata outside the counted step memory, as a request's
 * is), so memplan's plan of a step that splits (FSDP + EP, pp x fsdp) equals its measured step byte for
 * byte. The struct itself is plain calloc'd, counted by hand. */
static mpi_comm *split_new(void) {
    mpi_comm *n = calloc(1, sizeof *n);
    if (n) ds4_mem_track(DS4_MEM_OTHER, (int64_t)sizeof(ds4_comm));
    return n;
}

static void split_free(mpi_comm *n) {
    ds4_mem_track(DS4_MEM_OTHER, -(int64_t)sizeof(ds4_comm));
    free(n);
}

static ds4_status mpi_split(ds4_comm *c, int color, int key, int size, int rank, ds4_comm **out) {
    mpi_comm *n = split_new();
    if (!n) return ds4_fail(DS4_ERR_OOM, "out of memory for a communicator");
    if (MPI_Comm_split(handle(c), color, key, &n->mpi) != MPI_SUCCESS) {
        split_free(n);
        return ds4_fail(DS4_ERR_IO, "MPI_Comm_split failed");
    }
    int r = 0, s = 0;
    MPI_Comm_rank(n->mpi, &r);
    MPI_Comm_size(n->mpi, &s);
    ds4_status st = r == rank && s == size ? comm_init(&n->base, &ds4_comm_ops_mpi, r, s, c->lane)
                                           : ds4_fail(DS4_ERR_INTERNAL,
                                                      "MPI_Comm_split (color %d, key %d) made rank %d of %d, expected "
                                                      "rank %d of %d", color, key, r, s, rank, size);
    if (st != DS4_OK) {
        MPI_Comm_free(&n->mpi);
        split_free(n);
        return st;
    }
    *out = &n->base;
    return DS4_OK;
}

static void mpi_free(ds4_comm *c) {
    mpi_comm *m = (mpi_comm *)c;
    MPI_Comm_free(&m->mpi);
    split_free(m);
}

/* MPI counts are int: elements of `elem` bytes travel as one contiguous datatype each. */
static ds4_status mpi_type(size_t elem, MPI_Datatype *t) {
    if (MPI_Type_contiguous((int)elem, MPI_BYTE, t) != MPI_SUCCESS || MPI_Type_commit(t) != MPI_SUCCESS)
        return ds4_fail(DS4_ERR_IO, "MPI: cannot make a %zu-byte datatype", elem);
    return DS4_OK;
}

static ds4_status to_int(const int64_t *v, int n, int *out, const char *what) {
    for (int i = 0; i < n; i++) {
        if (v[i] < 0 || v[i] > INT_MAX) return ds4_fail(DS4_ERR_ARG, "MPI: %s %lld does not fit an int", what, (long long)v[i]);
        out[i] = (int)v[i];
    }
    return DS4_OK;
}

/* A request with room for nints int counts and the datatype of `elem` bytes. */
static ds4_status req_new(size_t elem, int nints, mpi_req **out) {
    mpi_req *q = calloc(1, sizeof *q + sizeof(int) * (size_t)nints);
    if (!q) return DS4_ERR_OOM;
    q->mpi = MPI_REQUEST_NULL;
    ds4_status st = mpi_type(elem, &q->type);
    if (st != DS4_OK) {
        free(q);
        return st;
    }
    q->typed = true;
    *out = q;
    return DS4_OK;
}

static void mpi_req_free(ds4_comm_req *r) {
    mpi_req *q = (mpi_req *)r;
    if (q->typed) MPI_Type_free(&q->type);
    free(q);
}

/* q started (rc: what MPI answered) or not (st): the request goes to the caller, or is dropped. */
static ds4_status req_started(mpi_req *q, ds4_status st, int rc, const char *what, ds4_comm_req **req) {
    if (st == DS4_OK && rc != MPI_SUCCESS) st = ds4_fail(DS4_ERR_IO, "%s failed", what);
    if (st != DS4_OK) {
        mpi_req_free(&q->base);
        return st;
    }
    *req = &q->base;
    return DS4_OK;
}

/* All-gather (root < 0) or gather to root of variable counts: the one body both collectives share. */
static ds4_status igather_any(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                              const int64_t *rdispls, size_t elem, int root, ds4_comm_req **req) {
    *req = NULL;
    const int n = c->size;
    mpi_req *q = NULL;
    DS4_TRY(req_new(elem, 2 * n + 1, &q));
    int *ic = q->ints, rc = MPI_SUCCESS;
    ds4_status st = to_int(rcounts, n, ic, "count");
    if (st == DS4_OK) st = to_int(rdispls, n, ic + n, "displacement");
    if (st == DS4_OK) st = to_int(&scount, 1, ic + 2 * n, "count");
    if (st == DS4_OK)
        rc = root < 0 ? MPI_Iallgatherv(send, ic[2 * n], q->type, recv, ic, ic + n, q->type, handle(c), &q->mpi)
                      : MPI_Igatherv(send, ic[2 * n], q->type, recv, ic, ic + n, q->type, root, handle(c), &q->mpi);
    return req_started(q, st, rc, root < 0 ? "MPI_Iallgatherv" : "MPI_Igatherv", req);
}

static ds4_status mpi_iallgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                                  const int64_t *rdispls, size_t elem, ds4_stream *stream, ds4_comm_req **req) {
    (void)stream;
    return igather_any(c, send, scount, recv, rcounts, rdispls, elem, -1, req);
}

static ds4_status mpi_igatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                               const int64_t *rdispls, size_t elem, int root, ds4_stream *stream, ds4_comm_req **req) {
    (void)stream;
    return igather_any(c, send, scount, recv, rcounts, rdispls, elem, root, req);
}

static ds4_status mpi_ialltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                                 void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem,
                                 ds4_stream *stream, ds4_comm_req **req) {
    (void)stream;
    *req = NULL;
    const int n = c->size;
    mpi_req *q = NULL;
    DS4_TRY(req_new(elem, 4 * n, &q));
    int *ic = q->ints, rc = MPI_SUCCESS;
    ds4_status st = to_int(scounts, n, ic, "count");
    if (st == DS4_OK) st = to_int(sdispls, n, ic + n, "displacement");
    if (st == DS4_OK) st = to_int(rcounts, n, ic + 2 * n, "count");
    if (st == DS4_OK) st = to_int(rdispls, n, ic + 3 * n, "displacement");
    if (st == DS4_OK)
        rc = MPI_Ialltoallv(send, ic, ic + n, q->type, recv, ic + 2 * n, ic + 3 * n, q->type, handle(c), &q->mpi);
    return req_started(q, st, rc, "MPI_Ialltoallv", req);
}

static ds4_status mpi_ialltoall_counts(ds4_comm *c, const int64_t *send, int64_t per, int64_t *recv,
                                       ds4_stream *stream, ds4_comm_req **req) {
    (void)stream;
    *req = NULL;
    mpi_req *q = NULL;
    DS4_TRY(req_new(sizeof(int64_t), 1, &q));
    int rc = MPI_SUCCESS;
    ds4_status st = to_int(&per, 1, q->ints, "count");
    if (st == DS4_OK) rc = MPI_Ialltoall(send, q->ints[0], q->type, recv, q->ints[0], q->type, handle(c), &q->mpi);
    return req_started(q, st, rc, "MPI_Ialltoall", req);
}

static ds4_status mpi_p2p(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag, bool send,
                          ds4_comm_req **req) {
    *req = NULL;
    mpi_req *q = NULL;
    DS4_TRY(req_new(elem, 1, &q));
    int rc = MPI_SUCCESS;
    ds4_status st = to_int(&count, 1, q->ints, "count");
    if (st == DS4_OK)
        rc = send ? MPI_Isend(buf, q->ints[0], q->type, peer, tag, handle(c), &q->mpi)
                  : MPI_Irecv(buf, q->ints[0], q->type, peer, tag, handle(c), &q->mpi);
    return req_started(q, st, rc, send ? "MPI_Isend" : "MPI_Irecv", req);
}
static ds4_status mpi_isend(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                            ds4_stream *stream, ds4_comm_req **req) {
    (void)stream;
    return mpi_p2p(c, (void *)buf, count, elem, peer, tag, true, req);
}
static ds4_status mpi_irecv(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag,
                            ds4_stream *stream, ds4_comm_req **req) {
    (void)stream;
    return mpi_p2p(c, buf, count, elem, peer, tag, false, req);
}

static ds4_status mpi_sum_f64(ds4_comm *c, double *x, int64_t n, ds4_stream *stream) {
    (void)stream;
    return comm_sum_by_gather(c, x, n, sizeof(double), true);
}
static ds4_status mpi_sum_i64(ds4_comm *c, int64_t *x, int64_t n, ds4_stream *stream) {
    (void)stream;
    return comm_sum_by_gather(c, x, n, sizeof(int64_t), false);
}

static ds4_status mpi_barrier(ds4_comm *c, ds4_stream *stream) {
    (void)stream;
    if (MPI_Barrier(handle(c)) != MPI_SUCCESS) return ds4_fail(DS4_ERR_IO, "MPI_Barrier failed");
    return DS4_OK;
}

static bool mpi_test(ds4_comm_req *r) {
    int flag = 0;
    return MPI_Test(&((mpi_req *)r)->mpi, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag;
}

static ds4_status mpi_wait(ds4_comm_req *r, ds4_stream *stream) {
    (void)stream;
    if (MPI_Wait(&((mpi_req *)r)->mpi, MPI_STATUS_IGNORE) != MPI_SUCCESS)
        return ds4_fail(DS4_ERR_IO, "MPI: %s failed", r->name);
    return DS4_OK;
}

const ds4_comm_ops ds4_comm_ops_mpi = {
    .name = "mpi",
    .split = mpi_split,
    .free = mpi_free,
    .iallgatherv = mpi_iallgatherv,
    .igatherv = mpi_igatherv,
    .ialltoallv = mpi_ialltoallv,
    .ialltoall_counts = mpi_ialltoall_counts,
    .isend = mpi_isend,
    .irecv = mpi_irecv,
    .sum_f64 = mpi_sum_f64,
    .sum_i64 = mpi_sum_i64,
    .barrier = mpi_barrier,
    .test = mpi_test,
    .wait = mpi_wait,
    .req_free = mpi_req_free,
};

#else

ds4_status comm_mpi_start(ds4_comm **world) {
    (void)world;
    return ds4_fail(DS4_ERR_ARG, "launched by mpirun, but this ds4 was built without MPI (install libopenmpi-dev)");
}
void comm_mpi_stop(void) {}

#endif
