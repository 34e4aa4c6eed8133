/* TorchTitan configs as they are: its section and key names read as ds4's. Three kinds of key:
 *   aliases   the same setting under another name (training.local_batch_size = micro_batch_size),
 *   mapped    a TorchTitan setting ds4 carries out its own way (activation_checkpoint.mode onto the
 *             recompute policy, decay_ratio onto the schedule, parallel degrees checked against the
 *             world), or refuses with an error when honouring it is impossible and ignoring it would
 *             change what the run means (tensor_parallel_degree = 2),
 *   ignored   understood, not honoured, harmless to skip: ds4 train prints one warning line each
 *             with the reason (ds4_train_toml_notes).
 * The mapping and its reasons: docs/torchtitan-configs.md. */
#include "titan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    const char *ds4, *titan, *label; /* label: what an error about the setting names when set as titan */
} alias;

#define ALIAS(ds4, titan) {ds4, titan, titan " (ds4's " ds4 ")"}
static const alias k_aliases[] = {
    ALIAS("training.micro_batch_size", "training.local_batch_size"),
    ALIAS("parallel.ep", "parallelism.expert_parallel_degree"),
    ALIAS("parallel.pp", "parallelism.pipeline_parallel_degree"),
    ALIAS("lr_scheduler.decay_steps", "lr_scheduler.total_steps"),
    ALIAS("data.train", "training.dataset_path"),
    ALIAS("training.seed", "debug.seed"),
};
#undef ALIAS
#define N_ALIASES (sizeof k_aliases / sizeof k_aliases[0])

typedef struct {
    const char *key; /* "section.*": every key under it */
    const char *why; /* what ds4 does instead */
} note;

/* Mapped: read by titan_read. */
static const note k_mapped[] = {
    {"lr_scheduler.decay_ratio", "warmup, then lr stays until steps x (1 - decay_ratio), then decays"},
    {"lr_scheduler.min_lr_factor", "lr_scheduler.min_lr = optimizer.lr x min_lr_factor"},
    {"checkpoint.enable", "false: no checkpoints are saved or resumed"},
    {"checkpoint.enable_checkpoint", "false: no checkpoints are saved or resumed"},
    {"checkpoint.initial_load_path", "refused: load Hugging Face weights with model.dir"},
    {"parallelism.data_parallel_shard_degree", "-1 or the world size: FSDP over every rank"},
    {"parallelism.data_parallel_replicate_degree", "must be 1 (no HSDP)"},
    {"parallelism.tensor_parallel_degree", "must be 1 (no tensor parallelism)"},
    {"parallelism.pipeline_parallel_schedule", "1F1B or Interleaved1F1B, checked against the layout (the schedules "
                                               "are not built yet)"},
    {"parallelism.context_parallel_degree", "must be 1 (no context parallelism)"},
    {"parallelism.expert_tensor_parallel_degree", "must be 1 (experts are whole on their EP rank)"},
    {"activation_checkpoint.mode", "the recompute policy"},
    {"activation_checkpoint.selective_ac_option", "the recompute policy of mode = \"selective\""},
    {"model.name", "deepseek_v4 or deepseek_v3 (ds4 trains DeepSeek-V4 blocks)"},
    {"model.flavor", "a preset name (configs/<flavor>.json) when nothing else gives the model"},
    {"model.hf_assets_path", "its config.json gives the model when model.config / preset / dir do not"},
    {"debug.deterministic", "ds4 is always deterministic"},
};

