/* Sparse-aware training FLOPs per token: what the engine actually computes at sequence length T.
 * A linear [in -> out] costs 2·in·out per token forward; attention costs 4·H·c per (query, key)
 * (QK and PV); the indexer scores 2·HI·dI per (query, usable entry). Training = 3× forward. */
#include "ds4/train.h"

/* Mean over t < T of the number of keys a query attends to and of the entries the indexer scores. */
static void mean_keys(const ds4_config *c, int64_t r, int64_t T, double *keys, double *scored) {
    double k = 0, s = 0;
    for (int64_t t = 0; t < T; t++) {
        int64_t win = t + 1 < c->window ? t + 1 : c->window;
        int64_t usable = r > 0 ? (t + 1) / r : 0;
        int64_t sel = usable;
        if (r == 4 && !c->csa_dense && usable > c->index_topk) sel = c->index_topk;
        k += (double)(win + sel);
        s += r == 4 ? (double)usable : 0.0;
    }
    *keys = k / (double)T;
    *scored = s / (double)T;
}

static double block_fwd_flops(const ds4_config *c, int64_t l, int64_t T) {
    const double D = (double)c->dim, n = (double)c->hc_mult, M = (double)((2 + c->hc_mult) * c->hc_mult);
    const double H = (double)c->n_heads, hd = (double)c->head_dim, QR = (double)c->q_lora_rank;
    const double GR = (double)(c->o_groups * c->o_lora_rank), I = (double)c->moe_inter_dim;
    const double HI = (double)c->index_n_heads, dI = (double)c->index_head_dim;
    const int64_t r = c->compress_ratios[l];
    double f = 0;
    f += 2 * 2 * M * n * D;                       /* hc_pre mixes, attention and FFN */
    f += 2 * (D * QR + QR * H * hd + D * hd);     /* wq_a, wq_b, wkv */
    f += 2 * (H * hd * (double)c->o_lora_rank + GR * D);    /* grouped wo_a (H·c inputs -> R per group), wo_b */
    if (r > 0) f += 2 * 2 * D * (r == 4 ? 2 : 1) * hd;           /* compressor wkv, wgate */
    double keys, scored;
    mean_keys(c, r, T, &keys, &scored);
    f += 4 * H * hd * keys;
    if (r == 4) {
        f += 2 * (QR * HI * dI + D * HI + 2 * D * 2 * dI); /* indexer wq_b, weights_proj, compressor */
        f += 2 * HI * dI * scored;
    }
    f += 2 * D * (double)c->n_routed_experts;    /* gate */
    f += (double)c->n_activated_experts * 2 * 3 * D * I;                    /* routed experts */
    f += 2 * 3 * D * I * (double)c->n_shared_experts;                      /* shared expert */
    return f;
}

double ds4_train_flops_per_token(const ds4_config *c, int64_t T) {
    const double D = (double)c->dim, V = (double)c->vocab_size;
    double f = 0;
    for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers; l++) f += block_fwd_flops(c, l, T);
    f += 2 * D * V * (double)(1 + c->n_mtp_layers);                   /* head (main + MTP) */
    if (c->n_mtp_layers) f += 2 * D * D * (double)(1 + c->hc_mult); /* e_proj once, h_proj on every stream */
    return 3.0 * f;
}
