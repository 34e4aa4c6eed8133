/* Pipeline layout: Megatron's pipeline_model_parallel_layout string or the uniform split, checked, and the
 * recompute priority of a layer from its real place in it (include/ds4/pipeline.h, docs/pipeline.md). */
#include "ds4/pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXPAND_MAX (1 << 20) /* characters of an expanded layout: far beyond any model, far below memory */

void ds4_pp_cfg_defaults(ds4_pp_cfg *p) {
    memset(p, 0, sizeof *p);
    p->pp = 1;
}

/* A growing string for the expansion. */
typedef struct {
    char *s;
    size_t n, cap;
} sbuf;

static bool sb_put(sbuf *b, const char *src, size_t n) {
    if (b->n + n + 1 > EXPAND_MAX) return false;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *s = realloc(b->s, cap);
        if (!s) return false;
        b->s = s;
        b->cap = cap;
    }
    memcpy(b->s + b->n, src, n);
    b->n += n;
    b->s[b->n] = 0;
    return true;
}

/* "*N" at s[i]: *count and *end (the index after the digits); false when s[i] is not '*' followed by digits. */
static bool repeat_at(const char *s, size_t i, long *count, size_t *end) {
    if (s[i] != '*' || s[i + 1] < '0' || s[i + 1] > '9') return false;
    long v = 0;
    size_t k = i + 1;
    for (; s[k] >= '0' && s[k] <= '9'; k++) {
        v = v * 10 + (s[k] - '0');
        if (v > EXPAND_MAX) v = EXPAND_MAX + 1L; /* saturate: the expansion fails on its size */
    }
    *count = v;
    *end = k;
    return true;
}

static ds4_status too_long(const char *layout) {
    return ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s' expands to more than %d characters", layout, EXPAND_MAX);
}

/* Megatron's two passes: every "(group)*N" first (no nested group), then every "x*N". ',' is dropped
 * before both. *out is malloc'ed. */
static ds4_status expand(const char *layout, char **out) {
    *out = NULL;
    sbuf a = {0}, b = {0};
    ds4_status st = DS4_OK;
    if (!sb_put(&a, "", 0)) return too_long(layout);
    for (const char *p = layout; *p; p++)
        if (*p != ',' && !sb_put(&a, p, 1)) {
            st = too_long(layout);
            goto done;
        }
    if (!sb_put(&b, "", 0)) {
        st = too_long(layout);
        goto done;
    }
    for (size_t i = 0; i < a.n;) {
        if (a.s[i] == ')') {
            st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': ')' without its '('", layout);
            goto done;
        }
        if (a.s[i] != '(') {
            if (!sb_put(&b, a.s + i, 1)) goto long_;
            i++;
            continue;
        }
        size_t close = i + 1;
        while (close < a.n && a.s[close] != ')' && a.s[close] != '(') close++;
        if (close >= a.n) {
            st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': '(' without its ')'", layout);
            goto done;
        }
        if (a.s[close] == '(') {
            st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': nested parentheses are not supported", layout);
            goto done;
        }
        long count;
        size_t end;
        if (close == i + 1 || !repeat_at(a.s, close + 1, &count, &end)) {
            st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': a group '(...)' must be non-empty and followed by "
                          "*N", layout);
            goto done;
        }
        for (long r = 0; r < count; r++)
            if (!sb_put(&b, a.s + i + 1, close - i - 1)) goto long_;
        i = end;
    }
    /* x*N: the character before each '*' */
    a.n = 0;
    a.s[0] = 0;
    for (size_t i = 0; i < b.n;) {
        long count;
        size_t end;
        if (b.s[i] == '*') {
            st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': '*' repeats nothing (write x*N or (...)*N)", layout);
            goto done;
        }
        if (repeat_at(b.s, i + 1, &count, &end)) {
            for (long r = 0; r < count; r++)
                if (!sb_put(&a, b.s + i, 1)) goto long_;
            i = end;
            continue;
        }
        if (b.s[i + 1] == '*') {
            st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': '*' after '%c' needs a count", layout, b.s[i]);
            goto done;
        }
        if (!sb_put(&a, b.s + i, 1)) goto long_;
        i++;
    }
    *out = a.s;
    a.s = NULL;
    goto done;
