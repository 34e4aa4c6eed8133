/* Training pieces around the model: AdamW, LR schedule, gradient clipping, the router's
 * aux-loss-free bias update, checkpoints, and the FLOP count behind MFU. */
#ifndef DS4_TRAIN_H
#define DS4_TRAIN_H

#include "ds4/dist.h"
#include "ds4/io.h"
#include "ds4/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ AdamW */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
} ds4_adamw_cfg;

typedef struct ds4_offload ds4_offload; /* ds4/offload.h */

/* The rule AdamW applies to a run of elements: a property of the parameter they belong to, so the
 * optimizer keeps one per run of parameters (O(parameters)), never one per element. */
typedef struct {
    int64_t off, n; /* elements [off, off + n) of the flat arrays */
    bool decay;     /* decoupled weight decay applies (not norms, biases, mHC base/scale, sinks, ape) */
    bool frozen;    /* not trained by gradients (router bias): weight and moments left as they are */
    bool muon;      /* a Muon matrix (ds4_param_is_muon): AdamW leaves it to ds4_muon_step */
} ds4_adamw_range;

/* fp32 first and second moments for every float parameter of the model (flat layout): 8 bytes per
 * element, the rules by range. */
typedef struct {
    int64_t n;       /* = ds4_model_numel */
    int64_t step;    /* optimizer steps taken */
    float *m, *v;    /* [n] each, DS4_MEM_OPTIM; NULL while in the offload store */
    ds4_adamw_range *ranges; /* [nranges] DS4_MEM_OTHER: sorted, back to back, covering [0, n) */
    int64_t nranges;
    /* --swap-optimizer: moments that are NULL above live in `store` under these handles */
    ds4_offload *store;
    int64_t h_m, h_v;
    int64_t chunk;   /* elements per update chunk while swapped */
    bool plan;       /* the state of a plan step (ds4_exec): buffers counted, updates touch no values; set
                      * by its owner after init (init clears it) */
    bool muon;       /* the ranges mark the Muon group (ds4_adamw_group_muon; init clears it) */
} ds4_adamw;

ds4_status ds4_adamw_init(ds4_adamw *o, ds4_model *m);
/* State for n elements, all trained without weight decay until ds4_adamw_set_ranges (e.g. an FSDP
 * shard: ds4_fsdp_adamw_ranges). */
ds4_status ds4_adamw_init_n(ds4_adamw *o, int64_t n);
/* The rules of o's elements: r [nr] in any order, disjoint, inside [0, o->n) (copied); elements in no
 * range are trained without weight decay. Fails naming the bad range. */
ds4_status ds4_adamw_set_ranges(ds4_adamw *o, const ds4_adamw_range *r, int64_t nr);
/* The AdamW rules of an FSDP rank's shard (o: [shard_numel]): one range per piece of a float parameter
 * the shard holds, cut at the shard's boundaries, with that parameter's decay / frozen rule (and, when
 * o->muon is set, its Muon mark). */
ds4_status ds4_fsdp_adamw_ranges(const ds4_fsdp *f, ds4_adamw *o);
/* The AdamW update on w [n] with gradients g [n]. Fails only on offload store I/O. */
ds4_status ds4_adamw_step_flat(ds4_adamw *o, float *w, const float *g, const ds4_adamw_cfg *c, double lr);
void ds4_adamw_free(ds4_adamw *o);
/* One decoupled-weight-decay Adam step with learning rate lr on the model's gradients. */
ds4_status ds4_adamw_step(ds4_adamw *o, ds4_model *m, const ds4_adamw_cfg *c, double lr);

/* --swap-optimizer (MindSpeed's name). Between updates the state lives in an offload store; the update
 * streams it through buffers of at most chunk_bytes (0: DS4_ADAMW_SWAP_CHUNK), element by element the
 * same arithmetic as the resident update, so the bits are the same. The store must stay open until
 * ds4_adamw_free. */
#define DS4_ADAMW_SWAP_CHUNK ((size_t)4 << 20)
/* Like ds4_adamw_init_n with m and v created zero in the store (never resident). */
ds4_status ds4_adamw_init_n_swapped(ds4_adamw *o, int64_t n, ds4_offload *store, size_t chunk_bytes);
/* Like ds4_adamw_init with m and v made zero in the store (never resident). */
ds4_status ds4_adamw_init_swapped(ds4_adamw *o, ds4_model *m, ds4_offload *store, size_t chunk_bytes);
/* Moves whatever of m, v is resident into `store` (or o->store if already set; a second
 * store is an error) and frees it. chunk_bytes 0: keep the chunk already set, else the default. */
