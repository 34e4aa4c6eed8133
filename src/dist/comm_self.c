/* The communicator of one process (ds4_comm_self, and the world without mpirun): every collective
 * completes at once, delivering what a one-rank exchange delivers; sums and barriers have nothing to do. */
#include "dist/comm_impl.h"

#include <string.h>

/* Copies what a one-rank collective would deliver: count elements of send to recv at displacement displ. */
static void self_copy(const void *send, int64_t count, void *recv, int64_t displ, size_t elem) {
    if (count > 0 && recv && send) memmove((char *)recv + (size_t)displ * elem, send, (size_t)count * elem);
}

static ds4_status self_split(ds4_comm *c, int color, int key, int size, int rank, ds4_comm **out) {
    (void)color, (void)key;
    if (size != 1 || rank != 0)
        return ds4_fail(DS4_ERR_INTERNAL, "a split of one process is rank 0 of 1, not rank %d of %d", rank, size);
    ds4_comm *n = ds4_calloc(DS4_MEM_OTHER, sizeof *n);
    if (!n) return DS4_ERR_OOM;
    ds4_status st = comm_init(n, &ds4_comm_ops_self, 0, 1, c->lane);
    if (st != DS4_OK) {
        ds4_free(n);
        return st;
    }
    *out = n;
    return DS4_OK;
}

static void self_free(ds4_comm *c) { ds4_free(c); }

static ds4_status self_iallgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                                   const int64_t *rdispls, size_t elem, ds4_stream *stream, ds4_comm_req **req) {
    (void)c, (void)rcounts, (void)stream;
    *req = NULL;
    self_copy(send, scount, recv, rdispls[0], elem);
    return DS4_OK;
}

static ds4_status self_ialltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                                  void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem,
                                  ds4_stream *stream, ds4_comm_req **req) {
    (void)c, (void)rcounts, (void)stream;
    *req = NULL;
    self_copy(send ? (const char *)send + (size_t)sdispls[0] * elem : NULL, scounts[0], recv, rdispls[0], elem);
    return DS4_OK;
}

static ds4_status self_ialltoall_counts(ds4_comm *c, const int64_t *send, int64_t per, int64_t *recv,
                                        ds4_stream *stream, ds4_comm_req **req) {
    (void)c, (void)stream;
    *req = NULL;
    self_copy(send, per, recv, 0, sizeof(int64_t));
    return DS4_OK;
}

const ds4_comm_ops ds4_comm_ops_self = {
    .name = "self",
    .split = self_split,
    .free = self_free,
    .iallgatherv = self_iallgatherv,
    .igatherv = comm_igatherv_as_allgather,
    .ialltoallv = self_ialltoallv,
    .ialltoall_counts = self_ialltoall_counts,
    .isend = comm_no_peer_send,
    .irecv = comm_no_peer_recv,
    .sum_f64 = comm_keep_sum_f64,
    .sum_i64 = comm_keep_sum_i64,
    .barrier = comm_no_barrier,
    .test = comm_no_req_test,
    .wait = comm_no_req_wait,
    .req_free = comm_no_req_free,
};
