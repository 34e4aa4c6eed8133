/* Communicators (ds4/dist.h): the public API over the tables of comm_impl.h, and what every table shares.
 * Each collective calls its communicator's entry (self, MPI or plan) and nothing here asks which one it
 * is. Every collective is a non-blocking start and a wait (the blocking ones wait at once); a start that
 * leaves a request in flight registers it here (the simulated link's transfer, the all-gather bytes, the
 * list progress walks), and the wait is where the link delays completions, where exposed time is counted
 * per lane and where the trace records its events. Sums are computed by gathering every rank's values
 * and adding them in rank order, so results do not depend on the transport's reduction algorithm. */
#include "dist/comm_impl.h"
#include "dist/dist_kernels.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Adding an entry to the table means adding it to DS4_COMM_ENTRIES too: the struct is its name and
 * plan flag, then exactly the listed entries. */
#define DS4_COMM_COUNT_ENTRY(e) +1
_Static_assert(sizeof(ds4_comm_ops) ==
                   offsetof(ds4_comm_ops, split) + (0 DS4_COMM_ENTRIES(DS4_COMM_COUNT_ENTRY)) * sizeof(void (*)(void)),
               "ds4_comm_ops and DS4_COMM_ENTRIES list different entries");
#undef DS4_COMM_COUNT_ENTRY

const char *ds4_comm_ops_missing(const ds4_comm_ops *t) {
#define DS4_COMM_ENTRY_PRESENT(e) \
    if (!t->e) return #e;
    DS4_COMM_ENTRIES(DS4_COMM_ENTRY_PRESENT)
#undef DS4_COMM_ENTRY_PRESENT
    return NULL;
}

ds4_status ds4_comm_ops_check(const ds4_comm_ops *t) {
    const char *e = ds4_comm_ops_missing(t);
    if (e) return ds4_fail(DS4_ERR_INTERNAL, "communicator table '%s': entry '%s' is NULL (a table fills every entry)",
                           t->name ? t->name : "(unnamed)", e);
    return DS4_OK;
}

ds4_status comm_init(ds4_comm *c, const ds4_comm_ops *t, int rank, int size, ds4_comm_lane lane) {
    DS4_TRY(ds4_comm_ops_check(t));
    *c = (ds4_comm){.ops = t, .rank = rank, .size = size, .lane = lane};
    return DS4_OK;
}

/* ------------------------------------------------------------------ the world, self, plan */
static ds4_comm g_self_world = {.ops = &ds4_comm_ops_self, .rank = 0, .size = 1};
static ds4_comm g_self = {.ops = &ds4_comm_ops_self, .rank = 0, .size = 1};
static ds4_comm *g_world = &g_self_world; /* MPI's world once started */

bool comm_launched_by_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_SIZE");
}

ds4_status ds4_dist_init(void) {
    if (g_world != &g_self_world || !comm_launched_by_mpirun()) return DS4_OK;
    return comm_mpi_start(&g_world);
}

void ds4_dist_finalize(void) {
    comm_mpi_stop();
    g_world = &g_self_world;
}

ds4_comm *ds4_comm_world(void) { return g_world; }
ds4_comm *ds4_comm_self(void) { return &g_self; }

int ds4_comm_rank(const ds4_comm *c) { return c->rank; }
int ds4_comm_size(const ds4_comm *c) { return c->size; }
bool ds4_comm_is_plan(const ds4_comm *c) { return c->ops->plan; }

ds4_status ds4_comm_split(ds4_comm *c, int color, int key, int size, int rank, ds4_comm **out) {
    *out = NULL;
    return c->ops->split(c, color, key, size, rank, out);
}

void ds4_comm_free(ds4_comm *c) {
    if (!c || c == g_world || c == &g_self_world || c == &g_self) return;
    c->ops->free(c);
}

/* ------------------------------------------------------------------ clock, link model, exposed time */
double comm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void sleep_until(double t) {
    struct timespec ts = {.tv_sec = (time_t)t, .tv_nsec = (long)((t - (double)(time_t)t) * 1e9)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
    }
}