ds4_status ds4_adamw_swap_out(ds4_adamw *o, ds4_offload *store, size_t chunk_bytes);
/* Brings m and v back into memory, as MindSpeed does around checkpoints: e.g. before gathering a
 * sharded state's moments; ds4_adamw_swap_out(o, NULL, 0) puts them back. A step with the moments
 * brought back is the same update. */
ds4_status ds4_adamw_swap_in(ds4_adamw *o);
/* Elements [i0, i0 + n) of the first (which = 0) or second (which = 1) moment, resident or swapped. */
ds4_status ds4_adamw_moment_read(const ds4_adamw *o, int which, int64_t i0, int64_t n, float *dst);
ds4_status ds4_adamw_moment_write(ds4_adamw *o, int which, int64_t i0, int64_t n, const float *src);
/* The checkpoint's optim.state (safetensors: adamw.m, adamw.v F32 [n], adamw.step I64 [1]), written and
 * read in chunks through the accessors above, whether the state is resident or swapped. */
ds4_status ds4_adamw_state_save(const ds4_adamw *o, const char *path);
ds4_status ds4_adamw_state_load(ds4_adamw *o, const char *path);

/* ------------------------------------------------------------------ Muon (docs/muon.md)
 * Momentum SGD whose update of each weight matrix is orthogonalized by Newton–Schulz iterations, for the
 * matrices ds4_param_is_muon picks; every other float parameter stays on AdamW. The state is one
 * momentum per element of those matrices, kept in the AdamW state's first-moment array over the Muon
 * ranges (ds4_adamw_group_muon), so --swap-optimizer, checkpoints and FSDP shards carry it as they carry
 * the moments; the second moment of those elements stays zero. Per matrix W [A, B] with gradient G:
 *   M := μ·M + G;  U := G + μ·M (nesterov) or M;  O := NS(U);  W := W − lr·wd·W − lr·s·O
 * with s = update_rms·sqrt(max(A, B)) (rms_norm: O's RMS becomes update_rms, AdamW's lr and wd carry
 * over), sqrt(max(1, A/B)) (spectral_norm) or 1 (none). */
typedef enum { DS4_MUON_ADJUST_RMS = 0, DS4_MUON_ADJUST_SPECTRAL, DS4_MUON_ADJUST_NONE } ds4_muon_adjust;
#define DS4_MUON_NS_MAX 100 /* Newton–Schulz iterations at most */
typedef struct {
    double momentum;        /* μ (optimizer.momentum) */
    bool nesterov;          /* optimizer.nesterov */
    int64_t ns_steps;       /* Newton–Schulz iterations in all (optimizer.ns_steps) */
    int64_t ns_final_steps; /* the last ones of them with the settling coefficients (optimizer.ns_final_steps) */
    ds4_muon_adjust adjust; /* optimizer.adjust_lr: "rms_norm" | "spectral_norm" | "none" */
    double update_rms;      /* rms_norm's target RMS (optimizer.update_rms) */
} ds4_muon_cfg;
/* DeepSeek-V4's recipe: μ 0.95, Nesterov, 10 iterations of which the last 2 settle, update RMS 0.18. */
ds4_muon_cfg ds4_muon_defaults(void);
/* The coefficients of iteration i (0-based) of the schedule: (3.4445, −4.7750, 2.0315), the last
 * ns_final_steps (2, −1.5, 0.5). */
ds4_ns_coef ds4_muon_coef(const ds4_muon_cfg *c, int64_t i);
/* s of a matrix [rows, cols] (see above). */
double ds4_muon_scale(const ds4_muon_cfg *c, int64_t rows, int64_t cols);
/* The Muon group: 2-D float matrices trained with weight decay (attention, compressor, indexer, router
 * gate, each routed expert, shared experts, MTP projections), except the embedding, the head and the mHC
 * mappings (hc_*); everything else (norms, biases, sinks, ape, mHC, router bias) is AdamW's. */
bool ds4_param_is_muon(const ds4_param *p);
/* Marks the Muon group in o's ranges (o: the whole model's AdamW state), so AdamW skips those elements. */
ds4_status ds4_adamw_group_muon(ds4_adamw *o, ds4_model *m);
/* One Muon step on the Muon ranges of o (marked) with the model's gradients; wd: AdamW's weight decay. */
ds4_status ds4_muon_step(ds4_adamw *o, ds4_model *m, const ds4_muon_cfg *c, double weight_decay, double lr);
/* The same on an FSDP shard (o [shard_numel], its Muon ranges marked): each matrix gathered whole on its
 * owner rank, orthogonalized there, scattered back (ds4_fsdp_for_each_matrix). A collective; the same
 * bits as ds4_muon_step on the whole model. */
