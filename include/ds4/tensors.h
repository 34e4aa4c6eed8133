/* The tensors of a DeepSeek-V4 checkpoint, declared once (docs/dsv4-architecture.md §8.1). The model's
 * parameter table and the expected-tensor check (src/model/param_table.c), the Hugging Face name map
 * (src/io/names.c) and the conversion's fp32 rule (src/io/convert.c) all expand these lists; which
 * tensors a block has (compressor, indexer, router bias or hash table, MTP) and their order is decided
 * by ds4_param_walk alone.
 *
 * X(field, ndim, d0, d1, official, hf, init, f32)
 *   field     the slot in the model's weight structs (block_w, compressor_w, expert_w, model_w)
 *   d0, d1    the shape, in the names of ds4_param_walk (D dim, n hc_mult, M mix_hc, H heads, hd
 *             head_dim, q q_lora_rank, GR o_groups·o_lora_rank, Og o_groups, E experts, I moe_inter_dim,
 *             Is shared inter dim, V vocab, K activated experts, r compress ratio, cd compressor dim,
 *             cw compressor width (2·cd for CSA), ih index heads, id index head dim)
 *   official  the name (after "layers.L." / "<compressor>." in block and compressor lists)
 *   hf        the Hugging Face transformers name after "model.layers.L." (0: none)
 *   init      NORMAL: N(0, 0.02), weight decay; ONE, ZERO: constant, no weight decay; ZERO_FROZEN:
 *             0, no decay, not trained by gradients (the router bias: the balancing rule moves it);
 *             EXPERT_IDS: the hash router's int64 table
 *   f32       1: kept in fp32 in a bf16 checkpoint (the mHC mixing, sinks, ape, router bias) */
#ifndef DS4_TENSORS_H
#define DS4_TENSORS_H

typedef enum {
    DS4_INIT_NORMAL = 0,
    DS4_INIT_ONE,
    DS4_INIT_ZERO,
    DS4_INIT_ZERO_FROZEN,
    DS4_INIT_EXPERT_IDS,
} ds4_init_rule;

/* Every block, first part (before the compressor). */
#define DS4_BLOCK_TENSORS(X)                                                                          \
    X(attn_norm, 1, D, 0, "attn_norm.weight", "input_layernorm.weight", ONE, 0)                       \
    X(ffn_norm, 1, D, 0, "ffn_norm.weight", "post_attention_layernorm.weight", ONE, 0)                \
    X(hc_attn_fn, 2, M, n * D, "hc_attn_fn", "attn_hc.fn", NORMAL, 1)                                 \
    X(hc_attn_base, 1, M, 0, "hc_attn_base", "attn_hc.base", ZERO, 1)                                 \
    X(hc_attn_scale, 1, 3, 0, "hc_attn_scale", "attn_hc.scale", ONE, 1)                               \
    X(hc_ffn_fn, 2, M, n * D, "hc_ffn_fn", "ffn_hc.fn", NORMAL, 1)                                    \
    X(hc_ffn_base, 1, M, 0, "hc_ffn_base", "ffn_hc.base", ZERO, 1)                                    \
    X(hc_ffn_scale, 1, 3, 0, "hc_ffn_scale", "ffn_hc.scale", ONE, 1)                                  \
    X(attn_sink, 1, H, 0, "attn.attn_sink", "self_attn.sinks", ZERO, 1)                               \
    X(wq_a, 2, q, D, "attn.wq_a.weight", "self_attn.q_a_proj.weight", NORMAL, 0)                      \
    X(q_norm, 1, q, 0, "attn.q_norm.weight", "self_attn.q_a_norm.weight", ONE, 0)                     \
    X(wq_b, 2, H * hd, q, "attn.wq_b.weight", "self_attn.q_b_proj.weight", NORMAL, 0)                 \
    X(wkv, 2, hd, D, "attn.wkv.weight", "self_attn.kv_proj.weight", NORMAL, 0)                        \
    X(kv_norm, 1, hd, 0, "attn.kv_norm.weight", "self_attn.kv_norm.weight", ONE, 0)                   \
    X(wo_a, 2, GR, H * hd / Og, "attn.wo_a.weight", "self_attn.o_a_proj.weight", NORMAL, 0)           \
    X(wo_b, 2, D, GR, "attn.wo_b.weight", "self_attn.o_b_proj.weight", NORMAL, 0)

/* A compressor (layers with compress ratio r > 0: "attn.compressor"; CSA layers (r = 4) also
 * "attn.indexer.compressor"), names after its prefix. */
#define DS4_COMPRESSOR_TENSORS(X)                                              \
    X(wkv, 2, cw, D, "wkv.weight", "kv_proj.weight", NORMAL, 0)                \
    X(wgate, 2, cw, D, "wgate.weight", "gate_proj.weight", NORMAL, 0)          \
    X(ape, 2, r, cw, "ape", "position_bias", ZERO, 1)                          \
    X(norm, 1, cd, 0, "norm.weight", "kv_norm.weight", ONE, 0)

/* The indexer of a CSA layer (r = 4), before its compressor. */
#define DS4_INDEXER_TENSORS(X)                                                                                   \
    X(idx_wq_b, 2, ih * id, q, "attn.indexer.wq_b.weight", "self_attn.compressor.indexer.q_b_proj.weight",      \
      NORMAL, 0)                                                                                                 \
    X(idx_weights_proj, 2, ih, D, "attn.indexer.weights_proj.weight",                                           \
      "self_attn.compressor.indexer.scorer.weights_proj.weight", NORMAL, 0)

