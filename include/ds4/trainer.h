/* `ds4 train`: the training loop, configured by a TOML file in the TorchTitan manner
 * ([model], [training], [optimizer], [lr_scheduler], [data], [checkpoint], [metrics], [parallel]) with
 * `--section.key value` overrides and the MindSpeed recompute flags.
 *
 * Under `mpirun -np W` the loop runs FSDP + expert parallelism (ds4/dist.h) with TorchTitan's meaning
 * of the batch: training.global_batch_size rows per step over all ranks, each rank running
 * global_batch / (micro_batch_size · W) micro-batches. The data loader's order is the one of a single
 * process; of every W consecutive micro-batches of it, rank r takes the r-th (ds4/data.h dp_rank). The
 * logged loss is the mean over ranks; rank 0 alone logs and writes the JSONL; checkpoints are written by
 * rank 0, or with checkpoint.per_rank by every rank (its own shard file). */
#ifndef DS4_TRAINER_H
#define DS4_TRAINER_H

#include "ds4/actstore.h"
#include "ds4/dist.h"
#include "ds4/kernels.h"
#include "ds4/recompute.h"
#include "ds4/toml.h"
#include "ds4/train.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    /* [model] */
    char model_dir[1024];     /* load weights from a model directory, or */
    char model_config[1024];  /* config.json to initialise randomly */
    int64_t init_seed;
    /* [training] */
    int64_t steps, seq_len, global_batch, micro_batch, seed, threads, csa_dense_steps;
    double max_norm, router_bias_gamma;
    double mtp_loss_weight, indexer_loss_coeff; /* < 0: keep the model config's value */
    ds4_matmul_precision matmul_precision;      /* training.matmul_precision "fp32" (default) | "bf16" */
    char device[32];          /* training.device: the backend the run computes on, by name ("cpu", the default; "": cpu) */
    bool bf16_params;         /* training.mixed_precision_param "bfloat16" (implies bf16 GEMMs) | "float32" (default) */
    /* [optimizer] */
    ds4_adamw_cfg adamw;
    const ds4_optimizer *optimizer; /* optimizer.name: the socket's entry (AdamW, Muon: its group on Muon, the
                                       rest on AdamW) */
    ds4_muon_cfg muon;        /* optimizer.momentum, nesterov, ns_steps, ns_final_steps, adjust_lr, update_rms */
    /* [lr_scheduler] */
    ds4_lr_schedule sched;
    /* [data] */
    char train_data[1024], val_data[1024];
    int64_t val_batches;      /* validation batches evaluated at the end (0 = none) */
    /* [checkpoint] */
    char ckpt_folder[1024];
    int64_t ckpt_interval, keep_latest_k, load_step; /* load_step: -1 latest, -2 never */
    bool ckpt_per_rank;       /* under mpirun every rank writes its own shard file (default: rank 0 writes all) */
    /* [metrics] */
    int64_t log_freq;
    char jsonl[1024];
    double peak_tflops;       /* <= 0: the theoretical peak (ds4_probe_peak) */
    char tb_folder[1024];     /* metrics.enable_tensorboard: where the event files go ("": none) */
    /* [parallel] */
    int64_t ep;               /* expert-parallel degree (divides the ranks and the routed experts) */
    int64_t dp_shard;         /* parallelism.data_parallel_shard_degree: 0 unset, -1 or the world size */
    /* parallel.pp, parallel.vpp, parallel.layout, parallel.num_layers_per_virtual_pipeline_stage live in
     * recompute.pipe (the priority reads them); a layout of more than one chunk is refused until the
     * pipeline schedules exist (docs/pipeline.md) */
    char pp_schedule[32];     /* parallelism.pipeline_parallel_schedule: "", "1F1B" or "Interleaved1F1B" */
    uint32_t titan_names;     /* bit i: alias i of src/train/titan.c was set under TorchTitan's name (errors name it) */
    int64_t ac_every;         /* activation_checkpoint: every N-th layer in full (1: all), 0: none; resolved
                                 onto the recompute policy once the model's layers are known */
    int64_t prefetch_depth;   /* parallel.prefetch_depth (--prefetch-depth): FSDP groups in flight, 0: blocking */
    bool moe_fb_overlap;      /* parallel.moe_fb_overlap (--moe-fb-overlap): forward(i) beside backward(i - 1),
                                 each one's EP all-to-alls hidden behind the other's compute (>= 2 micro-batches) */
    double sim_link_gbps, sim_link_latency_us; /* parallel.sim_link_*: a simulated link (ds4/dist.h), 0: off */
    char trace_file[1024];    /* metrics.trace_file (--trace): Chrome trace JSON of the run's steps ("": none) */
    /* [memory] (also --swap-optimizer, --swap-layer-input, --offload-dir) */
    bool swap_optimizer;      /* optimizer state in the offload store between updates */
    bool swap_layer_input;    /* layer input streams in the offload store between forward and backward */
    char offload_dir[1024];   /* the store's directory ("": $TMPDIR, else /tmp) */
    /* command line */
    ds4_recompute_cfg recompute;
    bool memory_report;
} ds4_train_cfg;

