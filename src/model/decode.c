/* Incremental decoding (docs/dsv4-architecture.md §4.8): one token at a time through the blocks of
 * model/block.c with a per-layer cache, giving the full-sequence forward's logits at every position.
 *
 * Every op is the kernel the pass uses, called on one token (N = 1): per-token kernels (mHC,
 * norms, linears, MoE gate, SwiGLU) compute a row the same way whatever N is. Three ops look
 * across positions and are called on shaped views instead:
 *   - RoPE at position p: a table view starting at row p (rope_at);
 *   - compressor pooling of the block that just completed: the pending rows as a T = r sequence
 *     (or T = 2r with the previous block for the overlapping ratio-4 compressor, taking entry 1);
 *   - sparse attention of the query at p: a T = 1, window 0 call whose "compressed entries" are
 *     the layer's key buffer and whose top-k list names the keys in the pass's order (window rows
 *     by position, then the compressed entries), so the kernel runs the same row math.
 * The indexer's top-k of one row is written here (indexer_row_topk) in the kernel's operation
 * order, because the kernel ties a row's usable entries to its position in the sequence. */
#include "ds4/decode.h"
#include "model/model_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One compressor's decode state. */
typedef struct {
    int64_t r, d, C;      /* ratio, entry width, C = coff·d channels per token */
    bool overlap;         /* ratio 4: entry i also pools block i − 1 */
    float *a, *z;         /* [rows, C] pending wkv / wgate rows: rows = 2r (previous block, then current) or r */
    float *out;           /* [cap, d] emitted entries (normalised, roped at i·r) */
    int64_t cap, n;       /* capacity max_len / r; entries emitted */
} cmp_state;

/* What a new position needs from the past, per main layer. */
typedef struct {
    int64_t ratio, ncap;  /* compress ratio (0: SWA); compressed capacity max_len / ratio */
    float *keys;          /* [ncap + window, hd]: compressed entries 0..ncap-1, then the window ring
                           * (position j in row ncap + j % window); each row is key and value */
    cmp_state cmp;        /* main compressor (ratio > 0); cmp.out points into keys */
    cmp_state icmp;       /* indexer compressor (ratio == 4) */
} layer_cache;

/* Below this many multiply-adds in the largest linear of a token (the head), the fast GEMM runs on
 * one thread anyway, and the other one-token kernels' thread teams cost more than they save: such a
 * model decodes on one thread (results do not depend on the thread count). */
#define DEC_PAR_MIN ((int64_t)1 << 20)

struct ds4_decoder {
    ds4_model *m;
    int64_t max_len, pos;
    bool serial;          /* run each step on one thread */
    layer_cache *layers;  /* [n_layers] */
    void **bufs;          /* [cap] every allocation below, freed together */
    int64_t nbufs, cap;
    /* one-token scratch */
    float *X, *Xmid, *Xnext;            /* [n, D] streams */
    float *mixes, *rsqrt, *post, *comb; /* [M], [1], [n], [n, n] */
    float *y, *xa, *rstd;               /* [D], [D], [max(H, 1)] */
    float *qa, *qr;                     /* [QR] */
    float *qraw, *q, *o, *o_r, *lse;    /* [H·hd] ×4, [H] */
    float *kvraw, *pool;                /* [hd], [2·max(hd, dI)] */
    float *zlo, *attn_out;              /* [G·R], [D] */
    float *qi, *wi, *iscore;            /* [HI·dI], [HI], [ncap4] */
    uint64_t *ikey, *isort;             /* [ncap4] */
    int32_t *topk;                      /* [index_topk] */
    int32_t *ids;                       /* [window + max compressed keys] attention key list */
    float *xf, *glog, *gsc, *gw;        /* [D], [E], [E], [K] */
    int32_t *gidx;                      /* [K] */
    float *h1, *h3, *act, *ye, *ffn;    /* [Imax] ×3, [D], [D] */
    float *hmix, *hy, *hyn;             /* [n], [D], [D] */
};

/* ------------------------------------------------------------------ allocation */
static void *dec_alloc(ds4_decoder *d, int64_t n, size_t elt) {
    if (d->nbufs >= d->cap) {
        ds4_fail(DS4_ERR_INTERNAL, "decoder: more than %lld buffers", (long long)d->cap);
        return NULL;
    }
    void *p = ds4_calloc(DS4_MEM_ACT, (size_t)(n > 0 ? n : 1) * elt);
    if (p) d->bufs[d->nbufs++] = p;
    return p;
}
#define DF(n) ((float *)dec_alloc(dec, (n), sizeof(float)))

