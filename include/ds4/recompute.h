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
 *   --enable-recompute-layers-per-pp-rank   the priority counts over the pp rank's chunks, interleaved
 * The priority (lower: first) is the layer's position in its pipeline chunk (ds4/pipeline.h: the layout of
 * --pp, --vpp, --pipeline-model-parallel-layout, also parsed here); full block recompute takes the layers
 * of priority < --recompute-num-layers, --recompute-norm those of priority < --recompute-norm-num-layers.
 * MTP layers, eval passes and passes without gradients never recompute (enforced by the model). */
#ifndef DS4_RECOMPUTE_H
#define DS4_RECOMPUTE_H

#include "ds4/config.h"
#include "ds4/pipeline.h"

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
    bool per_pp_rank;         /* --enable-recompute-layers-per-pp-rank */
    /* the run's pipeline layout (parallel.pp, parallel.vpp, parallel.layout; --pp, --vpp, ...): the
     * priority is a layer's place in it */
    ds4_pp_cfg pipe;
} ds4_recompute_cfg;

void ds4_recompute_defaults(ds4_recompute_cfg *r);
/* Consumes argv[*i] (and its value) if it is a recompute flag; returns DS4_OK and sets *used. */
ds4_status ds4_recompute_parse_arg(ds4_recompute_cfg *r, int argc, char **argv, int *i, bool *used);
/* Rejects incompatible combinations with a message naming the flags, and a pipeline layout that does not
 * fit the model (ds4_pp_layout_make's errors). */
ds4_status ds4_recompute_validate(const ds4_recompute_cfg *r, const ds4_config *c);
/* Priority of a layer for recompute: lower = recomputed first (ds4_pp_priority of the layout of r->pipe;
 * a layout that does not validate counts as one chunk). With one stage and one chunk this is the layer's
 * position; on the uniform split with per_pp_rank, ((L % per_chunk) · vpp + vpp_rank). */
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
