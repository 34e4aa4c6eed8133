/* The plan communicator (ds4_comm_plan): a simulated world of `size` ranks seen from one rank, for memplan's
 * plan step. Collectives move no data and complete at once; EP's receive counts are those of balanced
 * routing (every rank sends what this one sends). FSDP on it counts every buffer as a real run does. */
#include "dist/comm_impl.h"

static ds4_status plan_new(int size, int rank, ds4_comm_lane lane, ds4_comm **out) {
    if (size < 1 || rank < 0 || rank >= size)
        return ds4_fail(DS4_ERR_ARG, "plan communicator: rank %d of %d ranks is not valid", rank, size);
    ds4_comm *c = ds4_calloc(DS4_MEM_OTHER, sizeof *c);
    if (!c) return DS4_ERR_OOM;
    ds4_status st = comm_init(c, &ds4_comm_ops_plan, rank, size, lane);
    if (st != DS4_OK) {
        ds4_free(c);
        return st;
    }
    *out = c;
    return DS4_OK;
}

ds4_status ds4_comm_plan(int size, int rank, ds4_comm **out) { return plan_new(size, rank, DS4_LANE_OTHER, out); }

/* A plan knows no other rank's color: the sub-world is what the caller says it is. */
static ds4_status plan_split(ds4_comm *c, int color, int key, int size, int rank, ds4_comm **out) {
    (void)color, (void)key;
    return plan_new(size, rank, c->lane, out);
}

static void plan_free(ds4_comm *c) { ds4_free(c); }

static ds4_status plan_iallgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                                   const int64_t *rdispls, size_t elem, ds4_stream *stream, ds4_comm_req **req) {
    (void)c, (void)send, (void)scount, (void)recv, (void)rcounts, (void)rdispls, (void)elem, (void)stream;
    *req = NULL;
    return DS4_OK;
}

static ds4_status plan_ialltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                                  void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem,
                                  ds4_stream *stream, ds4_comm_req **req) {
    (void)c, (void)send, (void)scounts, (void)sdispls, (void)recv, (void)rcounts, (void)rdispls, (void)elem,
        (void)stream;
    *req = NULL;
    return DS4_OK;
}

/* Balanced routing: from every source, the block this rank sends itself. recv [size][per]. */
static ds4_status plan_ialltoall_counts(ds4_comm *c, const int64_t *send, int64_t per, int64_t *recv,
                                        ds4_stream *stream, ds4_comm_req **req) {
    (void)stream;
    *req = NULL;
    for (int s = 0; s < c->size; s++)
        for (int64_t i = 0; i < per; i++) recv[(int64_t)s * per + i] = send[(int64_t)c->rank * per + i];
    return DS4_OK;
}

/* A plan's stage boundaries move nothing and complete at once. */
static ds4_status plan_isend(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                             ds4_stream *stream, ds4_comm_req **req) {
    (void)c, (void)buf, (void)count, (void)elem, (void)peer, (void)tag, (void)stream;
    *req = NULL;
    return DS4_OK;
}
static ds4_status plan_irecv(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag,
                             ds4_stream *stream, ds4_comm_req **req) {
    return plan_isend(c, buf, count, elem, peer, tag, stream, req);
}

const ds4_comm_ops ds4_comm_ops_plan = {
    .name = "plan",
    .plan = true,
    .split = plan_split,
    .free = plan_free,
    .iallgatherv = plan_iallgatherv,
    .igatherv = comm_igatherv_as_allgather,
    .ialltoallv = plan_ialltoallv,
    .ialltoall_counts = plan_ialltoall_counts,
    .isend = plan_isend,
    .irecv = plan_irecv,
    .sum_f64 = comm_keep_sum_f64,
    .sum_i64 = comm_keep_sum_i64,
    .barrier = comm_no_barrier,
    .test = comm_no_req_test,
    .wait = comm_no_req_wait,
    .req_free = comm_no_req_free,
};
