/* Results do not depend on the thread count: one full training step (two micro-batches of forward +
 * backward, clipping, AdamW, the router bias rule) of a model with every attention kind (sliding
 * window, CSA with the indexer and its KL loss, HCA), hash- and score-routed MoE and MTP gives bitwise
 * the same losses, logits, gradients and updated weights under 1, 2, 3 and 5 OpenMP threads, in fp32
 * and with bf16 matmuls, on the kernel engines of the level in use (the best this CPU runs, or DS4_ISA). */
#include <omp.h>

#include "ds4/kernels.h"
#include "ds4/trainer.h"
#include "test.h"

#define CONFIG "tests/configs/tiny-a.json"
#define B_ROWS 2
#define T_SEQ 64 /* with B_ROWS: the attention, the indexer, mHC and the larger GEMMs split over threads */

typedef struct {
    double loss, mtp_loss, indexer_loss, total_loss, grad_norm;
    float *logits, *mtp_logits; /* [B, T, V] of a forward before the step */
    float *grads, *params;      /* [numel] after the step (gradients clipped) */
    int64_t nlogit, numel;
} step_out;

static void make_ids(int32_t *ids, int64_t n, int64_t V, uint64_t stream) {
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(ds4_rng_u64(29, stream, (uint64_t)i) % (uint64_t)V);
}

static float *copy_floats(const float *x, int64_t n) {
    float *y = malloc((size_t)n * sizeof(float));
    if (y && x) memcpy(y, x, (size_t)n * sizeof(float));
    return y;
}

/* micro-batch k of the step: ids stream k */
typedef struct {
    int64_t next, V;
} id_feed;
static ds4_status next_ids(void *ctx, int32_t *ids) {
    id_feed *f = ctx;
    make_ids(ids, B_ROWS * T_SEQ, f->V, (uint64_t)f->next++);
    return DS4_OK;
}

/* The forward logits of the initial model, then one training step, under `threads` threads. */
static bool run_step(const ds4_config *c, ds4_matmul_precision prec, int threads, step_out *out) {
    omp_set_num_threads(threads);
    memset(out, 0, sizeof *out);
    ds4_train_state *s;
    const ds4_exec ex = {.matmul_precision = prec};
    ds4_train_state_opts so = {.ep = 1, .exec = &ex};
    if (ds4_train_state_open(c, NULL, 7, ds4_comm_world(), &so, &s) != DS4_OK) return false;
    ds4_model *m = ds4_train_state_model(s);
    const int64_t nb = c->n_layers + c->n_mtp_layers;
    int32_t ids[B_ROWS * T_SEQ];
    int64_t *loads = malloc((size_t)(nb * c->n_routed_experts) * sizeof(int64_t));
    bool ok = true;

    make_ids(ids, B_ROWS * T_SEQ, c->vocab_size, 100);
    ds4_pass *p;
    ds4_pass_opts po = {.keep_logits = true};
    ok = ds4_forward(m, ids, B_ROWS, T_SEQ, &po, &p) == DS4_OK;
    if (ok) {
        out->nlogit = B_ROWS * T_SEQ * c->vocab_size;
        out->logits = copy_floats(ds4_pass_logits(p), out->nlogit);
        out->mtp_logits = copy_floats(ds4_pass_mtp_logits(p), out->nlogit);
        ds4_pass_free(p);
    }

    id_feed feed = {.V = c->vocab_size};
    ds4_adamw_cfg ac = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    ds4_step_args a = {.step = 1, .micro_batches = 2, .B = B_ROWS, .T = T_SEQ, .ids = ids, .next_ids = next_ids,
                       .ctx = &feed, .loads = loads, .adamw = &ac, .lr = 1e-3, .max_norm = 0.5,
                       .router_bias_gamma = 1e-3};
    ds4_step_result r;
    if (ok) ok = ds4_train_step(s, &a, &r) == DS4_OK;
    if (ok) {
        out->loss = r.loss, out->mtp_loss = r.mtp_loss, out->indexer_loss = r.indexer_loss;
        out->total_loss = r.total_loss, out->grad_norm = r.grad_norm;
        out->numel = ds4_model_numel(m);
        out->grads = copy_floats(ds4_model_grads_flat(m), out->numel);
        out->params = copy_floats(ds4_model_params_flat(m), out->numel);
    }
    free(loads);
    ds4_train_state_free(s);
    return ok;
}