#define NO_TP "ds4 has no tensor parallelism"
#define NO_PP "ds4's pipeline is parallel.pp, parallel.vpp and parallel.layout (docs/pipeline.md)"
#define NO_LOAD "not a ds4 checkpoint option (model.dir loads Hugging Face weights, ds4 export writes them)"
static const note k_ignored[] = {
    {"job.print_config", "ds4 does not print its config"},
    {"job.print_args", "ds4 does not print its config"},
    {"job.config_file", "the file is the one --config / --job.config_file names on the command line"},
    {"job.save_config_file", "ds4 does not save its config"},
    {"job.custom_config_module", "TorchTitan extension modules do not apply to ds4"},
    {"job.use_for_integration_test", "a TorchTitan test-suite marker"},
    {"profiling.*", "ds4 has no profiler (see ds4 train --memory-report and ds4 memplan)"},
    {"metrics.disable_color_printing", "ds4 prints no colours"},
    {"metrics.save_for_all_ranks", "rank 0 alone writes ds4's metrics"},
    {"metrics.enable_wandb", "ds4 has no Weights & Biases writer (TensorBoard files and metrics.jsonl)"},
    {"model.tokenizer_path", "ds4 trains on token shards (ds4 tokenize makes them)"},
    {"model.converters", "no float8/MX converters: fp32 weights (training.matmul_precision for bf16 GEMMs)"},
    {"model.print_after_conversion", "no model converters in ds4"},
    {"optimizer.implementation", "ds4 has one implementation of each optimizer"},
    {"optimizer.early_step_in_backward", "ds4 steps after the whole backward"},
    {"training.dataset", "ds4 reads token shards: data.train or training.dataset_path"},
    {"training.compile", "ds4 is compiled C"},
    {"training.enable_cpu_offload", "use memory.swap_optimizer / --swap-optimizer"},
    {"training.dtype", "ds4 keeps fp32 master weights (training.mixed_precision_param = \"bfloat16\" for bf16 compute)"},
    {"training.gc_freq", "no garbage collector in C"},
    {"training.gc_debug", "no garbage collector in C"},
    {"training.dataloader.*", "ds4's loader maps the shards in the training process"},
    {"parallelism.fsdp_reshard_after_forward", "ds4 frees every gathered group after its last use"},
    {"parallelism.enable_async_tensor_parallel", NO_TP},
    {"parallelism.disable_loss_parallel", NO_TP},
    {"parallelism.pipeline_parallel_schedule_csv", NO_PP},
    {"parallelism.pipeline_parallel_microbatch_size", NO_PP},
    {"parallelism.pipeline_parallel_layers_per_stage", NO_PP},
    {"parallelism.pipeline_parallel_first_stage_less_layers", NO_PP},
    {"parallelism.pipeline_parallel_last_stage_less_layers", NO_PP},
    {"parallelism.pipeline_parallel_expert_parallel_overlap", NO_PP},
    {"parallelism.module_fqns_per_model_part", NO_PP},
    {"parallelism.context_parallel_load_balancer", "ds4 has no context parallelism"},
    {"parallelism.context_parallel_rotate_method", "ds4 has no context parallelism"},
    {"parallelism.expert_parallel_comm_backend", "ds4's expert all-to-all runs over MPI"},
    {"checkpoint.last_save_model_only", "ds4's last checkpoint keeps the whole state (ds4 export writes the model)"},
    {"checkpoint.async_mode", "ds4 saves synchronously (the same files)"},
    {"checkpoint.export_dtype", "ds4 checkpoints are fp32 (ds4 export --dtype bf16 writes bf16)"},
    {"checkpoint.initial_load_model_only", NO_LOAD},
    {"checkpoint.initial_load_in_hf", NO_LOAD},
    {"checkpoint.initial_load_in_hf_quantized", NO_LOAD},
    {"checkpoint.last_save_in_hf", NO_LOAD},
    {"checkpoint.exclude_from_loading", NO_LOAD},
    {"checkpoint.enable_first_step_checkpoint", NO_LOAD},
    {"checkpoint.create_seed_checkpoint", NO_LOAD},
    {"checkpoint.load_only", NO_LOAD},
    {"checkpoint.enable_ft_dataloader_checkpoints", NO_LOAD},
    {"activation_checkpoint.*", "ds4 replays are deterministic forwards: no torch checkpoint options"},
    {"compile.*", "ds4 is compiled C: nothing to compile"},
    {"float8.*", "no float8 training: fp32 weights (training.matmul_precision for bf16 GEMMs)"},
    {"quantize.*", "no float8/MX training: fp32 weights (training.matmul_precision for bf16 GEMMs)"},
    {"comm.*", "MPI's own timeouts and tracing apply"},
    {"memory_estimation.*", "ds4 memplan plans memory"},
    {"fault_tolerance.*", "no torchft: ds4 checkpoints resume bit-exactly"},
    {"experimental.*", "TorchTitan extension modules do not apply to ds4"},
    {"validation.*", "ds4 evaluates data.val once at the end (data.val, data.val_batches)"},
    {"debug.deterministic_warn_only", "ds4 is always deterministic"},
    {"debug.moe_force_load_balance", "ds4 routes by the model's own router"},
};
#define N_MAPPED (sizeof k_mapped / sizeof k_mapped[0])
#define N_IGNORED (sizeof k_ignored / sizeof k_ignored[0])

