/* The kernel profile (ds4/profile.h): per op of ops.def, the calls, time and estimated FLOPs of the
 * wrappers' calls (kernels.h) while it is on. */
#include <stdarg.h>
#include <time.h>

#include "kernels/kernels.h"

bool ds4_profile_on;

static int64_t g_calls[DS4_OPID_COUNT], g_ns[DS4_OPID_COUNT], g_flops[DS4_OPID_COUNT];

void ds4_profile_enable(bool on) { ds4_profile_on = on; }
bool ds4_profile_enabled(void) { return ds4_profile_on; }

void ds4_profile_reset(void) {
    for (int i = 0; i < DS4_OPID_COUNT; i++)
        __atomic_store_n(&g_calls[i], 0, __ATOMIC_RELAXED), __atomic_store_n(&g_ns[i], 0, __ATOMIC_RELAXED),
            __atomic_store_n(&g_flops[i], 0, __ATOMIC_RELAXED);
}

int ds4_profile_op_count(void) { return DS4_OPID_COUNT; }

ds4_profile_op ds4_profile_get(int i) {
    if (i < 0 || i >= DS4_OPID_COUNT) return (ds4_profile_op){.name = "?"};
    return (ds4_profile_op){.name = ds4_kernel_op_names[i],
                            .calls = __atomic_load_n(&g_calls[i], __ATOMIC_RELAXED),
                            .seconds = 1e-9 * (double)__atomic_load_n(&g_ns[i], __ATOMIC_RELAXED),
                            .flops = (double)__atomic_load_n(&g_flops[i], __ATOMIC_RELAXED)};
}