/* Fills cfg from the TOML tree (after overrides); unknown keys are errors naming the closest key.
 * TorchTitan's sections and keys are read too (docs/torchtitan-configs.md): aliases of ds4's keys,
 * settings mapped onto ds4's (a degree ds4 cannot honour is an error), and keys ignored. */
ds4_status ds4_train_cfg_from_toml(const ds4_toml *root, ds4_train_cfg *cfg);
/* What became of each TorchTitan key of the tree: read as a ds4 key (`what` names it), mapped onto
 * ds4's settings, or ignored (`what` says why). ds4's own keys are not reported. */
typedef enum { DS4_TOML_ALIAS, DS4_TOML_MAPPED, DS4_TOML_IGNORED } ds4_toml_note_kind;
typedef void (*ds4_toml_note_fn)(void *ctx, const char *key, ds4_toml_note_kind kind, const char *what);
void ds4_train_toml_notes(const ds4_toml *root, ds4_toml_note_fn fn, void *ctx);
/* Runs training on the world (ds4_comm_world: one process, or every rank of mpirun); returns DS4_OK also
 * when stopped by SIGINT, SIGTERM or SIGUSR1 (after the step and a checkpoint). */
ds4_status ds4_train_run(const ds4_train_cfg *cfg);
/* The same; on failure *agreed tells whether every rank returns this same failure and message (bad
 * config, a failed start, resume or save: report it once and return) or only this rank knows it (a
 * failure inside a step: other ranks may wait in a collective, so the caller aborts the world). */
ds4_status ds4_train_run_world(const ds4_train_cfg *cfg, bool *agreed);

/* ------------------------------------------------------------------ the trained state
 * What a step updates, behind one interface: the whole model in this process (one rank, ep = 1) or this
 * rank's FSDP + EP shard of it. With a shard, every function below is a collective of the world except
 * model / hooks / numel / zero / scale / adamw. src/train/state.c. */
typedef struct ds4_train_state ds4_train_state;

typedef struct {
    int ep;                                 /* expert-parallel degree */
    bool shard;                             /* the FSDP form also for one rank at ep 1 (memplan) */
    bool swap_optimizer, swap_layer_input;  /* the offload policies (ds4/offload.h) */
    const char *offload_dir;                /* NULL or "": $TMPDIR, else /tmp */
    size_t swap_chunk_bytes;                /* --swap-optimizer update buffers; 0: DS4_ADAMW_SWAP_CHUNK */
    const ds4_optimizer *optimizer;         /* the optimizer's entry (ds4/train.h); NULL: AdamW */
    /* training.mixed_precision_param = "bfloat16": fp32 master weights and optimizer state, steps run with
     * bf16 GEMM operands and bf16 activations (ds4_pass_opts.bf16_acts); docs/mixed-precision.md */
    bool bf16;
    bool per_rank_ckpt;                     /* sharded saves: every rank writes its own file (checkpoint.per_rank) */
    /* a pipeline of world = pp ranks (parallel.pp > 1, the layout of pp_cfg): each rank holds the groups of
     * its chunks (values, gradients, optimizer state; the last rank also the embedding's values its MTP
     * block reads); checkpoints in the one-process format, written by rank 0 as the others send their
     * tensors (docs/pipeline.md) */
    bool pipeline;
    const ds4_pp_cfg *pp_cfg;
    int prefetch_depth;                     /* sharded: overlap depth (ds4_fsdp_set_prefetch); 0: blocking */
    const ds4_exec *exec;                   /* real (NULL too) or a plan (memplan), ds4/core.h */
} ds4_train_state_opts;