ds4_status ds4_fsdp_muon_step(ds4_fsdp *f, ds4_adamw *o, const ds4_muon_cfg *c, double weight_decay, double lr);
/* Zeroes both moments over the Muon group's elements (whole: m; sharded: f and o [shard_numel]) and
 * returns how many: what a resume does when the checkpoint was written by the other optimizer. */
ds4_status ds4_muon_reset_group(ds4_adamw *o, ds4_model *m, const ds4_fsdp *f, int64_t *elements, int64_t *matrices);

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
    int64_t decay_start; /* lr stays until this step (TorchTitan's decay_ratio); <= warmup_steps: none */
    ds4_decay_kind decay;
} ds4_lr_schedule;
/* step counts from 1: linear warmup to lr over warmup_steps, lr until decay_start, then decay to
 * min_lr at total_steps. */
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
    bool muon;             /* load: optim.state was written by Muon (DS4_CKPT_MUON_MARK); not in state.json */
} ds4_ckpt_meta;

ds4_status ds4_checkpoint_save(const char *root, int64_t keep_latest_k, ds4_model *m, const ds4_adamw *o,
                               const ds4_ckpt_meta *meta);
/* Path of the checkpoint for `step`, or of the latest complete one when step < 0. */
ds4_status ds4_checkpoint_find(const char *root, int64_t step, char *path, size_t n);
/* Loads model weights, optimizer state (o may be NULL) and meta; checks every shape. */
ds4_status ds4_checkpoint_load(const char *path, ds4_model *m, ds4_adamw *o, ds4_ckpt_meta *meta);
/* Saving in pieces, for callers that write the files themselves (a sharded state streaming from its
 * ranks): begin makes the hidden ROOT/.tmp-step-N (path into tmp [n]), the caller writes config.json,
 * model.safetensors and optim.state into it, commit writes state.json and renames it into place. */
ds4_status ds4_checkpoint_begin(const char *root, int64_t step, char *tmp, size_t n);
/* The hidden folder's name, ROOT/.tmp-step-NNNNNNNN, for the ranks that write into it after begin. */
void ds4_checkpoint_tmp_name(const char *root, int64_t step, char *tmp, size_t n);
/* Renames tmp into place, then keep_latest_k removes the oldest (never the step just saved). On failure
 * tmp is removed. */
ds4_status ds4_checkpoint_commit(const char *root, int64_t keep_latest_k, const char *tmp, const ds4_ckpt_meta *meta);
/* Removes the temporary folder of a save that failed (tmp "" or NULL: nothing). */
void ds4_checkpoint_abort(const char *tmp);
/* The checkpoint's config.json describes the same model as `run`: else an error naming the key and both
 * values (a resumed run must not silently change rope_theta, hc_sinkhorn_iters, ...). */
ds4_status ds4_checkpoint_check_config(const char *path, const ds4_config *run);
/* One run per checkpoint folder: creates ROOT (one level) if needed, checks it is writable and takes an
 * exclusive flock on ROOT/.lock, held until ds4_checkpoint_unlock(*fd) (or the process ends). A second
 * run on the same folder gets an error naming the folder. */
ds4_status ds4_checkpoint_lock(const char *root, int *fd);
void ds4_checkpoint_unlock(int fd);
/* Loading in pieces, for callers holding the model in shards (the weights: ds4_model_dir_open(path)):
 * the meta of PATH/state.json, and one AdamW moment of PATH/optim.state ("adamw.m" or "adamw.v", [n] in
 * the packed layout of a whole model) read in ranges straight from the mapped file, with the step. */
ds4_status ds4_checkpoint_load_meta(const char *path, ds4_ckpt_meta *meta);
/* optim.state of a Muon run holds this I64 [1] (the step, like adamw.step): adamw.m then holds the Muon
 * momentum over the Muon group's elements (ds4_param_is_muon), adamw.v zeros there. */
#define DS4_CKPT_MUON_MARK "muon.step"
typedef struct ds4_ckpt_moment ds4_ckpt_moment;
ds4_status ds4_checkpoint_moment_open(const char *path, const char *name, int64_t n, ds4_ckpt_moment **out,
                                      int64_t *step);
/* Elements [off, off + n) into dst (the signature of ds4_packed_read_fn, ds4/dist.h). */
ds4_status ds4_ckpt_moment_read(void *moment, int64_t off, int64_t n, float *dst);
void ds4_ckpt_moment_close(ds4_ckpt_moment *mo);  /* NULL: no-op */