static struct {
    double bytes_per_s, latency_s; /* bytes_per_s 0: no simulated link */
    double free_at[DS4_NUM_LANES]; /* when each lane's link ends its last transfer (seconds, monotonic) */
} g_link;
static double g_exposed[DS4_NUM_LANES];
static int64_t g_allgather_bytes[DS4_NUM_LANES]; /* received from other ranks by all-gathers, per lane */

static const char *const k_lane_names[DS4_NUM_LANES] = {"other", "fsdp", "ep"};
const char *ds4_comm_lane_name(ds4_comm_lane lane) { return k_lane_names[lane]; }
void ds4_comm_set_lane(ds4_comm *c, ds4_comm_lane lane) { c->lane = lane; }

ds4_status ds4_comm_set_link(double gbps, double latency_us) {
    if (!(gbps >= 0) || !(latency_us >= 0) || gbps > 1e6 || latency_us > 1e9)
        return ds4_fail(DS4_ERR_ARG, "--sim-link-gbps %g / --sim-link-latency-us %g: need finite values >= 0", gbps,
                        latency_us);
    g_link.bytes_per_s = gbps * 1e9 / 8;
    g_link.latency_s = latency_us * 1e-6;
    return DS4_OK;
}

void ds4_comm_exposed(double out[DS4_NUM_LANES]) { memcpy(out, g_exposed, sizeof g_exposed); }
void ds4_comm_allgather_bytes(int64_t out[DS4_NUM_LANES]) { memcpy(out, g_allgather_bytes, sizeof g_allgather_bytes); }

/* ------------------------------------------------------------------ requests */
static ds4_comm_req *g_pending;

/* The collective q of c has started (named `name`, `bytes` this rank sends or receives): when the
 * simulated link will have carried them, and onto the pending list. */
static void req_issued(ds4_comm_req *q, ds4_comm *c, const char *name, int64_t bytes) {
    q->c = c;
    q->name = name;
    q->issued = comm_now();
    if (g_link.bytes_per_s > 0) {
        double *free_at = &g_link.free_at[c->lane];
        q->link_start = q->issued > *free_at ? q->issued : *free_at;
        q->link_done = q->link_start + g_link.latency_s + (double)bytes / g_link.bytes_per_s;
        *free_at = q->link_done;
    }
    q->next = g_pending;
    g_pending = q;
}

void ds4_comm_req_label(ds4_comm_req *q, const char *label) {
    if (q) q->name = label;
}

void ds4_comm_progress(void) {
    for (ds4_comm_req *q = g_pending; q; q = q->next)
        if (q->seen_done <= 0 && q->c->ops->test(q)) q->seen_done = comm_now();
}

bool ds4_comm_test(ds4_comm_req *q) {
    if (!q) return true;
    if (q->seen_done <= 0 && q->c->ops->test(q)) q->seen_done = comm_now();
    return q->seen_done > 0 && comm_now() >= q->link_done;
}

ds4_status ds4_comm_wait(ds4_comm_req *q) {
    if (!q) return DS4_OK;
    const double t0 = comm_now();
    ds4_status st = q->c->ops->wait(q, NULL);
    double t = comm_now();
    if (q->seen_done <= 0) q->seen_done = t;
    if (q->link_done > t) sleep_until(q->link_done);
    const double t1 = comm_now();
    g_exposed[q->c->lane] += t1 - t0;
    double done = q->seen_done > q->link_done ? q->seen_done : q->link_done;
    comm_trace_wait(q->c->lane, q->name, q->link_done > 0 ? q->link_start : q->issued, done < t1 ? done : t1, t0, t1);
    for (ds4_comm_req **pp = &g_pending; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            break;
        }
    q->c->ops->req_free(q);
    return st;
}

