/* A pipelined step over MPI, world = pp: each rank runs its own list of the schedule on a whole model
 * (include/ds4/pp_schedule.h, docs/pipeline.md). What crosses is what ds4_pp_run_local hands across: the
 * stream at a chunk's end, its gradient, the MTP rows' gradient from the head's rank to rank 0. Each rank
 * times its waits (its bubble) and puts its actions and waits on the trace's pp row. */
#include "ds4/kernels.h"
#include "pp_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { TAG_STREAM, TAG_GRAD, TAG_ROWS, TAG_KINDS };

typedef struct {
    ds4_model *m;
    ds4_comm *pipe;
    const ds4_pp_local_args *a;
    int64_t nc, M, S, R;        /* chunks, micro-batches, floats of a stream [B·T, hc, dim], of the rows [B·T, dim] */
    ds4_pass **pass;            /* [nc, M] this rank's, freed when its backward is done */
    float **out;                /* [nc, M, 2] a backward's sent tensors, copied out of its pass (comm), freed
                                 * at the action release names */
    int64_t *release;           /* [n] ds4_pp_send_release of the rank's schedule */
    int64_t *sending, n_sending; /* [nc·M] the backwards whose copies wait on their sends */
    int64_t *sending_at;        /* [nc·M] the action before which each waits (release) */
    int64_t live, peak;         /* passes held now, the most at once */
    ds4_comm_req **fwd;         /* [nc, M] a forward's send of its stream */
    ds4_comm_req **bwd;         /* [nc, M, 2] a backward's sends: the stream's gradient, the MTP rows */
    double *parts;              /* [M, 2 + n_layers]: loss, MTP loss, each layer's indexer KL (this rank's) */
    int64_t *loads;             /* NULL or [n_blocks, E] this rank's */
    double idle;                /* seconds blocked in waits (receives, sends) */
    double work_from;           /* when the running action's waits ended and its stage pass began */
    pp_swaps sw;                /* --swap-layer-input: a store a micro-batch */
} run;

/* The tag of a tensor of kind for chunk k (the receiver's chunk) of micro-batch mb. */
static int tag_of(const run *r, int kind, int64_t k, int64_t mb) { return (int)((kind * r->nc + k) * r->M + mb); }

/* ds4_comm_wait, the time it blocked counted idle. */
static ds4_status wait_idle(run *r, ds4_comm_req *req) {
    const double t0 = ds4_now();
    const ds4_status s = ds4_comm_wait(req);
    r->idle += ds4_now() - t0;
    return s;
}

static ds4_status recv_into(run *r, float **buf, int64_t count, int64_t from_rank, int tag) {
    const double t0 = ds4_now(); /* the receive blocks until the sender's tensor is there: idle */
    const ds4_status s = pp_recv_into(r->pipe, buf, count, from_rank, tag);
    r->idle += ds4_now() - t0;
    return s;
}

/* The trace's span of action x: its waits ("wait F c1 mb3", from t0 to t1, when it blocked), or its work
 * ("F c1 mb3"). */
static void trace_action(const ds4_pp_action *x, bool wait, double t0, double t1) {
    if (wait && t1 - t0 <= 1e-6) return;
    char name[64];
    snprintf(name, sizeof name, "%s%s c%lld mb%lld", wait ? "wait " : "", x->op == DS4_PP_FORWARD ? "F" : "B",
             (long long)x->chunk, (long long)x->mb);
    ds4_trace_span(name, t0, t1);
}

static ds4_stage stage_of(const run *r, int64_t k) { return pp_stage_of(r->m, r->a->layout, k); }

