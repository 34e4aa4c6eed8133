/* The tensors a config needs, by official name and shape, without allocating a model: the same
 * table, in the same order, as the parameter table of ds4_model_create (src/model/params.c), so a
 * 150 GB checkpoint can be checked against its config on a small machine. */
#include "model/model_internal.h"

#include "ds4/io.h"

#include <stdarg.h>
#include <stdio.h>

typedef struct {
    ds4_expected_fn fn;
    void *ctx;
    ds4_status st;
} emitter;

static void emit(emitter *em, bool is_int, int ndim, int64_t d0, int64_t d1, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
static void emit(emitter *em, bool is_int, int ndim, int64_t d0, int64_t d1, const char *fmt, ...) {
    if (em->st != DS4_OK) return;
    char name[112];   /* ds4_param.name */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    int64_t shape[2] = {d0, d1};
    em->st = em->fn(em->ctx, name, ndim, shape, is_int);
}

#define F1(n, ...) emit(em, false, 1, n, 0, __VA_ARGS__)
#define F2(a, b, ...) emit(em, false, 2, a, b, __VA_ARGS__)

static void compressor(emitter *em, const char *pre, int64_t r, int64_t d, int64_t D) {
    int64_t coff = r == 4 ? 2 : 1;   /* CSA keeps two overlapping series */
    F2(coff * d, D, "%s.wkv.weight", pre);
    F2(coff * d, D, "%s.wgate.weight", pre);
    F2(r, coff * d, "%s.ape", pre);
    F1(d, "%s.norm.weight", pre);
}

static void block(emitter *em, const ds4_config *c, int64_t l, const char *pre) {
    int64_t D = c->dim, n = c->hc_mult, M = mix_hc(c), H = c->n_heads, hd = c->head_dim;
    int64_t r = ds4_layer_ratio(c, l), E = c->n_routed_experts, I = c->moe_inter_dim;
    int64_t Is = I * c->n_shared_experts, GR = c->o_groups * c->o_lora_rank;
    F1(D, "%s.attn_norm.weight", pre);
    F1(D, "%s.ffn_norm.weight", pre);
    F2(M, n * D, "%s.hc_attn_fn", pre);
    F1(M, "%s.hc_attn_base", pre);
    F1(3, "%s.hc_attn_scale", pre);
    F2(M, n * D, "%s.hc_ffn_fn", pre);
    F1(M, "%s.hc_ffn_base", pre);
    F1(3, "%s.hc_ffn_scale", pre);
    F1(H, "%s.attn.attn_sink", pre);
    F2(c->q_lora_rank, D, "%s.attn.wq_a.weight", pre);
    F1(c->q_lora_rank, "%s.attn.q_norm.weight", pre);
    F2(H * hd, c->q_lora_rank, "%s.attn.wq_b.weight", pre);
    F2(hd, D, "%s.attn.wkv.weight", pre);
    F1(hd, "%s.attn.kv_norm.weight", pre);
    F2(GR, H * hd / c->o_groups, "%s.attn.wo_a.weight", pre);
    F2(D, GR, "%s.attn.wo_b.weight", pre);
    char sub[128];
    if (r > 0) {
        snprintf(sub, sizeof sub, "%s.attn.compressor", pre);
        compressor(em, sub, r, hd, D);
    }
    if (r == 4) {
        F2(c->index_n_heads * c->index_head_dim, c->q_lora_rank, "%s.attn.indexer.wq_b.weight", pre);
        F2(c->index_n_heads, D, "%s.attn.indexer.weights_proj.weight", pre);
        snprintf(sub, sizeof sub, "%s.attn.indexer.compressor", pre);
        compressor(em, sub, 4, c->index_head_dim, D);
    }
    F2(E, D, "%s.ffn.gate.weight", pre);
    if (!block_is_hash(c, l)) F1(E, "%s.ffn.gate.bias", pre);
    else emit(em, true, 2, c->vocab_size, c->n_activated_experts, "%s.ffn.gate.tid2eid", pre);
    for (int64_t e = 0; e < E; e++) {
        F2(I, D, "%s.ffn.experts.%lld.w1.weight", pre, (long long)e);
        F2(D, I, "%s.ffn.experts.%lld.w2.weight", pre, (long long)e);
        F2(I, D, "%s.ffn.experts.%lld.w3.weight", pre, (long long)e);
    }
    F2(Is, D, "%s.ffn.shared_experts.w1.weight", pre);
    F2(D, Is, "%s.ffn.shared_experts.w2.weight", pre);
    F2(Is, D, "%s.ffn.shared_experts.w3.weight", pre);
}

ds4_status ds4_model_expected_tensors(const ds4_config *c, ds4_expected_fn fn, void *ctx) {
    DS4_TRY(ds4_config_validate(c, "config"));
    emitter e = {fn, ctx, DS4_OK}, *em = &e;
    int64_t D = c->dim, V = c->vocab_size, n = c->hc_mult;
    F2(V, D, "embed.weight");
    for (int64_t l = 0; l < c->n_layers; l++) {
        char pre[32];
        snprintf(pre, sizeof pre, "layers.%lld", (long long)l);
        block(em, c, l, pre);
    }
    F1(D, "norm.weight");
    F2(V, D, "head.weight");
    F2(n, n * D, "hc_head_fn");
    F1(n, "hc_head_base");
    F1(1, "hc_head_scale");
    if (c->n_mtp_layers > 0) {
        block(em, c, c->n_layers, "mtp.0");
        F2(D, D, "mtp.0.e_proj.weight");
        F2(D, D, "mtp.0.h_proj.weight");
        F1(D, "mtp.0.enorm.weight");
        F1(D, "mtp.0.hnorm.weight");
        F1(D, "mtp.0.norm.weight");
        F2(n, n * D, "mtp.0.hc_head_fn");
        F1(n, "mtp.0.hc_head_base");
        F1(1, "mtp.0.hc_head_scale");
    }
    return e.st;
}
