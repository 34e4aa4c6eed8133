/* Communicators: one process, MPI, or a simulated world for memplan. Sums are computed by gathering
 * every rank's values and adding them in rank order, so results do not depend on MPI's reduction
 * algorithm. Every collective is a non-blocking start and a wait (the blocking ones wait at once); the
 * wait is where the simulated link delays completions, where exposed time is counted per lane and where
 * the trace records its events. */
#include "ds4/dist.h"

#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef DS4_HAVE_MPI
#include <mpi.h>
#endif

typedef enum { COMM_SELF, COMM_MPI, COMM_PLAN } comm_kind;

struct ds4_comm {
    comm_kind kind;
    int rank, size;
    ds4_comm_lane lane;
#ifdef DS4_HAVE_MPI
    MPI_Comm mpi;
#endif
};

static ds4_comm g_world = {.kind = COMM_SELF, .rank = 0, .size = 1};
static bool g_mpi_started;

/* mpirun (Open MPI), PMIx or PMI launchers leave one of these in the environment. */
static bool launched_by_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_SIZE");
}

ds4_status ds4_dist_init(void) {
    if (g_mpi_started || !launched_by_mpirun()) return DS4_OK;
#ifdef DS4_HAVE_MPI
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return ds4_fail(DS4_ERR_IO, "MPI_Init failed");
    g_mpi_started = true;
    g_world.kind = COMM_MPI;
    g_world.mpi = MPI_COMM_WORLD;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world.size);
    return DS4_OK;
#else
    return ds4_fail(DS4_ERR_ARG, "launched by mpirun, but this ds4 was built without MPI (install libopenmpi-dev)");
#endif
}

void ds4_dist_finalize(void) {
#ifdef DS4_HAVE_MPI
    if (g_mpi_started) MPI_Finalize();
#endif
    g_mpi_started = false;
}

ds4_comm *ds4_comm_world(void) { return &g_world; }

ds4_comm *ds4_comm_self(void) {
    static ds4_comm self = {.kind = COMM_SELF, .rank = 0, .size = 1};
    return &self;
}

ds4_status ds4_comm_plan(int size, int rank, ds4_comm **out) {
    if (size < 1 || rank < 0 || rank >= size)
        return ds4_fail(DS4_ERR_ARG, "plan communicator: rank %d of %d ranks is not valid", rank, size);
    ds4_comm *c = ds4_calloc(DS4_MEM_OTHER, sizeof *c);
    if (!c) return DS4_ERR_OOM;
    c->kind = COMM_PLAN;
    c->rank = rank;
    c->size = size;
    *out = c;
    return DS4_OK;
}

int ds4_comm_rank(const ds4_comm *c) { return c->rank; }
int ds4_comm_size(const ds4_comm *c) { return c->size; }
bool ds4_comm_is_plan(const ds4_comm *c) { return c->kind == COMM_PLAN; }

ds4_status ds4_comm_split(ds4_comm *c, int color, int key, ds4_comm **out) {
    *out = NULL;
    ds4_comm *n = ds4_calloc(DS4_MEM_OTHER, sizeof *n);
    if (!n) return DS4_ERR_OOM;
    n->kind = c->kind;
    n->lane = c->lane;
    if (c->kind == COMM_MPI) {
#ifdef DS4_HAVE_MPI
        if (MPI_Comm_split(c->mpi, color, key, &n->mpi) != MPI_SUCCESS) {
            ds4_free(n);
            return ds4_fail(DS4_ERR_IO, "MPI_Comm_split failed");
        }
        MPI_Comm_rank(n->mpi, &n->rank);
        MPI_Comm_size(n->mpi, &n->size);
#endif
    } else if (c->kind == COMM_PLAN) {
        ds4_free(n);
        return ds4_fail(DS4_ERR_INTERNAL, "a plan communicator is not split: make the sub-world with ds4_comm_plan");
    } else {
        n->size = 1;
        n->rank = 0;
    }
    *out = n;
    return DS4_OK;
}

void ds4_comm_free(ds4_comm *c) {
    if (!c || c == &g_world || c == ds4_comm_self()) return;
#ifdef DS4_HAVE_MPI
    if (c->kind == COMM_MPI) MPI_Comm_free(&c->mpi);
#endif
    ds4_free(c);
}

#ifdef DS4_HAVE_MPI
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
#endif