static void free_out(step_out *o) {
    free(o->logits);
    free(o->mtp_logits);
    free(o->grads);
    free(o->params);
}

/* Index of the first differing float of a and b [n], or -1. */
static int64_t first_diff(const float *a, const float *b, int64_t n) {
    if (!a || !b) return a == b ? -1 : 0;
    for (int64_t i = 0; i < n; i++)
        if (memcmp(a + i, b + i, sizeof(float))) return i;
    return -1;
}

static void same_bits(const char *what, const step_out *r, const step_out *base, int threads) {
    CHECK(r->loss == base->loss && r->mtp_loss == base->mtp_loss && r->indexer_loss == base->indexer_loss &&
              r->total_loss == base->total_loss,
          "%s, %d threads: losses %.17g %.17g %.17g vs %.17g %.17g %.17g", what, threads, r->loss, r->mtp_loss,
          r->indexer_loss, base->loss, base->mtp_loss, base->indexer_loss);
    CHECK(r->grad_norm == base->grad_norm, "%s, %d threads: grad norm %.17g vs %.17g", what, threads, r->grad_norm,
          base->grad_norm);
    int64_t i;
    CHECK((i = first_diff(r->logits, base->logits, base->nlogit)) < 0, "%s, %d threads: logits differ at %lld", what,
          threads, (long long)i);
    CHECK((i = first_diff(r->mtp_logits, base->mtp_logits, base->nlogit)) < 0, "%s, %d threads: MTP logits differ at %lld",
          what, threads, (long long)i);
    CHECK((i = first_diff(r->grads, base->grads, base->numel)) < 0, "%s, %d threads: gradient %lld differs", what,
          threads, (long long)i);
    CHECK((i = first_diff(r->params, base->params, base->numel)) < 0, "%s, %d threads: updated weight %lld differs",
          what, threads, (long long)i);
}

/* 1 thread is the reference; each of `counts` must give its bits. */
static void threads_agree(ds4_matmul_precision prec, const int *counts, int ncounts) {
    ds4_config c;
    CHECK(ds4_config_load(CONFIG, &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(c.n_mtp_layers > 0 && c.n_hash_layers > 0 && c.n_hash_layers < c.n_layers,
          CONFIG ": the test needs MTP and both hash and score routing");
    char what[160];
    snprintf(what, sizeof what, "%s %s %s", CONFIG, ds4_isa_name(ds4_isa_current()), ds4_matmul_precision_name(prec));
    step_out base;
    CHECK(run_step(&c, prec, 1, &base), "%s: %s", what, ds4_errmsg());
    CHECK(base.logits && base.mtp_logits && base.grads && base.params, "%s: nothing captured", what);
    for (int k = 0; k < ncounts; k++) {
        step_out r;
        CHECK(run_step(&c, prec, counts[k], &r), "%s, %d threads: %s", what, counts[k], ds4_errmsg());
        same_bits(what, &r, &base, counts[k]);
        free_out(&r);
    }
    free_out(&base);
}

/* The engines of the level in use (the best, or DS4_ISA: `make check` runs the suite again at generic). */
static void test_fp32_any_thread_count(void) {
    static const int counts[] = {2, 3, 5};
    threads_agree(DS4_MATMUL_FP32, counts, 3);
}

/* The portable bf16 GEMM (generic) is the slow reference, one double sum per output element: there,
 * 3 threads against 1 keeps the test short; every other engine gets 2, 3 and 5. */
static void test_bf16_any_thread_count(void) {
    static const int counts[] = {2, 3, 5}, reference[] = {3};
    if (ds4_isa_current() == DS4_ISA_GENERIC) threads_agree(DS4_MATMUL_BF16, reference, 1);
    else threads_agree(DS4_MATMUL_BF16, counts, 3);
}

int main(void) {
    RUN(test_fp32_any_thread_count);
    RUN(test_bf16_any_thread_count);
    TEST_MAIN_END("test_threads");
}
