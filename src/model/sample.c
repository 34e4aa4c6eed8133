/* Next-token sampling from logits: greedy, temperature, top-p (nucleus). The one random number of
 * a draw comes from ds4's counter RNG at (seed, DS4_SAMPLE_STREAM, step), so a run repeats exactly. */
#include "ds4/decode.h"

#include <math.h>
#include <stdlib.h>

ds4_sample_opts ds4_sample_defaults(void) { return (ds4_sample_opts){.temperature = 0, .top_p = 1, .seed = 0}; }

typedef struct {
    double w;   /* unnormalised probability */
    int32_t id;
} weighted;

/* Descending weight, ties to the lower id: a total order, so qsort's result is unique. */
static int cmp_weighted(const void *a, const void *b) {
    const weighted *x = a, *y = b;
    if (x->w != y->w) return x->w > y->w ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

ds4_status ds4_sample(const float *logits, int64_t V, const ds4_sample_opts *o, uint64_t step, int32_t *token) {
    if (V <= 0) return ds4_fail(DS4_ERR_ARG, "sample: vocabulary size %lld must be > 0", (long long)V);
    /* argmax, ties to the lower id; NaN never wins */
    int64_t best = -1;
    for (int64_t i = 0; i < V; i++)
        if (logits[i] == logits[i] && (best < 0 || logits[i] > logits[best])) best = i;
    if (best < 0 || logits[best] == -INFINITY)
        return ds4_fail(DS4_ERR_ARG, "sample: every one of the %lld logits is -inf or NaN", (long long)V);
    const double mx = logits[best];
    if (o->temperature <= 0 || isinf(mx)) { /* greedy (a +inf logit takes all the mass) */
        *token = (int32_t)best;
        return DS4_OK;
    }
    weighted *c = ds4_alloc(DS4_MEM_WORK, (size_t)V * sizeof(weighted));
    if (!c) return ds4_fail(DS4_ERR_OOM, "sample: out of memory for %lld candidates", (long long)V);
    double total = 0;
    for (int64_t i = 0; i < V; i++) {
        double l = logits[i];
        c[i] = (weighted){l == l ? exp((l - mx) / o->temperature) : 0.0, (int32_t)i};
        total += c[i].w;
    }
    /* nucleus: the shortest most-probable prefix holding top_p of the mass */
    int64_t kept = V;
    double mass = total;
    if (o->top_p < 1) {
        qsort(c, (size_t)V, sizeof *c, cmp_weighted);
        mass = 0;
        for (kept = 0; kept < V;) {
            mass += c[kept++].w;
            if (mass >= o->top_p * total) break;
        }
    }
    /* inverse CDF over the kept tokens, in their order */
    double target = (double)ds4_rng_uniform(o->seed, DS4_SAMPLE_STREAM, step) * mass, cum = 0;
    int32_t pick = -1;
    for (int64_t k = 0; k < kept && pick < 0; k++) {
        cum += c[k].w;
        if (c[k].w > 0 && target < cum) pick = c[k].id;
    }
    for (int64_t k = kept - 1; pick < 0 && k >= 0; k--) /* rounding left target at the very top */
        if (c[k].w > 0) pick = c[k].id;
    ds4_free(c);
    *token = pick;
    return DS4_OK;
}