/* ------------------------------------------------------------------ clock, link model, exposed time, trace */
static double mono_now(void) {
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

/* Trace events, this rank's, as JSON text (plain malloc: outside the counted step memory). tid 0 is the
 * compute lane; each communication lane has up to TRACE_SUB rows (tids) so that overlapping collectives
 * of different kinds (a gather in flight beside a reduce-scatter) sit on rows of their own. Overlapping
 * collectives of one kind (the pieces of one group, started together) merge into one event. */
#define TRACE_SUB 4
typedef struct {
    const char *name; /* NULL: the row is free */
    double t0, t1;
    int count;        /* collectives merged into the event */
} trace_open;
static struct {
    bool on, oom;
    double t0, busy_from;              /* the trace's zero; when this rank last stopped waiting */
    trace_open open[DS4_NUM_LANES][TRACE_SUB];
    int sub_used[DS4_NUM_LANES];
    char *buf;
    size_t len, cap;
} g_trace;

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

static int64_t g_allgather_bytes[DS4_NUM_LANES]; /* received from other ranks by all-gathers, per lane */
void ds4_comm_allgather_bytes(int64_t out[DS4_NUM_LANES]) { memcpy(out, g_allgather_bytes, sizeof g_allgather_bytes); }

static void trace_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void trace_printf(const char *fmt, ...) {
    if (g_trace.oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(g_trace.buf ? g_trace.buf + g_trace.len : NULL, g_trace.cap - g_trace.len, fmt, ap);
        va_end(ap);
        if (k < 0) return;
        if (g_trace.len + (size_t)k < g_trace.cap) {
            g_trace.len += (size_t)k;
            return;
        }
        size_t cap = 2 * g_trace.cap + (size_t)k + 4096;
        char *b = realloc(g_trace.buf, cap);
        if (!b) {
            g_trace.oom = true;
            return;
        }
        g_trace.buf = b;
        g_trace.cap = cap;
    }
}

static void trace_event(const char *name, int tid, double t0, double t1) {
    if (t1 < t0) t1 = t0;
    trace_printf(",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}", name, g_world.rank,
                 tid, 1e6 * (t0 - g_trace.t0), 1e6 * (t1 - t0));
}

static void trace_flush(ds4_comm_lane lane, int k) {
    trace_open *o = &g_trace.open[lane][k];
    if (!o->name) return;
    if (o->t1 < o->t0) o->t1 = o->t0;
    trace_printf(",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                 "\"args\":{\"collectives\":%d}}",
                 o->name, g_world.rank, 1 + (int)lane * TRACE_SUB + k, 1e6 * (o->t0 - g_trace.t0), 1e6 * (o->t1 - o->t0),
                 o->count);
    o->name = NULL;
}

/* A collective of `lane` from t0 to t1: merged into an overlapping event of its kind, else on the first
 * row free at t0 (the last row when none is). */
static void trace_comm(ds4_comm_lane lane, const char *name, double t0, double t1) {
    trace_open *row = g_trace.open[lane];
    int k = 0;
    for (k = 0; k < TRACE_SUB; k++)
        if (row[k].name && !strcmp(row[k].name, name) && t0 <= row[k].t1) {
            if (t1 > row[k].t1) row[k].t1 = t1;
            if (t0 < row[k].t0) row[k].t0 = t0;
            row[k].count++;
            return;
        }
    for (k = 0; k < TRACE_SUB - 1 && row[k].name && row[k].t1 > t0; k++) {
    }
    trace_flush(lane, k);
    row[k] = (trace_open){name, t0, t1, 1};
    if (k + 1 > g_trace.sub_used[lane]) g_trace.sub_used[lane] = k + 1;
}

/* ------------------------------------------------------------------ requests */
struct ds4_comm_req {
    ds4_comm *c;
    const char *name;
    double issued, link_start, link_done; /* link_*: the simulated link's transfer (0 without one) */
    double seen_done;                     /* when progress first found it complete (0: not yet) */
    ds4_comm_req *next;                   /* the list of outstanding requests */
#ifdef DS4_HAVE_MPI
    MPI_Request mpi;
    MPI_Datatype type;
    bool typed;
    int ints[];                           /* the int counts MPI reads until completion */
#endif
};

static ds4_comm_req *g_pending;

#ifdef DS4_HAVE_MPI
/* plain malloc: metadata of the exchange, outside the counted step memory (memplan has no requests) */
static ds4_comm_req *req_new(ds4_comm *c, const char *name, int nints) {
    ds4_comm_req *q = calloc(1, sizeof *q + sizeof(int) * (size_t)nints);
    if (!q) return NULL;
    q->c = c;
    q->name = name;
    q->mpi = MPI_REQUEST_NULL;
    return q;
}

static void req_drop(ds4_comm_req *q) {
    if (q->typed) MPI_Type_free(&q->type);
    free(q);
}

/* The collective has started: when the simulated link will have carried `bytes`, and the pending list. */
static void req_issued(ds4_comm_req *q, int64_t bytes) {
    q->issued = mono_now();
    if (g_link.bytes_per_s > 0) {
        double *free_at = &g_link.free_at[q->c->lane];
        q->link_start = q->issued > *free_at ? q->issued : *free_at;
        q->link_done = q->link_start + g_link.latency_s + (double)bytes / g_link.bytes_per_s;
        *free_at = q->link_done;
    }
    q->next = g_pending;
    g_pending = q;
}
#endif

void ds4_comm_req_label(ds4_comm_req *q, const char *label) {
    if (q) q->name = label;
}

void ds4_comm_progress(void) {
#ifdef DS4_HAVE_MPI
    for (ds4_comm_req *q = g_pending; q; q = q->next) {
        if (q->seen_done > 0) continue;
        int flag = 0;
        if (MPI_Test(&q->mpi, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) q->seen_done = mono_now();
    }
#endif
}

ds4_status ds4_comm_wait(ds4_comm_req *q) {
    if (!q) return DS4_OK;
#ifdef DS4_HAVE_MPI
    const double t0 = mono_now();
    ds4_status st = DS4_OK;
    if (MPI_Wait(&q->mpi, MPI_STATUS_IGNORE) != MPI_SUCCESS) st = ds4_fail(DS4_ERR_IO, "MPI: %s failed", q->name);
    double t = mono_now();
    if (q->seen_done <= 0) q->seen_done = t;
    if (q->link_done > t) sleep_until(q->link_done);
    const double t1 = mono_now();
    g_exposed[q->c->lane] += t1 - t0;
    if (g_trace.on) {
        double done = q->seen_done > q->link_done ? q->seen_done : q->link_done;
        trace_comm(q->c->lane, q->name, q->link_done > 0 ? q->link_start : q->issued, done < t1 ? done : t1);
        if (t1 - t0 > 1e-6) { /* blocked: the compute lane pauses here */
            if (t0 > g_trace.busy_from) trace_event("compute", 0, g_trace.busy_from, t0);
            g_trace.busy_from = t1;
        }
    }
    for (ds4_comm_req **pp = &g_pending; *pp; pp = &(*pp)->next)
        if (*pp == q) {
            *pp = q->next;
            break;
        }
    req_drop(q);
    return st;
#else
    return DS4_ERR_INTERNAL;
#endif
}

/* Copies what a one-rank collective would deliver. */
static void self_copy(const void *send, int64_t count, void *recv, int64_t displ, size_t elem) {
    if (count > 0 && recv && send) memmove((char *)recv + (size_t)displ * elem, send, (size_t)count * elem);
}

/* All-gather (root < 0) or gather to root of variable counts: the one body both collectives share. */
static ds4_status igather_any(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                              const int64_t *rdispls, size_t elem, int root, ds4_comm_req **req) {
    *req = NULL;
    if (c->kind == COMM_PLAN) return DS4_OK; /* a plan: nothing moves */
    if (c->kind == COMM_SELF) {
        self_copy(send, scount, recv, rdispls[0], elem);
        return DS4_OK;
    }
#ifdef DS4_HAVE_MPI
    const int n = c->size;
    ds4_comm_req *q = req_new(c, root < 0 ? "all-gather" : "gather", 2 * n + 1);
    if (!q) return DS4_ERR_OOM;
    int *ic = q->ints;
    ds4_status st = to_int(rcounts, n, ic, "count");
    if (st == DS4_OK) st = to_int(rdispls, n, ic + n, "displacement");
    if (st == DS4_OK) st = to_int(&scount, 1, ic + 2 * n, "count");
    if (st == DS4_OK && (st = mpi_type(elem, &q->type)) == DS4_OK) q->typed = true;
    if (st == DS4_OK) {
        int rc = root < 0 ? MPI_Iallgatherv(send, ic[2 * n], q->type, recv, ic, ic + n, q->type, c->mpi, &q->mpi)
                          : MPI_Igatherv(send, ic[2 * n], q->type, recv, ic, ic + n, q->type, root, c->mpi, &q->mpi);
        if (rc != MPI_SUCCESS) st = ds4_fail(DS4_ERR_IO, "%s failed", root < 0 ? "MPI_Iallgatherv" : "MPI_Igatherv");
    }
    if (st != DS4_OK) {
        req_drop(q);
        return st;
    }
    int64_t others = 0; /* received from the other ranks (a ring all-gather's traffic per rank) */
    for (int r = 0; r < n; r++)
        if (r != c->rank) others += rcounts[r];
    req_issued(q, (root < 0 || root == c->rank ? others : scount) * (int64_t)elem);
    if (root < 0) g_allgather_bytes[c->lane] += others * (int64_t)elem;
    *req = q;
    return DS4_OK;
#else
    (void)root;
    return DS4_ERR_INTERNAL;
#endif
}

ds4_status ds4_comm_iallgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                                const int64_t *rdispls, size_t elem, ds4_comm_req **req) {
    return igather_any(c, send, scount, recv, rcounts, rdispls, elem, -1, req);
}

ds4_status ds4_comm_ialltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                               void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem,
                               ds4_comm_req **req) {
    *req = NULL;
    if (c->kind == COMM_PLAN) return DS4_OK; /* a plan: nothing moves */
    if (c->kind == COMM_SELF) {
        (void)rcounts;
        self_copy(send ? (const char *)send + (size_t)sdispls[0] * elem : NULL, scounts[0], recv, rdispls[0], elem);
        return DS4_OK;
    }
#ifdef DS4_HAVE_MPI
    const int n = c->size;
    ds4_comm_req *q = req_new(c, "all-to-all", 4 * n);
    if (!q) return DS4_ERR_OOM;
    int *ic = q->ints;
    ds4_status st = to_int(scounts, n, ic, "count");
    if (st == DS4_OK) st = to_int(sdispls, n, ic + n, "displacement");
    if (st == DS4_OK) st = to_int(rcounts, n, ic + 2 * n, "count");
    if (st == DS4_OK) st = to_int(rdispls, n, ic + 3 * n, "displacement");
    if (st == DS4_OK && (st = mpi_type(elem, &q->type)) == DS4_OK) q->typed = true;
    if (st == DS4_OK &&
        MPI_Ialltoallv(send, ic, ic + n, q->type, recv, ic + 2 * n, ic + 3 * n, q->type, c->mpi, &q->mpi) != MPI_SUCCESS)
        st = ds4_fail(DS4_ERR_IO, "MPI_Ialltoallv failed");
    if (st != DS4_OK) {
        req_drop(q);
        return st;
    }
    int64_t sent = 0, got = 0; /* to and from the other ranks */
    for (int r = 0; r < n; r++)
        if (r != c->rank) sent += scounts[r], got += rcounts[r];
    req_issued(q, (sent > got ? sent : got) * (int64_t)elem);
    *req = q;
    return DS4_OK;
#else
    return DS4_ERR_INTERNAL;
#endif
}