long_:
    st = too_long(layout);
done:
    free(a.s);
    free(b.s);
    return st;
}

/* The chunks of an expanded layout, counted and filled in list order; the checks follow Megatron's
 * validate_layer_layout with the placement ds4's passes need (MTP runs after the head, on its chunk). */
static ds4_status from_string(const ds4_pp_cfg *cfg, int64_t n_layers, int64_t n_mtp, ds4_pp_layout *L) {
    const char *src = cfg->layout;
    char *s;
    DS4_TRY(expand(src, &s));
    ds4_status st = DS4_OK;
    int64_t n_chunks = 1, n_t = 0, n_m = 0, n_e = 0, n_l = 0;
    for (const char *p = s; *p; p++) {
        if (*p == '|') n_chunks++;
        else if (*p == 't') n_t++;
        else if (*p == 'm') n_m++;
        else if (*p == 'E') n_e++;
        else if (*p == 'L') n_l++;
        else {
            st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': '%c' is not a layer (E embedding, t decoder layer, "
                          "m MTP layer, L loss; '|' between chunks)", src, *p);
            goto done;
        }
    }
    if (n_chunks > DS4_PP_MAX_CHUNKS) {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': %lld chunks, more than %d", src, (long long)n_chunks,
                      DS4_PP_MAX_CHUNKS);
        goto done;
    }
    if (n_chunks % cfg->pp) {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': %lld chunks are not a multiple of the %lld pipeline "
                      "stages (--pipeline-model-parallel-size)", src, (long long)n_chunks, (long long)cfg->pp);
        goto done;
    }
    L->vpp = n_chunks / cfg->pp;
    if (cfg->vpp > 0 && cfg->vpp != L->vpp) {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': %lld chunks, but pp %lld x vpp %lld = %lld", src,
                      (long long)n_chunks, (long long)cfg->pp, (long long)cfg->vpp, (long long)(cfg->pp * cfg->vpp));
        goto done;
    }
    if (n_t != n_layers) {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': %lld decoder layers (t), the model has %lld", src,
                      (long long)n_t, (long long)n_layers);
        goto done;
    }
    if (n_m != n_mtp) {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': %lld MTP layers (m), the model has %lld", src,
                      (long long)n_m, (long long)n_mtp);
        goto done;
    }
    if (n_e != 1 || s[0] != 'E') {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': the embedding (E) must come once, first of the first "
                      "chunk (pp rank 0, virtual chunk 0)", src);
        goto done;
    }
    if (n_l != 1 || s[strlen(s) - 1] != 'L') {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': the loss (L) must come once, last of the last chunk "
                      "(pp rank %lld, virtual chunk %lld)", src, (long long)(cfg->pp - 1), (long long)(L->vpp - 1));
        goto done;
    }
    const char *mtp = strchr(s, 'm');
    if (mtp && strchr(mtp, 't')) {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': a decoder layer (t) after an MTP layer (m); MTP layers "
                      "follow every decoder layer", src);
        goto done;
    }
    if (mtp && strchr(mtp, '|')) {
        st = ds4_fail(DS4_ERR_ARG, "pipeline layout '%.200s': the MTP layers (m) must be on the last chunk with the "
                      "loss (pp rank %lld, virtual chunk %lld): ds4 runs MTP after the head", src,
                      (long long)(cfg->pp - 1), (long long)(L->vpp - 1));
        goto done;
    }
    int64_t k = 0, layer = 0;
    L->chunk[0] = (ds4_pp_chunk){0};
    for (const char *p = s; *p; p++) {
        ds4_pp_chunk *ch = &L->chunk[k];
        switch (*p) {
        case '|':
            k++;
            L->chunk[k] = (ds4_pp_chunk){.layer_begin = layer, .layer_end = layer};
            break;
        case 'E': ch->embedding = true; break;
        case 't': ch->layer_end = ++layer; break;
        case 'm': ch->n_mtp++; break;
        default: ch->loss = true; break; /* 'L' */
        }
    }