int64_t ds4_profile_begin(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- FLOPs of an op from its arguments: 2 per multiply-add of its products, the cheap elementwise work
 * around them not counted. */

/* Compressed entries query position p may use: (s+1)·ratio <= p+1, at most Nc. */
static int64_t usable(int64_t p, int64_t ratio, int64_t Nc) {
    const int64_t u = (p + 1) / ratio;
    return u < Nc ? u : Nc;
}

/* Keys of one batch row's queries together, as sparse_attn reads them: the window, plus the top-k (at most
 * K, at most the usable entries) or every usable compressed entry. */
static double attn_keys(const sparse_attn_dims *d) {
    double keys = 0;
    for (int64_t t = 0; t < d->T; t++) {
        keys += (double)(t + 1 < d->window ? t + 1 : d->window);
        if (d->ratio > 0) {
            const int64_t u = usable(t, d->ratio, d->Nc);
            keys += (double)(d->K > 0 && d->K < u ? d->K : u);
        }
    }
    return keys;
}

/* Σ over a batch row's queries of the entries the indexer scores: top-k scores every usable entry of a
 * query that has more than K (with K or fewer, all are selected unscored); the KL scores its set S (the
 * top-k, or every usable entry without top-k). */
static double indexer_entries(const indexer_dims *d, int64_t t0, bool topk, bool kl) {
    double n = 0;
    for (int64_t t = 0; t < d->T; t++) {
        const int64_t u = usable(t0 + t, d->ratio, d->Nc);
        if (!kl) n += (double)(u > d->K ? u : 0);
        else n += (double)(topk && d->K < u ? d->K : u);
    }
    return n;
}

/* The routed experts' rows, read from the offsets: only where the host can read them (the cpu backend). */
static double expert_rows(const ds4_exec *ex, const moe_experts_args *a) {
    if (ex && ex->backend && ex->backend != ds4_kernel_backend_cpu()) return 0;
    return a->nexp > 0 ? (double)(a->off[a->nexp] - a->off[0]) : 0;
}

/* The arguments after ex are read in their order and types in ops.def. */
static double op_flops(int op, const ds4_exec *ex, va_list ap) {
    switch (op) {
    case DS4_OPID_gemm_nt:
    case DS4_OPID_gemm_nn:
    case DS4_OPID_gemm_tn: {
        const int64_t M = va_arg(ap, int64_t), N = va_arg(ap, int64_t), K = va_arg(ap, int64_t);
        return 2.0 * (double)M * (double)N * (double)K;
    }
    case DS4_OPID_linear_fwd:
    case DS4_OPID_linear_fwd_bf16w:
    case DS4_OPID_linear_bwd:
    case DS4_OPID_linear_bwd_bf16w:
    case DS4_OPID_grouped_linear_fwd:
    case DS4_OPID_grouped_linear_fwd_bf16w:
    case DS4_OPID_grouped_linear_bwd:
    case DS4_OPID_grouped_linear_bwd_bf16w: {
        /* forward (out, inp, w, sizes...), backward (dinp, dw, dout, inp, w, sizes...); the FLOPs are
         * 2 × the product of the sizes (N·IC·OC, or N·G·R·Din grouped) per product computed */
        const bool bwd = op == DS4_OPID_linear_bwd || op == DS4_OPID_linear_bwd_bf16w ||
                         op == DS4_OPID_grouped_linear_bwd || op == DS4_OPID_grouped_linear_bwd_bf16w;
        const bool bf16w = op == DS4_OPID_linear_fwd_bf16w || op == DS4_OPID_linear_bwd_bf16w ||
                           op == DS4_OPID_grouped_linear_fwd_bf16w || op == DS4_OPID_grouped_linear_bwd_bf16w;
        const bool grouped = op == DS4_OPID_grouped_linear_fwd || op == DS4_OPID_grouped_linear_fwd_bf16w ||
                             op == DS4_OPID_grouped_linear_bwd || op == DS4_OPID_grouped_linear_bwd_bf16w;
        double flops = 2.0;
        if (bwd) {
            const float *dinp = va_arg(ap, float *), *dw = va_arg(ap, float *);
            flops *= (dinp != NULL) + (dw != NULL);
            (void)va_arg(ap, const float *);
        } else {
            (void)va_arg(ap, float *);
        }
        (void)va_arg(ap, const float *);
        if (bf16w) (void)va_arg(ap, const uint16_t *);
        else (void)va_arg(ap, const float *);
        for (int i = 0; i < (grouped ? 4 : 3); i++) flops *= (double)va_arg(ap, int64_t);
        return flops;
    }
    case DS4_OPID_moe_experts_fwd: { /* h1 = w1 x, h3 = w3 x, y = w2 act */
        const moe_experts_args *a = va_arg(ap, const moe_experts_args *);
        return 6.0 * expert_rows(ex, a) * (double)a->D * (double)a->I;
    }
    case DS4_OPID_moe_experts_bwd: { /* the input and weight gradients of the three products */
        const moe_experts_args *a = va_arg(ap, const moe_experts_args *);
        return 12.0 * expert_rows(ex, a) * (double)a->D * (double)a->I;
    }
    case DS4_OPID_sparse_attn_fwd: { /* per (query, head, key): q·key and p·key */
        const sparse_attn_args *a = va_arg(ap, const sparse_attn_args *);
        const sparse_attn_dims *d = &a->dims;
        return 4.0 * (double)d->c * (double)(d->B * d->H) * attn_keys(d);
    }
    case DS4_OPID_sparse_attn_bwd: { /* q·key again, dout·key, dq, dkey as key and as value */
        const sparse_attn_args *a = va_arg(ap, const sparse_attn_args *);
        const sparse_attn_dims *d = &a->dims;
        return 10.0 * (double)d->c * (double)(d->B * d->H) * attn_keys(d);
    }
    case DS4_OPID_indexer_topk_fwd: { /* per (query, indexer head, usable entry): qi·ki */
        const indexer_topk_args *a = va_arg(ap, const indexer_topk_args *);
        const indexer_dims *d = &a->dims;
        return 2.0 * (double)(d->B * d->HI * d->dI) * indexer_entries(d, a->t0, true, false);
    }
    case DS4_OPID_indexer_kl_fwd_bwd: { /* per (row, entry of S): the teacher's q·kvc, the student's qi·ki,
                                         * and with gradients dqi and dki */
        const indexer_kl_args *a = va_arg(ap, const indexer_kl_args *);
        const indexer_dims *d = &a->dims;
        const double per = 2.0 * (double)(a->H * a->c) + 2.0 * (double)(d->HI * d->dI) * (a->dqi ? 3.0 : 1.0);
        return per * (double)d->B * indexer_entries(d, 0, a->topk != NULL, true);
    }
    default: return 0;
    }
}

void ds4_profile_end(int op, int64_t t0, const ds4_exec *ex, ...) {
    const int64_t dt = ds4_profile_begin() - t0;
    if ((ex && ex->plan) || op < 0 || op >= DS4_OPID_COUNT) return;
    va_list ap;
    va_start(ap, ex);
    const double flops = op_flops(op, ex, ap);
    va_end(ap);
    __atomic_fetch_add(&g_calls[op], 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&g_ns[op], dt, __ATOMIC_RELAXED);
    __atomic_fetch_add(&g_flops[op], (int64_t)flops, __ATOMIC_RELAXED);
}

void ds4_profile_print(FILE *f, double wall_seconds, int64_t steps) {
    int order[DS4_OPID_COUNT], n = 0;
    double total = 0;
    for (int i = 0; i < DS4_OPID_COUNT; i++) {
        const ds4_profile_op o = ds4_profile_get(i);
        if (o.calls == 0) continue;
        total += o.seconds;
        int j = n++; /* insertion by time, slowest first */
        for (; j > 0 && ds4_profile_get(order[j - 1]).seconds < o.seconds; j--) order[j] = order[j - 1];
        order[j] = i;
    }
    const double per = steps > 0 ? 1.0 / (double)steps : 1.0;
    const double wall = wall_seconds > 0 ? wall_seconds : total;
    fprintf(f, "| op | calls/step | ms/step | share | GFLOP/step | GFLOP/s |\n|---|---:|---:|---:|---:|---:|\n");
    int shown = n; /* the ops under 0.1% of the step share one row */
    double rest = 0;
    while (shown > 1 && wall > 0 && ds4_profile_get(order[shown - 1]).seconds < 1e-3 * wall)
        rest += ds4_profile_get(order[--shown]).seconds;
    for (int k = 0; k < shown; k++) {
        const ds4_profile_op o = ds4_profile_get(order[k]);
        fprintf(f, "| %s | %.0f | %.2f | %.1f%% |", o.name, (double)o.calls * per, 1e3 * o.seconds * per,
                wall > 0 ? 100.0 * o.seconds / wall : 0.0);
        if (o.flops > 0)
            fprintf(f, " %.3f | %.1f |\n", 1e-9 * o.flops * per, o.seconds > 0 ? 1e-9 * o.flops / o.seconds : 0.0);
        else
            fprintf(f, " | |\n");
    }
    if (shown < n)
        fprintf(f, "| %d more ops, each under 0.1%% | | %.2f | %.1f%% | | |\n", n - shown, 1e3 * rest * per,
                100.0 * rest / wall);
    fprintf(f, "| **all ops** | | %.2f | %.1f%% | | |\n", 1e3 * total * per, wall > 0 ? 100.0 * total / wall : 0.0);
    fprintf(f, "| outside the ops (optimizer, clipping, host code) | | %.2f | %.1f%% | | |\n",
            1e3 * (wall - total) * per, wall > 0 ? 100.0 * (wall - total) / wall : 0.0);
    fprintf(f, "| **step (wall)** | | %.2f | 100%% | | |\n", 1e3 * wall * per);
}