/* The blocking collectives: start, then wait. */
ds4_status ds4_comm_allgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                               const int64_t *rdispls, size_t elem) {
    ds4_comm_req *q;
    DS4_TRY(igather_any(c, send, scount, recv, rcounts, rdispls, elem, -1, &q));
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
    DS4_TRY(igather_any(c, send, scount, recv, rcounts, rdispls, elem, root, &q));
    return ds4_comm_wait(q);
}
/* Every rank's x gathered, then added in rank order on every rank. */
static ds4_status sum_ordered(ds4_comm *c, void *x, int64_t n, size_t elem, bool is_double) {
    if (c->kind != COMM_MPI || n <= 0) return DS4_OK;
    /* plain malloc: metadata of the exchange, outside the counted step memory (memplan cannot see it) */
    int64_t *cnt = malloc(sizeof(int64_t) * 2 * (size_t)c->size);
    char *all = malloc((size_t)(n * c->size) * elem);
    ds4_status st = cnt && all ? DS4_OK : DS4_ERR_OOM;
    for (int r = 0; st == DS4_OK && r < c->size; r++) {
        cnt[r] = n;
        cnt[c->size + r] = (int64_t)r * n;
    }
    if (st == DS4_OK) st = ds4_comm_allgatherv(c, x, n, all, cnt, cnt + c->size, elem);
    for (int64_t i = 0; st == DS4_OK && i < n; i++) {
        if (is_double) {
            double s = 0;
            for (int r = 0; r < c->size; r++) s += ((const double *)all)[(int64_t)r * n + i];
            ((double *)x)[i] = s;
        } else {
            int64_t s = 0;
            for (int r = 0; r < c->size; r++) s += ((const int64_t *)all)[(int64_t)r * n + i];
            ((int64_t *)x)[i] = s;
        }
    }
    free(cnt);
    free(all);
    return st;
}

