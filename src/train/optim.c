/* AdamW with fp32 master weights and moments, gradient clipping, the router bias rule, LR schedule. */
#include "ds4/train.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

ds4_status ds4_adamw_init_n(ds4_adamw *o, int64_t n) {
    memset(o, 0, sizeof *o);
    o->n = n;
    o->m = ds4_calloc(DS4_MEM_OPTIM, (size_t)n * sizeof(float));
    o->v = ds4_calloc(DS4_MEM_OPTIM, (size_t)n * sizeof(float));
    o->decay = ds4_calloc(DS4_MEM_OPTIM, (size_t)n);
    o->frozen = ds4_calloc(DS4_MEM_OPTIM, (size_t)n);
    if (!o->m || !o->v || !o->decay || !o->frozen) {
        ds4_adamw_free(o);
        return ds4_fail(DS4_ERR_OOM, "out of memory for the optimizer state (%lld parameters)", (long long)n);
    }
    return DS4_OK;
}

ds4_status ds4_adamw_init(ds4_adamw *o, ds4_model *m) {
    DS4_TRY(ds4_adamw_init_n(o, ds4_model_numel(m)));
    const float *base = ds4_model_params_flat(m);
    for (int64_t i = 0; i < (ds4_shape_only() ? 0 : ds4_model_nparams(m)); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (p->is_int) continue;
        int64_t off = p->data - base;
        memset(o->decay + off, p->no_decay ? 0 : 1, (size_t)p->numel);
        memset(o->frozen + off, p->no_grad ? 1 : 0, (size_t)p->numel);
    }
    return DS4_OK;
}

void ds4_adamw_free(ds4_adamw *o) {
    ds4_free(o->m);
    ds4_free(o->v);
    ds4_free(o->decay);
    ds4_free(o->frozen);
    memset(o, 0, sizeof *o);
}

void ds4_adamw_step(ds4_adamw *o, ds4_model *m, const ds4_adamw_cfg *c, double lr) {
    ds4_adamw_step_flat(o, ds4_model_params_flat(m), ds4_model_grads_flat(m), c, lr);
}

void ds4_adamw_step_flat(ds4_adamw *o, float *w, const float *g, const ds4_adamw_cfg *c, double lr) {
    if (ds4_shape_only()) return;
    o->step++;
    const double bc1 = 1.0 - pow(c->beta1, (double)o->step), bc2 = 1.0 - pow(c->beta2, (double)o->step);
    const float b1 = (float)c->beta1, b2 = (float)c->beta2, eps = (float)c->eps;
    const float step_size = (float)(lr / bc1), inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    const float decay = (float)(lr * c->weight_decay);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < o->n; i++) {
        if (o->frozen[i]) continue;
        float gi = g[i];
        o->m[i] = b1 * o->m[i] + (1.0f - b1) * gi;
        o->v[i] = b2 * o->v[i] + (1.0f - b2) * gi * gi;
        float denom = sqrtf(o->v[i]) * inv_sqrt_bc2 + eps;
        if (o->decay[i]) w[i] -= decay * w[i];
        w[i] -= step_size * o->m[i] / denom;
    }
}

double ds4_clip_grad_norm(ds4_model *m, double max_norm) {
    float *g = ds4_model_grads_flat(m);
    int64_t n = ds4_model_numel(m);
    /* fixed-size chunks summed in order: the same bits for any thread count */
    const int64_t chunk = 1 << 16, nchunks = (n + chunk - 1) / chunk;
    double *part = ds4_calloc(DS4_MEM_WORK, (size_t)(nchunks > 0 ? nchunks : 1) * sizeof(double));
    if (!part) return NAN;
    if (ds4_shape_only()) {
        ds4_free(part);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < nchunks; c++) {
        double s = 0;
        int64_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        for (int64_t i = c * chunk; i < end; i++) s += (double)g[i] * g[i];
        part[c] = s;
    }
    double total = 0;
    for (int64_t c = 0; c < nchunks; c++) total += part[c];
    ds4_free(part);
    double norm = sqrt(total);
    if (max_norm > 0 && norm > max_norm) {
        float s = (float)(max_norm / (norm + 1e-6));
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) g[i] *= s;
    }
    return norm;
}

void ds4_router_bias_update(ds4_model *m, const int64_t *loads, double gamma) {
    const ds4_config *c = ds4_model_config(m);
    int64_t E = c->n_routed_experts, nb = c->n_layers + c->n_mtp_layers;
    char name[64];
    for (int64_t l = 0; l < nb; l++) {
        if (l < c->n_layers) snprintf(name, sizeof name, "layers.%lld.ffn.gate.bias", (long long)l);
        else snprintf(name, sizeof name, "mtp.%lld.ffn.gate.bias", (long long)(l - c->n_layers));
        ds4_param *b = ds4_model_find(m, name);
        if (!b) continue; /* hash-routed layer */
        const int64_t *ld = loads + l * E;
        double mean = 0;
        for (int64_t e = 0; e < E; e++) mean += (double)ld[e];
        mean /= (double)E;
        for (int64_t e = 0; e < E; e++) {
            double d = mean - (double)ld[e];
            b->data[e] += (float)(gamma * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0));
        }
    }
}

double ds4_lr_at(const ds4_lr_schedule *s, int64_t step) {
    if (s->warmup_steps > 0 && step <= s->warmup_steps) return s->lr * (double)step / (double)s->warmup_steps;
    if (s->decay == DS4_DECAY_NONE || s->total_steps <= s->warmup_steps) return s->lr;
    double prog = (double)(step - s->warmup_steps) / (double)(s->total_steps - s->warmup_steps);
    if (prog > 1) prog = 1;
    double f = s->decay == DS4_DECAY_COSINE ? 0.5 * (1.0 + cos(M_PI * prog)) : 1.0 - prog;
    return s->min_lr + (s->lr - s->min_lr) * f;
}