void ds4_decoder_free(ds4_decoder *dec) {
    if (!dec) return;
    for (int64_t i = 0; i < dec->nbufs; i++) ds4_free(dec->bufs[i]);
    ds4_free(dec->bufs);
    ds4_free(dec->layers);
    ds4_free(dec);
}

int64_t ds4_decoder_bytes(const ds4_decoder *dec) {
    int64_t b = (int64_t)(ds4_alloc_size(dec) + ds4_alloc_size(dec->layers) + ds4_alloc_size(dec->bufs));
    for (int64_t i = 0; i < dec->nbufs; i++) b += (int64_t)ds4_alloc_size(dec->bufs[i]);
    return b;
}

int64_t ds4_decoder_pos(const ds4_decoder *dec) { return dec->pos; }
int64_t ds4_decoder_max_len(const ds4_decoder *dec) { return dec->max_len; }

void ds4_decoder_reset(ds4_decoder *dec) {
    dec->pos = 0;
    for (int64_t l = 0; l < dec->m->cfg.n_layers; l++) dec->layers[l].cmp.n = dec->layers[l].icmp.n = 0;
}

static bool cmp_init(ds4_decoder *dec, cmp_state *cs, int64_t r, int64_t d, int64_t max_len, float *out) {
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
    const int64_t L = c->n_layers, D = c->dim, n = c->hc_mult, H = c->n_heads, hd = c->head_dim;
    const int64_t QR = c->q_lora_rank, HI = c->index_n_heads, dI = c->index_head_dim, W = c->window;
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts, Imax = I > Is ? I : Is;
    const bool dense = c->csa_dense;
    dec->cap = 6 * L + 64; /* per layer at most keys + 2 × (a, z) + indexer entries; the scratch */
    bool ok = (dec->layers = ds4_calloc(DS4_MEM_ACT, (size_t)L * sizeof(layer_cache))) != NULL &&
              (dec->bufs = ds4_calloc(DS4_MEM_ACT, (size_t)dec->cap * sizeof(void *))) != NULL;
    int64_t ncap4 = 0, max_ck = 0; /* indexer entries; compressed keys one query can attend */
    for (int64_t l = 0; ok && l < L; l++) {
        layer_cache *lc = &dec->layers[l];
        lc->ratio = ds4_layer_ratio(c, l);
        lc->ncap = lc->ratio > 0 ? max_len / lc->ratio : 0;
        ok = (lc->keys = DF((lc->ncap + W) * hd)) != NULL;
        if (ok && lc->ratio > 0) ok = cmp_init(dec, &lc->cmp, lc->ratio, hd, max_len, lc->keys);
        if (ok && lc->ratio == 4) ok = cmp_init(dec, &lc->icmp, 4, dI, max_len, NULL);
        if (lc->ratio == 4) ncap4 = lc->ncap;
        int64_t ck = lc->ratio == 4 && !dense ? (c->index_topk < lc->ncap ? c->index_topk : lc->ncap) : lc->ncap;
        if (ck > max_ck) max_ck = ck;
    }
    int64_t pw = 2 * (hd > dI ? hd : dI);
    ok = ok && (dec->X = DF(n * D)) && (dec->Xmid = DF(n * D)) && (dec->Xnext = DF(n * D));
    ok = ok && (dec->mixes = DF(mix_hc(c))) && (dec->rsqrt = DF(1)) && (dec->post = DF(n)) && (dec->comb = DF(n * n));
    ok = ok && (dec->y = DF(D)) && (dec->xa = DF(D)) && (dec->rstd = DF(H > 1 ? H : 1));
    ok = ok && (dec->qa = DF(QR)) && (dec->qr = DF(QR));
    ok = ok && (dec->qraw = DF(H * hd)) && (dec->q = DF(H * hd)) && (dec->o = DF(H * hd)) && (dec->o_r = DF(H * hd));
    ok = ok && (dec->lse = DF(H)) && (dec->kvraw = DF(hd)) && (dec->pool = DF(pw));
    ok = ok && (dec->zlo = DF(c->o_groups * c->o_lora_rank)) && (dec->attn_out = DF(D));
    ok = ok && (dec->qi = DF(HI * dI)) && (dec->wi = DF(HI)) && (dec->iscore = DF(ncap4));
    ok = ok && (dec->ikey = dec_alloc(dec, ncap4, sizeof(uint64_t)));
    ok = ok && (dec->isort = dec_alloc(dec, ncap4, sizeof(uint64_t)));
    ok = ok && (dec->topk = dec_alloc(dec, c->index_topk, sizeof(int32_t)));
    ok = ok && (dec->ids = dec_alloc(dec, W + max_ck, sizeof(int32_t)));
    ok = ok && (dec->xf = DF(D)) && (dec->glog = DF(E)) && (dec->gsc = DF(E)) && (dec->gw = DF(K));
    ok = ok && (dec->gidx = dec_alloc(dec, K, sizeof(int32_t)));
    ok = ok && (dec->h1 = DF(Imax)) && (dec->h3 = DF(Imax)) && (dec->act = DF(Imax)) && (dec->ye = DF(D)) &&
         (dec->ffn = DF(D));
    ok = ok && (dec->hmix = DF(n)) && (dec->hy = DF(D)) && (dec->hyn = DF(D));
    if (!ok) {
        ds4_decoder_free(dec);
        return ds4_fail(DS4_ERR_OOM, "out of memory for a decoder of %lld positions", (long long)max_len);
    }
    *out = dec;
    return DS4_OK;
}

