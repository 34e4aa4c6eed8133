/* Pipeline schedules: 1F1B and interleaved 1F1B, one rank's ordered actions (include/ds4/pp_schedule.h,
 * docs/pipeline.md). */
#include "ds4/pp_schedule.h"

#include <stdlib.h>
#include <string.h>

/* Fills the boundary sides of action x (op, chunk, mb set) for n_chunks = pp · vpp chunks. */
static void sides(ds4_pp_action *x, int64_t pp, int64_t n_chunks) {
    const int64_t prev = x->chunk - 1, next = x->chunk + 1;
    const int64_t from = x->op == DS4_PP_FORWARD ? prev : next, to = x->op == DS4_PP_FORWARD ? next : prev;
    const bool has_from = from >= 0 && from < n_chunks, has_to = to >= 0 && to < n_chunks;
    x->from_chunk = has_from ? from : -1;
    x->from_rank = has_from ? from % pp : -1;
    x->to_chunk = has_to ? to : -1;
    x->to_rank = has_to ? to % pp : -1;
}

/* Virtual micro-batch k of the interleaved order: its virtual chunk and micro-batch (Megatron's
 * get_model_chunk_id / get_microbatch_id_in_model_chunk, groups of pp micro-batches per chunk). */
static void interleaved_at(int64_t pp, int64_t vpp, int64_t k, bool forward, int64_t *vchunk, int64_t *mb) {
    const int64_t group = pp * vpp, in_group = k % group;
    *vchunk = forward ? in_group / pp : vpp - 1 - in_group / pp;
    *mb = (k / group) * pp + k % pp;
}

ds4_status ds4_pp_schedule_make(int64_t pp, int64_t vpp, int64_t m, int64_t rank, ds4_pp_schedule *out) {
    memset(out, 0, sizeof *out);
    if (pp < 1 || vpp < 1 || m < 1)
        return ds4_fail(DS4_ERR_ARG, "pipeline schedule: pp %lld, vpp %lld, %lld micro-batches (each must be >= 1)",
                        (long long)pp, (long long)vpp, (long long)m);
    if (rank < 0 || rank >= pp)
        return ds4_fail(DS4_ERR_ARG, "pipeline schedule: rank %lld is outside the %lld pipeline ranks", (long long)rank,
                        (long long)pp);
    if (vpp > 1 && m % pp)
        return ds4_fail(DS4_ERR_ARG, "interleaved 1F1B (pp %lld, vpp %lld): %lld micro-batches are not a multiple of "
                        "pp (Megatron's interleaved schedule runs groups of pp micro-batches per chunk)",
                        (long long)pp, (long long)vpp, (long long)m);
    const int64_t total = m * vpp, n = 2 * total;
    ds4_pp_action *a = calloc((size_t)n, sizeof *a);
    if (!a) return ds4_fail(DS4_ERR_OOM, "pipeline schedule: out of memory for %lld actions", (long long)n);
    int64_t warmup;
    if (vpp == 1) warmup = pp - rank - 1 < m ? pp - rank - 1 : m;
    else if (m == pp) warmup = total; /* every forward first, then every backward */
    else {
        warmup = (pp - rank - 1) * 2 + (vpp - 1) * pp;
        if (warmup > total) warmup = total;
    }
    /* virtual micro-batches in order: the warm-up forwards, then forward warmup + j beside backward j, then
     * the remaining backwards */
    int64_t i = 0;
    for (int64_t f = 0; f < warmup; f++) a[i++] = (ds4_pp_action){.op = DS4_PP_FORWARD, .chunk = f};
    for (int64_t j = 0; j < total - warmup; j++) {
        a[i++] = (ds4_pp_action){.op = DS4_PP_FORWARD, .chunk = warmup + j};
        a[i++] = (ds4_pp_action){.op = DS4_PP_BACKWARD, .chunk = j};
    }
    for (int64_t j = total - warmup; j < total; j++) a[i++] = (ds4_pp_action){.op = DS4_PP_BACKWARD, .chunk = j};
    for (i = 0; i < n; i++) { /* .chunk held the virtual micro-batch */
        ds4_pp_action *x = &a[i];
        const int64_t k = x->chunk;
        if (vpp == 1) x->vchunk = 0, x->mb = k;
        else interleaved_at(pp, vpp, k, x->op == DS4_PP_FORWARD, &x->vchunk, &x->mb);
        x->chunk = x->vchunk * pp + rank;
        sides(x, pp, pp * vpp);
    }
    *out = (ds4_pp_schedule){.pp = pp, .vpp = vpp, .m = m, .rank = rank, .warmup = warmup, .n = n, .a = a};
    return DS4_OK;
}

/* The unit-cost run of every rank's list (ds4_pp_send_release): start [2, nc, m] of each (forward 0 /
 * backward 1, chunk, micro-batch), each action as early as its rank's previous one and what it receives let
 * it (the previous chunk's stream; the next chunk's gradient, on the last chunk its own forward; on chunk 0
 * with mtp, the last chunk's rows). */