/* Weights from d (a model directory), else the init rules with seed. The form is sharded when the world
 * has several ranks, ep > 1 or shard is set. A plan state (opts->exec) runs under its plan context in the
 * allocator while it is set up, stepped (ds4_train_step) and freed; a plan communicator (ds4_comm_plan)
 * runs only a plan, and a sharded plan needs one. */
ds4_status ds4_train_state_open(const ds4_config *mc, const ds4_model_dir *d, uint64_t seed, ds4_comm *world,
                                const ds4_train_state_opts *opts, ds4_train_state **out);
/* The same in two parts, for a caller that counts what the state holds apart from the handle (memplan):
 * new makes an empty state of context exec (NULL: real), setup fills it (opts->exec unused there); free
 * it also after a failed setup. */
ds4_status ds4_train_state_new(const ds4_exec *exec, ds4_train_state **out);
ds4_status ds4_train_state_setup(ds4_train_state *s, const ds4_config *mc, const ds4_model_dir *d, uint64_t seed,
                                 ds4_comm *world, const ds4_train_state_opts *opts);
void ds4_train_state_free(ds4_train_state *s);
const ds4_exec *ds4_train_state_exec(const ds4_train_state *s); /* real or plan */
int ds4_train_state_ranks(const ds4_train_state *s);               /* ranks of its world */
ds4_model *ds4_train_state_model(ds4_train_state *s);               /* what ds4_forward runs on */
const ds4_param_hooks *ds4_train_state_hooks(ds4_train_state *s);  /* for ds4_pass_opts; NULL: whole */
ds4_act_swap *ds4_train_state_swap(ds4_train_state *s);           /* --swap-layer-input; NULL: none */
/* --moe-fb-overlap keeps two passes alive. The layer-input swap of pass slot 0 or 1 (each pass its own
 * entries; slot 1's made on first use); NULL without --swap-layer-input. */
ds4_status ds4_train_state_swap_slot(ds4_train_state *s, int slot, ds4_act_swap **out);
/* The EP ops of the hooks whose all-to-alls call yield(ctx) between start and wait (ds4_fsdp_yielding,
 * held by the state until the next call); NULL without EP. */
const ds4_ep_ops *ds4_train_state_yielding_ep(ds4_train_state *s, void (*yield)(void *ctx), void *ctx);
int64_t ds4_train_state_numel(const ds4_train_state *s);           /* parameters of the whole model */
/* A pipeline's communicator of this rank's pp stages (rank = stage; world = pp: the world; pp x fsdp: the
 * ranks of this data rank, world rank stage * fsdp + d), NULL without a pipeline; and its data ranks (fsdp). */
ds4_comm *ds4_train_state_pipe(ds4_train_state *s);
int ds4_train_state_data_ranks(const ds4_train_state *s);
int64_t ds4_train_state_held_numel(const ds4_train_state *s);      /* elements trained here: all, the shard's, a stage's groups' */
void ds4_train_state_zero_grads(ds4_train_state *s);
/* The pieces of ds4_train_step below, one by one (on a plan state: only inside ds4_train_step). */
/* Gradients /= micro_batches (all ranks' micro-batches of the step): the mean over the global batch. */
void ds4_train_state_scale_grads(ds4_train_state *s, int64_t micro_batches);
/* x [n] := the mean over ranks (rank-ordered sum / W); unchanged when whole. */
ds4_status ds4_train_state_mean(ds4_train_state *s, double *x, int64_t n);
/* Global gradient norm before clipping to max_norm (> 0). Sharded, it is exact (the same bits for any EP). */
ds4_status ds4_train_state_clip(ds4_train_state *s, double max_norm, double *norm);
/* A pipeline, after the update: rank 0 sends the embedding's new values to the rank whose MTP block reads
 * them (the last chunk's, when it is not rank 0); a no-op otherwise. Call before ds4_train_state_refresh_bf16. */
