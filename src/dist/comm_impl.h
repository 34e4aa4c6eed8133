/* The communicator seam (private to src/dist): the table one implementation of ds4_comm fills, and the
 * parts of a communicator and of a request every implementation shares.
 *
 * comm.c holds the public API (ds4/dist.h): every collective calls through c->ops, and what is the same
 * for every implementation stays there: the simulated link, exposed time per lane, the all-gather bytes,
 * the list of requests in flight and the trace (comm_trace.c). The tables: comm_self.c (one process),
 * comm_mpi.c (Open MPI; only with DS4_HAVE_MPI), comm_plan.c (memplan's simulated world: moves no data,
 * gives EP the counts of balanced routing), comm_staged.c (a device backend's buffers over any of them,
 * through host copies). A device communicator (NCCL) is one more file with one more table:
 * docs/DESIGN.md, "Adding a communicator". */
#ifndef DS4_DIST_COMM_IMPL_H
#define DS4_DIST_COMM_IMPL_H

#include "ds4/dist.h"

typedef struct ds4_comm_ops ds4_comm_ops;

/* A communicator: its table, where this process sits in it, and the lane its traffic counts on. An
 * implementation that needs a handle of its own (MPI's MPI_Comm) allocates a larger struct that starts
 * with this one. 24 bytes on LP64: memplan counts every communicator it makes (DS4_MEM_OTHER). */
struct ds4_comm {
    const ds4_comm_ops *ops;
    int rank, size;
    ds4_comm_lane lane;
};

/* A collective in flight. An implementation's request starts with this struct (MPI adds its request,
 * datatype and int counts); comm.c fills it once the collective has started (comm_req_issued). */
struct ds4_comm_req {
    ds4_comm *c;
    const char *name;
    double issued, link_start, link_done; /* link_*: the simulated link's transfer (0 without one) */
    double seen_done;                     /* when progress first found it complete (0: not yet) */
    ds4_comm_req *next;                   /* the list of outstanding requests */
};

/* One implementation. Semantics of each collective: ds4/dist.h (same name, ds4_comm_ prefix), counts and
 * displacements in elements of `elem` bytes. A start sets *req to a request, or to NULL when the
 * collective is complete on return (one process, a plan). stream: the backend queue the collective is
 * ordered on (NULL: the default, host-synchronous; every caller passes NULL today). Every table fills
 * every entry (comm_ops_check); entries that cannot be reached in an implementation (a request's entries
 * where no collective is ever in flight) say so with an error. */
struct ds4_comm_ops {
    const char *name; /* "self", "mpi", "plan" */
    bool plan;        /* a simulated world: moves no data (ds4_comm_is_plan) */
    /* A new communicator of the ranks of c with the same color, ordered by key; size and rank: what the
     * caller expects it to be (a plan makes exactly that, a real one fails when it is not). */
    ds4_status (*split)(ds4_comm *c, int color, int key, int size, int rank, ds4_comm **out);
    void (*free)(ds4_comm *c); /* one made by split (or ds4_comm_plan) */
    ds4_status (*iallgatherv)(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                              const int64_t *rdispls, size_t elem, ds4_stream *stream, ds4_comm_req **req);
    ds4_status (*igatherv)(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                           const int64_t *rdispls, size_t elem, int root, ds4_stream *stream, ds4_comm_req **req);
    ds4_status (*ialltoallv)(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls, void *recv,
                             const int64_t *rcounts, const int64_t *rdispls, size_t elem, ds4_stream *stream,
                             ds4_comm_req **req);
    ds4_status (*ialltoall_counts)(ds4_comm *c, const int64_t *send, int64_t per, int64_t *recv, ds4_stream *stream,
                                   ds4_comm_req **req);
    /* Point to point (a pipeline's stage boundaries): count elements to or from rank peer of c (not this
     * rank), matched by tag. */
    ds4_status (*isend)(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                        ds4_stream *stream, ds4_comm_req **req);
    ds4_status (*irecv)(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag, ds4_stream *stream,
                        ds4_comm_req **req);
    ds4_status (*sum_f64)(ds4_comm *c, double *x, int64_t n, ds4_stream *stream);
    ds4_status (*sum_i64)(ds4_comm *c, int64_t *x, int64_t n, ds4_stream *stream);
    ds4_status (*barrier)(ds4_comm *c, ds4_stream *stream);
    /* Requests (only those this table's starts made): test answers whether q has completed, moving it on;
     * wait blocks until it has; req_free frees it after wait. */
    bool (*test)(ds4_comm_req *q);
    ds4_status (*wait)(ds4_comm_req *q, ds4_stream *stream);
    void (*req_free)(ds4_comm_req *q);
};