ds4_status ds4_comm_sum_f64(ds4_comm *c, double *x, int64_t n) { return sum_ordered(c, x, n, sizeof(double), true); }
ds4_status ds4_comm_sum_i64(ds4_comm *c, int64_t *x, int64_t n) { return sum_ordered(c, x, n, sizeof(int64_t), false); }

ds4_status ds4_comm_barrier(ds4_comm *c) {
#ifdef DS4_HAVE_MPI
    if (c->kind == COMM_MPI && MPI_Barrier(c->mpi) != MPI_SUCCESS) return ds4_fail(DS4_ERR_IO, "MPI_Barrier failed");
#else
    (void)c;
#endif
    return DS4_OK;
}

/* ------------------------------------------------------------------ the trace file */
ds4_status ds4_trace_begin(ds4_comm *world) {
    DS4_TRY(ds4_comm_barrier(world)); /* one zero for every rank's clock (one machine: one monotonic clock) */
    free(g_trace.buf);
    memset(&g_trace, 0, sizeof g_trace);
    g_trace.t0 = g_trace.busy_from = mono_now();
    g_trace.on = true;
    return DS4_OK;
}

/* This rank's lane names (Chrome trace metadata). */
static void trace_names(void) {
    int r = g_world.rank;
    trace_printf(",\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", r, r);
    trace_printf(",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"sort_index\":%d}}", r, r);
    trace_printf(",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"compute\"}}", r);
    for (int l = 0; l < DS4_NUM_LANES; l++)
        for (int k = 0; k < g_trace.sub_used[l]; k++) {
            int tid = 1 + l * TRACE_SUB + k;
            trace_printf(",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s%s\"}}",
                         r, tid, k_lane_names[l], k ? " +" : "");
            trace_printf(",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"sort_index\":%d}}",
                         r, tid, tid);
        }
}

