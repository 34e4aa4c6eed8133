/* Muon (ds4/train.h, docs/muon.md): the momentum, the Newton–Schulz step and the update of the Muon
 * group's matrices. The whole model and an FSDP shard run the same three per-matrix functions (a part of
 * the matrix out, the whole matrix, a part back in); the shard only adds the exchange between them, so
 * both give the same bits. */
#include "ds4/train.h"

#include <math.h>
#include <string.h>

ds4_muon_cfg ds4_muon_defaults(void) {
    return (ds4_muon_cfg){.momentum = 0.95,
                          .nesterov = true,
                          .ns_steps = 10,
                          .ns_final_steps = 2,
                          .adjust = DS4_MUON_ADJUST_RMS,
                          .update_rms = 0.18};
}

ds4_ns_coef ds4_muon_coef(const ds4_muon_cfg *c, int64_t i) {
    if (i >= c->ns_steps - c->ns_final_steps) return (ds4_ns_coef){2.0f, -1.5f, 0.5f}; /* settle at 1 */
    return (ds4_ns_coef){3.4445f, -4.7750f, 2.0315f};                                   /* drive up fast */
}

double ds4_muon_scale(const ds4_muon_cfg *c, int64_t rows, int64_t cols) {
    const double big = (double)(rows > cols ? rows : cols);
    switch (c->adjust) {
    case DS4_MUON_ADJUST_RMS: return c->update_rms * sqrt(big);
    case DS4_MUON_ADJUST_SPECTRAL: return rows > cols ? sqrt((double)rows / (double)cols) : 1.0;
    default: return 1.0;
    }
}

bool ds4_param_is_muon(const ds4_param *p) {
    if (p->is_int || p->no_grad || p->no_decay || p->ndim != 2) return false;
    if (!strcmp(p->name, "embed.weight") || !strcmp(p->name, "head.weight")) return false;
    return strstr(p->name, "hc_") == NULL; /* the mHC mappings stay on AdamW */
}

/* ------------------------------------------------------------------ the three per-matrix functions */
typedef struct {
    ds4_adamw *o;
    const ds4_muon_cfg *c;
    float *w;       /* the weights the offsets s0 index: the whole model's flat array or the shard */
    const float *g; /* the gradients, likewise */
    float decay;    /* lr · weight_decay */
    double lr;
    ds4_ns_coef coef[DS4_MUON_NS_MAX];
} muon_ctx;

/* M := μ·M + G over the part (momentum read from the state, resident or swapped, and written back);
 * part := G + μ·M (Nesterov) or M. */
static ds4_status muon_part_out(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0, float *part) {
    muon_ctx *x = ctx;
    const int64_t n = k1 - k0;
    if (n == 0) return DS4_OK; /* this rank holds none of the matrix */
    float *mom = ds4_alloc(DS4_MEM_OPTIM, (size_t)n * sizeof(float)); /* [n], counted in a plan too */
    if (!mom) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the Muon momentum", p->name);
    ds4_status st = x->o->plan ? DS4_OK : ds4_adamw_moment_read(x->o, 0, s0, n, mom);
    if (st == DS4_OK && !x->o->plan) {
        const float mu = (float)x->c->momentum;
        const float *g = x->g + s0;
        for (int64_t i = 0; i < n; i++) {
            mom[i] = mu * mom[i] + g[i];
            part[i] = x->c->nesterov ? g[i] + mu * mom[i] : mom[i];
        }
        st = ds4_adamw_moment_write(x->o, 0, s0, n, mom);
    }
    ds4_free(mom);
    return st;
}

/* The whole matrix [A, B] orthogonalized. */
static ds4_status muon_whole(void *ctx, ds4_param *p, float *x) {
    muon_ctx *m = ctx;
    return ds4_newton_schulz(x, p->shape[0], p->shape[1], m->coef, m->c->ns_steps, 1e-7f, m->o->plan);
}

/* W := W − lr·wd·W − lr·s·O over the part. */
static ds4_status muon_part_in(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0, const float *part) {
    muon_ctx *x = ctx;
    if (x->o->plan) return DS4_OK;
    const float step = (float)(x->lr * ds4_muon_scale(x->c, p->shape[0], p->shape[1]));
    float *w = x->w + s0;
    for (int64_t i = 0; i < k1 - k0; i++) {
        w[i] -= x->decay * w[i];
        w[i] -= step * part[i];
    }
    return DS4_OK;
}