ds4_status comm_igatherv_as_allgather(ds4_comm *c, const void *send, int64_t scount, void *recv,
                                      const int64_t *rcounts, const int64_t *rdispls, size_t elem, int root,
                                      ds4_stream *stream, ds4_comm_req **req) {
    (void)root;
    return c->ops->iallgatherv(c, send, scount, recv, rcounts, rdispls, elem, stream, req);
}

ds4_status comm_keep_sum_f64(ds4_comm *c, double *x, int64_t n, ds4_stream *stream) {
    (void)c, (void)x, (void)n, (void)stream;
    return DS4_OK;
}
ds4_status comm_keep_sum_i64(ds4_comm *c, int64_t *x, int64_t n, ds4_stream *stream) {
    (void)c, (void)x, (void)n, (void)stream;
    return DS4_OK;
}
ds4_status comm_no_barrier(ds4_comm *c, ds4_stream *stream) {
    (void)c, (void)stream;
    return DS4_OK;
}

ds4_status comm_no_peer_send(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                             ds4_stream *stream, ds4_comm_req **req) {
    (void)buf, (void)count, (void)elem, (void)tag, (void)stream;
    *req = NULL;
    return ds4_fail(DS4_ERR_INTERNAL, "%s communicator of one rank: no rank %d to exchange with", c->ops->name, peer);
}
ds4_status comm_no_peer_recv(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag,
                             ds4_stream *stream, ds4_comm_req **req) {
    return comm_no_peer_send(c, buf, count, elem, peer, tag, stream, req);
}

bool comm_no_req_test(ds4_comm_req *q) {
    (void)q;
    return true;
}
ds4_status comm_no_req_wait(ds4_comm_req *q, ds4_stream *stream) {
    (void)stream;
    return ds4_fail(DS4_ERR_INTERNAL, "%s communicator: no collective is ever in flight on it (%s)", q->c->ops->name,
                    q->name);
}
void comm_no_req_free(ds4_comm_req *q) { (void)q; }

/* ------------------------------------------------------------------ collectives */
/* Elements the other ranks contribute to a gather of rcounts [n] (a ring all-gather's traffic per rank). */
static int64_t from_others(const ds4_comm *c, const int64_t *rcounts) {
    int64_t others = 0;
    for (int r = 0; r < c->size; r++)
        if (r != c->rank) others += rcounts[r];
    return others;
}

ds4_status ds4_comm_iallgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                                const int64_t *rdispls, size_t elem, ds4_comm_req **req) {
    *req = NULL;
    DS4_TRY(c->ops->iallgatherv(c, send, scount, recv, rcounts, rdispls, elem, NULL, req));
    if (*req) {
        const int64_t others = from_others(c, rcounts);
        req_issued(*req, c, "all-gather", others * (int64_t)elem);
        g_allgather_bytes[c->lane] += others * (int64_t)elem;
    }
    return DS4_OK;
}

static ds4_status igatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                           const int64_t *rdispls, size_t elem, int root, ds4_comm_req **req) {
    *req = NULL;
    DS4_TRY(c->ops->igatherv(c, send, scount, recv, rcounts, rdispls, elem, root, NULL, req));
    if (*req) req_issued(*req, c, "gather", (root == c->rank ? from_others(c, rcounts) : scount) * (int64_t)elem);
    return DS4_OK;
}

ds4_status ds4_comm_ialltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                               void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem,
                               ds4_comm_req **req) {
    *req = NULL;
    DS4_TRY(c->ops->ialltoallv(c, send, scounts, sdispls, recv, rcounts, rdispls, elem, NULL, req));
    if (*req) {
        int64_t sent = 0, got = 0; /* to and from the other ranks */
        for (int r = 0; r < c->size; r++)
            if (r != c->rank) sent += scounts[r], got += rcounts[r];
        req_issued(*req, c, "all-to-all", (sent > got ? sent : got) * (int64_t)elem);
    }
    return DS4_OK;
}

