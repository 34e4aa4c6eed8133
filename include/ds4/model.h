/* The DeepSeek-V4 model: parameter table with the official tensor names, initialisation, load/save,
 * and one forward + backward pass producing the contract's losses and gradients.
 *
 * The model knows nothing about parallelism, offload or recompute policy: those wrap it. */
#ifndef DS4_MODEL_H
#define DS4_MODEL_H

#include "ds4/config.h"
#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_model_dir ds4_model_dir;

/* One named tensor of the model. Float parameters live in one contiguous fp32 buffer (data) with a
 * matching gradient buffer (grad); integer tables (tid2eid) are kept as int64 (idata) and have no
 * gradient. */
typedef struct {
    char name[112];
    int ndim;
    int64_t shape[3];
    int64_t numel;
    bool is_int;        /* tid2eid */
    bool no_decay;      /* norms, biases, mHC base/scale, sinks, ape: no weight decay */
    bool no_grad;       /* router bias: updated by the load-balancing rule, not by gradients */
    float *data;        /* fp32 value (NULL when is_int) */
    float *grad;        /* fp32 gradient (NULL when is_int) */
    int64_t *idata;     /* int table (NULL unless is_int) */
} ds4_param;

typedef struct ds4_model ds4_model;

ds4_status ds4_model_create(const ds4_config *cfg, ds4_model **out);  /* params zero */
void ds4_model_free(ds4_model *m);
const ds4_config *ds4_model_config(const ds4_model *m);
int64_t ds4_model_nparams(const ds4_model *m);                          /* number of named tensors */
ds4_param *ds4_model_param(ds4_model *m, int64_t i);
ds4_param *ds4_model_find(ds4_model *m, const char *name);
int64_t ds4_model_numel(const ds4_model *m);                            /* float elements in total */
float *ds4_model_params_flat(ds4_model *m);                              /* [numel] */
float *ds4_model_grads_flat(ds4_model *m);                               /* [numel] */
void ds4_model_zero_grad(ds4_model *m);

/* docs/contract.md init rules, every value a function of (seed, tensor name, index). */
void ds4_model_init_random(ds4_model *m, uint64_t seed);
/* Loads every tensor by its official name; each must exist with the right shape. */
ds4_status ds4_model_load(ds4_model *m, const ds4_model_dir *d);
/* Writes DIR/config.json + DIR/model.safetensors (F32 or BF16 floats; tid2eid I64). */
ds4_status ds4_model_save(ds4_model *m, const char *dir, ds4_dtype float_dtype);

/* ------------------------------------------------------------------ one pass */
typedef struct {
    double loss, mtp_loss, indexer_loss, total_loss;
} ds4_losses;

typedef struct {
    bool need_backward;     /* false: forward only (eval); no activations kept beyond use */
    bool keep_logits;       /* keep logits / mtp_logits for the caller (debug-state) */
    bool csa_dense;         /* attend all usable compressed entries on CSA layers */
    /* Recompute: per main layer, a bit mask of units (ds4_unit_names order) whose outputs are released
     * after their last forward read and replayed in backward. NULL: keep everything. The policy that
     * chooses the masks lives outside the model (src/memory/recompute.c). */
    const uint32_t *release_mask;
} ds4_pass_opts;

typedef struct ds4_pass ds4_pass;

/* Forward of input_ids [B, T] (int32, each < vocab). The indexer loss of a training pass is computed
 * in backward from the saved log-sum-exp; for a forward-only pass it is computed in forward. */
ds4_status ds4_forward(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, const ds4_pass_opts *opts,
                       ds4_pass **out);
/* Backward of total_loss; ACCUMULATES into the model's gradients; fills the final losses. */
ds4_status ds4_backward(ds4_model *m, ds4_pass *p);
const ds4_losses *ds4_pass_losses(const ds4_pass *p);
const float *ds4_pass_logits(const ds4_pass *p);       /* [B, T, V] if keep_logits */
const float *ds4_pass_mtp_logits(const ds4_pass *p);   /* [B, T, V] if keep_logits and MTP */
const int32_t *ds4_pass_topk(const ds4_pass *p, int64_t layer); /* [B, T, index_topk] or NULL */
/* Per-expert token counts of each MoE layer in the pass ([n_layers + n_mtp][E]), for load balancing. */
const int64_t *ds4_pass_expert_load(const ds4_pass *p, int64_t layer);
void ds4_pass_free(ds4_pass *p);

/* ------------------------------------------------------------------ units (for policies and reports) */
#define DS4_NUM_UNITS 16
const char *ds4_unit_name(int unit);  /* "hc_pre_attn", "attn_norm", ..., "hc_post_ffn" */
int ds4_unit_find(const char *name);  /* -1 if unknown */
typedef struct {
    int64_t bytes;          /* bytes of the unit's outputs (one copy) in this pass */
    int64_t released;       /* releases after forward */
    int64_t replays;        /* replays for backward */
    double replay_seconds;
} ds4_unit_report;
/* Per (block, unit) figures of a pass; valid after forward (released) and after backward (replays). */
ds4_unit_report ds4_pass_unit_report(const ds4_pass *p, int64_t layer, int unit);

#ifdef __cplusplus
}
#endif
#endif