/* `key` matches `pat`: equal, or pat is "section.*" and key lies under section. */
static bool matches(const char *pat, const char *key) {
    size_t n = strlen(pat);
    if (n > 2 && !strcmp(pat + n - 2, ".*")) return !strncmp(pat, key, n - 1);
    return !strcmp(pat, key);
}

static const note *find_note(const note *list, size_t n, const char *key) {
    for (size_t i = 0; i < n; i++)
        if (matches(list[i].key, key)) return &list[i];
    return NULL;
}

static bool has(const ds4_toml *t, const char *key) { return ds4_toml_find(t, key) != NULL; }

/* Two scalar values that are equal (a setting given twice, once under each name). */
static bool same_value(const ds4_toml *a, const ds4_toml *b) {
    if (a->type != b->type) return false;
    switch (a->type) {
    case DS4_TOML_INT: return a->v.i == b->v.i;
    case DS4_TOML_FLOAT: return a->v.f == b->v.f;
    case DS4_TOML_BOOL: return a->v.b == b->v.b;
    case DS4_TOML_STRING: return !strcmp(a->v.s, b->v.s);
    default: return false;
    }
}

ds4_status titan_check_keys(const ds4_toml *t, const char *const *known, int64_t n_known) {
    enum { MAX = 512 };
    const char *all[MAX];
    int64_t n = 0;
    for (int64_t i = 0; i < n_known && n < MAX; i++) all[n++] = known[i];
    for (size_t i = 0; i < N_ALIASES && n < MAX; i++) all[n++] = k_aliases[i].titan;
    for (size_t i = 0; i < N_MAPPED && n < MAX; i++) all[n++] = k_mapped[i].key;
    for (size_t i = 0; i < N_IGNORED && n < MAX; i++) all[n++] = k_ignored[i].key;
    DS4_TRY(ds4_toml_check_keys(t, all, n));
    for (size_t i = 0; i < N_ALIASES; i++)
        if (has(t, k_aliases[i].ds4) && has(t, k_aliases[i].titan) &&
            !same_value(ds4_toml_find(t, k_aliases[i].ds4), ds4_toml_find(t, k_aliases[i].titan)))
            return ds4_fail(DS4_ERR_CONFIG, "keys %s and %s (TorchTitan's name) are the same setting, set to "
                                            "different values: set one", k_aliases[i].ds4, k_aliases[i].titan);
    if (has(t, "checkpoint.enable") && has(t, "checkpoint.enable_checkpoint"))
        return ds4_fail(DS4_ERR_CONFIG, "keys checkpoint.enable and checkpoint.enable_checkpoint: set one");
    return DS4_OK;
}

const char *titan_key(const ds4_toml *t, const char *key) {
    for (size_t i = 0; i < N_ALIASES; i++)
        if (!strcmp(k_aliases[i].ds4, key) && !has(t, key) && has(t, k_aliases[i].titan)) return k_aliases[i].titan;
    return key;
}

