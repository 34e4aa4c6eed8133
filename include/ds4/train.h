/* Training pieces around the model: the optimizers (AdamW, Muon), LR schedule, gradient clipping, the router's
 * aux-loss-free bias update, checkpoints, and the FLOP count behind MFU. */
#ifndef DS4_TRAIN_H
#define DS4_TRAIN_H

#include "ds4/dist.h"
#include "ds4/io.h"
#include "ds4/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ optimizers
 * A socket (docs/DESIGN.md "Optimizers are entries of a socket"): `optimizer.name` picks an entry of the
 * registry (optim.c). An entry trains the float parameters its `takes` picks with its own rule and every
 * other one with AdamW; the AdamW entry picks none. Each rule owns its state: AdamW the moments m and v of
 * its elements (8 bytes each), Muon the momentum of its matrices' (4 bytes each). */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
} ds4_adamw_cfg;

typedef struct ds4_offload ds4_offload; /* ds4/offload.h */
typedef struct ds4_optim ds4_optim;

/* The two groups of a state: the elements AdamW trains (also the frozen ones, whose state stays as it is,
 * and region padding) and those of the entry's own rule (empty for AdamW). */
enum { DS4_OPT_ADAMW = 0, DS4_OPT_OWN = 1, DS4_OPT_NGROUPS = 2 };
#define DS4_OPT_ARRAYS_MAX 2 /* fp32 state arrays of one group at most */

/* The rule of a run of elements: a property of the parameter they belong to, so the optimizer keeps one
 * per run of parameters (O(parameters)), never one per element. */
typedef struct {
    int64_t off, n; /* elements [off, off + n) of the flat arrays (weights, gradients) */
    bool decay;     /* decoupled weight decay applies (not norms, biases, mHC base/scale, sinks, ape) */
    bool frozen;    /* not trained by gradients (router bias): weight and state left as they are */
    bool own;       /* trained by the entry's own rule (group DS4_OPT_OWN), else by AdamW */
    bool absent;    /* not this state's (a pipeline rank's other stages, region padding): no state, no update */
} ds4_opt_run;

/* What an entry's update runs on: the whole model (f NULL) or this rank's FSDP shard (m unmapped). */
typedef struct {
    ds4_model *m;
    ds4_fsdp *f;
} ds4_opt_target;

/* An entry of the socket. Adding an optimizer is one file defining its entry (muon.c is the example) and
 * one line in the registry of optim.c. */
typedef struct {
    const char *name;                  /* optimizer.name, matched in any case */
    bool (*takes)(const ds4_param *p); /* the parameters of its own rule; NULL: none (AdamW alone) */
    int nstate;                        /* fp32 arrays per element of its group: 4·nstate bytes, all the state
                                        * memplan counts for it between steps (its step's buffers are counted
                                        * by running the step in plan mode) */
    const char *const *state_names;    /* [nstate]: the arrays' tensors in optim.state */
    const char *mark;                  /* an I64 [1] tensor saying optim.state was written by it; NULL: AdamW */
    /* The update of its group (o->g[DS4_OPT_OWN] for Muon, o->g[DS4_OPT_ADAMW] for AdamW) with its own
     * settings cfg (AdamW: ds4_adamw_cfg, Muon: ds4_muon_cfg), AdamW's weight decay and lr. */
    ds4_status (*step)(ds4_optim *o, const ds4_opt_target *t, const void *cfg, double weight_decay, double lr);
} ds4_optimizer;
extern const ds4_optimizer ds4_optimizer_adamw, ds4_optimizer_muon;
/* The entry named `name` (any case), else an error naming the key optimizer.name and every known name. */
ds4_status ds4_optimizer_find(const char *name, const ds4_optimizer **out);
const ds4_optimizer *ds4_optimizer_at(int i); /* the registry in order; NULL past its end */
/* The entry's rule for p: true when its own rule takes p (never an integer table or a frozen tensor). */
bool ds4_optimizer_takes(const ds4_optimizer *opt, const ds4_param *p);