ds4_status ds4_trace_end(ds4_comm *world, const char *path) {
    if (!g_trace.on || !world) { /* no world: the events are dropped (after a failure, no collective) */
        free(g_trace.buf);
        memset(&g_trace, 0, sizeof g_trace);
        return DS4_OK;
    }
    const double t = mono_now();
    if (t > g_trace.busy_from) trace_event("compute", 0, g_trace.busy_from, t);
    for (int l = 0; l < DS4_NUM_LANES; l++)
        for (int k = 0; k < TRACE_SUB; k++) trace_flush((ds4_comm_lane)l, k);
    trace_names();
    g_trace.on = false; /* the gathers below are not traced */
    const int n = ds4_comm_size(world), rank = ds4_comm_rank(world);
    int64_t *v = calloc(2 * (size_t)n, sizeof(int64_t)); /* [n] lengths, [n] displacements */
    int64_t mine = g_trace.oom ? 0 : (int64_t)g_trace.len;
    ds4_status st = v ? DS4_OK : DS4_ERR_OOM;
    for (int r = 0; st == DS4_OK && r < n; r++) v[n + r] = r;
    if (st == DS4_OK) {
        int64_t *cnt = calloc((size_t)n, sizeof(int64_t));
        st = cnt ? DS4_OK : DS4_ERR_OOM;
        for (int r = 0; st == DS4_OK && r < n; r++) cnt[r] = 1;
        if (st == DS4_OK) st = ds4_comm_allgatherv(world, &mine, 1, v, cnt, v + n, sizeof(int64_t));
        free(cnt);
    }
    char *all = NULL;
    int64_t total = 0;
    if (st == DS4_OK) {
        for (int r = 0; r < n; r++) {
            int64_t len = v[r];
            v[n + r] = total;
            total += len;
        }
        all = rank == 0 ? malloc((size_t)total + 1) : NULL;
        if (rank == 0 && !all) st = ds4_fail(DS4_ERR_OOM, "%s: out of memory gathering the trace", path);
        /* every rank takes part, also after root's failure, so none waits forever */
        ds4_status gs = ds4_comm_gatherv(world, g_trace.buf, mine, all, v, v + n, 1, 0);
        if (st == DS4_OK) st = gs;
    }
    if (st == DS4_OK && rank == 0) {
        FILE *f = fopen(path, "w");
        if (!f) st = ds4_fail(DS4_ERR_IO, "%s: cannot write the trace: %s", path, strerror(errno));
        else {
            /* every event text starts with ",\n": the first one's comma is dropped */
            fprintf(f, "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[");
            if (total > 1) fwrite(all + 1, 1, (size_t)total - 1, f);
            fprintf(f, "\n]}\n");
            if (fclose(f) != 0) st = ds4_fail(DS4_ERR_IO, "%s: cannot write the trace: %s", path, strerror(errno));
        }
    }
    if (st == DS4_OK && g_trace.oom) st = ds4_fail(DS4_ERR_OOM, "%s: rank %d ran out of memory for its trace", path, rank);
    free(all);
    free(v);
    free(g_trace.buf);
    memset(&g_trace, 0, sizeof g_trace);
    return st;
}
