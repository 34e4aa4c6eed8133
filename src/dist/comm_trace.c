/* The trace (ds4_trace_begin / ds4_trace_end, ds4/dist.h): this rank's events, recorded as JSON text by
 * ds4_comm_wait (comm_trace_wait) whatever the communicator's table, and gathered on rank 0 into one
 * Chrome trace file. */
#include "dist/comm_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Trace events, this rank's, as JSON text (plain malloc: outside the counted step memory). tid 0 is the
 * compute lane; each communication lane has up to TRACE_SUB rows (tids) so that overlapping collectives
 * of different kinds (a gather in flight beside a reduce-scatter) sit on rows of their own. Overlapping
 * collectives of one kind (the pieces of one group, started together) merge into one event. */
#define TRACE_SUB 4
#define TRACE_PP_TID (1 + DS4_NUM_LANES * TRACE_SUB) /* the pipeline's row (ds4_trace_span), after the lanes' */
typedef struct {
    const char *name; /* NULL: the row is free */
    double t0, t1;
    int count;        /* collectives merged into the event */
} trace_open;
static struct {
    bool on, oom, pp_used;
    double t0, busy_from;              /* the trace's zero; when this rank last stopped waiting */
    trace_open open[DS4_NUM_LANES][TRACE_SUB];
    int sub_used[DS4_NUM_LANES];
    char *buf;
    size_t len, cap;
} g_trace;

static int trace_pid(void) { return ds4_comm_rank(ds4_comm_world()); }

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
    trace_printf(",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f}", name, trace_pid(),
                 tid, 1e6 * (t0 - g_trace.t0), 1e6 * (t1 - t0));
}

static void trace_flush(ds4_comm_lane lane, int k) {
    trace_open *o = &g_trace.open[lane][k];
    if (!o->name) return;
    if (o->t1 < o->t0) o->t1 = o->t0;
    trace_printf(",\n{\"name\":\"%s\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,"
                 "\"args\":{\"collectives\":%d}}",
                 o->name, trace_pid(), 1 + (int)lane * TRACE_SUB + k, 1e6 * (o->t0 - g_trace.t0), 1e6 * (o->t1 - o->t0),
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

void comm_trace_wait(ds4_comm_lane lane, const char *name, double start, double done, double t0, double t1) {
    if (!g_trace.on) return;
    trace_comm(lane, name, start, done);
    if (t1 - t0 > 1e-6) { /* blocked: the compute lane pauses here */
        if (t0 > g_trace.busy_from) trace_event("compute", 0, g_trace.busy_from, t0);
        g_trace.busy_from = t1;
    }
}

void ds4_trace_span(const char *name, double t0, double t1) {
    if (!g_trace.on) return;
    trace_event(name, TRACE_PP_TID, t0, t1);
    g_trace.pp_used = true;
}

/* ------------------------------------------------------------------ the trace file */
ds4_status ds4_trace_begin(ds4_comm *world) {
    DS4_TRY(ds4_comm_barrier(world)); /* one zero for every rank's clock (one machine: one monotonic clock) */
    free(g_trace.buf);
    memset(&g_trace, 0, sizeof g_trace);
    g_trace.t0 = g_trace.busy_from = comm_now();
    g_trace.on = true;
    return DS4_OK;
}

/* This rank's lane names (Chrome trace metadata). */
static void trace_names(void) {
    int r = trace_pid();
    trace_printf(",\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"name\":\"rank %d\"}}", r, r);
    trace_printf(",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"args\":{\"sort_index\":%d}}", r, r);
    trace_printf(",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"compute\"}}", r);
    for (int l = 0; l < DS4_NUM_LANES; l++)
        for (int k = 0; k < g_trace.sub_used[l]; k++) {
            int tid = 1 + l * TRACE_SUB + k;
            trace_printf(",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"%s%s\"}}",
                         r, tid, ds4_comm_lane_name((ds4_comm_lane)l), k ? " +" : "");
            trace_printf(",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"sort_index\":%d}}",
                         r, tid, tid);
        }
    if (g_trace.pp_used)
        trace_printf(",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"pp\"}}", r,
                     TRACE_PP_TID);
}

ds4_status ds4_trace_end(ds4_comm *world, const char *path) {
    if (!g_trace.on || !world) { /* no world: the events are dropped (after a failure, no collective) */
        free(g_trace.buf);
        memset(&g_trace, 0, sizeof g_trace);
        return DS4_OK;
    }
    const double t = comm_now();
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