/* One group's state: k arrays of n fp32 values (the group's elements in run order), resident (mem,
 * DS4_MEM_OPTIM) or in the offload store (handles h; -1: none, when n is 0). */
typedef struct {
    int64_t n;
    int k;
    const char *const *names; /* [k] their tensor names */
    float *mem[DS4_OPT_ARRAYS_MAX];
    int64_t h[DS4_OPT_ARRAYS_MAX];
} ds4_opt_group;

/* The state of an optimizer over n flat elements (a whole model or an FSDP shard). */
struct ds4_optim {
    const ds4_optimizer *opt; /* the entry (AdamW or Muon) */
    int64_t n;                /* = ds4_model_numel, or the shard's ds4_fsdp_shard_numel */
    int64_t step;             /* optimizer steps taken */
    ds4_opt_run *runs;        /* [nruns] DS4_MEM_OTHER: sorted, back to back, covering [0, n) */
    int64_t nruns;
    /* With an own group (else NULL: AdamW's group is every run, each at its flat offset): */
    int64_t *soff;                  /* [nruns] where each run's first element sits in its group's arrays */
    int64_t *grun[DS4_OPT_NGROUPS]; /* [ngrun[g]] the runs of each group, in order (their soff ascend) */
    int64_t ngrun[DS4_OPT_NGROUPS];
    ds4_opt_group g[DS4_OPT_NGROUPS];
    /* --swap-optimizer: the arrays live in `store` between updates (swapped) */
    ds4_offload *store;
    bool swapped;
    int64_t chunk;            /* AdamW elements per update chunk while swapped */
    ds4_exec exec;            /* the context the state lives in (the model's): its arrays are that backend's
                               * buffers, its updates that backend's ops; a plan's are counted, not computed */
};

/* The state of entry opt (NULL: AdamW) for a whole model, in the model's context: zero, resident, or in
 * `store` (never resident) with update chunks of chunk_bytes (0: DS4_ADAMW_SWAP_CHUNK). The store must stay
 * open until free. Of an unmapped model holding groups (a pipeline stage, ds4_model_hold): the parameters
 * whose gradients it holds only, everything else (other groups, region padding) absent. */
ds4_status ds4_optim_init(ds4_optim *o, const ds4_optimizer *opt, ds4_model *m, ds4_offload *store, size_t chunk_bytes);
/* The same for n elements under the rules r [nr] (any order, disjoint, inside [0, n); copied, soff
 * ignored), in context ex (NULL: real, on the cpu); elements in no range are trained by AdamW without
 * weight decay. Fails naming a bad range. */
ds4_status ds4_optim_init_runs(ds4_optim *o, const ds4_exec *ex, const ds4_optimizer *opt, int64_t n,
                               const ds4_opt_run *r, int64_t nr, ds4_offload *store, size_t chunk_bytes);
/* The same for an FSDP rank's shard: one run per piece of a float parameter the shard holds, cut at the
 * shard's boundaries, with that parameter's rules. */
ds4_status ds4_optim_init_shard(ds4_optim *o, const ds4_optimizer *opt, const ds4_fsdp *f, ds4_offload *store,
                                size_t chunk_bytes);
void ds4_optim_free(ds4_optim *o);
/* The AdamW update of the AdamW group on w [n] with gradients g [n]; counts the step. Fails only on
 * offload store I/O. */
ds4_status ds4_adamw_step_flat(ds4_optim *o, float *w, const float *g, const ds4_adamw_cfg *c, double lr);
ds4_status ds4_adamw_step(ds4_optim *o, ds4_model *m, const ds4_adamw_cfg *c, double lr);
/* The entry's own update of its group (a no-op for AdamW); cfg: its settings (Muon: ds4_muon_cfg). */
ds4_status ds4_optim_own_step(ds4_optim *o, const ds4_opt_target *t, const void *cfg, double weight_decay, double lr);

