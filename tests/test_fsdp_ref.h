/* The single-process reference of the FSDP (+ EP) tests (test_dist, test_bf16_copy): every rank's batch
 * run in one process on the whole model, what FSDP + EP must reduce-scatter from those gradients, and a
 * parameter-by-parameter bitwise comparison. */
#ifndef DS4_TEST_FSDP_REF_H
#define DS4_TEST_FSDP_REF_H

#include <stdlib.h>
#include <string.h>

#include "ds4/model.h"
#include "test.h"

#define REF_MAX_RANKS 4
static const int64_t kB = 1, kT = 64;

/* Rank r's batch [kB, kT] of token ids, drawn from random stream `seed`. */
static inline void ref_batch_ids(const ds4_config *c, uint64_t seed, int rank, int32_t *ids) {
    for (int64_t i = 0; i < kB * kT; i++)
        ids[i] = (int32_t)(ds4_rng_u64(seed, (uint64_t)rank, (uint64_t)i) % (uint64_t)c->vocab_size);
}

/* One training pass of ids [kB, kT] on m (bf16: mixed-precision activations): the total loss into *total,
 * the gradients accumulated into m's. */
static inline bool ref_pass(ds4_model *m, const int32_t *ids, const ds4_param_hooks *hooks, bool bf16,
                            double *total) {
    ds4_pass_opts o = {.need_backward = true, .bf16_acts = bf16, .hooks = hooks};
    ds4_pass *p = NULL;
    ds4_status st = ds4_forward(m, ids, kB, kT, &o, &p);
    if (st == DS4_OK) st = ds4_backward(m, p);
    if (st == DS4_OK) *total = ds4_pass_losses(p)->total_loss;
    ds4_pass_free(p);
    CHECK(st == DS4_OK, "%s", ds4_errmsg());
    return st == DS4_OK;
}

/* Losses and gradients of every rank's batch, one process. */
typedef struct {
    ds4_model *m;
    int ranks;
    float *g[REF_MAX_RANKS];     /* [numel] gradient of rank r's batch */
    double total[REF_MAX_RANKS]; /* total_loss of each rank's batch */
} reference;

static inline bool reference_run(const ds4_config *c, int ranks, uint64_t seed, bool bf16, reference *ref) {
    memset(ref, 0, sizeof *ref);
    const ds4_exec ex = {.matmul_precision = bf16 ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32}; /* bf16 runs bf16 GEMMs */
    if (ranks > REF_MAX_RANKS || ds4_model_create(&ex, c, false, &ref->m) != DS4_OK) return false;
    ds4_model_init_random(ref->m, 7);
    const int64_t n = ds4_model_numel(ref->m);
    ref->ranks = ranks;
    int32_t ids[64];
    for (int r = 0; r < ranks; r++) {
        ref_batch_ids(c, seed, r, ids);
        ds4_model_zero_grad(ref->m);
        if (!ref_pass(ref->m, ids, NULL, bf16, &ref->total[r])) return false;
        ref->g[r] = malloc((size_t)n * sizeof(float));
        memcpy(ref->g[r], ds4_model_grads_flat(ref->m), (size_t)n * sizeof(float));
    }
    return true;
}

static inline void reference_free(reference *ref) {
    ds4_model_free(ref->m);
    for (int r = 0; r < ref->ranks; r++) free(ref->g[r]);
}

/* The gradient FSDP + EP of degree ep must produce, in the reference layout [numel]: dense parameters
 * summed in rank order, a routed expert over each EP group's sources first. */
static inline float *expected_grads(const reference *ref, int ep) {
    const int64_t n = ds4_model_numel(ref->m);
    float *out = calloc((size_t)n, sizeof(float));
    const float *base = ds4_model_params_flat(ref->m);
    for (int64_t i = 0; i < ds4_model_nparams(ref->m); i++) {
        ds4_param *q = ds4_model_param(ref->m, i);
        if (!ds4_param_in_flat(q)) continue;
        const int64_t o = q->data - base;
        const int group = strstr(q->name, ".ffn.experts.") ? ep : 1; /* ranks summed before the next level */
        for (int64_t k = o; k < o + q->numel; k++) {
            float acc = 0;
            for (int g0 = 0; g0 < ref->ranks; g0 += group) {
                float part = 0;
                for (int r = g0; r < g0 + group; r++) part += ref->g[r][k];
                acc += part;
            }
            out[k] = acc;
        }
    }
    return out;
}

/* Elements of every float parameter of fm's layout (got, a collected flat buffer) that differ from rm's
 * (want); *first names the first parameter that differs. */
static inline int64_t compare_params(ds4_model *fm, const float *got, ds4_model *rm, const float *want,
                                     const char **first) {
    int64_t bad = 0;
    const float *fb = ds4_model_params_flat(fm), *rb = ds4_model_params_flat(rm);
    for (int64_t i = 0; i < ds4_model_nparams(fm); i++) {
        ds4_param *p = ds4_model_param(fm, i), *q = ds4_model_param(rm, i);
        if (!ds4_param_in_flat(p)) continue;
        const float *a = got + (p->data - fb), *b = want + (q->data - rb);
        for (int64_t k = 0; k < p->numel; k++)
            if (memcmp(&a[k], &b[k], sizeof(float))) {
                if (!bad) *first = p->name;
                bad++;
            }
    }
    return bad;
}

#endif
