/* Internal layout of the model: typed pointers into the flat parameter / gradient buffers. */
#ifndef DS4_MODEL_INTERNAL_H
#define DS4_MODEL_INTERNAL_H

#include "ds4/model.h"
#include "kernels/kernels.h"

/* One expert's SwiGLU weights (the kernels' moe_expert_w). w1, w3: [I, D]; w2: [D, I]. */
typedef moe_expert_w expert_w;

/* A compressor. wkv, wgate: [coff·d, D]; ape: [r, coff·d]; norm: [d]. */
typedef struct {
    float *wkv, *wgate, *ape, *norm;
} compressor_w;

/* One block (main layer or MTP block). Shapes in model/params.c. */
typedef struct {
    float *attn_norm, *ffn_norm;
    float *hc_attn_fn, *hc_attn_base, *hc_attn_scale;
    float *hc_ffn_fn, *hc_ffn_base, *hc_ffn_scale;
    float *attn_sink, *wq_a, *q_norm, *wq_b, *wkv, *kv_norm, *wo_a, *wo_b;
    compressor_w cmp;                 /* ratio > 0 */
    float *idx_wq_b, *idx_weights_proj; /* ratio == 4 */
    compressor_w idx_cmp;
    float *gate, *gate_bias;          /* gate: [E, D]; bias [E] (score-routed layers) */
    expert_w *experts;                /* [E] */
    expert_w shared;                  /* [Is, D] / [D, Is] */
} block_w;

/* Weights of the whole model; the gradient view has the same layout. */
typedef struct {
    float *embed, *head, *norm;
    float *hc_head_fn, *hc_head_base, *hc_head_scale;
    block_w *blocks;                  /* [n_layers + n_mtp_layers] */
    /* MTP extras */
    float *e_proj, *h_proj, *enorm, *hnorm, *mtp_norm;
    float *mtp_hc_head_fn, *mtp_hc_head_base, *mtp_hc_head_scale;
} model_w;

struct ds4_model {
    ds4_config cfg;
    int64_t nparams, cap;
    ds4_param *params;
    int64_t numel;
    float *flat, *gflat;              /* [numel] */
    int64_t **tid2eid;                /* [n_blocks] (NULL for score-routed) -> [V, K] */
    model_w w, g;                     /* values / gradients */
    ds4_rope rope_main, rope_cmp;     /* rebuilt when T grows */
    int64_t rope_len;
    bool gemm_ws;                     /* holds a reference on the GEMM packing workspace */
    bool bf16;                        /* made with the bf16 compute copy (ds4_model_create_bf16) */
    ds4_region *regions;              /* [nregions] in flat order */
    int64_t nregions;
    bool unmapped;                    /* flat / gflat are reserved ranges (ds4_model_create with unmapped) */
    ds4_exec exec;                    /* the context it was made for (ds4_model_create); passes check it */
    uint16_t *hflat;                  /* [numel] the bf16 compute copy, or NULL (fp32 models) */
};

/* ------------------------------------------------------------------ the model's device buffers
 * Every tensor a kernel reads or writes lives in the memory of the model's backend (buf_alloc in the
 * model's context); the host reaches it only through a copy (ds4_model_to_host / ds4_model_to_device).
 * Host metadata (the pass itself, its tables of pointers, counters the host keeps) stays ds4_alloc. */
static inline void *dev_alloc(const ds4_model *m, ds4_mem_cat cat, size_t bytes) {
    return buf_alloc(&m->exec, cat, bytes);
}
/* dev_alloc, zeroed by the backend (a plan's zeroing is skipped with every other op) */
static inline void *dev_zalloc(const ds4_model *m, ds4_mem_cat cat, size_t bytes) {
    void *p = buf_alloc(&m->exec, cat, bytes);
    if (p) tensor_zero(&m->exec, p, bytes);
    return p;
}
static inline void dev_free(const ds4_model *m, void *p) { buf_free(&m->exec, p); }

/* ------------------------------------------------------------------ the linear layers' weights
 * The one place the model picks what its linear layers read: the bf16 compute copy of weight w (a slot
 * of m->w whose parameter has compute dtype bf16) when the model holds one, else w in fp32. */
static inline const uint16_t *weight_bf16(const ds4_model *m, const float *w) {
    return m->hflat ? m->hflat + (w - m->flat) : NULL;
}
static inline void model_linear_fwd(const ds4_model *m, float *out, const float *inp, const float *w, int64_t N,
                                    int64_t IC, int64_t OC) {
    const uint16_t *h = weight_bf16(m, w);
    if (h) linear_fwd_bf16w(&m->exec, out, inp, h, N, IC, OC);
    else linear_fwd(&m->exec, out, inp, w, N, IC, OC);
}
static inline void model_linear_bwd(const ds4_model *m, float *dinp, float *dw, const float *dout, const float *inp,
                                    const float *w, int64_t N, int64_t IC, int64_t OC) {
    const uint16_t *h = weight_bf16(m, w);
    if (h) linear_bwd_bf16w(&m->exec, dinp, dw, dout, inp, h, N, IC, OC);
    else linear_bwd(&m->exec, dinp, dw, dout, inp, w, N, IC, OC);
}
static inline void model_grouped_linear_fwd(const ds4_model *m, float *z, const float *o, const float *w, int64_t N,
                                            int64_t G, int64_t R, int64_t Din) {
    const uint16_t *h = weight_bf16(m, w);
    if (h) grouped_linear_fwd_bf16w(&m->exec, z, o, h, N, G, R, Din);
    else grouped_linear_fwd(&m->exec, z, o, w, N, G, R, Din);
}
static inline void model_grouped_linear_bwd(const ds4_model *m, float *do_, float *dw, const float *dz, const float *o,
                                            const float *w, int64_t N, int64_t G, int64_t R, int64_t Din) {
    const uint16_t *h = weight_bf16(m, w);
    if (h) grouped_linear_bwd_bf16w(&m->exec, do_, dw, dz, o, h, N, G, R, Din);
    else grouped_linear_bwd(&m->exec, do_, dw, dz, o, w, N, G, R, Din);
}

/* Parameter groups (ds4/model.h): embed, layers, head, MTP. */
static inline int64_t group_of_layer(int64_t l) { return 1 + l; }

/* Frees a rope table the model moved to its backend (model.c). */
void model_rope_free(ds4_model *m, ds4_rope *r);
/* Rope tables for positions [0, T) (model.c; grows only). For model/decode.c. */
ds4_status model_ensure_rope(ds4_model *m, int64_t T);

static inline int64_t n_blocks(const ds4_config *c) { return c->n_layers + c->n_mtp_layers; }
static inline int64_t group_head(const ds4_config *c) { return c->n_layers + 1; }
static inline int64_t group_mtp(const ds4_config *c) { return c->n_layers + 2; }
static inline int64_t mix_hc(const ds4_config *c) { return (2 + c->hc_mult) * c->hc_mult; }
static inline bool block_is_hash(const ds4_config *c, int64_t l) { return l < c->n_hash_layers; }

#endif
