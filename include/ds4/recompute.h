/* Recompute policy: turns the MindSpeed/Megatron flags into per-layer release masks, the activation
 * store's recompute policy (ds4/actstore.h). The model only knows "release these units and replay
 * them"; which units and which layers is decided here.
 *
 *   --recompute-csa-attention        q_up, compressor, indexer, sparse_attn, o_proj (+ q_down with
 *                                    --recompute-norm on the layer: "q-up + q-norm + RoPE")
 *   --mhc-recompute                  hc_pre_attn, hc_pre_ffn, hc_post_attn
 *   --recompute-norm                 attn_norm, ffn_norm on the first --recompute-norm-num-layers
 *                                    layers by recompute priority (default: all)
 *   --recompute-granularity full     every unit of a layer, replayed from the layer input
 *   --recompute-method uniform|block uniform: every layer; block: the first --recompute-num-layers
 *   --recompute-num-layers N
 * MTP layers, eval passes and passes without gradients never recompute (enforced by the model). */
#ifndef DS4_RECOMPUTE_H
#define DS4_RECOMPUTE_H

#include "ds4/config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { DS4_RECOMPUTE_GRAN_NONE = 0, DS4_RECOMPUTE_GRAN_FULL, DS4_RECOMPUTE_GRAN_SELECTIVE } ds4_recompute_gran;
typedef enum { DS4_RECOMPUTE_METHOD_NONE = 0, DS4_RECOMPUTE_METHOD_UNIFORM, DS4_RECOMPUTE_METHOD_BLOCK } ds4_recompute_method;

typedef struct {
    bool csa_attention;
    bool mhc;
    bool norm;
    int64_t norm_num_layers;  /* -1 = all layers */
    ds4_recompute_gran granularity;
    ds4_recompute_method method;
    int64_t num_layers;       /* -1 = unset */
    /* pipeline layout for recompute_priority (1 stage, 1 virtual chunk until pipelines exist) */
    int64_t pp_size, vpp_size;
} ds4_recompute_cfg;

void ds4_recompute_defaults(ds4_recompute_cfg *r);
/* Consumes argv[*i] (and its value) if it is a recompute flag; returns DS4_OK and sets *used. */
ds4_status ds4_recompute_parse_arg(ds4_recompute_cfg *r, int argc, char **argv, int *i, bool *used);
/* Rejects incompatible combinations with a message naming the flags. */
ds4_status ds4_recompute_validate(const ds4_recompute_cfg *r, const ds4_config *c);
/* Priority of a layer for selective recompute: lower = recomputed first. With pipelines of pp
 * stages and vpp virtual chunks (uniform layout), layer L (0-based) gets
 * ((L % per_chunk) · vpp + vpp_rank), per_chunk = n_layers / (pp·vpp), vpp_rank = (L / per_chunk) % vpp;
 * with one stage and one chunk this is the layer's position. */
int64_t ds4_recompute_priority(const ds4_recompute_cfg *r, const ds4_config *c, int64_t layer);
/* masks[l] for l < n_layers: bit u set = release unit u (ds4_unit_name order) on layer l. */
void ds4_recompute_masks(const ds4_recompute_cfg *r, const ds4_config *c, uint32_t *masks);
bool ds4_recompute_any(const ds4_recompute_cfg *r);
/* "csa+mhc+norm", "full uniform", "off", ... for logs */
const char *ds4_recompute_describe(const ds4_recompute_cfg *r, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