static muon_ctx muon_context(ds4_adamw *o, const ds4_muon_cfg *c, float *w, const float *g, double wd, double lr) {
    muon_ctx x = {.o = o, .c = c, .w = w, .g = g, .decay = (float)(lr * wd), .lr = lr};
    for (int64_t i = 0; i < c->ns_steps && i < DS4_MUON_NS_MAX; i++) x.coef[i] = ds4_muon_coef(c, i);
    return x;
}

static ds4_status check_cfg(const ds4_adamw *o, const ds4_muon_cfg *c) {
    if (!o->muon) return ds4_fail(DS4_ERR_ARG, "muon: the optimizer state has no Muon group (ds4_adamw_group_muon)");
    if (c->ns_steps < 1 || c->ns_steps > DS4_MUON_NS_MAX || c->ns_final_steps < 0 || c->ns_final_steps > c->ns_steps)
        return ds4_fail(DS4_ERR_ARG, "muon: %lld Newton-Schulz iterations of which %lld final (need 1..%d, final <= all)",
                        (long long)c->ns_steps, (long long)c->ns_final_steps, DS4_MUON_NS_MAX);
    return DS4_OK;
}

/* ------------------------------------------------------------------ the whole model */
ds4_status ds4_muon_step(ds4_adamw *o, ds4_model *m, const ds4_muon_cfg *c, double weight_decay, double lr) {
    DS4_TRY(check_cfg(o, c));
    float *w = ds4_model_params_flat(m);
    muon_ctx x = muon_context(o, c, w, ds4_model_grads_flat(m), weight_decay, lr);
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_is_muon(p)) continue;
        const int64_t s0 = p->data - w;
        float *buf = ds4_alloc(DS4_MEM_OPTIM, (size_t)p->numel * sizeof(float)); /* the matrix [A, B] */
        ds4_status st = buf ? DS4_OK : ds4_fail(DS4_ERR_OOM, "%s: out of memory for the Muon update", p->name);
        if (st == DS4_OK) st = muon_part_out(&x, p, 0, p->numel, s0, buf);
        if (st == DS4_OK) st = muon_whole(&x, p, buf);
        if (st == DS4_OK) st = muon_part_in(&x, p, 0, p->numel, s0, buf);
        ds4_free(buf);
        DS4_TRY(st);
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------ an FSDP shard */
ds4_status ds4_fsdp_muon_step(ds4_fsdp *f, ds4_adamw *o, const ds4_muon_cfg *c, double weight_decay, double lr) {
    DS4_TRY(check_cfg(o, c));
    muon_ctx x = muon_context(o, c, ds4_fsdp_shard_params(f), ds4_fsdp_shard_grads(f), weight_decay, lr);
    const ds4_matrix_ops ops = {.ctx = &x,
                                .pick = ds4_param_is_muon,
                                .part_out = muon_part_out,
                                .whole = muon_whole,
                                .part_in = muon_part_in};
    return ds4_fsdp_for_each_matrix(f, &ops);
}

/* ------------------------------------------------------------------ switching optimizers at a resume */
typedef struct {
    ds4_adamw *o;
    int64_t elements;
    ds4_status st;
} reset_ctx;

static void reset_span(reset_ctx *r, int64_t s0, int64_t n) {
    if (r->st != DS4_OK || n == 0) return;
    float *zero = ds4_calloc(DS4_MEM_OPTIM, (size_t)n * sizeof(float));
    if (!zero) r->st = ds4_fail(DS4_ERR_OOM, "out of memory resetting the Muon group's optimizer state");
    for (int k = 0; k < 2 && r->st == DS4_OK; k++) r->st = ds4_adamw_moment_write(r->o, k, s0, n, zero);
    ds4_free(zero);
    r->elements += n;
}

static void reset_piece(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    if (ds4_param_is_muon(p)) reset_span(ctx, s0, k1 - k0);
}

ds4_status ds4_muon_reset_group(ds4_adamw *o, ds4_model *m, const ds4_fsdp *f, int64_t *elements, int64_t *matrices) {
    reset_ctx r = {.o = o, .st = DS4_OK};
    const float *flat = ds4_model_params_flat(m);
    *matrices = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_is_muon(p)) continue;
        (*matrices)++;
        if (!f) reset_span(&r, p->data - flat, p->numel);
    }
    if (f) ds4_fsdp_for_each_piece(f, reset_piece, &r);
    *elements = r.elements;
    return r.st;
}
