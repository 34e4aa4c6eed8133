/* A pipelined step in one process: every rank's schedule run on one model (include/ds4/pp_schedule.h,
 * docs/pipeline.md). What crosses between chunks is what a multi-process run sends: the stream X at a
 * chunk's end (forward), its gradient (backward), and the MTP rows' gradient from the head's chunk to the
 * embedding's; a receiver reads the sender's buffer, which the stage pass copies in. */
#include "pp_impl.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    ds4_model *m;
    const ds4_pp_local_args *a;
    int64_t nc, M;             /* chunks, micro-batches */
    ds4_pass **pass;           /* [nc, M] made by the forward, freed once nothing reads it any more */
    bool *bwd_done;            /* [nc, M] */
    double *kl;                /* [M, n_layers] each layer's indexer KL, from its chunk's backward */
    double *loss, *mtp_loss;   /* [M] the head's */
    int64_t *loads;            /* NULL or [n_blocks, E] */
    pp_swaps sw;               /* --swap-layer-input: a store a micro-batch */
} run;

static ds4_stage stage_of(const run *r, int64_t k) { return pp_stage_of(r->m, r->a->layout, k); }

/* Whether what action x receives has been sent. */
static bool ready(const run *r, const ds4_pp_action *x) {
    if (x->from_chunk < 0) return true;
    const int64_t i = x->from_chunk * r->M + x->mb;
    return x->op == DS4_PP_FORWARD ? r->pass[i] != NULL : r->bwd_done[i];
}

static void free_pass(run *r, int64_t k, int64_t mb) {
    ds4_pass_free(r->pass[k * r->M + mb]);
    r->pass[k * r->M + mb] = NULL;
}

static ds4_status act(run *r, const ds4_pp_action *x) {
    const ds4_pp_local_args *a = r->a;
    const ds4_config *c = ds4_model_config(r->m);
    const int64_t k = x->chunk, mb = x->mb, M = r->M, last = r->nc - 1;
    const ds4_stage st = stage_of(r, k);
    if (x->op == DS4_PP_FORWARD) {
        ds4_pass_opts o = pp_opts_of(a, &r->sw, mb);
        const float *X_in = k > 0 ? ds4_pass_stream_out(r->pass[(k - 1) * M + mb]) : NULL;
        return ds4_stage_forward(r->m, a->ids + mb * a->B * a->T, a->B, a->T, &o, &st, X_in, &r->pass[k * M + mb]);
    }
    ds4_pass *p = r->pass[k * M + mb];
    const float *dX = k < last ? ds4_pass_stream_grad(r->pass[(k + 1) * M + mb]) : NULL;
    const float *rows = k == 0 && last > 0 ? ds4_pass_mtp_rows_grad(r->pass[last * M + mb]) : NULL;
    DS4_TRY(ds4_stage_backward_rows(r->m, p, dX, rows));
    r->bwd_done[k * M + mb] = true;
    for (int64_t l = st.layer_begin; l < st.layer_end; l++) r->kl[mb * c->n_layers + l] = ds4_pass_layer_kl(p, l);
    if (st.head) {
        const ds4_losses *L = ds4_pass_losses(p);
        r->loss[mb] = L->loss;
        r->mtp_loss[mb] = L->mtp_loss;
    }
    if (r->loads) {
        const int64_t E = c->n_routed_experts;
        for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers; l++) {
            const bool own = (l >= st.layer_begin && l < st.layer_end) || (l >= c->n_layers && st.head);
            const int64_t *ld = ds4_pass_expert_load(p, l);
            for (int64_t e = 0; own && e < E; e++) r->loads[l * E + e] += ld[e];
        }
    }
    /* the next chunk's gradient was received: its pass is done, unless it is the head's, whose MTP rows
     * the embedding's chunk reads last */
    if (k + 1 < last) free_pass(r, k + 1, mb);
    if (k == 0) {
        free_pass(r, 0, mb);
        if (last > 0) free_pass(r, last, mb);
    }
    return DS4_OK;
}

ds4_status ds4_pp_run_local(ds4_model *m, const ds4_pp_local_args *a, ds4_losses *mean, int64_t *loads) {
    const ds4_config *c = ds4_model_config(m);
    const ds4_pp_layout *L = a->layout;
    memset(mean, 0, sizeof *mean);
    DS4_TRY(pp_check_args(m, a));
    const int64_t pp = L->pp, nc = pp * L->vpp, M = a->micro_batches;
    ds4_pp_schedule *s = calloc((size_t)pp, sizeof *s);
    int64_t *pos = calloc((size_t)pp, sizeof *pos);
    run r = {.m = m, .a = a, .nc = nc, .M = M, .loads = loads};
    r.pass = calloc((size_t)(nc * M), sizeof *r.pass);
    r.bwd_done = calloc((size_t)(nc * M), sizeof *r.bwd_done);
    r.kl = calloc((size_t)(M * (c->n_layers > 0 ? c->n_layers : 1)), sizeof *r.kl);
    r.loss = calloc((size_t)M, sizeof *r.loss);
    r.mtp_loss = calloc((size_t)M, sizeof *r.mtp_loss);
    ds4_status st = s && pos && r.pass && r.bwd_done && r.kl && r.loss && r.mtp_loss
                        ? DS4_OK
                        : ds4_fail(DS4_ERR_OOM, "pipeline: out of memory for %lld chunks x %lld micro-batches",
                                   (long long)nc, (long long)M);
    for (int64_t q = 0; st == DS4_OK && q < pp; q++) st = ds4_pp_schedule_make(pp, L->vpp, M, q, &s[q]);
    if (st == DS4_OK) st = pp_swaps_make(a, &r.sw);
    /* the ranks in turn, each as far as its receives let it */
    int64_t left = st == DS4_OK ? pp * s[0].n : 0;
    while (st == DS4_OK && left > 0) {
        bool progress = false;
        for (int64_t q = 0; st == DS4_OK && q < pp; q++)
            while (st == DS4_OK && pos[q] < s[q].n && ready(&r, &s[q].a[pos[q]])) {
                st = act(&r, &s[q].a[pos[q]++]);
                left--;
                progress = true;
            }
        if (st == DS4_OK && !progress)
            st = ds4_fail(DS4_ERR_INTERNAL, "pipeline: the schedules wait on each other with %lld actions left",
                          (long long)left);
    }
    for (int64_t mb = 0; st == DS4_OK && mb < M; mb++)
        ds4_pp_mean_add(c, mean, r.loss[mb], r.mtp_loss[mb], &r.kl[mb * c->n_layers], M);
    if (r.pass)
        for (int64_t i = 0; i < nc * M; i++) ds4_pass_free(r.pass[i]);
    pp_swaps_free(&r.sw);
    for (int64_t q = 0; s && q < pp; q++) ds4_pp_schedule_free(&s[q]);
    free(r.pass);
    free(r.bwd_done);
    free(r.kl);
    free(r.loss);
    free(r.mtp_loss);
    free(pos);
    free(s);
    return st;
}