static ds4_status forward(run *r, const ds4_pp_action *x) {
    const ds4_pp_local_args *a = r->a;
    const int64_t i = x->chunk * r->M + x->mb;
    const ds4_stage st = stage_of(r, x->chunk);
    float *X_in = NULL;
    ds4_status s = DS4_OK;
    if (x->from_chunk >= 0) s = recv_into(r, &X_in, r->S, x->from_rank, tag_of(r, TAG_STREAM, x->chunk, x->mb));
    ds4_pass_opts o = pp_opts_of(a, &r->sw, x->mb);
    r->work_from = ds4_now();
    if (s == DS4_OK)
        s = ds4_stage_forward(r->m, a->ids + x->mb * a->B * a->T, a->B, a->T, &o, &st, X_in, &r->pass[i]);
    if (s == DS4_OK && ++r->live > r->peak) r->peak = r->live;
    ds4_free(X_in);
    if (s == DS4_OK && x->to_chunk >= 0)
        s = ds4_comm_isend(r->pipe, ds4_pass_stream_out(r->pass[i]), r->S, sizeof(float), (int)x->to_rank,
                           tag_of(r, TAG_STREAM, x->to_chunk, x->mb), &r->fwd[i]);
    return s;
}

/* *dst := a host copy of src [n] for a send, counted as comm (in a plan only the count: nothing is read or
 * sent). */
static ds4_status copy_out(run *r, const float *src, int64_t n, float **dst) {
    const bool plan = ds4_comm_is_plan(r->pipe);
    *dst = ds4_alloc_for(plan, DS4_MEM_COMM, (size_t)n * sizeof(float));
    if (!*dst) return ds4_fail(DS4_ERR_OOM, "pipeline: out of memory for a send of %lld floats", (long long)n);
    if (!plan) memcpy(*dst, src, (size_t)n * sizeof(float));
    return DS4_OK;
}

static ds4_status backward(run *r, const ds4_pp_action *x, int64_t at) {
    const ds4_config *c = ds4_model_config(r->m);
    const int64_t k = x->chunk, mb = x->mb, i = k * r->M + mb, last = r->nc - 1;
    const ds4_stage st = stage_of(r, k);
    ds4_pass *p = r->pass[i];
    ds4_comm_req *fw = r->fwd[i];
    r->fwd[i] = NULL;
    ds4_status s = wait_idle(r, fw); /* the stream it sent is freed by the backward */
    float *dX = NULL, *rows = NULL;
    if (s == DS4_OK && x->from_chunk >= 0) s = recv_into(r, &dX, r->S, x->from_rank, tag_of(r, TAG_GRAD, k, mb));
    if (s == DS4_OK && k == 0 && last > 0 && c->n_mtp_layers > 0)
        s = recv_into(r, &rows, r->R, last % r->a->layout->pp, tag_of(r, TAG_ROWS, 0, mb));
    r->work_from = ds4_now();
    if (s == DS4_OK) s = ds4_stage_backward_rows(r->m, p, dX, rows);
    ds4_free(dX);
    ds4_free(rows);
    if (s != DS4_OK) return s;
    double *part = &r->parts[mb * (2 + c->n_layers)];
    for (int64_t l = st.layer_begin; l < st.layer_end; l++) part[2 + l] = ds4_pass_layer_kl(p, l);
    if (st.head) part[0] = ds4_pass_losses(p)->loss, part[1] = ds4_pass_losses(p)->mtp_loss;
    if (r->loads) {
        const int64_t E = c->n_routed_experts;
        for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers; l++) {
            const bool own = (l >= st.layer_begin && l < st.layer_end) || (l >= c->n_layers && st.head);
            const int64_t *ld = ds4_pass_expert_load(p, l);
            for (int64_t e = 0; own && e < E; e++) r->loads[l * E + e] += ld[e];
        }
    }
    if (x->to_chunk >= 0) {
        DS4_TRY(copy_out(r, ds4_pass_stream_grad(p), r->S, &r->out[2 * i]));
        DS4_TRY(ds4_comm_isend(r->pipe, r->out[2 * i], r->S, sizeof(float), (int)x->to_rank,
                               tag_of(r, TAG_GRAD, x->to_chunk, mb), &r->bwd[2 * i]));
    }
    if (st.mtp_rows_out) {
        DS4_TRY(copy_out(r, ds4_pass_mtp_rows_grad(p), r->R, &r->out[2 * i + 1]));
        DS4_TRY(ds4_comm_isend(r->pipe, r->out[2 * i + 1], r->R, sizeof(float), 0, tag_of(r, TAG_ROWS, 0, mb),
                               &r->bwd[2 * i + 1]));
    }
    /* the pass goes now, at a point of the schedule, not when a send happens to complete: what a rank holds
     * is the same in every run and in its plan (memplan) */
    ds4_pass_free(p);
    r->pass[i] = NULL;
    r->live--;
    if (r->release[at] >= 0) r->sending_at[r->n_sending] = r->release[at], r->sending[r->n_sending++] = i;
    return DS4_OK;
}