done:
    free(s);
    return st;
}

/* pp x vpp chunks of n_layers / (pp · vpp) layers each. */
static ds4_status uniform(const ds4_pp_cfg *cfg, int64_t n_layers, ds4_pp_layout *L) {
    const int64_t pp = cfg->pp;
    int64_t vpp = cfg->vpp > 0 ? cfg->vpp : 1;
    if (cfg->layers_per_vstage > 0) {
        if (n_layers % pp || (n_layers / pp) % cfg->layers_per_vstage)
            return ds4_fail(DS4_ERR_ARG, "--num-layers-per-virtual-pipeline-stage %lld: the model's %lld layers over %lld "
                            "pipeline stages do not split into chunks of that many", (long long)cfg->layers_per_vstage,
                            (long long)n_layers, (long long)pp);
        const int64_t derived = n_layers / pp / cfg->layers_per_vstage;
        if (cfg->vpp > 0 && cfg->vpp != derived)
            return ds4_fail(DS4_ERR_ARG, "--num-layers-per-virtual-pipeline-stage %lld gives %lld virtual chunks per "
                            "stage, but --vpp is %lld", (long long)cfg->layers_per_vstage, (long long)derived,
                            (long long)cfg->vpp);
        vpp = derived;
    }
    if (pp * vpp > DS4_PP_MAX_CHUNKS)
        return ds4_fail(DS4_ERR_ARG, "pipeline: pp %lld x vpp %lld chunks, more than %d", (long long)pp, (long long)vpp,
                        DS4_PP_MAX_CHUNKS);
    if (n_layers % (pp * vpp))
        return ds4_fail(DS4_ERR_ARG, "pipeline: the model's %lld layers do not split evenly over pp %lld x vpp %lld "
                        "chunks; give the split with --pipeline-model-parallel-layout", (long long)n_layers,
                        (long long)pp, (long long)vpp);
    const int64_t per = n_layers / (pp * vpp);
    L->vpp = vpp;
    for (int64_t k = 0; k < pp * vpp; k++) L->chunk[k] = (ds4_pp_chunk){.layer_begin = k * per, .layer_end = (k + 1) * per};
    L->chunk[0].embedding = true;
    L->chunk[pp * vpp - 1].loss = true;
    return DS4_OK;
}

ds4_status ds4_pp_layout_make(const ds4_pp_cfg *cfg, int64_t n_layers, int64_t n_mtp, ds4_pp_layout *out) {
    memset(out, 0, sizeof *out);
    if (cfg->pp < 1 || cfg->pp > DS4_PP_MAX_CHUNKS)
        return ds4_fail(DS4_ERR_ARG, "--pipeline-model-parallel-size (parallel.pp) %lld: expected 1..%d",
                        (long long)cfg->pp, DS4_PP_MAX_CHUNKS);
    if (cfg->vpp < 0 || cfg->vpp > DS4_PP_MAX_CHUNKS)
        return ds4_fail(DS4_ERR_ARG, "--vpp (parallel.vpp) %lld: expected 1..%d", (long long)cfg->vpp, DS4_PP_MAX_CHUNKS);
    if (cfg->layers_per_vstage < 0)
        return ds4_fail(DS4_ERR_ARG, "--num-layers-per-virtual-pipeline-stage %lld: expected a positive count",
                        (long long)cfg->layers_per_vstage);
    if (cfg->layout[0] && cfg->layers_per_vstage > 0)
        return ds4_fail(DS4_ERR_ARG, "--pipeline-model-parallel-layout and --num-layers-per-virtual-pipeline-stage: "
                        "give one (the layout says how many layers each chunk has)");
    out->pp = cfg->pp;
    out->n_layers = n_layers;
    out->n_mtp = n_mtp;
    ds4_status st = cfg->layout[0] ? from_string(cfg, n_layers, n_mtp, out) : uniform(cfg, n_layers, out);
    if (st != DS4_OK) return st;
    if (!cfg->layout[0]) out->chunk[out->pp * out->vpp - 1].n_mtp = n_mtp;
    return DS4_OK;
}