const char *titan_label(const ds4_train_cfg *c, const char *key) {
    for (size_t i = 0; i < N_ALIASES; i++)
        if (!strcmp(k_aliases[i].ds4, key) && (c->titan_names >> i & 1u)) return k_aliases[i].label;
    return key;
}

/* c->titan_names: which aliases the config set under TorchTitan's name only. */
static void note_titan_names(const ds4_toml *t, ds4_train_cfg *c) {
    c->titan_names = 0;
    for (size_t i = 0; i < N_ALIASES; i++)
        if (strcmp(titan_key(t, k_aliases[i].ds4), k_aliases[i].ds4) != 0) c->titan_names |= 1u << i;
}

/* ------------------------------------------------------------------ the TorchTitan-only settings */
static ds4_status read_degrees(const ds4_toml *t, ds4_train_cfg *c) {
    static const char *const ones[] = {"parallelism.data_parallel_replicate_degree",
                                       "parallelism.tensor_parallel_degree",
                                       "parallelism.context_parallel_degree",
                                       "parallelism.expert_tensor_parallel_degree"};
    for (size_t i = 0; i < sizeof ones / sizeof ones[0]; i++) {
        int64_t d;
        DS4_TRY(ds4_toml_int_or(t, ones[i], 1, &d));
        if (d != 1)
            return ds4_fail(DS4_ERR_CONFIG, "key %s = %lld: ds4 runs FSDP over every rank plus expert parallelism "
                                            "only; set it to 1", ones[i], (long long)d);
    }
    DS4_TRY(ds4_toml_int_or(t, "parallelism.data_parallel_shard_degree", 0, &c->dp_shard));
    const char *sched;
    DS4_TRY(ds4_toml_string_or(t, "parallelism.pipeline_parallel_schedule", "", &sched));
    if (sched[0] && strcmp(sched, "1F1B") && strcmp(sched, "Interleaved1F1B"))
        return ds4_fail(DS4_ERR_CONFIG, "key parallelism.pipeline_parallel_schedule = \"%s\": ds4 knows 1F1B and "
                                        "Interleaved1F1B", sched);
    snprintf(c->pp_schedule, sizeof c->pp_schedule, "%s", sched);
    if (c->dp_shard < -1)
        return ds4_fail(DS4_ERR_CONFIG, "key parallelism.data_parallel_shard_degree = %lld: expected -1 (every rank) "
                                        "or the number of ranks", (long long)c->dp_shard);
    return DS4_OK;
}

/* TorchTitan's warmup-stable-decay: decay_ratio of the steps decay at the end, after a stable stretch. */
static ds4_status read_schedule(const ds4_toml *t, ds4_train_cfg *c) {
    if (has(t, "lr_scheduler.decay_ratio")) {
        double r;
        DS4_TRY(ds4_toml_get_float(t, "lr_scheduler.decay_ratio", &r));
        if (!(r >= 0 && r <= 1))
            return ds4_fail(DS4_ERR_CONFIG, "key lr_scheduler.decay_ratio = %g: expected a number in [0, 1]", r);
        int64_t total = c->sched.total_steps, decay = (int64_t)llround((double)total * r);
        c->sched.decay_start = total - decay; /* ds4_lr_at decays after max(warmup, decay_start) */
    }
    if (has(t, "lr_scheduler.min_lr_factor")) {
        if (has(t, "lr_scheduler.min_lr"))
            return ds4_fail(DS4_ERR_CONFIG, "keys lr_scheduler.min_lr and min_lr_factor (TorchTitan's): set one");
        double f;
        DS4_TRY(ds4_toml_get_float(t, "lr_scheduler.min_lr_factor", &f));
        if (!(f >= 0 && f <= 1))
            return ds4_fail(DS4_ERR_CONFIG, "key lr_scheduler.min_lr_factor = %g: expected a number in [0, 1]", f);
        c->sched.min_lr = c->adamw.lr * f;
    }
    return DS4_OK;
}