/* ------------------------------------------------------------------ per-rank checkpoints
 * checkpoint.per_rank: every rank of a sharded state writes its own file into the hidden step folder, all
 * at once; rank 0 adds config.json, the index and, once every rank has written, state.json and the rename
 * (the one-writer commit above). ROOT/step-N then holds
 *   shard-RRRRR-of-WWWWW.safetensors  "params", "adamw.m", "adamw.v" F32 [k]: rank R's elements of the packed
 *                                     layout (ds4/dist.h), "adamw.step" I64 [1] (and the Muon mark); shard 0
 *                                     also the integer tables and carried tensors under their names;
 *   shards.json                       for each file, the packed ranges it holds: [packed offset, offset in
 *                                     the file's arrays, length].
 * Any packed range can be read back from the files, so such a checkpoint loads on any world and EP degree
 * and in one process, to the same bits as the one-writer format. src/train/ckpt_shards.c. */
#define DS4_CKPT_INDEX "shards.json"
bool ds4_checkpoint_is_per_rank(const char *path);   /* PATH/shards.json exists */
void ds4_checkpoint_shard_name(char *buf, size_t n, int rank, int world);
typedef struct {
    const float *params, *m, *v; /* [n] this rank's elements, in the order of its ranges */
    int64_t n, step;             /* elements; the optimizer's step */
    bool muon;                   /* written by Muon: the mark goes in too */
    ds4_model *tables;           /* rank 0: the model whose integer tables and carried tensors go in; else NULL */
} ds4_ckpt_shard_data;
/* tmp/shard-RRRRR-of-WWWWW.safetensors, written atomically. */
ds4_status ds4_checkpoint_write_shard(const char *tmp, int rank, int world, const ds4_ckpt_shard_data *d);
/* tmp/shards.json: rank r's file holds sizes[2r] ranges in arrays of sizes[2r + 1] elements (a shard also
 * holds region padding); the ranges of all files back to back in ranges [sum sizes[2r]][3]. */
ds4_status ds4_checkpoint_write_index(const char *tmp, int world, int64_t packed_numel, const int64_t *sizes,
                                      const int64_t *ranges);
/* Reading: opens every file the index names and checks that their ranges tile [0, packed_numel) exactly and
 * that each array has the length the index gives it (errors name the file); packed_numel < 0: the index's. */
typedef struct ds4_ckpt_shards ds4_ckpt_shards;
typedef enum { DS4_CKPT_PARAMS = 0, DS4_CKPT_ADAMW_M = 1, DS4_CKPT_ADAMW_V = 2 } ds4_ckpt_array;
ds4_status ds4_ckpt_shards_open(const char *path, int64_t packed_numel, ds4_ckpt_shards **out);
void ds4_ckpt_shards_close(ds4_ckpt_shards *s);           /* NULL: no-op */
int64_t ds4_ckpt_shards_step(const ds4_ckpt_shards *s);   /* adamw.step */
bool ds4_ckpt_shards_muon(const ds4_ckpt_shards *s);      /* the Muon mark is there */
const char *ds4_ckpt_shards_first_file(const ds4_ckpt_shards *s);
/* What the index describes (ds4 inspect): its files, their array lengths, and its non-empty ranges sorted by
 * packed offset; they tile [0, packed_numel). */
typedef struct {
    int file;               /* index into the files */
    int64_t poff, foff, len; /* packed [poff, poff + len) = the file's arrays [foff, foff + len) */
} ds4_ckpt_range;
int ds4_ckpt_shards_nfiles(const ds4_ckpt_shards *s);
const ds4_st_file *ds4_ckpt_shards_file(const ds4_ckpt_shards *s, int i);
int64_t ds4_ckpt_shards_elements(const ds4_ckpt_shards *s, int i);
int64_t ds4_ckpt_shards_packed_numel(const ds4_ckpt_shards *s);
int64_t ds4_ckpt_shards_nranges(const ds4_ckpt_shards *s);
ds4_ckpt_range ds4_ckpt_shards_range(const ds4_ckpt_shards *s, int64_t i);
/* The array ds4_ckpt_shards_read serves from now on (PARAMS at open). */
void ds4_ckpt_shards_select(ds4_ckpt_shards *s, ds4_ckpt_array which);
/* Packed elements [off, off + n) of the selected array into dst (a ds4_packed_read_fn). */
ds4_status ds4_ckpt_shards_read(void *ctx, int64_t off, int64_t n, float *dst);
/* The integer tables and carried tensors of m (whole or unmapped), from the first file. */
ds4_status ds4_ckpt_shards_load_tables(const ds4_ckpt_shards *s, ds4_model *m);
/* The weights of a checkpoint of either format into a whole model (eval, generate, export). */
ds4_status ds4_checkpoint_load_model(const char *path, ds4_model *m);

#ifdef __cplusplus
}
#endif
#endif
