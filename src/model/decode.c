/* Incremental decoding (docs/dsv4-architecture.md §4.8): one token at a time through the units of
 * model/block.h with a per-layer cache, giving the full-sequence forward's logits at every position.
 *
 * Each block runs the pass's own unit forwards on one token (B = T = 1), so per-token math (mHC,
 * norms, linears, MoE gate, SwiGLU) is the pass's; RoPE at position p is a table view from row p.
 * The units that look across positions (kv's window, the compressors, the indexer's top-k, sparse
 * attention) run their declared decode variants against the layer's unit_cache instead (units_attn.c).
 * The cache is allocated here once; each step's unit outputs come and go through the activation store,
 * as in a forward-only pass. */
#include "ds4/decode.h"
#include "model/block.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Below this many multiply-adds in the largest linear of a token (the head), the fast GEMM runs on
 * one thread anyway, and the other one-token kernels' thread teams cost more than they save: such a
 * model decodes on one thread (results do not depend on the thread count). */
#define DEC_PAR_MIN ((int64_t)1 << 20)

struct ds4_decoder {
    ds4_model *m;
    int64_t max_len, pos;
    bool serial;          /* run each step on one thread */
    unit_cache *layers;   /* [n_layers] what a new position needs from the past (model/block.h) */
    void **bufs;          /* [cap] every allocation below, freed together */
    int64_t nbufs, cap;
    float *X, *Xnext;     /* [n, D] streams */
    float *hmix, *hrsqrt; /* [n], [1] head */
    float *hy, *hyn, *hrstd; /* [D], [D], [1] */
    int32_t *token;       /* [1] the step's token, on the backend (the embedding and hash routing read it) */
    float *logits;        /* [V] the step's logits, copied to the caller's host buffer */
    int32_t *keylist_host, *sel_host; /* host halves of the layers' shared key list (model/block.h) */
    int64_t dev_bytes;    /* of the buffers on the backend */
};

/* ------------------------------------------------------------------ allocation */
/* A zeroed buffer of the model's backend (the caches, the one-row scratch), freed with the decoder. */
static void *dec_alloc(ds4_decoder *d, int64_t n, size_t elt) {
    if (d->nbufs >= d->cap) {
        ds4_fail(DS4_ERR_INTERNAL, "decoder: more than %lld buffers", (long long)d->cap);
        return NULL;
    }
    const size_t bytes = (size_t)(n > 0 ? n : 1) * elt;
    void *p = dev_zalloc(d->m, DS4_MEM_ACT, bytes);
    if (p) {
        d->bufs[d->nbufs++] = p;
        d->dev_bytes += (int64_t)bytes;
    }
    return p;
}
#define DF(n) ((float *)dec_alloc(dec, (n), sizeof(float)))

void ds4_decoder_free(ds4_decoder *dec) {
    if (!dec) return;
    for (int64_t i = 0; i < dec->nbufs; i++) dev_free(dec->m, dec->bufs[i]);
    ds4_free(dec->keylist_host);
    ds4_free(dec->sel_host);
    ds4_free(dec->bufs);
    ds4_free(dec->layers);
    ds4_free(dec);
}

int64_t ds4_decoder_bytes(const ds4_decoder *dec) {
    int64_t b = (int64_t)(ds4_alloc_size(dec) + ds4_alloc_size(dec->layers) + ds4_alloc_size(dec->bufs) +
                          ds4_alloc_size(dec->keylist_host) + ds4_alloc_size(dec->sel_host));
    return b + dec->dev_bytes;
}

int64_t ds4_decoder_pos(const ds4_decoder *dec) { return dec->pos; }
int64_t ds4_decoder_max_len(const ds4_decoder *dec) { return dec->max_len; }

void ds4_decoder_reset(ds4_decoder *dec) {
    dec->pos = 0;
    for (int64_t l = 0; l < dec->m->cfg.n_layers; l++) dec->layers[l].cmp.n = dec->layers[l].icmp.n = 0;
}