static ds4_status unit_run(int64_t pp, int64_t vpp, int64_t m, bool mtp, int64_t *start) {
    const int64_t nc = pp * vpp, n = 2 * vpp * m, all = 2 * nc * m;
    ds4_pp_schedule *s = calloc((size_t)pp, sizeof *s);
    int64_t *pos = calloc((size_t)pp, sizeof *pos), *clock = calloc((size_t)pp, sizeof *clock);
    ds4_status st = s && pos && clock ? DS4_OK
                                      : ds4_fail(DS4_ERR_OOM, "pipeline schedule: out of memory for %lld ranks",
                                                 (long long)pp);
    for (int64_t r = 0; st == DS4_OK && r < pp; r++) st = ds4_pp_schedule_make(pp, vpp, m, r, &s[r]);
    for (int64_t i = 0; i < all; i++) start[i] = -1;
#define AT(op, k, mb) start[((op) * nc + (k)) * m + (mb)]
#define END(op, k, mb) (AT(op, k, mb) < 0 ? -1 : AT(op, k, mb) + ((op) ? 2 : 1))
    for (bool moved = true; st == DS4_OK && moved;) {
        moved = false;
        for (int64_t r = 0; r < pp; r++)
            while (pos[r] < n) {
                const ds4_pp_action *x = &s[r].a[pos[r]];
                const int64_t k = x->chunk, mb = x->mb, op = x->op == DS4_PP_BACKWARD;
                int64_t need[2] = {0, 0}; /* ends of what it receives; -1: not yet run */
                if (!op && k > 0) need[0] = END(0, k - 1, mb);
                if (op) need[0] = k < nc - 1 ? END(1, k + 1, mb) : END(0, k, mb);
                if (op && k == 0 && nc > 1 && mtp) need[1] = END(1, nc - 1, mb);
                if (need[0] < 0 || need[1] < 0) break;
                int64_t t = clock[r];
                for (int j = 0; j < 2; j++) t = need[j] > t ? need[j] : t;
                AT(op, k, mb) = t;
                clock[r] = t + (op ? 2 : 1);
                pos[r]++;
                moved = true;
            }
    }
    for (int64_t r = 0; st == DS4_OK && r < pp; r++)
        if (pos[r] < n) /* the lists' own property (tests/test_pp_schedule.c): a schedule that stalls is a bug */
            st = ds4_fail(DS4_ERR_INTERNAL, "pipeline schedule: pp %lld, vpp %lld, m %lld stalls on rank %lld",
                          (long long)pp, (long long)vpp, (long long)m, (long long)r);
    for (int64_t r = 0; s && r < pp; r++) ds4_pp_schedule_free(&s[r]);
    free(s);
    free(pos);
    free(clock);
    return st;
}

ds4_status ds4_pp_send_release(const ds4_pp_schedule *s, bool mtp, int64_t *release) {
    const int64_t pp = s->pp, nc = pp * s->vpp, m = s->m;
    int64_t *start = malloc((size_t)(2 * nc * m) * sizeof *start);
    if (!start) return ds4_fail(DS4_ERR_OOM, "pipeline schedule: out of memory for %lld actions", (long long)(2 * nc * m));
    const ds4_status st = unit_run(pp, s->vpp, m, mtp, start);
    for (int64_t i = 0; st == DS4_OK && i < s->n; i++) {
        const ds4_pp_action *x = &s->a[i];
        const int64_t k = x->chunk, mb = x->mb;
        int64_t recv = -1; /* when the last of its receivers started */
        if (x->op == DS4_PP_BACKWARD && k > 0) recv = AT(1, k - 1, mb);
        if (x->op == DS4_PP_BACKWARD && k == nc - 1 && nc > 1 && mtp && AT(1, 0, mb) > recv) recv = AT(1, 0, mb);
        release[i] = -1;
        if (recv < 0) continue;
        release[i] = s->n;
        for (int64_t j = i + 1; j < s->n; j++) {
            const ds4_pp_action *y = &s->a[j];
            if (AT(y->op == DS4_PP_BACKWARD, y->chunk, y->mb) > recv) {
                release[i] = j;
                break;
            }
        }
    }
#undef AT
#undef END
    free(start);
    return st;
}

void ds4_pp_schedule_free(ds4_pp_schedule *s) {
    if (!s) return;
    free(s->a);
    memset(s, 0, sizeof *s);
}

void ds4_pp_mean_add(const ds4_config *c, ds4_losses *mean, double loss, double mtp_loss, const double *kl, int64_t M) {
    const ds4_losses l = ds4_losses_combine(c, loss, mtp_loss, kl);
    mean->loss += l.loss / (double)M; /* as ds4_train_step sums them */
    mean->mtp_loss += l.mtp_loss / (double)M;
    mean->indexer_loss += l.indexer_loss / (double)M;
    mean->total_loss += l.total_loss / (double)M;
}