/* --swap-optimizer (MindSpeed's name). Between updates the arrays live in an offload store; the AdamW
 * update streams them through buffers of at most chunk_bytes, Muon a matrix's piece at a time, element by
 * element the same arithmetic as the resident update, so the bits are the same. */
#define DS4_ADAMW_SWAP_CHUNK ((size_t)4 << 20)
/* Moves the resident arrays into `store` (or o->store if already set; a second store is an error) and
 * frees them. chunk_bytes 0: keep the chunk already set, else the default. */
ds4_status ds4_optim_swap_out(ds4_optim *o, ds4_offload *store, size_t chunk_bytes);
/* Brings the arrays back into memory, as MindSpeed does around checkpoints; ds4_optim_swap_out(o, NULL, 0)
 * puts them back. A step with the arrays brought back is the same update. */
ds4_status ds4_optim_swap_in(ds4_optim *o);
/* Elements [i0, i0 + n) of array a of group grp, resident or swapped. */
ds4_status ds4_optim_read(const ds4_optim *o, int grp, int a, int64_t i0, int64_t n, float *dst);
ds4_status ds4_optim_write(ds4_optim *o, int grp, int a, int64_t i0, int64_t n, const float *src);
/* The same into / from a buffer of the optimizer's backend (its exec): what an update step works on. */
ds4_status ds4_optim_read_dev(const ds4_optim *o, int grp, int a, int64_t i0, int64_t n, float *dst);
ds4_status ds4_optim_write_dev(ds4_optim *o, int grp, int a, int64_t i0, int64_t n, const float *src);
/* The group of flat element i (the run holding it) and its offset in that group's arrays. */
int ds4_optim_locate(const ds4_optim *o, int64_t i, int64_t *j);
/* Whether flat element i has state here (not in an absent run). */
bool ds4_optim_holds(const ds4_optim *o, int64_t i);
/* Array a of group grp in the flat layout: out [o->n], the group's values at their flat offsets and 0
 * elsewhere (a shard's arrays in the shape FSDP and the per-rank files handle). */
ds4_status ds4_optim_expand(const ds4_optim *o, int grp, int a, float *out);
/* The whole model's optim.state (adamw.step, the entry's mark, then each group's arrays over its elements,
 * F32 [group n]), written from memory or streamed from the store a chunk at a time. */
ds4_status ds4_optim_state_save(const ds4_optim *o, const char *path);

/* ------------------------------------------------------------------ Muon (docs/muon.md)
 * Momentum SGD whose update of each weight matrix is orthogonalized by Newton–Schulz iterations, for the
 * matrices ds4_param_is_muon picks (the entry ds4_optimizer_muon, muon.c); every other float parameter
 * stays on AdamW. Its state is one momentum per element of those matrices (muon.momentum, 4 bytes). Per
 * matrix W [A, B] with gradient G:
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
/* One Muon step on the Muon group of o (a state of ds4_optimizer_muon) with the model's gradients; wd:
 * AdamW's weight decay. */
ds4_status ds4_muon_step(ds4_optim *o, ds4_model *m, const ds4_muon_cfg *c, double weight_decay, double lr);
/* The same on an FSDP shard (o: ds4_optim_init_shard): each matrix gathered whole on its owner rank,
 * orthogonalized there, scattered back (ds4_fsdp_for_each_matrix). A collective; the same bits as
 * ds4_muon_step on the whole model. */
ds4_status ds4_fsdp_muon_step(ds4_fsdp *f, ds4_optim *o, const ds4_muon_cfg *c, double weight_decay, double lr);

/* Global L2 norm of the gradients, the squares summed exactly (ds4_sumsq_exact, on the model's backend) and
 * rounded once, so one process, FSDP's shards and a pipeline's stages give the same bits; if max_norm > 0
 * and the norm exceeds it, scales gradients by max_norm / norm. *norm: the norm before clipping; NaN when a
 * gradient is not finite. Fails only out of memory. */