static bool cmp_init(ds4_decoder *dec, cmp_cache *cs, int64_t r, int64_t d, int64_t max_len, float *out) {
    cs->r = r;
    cs->d = d;
    cs->overlap = r == 4;
    cs->C = (cs->overlap ? 2 : 1) * d;
    cs->cap = max_len / r;
    cs->n = 0;
    const int64_t rows = cs->overlap ? 2 * r : r;
    cs->a = DF(rows * cs->C);
    cs->z = DF(rows * cs->C);
    cs->out = out ? out : DF(cs->cap * d);
    return cs->a && cs->z && cs->out;
}

ds4_status ds4_decoder_new(ds4_model *m, int64_t max_len, ds4_decoder **out) {
    *out = NULL;
    const ds4_config *c = &m->cfg;
    if (max_len < 1) return ds4_fail(DS4_ERR_ARG, "decoder: max_len must be >= 1, got %lld", (long long)max_len);
    if (c->window < 1)
        return ds4_fail(DS4_ERR_CONFIG, "decoder: sliding_window must be >= 1, got %lld", (long long)c->window);
    DS4_TRY(model_ensure_rope(m, max_len));
    ds4_decoder *dec = ds4_calloc(DS4_MEM_ACT, sizeof *dec);
    if (!dec) return DS4_ERR_OOM;
    dec->m = m;
    dec->max_len = max_len;
    dec->serial = c->vocab_size * c->dim < DEC_PAR_MIN;
    const int64_t L = c->n_layers, D = c->dim, n = c->hc_mult, hd = c->head_dim, dI = c->index_head_dim;
    const int64_t W = c->window;
    const bool dense = c->csa_dense;
    dec->cap = 6 * L + 64; /* per layer at most keys + 2 × (a, z) + indexer entries; the scratch */
    bool ok = (dec->layers = ds4_calloc(DS4_MEM_ACT, (size_t)L * sizeof(unit_cache))) != NULL &&
              (dec->bufs = ds4_calloc(DS4_MEM_ACT, (size_t)dec->cap * sizeof(void *))) != NULL;
    int64_t max_ck = 0; /* compressed keys one query can attend */
    for (int64_t l = 0; ok && l < L; l++) {
        unit_cache *lc = &dec->layers[l];
        lc->ratio = ds4_layer_ratio(c, l);
        lc->ncap = lc->ratio > 0 ? max_len / lc->ratio : 0;
        ok = (lc->keys = DF((lc->ncap + W) * hd)) != NULL;
        if (ok && lc->ratio > 0) ok = cmp_init(dec, &lc->cmp, lc->ratio, hd, max_len, lc->keys);
        if (ok && lc->ratio == 4) ok = cmp_init(dec, &lc->icmp, 4, dI, max_len, NULL);
        int64_t ck = lc->ratio == 4 && !dense ? (c->index_topk < lc->ncap ? c->index_topk : lc->ncap) : lc->ncap;
        if (ck > max_ck) max_ck = ck;
    }
    /* the one-row scratch every layer's decode variants share */
    float *pool = NULL, *rstd = NULL;
    int32_t *keylist = NULL;
    ok = ok && (dec->X = DF(n * D)) && (dec->Xnext = DF(n * D));
    ok = ok && (rstd = DF(1)) && (pool = DF(2 * (hd > dI ? hd : dI)));
    ok = ok && (keylist = dec_alloc(dec, W + max_ck, sizeof(int32_t)));
    ok = ok && (dec->keylist_host = ds4_alloc(DS4_MEM_ACT, (size_t)(W + max_ck) * sizeof(int32_t)));
    ok = ok && (dec->sel_host = ds4_alloc(DS4_MEM_ACT, (size_t)(c->index_topk > 0 ? c->index_topk : 1) * sizeof(int32_t)));
    ok = ok && (dec->token = dec_alloc(dec, 1, sizeof(int32_t))) && (dec->logits = DF(c->vocab_size));
    ok = ok && (dec->hmix = DF(n)) && (dec->hrsqrt = DF(1)) && (dec->hy = DF(D)) && (dec->hyn = DF(D)) &&
         (dec->hrstd = DF(1));
    if (!ok) {
        ds4_decoder_free(dec);
        return ds4_fail(DS4_ERR_OOM, "out of memory for a decoder of %lld positions", (long long)max_len);
    }
    for (int64_t l = 0; l < L; l++) {
        unit_cache *lc = &dec->layers[l];
        lc->pool = pool;
        lc->rstd = rstd;
        lc->keylist = keylist;
        lc->keylist_host = dec->keylist_host;
        lc->sel_host = dec->sel_host;
    }
    *out = dec;
    return DS4_OK;
}