ds4_status ds4_comm_ialltoall_counts(ds4_comm *c, const int64_t *send, int64_t per, int64_t *recv,
                                     ds4_comm_req **req) {
    *req = NULL;
    DS4_TRY(c->ops->ialltoall_counts(c, send, per, recv, NULL, req));
    if (*req) req_issued(*req, c, "all-to-all", (int64_t)(c->size - 1) * per * (int64_t)sizeof(int64_t));
    return DS4_OK;
}

/* Point to point: the peer checked here, for every table. */
static ds4_status p2p_check(const ds4_comm *c, int64_t count, int peer, int tag, const char *what) {
    if (peer < 0 || peer >= c->size || peer == c->rank || count < 0 || tag < 0)
        return ds4_fail(DS4_ERR_INTERNAL, "%s of %lld elements to/from rank %d (tag %d): rank %d of %d cannot", what,
                        (long long)count, peer, tag, c->rank, c->size);
    return DS4_OK;
}

ds4_status ds4_comm_isend(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                          ds4_comm_req **req) {
    *req = NULL;
    DS4_TRY(p2p_check(c, count, peer, tag, "send"));
    DS4_TRY(c->ops->isend(c, buf, count, elem, peer, tag, NULL, req));
    if (*req) req_issued(*req, c, "send", count * (int64_t)elem);
    return DS4_OK;
}

ds4_status ds4_comm_irecv(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag,
                          ds4_comm_req **req) {
    *req = NULL;
    DS4_TRY(p2p_check(c, count, peer, tag, "receive"));
    DS4_TRY(c->ops->irecv(c, buf, count, elem, peer, tag, NULL, req));
    if (*req) req_issued(*req, c, "receive", count * (int64_t)elem);
    return DS4_OK;
}

/* The blocking collectives: start, then wait. */
ds4_status ds4_comm_allgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                               const int64_t *rdispls, size_t elem) {
    ds4_comm_req *q;
    DS4_TRY(ds4_comm_iallgatherv(c, send, scount, recv, rcounts, rdispls, elem, &q));
    return ds4_comm_wait(q);
}

ds4_status ds4_comm_alltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                              void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem) {
    ds4_comm_req *q;
    DS4_TRY(ds4_comm_ialltoallv(c, send, scounts, sdispls, recv, rcounts, rdispls, elem, &q));
    return ds4_comm_wait(q);
}

ds4_status ds4_comm_gatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                            const int64_t *rdispls, size_t elem, int root) {
    ds4_comm_req *q;
    DS4_TRY(igatherv(c, send, scount, recv, rcounts, rdispls, elem, root, &q));
    return ds4_comm_wait(q);
}

ds4_status ds4_comm_sum_f64(ds4_comm *c, double *x, int64_t n) { return c->ops->sum_f64(c, x, n, NULL); }
ds4_status ds4_comm_sum_i64(ds4_comm *c, int64_t *x, int64_t n) { return c->ops->sum_i64(c, x, n, NULL); }
ds4_status ds4_comm_barrier(ds4_comm *c) { return c->ops->barrier(c, NULL); }

ds4_status comm_sum_by_gather(ds4_comm *c, void *x, int64_t n, size_t elem, bool is_double) {
    if (n <= 0) return DS4_OK;
    /* plain malloc: metadata of the exchange, outside the counted step memory (memplan cannot see it) */
    int64_t *cnt = malloc(sizeof(int64_t) * 2 * (size_t)c->size);
    char *all = malloc((size_t)(n * c->size) * elem);
    ds4_status st = cnt && all ? DS4_OK : DS4_ERR_OOM;
    for (int r = 0; st == DS4_OK && r < c->size; r++) {
        cnt[r] = n;
        cnt[c->size + r] = (int64_t)r * n;
    }
    if (st == DS4_OK) st = ds4_comm_allgatherv(c, x, n, all, cnt, cnt + c->size, elem);
    if (st == DS4_OK && is_double) rank_sum_f64(x, (const double *)all, c->size, n);
    if (st == DS4_OK && !is_double) rank_sum_i64(x, (const int64_t *)all, c->size, n);
    free(cnt);
    free(all);
    return st;
}
