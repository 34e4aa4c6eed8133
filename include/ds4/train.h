/* Training pieces around the model: AdamW, LR schedule, gradient clipping, the router's
 * aux-loss-free bias update, checkpoints, and the FLOP count behind MFU. */
#ifndef DS4_TRAIN_H
#define DS4_TRAIN_H

#include "ds4/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ AdamW */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
} ds4_adamw_cfg;

/* fp32 first and second moments for every float parameter of the model (flat layout). */
typedef struct {
    int64_t n;       /* = ds4_model_numel */
    int64_t step;    /* optimizer steps taken */
    float *m, *v;    /* [n] each, DS4_MEM_OPTIM */
    uint8_t *decay;  /* [n] 1 where weight decay applies, 0 for norms, biases, mHC base/scale, sinks, ape */
    uint8_t *frozen; /* [n] 1 for parameters not trained by gradients (router bias) */
} ds4_adamw;

ds4_status ds4_adamw_init(ds4_adamw *o, ds4_model *m);
/* State for n elements with zero masks (the caller fills decay / frozen, e.g. for an FSDP shard). */
ds4_status ds4_adamw_init_n(ds4_adamw *o, int64_t n);
/* The AdamW update on w [n] with gradients g [n]. */
void ds4_adamw_step_flat(ds4_adamw *o, float *w, const float *g, const ds4_adamw_cfg *c, double lr);
void ds4_adamw_free(ds4_adamw *o);
/* One decoupled-weight-decay Adam step with learning rate lr on the model's gradients. */
void ds4_adamw_step(ds4_adamw *o, ds4_model *m, const ds4_adamw_cfg *c, double lr);

/* Global L2 norm of the gradients (fp64 accumulation, fixed order); if max_norm > 0 and the norm
 * exceeds it, scales gradients by max_norm / norm. Returns the norm before clipping. */
double ds4_clip_grad_norm(ds4_model *m, double max_norm);

/* Aux-loss-free balancing (noaux_tc): for each score-routed layer, b_e += γ·sign(mean_load − load_e).
 * loads: [n_blocks, E] token counts of the step (all micro-batches). */
void ds4_router_bias_update(ds4_model *m, const int64_t *loads, double gamma);

/* ------------------------------------------------------------------ LR schedule */
typedef enum { DS4_DECAY_COSINE = 0, DS4_DECAY_LINEAR, DS4_DECAY_NONE } ds4_decay_kind;
typedef struct {
    double lr, min_lr;
    int64_t warmup_steps, total_steps;
    ds4_decay_kind decay;
} ds4_lr_schedule;
/* step counts from 1: linear warmup to lr over warmup_steps, then decay to min_lr at total_steps. */
double ds4_lr_at(const ds4_lr_schedule *s, int64_t step);

/* ------------------------------------------------------------------ FLOPs */
/* Training FLOPs per token (forward + backward = 3× forward matmul FLOPs), counting the sparse work
 * actually done at sequence length T: window + selected compressed attention, the indexer, the
 * compressors, MoE with the top-k routed experts + shared expert, MTP, head. */
double ds4_train_flops_per_token(const ds4_config *c, int64_t T);

/* ------------------------------------------------------------------ checkpoints */
/* A checkpoint is a directory ROOT/step-NNNNNNNN holding config.json + model.safetensors (a loadable
 * Hugging Face model directory, F32), optim.state (safetensors layout: AdamW moments and step) and state.json
 * (step, seed, data-loader state). It is written under a temporary name, every file fsynced, then
 * renamed into place: a crash leaves either the old set of checkpoints or the new one. */
typedef struct {
    int64_t step;
    uint64_t seed;
    char data_state[1024]; /* the data loader's state, as text */
} ds4_ckpt_meta;

ds4_status ds4_checkpoint_save(const char *root, int64_t keep_latest_k, ds4_model *m, const ds4_adamw *o,
                               const ds4_ckpt_meta *meta);
/* Path of the checkpoint for `step`, or of the latest complete one when step < 0. */
ds4_status ds4_checkpoint_find(const char *root, int64_t step, char *path, size_t n);
/* Loads model weights, optimizer state (o may be NULL) and meta; checks every shape. */
ds4_status ds4_checkpoint_load(const char *path, ds4_model *m, ds4_adamw *o, ds4_ckpt_meta *meta);

#ifdef __cplusplus
}
#endif
#endif