/* Every entry of the table, for the checks that walk it (X(name) per entry). */
#define DS4_COMM_ENTRIES(X)                                                                                   \
    X(split) X(free) X(iallgatherv) X(igatherv) X(ialltoallv) X(ialltoall_counts) X(isend) X(irecv)          \
    X(sum_f64) X(sum_i64) X(barrier) X(test) X(wait) X(req_free)

/* The tables. staged: another communicator's collectives on a device backend's buffers, through host
 * copies (comm_staged.c, made by ds4_comm_staged). */
extern const ds4_comm_ops ds4_comm_ops_self, ds4_comm_ops_plan, ds4_comm_ops_staged;
#ifdef DS4_HAVE_MPI
extern const ds4_comm_ops ds4_comm_ops_mpi;
#endif

/* The name of the first NULL entry of t, or NULL when t fills every entry. */
const char *ds4_comm_ops_missing(const ds4_comm_ops *t);
/* DS4_OK, or an error naming the table and its first NULL entry. */
ds4_status ds4_comm_ops_check(const ds4_comm_ops *t);
/* Fills c as a communicator of table t (checked), rank `rank` of `size`, on lane `lane`. */
ds4_status comm_init(ds4_comm *c, const ds4_comm_ops *t, int rank, int size, ds4_comm_lane lane);

/* ------------------------------------------------------------------ shared by the implementations */
/* Sums by gathering every rank's x and adding them in rank order on every rank (rank_sum_*,
 * dist_ops.h): the same bits whatever the transport does. Through the public all-gather, so the link
 * model, exposed time and trace see it. */
ds4_status comm_sum_by_gather(ds4_comm *c, void *x, int64_t n, size_t elem, bool is_double);
/* A gather that delivers on this rank what the table's all-gather does (self: one rank; plan: nothing). */
ds4_status comm_igatherv_as_allgather(ds4_comm *c, const void *send, int64_t scount, void *recv,
                                      const int64_t *rcounts, const int64_t *rdispls, size_t elem, int root,
                                      ds4_stream *stream, ds4_comm_req **req);
/* The sums and barrier of a world where nothing travels (self: one rank; plan: a simulated world): x
 * stays this rank's values, bit for bit (-0.0 included), and nobody is waited for. */
ds4_status comm_keep_sum_f64(ds4_comm *c, double *x, int64_t n, ds4_stream *stream);
ds4_status comm_keep_sum_i64(ds4_comm *c, int64_t *x, int64_t n, ds4_stream *stream);
ds4_status comm_no_barrier(ds4_comm *c, ds4_stream *stream);
/* Point to point where no other rank exists (self): an error naming the peer. */
ds4_status comm_no_peer_send(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                             ds4_stream *stream, ds4_comm_req **req);
ds4_status comm_no_peer_recv(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag,
                             ds4_stream *stream, ds4_comm_req **req);
/* The request entries of a table whose collectives all complete at once (self, plan): unreachable. */
bool comm_no_req_test(ds4_comm_req *q);
ds4_status comm_no_req_wait(ds4_comm_req *q, ds4_stream *stream);
void comm_no_req_free(ds4_comm_req *q);

/* MPI's world (comm_mpi.c): starts MPI when launched by mpirun and sets *world; without DS4_HAVE_MPI an
 * error saying so. comm_mpi_stop finalizes it (nothing when it never started). */
bool comm_launched_by_mpirun(void);
ds4_status comm_mpi_start(ds4_comm **world);
void comm_mpi_stop(void);

/* The trace (comm_trace.c), fed by ds4_comm_wait: a collective of `lane` named `name` ran from start to
 * done, and this rank was blocked in its wait from t0 to t1. */
void comm_trace_wait(ds4_comm_lane lane, const char *name, double start, double done, double t0, double t1);
double comm_now(void); /* seconds, monotonic */

#endif
