/* `ds4 train`: the training loop, configured by a TOML file in the TorchTitan manner
 * ([model], [training], [optimizer], [lr_scheduler], [data], [checkpoint], [metrics]) with
 * `--section.key value` overrides and the MindSpeed recompute flags. */
#ifndef DS4_TRAINER_H
#define DS4_TRAINER_H

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
    /* [optimizer] */
    ds4_adamw_cfg adamw;
    /* [lr_scheduler] */
    ds4_lr_schedule sched;
    /* [data] */
    char train_data[1024], val_data[1024];
    int64_t val_batches;      /* validation batches evaluated at the end (0 = none) */
    /* [checkpoint] */
    char ckpt_folder[1024];
    int64_t ckpt_interval, keep_latest_k, load_step; /* load_step: -1 latest, -2 never */
    /* [metrics] */
    int64_t log_freq;
    char jsonl[1024];
    double peak_tflops;       /* <= 0: measure with a GEMM probe */
    /* command line */
    ds4_recompute_cfg recompute;
    bool memory_report;
} ds4_train_cfg;

/* Fills cfg from the TOML tree (after overrides); unknown keys are errors naming the closest key. */
ds4_status ds4_train_cfg_from_toml(const ds4_toml *root, ds4_train_cfg *cfg);
/* Runs training; returns DS4_OK also when interrupted by SIGINT (after saving a checkpoint). */
ds4_status ds4_train_run(const ds4_train_cfg *cfg);

/* Peak fp32 FLOP/s of this machine with the given threads, measured by a GEMM probe (~0.3 s). */
double ds4_probe_peak_flops(void);

#ifdef __cplusplus
}
#endif
#endif