/* ------------------------------------------------------------------ one layer, one token */
/* Xnext: [n, D] from X: [n, D] at position p: the block's units on one token, the cache-backed ones
 * through their decode variants; the step's unit outputs are freed once the block is done. */
static ds4_status layer_step(ds4_decoder *dec, int64_t l, int64_t p) {
    ds4_model *m = dec->m;
    unit_cache *lc = &dec->layers[l];
    const ds4_rope rope_main = rope_view(&m->rope_main, p), rope_cmp = rope_view(&m->rope_cmp, p);
    const block_ctx bc = {.m = m, .layer = l, .B = 1, .T = 1, .ids = dec->token, .dense_csa = m->cfg.csa_dense,
                          .rope_main = &rope_main, .rope_cmp = &rope_cmp};
    block_acts a = {.X_in = dec->X, .X_out = dec->Xnext, .ratio = lc->ratio};
    lc->pos = p;
    ds4_status st = DS4_OK;
    for (int u = 0; u < U_COUNT && st == DS4_OK; u++) st = act_run_cached(&bc, &a, (unit_id)u, lc);
    block_acts_free(&a);
    return st;
}

ds4_status ds4_decoder_step(ds4_decoder *dec, int32_t token, float *logits_out) {
    ds4_model *m = dec->m;
    const ds4_config *c = &m->cfg;
    const int64_t D = c->dim, n = c->hc_mult, p = dec->pos;
    if (token < 0 || token >= c->vocab_size)
        return ds4_fail(DS4_ERR_ARG, "decoder: token %d at position %lld is outside the vocabulary [0, %lld)", token,
                        (long long)p, (long long)c->vocab_size);
    if (p >= dec->max_len)
        return ds4_fail(DS4_ERR_ARG, "decoder: position %lld is past max_len %lld", (long long)p,
                        (long long)dec->max_len);
    DS4_TRY(model_ensure_rope(m, dec->max_len)); /* a no-op unless the tables were never this long */
    const int threads = ds4_get_threads();
    if (dec->serial) ds4_set_threads(1);
    /* embedding into n identical streams: X [n, D] */
    ds4_model_to_device(m, dec->token, &token, sizeof token);
    embedding_fwd(&m->exec, dec->X, m->w.embed, dec->token, 1, D);
    streams_expand(&m->exec, dec->X, 1, n, D);
    ds4_status st = DS4_OK;
    for (int64_t l = 0; l < c->n_layers && st == DS4_OK; l++) {
        st = layer_step(dec, l, p);
        float *t = dec->X;
        dec->X = dec->Xnext;
        dec->Xnext = t;
    }
    /* hc_head → norm → head */
    if (st == DS4_OK) {
        hc_head_fwd(&m->exec, &(hc_head_args){.dims = {.N = 1, .n = n, .D = D}, .hc_eps = (float)c->hc_eps,
            .norm_eps = (float)c->norm_eps, .X = dec->X, .fn = m->w.hc_head_fn, .scale = m->w.hc_head_scale,
            .base = m->w.hc_head_base, .y = dec->hy, .mixes = dec->hmix, .rsqrt = dec->hrsqrt});
        rmsnorm_fwd(&m->exec, dec->hyn, dec->hrstd, dec->hy, m->w.norm, 1, D, (float)c->norm_eps);
        model_linear_fwd(m, dec->logits, dec->hyn, m->w.head, 1, D, c->vocab_size); // [V]
        ds4_model_to_host(m, logits_out, dec->logits, (size_t)c->vocab_size * sizeof(float));
        st = ds4_dev_status(&m->exec);
    }
    if (dec->serial) ds4_set_threads(threads);
    if (st != DS4_OK) return st;
    dec->pos = p + 1;
    return DS4_OK;
}
