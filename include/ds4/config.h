/* DeepSeek-V4 model configuration, read from a Hugging Face config.json.
 * Key names are the HF ones (docs/dsv4-architecture.md §1.1); fields are named after them. */
#ifndef DS4_CONFIG_H
#define DS4_CONFIG_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_MAX_LAYERS 256
/* DSpark drafter stages ds4 accepts (DeepSeek-V4-Flash-0731 has 3, one per dspark_target_layer_ids entry). */
#define DS4_MAX_DSPARK_STAGES 8
/* The longest context ds4 accepts: max_position_embeddings, and a decoder's length when the config
 * gives none (16M tokens; DeepSeek-V4 has 1M). */
#define DS4_MAX_POSITIONS ((int64_t)1 << 24)

typedef struct {
    int64_t vocab_size;            /* vocab_size */
    int64_t dim;                   /* hidden_size */
    int64_t n_layers;              /* num_hidden_layers */
    int64_t n_mtp_layers;          /* num_nextn_predict_layers (0 or 1) */
    int64_t n_heads;               /* num_attention_heads */
    int64_t n_kv_heads;            /* num_key_value_heads, must be 1 */
    int64_t head_dim;              /* head_dim */
    int64_t rope_head_dim;         /* qk_rope_head_dim */
    int64_t q_lora_rank;           /* q_lora_rank */
    int64_t o_groups;              /* o_groups */
    int64_t o_lora_rank;           /* o_lora_rank */
    int64_t window;                /* sliding_window */
    /* compress_ratios: n_layers + n_mtp_layers + dspark_n_stages entries (main layers, MTP, DSpark stages) */
    int64_t compress_ratios[DS4_MAX_LAYERS];
    int64_t index_n_heads;         /* index_n_heads */
    int64_t index_head_dim;        /* index_head_dim */
    int64_t index_topk;            /* index_topk */
    int64_t hc_mult;               /* hc_mult (4) */
    int64_t hc_sinkhorn_iters;     /* hc_sinkhorn_iters */
    double hc_eps;                 /* hc_eps */
    int64_t n_routed_experts;      /* n_routed_experts */
    int64_t n_shared_experts;      /* n_shared_experts */
    int64_t n_activated_experts;   /* num_experts_per_tok */
    int64_t moe_inter_dim;         /* moe_intermediate_size */
    int64_t n_hash_layers;         /* num_hash_layers */
    double route_scale;            /* routed_scaling_factor */
    double swiglu_limit;           /* swiglu_limit (0 = no clamp) */
    double rope_theta;             /* rope_theta */
    double compress_rope_theta;    /* compress_rope_theta */
    double rope_factor;            /* rope_scaling.factor (yarn) */
    int64_t original_seq_len;      /* rope_scaling.original_max_position_embeddings (0 = no yarn) */
    double beta_fast, beta_slow;   /* rope_scaling.beta_fast / beta_slow */
    double norm_eps;               /* rms_norm_eps */
    int64_t max_position_embeddings;
    int64_t bos_token_id, eos_token_id;
    /* training contract (docs/contract.md) */
    double mtp_loss_weight;        /* default 0.3 */
    double indexer_loss_coeff;     /* default 0.01 */
    bool csa_dense;                /* default false */
    /* DSpark speculative-decoding drafter (DeepSeek-V4-Flash-0731, docs/dspark.md): its stages are the
     * checkpoint's mtp.0 .. mtp.S-1, so a config with DSpark has no NextN block of its own (n_mtp_layers 0).
     * ds4 carries the drafter's tensors (loads, checkpoints and exports them) and does not train them. */
    int64_t dspark_n_stages;       /* len(dspark_target_layer_ids); 0 = no DSpark */
    int64_t dspark_target_layer_ids[DS4_MAX_DSPARK_STAGES]; /* main layers whose outputs feed stage 0 */
    int64_t dspark_block_size;     /* dspark_block_size: draft tokens per step (5) */
    int64_t dspark_noise_token_id; /* dspark_noise_token_id: the mask token of the draft block */
    int64_t dspark_markov_rank;    /* dspark_markov_rank: rank of the Markov head (256) */
    int64_t dspark_nextn_declared; /* num_nextn_predict_layers as a DSpark config.json states it (1), written back */
    /* checkpoint format */
    bool quantized;                /* quantization_config present (fp8) */
    bool expert_fp4;               /* expert_dtype == "fp4" */
} ds4_config;

/* Parses and validates; on error the message names `path` and the key. */
ds4_status ds4_config_load(const char *path, ds4_config *cfg);
ds4_status ds4_config_parse(const char *json_text, size_t len, const char *path_for_errors, ds4_config *cfg);
/* Structural checks (head/rope dims, compress ratios, groups, ...). Called by load. */
ds4_status ds4_config_validate(const ds4_config *cfg, const char *path_for_errors);
/* Writes a config.json (HF keys) atomically. */
ds4_status ds4_config_save(const ds4_config *cfg, const char *path);
/* The scalar settings that shape the model or its computation (not the loss weights), from the key
 * table of src/io/config.c: for i = 0, 1, ... until false, the config.json key ("rope_scaling.factor"
 * for one inside rope_scaling), its offset in ds4_config and whether it is a double (else int64_t). A
 * resumed run must match its checkpoint in every one. */
bool ds4_config_resume_field(int i, const char **key, size_t *offset, bool *is_float);

static inline int64_t ds4_layer_ratio(const ds4_config *c, int64_t layer) {
    return c->compress_ratios[layer];
}

#ifdef __cplusplus
}
#endif
#endif