/* ------------------------------------------------------------------ one-row helpers */
/* RoPE of x: [H, hd] at position pos: the table viewed from row pos. */
static void rope_at(float *x, int64_t H, int64_t hd, const ds4_rope *r, int64_t pos, bool inverse) {
    ds4_rope at = *r;
    at.cos += pos * (r->rd / 2);
    at.sin += pos * (r->rd / 2);
    at.max_pos = 1;
    rope_fwd(x, &(rope_args){.N = 1, .H = H, .hd = hd, .period = 1, .mult = 1, .table = &at, .inverse = inverse});
}

static const ds4_rope *layer_rope(const ds4_model *m, int64_t ratio) {
    return ratio > 0 ? &m->rope_cmp : &m->rope_main;
}

/* Appends token p's wkv / wgate rows (from xa: [D]) to the pending block; when the block completes,
 * (p + 1) % r == 0, emits entry i = (p + 1)/r − 1 = rope(norm(pool)) at position i·r. */
static void cmp_step(ds4_decoder *dec, cmp_state *cs, const compressor_w *cw, const float *xa, int64_t p) {
    const ds4_config *c = &dec->m->cfg;
    const int64_t r = cs->r, d = cs->d, C = cs->C, row = (cs->overlap ? r : 0) + p % r;
    linear_fwd(cs->a + row * C, xa, cw->wkv, 1, c->dim, C);   // [C]
    linear_fwd(cs->z + row * C, xa, cw->wgate, 1, c->dim, C); // [C]
    if ((p + 1) % r != 0) return;
    const int64_t i = (p + 1) / r - 1;
    const float *pooled = dec->pool; // [d]
    if (!cs->overlap) {
        compressor_pool_fwd(&(compressor_pool_args){.dims = {.B = 1, .T = r, .r = r, .d = d, .overlap = false},
            .a = cs->a, .z = cs->z, .ape = cw->ape, .out = dec->pool});
    } else if (i == 0) { /* no previous block: the current block alone, as the pass's entry 0 */
        compressor_pool_fwd(&(compressor_pool_args){.dims = {.B = 1, .T = r, .r = r, .d = d, .overlap = true},
            .a = cs->a + r * C, .z = cs->z + r * C, .ape = cw->ape, .out = dec->pool});
    } else { /* [previous | current] as a 2-entry sequence; its entry 1 is this one */
        compressor_pool_fwd(&(compressor_pool_args){.dims = {.B = 1, .T = 2 * r, .r = r, .d = d, .overlap = true},
            .a = cs->a, .z = cs->z, .ape = cw->ape, .out = dec->pool});
        pooled = dec->pool + d;
    }
    if (cs->overlap) { /* the current block becomes the previous one */
        memcpy(cs->a, cs->a + r * C, (size_t)(r * C) * sizeof(float));
        memcpy(cs->z, cs->z + r * C, (size_t)(r * C) * sizeof(float));
    }
    float *e = cs->out + i * d; // [d]
    rmsnorm_fwd(e, dec->rstd, pooled, cw->norm, 1, d, (float)c->norm_eps);
    rope_at(e, 1, d, &dec->m->rope_cmp, i * r, false);
    cs->n = i + 1;
}