/* Before action `at` (n: the end of the step): the sends of the backwards released there (the stream's
 * gradient, the MTP rows) are waited for and their copies freed, in the order the backwards ran. The point
 * is the schedule's (ds4_pp_send_release), so the copies a rank holds are the same in every run and in its
 * plan; their receives are posted by then in the unit-cost run, so the wait rarely blocks. */
static ds4_status free_sent(run *r, int64_t at) {
    int64_t kept = 0;
    ds4_status s = DS4_OK;
    for (int64_t j = 0; j < r->n_sending; j++) {
        const int64_t i = r->sending[j];
        if (r->sending_at[j] > at) {
            r->sending_at[kept] = r->sending_at[j];
            r->sending[kept++] = i;
            continue;
        }
        ds4_comm_req **q = &r->bwd[2 * i];
        for (int t = 0; t < 2; t++) {
            const ds4_status w = wait_idle(r, q[t]);
            q[t] = NULL;
            if (s == DS4_OK) s = w;
        }
        ds4_free(r->out[2 * i]);
        ds4_free(r->out[2 * i + 1]);
        r->out[2 * i] = r->out[2 * i + 1] = NULL;
    }
    r->n_sending = kept;
    return s;
}

/* bubble [pp] := each rank's `mine`, on every rank (a sum of zeros but one: exact). */
static ds4_status gather_bubble(ds4_comm *pipe, double mine, double *bubble) {
    const int n = ds4_comm_size(pipe);
    for (int i = 0; i < n; i++) bubble[i] = 0;
    bubble[ds4_comm_rank(pipe)] = mine;
    return ds4_comm_sum_f64(pipe, bubble, n);
}

