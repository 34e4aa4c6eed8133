/* Recompute policy: flags → per-layer release masks (see include/ds4/recompute.h). */
#include "ds4/recompute.h"

#include "ds4/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ds4_recompute_defaults(ds4_recompute_cfg *r) {
    memset(r, 0, sizeof *r);
    r->norm_num_layers = -1;
    r->num_layers = -1;
    ds4_pp_cfg_defaults(&r->pipe);
}

static ds4_status parse_count(const char *flag, const char *v, int64_t *out) {
    char *end;
    long long x = strtoll(v, &end, 10);
    if (!*v || *end || x < 0) return ds4_fail(DS4_ERR_ARG, "%s expects a non-negative integer, got '%s'", flag, v);
    *out = x;
    return DS4_OK;
}

static ds4_status parse_positive(const char *flag, const char *v, int64_t *out) {
    DS4_TRY(parse_count(flag, v, out));
    if (*out < 1) return ds4_fail(DS4_ERR_ARG, "%s expects a positive integer, got '%s'", flag, v);
    return DS4_OK;
}

/* The pipeline flags (Megatron's names and ds4's short ones): *used = false when a is none of them. */
static ds4_status parse_pipe_arg(ds4_pp_cfg *p, const char *a, const char *v, bool *used) {
    *used = true;
    if (!strcmp(a, "--pp") || !strcmp(a, "--pipeline-model-parallel-size")) return parse_positive(a, v, &p->pp);
    if (!strcmp(a, "--vpp")) return parse_positive(a, v, &p->vpp);
    if (!strcmp(a, "--num-layers-per-virtual-pipeline-stage")) return parse_positive(a, v, &p->layers_per_vstage);
    if (!strcmp(a, "--pipeline-model-parallel-layout") || !strcmp(a, "--layout")) {
        if (strlen(v) >= sizeof p->layout)
            return ds4_fail(DS4_ERR_ARG, "%s: longer than %zu characters", a, sizeof p->layout - 1);
        snprintf(p->layout, sizeof p->layout, "%s", v);
        return DS4_OK;
    }
    *used = false;
    return DS4_OK;
}

ds4_status ds4_recompute_parse_arg(ds4_recompute_cfg *r, int argc, char **argv, int *i, bool *used) {
    const char *a = argv[*i];
    *used = true;
    if (!strcmp(a, "--recompute-csa-attention")) r->csa_attention = true;
    else if (!strcmp(a, "--mhc-recompute")) r->mhc = true;
    else if (!strcmp(a, "--recompute-norm")) r->norm = true;
    else if (!strcmp(a, "--enable-recompute-layers-per-pp-rank")) r->per_pp_rank = true;
    else if (!strcmp(a, "--pp") || !strcmp(a, "--pipeline-model-parallel-size") || !strcmp(a, "--vpp") ||
             !strcmp(a, "--num-layers-per-virtual-pipeline-stage") || !strcmp(a, "--pipeline-model-parallel-layout") ||
             !strcmp(a, "--layout")) {
        if (*i + 1 >= argc) return ds4_fail(DS4_ERR_ARG, "%s needs a value", a);
        const char *v = argv[++*i];
        return parse_pipe_arg(&r->pipe, a, v, used);
    }
    else if (!strcmp(a, "--recompute-norm-num-layers") || !strcmp(a, "--recompute-granularity") ||
             !strcmp(a, "--recompute-method") || !strcmp(a, "--recompute-num-layers")) {
        if (*i + 1 >= argc) return ds4_fail(DS4_ERR_ARG, "%s needs a value", a);
        const char *v = argv[++*i];
        if (!strcmp(a, "--recompute-norm-num-layers")) return parse_count(a, v, &r->norm_num_layers);
        if (!strcmp(a, "--recompute-num-layers")) return parse_count(a, v, &r->num_layers);
        if (!strcmp(a, "--recompute-granularity")) {
            if (!strcmp(v, "full")) r->granularity = DS4_RECOMPUTE_GRAN_FULL;
            else if (!strcmp(v, "selective")) r->granularity = DS4_RECOMPUTE_GRAN_SELECTIVE;
            else return ds4_fail(DS4_ERR_ARG, "--recompute-granularity must be full or selective, got '%s'", v);
        } else {
            if (!strcmp(v, "uniform")) r->method = DS4_RECOMPUTE_METHOD_UNIFORM;
            else if (!strcmp(v, "block")) r->method = DS4_RECOMPUTE_METHOD_BLOCK;
            else return ds4_fail(DS4_ERR_ARG, "--recompute-method must be uniform or block, got '%s'", v);
        }
    } else {
        *used = false;
    }
    return DS4_OK;
}