/* x·k over n floats in the indexer kernel's order: two 8-lane accumulators (elements i..i+7 and
 * i+8..i+15 of each 16), a last 8-lane step, the lanes summed pairwise, then the tail. */
static float ix_dot(const float *x, const float *k, int64_t n) {
    float a[8] = {0}, b[8] = {0}, v[8];
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 8; l++) a[l] += x[i + l] * k[i + l], b[l] += x[i + 8 + l] * k[i + 8 + l];
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) a[l] += x[i + l] * k[i + l];
    for (int l = 0; l < 8; l++) v[l] = a[l] + b[l];
    float s = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    for (; i < n; i++) s += x[i] * k[i];
    return s;
}

/* A key that orders like the score (NaN as −inf), as the kernel's selection uses. */
static uint64_t score_key(float x) {
    if (x != x) x = -INFINITY;
    uint32_t u;
    memcpy(&u, &x, 4);
    return (u >> 31) ? (uint32_t)~u : (u | 0x80000000u);
}

static int cmp_desc_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Top-k of one query row over the nu usable indexer entries (indexer_topk_fwd's row):
 * I[s] = Σ_h (wscale·w[h])·ReLU(qi[h]·ki[s]), heads ascending; the K largest, ties to the lower
 * index, written ascending, −1 padded. qi: [HI, dI]; ki: [nu, dI]; w: [HI]; topk: [K]. */
static void indexer_row_topk(ds4_decoder *dec, int32_t *topk, const float *qi, const float *ki, const float *w,
                             int64_t nu) {
    const ds4_config *c = &dec->m->cfg;
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, K = c->index_topk;
    const float wscale = (float)(1.0 / sqrt((double)dI) / sqrt((double)HI));
    int64_t n = 0;
    if (nu <= K) {
        for (; n < nu; n++) topk[n] = (int32_t)n;
    } else {
        for (int64_t s = 0; s < nu; s++) {
            float acc = 0;
            for (int64_t h = 0; h < HI; h++) {
                float dd = ix_dot(qi + h * dI, ki + s * dI, dI), ww = wscale * w[h];
                acc += ww * (dd > 0 ? dd : 0);
            }
            dec->iscore[s] = acc;
            dec->ikey[s] = dec->isort[s] = score_key(acc);
        }
        /* the K-th largest key; take every larger key and the lowest-index equal ones */
        qsort(dec->isort, (size_t)nu, sizeof(uint64_t), cmp_desc_u64);
        const uint64_t kth = dec->isort[K - 1];
        int64_t need = 0;
        for (int64_t j = 0; j < K; j++) need += dec->isort[j] == kth;
        for (int64_t s = 0; s < nu && n < K; s++) {
            bool take = dec->ikey[s] > kth || (dec->ikey[s] == kth && need > 0);
            if (take && dec->ikey[s] == kth) need--;
            if (take) topk[n++] = (int32_t)s;
        }
    }
    for (; n < K; n++) topk[n] = -1;
}

/* Attention of the query q: [H, hd] at position p over the window and the compressed entries
 * (selected by topk on sparse CSA layers, all emitted otherwise) with the sink. o: [H, hd]. */
static void attend(ds4_decoder *dec, const layer_cache *lc, const block_w *W, const int32_t *sel, int64_t p) {
    const ds4_config *c = &dec->m->cfg;
    const int64_t win = c->window, H = c->n_heads, hd = c->head_dim;
    int64_t nk = 0;
    for (int64_t j = p - win + 1 > 0 ? p - win + 1 : 0; j <= p; j++) dec->ids[nk++] = (int32_t)(lc->ncap + j % win);
    if (lc->ratio > 0) {
        if (sel) {
            for (int64_t k = 0; k < c->index_topk; k++)
                if (sel[k] >= 0) dec->ids[nk++] = sel[k];
        } else {
            for (int64_t i = 0; i < lc->cmp.n; i++) dec->ids[nk++] = (int32_t)i;
        }
    }
    /* one query row, no window, the key list as its "top-k" over the key buffer */
    sparse_attn_fwd(&(sparse_attn_args){.dims = {.B = 1, .T = 1, .H = H, .c = hd, .window = 0, .ratio = 1,
        .Nc = lc->ncap + win, .K = nk}, .scale = (float)(1.0 / sqrt((double)hd)), .q = dec->q, .kv = lc->keys,
        .kvc = lc->keys, .sink = W->attn_sink, .topk = dec->ids, .o = dec->o, .lse = dec->lse});
}

/* Routed experts (ascending id, as the pass groups assignments) then the shared expert, on xf. */
static void moe_token(ds4_decoder *dec, const block_w *W, int64_t l, int32_t token) {
    ds4_model *m = dec->m;
    const ds4_config *c = &m->cfg;
    const int64_t D = c->dim, E = c->n_routed_experts, K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts;
    const float limit = (float)c->swiglu_limit;
    const bool hash = block_is_hash(c, l);
    linear_fwd(dec->glog, dec->xf, W->gate, 1, D, E); // [E]
    moe_gate_fwd(&(moe_gate_args){.dims = {.N = 1, .E = E, .K = K}, .route_scale = (float)c->route_scale,
        .logits = dec->glog, .bias = hash ? NULL : W->gate_bias, .tid2eid = hash ? m->tid2eid[l] : NULL, .ids = &token,
        .idx = dec->gidx, .weights = dec->gw, .scores = dec->gsc});
    memset(dec->ffn, 0, (size_t)D * sizeof(float));
    for (int64_t e = 0; e < E; e++)
        for (int64_t k = 0; k < K; k++) {
            if (dec->gidx[k] != e) continue;
            const expert_w *ew = &W->experts[e];
            linear_fwd(dec->h1, dec->xf, ew->w1, 1, D, I);
            linear_fwd(dec->h3, dec->xf, ew->w3, 1, D, I);
            swiglu_fwd(dec->act, dec->h1, dec->h3, 1, I, limit);
            for (int64_t i = 0; i < I; i++) dec->act[i] *= dec->gw[k]; /* routing weight before w2 */
            linear_fwd(dec->ye, dec->act, ew->w2, 1, I, D);
            for (int64_t i = 0; i < D; i++) dec->ffn[i] += dec->ye[i];
        }
    linear_fwd(dec->h1, dec->xf, W->shared.w1, 1, D, Is);
    linear_fwd(dec->h3, dec->xf, W->shared.w3, 1, D, Is);
    swiglu_fwd(dec->act, dec->h1, dec->h3, 1, Is, limit);
    linear_fwd(dec->ye, dec->act, W->shared.w2, 1, Is, D);
    for (int64_t i = 0; i < D; i++) dec->ffn[i] += dec->ye[i];
}

/* ------------------------------------------------------------------ one layer, one token */
/* Xnext: [n, D] from X: [n, D] at position p, updating the layer's cache. */
static void layer_step(ds4_decoder *dec, int64_t l, int32_t token, int64_t p) {
    ds4_model *m = dec->m;
    const ds4_config *c = &m->cfg;
    const block_w *W = &m->w.blocks[l];
    layer_cache *lc = &dec->layers[l];
    const int64_t D = c->dim, n = c->hc_mult, H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank;
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, G = c->o_groups, R = c->o_lora_rank;
    const float eps = (float)c->norm_eps, hc_eps = (float)c->hc_eps;
    const ds4_rope *rope = layer_rope(m, lc->ratio);

    /* hc_pre_attn, attn_norm */
    hc_pre_fwd(&(hc_pre_args){.dims = {.N = 1, .n = n, .D = D, .iters = c->hc_sinkhorn_iters}, .hc_eps = hc_eps,
        .norm_eps = eps, .X = dec->X, .fn = W->hc_attn_fn, .scale = W->hc_attn_scale, .base = W->hc_attn_base,
        .y = dec->y, .post = dec->post, .comb = dec->comb, .mixes = dec->mixes, .rsqrt = dec->rsqrt});
    rmsnorm_fwd(dec->xa, dec->rstd, dec->y, W->attn_norm, 1, D, eps); // xa: [D]
    /* q_down, q_up: q = rope(headnorm(wq_b q_norm(wq_a xa))) at p */
    linear_fwd(dec->qa, dec->xa, W->wq_a, 1, D, QR);
    rmsnorm_fwd(dec->qr, dec->rstd, dec->qa, W->q_norm, 1, QR, eps); // qr: [QR]
    linear_fwd(dec->qraw, dec->qr, W->wq_b, 1, QR, H * hd);
    rmsnorm_fwd(dec->q, dec->rstd, dec->qraw, NULL, H, hd, eps); // q: [H, hd]
    rope_at(dec->q, H, hd, rope, p, false);
    /* kv: into the window ring */
    float *kv = lc->keys + (lc->ncap + p % c->window) * hd; // [hd]
    linear_fwd(dec->kvraw, dec->xa, W->wkv, 1, D, hd);
    rmsnorm_fwd(kv, dec->rstd, dec->kvraw, W->kv_norm, 1, hd, eps);
    rope_at(kv, 1, hd, rope, p, false);
    /* compressor; indexer (CSA) */
    if (lc->ratio > 0) cmp_step(dec, &lc->cmp, &W->cmp, dec->xa, p);
    const int32_t *sel = NULL;
    if (lc->ratio == 4) {
        linear_fwd(dec->qi, dec->qr, W->idx_wq_b, 1, QR, HI * dI); // [HI, dI]
        rope_at(dec->qi, HI, dI, &m->rope_cmp, p, false);
        linear_fwd(dec->wi, dec->xa, W->idx_weights_proj, 1, D, HI); // [HI]
        cmp_step(dec, &lc->icmp, &W->idx_cmp, dec->xa, p);
        if (!c->csa_dense) {
            indexer_row_topk(dec, dec->topk, dec->qi, lc->icmp.out, dec->wi, lc->icmp.n);
            sel = dec->topk;
        }
    }
    /* sparse_attn, o_proj, hc_post_attn */
    attend(dec, lc, W, sel, p); // o: [H, hd]
    memcpy(dec->o_r, dec->o, (size_t)(H * hd) * sizeof(float));
    rope_at(dec->o_r, H, hd, rope, p, true);
    grouped_linear_fwd(dec->zlo, dec->o_r, W->wo_a, 1, G, R, H * hd / G); // [G·R]
    linear_fwd(dec->attn_out, dec->zlo, W->wo_b, 1, G * R, D);          // [D]
    hc_post_fwd(&(hc_post_args){.dims = {.N = 1, .n = n, .D = D}, .x = dec->attn_out, .res = dec->X, .post = dec->post,
        .comb = dec->comb, .Y = dec->Xmid});
    /* hc_pre_ffn, ffn_norm, router + moe, hc_post_ffn */
    hc_pre_fwd(&(hc_pre_args){.dims = {.N = 1, .n = n, .D = D, .iters = c->hc_sinkhorn_iters}, .hc_eps = hc_eps,
        .norm_eps = eps, .X = dec->Xmid, .fn = W->hc_ffn_fn, .scale = W->hc_ffn_scale, .base = W->hc_ffn_base,
        .y = dec->y, .post = dec->post, .comb = dec->comb, .mixes = dec->mixes, .rsqrt = dec->rsqrt});
    rmsnorm_fwd(dec->xf, dec->rstd, dec->y, W->ffn_norm, 1, D, eps);
    moe_token(dec, W, l, token);
    hc_post_fwd(&(hc_post_args){.dims = {.N = 1, .n = n, .D = D}, .x = dec->ffn, .res = dec->Xmid, .post = dec->post,
        .comb = dec->comb, .Y = dec->Xnext});
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
    embedding_fwd(dec->X, m->w.embed, &token, 1, D);
    for (int64_t k = 1; k < n; k++) memcpy(dec->X + k * D, dec->X, (size_t)D * sizeof(float));
    for (int64_t l = 0; l < c->n_layers; l++) {
        layer_step(dec, l, token, p);
        float *t = dec->X;
        dec->X = dec->Xnext;
        dec->Xnext = t;
    }
    /* hc_head → norm → head */
    hc_head_fwd(&(hc_head_args){.dims = {.N = 1, .n = n, .D = D}, .hc_eps = (float)c->hc_eps,
        .norm_eps = (float)c->norm_eps, .X = dec->X, .fn = m->w.hc_head_fn, .scale = m->w.hc_head_scale,
        .base = m->w.hc_head_base, .y = dec->hy, .mixes = dec->hmix, .rsqrt = dec->rsqrt});
    rmsnorm_fwd(dec->hyn, dec->rstd, dec->hy, m->w.norm, 1, D, (float)c->norm_eps);
    linear_fwd(logits_out, dec->hyn, m->w.head, 1, D, c->vocab_size); // [V]
    if (dec->serial) ds4_set_threads(threads);
    dec->pos = p + 1;
    return DS4_OK;
}