ds4_status ds4_pp_chunk_at(const ds4_pp_layout *L, int64_t pp_rank, int64_t vpp_rank, const ds4_pp_chunk **out) {
    *out = NULL;
    if (pp_rank < 0 || pp_rank >= L->pp)
        return ds4_fail(DS4_ERR_ARG, "pipeline: pp rank %lld out of range [0, %lld)", (long long)pp_rank, (long long)L->pp);
    if (vpp_rank < 0 || vpp_rank >= L->vpp)
        return ds4_fail(DS4_ERR_ARG, "pipeline: VPP rank %lld out of range [0, %lld)", (long long)vpp_rank,
                        (long long)L->vpp);
    *out = &L->chunk[vpp_rank * L->pp + pp_rank];
    return DS4_OK;
}

ds4_status ds4_pp_locate(const ds4_pp_layout *L, int64_t layer, int64_t *pp_rank, int64_t *vpp_rank, int64_t *local) {
    if (layer < 0 || layer >= L->n_layers)
        return ds4_fail(DS4_ERR_ARG, "pipeline: layer %lld is not a decoder layer of the model [0, %lld)",
                        (long long)layer, (long long)L->n_layers);
    for (int64_t k = 0; k < L->pp * L->vpp; k++) {
        const ds4_pp_chunk *c = &L->chunk[k];
        if (layer >= c->layer_begin && layer < c->layer_end) {
            *pp_rank = k % L->pp;
            *vpp_rank = k / L->pp;
            *local = layer - c->layer_begin;
            return DS4_OK;
        }
    }
    return ds4_fail(DS4_ERR_INTERNAL, "pipeline: layer %lld is on no chunk", (long long)layer);
}

static int64_t chunk_size(const ds4_pp_layout *L, int64_t pp_rank, int64_t vpp_rank) {
    const ds4_pp_chunk *c = &L->chunk[vpp_rank * L->pp + pp_rank];
    return c->layer_end - c->layer_begin;
}

static int64_t priority_of(const ds4_pp_layout *L, int64_t p, int64_t v, int64_t local, bool per_pp_rank) {
    if (!per_pp_rank) return local;
    int64_t prio = 0;
    for (int64_t d = 0; d < local; d++) /* every depth above this one, over the rank's chunks long enough */
        for (int64_t w = 0; w < L->vpp; w++) prio += chunk_size(L, p, w) > d;
    for (int64_t w = 0; w < v; w++) prio += chunk_size(L, p, w) > local; /* this depth, earlier chunks */
    return prio;
}

ds4_status ds4_pp_priority(const ds4_pp_layout *L, int64_t layer, bool per_pp_rank, int64_t *out) {
    int64_t p, v, local;
    DS4_TRY(ds4_pp_locate(L, layer, &p, &v, &local));
    *out = priority_of(L, p, v, local, per_pp_rank);
    return DS4_OK;
}

ds4_status ds4_pp_priority_on(const ds4_pp_layout *L, int64_t pp_rank, int64_t vpp_rank, int64_t layer,
                              bool per_pp_rank, int64_t *out) {
    const ds4_pp_chunk *c;
    DS4_TRY(ds4_pp_chunk_at(L, pp_rank, vpp_rank, &c));
    if (layer < c->layer_begin || layer >= c->layer_end)
        return ds4_fail(DS4_ERR_ARG, "pipeline: layer %lld is not on pp rank %lld, virtual chunk %lld (its layers: "
                        "[%lld, %lld))", (long long)layer, (long long)pp_rank, (long long)vpp_rank,
                        (long long)c->layer_begin, (long long)c->layer_end);
    *out = priority_of(L, pp_rank, vpp_rank, layer - c->layer_begin, per_pp_rank);
    return DS4_OK;
}