ds4_status ds4_pp_run_rank(ds4_model *m, ds4_comm *pipe, const ds4_pp_local_args *a, ds4_losses *mean,
                           int64_t *loads) {
    const ds4_config *c = ds4_model_config(m);
    const ds4_pp_layout *L = a->layout;
    memset(mean, 0, sizeof *mean);
    DS4_TRY(pp_check_rank(m, pipe, a, TAG_KINDS));
    const int64_t nc = L->pp * L->vpp, M = a->micro_batches, N = a->B * a->T, nb = c->n_layers + c->n_mtp_layers;
    const int64_t np = M * (2 + c->n_layers), nl = nb * c->n_routed_experts;
    run r = {.m = m, .pipe = pipe, .a = a, .nc = nc, .M = M, .S = N * c->hc_mult * c->dim, .R = N * c->dim};
    ds4_pp_schedule sch = {0};
    r.pass = calloc((size_t)(nc * M), sizeof *r.pass);
    r.sending = calloc((size_t)(nc * M), sizeof *r.sending);
    r.sending_at = calloc((size_t)(nc * M), sizeof *r.sending_at);
    r.release = calloc((size_t)(2 * nc * M), sizeof *r.release);
    r.out = calloc((size_t)(2 * nc * M), sizeof *r.out);
    r.fwd = calloc((size_t)(nc * M), sizeof *r.fwd);
    r.bwd = calloc((size_t)(2 * nc * M), sizeof *r.bwd);
    r.parts = calloc((size_t)np, sizeof *r.parts);
    r.loads = loads ? calloc((size_t)nl, sizeof *r.loads) : NULL;
    ds4_status st = r.pass && r.sending && r.sending_at && r.release && r.out && r.fwd && r.bwd && r.parts && (!loads || r.loads)
                        ? DS4_OK
                        : ds4_fail(DS4_ERR_OOM, "pipeline: out of memory for %lld chunks x %lld micro-batches",
                                   (long long)nc, (long long)M);
    if (st == DS4_OK) st = ds4_pp_schedule_make(L->pp, L->vpp, M, ds4_comm_rank(pipe), &sch);
    if (st == DS4_OK) st = ds4_pp_send_release(&sch, c->n_mtp_layers > 0, r.release);
    if (st == DS4_OK) st = pp_swaps_make(a, &r.sw);
    const double begin = ds4_now();
    for (int64_t i = 0; st == DS4_OK && i < sch.n; i++) {
        const double t0 = r.work_from = ds4_now();
        st = free_sent(&r, i);
        if (st == DS4_OK) st = sch.a[i].op == DS4_PP_FORWARD ? forward(&r, &sch.a[i]) : backward(&r, &sch.a[i], i);
        trace_action(&sch.a[i], true, t0, r.work_from);
        trace_action(&sch.a[i], false, r.work_from, ds4_now());
    }
    if (a->passes_peak) *a->passes_peak = r.peak;
    /* every send done before its pass goes (after a failure too: nothing stays in flight on freed buffers) */
    const double sends = ds4_now();
    if (st == DS4_OK) st = free_sent(&r, sch.n);
    for (int64_t i = 0; r.bwd && i < 2 * nc * M; i++) {
        const ds4_status w = wait_idle(&r, r.bwd[i]);
        if (st == DS4_OK) st = w;
    }
    for (int64_t i = 0; r.fwd && i < nc * M; i++) {
        const ds4_status w = wait_idle(&r, r.fwd[i]);
        if (st == DS4_OK) st = w;
    }
    const double drain = ds4_now();
    if (drain - sends > 1e-6) ds4_trace_span("wait sends", sends, drain);
    if (st == DS4_OK && a->bubble) { /* a rank done early idles until the last one is: the pipeline drains */
        st = ds4_comm_barrier(pipe);
        const double end = ds4_now();
        r.idle += end - drain;
        if (end - drain > 1e-6) ds4_trace_span("wait drain", drain, end);
        if (st == DS4_OK) st = gather_bubble(pipe, r.idle / (end > begin ? end - begin : 1), a->bubble);
    }
    /* every rank gets every micro-batch's parts (each nonzero on its one rank: adding zeros keeps the bits) */
    if (st == DS4_OK) st = ds4_comm_sum_f64(pipe, r.parts, np);
    if (st == DS4_OK && loads) st = ds4_comm_sum_i64(pipe, r.loads, nl);
    if (st == DS4_OK && loads)
        for (int64_t i = 0; i < nl; i++) loads[i] += r.loads[i];
    for (int64_t mb = 0; st == DS4_OK && mb < M; mb++) {
        const double *part = &r.parts[mb * (2 + c->n_layers)];
        ds4_pp_mean_add(c, mean, part[0], part[1], part + 2, M);
    }
    if (r.pass)
        for (int64_t i = 0; i < nc * M; i++) ds4_pass_free(r.pass[i]);
    pp_swaps_free(&r.sw);
    ds4_pp_schedule_free(&sch);
    free(r.pass);
    for (int64_t i = 0; r.out && i < 2 * nc * M; i++) ds4_free(r.out[i]);
    free(r.out);
    free(r.sending);
    free(r.sending_at);
    free(r.release);
    free(r.fwd);
    free(r.bwd);
    free(r.parts);
    free(r.loads);
    return st;
}