ds4_status ds4_recompute_validate(const ds4_recompute_cfg *r, const ds4_config *c) {
    bool fine = r->csa_attention || r->mhc || r->norm;
    ds4_pp_layout L; /* ~20 KiB */
    DS4_TRY(ds4_pp_layout_make(&r->pipe, c->n_layers, c->n_mtp_layers, &L));
    if (r->norm_num_layers >= 0 && !r->norm)
        return ds4_fail(DS4_ERR_ARG, "--recompute-norm-num-layers needs --recompute-norm");
    if (r->norm_num_layers > c->n_layers)
        return ds4_fail(DS4_ERR_ARG, "--recompute-norm-num-layers %lld exceeds the model's %lld layers",
                        (long long)r->norm_num_layers, (long long)c->n_layers);
    if (r->granularity != DS4_RECOMPUTE_GRAN_FULL) {
        if (r->method != DS4_RECOMPUTE_METHOD_NONE)
            return ds4_fail(DS4_ERR_ARG, "--recompute-method needs --recompute-granularity full");
        if (r->num_layers >= 0)
            return ds4_fail(DS4_ERR_ARG, "--recompute-num-layers needs --recompute-granularity full");
        if (r->granularity == DS4_RECOMPUTE_GRAN_SELECTIVE && !fine)
            return ds4_fail(DS4_ERR_ARG, "--recompute-granularity selective needs --recompute-csa-attention, "
                                         "--mhc-recompute or --recompute-norm");
        return DS4_OK;
    }
    if (r->method == DS4_RECOMPUTE_METHOD_NONE)
        return ds4_fail(DS4_ERR_ARG, "--recompute-granularity full needs --recompute-method uniform|block");
    if (r->num_layers < 0) return ds4_fail(DS4_ERR_ARG, "--recompute-granularity full needs --recompute-num-layers N");
    if (r->num_layers < 1 || r->num_layers > c->n_layers)
        return ds4_fail(DS4_ERR_ARG, "--recompute-num-layers must be in [1, %lld], got %lld", (long long)c->n_layers,
                        (long long)r->num_layers);
    if (r->method == DS4_RECOMPUTE_METHOD_UNIFORM && fine)
        return ds4_fail(DS4_ERR_ARG, "--recompute-method uniform recomputes every layer in full; the fine-grained "
                                     "flags (--recompute-csa-attention, --mhc-recompute, --recompute-norm) only "
                                     "combine with --recompute-method block");
    return DS4_OK;
}

/* The layout of r->pipe, or one chunk of every layer when it does not validate (ds4_recompute_validate
 * reports that). */
static void layout_of(const ds4_recompute_cfg *r, const ds4_config *c, ds4_pp_layout *L) {
    if (ds4_pp_layout_make(&r->pipe, c->n_layers, c->n_mtp_layers, L) == DS4_OK) return;
    ds4_pp_cfg one;
    ds4_pp_cfg_defaults(&one);
    (void)ds4_pp_layout_make(&one, c->n_layers, c->n_mtp_layers, L);
}

static int64_t priority_in(const ds4_recompute_cfg *r, const ds4_pp_layout *L, int64_t layer) {
    int64_t prio;
    return ds4_pp_priority(L, layer, r->per_pp_rank, &prio) == DS4_OK ? prio : layer;
}

int64_t ds4_recompute_priority(const ds4_recompute_cfg *r, const ds4_config *c, int64_t layer) {
    ds4_pp_layout L;
    layout_of(r, c, &L);
    return priority_in(r, &L, layer);
}

static uint32_t unit_bit(const char *name) {
    int u = ds4_unit_find(name);
    return u >= 0 ? 1u << u : 0;
}

void ds4_recompute_masks(const ds4_recompute_cfg *r, const ds4_config *c, uint32_t *masks) {
    const uint32_t all = ((1u << DS4_NUM_UNITS) - 1) & ~unit_bit("hc_post_ffn");
    const uint32_t csa = unit_bit("q_up") | unit_bit("compressor") | unit_bit("indexer") | unit_bit("sparse_attn") |
                         unit_bit("o_proj");
    const uint32_t mhc = unit_bit("hc_pre_attn") | unit_bit("hc_pre_ffn") | unit_bit("hc_post_attn");
    const uint32_t norm = unit_bit("attn_norm") | unit_bit("ffn_norm");
    ds4_pp_layout L;
    layout_of(r, c, &L);
    for (int64_t l = 0; l < c->n_layers; l++) {
        uint32_t m = 0;
        const int64_t prio = priority_in(r, &L, l);
        bool full = r->granularity == DS4_RECOMPUTE_GRAN_FULL &&
                    (r->method == DS4_RECOMPUTE_METHOD_UNIFORM || prio < r->num_layers);
        if (full) {
            masks[l] = all; /* no layer gets both full and fine-grained */
            continue;
        }
        bool norm_here = r->norm && (r->norm_num_layers < 0 || prio < r->norm_num_layers);
        if (r->csa_attention) m |= csa | (norm_here ? unit_bit("q_down") : 0);
        if (r->mhc) m |= mhc;
        if (norm_here) m |= norm;
        masks[l] = m;
    }
}

bool ds4_recompute_any(const ds4_recompute_cfg *r) {
    return r->csa_attention || r->mhc || r->norm || r->granularity == DS4_RECOMPUTE_GRAN_FULL;
}

const char *ds4_recompute_describe(const ds4_recompute_cfg *r, char *buf, size_t n) {
    buf[0] = 0;
    size_t k = 0;
    if (r->granularity == DS4_RECOMPUTE_GRAN_FULL)
        k += (size_t)snprintf(buf + k, n - k, "full-%s-%lld", r->method == DS4_RECOMPUTE_METHOD_BLOCK ? "block" : "uniform",
                              (long long)r->num_layers);
    if (r->csa_attention && k < n) k += (size_t)snprintf(buf + k, n - k, "%scsa", k ? "+" : "");
    if (r->mhc && k < n) k += (size_t)snprintf(buf + k, n - k, "%smhc", k ? "+" : "");
    if (r->norm && k < n) k += (size_t)snprintf(buf + k, n - k, "%snorm", k ? "+" : "");
    if (!k) snprintf(buf, n, "off");
    return buf;
}