/* The router: its weight, then a bias (score-routed layers) or a token -> experts table (hash layers). */
#define DS4_ROUTER_TENSORS(X) X(gate, 2, E, D, "ffn.gate.weight", "mlp.gate.weight", NORMAL, 0)
#define DS4_ROUTER_BIAS_TENSORS(X) \
    X(gate_bias, 1, E, 0, "ffn.gate.bias", "mlp.gate.e_score_correction_bias", ZERO_FROZEN, 1)
#define DS4_ROUTER_HASH_TENSORS(X) X(tid2eid, 2, V, K, "ffn.gate.tid2eid", "mlp.gate.tid2eid", EXPERT_IDS, 0)

/* Routed expert e ("ffn.experts.e." + name; Hugging Face fuses them, see src/io/names.c), then the
 * shared experts. */
#define DS4_EXPERT_TENSORS(X)                        \
    X(w1, 2, I, D, "w1.weight", 0, NORMAL, 0)        \
    X(w2, 2, D, I, "w2.weight", 0, NORMAL, 0)        \
    X(w3, 2, I, D, "w3.weight", 0, NORMAL, 0)
#define DS4_SHARED_EXPERT_TENSORS(X)                                                                   \
    X(shared.w1, 2, Is, D, "ffn.shared_experts.w1.weight", "mlp.shared_experts.gate_proj.weight", NORMAL, 0) \
    X(shared.w2, 2, D, Is, "ffn.shared_experts.w2.weight", "mlp.shared_experts.down_proj.weight", NORMAL, 0) \
    X(shared.w3, 2, Is, D, "ffn.shared_experts.w3.weight", "mlp.shared_experts.up_proj.weight", NORMAL, 0)

/* Whole-model tensors (hf: the full Hugging Face name): the embedding before the layers, the head after. */
#define DS4_EMBED_TENSORS(X) X(embed, 2, V, D, "embed.weight", "model.embed_tokens.weight", NORMAL, 0)
#define DS4_HEAD_TENSORS(X)                                                               \
    X(norm, 1, D, 0, "norm.weight", "model.norm.weight", ONE, 0)                          \
    X(head, 2, V, D, "head.weight", "lm_head.weight", NORMAL, 0)                          \
    X(hc_head_fn, 2, n, n * D, "hc_head_fn", "model.hc_head.hc_fn", NORMAL, 1)            \
    X(hc_head_base, 1, n, 0, "hc_head_base", "model.hc_head.hc_base", ZERO, 1)            \
    X(hc_head_scale, 1, 1, 0, "hc_head_scale", "model.hc_head.hc_scale", ONE, 1)

/* The MTP module's own tensors after its block (Hugging Face does not load MTP: no hf names). */
#define DS4_MTP_TENSORS(X)                                                  \
    X(e_proj, 2, D, D, "mtp.0.e_proj.weight", 0, NORMAL, 0)                 \
    X(h_proj, 2, D, D, "mtp.0.h_proj.weight", 0, NORMAL, 0)                 \
    X(enorm, 1, D, 0, "mtp.0.enorm.weight", 0, ONE, 0)                      \
    X(hnorm, 1, D, 0, "mtp.0.hnorm.weight", 0, ONE, 0)                      \
    X(mtp_norm, 1, D, 0, "mtp.0.norm.weight", 0, ONE, 0)                    \
    X(mtp_hc_head_fn, 2, n, n * D, "mtp.0.hc_head_fn", 0, NORMAL, 1)        \
    X(mtp_hc_head_base, 1, n, 0, "mtp.0.hc_head_base", 0, ZERO, 1)          \
    X(mtp_hc_head_scale, 1, 1, 0, "mtp.0.hc_head_scale", 0, ONE, 1)

/* The DSpark drafter of DeepSeek-V4-Flash-0731 (docs/dspark.md). Stage s of S (S = T =
 * len(dspark_target_layer_ids)) is a block named "mtp.s" (window only, score-routed: the lists above),
 * stage 0 also has FIRST (main_proj fuses the T target layers' outputs), stage S-1 also LAST (R =
 * dspark_markov_rank). Names after "mtp.s.". ds4 carries them (loads, checkpoints, exports) and trains
 * none of them; the init rules only fill a fresh model. */
#define DS4_DSPARK_FIRST_TENSORS(X)                                  \
    X(main_proj, 2, D, T * D, "main_proj.weight", 0, NORMAL, 0)      \
    X(main_norm, 1, D, 0, "main_norm.weight", 0, ONE, 0)
#define DS4_DSPARK_LAST_TENSORS(X)                                                    \
    X(norm, 1, D, 0, "norm.weight", 0, ONE, 0)                                        \
    X(hc_head_fn, 2, n, n * D, "hc_head_fn", 0, NORMAL, 1)                            \
    X(hc_head_base, 1, n, 0, "hc_head_base", 0, ZERO, 1)                              \
    X(hc_head_scale, 1, 1, 0, "hc_head_scale", 0, ONE, 1)                             \
    X(markov_w1, 2, V, R, "markov_head.markov_w1.weight", 0, NORMAL, 0)               \
    X(markov_w2, 2, V, R, "markov_head.markov_w2.weight", 0, NORMAL, 0)               \
    X(confidence, 2, 1, D + R, "confidence_head.proj.weight", 0, NORMAL, 0)

#endif
