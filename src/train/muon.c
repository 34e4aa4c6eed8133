/* Muon (ds4/train.h, docs/muon.md), an entry of the optimizer socket: its group (ds4_param_is_muon), its
 * state (one momentum per element, its own array), the Newton–Schulz step and the update of its matrices.
 * The whole model and an FSDP shard run the same three per-matrix functions (a part of the matrix out, the
 * whole matrix, a part back in); the shard only adds the exchange between them, so both give the same
 * bits. The per-element arithmetic is src/core/norm.c's. */
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
    ds4_optim *o;
    const ds4_muon_cfg *c;
    float *w;       /* the weights the offsets s0 index: the whole model's flat array or the shard */
    const float *g; /* the gradients, likewise */
    float decay;    /* lr · weight_decay */
    double lr;
    ds4_ns_coef coef[DS4_MUON_NS_MAX];
} muon_ctx;

/* M := μ·M + G over the part, part := G + μ·M (Nesterov) or M: on the momentum in place when resident,
 * else read from the store into a buffer and written back. */
static ds4_status muon_part_out(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0, float *part) {
    muon_ctx *x = ctx;
    const int64_t n = k1 - k0;
    if (n == 0) return DS4_OK; /* this rank holds none of the matrix */
    int64_t j;
    if (ds4_optim_locate(x->o, s0, &j) != DS4_OPT_OWN)
        return ds4_fail(DS4_ERR_INTERNAL, "%s: not in the Muon group of the optimizer state", p->name);
    ds4_opt_group *G = &x->o->g[DS4_OPT_OWN];
    const ds4_exec *ex = &x->o->exec;
    if (!x->o->swapped) {
        ds4_dev_muon_momentum(ex, n, x->g + s0, G->mem[0] + j, part, (float)x->c->momentum, x->c->nesterov);
        return DS4_OK;
    }
    float *mom = ds4_dev_alloc(ex, DS4_MEM_OPTIM, (size_t)n * sizeof(float)); /* [n], counted in a plan too */
    if (!mom) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the Muon momentum", p->name);
    ds4_status st = ds4_optim_read_dev(x->o, DS4_OPT_OWN, 0, j, n, mom);
    if (st == DS4_OK && !ex->plan) {
        ds4_dev_muon_momentum(ex, n, x->g + s0, mom, part, (float)x->c->momentum, x->c->nesterov);
        st = ds4_optim_write_dev(x->o, DS4_OPT_OWN, 0, j, n, mom);
    }
    ds4_dev_free(ex, mom);
    return st;
}

/* The whole matrix [A, B] orthogonalized. */
static ds4_status muon_whole(void *ctx, ds4_param *p, float *x) {
    muon_ctx *m = ctx;
    return ds4_newton_schulz(&m->o->exec, x, p->shape[0], p->shape[1], m->coef, m->c->ns_steps, 1e-7f);
}

/* W := W − lr·wd·W − lr·s·O over the part. */
static ds4_status muon_part_in(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0, const float *part) {
    muon_ctx *x = ctx;
    const float step = (float)(x->lr * ds4_muon_scale(x->c, p->shape[0], p->shape[1]));
    ds4_dev_muon_apply(&x->o->exec, k1 - k0, x->w + s0, part, x->decay, step);
    return DS4_OK;
}

static muon_ctx muon_context(ds4_optim *o, const ds4_muon_cfg *c, float *w, const float *g, double wd, double lr) {
    muon_ctx x = {.o = o, .c = c, .w = w, .g = g, .decay = (float)(lr * wd), .lr = lr};
    for (int64_t i = 0; i < c->ns_steps && i < DS4_MUON_NS_MAX; i++) x.coef[i] = ds4_muon_coef(c, i);
    return x;
}

static ds4_status check_cfg(const ds4_optim *o, const ds4_muon_cfg *c) {
    if (o->opt != &ds4_optimizer_muon)
        return ds4_fail(DS4_ERR_ARG, "muon: the optimizer state is %s's, not Muon's (no Muon group)", o->opt->name);
    if (c->ns_steps < 1 || c->ns_steps > DS4_MUON_NS_MAX || c->ns_final_steps < 0 || c->ns_final_steps > c->ns_steps)
        return ds4_fail(DS4_ERR_ARG, "muon: %lld Newton-Schulz iterations of which %lld final (need 1..%d, final <= all)",
                        (long long)c->ns_steps, (long long)c->ns_final_steps, DS4_MUON_NS_MAX);
    return DS4_OK;
}

/* ------------------------------------------------------------------ the whole model */
/* A matrix's update buffer [n] on the state's backend (not zeroed: the momentum step writes all of it). */
static float *buf_of(ds4_optim *o, int64_t n) { return ds4_dev_alloc(&o->exec, DS4_MEM_OPTIM, (size_t)n * sizeof(float)); }
ds4_status ds4_muon_step(ds4_optim *o, ds4_model *m, const ds4_muon_cfg *c, double weight_decay, double lr) {
    DS4_TRY(check_cfg(o, c));
    float *w = ds4_model_params_flat(m);
    muon_ctx x = muon_context(o, c, w, ds4_model_grads_flat(m), weight_decay, lr);
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (!ds4_optimizer_takes(o->opt, p)) continue;
        const int64_t s0 = p->data - w;
        if (!ds4_optim_holds(o, s0)) continue; /* a pipeline stage: another stage's matrix */
        float *buf = buf_of(o, p->numel); /* the matrix [A, B] */
        ds4_status st = buf ? DS4_OK : ds4_fail(DS4_ERR_OOM, "%s: out of memory for the Muon update", p->name);
        if (st == DS4_OK) st = muon_part_out(&x, p, 0, p->numel, s0, buf);
        if (st == DS4_OK) st = muon_whole(&x, p, buf);
        if (st == DS4_OK) st = muon_part_in(&x, p, 0, p->numel, s0, buf);
        ds4_dev_free(&o->exec, buf);
        DS4_TRY(st);
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------ an FSDP shard */
ds4_status ds4_fsdp_muon_step(ds4_fsdp *f, ds4_optim *o, const ds4_muon_cfg *c, double weight_decay, double lr) {
    DS4_TRY(check_cfg(o, c));
    muon_ctx x = muon_context(o, c, ds4_fsdp_shard_params(f), ds4_fsdp_shard_grads(f), weight_decay, lr);
    const ds4_matrix_ops ops = {.ctx = &x,
                                .pick = ds4_param_is_muon,
                                .part_out = muon_part_out,
                                .whole = muon_whole,
                                .part_in = muon_part_in};
    return ds4_fsdp_for_each_matrix(f, &ops);
}

/* ------------------------------------------------------------------ the entry */
static ds4_status muon_entry_step(ds4_optim *o, const ds4_opt_target *t, const void *cfg, double weight_decay,
                                  double lr) {
    if (t->f) return ds4_fsdp_muon_step(t->f, o, cfg, weight_decay, lr);
    return ds4_muon_step(o, t->m, cfg, weight_decay, lr);
}

static const char *const k_muon_names[] = {"muon.momentum"};
const ds4_optimizer ds4_optimizer_muon = {.name = "Muon",
                                          .takes = ds4_param_is_muon,
                                          .nstate = 1,
                                          .state_names = k_muon_names,
                                          .mark = "muon.step",
                                          .step = muon_entry_step};