static ds4_status read_checkpoint(const ds4_toml *t, ds4_train_cfg *c) {
    const char *load;
    DS4_TRY(ds4_toml_string_or(t, "checkpoint.initial_load_path", "", &load));
    if (load[0])
        return ds4_fail(DS4_ERR_CONFIG, "key checkpoint.initial_load_path: ds4 reads no DCP checkpoint; load Hugging "
                                        "Face weights with model.dir");
    const char *k = has(t, "checkpoint.enable") ? "checkpoint.enable" : "checkpoint.enable_checkpoint";
    bool on;
    DS4_TRY(ds4_toml_bool_or(t, k, true, &on));
    if (!has(t, k)) return DS4_OK;
    if (!on) { /* TorchTitan's folder and interval stay unused */
        c->ckpt_folder[0] = 0;
        c->ckpt_interval = 0;
    }
    else if (!c->ckpt_folder[0]) snprintf(c->ckpt_folder, sizeof c->ckpt_folder, "checkpoint"); /* its default */
    return DS4_OK;
}

/* activation_checkpoint.mode: none | full (every layer replayed from its input) | selective: op (the
 * cheap ops replayed, GEMMs and attention kept: ds4's norm + mHC recompute) or an integer N (every N-th
 * layer in full: ds4 replays the same number of layers, the first ones). */
static ds4_status read_activation_checkpoint(const ds4_toml *t, ds4_train_cfg *c) {
    const char *mode, *opt;
    DS4_TRY(ds4_toml_string_or(t, "activation_checkpoint.mode", "none", &mode));
    DS4_TRY(ds4_toml_string_or(t, "activation_checkpoint.selective_ac_option", "2", &opt));
    if (!strcmp(mode, "none") || !strcmp(mode, "memory_budget")) return DS4_OK;
    if (!strcmp(mode, "full")) {
        c->ac_every = 1;
        return DS4_OK;
    }
    if (strcmp(mode, "selective"))
        return ds4_fail(DS4_ERR_CONFIG, "key activation_checkpoint.mode: expected none, selective or full, got '%s'",
                        mode);
    if (!strcmp(opt, "op")) {
        c->recompute.norm = c->recompute.mhc = true;
        return DS4_OK;
    }
    char *end;
    long n = strtol(opt, &end, 10);
    if (end == opt || *end || n < 1 || n > 1 << 20)
        return ds4_fail(DS4_ERR_CONFIG, "key activation_checkpoint.selective_ac_option: expected 'op' or a positive "
                                        "integer, got '%s'", opt);
    c->ac_every = n;
    return DS4_OK;
}

/* model.name / flavor / hf_assets_path: the model's config when ds4's own keys give none. */
static ds4_status read_model(const ds4_toml *t, ds4_train_cfg *c) {
    const char *name, *flavor, *assets;
    DS4_TRY(ds4_toml_string_or(t, "model.name", "deepseek_v4", &name));
    DS4_TRY(ds4_toml_string_or(t, "model.flavor", "", &flavor));
    DS4_TRY(ds4_toml_string_or(t, "model.hf_assets_path", "", &assets));
    if (strcmp(name, "deepseek_v4") && strcmp(name, "deepseek_v3"))
        return ds4_fail(DS4_ERR_CONFIG, "key model.name = '%s': ds4 trains DeepSeek-V4 (deepseek_v4, or a "
                                        "deepseek_v3 config run as V4)", name);
    if (c->model_dir[0] || c->model_config[0]) return DS4_OK;
    if (assets[0]) {
        size_t n = strlen(assets);
        bool json = n > 5 && !strcmp(assets + n - 5, ".json");
        int w = snprintf(c->model_config, sizeof c->model_config, json ? "%s" : "%s/config.json", assets);
        if (w < 0 || (size_t)w >= sizeof c->model_config)
            return ds4_fail(DS4_ERR_CONFIG, "key model.hf_assets_path: path too long");
        return DS4_OK;
    }
    /* a preset by the flavor's name, also spelt with '-' for '_' (TorchTitan's deepseek_v4_flash) */
    char preset[256];
    if (!flavor[0] || strchr(flavor, '/') || strlen(flavor) > 200) return DS4_OK;
    for (int spelling = 0; spelling < 2 && !c->model_config[0]; spelling++) {
        snprintf(preset, sizeof preset, "configs/%s.json", flavor);
        for (char *p = preset + 8; spelling && *p; p++)
            if (*p == '_') *p = '-';
        if (access(preset, R_OK) == 0) snprintf(c->model_config, sizeof c->model_config, "%s", preset);
    }
    return DS4_OK;
}