ds4_status ds4_clip_grad_norm(ds4_model *m, double max_norm, double *norm);
/* The same over the gradients m holds (a pipeline stage: its held groups', ds4_model_hold; a whole model: all),
 * the exact sums' limbs added over pipe (NULL: none) as integers, so the ranks of a pipeline get one
 * process's norm and each scales its own gradients. */
ds4_status ds4_clip_grad_norm_over(ds4_model *m, ds4_comm *pipe, double max_norm, double *norm);
/* g *= s over the gradients m holds (all of a whole model's). */
void ds4_model_scale_held_grads(ds4_model *m, float s);

/* Aux-loss-free balancing (noaux_tc): for each score-routed layer, b_e += γ·sign(mean_load − load_e).
 * loads: [n_blocks, E] token counts of the step (all micro-batches). */
ds4_status ds4_router_bias_update(ds4_model *m, const int64_t *loads, double gamma);

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
 * Hugging Face model directory, F32), optim.state (safetensors layout: the optimizer's arrays and step) and state.json
 * (step, seed, data-loader state). It is written under a temporary name, every file fsynced, then
 * renamed into place: a crash leaves either the old set of checkpoints or the new one. */
typedef struct {
    int64_t step;
    uint64_t seed;
    char data_state[1024]; /* the data loader's state, as text */
    const ds4_optimizer *optimizer; /* load: the entry that wrote optim.state (its mark; none: AdamW); not in
                                     * state.json */
} ds4_ckpt_meta;

ds4_status ds4_checkpoint_save(const char *root, int64_t keep_latest_k, ds4_model *m, const ds4_optim *o,
                               const ds4_ckpt_meta *meta);
/* Path of the checkpoint for `step`, or of the latest complete one when step < 0. */
ds4_status ds4_checkpoint_find(const char *root, int64_t step, char *path, size_t n);
/* Loads model weights, optimizer state (o may be NULL; ds4_checkpoint_load_optim) and meta; checks every
 * shape. */
ds4_status ds4_checkpoint_load(const char *path, ds4_model *m, ds4_optim *o, ds4_ckpt_meta *meta);
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
 * the meta of PATH/state.json (and which entry wrote optim.state). */
ds4_status ds4_checkpoint_load_meta(const char *path, ds4_ckpt_meta *meta);
/* The optimizer state of the checkpoint at PATH, of either format, into o: the state of m (whole: f NULL)
 * or of f's shard, and the step. writer: the entry that wrote it (meta->optimizer). Each element's state
 * is read when the writer trained its parameter by the same rule, and is zero when it did not (a change
 * of optimizer at a resume; *switched: how many of o's elements, may be NULL). Reads each group's arrays
 * by name, over every packed element or over its group's elements only (optim.state of ds4_optim_state_save
 * and of a sharded save), or, from a checkpoint of ds4 before Muon owned its state (Muon's mark without
 * muon.momentum), the momentum from adamw.m. */
ds4_status ds4_checkpoint_load_optim(const char *path, ds4_optim *o, ds4_model *m, const ds4_fsdp *f,
                                     const ds4_optimizer *writer, int64_t *switched);
/* The same from one optim.state file (PATH is the file). */
ds4_status ds4_optim_state_load(ds4_optim *o, ds4_model *m, const ds4_fsdp *f, const ds4_optimizer *writer,
                                const char *path, int64_t *switched);

/* ------------------------------------------------------------------ per-rank checkpoints
 * checkpoint.per_rank: every rank of a sharded state writes its own file into the hidden step folder, all
 * at once; rank 0 adds config.json, the index and, once every rank has written, state.json and the rename
 * (the one-writer commit above). ROOT/step-N then holds
 *   shard-RRRRR-of-WWWWW.safetensors  "params" F32 [k]: rank R's elements of the packed layout (ds4/dist.h);
 *                                     the optimizer's arrays ("adamw.m", "adamw.v", Muon's "muon.momentum")
 *                                     F32, each over its group's elements of those k alone, in their order
 *                                     (AdamW alone: [k]); "adamw.step" I64 [1] (and the optimizer's mark);
 *                                     shard 0 also the integer tables and carried tensors under their names;
 *   shards.json                       for each file, the packed ranges it holds: [packed offset, offset in
 *                                     the file's arrays, length].
 * Any packed range can be read back from the files, so such a checkpoint loads on any world and EP degree
 * and in one process, to the same bits as the one-writer format. src/train/ckpt_shards.c. */
#define DS4_CKPT_INDEX "shards.json"
bool ds4_checkpoint_is_per_rank(const char *path);   /* PATH/shards.json exists */
void ds4_checkpoint_shard_name(char *buf, size_t n, int rank, int world);
#define DS4_CKPT_ARRAYS_MAX 4
typedef struct {
    const float *params;         /* [n] this rank's elements, in the order of its ranges */
    int64_t n, step;             /* elements; the optimizer's step */
    const char *mark;            /* the optimizer's mark (ds4_optimizer.mark), NULL: none */
    int narrays;                 /* the optimizer's arrays: [lens[a]] each, its group's elements in the params' order */
    const char *names[DS4_CKPT_ARRAYS_MAX];
    const float *arrays[DS4_CKPT_ARRAYS_MAX];
    int64_t lens[DS4_CKPT_ARRAYS_MAX];
    ds4_model *tables;           /* rank 0: the model whose integer tables and carried tensors go in; else NULL */
} ds4_ckpt_shard_data;
/* tmp/shard-RRRRR-of-WWWWW.safetensors, written atomically. */
ds4_status ds4_checkpoint_write_shard(const char *tmp, int rank, int world, const ds4_ckpt_shard_data *d);
/* tmp/shards.json: rank r's file holds sizes[2r] ranges in arrays of sizes[2r + 1] elements (a shard also
 * holds region padding); the ranges of all files back to back in ranges [sum sizes[2r]][3]. */
ds4_status ds4_checkpoint_write_index(const char *tmp, int world, int64_t packed_numel, const int64_t *sizes,
                                      const int64_t *ranges);
/* Reading: opens every file the index names and checks that their ranges tile [0, packed_numel) exactly and
 * that "params" has the length the index gives it, the optimizer's arrays at most that (errors name the
 * file); packed_numel < 0: the index's. */
typedef struct ds4_ckpt_shards ds4_ckpt_shards;
typedef enum { DS4_CKPT_PARAMS = 0, DS4_CKPT_ADAMW_M = 1, DS4_CKPT_ADAMW_V = 2 } ds4_ckpt_array; /* in every file */
ds4_status ds4_ckpt_shards_open(const char *path, int64_t packed_numel, ds4_ckpt_shards **out);
void ds4_ckpt_shards_close(ds4_ckpt_shards *s);           /* NULL: no-op */
int64_t ds4_ckpt_shards_step(const ds4_ckpt_shards *s);   /* adamw.step */
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
/* The array ds4_ckpt_shards_read serves from now on (PARAMS at open); by name also an optional one
 * ("muon.momentum"), an error naming the file that lacks it. */
void ds4_ckpt_shards_select(ds4_ckpt_shards *s, ds4_ckpt_array which);
ds4_status ds4_ckpt_shards_select_name(ds4_ckpt_shards *s, const char *name);
bool ds4_ckpt_shards_has(const ds4_ckpt_shards *s, const char *name); /* the array is in the files */
/* Packed elements [off, off + n) of the selected array into dst (a ds4_packed_read_fn); an array over one
 * group's elements is read by ds4_checkpoint_load_optim, which knows the groups. */
ds4_status ds4_ckpt_shards_read(void *ctx, int64_t off, int64_t n, float *dst);
/* The integer tables and carried tensors of m (whole or unmapped), from the first file. */
ds4_status ds4_ckpt_shards_load_tables(const ds4_ckpt_shards *s, ds4_model *m);
/* The weights of a checkpoint of either format into a whole model (eval, generate, export). */
ds4_status ds4_checkpoint_load_model(const char *path, ds4_model *m);

#ifdef __cplusplus
}
#endif
#endif