ds4_status ds4_train_state_share(ds4_train_state *s);
/* AdamW on the AdamW group (every float parameter but the optimizer's own group); counts the step. */
ds4_status ds4_train_state_adamw_step(ds4_train_state *s, const ds4_adamw_cfg *c, double lr);
/* The optimizer's own rule on its group (Muon: cfg a ds4_muon_cfg; a no-op for AdamW), AdamW's weight decay;
 * a collective when sharded. */
ds4_status ds4_train_state_own_step(ds4_train_state *s, const void *cfg, double weight_decay, double lr);
/* Mixed precision: the bf16 compute copy of the GEMM weights (a whole model's; a shard has none, its
 * gathers cast) rounded again from the fp32 master weights. The state does it after setup and load, ds4_train_step after its
 * optimizer update; call it after changing the weights any other way. A no-op in fp32. */
void ds4_train_state_refresh_bf16(ds4_train_state *s);
/* The router bias rule with loads [n_blocks, E] of this rank (summed over ranks in place first). */
ds4_status ds4_train_state_router_bias(ds4_train_state *s, int64_t *loads, double gamma);
/* Counts NaN / Inf in the weights and the optimizer state (over every rank): an error naming `step` when there
 * is any, so a diverged state is never saved. A collective when sharded. The functions from here on need
 * values: a plan state has none and gets an error. */
ds4_status ds4_train_state_check_finite(ds4_train_state *s, int64_t step);
/* Checkpoints (ds4/train.h): a whole state, or a sharded one without per_rank_ckpt, saves the one-writer
 * format (a sharded state streams to rank 0, which writes); with per_rank_ckpt every rank writes its own
 * shard file at the same time. Every rank returns the outcome of the whole save. load reads either format
 * on every rank, whatever world and EP degree wrote it. */
ds4_status ds4_train_state_save(ds4_train_state *s, const char *root, int64_t keep_latest_k, const ds4_ckpt_meta *meta);
ds4_status ds4_train_state_load(ds4_train_state *s, const char *path, ds4_ckpt_meta *meta);
/* After a load: when meta->optimizer (the one that wrote the checkpoint) differs from this state's, the
 * load started the state of the parameters whose rule changed at zero (it meant the other rule's state);
 * *elements, *matrices say how many (0, 0: nothing changed). */
ds4_status ds4_train_state_switch_optimizer(ds4_train_state *s, const ds4_ckpt_meta *meta, int64_t *elements,
                                            int64_t *matrices);
const ds4_optimizer *ds4_train_state_optimizer(const ds4_train_state *s); /* its entry */
bool ds4_train_state_bf16(const ds4_train_state *s); /* opened with bf16 mixed precision */

/* ------------------------------------------------------------------ one optimizer step
 * Everything `ds4 train` does to the state in one step, and what `ds4 memplan` runs on a plan state (so
 * plan and run are one code path): zero the gradients; forward + backward of each micro-batch under the
 * pass options, summing losses and expert loads; gradients / (micro-batches of all ranks); losses := their
 * mean over ranks; clip to max_norm; a non-finite loss or norm is an error; AdamW at lr (then the
 * optimizer's own rule on its group with own_cfg); the router bias rule with the loads. src/train/step.c. */