ds4_status titan_read(const ds4_toml *t, ds4_train_cfg *c) {
    note_titan_names(t, c);
    DS4_TRY(read_degrees(t, c));
    DS4_TRY(read_schedule(t, c));
    DS4_TRY(read_checkpoint(t, c));
    DS4_TRY(read_activation_checkpoint(t, c));
    DS4_TRY(read_model(t, c));
    if (has(t, "training.local_batch_size") && !has(t, "training.global_batch_size"))
        c->global_batch = -1; /* TorchTitan: local_batch_size on every rank, no accumulation */
    return DS4_OK;
}

/* ------------------------------------------------------------------ what became of each key */
typedef struct {
    ds4_toml_note_fn fn;
    void *ctx;
} walk_ctx;

static void note_leaf(const ds4_toml *t, const char *key, const walk_ctx *w) {
    for (size_t i = 0; i < N_ALIASES; i++)
        if (!strcmp(k_aliases[i].titan, key)) {
            w->fn(w->ctx, key, DS4_TOML_ALIAS, k_aliases[i].ds4);
            return;
        }
    const ds4_toml *v = ds4_toml_find(t, key);
    bool is_str = v && v->type == DS4_TOML_STRING;
    if (!strcmp(key, "activation_checkpoint.mode") && is_str && !strcmp(v->v.s, "memory_budget")) {
        w->fn(w->ctx, key, DS4_TOML_IGNORED, "memory_budget needs torch.compile's partitioner: no recompute");
        return;
    }
    /* the values ds4 honours as they are */
    if ((!strcmp(key, "checkpoint.async_mode") && is_str && !strcmp(v->v.s, "disabled")) ||
        (!strcmp(key, "checkpoint.export_dtype") && is_str && !strcmp(v->v.s, "float32"))) {
        w->fn(w->ctx, key, DS4_TOML_MAPPED, "as ds4 does");
        return;
    }
    const note *m = find_note(k_mapped, N_MAPPED, key);
    if (m) {
        w->fn(w->ctx, key, DS4_TOML_MAPPED, m->why);
        return;
    }
    const note *g = find_note(k_ignored, N_IGNORED, key);
    if (g) w->fn(w->ctx, key, DS4_TOML_IGNORED, g->why);
}

static void walk(const ds4_toml *root, const ds4_toml *n, char *path, size_t len, const walk_ctx *w) {
    for (int64_t i = 0; i < n->n_kids; i++) {
        const ds4_toml *k = n->kids[i];
        int m = snprintf(path + len, 512 - len, "%s%s", len ? "." : "", k->key ? k->key : "");
        if (m < 0 || len + (size_t)m >= 512) continue;
        if (k->type == DS4_TOML_TABLE) walk(root, k, path, len + (size_t)m, w);
        else note_leaf(root, path, w);
        path[len] = 0;
    }
}

void ds4_train_toml_notes(const ds4_toml *t, ds4_toml_note_fn fn, void *ctx) {
    char path[512] = "";
    walk_ctx w = {fn, ctx};
    walk(t, t, path, 0, &w);
}
