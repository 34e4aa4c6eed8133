/* Pipeline layout: which pipeline (PP) rank and virtual chunk (VPP) holds which decoder layers, the
 * embedding, the MTP layers and the head with the loss (docs/pipeline.md). Either Megatron's
 * pipeline_model_parallel_layout string or the uniform split of pp x vpp chunks; parsed and checked in
 * this one place. The layout feeds the recompute priority (ds4/recompute.h), ds4 memplan's stage table,
 * the checks of ds4 train and the executors of the schedules (ds4/pp_schedule.h), which ds4 train runs
 * with world = pp.
 *
 * Grammar (Megatron's PipelineParallelLayerLayout.parse_str_to_list):
 *   E embedding, t decoder layer, m MTP layer, L loss (the head); '|' ends a chunk (an empty chunk is
 *   allowed); ',' is cosmetic and dropped; "(...)*N" repeats a group (no nesting), then "x*N" repeats the
 *   character before it (N >= 0, "t*0" is nothing). Chunks are listed in forward order, VPP-major: chunk
 *   k of the list is pp rank k % pp, virtual chunk k / pp. Examples: "Et*3|(tt|)*29,m|L",
 *   "Et*11|t*12|t*12|t*8mL" (pp 2: vpp 2). */
#ifndef DS4_PIPELINE_H
#define DS4_PIPELINE_H

#include "ds4/config.h"
#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_PP_MAX_CHUNKS 512
#define DS4_PP_LAYOUT_MAX 1024 /* bytes of a layout string, its terminating zero included */

/* The run's pipeline options: parallel.pp / --pp / --pipeline-model-parallel-size, parallel.vpp / --vpp,
 * parallel.num_layers_per_virtual_pipeline_stage / --num-layers-per-virtual-pipeline-stage, parallel.layout /
 * --pipeline-model-parallel-layout / --layout. */
typedef struct {
    int64_t pp;                     /* stages (>= 1) */
    int64_t vpp;                    /* virtual chunks per stage; 0: derived (from the layout, or 1) */
    int64_t layers_per_vstage;      /* decoder layers per virtual chunk; 0: unset */
    char layout[DS4_PP_LAYOUT_MAX]; /* "" : the uniform split */
} ds4_pp_cfg;

void ds4_pp_cfg_defaults(ds4_pp_cfg *p);

/* One chunk: what it runs, in this order: the embedding, decoder layers [layer_begin, layer_end), the MTP
 * layers, the head and the loss. */
typedef struct {
    int64_t layer_begin, layer_end;
    int64_t n_mtp;
    bool embedding, loss;
} ds4_pp_chunk;

typedef struct {
    int64_t pp, vpp;
    int64_t n_layers, n_mtp;
    ds4_pp_chunk chunk[DS4_PP_MAX_CHUNKS]; /* [vpp · pp], index vpp_rank · pp + pp_rank (forward order) */
} ds4_pp_layout;

/* The layout of cfg for a model of n_layers decoder layers and n_mtp MTP layers: the string's, or the
 * uniform split (the embedding on the first chunk, MTP and the loss on the last). Every problem is one
 * error naming it: an illegal character, a chunk count that is not pp · vpp, layer counts that do not add
 * up to the model's, the embedding not first, the loss or MTP not on the last chunk, a decoder layer after
 * an MTP layer, layers that do not split evenly. */
ds4_status ds4_pp_layout_make(const ds4_pp_cfg *cfg, int64_t n_layers, int64_t n_mtp, ds4_pp_layout *out);
/* The chunk (pp_rank, vpp_rank); fails naming the rank out of range. */
ds4_status ds4_pp_chunk_at(const ds4_pp_layout *L, int64_t pp_rank, int64_t vpp_rank, const ds4_pp_chunk **out);
/* Where decoder layer `layer` (0-based) runs: its pp rank, virtual chunk and position in the chunk. */
ds4_status ds4_pp_locate(const ds4_pp_layout *L, int64_t layer, int64_t *pp_rank, int64_t *vpp_rank, int64_t *local);
/* The recompute priority of decoder layer `layer` (lower: recomputed first), MindSpeed's
 * get_recompute_priority: its position in its chunk; with per_pp_rank
 * (--enable-recompute-layers-per-pp-rank) its position when the chunks of its pp rank are interleaved
 * by depth (every chunk's position 0 first, in chunk order, then every chunk's position 1, ...; a chunk
 * too short for a depth is skipped). Fails for a layer outside [0, n_layers). */
ds4_status ds4_pp_priority(const ds4_pp_layout *L, int64_t layer, bool per_pp_rank, int64_t *out);
/* As ds4_pp_priority, but checking that the layer runs on (pp_rank, vpp_rank): fails naming the rank
 * out of range or the chunk the layer is not on. */
ds4_status ds4_pp_priority_on(const ds4_pp_layout *L, int64_t pp_rank, int64_t vpp_rank, int64_t layer,
                              bool per_pp_rank, int64_t *out);

#ifdef __cplusplus
}
#endif
#endif
