/* A forward-only pass over MPI, world = pp (validation under a pipeline, docs/pipeline.md): each rank runs its
 * chunks' forwards of every micro-batch in interleaved 1F1B's forward order (micro-batches in groups of pp,
 * each group through this rank's chunks in forward order); a chunk's forward receives the previous chunk's
 * stream and sends its own. No backward follows, so a pass goes as soon as its stream has left (the send
 * tested at each later forward, waited before its slot is reused a group later); the head's chunk keeps only
 * each micro-batch's LM loss. */
#include "pp_impl.h"

#include <stdlib.h>

typedef struct {
    ds4_model *m;
    ds4_comm *pipe;
    const ds4_pp_local_args *a;
    int64_t M, S;           /* micro-batches, floats of a stream [B·T, hc, dim] */
    ds4_pass **sent;        /* [vpp, pp] the pass of virtual chunk v, micro-batch mb (slot mb mod pp) whose
                               stream is being sent, or NULL */
    ds4_comm_req **req;     /* [vpp, pp] that send */
    double *loss;           /* [M] each micro-batch's LM loss (the head's rank's; 0 on the others) */
} eval;

/* The tag of the stream into chunk k of micro-batch mb. */
static int tag_of(const eval *e, int64_t k, int64_t mb) { return (int)(k * e->M + mb); }

/* The stream in flight in slot i, once it has left (wait: blocking until then): its pass goes. */
static ds4_status release(eval *e, int64_t i, bool wait) {
    if (!e->sent[i] || (!wait && !ds4_comm_test(e->req[i]))) return DS4_OK;
    const ds4_status s = ds4_comm_wait(e->req[i]);
    e->req[i] = NULL;
    ds4_pass_free(e->sent[i]);
    e->sent[i] = NULL;
    return s;
}

/* The forward of virtual chunk v of this rank for micro-batch mb. */
static ds4_status forward(eval *e, int64_t v, int64_t mb) {
    const ds4_pp_local_args *a = e->a;
    const int64_t pp = a->layout->pp, k = v * pp + ds4_comm_rank(e->pipe), slot = v * pp + mb % pp;
    const ds4_stage st = pp_stage_of(e->m, a->layout, k);
    DS4_TRY(release(e, slot, true)); /* micro-batch mb − pp's stream of this chunk has left */
    float *X_in = NULL;
    ds4_status s = DS4_OK;
    if (k > 0) s = pp_recv_into(e->pipe, &X_in, e->S, (k - 1) % pp, tag_of(e, k, mb));
    ds4_pass_opts o = *a->opts;
    o.need_backward = false;
    ds4_pass *p = NULL;
    if (s == DS4_OK) s = ds4_stage_forward(e->m, a->ids + mb * a->B * a->T, a->B, a->T, &o, &st, X_in, &p);
    ds4_free(X_in);
    if (s != DS4_OK) return s;
    if (st.head) { /* the last chunk: nothing to send */
        e->loss[mb] = ds4_pass_losses(p)->loss;
        ds4_pass_free(p);
        return DS4_OK;
    }
    e->sent[slot] = p;
    return ds4_comm_isend(e->pipe, ds4_pass_stream_out(p), e->S, sizeof(float), (int)((k + 1) % pp),
                          tag_of(e, k + 1, mb), &e->req[slot]);
}

ds4_status ds4_pp_eval_rank(ds4_model *m, ds4_comm *pipe, const ds4_pp_local_args *a, double *loss_sum) {
    DS4_TRY(pp_check_rank(m, pipe, a, 1));
    const ds4_config *c = ds4_model_config(m);
    const int64_t pp = a->layout->pp, vpp = a->layout->vpp, M = a->micro_batches, slots = vpp * pp;
    eval e = {.m = m, .pipe = pipe, .a = a, .M = M, .S = a->B * a->T * c->hc_mult * c->dim};
    e.sent = calloc((size_t)slots, sizeof *e.sent);
    e.req = calloc((size_t)slots, sizeof *e.req);
    e.loss = calloc((size_t)M, sizeof *e.loss);
    ds4_status st = e.sent && e.req && e.loss ? DS4_OK
                                              : ds4_fail(DS4_ERR_OOM, "pipeline: out of memory for %lld micro-batches "
                                                         "of a forward-only pass", (long long)M);
    /* Every rank's forwards follow one order, (group of pp micro-batches, virtual chunk, micro-batch, rank), in
     * which what a forward waits on comes first: the stream it receives (the previous chunk's, of the same
     * micro-batch) and the send whose slot it reuses (of the previous group, received there). So the first
     * forward not yet run can always run: no deadlock, for interleaved layouts too; and rank 0 starts the
     * next micro-batch while rank 1 runs this one. */
    for (int64_t g = 0; st == DS4_OK && g < M; g += pp)
        for (int64_t v = 0; st == DS4_OK && v < vpp; v++)
            for (int64_t mb = g; st == DS4_OK && mb < g + pp && mb < M; mb++) {
                for (int64_t i = 0; st == DS4_OK && i < slots; i++) st = release(&e, i, false);
                if (st == DS4_OK) st = forward(&e, v, mb);
            }
    for (int64_t i = 0; e.sent && i < slots; i++) { /* after a failure too: no send in flight on a freed pass */
        const ds4_status w = release(&e, i, true);
        if (st == DS4_OK) st = w;
    }
    /* every rank gets each micro-batch's loss (nonzero on the head's rank only: adding zeros keeps the bits),
     * then adds them in micro-batch order, as a loop of whole forwards does */
    if (st == DS4_OK) st = ds4_comm_sum_f64(pipe, e.loss, M);
    for (int64_t mb = 0; st == DS4_OK && mb < M; mb++) *loss_sum += e.loss[mb];
    free(e.sent);
    free(e.req);
    free(e.loss);
    return st;
}