typedef struct {
    int64_t step;              /* 1-based, for messages */
    int64_t micro_batches;     /* of this rank, >= 1 */
    int64_t B, T;              /* one micro-batch: ids [B, T] */
    int32_t *ids;              /* [B, T] */
    /* fills ids with the next micro-batch; NULL: ids already hold it (every micro-batch the same) */
    ds4_status (*next_ids)(void *ctx, int32_t *ids);
    void *ctx;
    int64_t *loads;            /* [n_layers + n_mtp_layers, n_routed_experts] scratch for the router loads */
    /* the passes */
    bool csa_dense;            /* CSA layers attend densely (training.csa_dense_steps) */
    const uint32_t *release_mask; /* the activation store's recompute masks (ds4/recompute.h); NULL: none */
    bool moe_force_balance;    /* balanced routing (memplan of a real world) */
    /* the update */
    const ds4_adamw_cfg *adamw;
    const void *own_cfg;       /* the settings of the state's own rule (Muon: a ds4_muon_cfg); NULL: AdamW alone */
    double lr, max_norm, router_bias_gamma;
    /* MoE forward-backward overlap (parallel.moe_fb_overlap, --moe-fb-overlap; micro_batches >= 2):
     * forward(i) runs beside backward(i - 1), taking turns at each EP all-to-all; the same bits */
    bool moe_fb_overlap;
    /* called after each micro-batch's backward, before its pass is freed (reports); NULL: none */
    void (*on_pass)(void *ctx, int64_t micro, const ds4_pass *p);
    /* a pipeline (docs/pipeline.md): the micro-batches run through ds4_pp_run_rank's schedule on pipe
     * (world = pp, every rank fed the same micro-batches); NULL: one after another. The state is a stage's
     * (ds4_train_state_opts.pipeline): each rank computes and updates its own groups' gradients (the norm's
     * exact sums added over pipe), then the embedding's values go to the MTP block's rank: the same bits as
     * one process. */
    ds4_comm *pipe;
    const ds4_pp_layout *layout;
    double *pp_bubble; /* NULL or [pp], out: each pipeline rank's bubble of the step (ds4_pp_local_args.bubble) */
} ds4_step_args;

/* ------------------------------------------------------------------ a run description's parts
 * ds4_train_cfg is the one description of a run: `ds4 train` runs it, `ds4 memplan --config` plans it
 * (ds4_step_memory_of_run), both through these. ds4_run_model: the model's config (model.dir's or
 * model.config, its loss weights as the run overrides them), the settings that need the world (W ranks)
 * or the model resolved into c, and c checked against both; *d: model.dir opened (NULL for model.config),
 * the caller closes it. ds4_run_exec: the steps' context, real or a plan, on training.device with the
 * GEMMs in the run's precision (a real one also needs the backend usable here). ds4_run_state_opts: the
 * train state's options (exec is kept by pointer). ds4_run_step_args: step `step`'s settings at lr; the
 * caller adds ids, next_ids, ctx, loads and on_pass. masks: ds4_recompute_masks of c->recompute, NULL
 * when it recomputes nothing. */
ds4_status ds4_run_model(ds4_train_cfg *c, int W, ds4_config *mc, ds4_model_dir **d);
ds4_status ds4_run_exec(const ds4_train_cfg *c, bool plan, ds4_exec *out);
ds4_train_state_opts ds4_run_state_opts(const ds4_train_cfg *c, const ds4_exec *exec);
ds4_step_args ds4_run_step_args(const ds4_train_cfg *c, int W, int64_t step, double lr, const uint32_t *masks);

typedef struct {
    double loss, mtp_loss, indexer_loss, total_loss; /* means over the global batch (none in a plan) */
    double grad_norm;          /* before clipping (0 in a plan) */
    bool agreed;               /* on failure: every rank fails the same way (a non-finite loss or norm) */
} ds4_step_result;

ds4_status ds4_train_step(ds4_train_state *s, const ds4_step_args *a, ds4_step_result *out);

/* st of every rank → the first failure in rank order on every rank (its message, "rank R: ..." when it
 * is another rank's), DS4_OK when none failed; a collective of the world. */
ds4_status ds4_train_agree(ds4_comm *world, ds4_status st);

#ifdef __cplusplus
}
#endif
#endif
