/* The training loop: data → forward/backward (with gradient accumulation and the recompute policy)
 * → clip → AdamW → router bias update → metrics → checkpoints. Resumes bit-exactly. The loop does
 * not know whether it holds the whole model or an FSDP + EP shard: ds4_train_state (state.c) does. */
#include "ds4/trainer.h"

#include "titan.h"

#include "ds4/data.h"
#include "ds4/io.h"
#include "ds4/kernels.h"
#include "ds4/pp_schedule.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ config */
static const char *const k_known_keys[] = {
    "model.dir", "model.config", "model.preset", "model.seed",
    "training.steps", "training.seq_len", "training.global_batch_size", "training.micro_batch_size",
    "training.seed", "training.threads", "training.max_norm", "training.mtp_loss_weight",
    "training.indexer_loss_coeff", "training.csa_dense_steps", "training.router_bias_gamma",
    "training.matmul_precision", "training.mixed_precision_param", "training.mixed_precision_reduce",
    "training.device",
    "optimizer.name", "optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps",
    "optimizer.weight_decay", "optimizer.momentum", "optimizer.nesterov", "optimizer.ns_steps",
    "optimizer.ns_final_steps", "optimizer.adjust_lr", "optimizer.update_rms",
    "lr_scheduler.warmup_steps", "lr_scheduler.decay_type", "lr_scheduler.min_lr", "lr_scheduler.decay_steps",
    "data.train", "data.val", "data.val_batches",
    "checkpoint.folder", "checkpoint.interval", "checkpoint.keep_latest_k", "checkpoint.load_step",
    "checkpoint.per_rank",
    "metrics.log_freq", "metrics.jsonl", "metrics.peak_tflops", "metrics.enable_tensorboard",
    "metrics.save_tb_folder", "job.dump_folder", "job.description",
    "parallel.ep", "parallel.pp", "parallel.vpp", "parallel.layout", "parallel.num_layers_per_virtual_pipeline_stage",
    "parallel.prefetch_depth", "parallel.moe_fb_overlap", "parallel.sim_link_gbps", "parallel.sim_link_latency_us",
    "metrics.trace_file",
    "memory.swap_optimizer", "memory.swap_layer_input", "memory.offload_dir",
};

static ds4_status copy_str(const ds4_toml *t, const char *key, const char *def, char *dst, size_t n) {
    const char *s;
    DS4_TRY(ds4_toml_string_or(t, key, def, &s));
    if (strlen(s) >= n) return ds4_fail(DS4_ERR_CONFIG, "key %s: value longer than %zu bytes", key, n - 1);
    snprintf(dst, n, "%s", s);
    return DS4_OK;
}

static ds4_status check_ranges(const ds4_train_cfg *c);

/* optimizer.name (TorchTitan's spelling, any case) and the Muon knobs (read for AdamW too, unused there). */
static ds4_status read_optimizer(const ds4_toml *t, ds4_train_cfg *c) {
    const char *opt, *adj;
    DS4_TRY(ds4_toml_string_or(t, "optimizer.name", "AdamW", &opt));
    DS4_TRY(ds4_optimizer_find(opt, &c->optimizer)); /* the socket's registry (src/train/optim.c) */
    c->muon = ds4_muon_defaults();
    DS4_TRY(ds4_toml_float_or(t, "optimizer.momentum", c->muon.momentum, &c->muon.momentum));
    DS4_TRY(ds4_toml_bool_or(t, "optimizer.nesterov", c->muon.nesterov, &c->muon.nesterov));
    DS4_TRY(ds4_toml_int_or(t, "optimizer.ns_steps", c->muon.ns_steps, &c->muon.ns_steps));
    DS4_TRY(ds4_toml_int_or(t, "optimizer.ns_final_steps", c->muon.ns_final_steps, &c->muon.ns_final_steps));
    DS4_TRY(ds4_toml_float_or(t, "optimizer.update_rms", c->muon.update_rms, &c->muon.update_rms));
    DS4_TRY(ds4_toml_string_or(t, "optimizer.adjust_lr", "rms_norm", &adj));
    if (!strcmp(adj, "rms_norm")) c->muon.adjust = DS4_MUON_ADJUST_RMS;
    else if (!strcmp(adj, "spectral_norm")) c->muon.adjust = DS4_MUON_ADJUST_SPECTRAL;
    else if (!strcmp(adj, "none")) c->muon.adjust = DS4_MUON_ADJUST_NONE;
    else
        return ds4_fail(DS4_ERR_CONFIG, "key optimizer.adjust_lr: expected rms_norm, spectral_norm or none, got '%s'",
                        adj);
    return DS4_OK;
}

/* `path` under job.dump_folder (TorchTitan's root of a run's outputs) unless it is absolute or no
 * dump folder is set. */
static ds4_status under_dump(const char *dump, const char *path, const char *key, char *dst, size_t n) {
    int len = path[0] == '/' || !dump[0] ? snprintf(dst, n, "%s", path) : snprintf(dst, n, "%s/%s", dump, path);
    if (len < 0 || (size_t)len >= n) return ds4_fail(DS4_ERR_CONFIG, "key %s: path longer than %zu bytes", key, n - 1);
    return DS4_OK;
}

/* TorchTitan's precision keys. ds4's default stays "float32" (the exact reference numerics), where
 * TorchTitan defaults to "bfloat16" under FSDP; "bfloat16" implies bf16 GEMMs. */
static ds4_status read_mixed_precision(const ds4_toml *t, ds4_train_cfg *c) {
    const char *param, *reduce;
    DS4_TRY(ds4_toml_string_or(t, "training.mixed_precision_param", "float32", &param));
    if (strcmp(param, "float32") && strcmp(param, "bfloat16"))
        return ds4_fail(DS4_ERR_CONFIG, "key training.mixed_precision_param: \"%s\" is not \"bfloat16\" or \"float32\"",
                        param);
    DS4_TRY(ds4_toml_string_or(t, "training.mixed_precision_reduce", "float32", &reduce));
    if (strcmp(reduce, "float32"))
        return ds4_fail(DS4_ERR_CONFIG, "key training.mixed_precision_reduce: \"%s\": ds4 reduces and accumulates "
                        "gradients in \"float32\" only", reduce);
    c->bf16_params = !strcmp(param, "bfloat16");
    if (!c->bf16_params) return DS4_OK;
    if (ds4_toml_find(t, "training.matmul_precision") && c->matmul_precision != DS4_MATMUL_BF16)
        return ds4_fail(DS4_ERR_CONFIG, "key training.matmul_precision: \"fp32\" contradicts "
                        "training.mixed_precision_param = \"bfloat16\" (its GEMMs take bf16 operands)");
    c->matmul_precision = DS4_MATMUL_BF16;
    return DS4_OK;
}

/* [metrics] enable_tensorboard, save_tb_folder (default "tb", under job.dump_folder). */
static ds4_status read_tensorboard(const ds4_toml *t, const char *dump, ds4_train_cfg *c) {
    bool on;
    const char *folder;
    DS4_TRY(ds4_toml_bool_or(t, "metrics.enable_tensorboard", false, &on));
    DS4_TRY(ds4_toml_string_or(t, "metrics.save_tb_folder", "tb", &folder));
    if (!on) return DS4_OK;
    if (!folder[0]) return ds4_fail(DS4_ERR_CONFIG, "key metrics.save_tb_folder: empty");
    return under_dump(dump, folder, "metrics.save_tb_folder", c->tb_folder, sizeof c->tb_folder);
}

/* [parallel] pp, vpp, layout, num_layers_per_virtual_pipeline_stage (TorchTitan's
 * parallelism.pipeline_parallel_degree is pp): the layout the recompute priority reads; checked against
 * the model by ds4_recompute_validate. */
static ds4_status read_pipeline(const ds4_toml *t, ds4_train_cfg *c) {
    ds4_pp_cfg *p = &c->recompute.pipe;
    DS4_TRY(ds4_toml_int_or(t, titan_key(t, "parallel.pp"), 1, &p->pp));
    DS4_TRY(ds4_toml_int_or(t, "parallel.vpp", 0, &p->vpp));
    DS4_TRY(ds4_toml_int_or(t, "parallel.num_layers_per_virtual_pipeline_stage", 0, &p->layers_per_vstage));
    DS4_TRY(copy_str(t, "parallel.layout", "", p->layout, sizeof p->layout));
    if (p->pp < 1)
        return ds4_fail(DS4_ERR_CONFIG, "key %s = %lld: expected a positive number of pipeline stages",
                        titan_key(t, "parallel.pp"), (long long)p->pp);
    if (p->vpp < 0 || (ds4_toml_find(t, "parallel.vpp") && p->vpp < 1))
        return ds4_fail(DS4_ERR_CONFIG, "key parallel.vpp = %lld: expected a positive number of virtual chunks",
                        (long long)p->vpp);
    if (ds4_toml_find(t, "parallel.num_layers_per_virtual_pipeline_stage") && p->layers_per_vstage < 1)
        return ds4_fail(DS4_ERR_CONFIG, "key parallel.num_layers_per_virtual_pipeline_stage = %lld: expected a "
                        "positive number of layers", (long long)p->layers_per_vstage);
    return DS4_OK;
}

ds4_status ds4_train_cfg_from_toml(const ds4_toml *t, ds4_train_cfg *c) {
    memset(c, 0, sizeof *c);
    ds4_recompute_defaults(&c->recompute);
    DS4_TRY(titan_check_keys(t, k_known_keys, (int64_t)(sizeof k_known_keys / sizeof k_known_keys[0])));
    DS4_TRY(copy_str(t, "model.dir", "", c->model_dir, sizeof c->model_dir));
    DS4_TRY(copy_str(t, "model.config", "", c->model_config, sizeof c->model_config));
    const char *preset;
    DS4_TRY(ds4_toml_string_or(t, "model.preset", "", &preset));
    if (preset[0]) { /* a named config shipped in configs/: deepseek-v4-flash, ds4-demo-small, ... */
        if (c->model_config[0])
            return ds4_fail(DS4_ERR_CONFIG, "[model]: set model.preset or model.config, not both");
        if (strchr(preset, '/') || strchr(preset, '.'))
            return ds4_fail(DS4_ERR_CONFIG, "key model.preset: '%s' is not a preset name (a file in configs/)", preset);
        snprintf(c->model_config, sizeof c->model_config, "configs/%s.json", preset);
    }
    DS4_TRY(ds4_toml_int_or(t, "model.seed", 0, &c->init_seed));
    DS4_TRY(ds4_toml_get_int(t, "training.steps", &c->steps));
    DS4_TRY(ds4_toml_get_int(t, "training.seq_len", &c->seq_len));
    DS4_TRY(ds4_toml_int_or(t, titan_key(t, "training.micro_batch_size"), 1, &c->micro_batch));
    DS4_TRY(ds4_toml_int_or(t, "training.global_batch_size", c->micro_batch, &c->global_batch));
    DS4_TRY(ds4_toml_int_or(t, titan_key(t, "training.seed"), 0, &c->seed));
    DS4_TRY(ds4_toml_int_or(t, "training.threads", 0, &c->threads));
    DS4_TRY(ds4_toml_float_or(t, "training.max_norm", 1.0, &c->max_norm));
    DS4_TRY(ds4_toml_float_or(t, "training.mtp_loss_weight", -1, &c->mtp_loss_weight));
    DS4_TRY(ds4_toml_float_or(t, "training.indexer_loss_coeff", -1, &c->indexer_loss_coeff));
    DS4_TRY(ds4_toml_int_or(t, "training.csa_dense_steps", 0, &c->csa_dense_steps));
    DS4_TRY(ds4_toml_float_or(t, "training.router_bias_gamma", 1e-3, &c->router_bias_gamma));
    DS4_TRY(read_optimizer(t, c));
    DS4_TRY(ds4_toml_float_or(t, "optimizer.lr", 3e-4, &c->adamw.lr));
    DS4_TRY(ds4_toml_float_or(t, "optimizer.beta1", 0.9, &c->adamw.beta1));
    DS4_TRY(ds4_toml_float_or(t, "optimizer.beta2", 0.95, &c->adamw.beta2));
    DS4_TRY(ds4_toml_float_or(t, "optimizer.eps", 1e-8, &c->adamw.eps));
    DS4_TRY(ds4_toml_float_or(t, "optimizer.weight_decay", 0.1, &c->adamw.weight_decay));
    c->sched.lr = c->adamw.lr;
    DS4_TRY(ds4_toml_int_or(t, titan_key(t, "lr_scheduler.decay_steps"), c->steps, &c->sched.total_steps));
    DS4_TRY(ds4_toml_int_or(t, "lr_scheduler.warmup_steps", 0, &c->sched.warmup_steps));
    DS4_TRY(ds4_toml_float_or(t, "lr_scheduler.min_lr", 0.1 * c->adamw.lr, &c->sched.min_lr));
    const char *dk;
    DS4_TRY(ds4_toml_string_or(t, "lr_scheduler.decay_type", "cosine", &dk));
    if (!strcmp(dk, "cosine")) c->sched.decay = DS4_DECAY_COSINE;
    else if (!strcmp(dk, "linear")) c->sched.decay = DS4_DECAY_LINEAR;
    else if (!strcmp(dk, "none")) c->sched.decay = DS4_DECAY_NONE;
    else return ds4_fail(DS4_ERR_CONFIG, "key lr_scheduler.decay_type: expected cosine, linear or none, got '%s'", dk);
    DS4_TRY(copy_str(t, titan_key(t, "data.train"), "", c->train_data, sizeof c->train_data));
    DS4_TRY(copy_str(t, "data.val", "", c->val_data, sizeof c->val_data));
    DS4_TRY(ds4_toml_int_or(t, "data.val_batches", 8, &c->val_batches));
    DS4_TRY(copy_str(t, "checkpoint.folder", "", c->ckpt_folder, sizeof c->ckpt_folder));
    DS4_TRY(ds4_toml_int_or(t, "checkpoint.interval", 0, &c->ckpt_interval));
    DS4_TRY(ds4_toml_int_or(t, "checkpoint.keep_latest_k", 2, &c->keep_latest_k));
    DS4_TRY(ds4_toml_int_or(t, "checkpoint.load_step", -1, &c->load_step));
    DS4_TRY(ds4_toml_bool_or(t, "checkpoint.per_rank", false, &c->ckpt_per_rank));
    DS4_TRY(ds4_toml_int_or(t, "metrics.log_freq", 1, &c->log_freq));
    DS4_TRY(copy_str(t, "metrics.jsonl", "", c->jsonl, sizeof c->jsonl));
    DS4_TRY(ds4_toml_float_or(t, "metrics.peak_tflops", 0, &c->peak_tflops));
    const char *dump, *description;
    DS4_TRY(ds4_toml_string_or(t, "job.dump_folder", "", &dump));
    DS4_TRY(ds4_toml_string_or(t, "job.description", "", &description)); /* a note for people: type-checked only */
    DS4_TRY(read_tensorboard(t, dump, c));
    DS4_TRY(titan_read(t, c));
    if (c->ckpt_folder[0]) { /* TorchTitan's checkpoint folder lies under job.dump_folder */
        char folder[sizeof c->ckpt_folder];
        DS4_TRY(under_dump(dump, c->ckpt_folder, "checkpoint.folder", folder, sizeof folder));
        memcpy(c->ckpt_folder, folder, sizeof folder);
    }
    DS4_TRY(ds4_toml_int_or(t, titan_key(t, "parallel.ep"), 1, &c->ep));
    DS4_TRY(read_pipeline(t, c));
    DS4_TRY(ds4_toml_int_or(t, "parallel.prefetch_depth", DS4_PREFETCH_DEFAULT, &c->prefetch_depth));
    DS4_TRY(ds4_toml_bool_or(t, "parallel.moe_fb_overlap", false, &c->moe_fb_overlap));
    DS4_TRY(ds4_toml_float_or(t, "parallel.sim_link_gbps", 0, &c->sim_link_gbps));
    DS4_TRY(ds4_toml_float_or(t, "parallel.sim_link_latency_us", 0, &c->sim_link_latency_us));
    DS4_TRY(copy_str(t, "metrics.trace_file", "", c->trace_file, sizeof c->trace_file));
    DS4_TRY(copy_str(t, "training.device", "cpu", c->device, sizeof c->device));
    const struct ds4_kernel_backend *backend;
    DS4_TRY(ds4_backend_find("key training.device", c->device, &backend)); /* a typo fails before any work */
    const char *prec;
    DS4_TRY(ds4_toml_string_or(t, "training.matmul_precision", "fp32", &prec));
    if (strcmp(prec, "fp32") && strcmp(prec, "bf16"))
        return ds4_fail(DS4_ERR_CONFIG, "key training.matmul_precision: \"%s\" is not \"fp32\" or \"bf16\"", prec);
    c->matmul_precision = strcmp(prec, "bf16") ? DS4_MATMUL_FP32 : DS4_MATMUL_BF16;
    DS4_TRY(read_mixed_precision(t, c));
    DS4_TRY(ds4_toml_bool_or(t, "memory.swap_optimizer", false, &c->swap_optimizer));
    DS4_TRY(ds4_toml_bool_or(t, "memory.swap_layer_input", false, &c->swap_layer_input));
    DS4_TRY(copy_str(t, "memory.offload_dir", "", c->offload_dir, sizeof c->offload_dir));
    return check_ranges(c);
}

/* ------------------------------------------------------------------ value ranges
 * Every numeric key of the config with the range it must lie in, checked in one place when the config
 * is read: a NaN learning rate or a million threads is a one-line error naming the key, not a run that
 * saves NaN weights or overflows the stack. */
typedef enum { RANGE_INT, RANGE_FLOAT } range_kind;
typedef struct {
    const char *key;
    size_t off;            /* of the int64_t or double in ds4_train_cfg */
    range_kind kind;
    double lo, hi;         /* floats: finite and in the range; ints: in [lo, hi] (both exact in a double) */
    bool lo_open, hi_open; /* floats: (lo and hi) instead of [lo and hi] */
    const char *note;      /* what a special value means, or NULL */
} key_range;

#define MAX_COUNT 1e12           /* steps, intervals: far beyond any run, far below overflow */
#define MAX_BATCH (double)(1 << 24)
#define MAX_SEQ (double)(1 << 24)
#define I_(key, field, lo, hi, note) {key, offsetof(ds4_train_cfg, field), RANGE_INT, lo, hi, false, false, note}
#define F_(key, field, lo, hi, lo_open, hi_open) \
    {key, offsetof(ds4_train_cfg, field), RANGE_FLOAT, lo, hi, lo_open, hi_open, NULL}
static const key_range k_ranges[] = {
    I_("model.seed", init_seed, 0, MAX_COUNT, NULL),
    I_("training.steps", steps, 1, MAX_COUNT, NULL),
    I_("training.seq_len", seq_len, 2, MAX_SEQ, NULL),
    I_("training.micro_batch_size", micro_batch, 1, MAX_BATCH, NULL),
    I_("training.global_batch_size", global_batch, -1, MAX_BATCH, "-1: micro_batch_size x ranks"),
    I_("training.seed", seed, 0, MAX_COUNT, NULL),
    I_("training.threads", threads, 0, DS4_MAX_THREADS, "0: every core"),
    I_("training.csa_dense_steps", csa_dense_steps, 0, MAX_COUNT, NULL),
    F_("training.max_norm", max_norm, 0, INFINITY, false, true),
    F_("training.mtp_loss_weight", mtp_loss_weight, -1, 1e3, false, false),
    F_("training.indexer_loss_coeff", indexer_loss_coeff, -1, 1e3, false, false),
    F_("training.router_bias_gamma", router_bias_gamma, 0, 1, false, false),
    F_("optimizer.lr", adamw.lr, 0, INFINITY, true, true),
    F_("optimizer.beta1", adamw.beta1, 0, 1, false, true),
    F_("optimizer.beta2", adamw.beta2, 0, 1, false, true),
    F_("optimizer.eps", adamw.eps, 0, INFINITY, true, true),
    F_("optimizer.weight_decay", adamw.weight_decay, 0, INFINITY, false, true),
    F_("optimizer.momentum", muon.momentum, 0, 1, false, true),
    I_("optimizer.ns_steps", muon.ns_steps, 1, DS4_MUON_NS_MAX, NULL),
    I_("optimizer.ns_final_steps", muon.ns_final_steps, 0, DS4_MUON_NS_MAX, "the last ones of optimizer.ns_steps"),
    F_("optimizer.update_rms", muon.update_rms, 0, 10, true, false),
    I_("lr_scheduler.warmup_steps", sched.warmup_steps, 0, MAX_COUNT, NULL),
    I_("lr_scheduler.decay_steps", sched.total_steps, 0, MAX_COUNT, NULL),
    F_("lr_scheduler.min_lr", sched.min_lr, 0, INFINITY, false, true),
    I_("data.val_batches", val_batches, 0, 1e6, NULL),
    I_("checkpoint.interval", ckpt_interval, 0, MAX_COUNT, "0: only at the end"),
    I_("checkpoint.keep_latest_k", keep_latest_k, 0, 1e6, "0: keep all"),
    I_("checkpoint.load_step", load_step, -2, MAX_COUNT, "-1: the latest, -2: never resume"),
    I_("metrics.log_freq", log_freq, 1, MAX_COUNT, NULL),
    F_("metrics.peak_tflops", peak_tflops, 0, 1e9, false, false),
    I_("parallel.ep", ep, 1, 1 << 16, NULL),
    I_("parallel.prefetch_depth", prefetch_depth, 0, DS4_PREFETCH_MAX, "0: blocking collectives"),
    F_("parallel.sim_link_gbps", sim_link_gbps, 0, 1e6, false, false),
    F_("parallel.sim_link_latency_us", sim_link_latency_us, 0, 1e9, false, false),
    I_("parallelism.data_parallel_shard_degree", dp_shard, -1, 1 << 20, "-1: every rank"),
    I_("activation_checkpoint.selective_ac_option", ac_every, 0, 1 << 20, NULL),
};
#undef I_
#undef F_

/* "a finite number > 0", "a finite number in [0, 1)", "a finite number >= 0". */
static void describe_float_range(const key_range *r, char *buf, size_t n) {
    if (isinf(r->hi)) snprintf(buf, n, "a finite number %s %g", r->lo_open ? ">" : ">=", r->lo);
    else snprintf(buf, n, "a finite number in %c%g, %g%c", r->lo_open ? '(' : '[', r->lo, r->hi, r->hi_open ? ')' : ']');
}

static ds4_status check_range(const ds4_train_cfg *c, const key_range *r) {
    const char *p = (const char *)c + r->off;
    char want[96], note[96] = "";
    if (r->note) snprintf(note, sizeof note, " (%s)", r->note);
    if (r->kind == RANGE_INT) {
        int64_t v;
        memcpy(&v, p, sizeof v);
        if ((double)v >= r->lo && (double)v <= r->hi) return DS4_OK;
        return ds4_fail(DS4_ERR_CONFIG, "%s = %lld: expected an integer in [%.0f, %.0f]%s", titan_label(c, r->key),
                        (long long)v, r->lo, r->hi, note);
    }
    double v;
    memcpy(&v, p, sizeof v);
    bool ok = isfinite(v) && (r->lo_open ? v > r->lo : v >= r->lo) && (r->hi_open ? v < r->hi : v <= r->hi);
    if (ok) return DS4_OK;
    describe_float_range(r, want, sizeof want);
    return ds4_fail(DS4_ERR_CONFIG, "%s = %g: expected %s%s", titan_label(c, r->key), v, want, note);
}

static ds4_status check_ranges(const ds4_train_cfg *c) {
    for (size_t i = 0; i < sizeof k_ranges / sizeof k_ranges[0]; i++) DS4_TRY(check_range(c, &k_ranges[i]));
    if (c->muon.ns_final_steps > c->muon.ns_steps)
        return ds4_fail(DS4_ERR_CONFIG, "optimizer.ns_final_steps = %lld: more than optimizer.ns_steps = %lld",
                        (long long)c->muon.ns_final_steps, (long long)c->muon.ns_steps);
    int64_t tokens;
    if (!ds4_mul_i64(c->micro_batch, c->seq_len, &tokens) || tokens > INT32_MAX)
        return ds4_fail(DS4_ERR_CONFIG, "%s %lld x training.seq_len %lld: more than %d tokens per micro-batch",
                        titan_label(c, "training.micro_batch_size"), (long long)c->micro_batch, (long long)c->seq_len,
                        INT32_MAX);
    return DS4_OK;
}

/* The layout's checks that need only the config: the layout itself, the TorchTitan schedule's name. */
static ds4_status check_pipeline(const ds4_train_cfg *c, const ds4_config *mc) {
    ds4_pp_layout L;
    DS4_TRY(ds4_pp_layout_make(&c->recompute.pipe, mc->n_layers, mc->n_mtp_layers, &L));
    if (c->pp_schedule[0] && L.pp > 1) {
        const bool interleaved = !strcmp(c->pp_schedule, "Interleaved1F1B");
        if (interleaved != (L.vpp > 1))
            return ds4_fail(DS4_ERR_CONFIG, "key parallelism.pipeline_parallel_schedule = \"%s\" with %lld virtual "
                            "chunks per stage: 1F1B runs one chunk per stage, Interleaved1F1B more", c->pp_schedule,
                            (long long)L.vpp);
    }
    return DS4_OK;
}

/* Ranks that take different micro-batches: a pipeline's stages share theirs (world = pp x fsdp: fsdp data
 * ranks, each running its own pipeline). */
static int data_ranks(const ds4_train_cfg *c, int W) {
    const int64_t pp = c->recompute.pipe.pp;
    return pp > 1 && W % pp == 0 ? (int)(W / pp) : pp > 1 ? 1 : W;
}

/* A layout of more than one chunk runs as a pipeline of world = pp x fsdp ranks (docs/pipeline.md), each
 * stage's groups on its ranks (fsdp > 1: sharded over the stage's data ranks); what is not built under it
 * yet is refused here, before any work. */
static ds4_status check_pipeline_world(const ds4_train_cfg *c, const ds4_config *mc, int W) {
    ds4_pp_layout L;
    DS4_TRY(ds4_pp_layout_make(&c->recompute.pipe, mc->n_layers, mc->n_mtp_layers, &L));
    if (L.pp * L.vpp == 1) return DS4_OK;
    if (L.pp == 1)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline parallelism (pp 1, vpp %lld): virtual chunks on a single "
                        "stage are not built yet; run with pp > 1 under mpirun, or one chunk", (long long)L.vpp);
    if (W % L.pp)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline parallelism (pp %lld, vpp %lld) runs pp x fsdp ranks: start it "
                        "under mpirun -np %lld (one rank per stage) or a multiple of it (this world has %d)",
                        (long long)L.pp, (long long)L.vpp, (long long)L.pp, W);
    if (c->ep > 1 && W == L.pp)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline parallelism (pp %lld) with expert parallel %lld (key "
                        "parallel.ep): EP inside a stage divides its FSDP group; run pp x fsdp ranks (mpirun -np "
                        "%lld x fsdp)", (long long)L.pp, (long long)c->ep, (long long)L.pp);
    if (c->dp_shard > 0 && c->dp_shard != W / L.pp)
        return ds4_fail(DS4_ERR_CONFIG, "key parallelism.data_parallel_shard_degree = %lld: a pipeline of pp %lld on "
                        "%d ranks shards each stage over %lld; set -1 or %lld", (long long)c->dp_shard, (long long)L.pp,
                        W, (long long)(W / L.pp), (long long)(W / L.pp));
    if (W > L.pp && c->ckpt_per_rank)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline parallelism (pp %lld x fsdp %lld): key checkpoint.per_rank is "
                        "not built yet under a pipeline", (long long)L.pp, (long long)(W / L.pp));
    if (c->moe_fb_overlap)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline parallelism (pp %lld): --moe-fb-overlap is not built yet under "
                        "a pipeline", (long long)L.pp);
    return DS4_OK;
}

/* Checks that need only the config, so bad input fails before any work starts. */
static ds4_status check_cfg(const ds4_train_cfg *c, const ds4_config *mc) {
    if (!c->model_dir[0] == !c->model_config[0])
        return ds4_fail(DS4_ERR_CONFIG, "[model]: set exactly one of model.dir (weights) or model.config (random init)");
    if (c->steps < 1) return ds4_fail(DS4_ERR_CONFIG, "key training.steps: must be >= 1, got %lld", (long long)c->steps);
    if (c->micro_batch < 1 || c->global_batch < 1 || c->global_batch % c->micro_batch)
        return ds4_fail(DS4_ERR_CONFIG, "training.global_batch_size %lld is not a positive multiple of %s %lld",
                        (long long)c->global_batch, titan_label(c, "training.micro_batch_size"), (long long)c->micro_batch);
    if (c->seq_len < mc->window)
        return ds4_fail(DS4_ERR_CONFIG, "key training.seq_len: %lld is shorter than the attention window %lld",
                        (long long)c->seq_len, (long long)mc->window);
    for (int64_t l = 0; l < mc->n_layers; l++)
        if (mc->compress_ratios[l] > c->seq_len)
            return ds4_fail(DS4_ERR_CONFIG, "key training.seq_len: %lld is shorter than layer %lld's compress ratio %lld",
                            (long long)c->seq_len, (long long)l, (long long)mc->compress_ratios[l]);
    if (!c->train_data[0])
        return ds4_fail(DS4_ERR_CONFIG, "key %s: missing (a shard file or glob)", titan_label(c, "data.train"));
    if (c->log_freq < 1) return ds4_fail(DS4_ERR_CONFIG, "key metrics.log_freq: must be >= 1");
    if (c->ckpt_interval > 0 && !c->ckpt_folder[0])
        return ds4_fail(DS4_ERR_CONFIG, "key checkpoint.interval set but checkpoint.folder is empty");
    DS4_TRY(ds4_recompute_validate(&c->recompute, mc)); /* the pipeline layout's errors come first */
    return check_pipeline(c, mc);
}

/* Checks of the config against the world of W ranks (the same on every rank: all fail alike). */
static ds4_status check_parallel(const ds4_train_cfg *c, const ds4_config *mc, int W) {
    DS4_TRY(check_pipeline_world(c, mc, W));
    W = data_ranks(c, W);
    if (c->ep < 1 || W % c->ep || mc->n_routed_experts % c->ep)
        return ds4_fail(DS4_ERR_CONFIG,
                        "key %s: %lld must be >= 1 and divide the number of ranks (%d) and of routed experts (%lld)",
                        titan_label(c, "parallel.ep"), (long long)c->ep, W, (long long)mc->n_routed_experts);
    if (c->dp_shard > 0 && c->dp_shard != W)
        return ds4_fail(DS4_ERR_CONFIG,
                        "key parallelism.data_parallel_shard_degree = %lld: ds4 shards over every rank, and the world "
                        "has %d (mpirun -np); set -1 or %d", (long long)c->dp_shard, W, W);
    if (c->global_batch % (c->micro_batch * W))
        return ds4_fail(DS4_ERR_CONFIG, "training.global_batch_size %lld is not a multiple of %s %lld x %d ranks",
                        (long long)c->global_batch, titan_label(c, "training.micro_batch_size"), (long long)c->micro_batch, W);
    if (c->moe_fb_overlap && c->global_batch / (c->micro_batch * W) < 2)
        return ds4_fail(DS4_ERR_CONFIG,
                        "--moe-fb-overlap (parallel.moe_fb_overlap) needs 2 or more micro-batches per rank: "
                        "training.global_batch_size %lld / (training.micro_batch_size %lld x %d ranks) = %lld",
                        (long long)c->global_batch, (long long)c->micro_batch, W,
                        (long long)(c->global_batch / (c->micro_batch * W)));
    return DS4_OK;
}

/* ------------------------------------------------------------------ stop signals: finish the step, save, exit 0
 * SIGINT (Ctrl-C), SIGTERM (schedulers) and SIGUSR1: mpirun forwards SIGUSR1 to every rank, while it
 * answers Ctrl-C by terminating the ranks itself, so `kill -USR1 <mpirun pid>` stops a job cleanly. */
static volatile sig_atomic_t g_stop;
static void on_stop_signal(int sig) {
    (void)sig;
    g_stop = 1;
}
static const int k_stop_signals[] = {SIGINT, SIGTERM, SIGUSR1};
static void stop_signals(void (*handler)(int)) {
    for (size_t i = 0; i < sizeof k_stop_signals / sizeof k_stop_signals[0]; i++) signal(k_stop_signals[i], handler);
}

/* ------------------------------------------------------------------ data */
/* rank / W: of every W consecutive micro-batches of the one order, this rank takes the rank-th. */
static ds4_status loader_open(const char *pattern, int64_t B, int64_t T, uint64_t seed, bool shuffle, int64_t vocab,
                              int rank, int W, ds4_dataloader **out) {
    ds4_data_opts o = ds4_data_defaults();
    o.dp_rank = rank;
    o.dp_size = W;
    o.seq_len = T;
    o.batch_size = B;
    o.seed = seed;
    o.shuffle = shuffle;
    o.max_vocab = vocab;
    const char *pats[1] = {pattern};
    return ds4_data_open(pats, 1, &o, out);
}

static ds4_status loader_state_text(const ds4_dataloader *d, char *buf, size_t n) {
    ds4_data_state s;
    ds4_data_get_state(d, &s);
    snprintf(buf, n, "%llu %llu %llu %llu", (unsigned long long)s.epoch, (unsigned long long)s.position,
             (unsigned long long)s.seed, (unsigned long long)s.n_rows);
    return DS4_OK;
}

/* "epoch position seed rows": four decimal integers < 2^64 separated by one space, nothing else. */
static bool parse_data_state(const char *txt, uint64_t v[4]) {
    const char *p = txt;
    for (int k = 0; k < 4; k++) {
        if (k > 0 && *p++ != ' ') return false;
        if (*p < '0' || *p > '9') return false;
        char *end;
        errno = 0;
        unsigned long long x = strtoull(p, &end, 10);
        if (errno == ERANGE || end - p > 20) return false;
        v[k] = x;
        p = end;
    }
    return *p == 0;
}

static ds4_status loader_restore_text(ds4_dataloader *d, const char *path, const char *txt) {
    uint64_t v[4];
    if (!parse_data_state(txt, v))
        return ds4_fail(DS4_ERR_FORMAT, "%s/state.json: key data_state = \"%.100s\": expected \"epoch position seed rows\"",
                        path, txt);
    ds4_data_state s = {.epoch = v[0], .position = v[1], .seed = v[2], .n_rows = v[3]};
    return ds4_data_set_state(d, &s);
}

/* ------------------------------------------------------------------ the loop */
typedef struct {
    const ds4_train_cfg *cfg;
    ds4_train_state *s;
    ds4_model *m;     /* the state's model */
    ds4_comm *world;
    int rank, W;
    bool lead;        /* rank 0: prints, logs, writes the JSONL */
    ds4_dataloader *train;
    uint32_t masks[DS4_MAX_LAYERS];
    int32_t *ids;     /* [micro_batch, seq_len] */
    int64_t *loads;   /* [n_blocks, E] */
    FILE *jsonl;      /* rank 0: the metrics file, appended */
    ds4_tfevents *tb; /* rank 0: the TensorBoard event file (metrics.enable_tensorboard) */
    int lock_fd;      /* rank 0: the flock on the checkpoint folder, -1 when none */
    double peak_flops, flops_per_token; /* the MFU's denominator (FLOP/s per rank) and numerator per token */
    char peak_how[224];                 /* how peak_flops was obtained, for the header line */
    bool peak_raised;                   /* a step ran faster than the peak, which was raised to its rate */
    bool report_pending; /* --memory-report: print it for the run's first step */
    bool stopped;        /* a stop signal reached some rank: every rank stops after the same step */
    int64_t step;        /* the step running (for the reports) */
    ds4_pp_layout *layout; /* a pipeline (pp > 1): its layout, the world its ranks; NULL: none */
    double bubble[DS4_PP_MAX_CHUNKS]; /* a pipeline: [pp] each rank's bubble of the step (ds4_pp_run_rank) */
} trainer;

/* The settings that need the world or the model: TorchTitan's global batch -1 (micro_batch_size on
 * every rank) and activation checkpointing of every N-th layer (ds4 replays as many layers in full,
 * the first ones). */
static ds4_status resolve_for_run(ds4_train_cfg *c, const ds4_config *mc, int W) {
    W = data_ranks(c, W);
    if (c->global_batch == -1 && !ds4_mul_i64(c->micro_batch, W, &c->global_batch))
        return ds4_fail(DS4_ERR_CONFIG, "training.micro_batch_size x %d ranks overflows", W);
    if (c->ac_every > 0) {
        if (c->recompute.granularity != DS4_RECOMPUTE_GRAN_NONE)
            return ds4_fail(DS4_ERR_CONFIG, "activation_checkpoint.mode and --recompute-granularity: set one");
        c->recompute.granularity = DS4_RECOMPUTE_GRAN_FULL;
        c->recompute.method = c->ac_every == 1 ? DS4_RECOMPUTE_METHOD_UNIFORM : DS4_RECOMPUTE_METHOD_BLOCK;
        c->recompute.num_layers = (mc->n_layers + c->ac_every - 1) / c->ac_every;
        c->ac_every = 0;
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------ what a run description makes
 * The trainer and memplan (ds4_step_memory_of_run) read a run only through these four, so a setting of
 * ds4_train_cfg reaches both once it is here. */
ds4_status ds4_run_model(ds4_train_cfg *c, int W, ds4_config *mc, ds4_model_dir **d) {
    *d = NULL;
    if (c->model_dir[0]) {
        DS4_TRY(ds4_model_dir_open(c->model_dir, d));
        *mc = *ds4_model_dir_config(*d);
    } else {
        DS4_TRY(ds4_config_load(c->model_config, mc));
    }
    if (c->mtp_loss_weight >= 0) mc->mtp_loss_weight = c->mtp_loss_weight;
    if (c->indexer_loss_coeff >= 0) mc->indexer_loss_coeff = c->indexer_loss_coeff;
    ds4_status st = resolve_for_run(c, mc, W);
    if (st == DS4_OK) st = check_cfg(c, mc);
    if (st == DS4_OK) st = check_parallel(c, mc, W);
    if (st != DS4_OK) {
        ds4_model_dir_close(*d);
        *d = NULL;
    }
    return st;
}

ds4_status ds4_run_exec(const ds4_train_cfg *c, bool plan, ds4_exec *out) {
    *out = (ds4_exec){.plan = plan, .matmul_precision = c->matmul_precision};
    DS4_TRY(ds4_backend_find("key training.device", c->device[0] ? c->device : "cpu", &out->backend));
    return plan ? DS4_OK : ds4_backend_ready("key training.device", out->backend);
}

ds4_train_state_opts ds4_run_state_opts(const ds4_train_cfg *c, const ds4_exec *exec) {
    return (ds4_train_state_opts){.ep = (int)c->ep, .swap_optimizer = c->swap_optimizer,
                                  .swap_layer_input = c->swap_layer_input, .offload_dir = c->offload_dir,
                                  .exec = exec, .optimizer = c->optimizer, .bf16 = c->bf16_params,
                                  .per_rank_ckpt = c->ckpt_per_rank, .prefetch_depth = (int)c->prefetch_depth,
                                  .pipeline = c->recompute.pipe.pp > 1, .pp_cfg = &c->recompute.pipe};
}

ds4_step_args ds4_run_step_args(const ds4_train_cfg *c, int W, int64_t step, double lr, const uint32_t *masks) {
    return (ds4_step_args){.step = step,
                           .micro_batches = c->global_batch / (c->micro_batch * data_ranks(c, W)),
                           .B = c->micro_batch,
                           .T = c->seq_len,
                           .csa_dense = step <= c->csa_dense_steps,
                           .release_mask = masks,
                           .adamw = &c->adamw,
                           .own_cfg = c->optimizer == &ds4_optimizer_muon ? &c->muon : NULL,
                           .lr = lr,
                           .max_norm = c->max_norm,
                           .router_bias_gamma = c->router_bias_gamma,
                           .moe_fb_overlap = c->moe_fb_overlap};
}

static ds4_status open_model(ds4_train_cfg *c, trainer *tr) {
    ds4_config mc;
    ds4_model_dir *d = NULL;
    ds4_status st = ds4_run_model(c, tr->W, &mc, &d);
    if (st == DS4_OK && d && ds4_model_dir_mtp_absent(d) && tr->lead)
        printf("note: model.dir %s stores no MTP block (transformers' save_pretrained drops it): training without MTP\n",
               c->model_dir);
    /* training runs real steps (memplan opens the same state as a plan) */
    ds4_exec real;
    if (st == DS4_OK) st = ds4_run_exec(c, false, &real);
    const ds4_train_state_opts so = ds4_run_state_opts(c, &real);
    if (st == DS4_OK) st = ds4_train_state_open(&mc, d, (uint64_t)c->init_seed, tr->world, &so, &tr->s);
    if (st == DS4_OK) tr->m = ds4_train_state_model(tr->s);
    ds4_model_dir_close(d);
    return st;
}

/* ds4_train_step's source of micro-batches: the next one of this rank from the loader. */
static ds4_status next_micro_batch(void *ctx, int32_t *ids) {
    trainer *tr = ctx;
    return ds4_data_next(tr->train, ids);
}

/* --memory-report, the run's first step: per layer and unit, what the first micro-batch kept and replayed. */
static void report_units(void *ctx, int64_t micro, const ds4_pass *p) {
    trainer *tr = ctx;
    if (!tr->cfg->memory_report || micro != 0 || !tr->report_pending || !tr->lead) return;
    const ds4_config *mc = ds4_model_config(tr->m);
    fprintf(stderr, "memory report, step %lld (per layer and unit: kept/released bytes, replays)\n",
            (long long)tr->step);
    for (int64_t l = 0; l < mc->n_layers + mc->n_mtp_layers; l++)
        for (int u = 0; u < DS4_NUM_UNITS; u++) {
            ds4_unit_report r = ds4_pass_unit_report(p, l, u);
            if (!r.bytes) continue;
            fprintf(stderr, "  layer %2lld %-13s %10lld B %-8s replays %lld (%.3f ms)\n", (long long)l,
                    ds4_unit_name(u), (long long)r.bytes, r.released ? "released" : "kept", (long long)r.replays,
                    1e3 * r.replay_seconds);
        }
}

/* The arguments of step `step` of this run. */
static ds4_step_args step_args(trainer *tr, int64_t step, double lr) {
    ds4_step_args a = ds4_run_step_args(tr->cfg, tr->W, step, lr, ds4_recompute_any(&tr->cfg->recompute) ? tr->masks : NULL);
    a.ids = tr->ids;
    a.next_ids = next_micro_batch;
    a.ctx = tr;
    a.loads = tr->loads;
    a.on_pass = report_units;
    if (tr->layout) a.pipe = ds4_train_state_pipe(tr->s), a.layout = tr->layout, a.pp_bubble = tr->bubble;
    return a;
}

/* Seconds since the epoch: TensorBoard's wall_time. */
static double wall_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The scalars of a logged step, under the names of the JSONL file's keys (pp_bubble under a pipeline). */
static ds4_status tb_step(trainer *tr, int64_t step, const ds4_step_result *r, double lr, const double m[5]) {
    if (!tr->tb) return DS4_OK;
    static const char *const tags[] = {"loss", "mtp_loss", "indexer_loss", "grad_norm", "lr",
                                       "memory_gib", "tps", "tflops", "mfu", "pp_bubble"};
    const double v[] = {r->loss, r->mtp_loss, r->indexer_loss, r->grad_norm, lr, m[0], m[1], m[2], m[3], m[4]};
    return ds4_tfevents_scalars(tr->tb, step, wall_clock(), (int)(sizeof v / sizeof v[0]) - !tr->layout, tags, v);
}

/* The pipeline's bubble of the step: the mean over its ranks of each one's idle share, and the largest. */
static void bubble_of(const trainer *tr, double *mean, double *max) {
    *mean = *max = 0;
    for (int64_t i = 0; tr->layout && i < tr->layout->pp; i++) {
        *mean += tr->bubble[i] / (double)tr->layout->pp;
        if (tr->bubble[i] > *max) *max = tr->bubble[i];
    }
}

/* The metrics line's pipeline fields: the bubble's mean, max and each rank's. */
static void jsonl_bubble(const trainer *tr, double mean, double max) {
    fprintf(tr->jsonl, ", \"pp_bubble\": %.6f, \"pp_bubble_max\": %.6f, \"pp_bubble_ranks\": [", mean, max);
    for (int64_t i = 0; i < tr->layout->pp; i++) fprintf(tr->jsonl, "%s%.6f", i ? ", " : "", tr->bubble[i]);
    fprintf(tr->jsonl, "]");
}

/* Seconds of a step: its wall time, and the parts of it spent blocked in FSDP and EP collectives. */
typedef struct {
    double wall, fsdp, ep, other;
} step_times;

/* The step's breakdown appended to the TorchTitan line (several ranks): compute is the step's time not
 * spent waiting in a collective; fsdp and ep the exposed communication of each. */
static void print_breakdown(const step_times *t) {
    printf("  compute %.3fs  exposed_fsdp %.3fs  exposed_ep %.3fs", t->wall - t->fsdp - t->ep - t->other, t->fsdp,
           t->ep);
}

static ds4_status log_step(trainer *tr, int64_t step, const ds4_step_result *r, double lr, const step_times *t) {
    const double dt = t->wall;
    const ds4_train_cfg *c = tr->cfg;
    ds4_mem_stats ms;
    ds4_mem_get(&ms);
    double tokens = (double)(c->global_batch * c->seq_len) / (double)tr->W; /* per rank, as TorchTitan */
    double tps = tokens / dt, tflops = tps * tr->flops_per_token / 1e12;
    /* MFU never exceeds 100%: a step that ran faster than the peak shows the peak was too low, so the peak
     * becomes that step's rate (said once in the log) and later steps are measured against it. */
    const double rate = tps * tr->flops_per_token;
    if (tr->peak_flops > 0 && rate > tr->peak_flops) {
        if (tr->lead && !tr->peak_raised)
            printf("note: step %lld ran at %.1f GFLOP/s, above the peak of %.1f GFLOP/s (%s): that peak was too low; "
                   "mfu is measured against the fastest step's rate from now on\n",
                   (long long)step, rate / 1e9, tr->peak_flops / 1e9, tr->peak_how);
        tr->peak_raised = true;
        tr->peak_flops = rate;
    }
    double mfu = tr->peak_flops > 0 ? 100.0 * rate / tr->peak_flops : 0;
    double gib = (double)ms.peak_total / (1024.0 * 1024.0 * 1024.0), bubble, bubble_max;
    bubble_of(tr, &bubble, &bubble_max);
    if (tr->lead && (step == 1 || step % c->log_freq == 0 || step == c->steps)) {
        printf("step %5lld  loss %7.4f  grad_norm %7.4f  memory %6.3fGiB  tps %8.0f  tflops %6.3f  mfu %5.2f%%",
               (long long)step, r->loss, r->grad_norm, gib, tps, tflops, mfu);
        if (tr->W > 1) print_breakdown(t);
        if (tr->layout) printf("  bubble %4.1f%%", 100.0 * bubble);
        printf("\n");
        fflush(stdout);
        if (tr->jsonl) {
            fprintf(tr->jsonl,
                    "{\"step\": %lld, \"loss\": %.6f, \"mtp_loss\": %.6f, \"indexer_loss\": %.6f, \"total_loss\": %.6f, "
                    "\"grad_norm\": %.6f, \"lr\": %.6g, \"memory_gib\": %.6f, \"memory_bytes\": %lld, "
                    "\"activation_peak_bytes\": %lld, \"tps\": %.2f, \"tflops\": %.6f, \"mfu\": %.4f, \"step_time\": %.6f",
                    (long long)step, r->loss, r->mtp_loss, r->indexer_loss, r->total_loss, r->grad_norm, lr, gib,
                    (long long)ms.peak_total,
                    (long long)ms.peak[DS4_MEM_ACT], tps, tflops, mfu, dt);
            if (tr->W > 1)
                fprintf(tr->jsonl, ", \"compute_time\": %.6f, \"exposed_fsdp_time\": %.6f, \"exposed_ep_time\": %.6f",
                        t->wall - t->fsdp - t->ep - t->other, t->fsdp, t->ep);
            if (tr->layout) jsonl_bubble(tr, bubble, bubble_max);
            fprintf(tr->jsonl, "}\n");
            if (fflush(tr->jsonl) != 0 || ferror(tr->jsonl))
                return ds4_fail(DS4_ERR_IO, "%s: cannot write the metrics of step %lld: %s", c->jsonl, (long long)step,
                                strerror(errno));
        }
        return tb_step(tr, step, r, lr, (const double[5]){gib, tps, tflops, mfu, bubble});
    }
    return DS4_OK;
}

/* A diverged state (NaN / Inf weights or moments) is never saved: the earlier checkpoints stay. */
static ds4_status save_ckpt(trainer *tr, int64_t step) {
    DS4_TRY(ds4_train_state_check_finite(tr->s, step));
    ds4_ckpt_meta meta = {.step = step, .seed = (uint64_t)tr->cfg->seed};
    DS4_TRY(loader_state_text(tr->train, meta.data_state, sizeof meta.data_state));
    ds4_status st = ds4_train_state_save(tr->s, tr->cfg->ckpt_folder, tr->cfg->keep_latest_k, &meta);
    if (st == DS4_OK && tr->lead) printf("saved checkpoint step %lld to %s\n", (long long)step, tr->cfg->ckpt_folder);
    return st;
}

/* A checkpoint of the other optimizer: the Muon group's state starts from zero, the rest is kept. */
static ds4_status switch_optimizer(trainer *tr, const ds4_ckpt_meta *meta) {
    int64_t elements, matrices;
    DS4_TRY(ds4_train_state_switch_optimizer(tr->s, meta, &elements, &matrices));
    if (!tr->lead || matrices == 0) return DS4_OK;
    if (tr->cfg->optimizer == &ds4_optimizer_muon)
        printf("optimizer switched AdamW -> Muon at resume: the Muon momentum of %lld matrices (%lld elements) starts "
               "at zero (new); the AdamW moments of the AdamW group and the step count are kept\n",
               (long long)matrices, (long long)elements);
    else
        printf("optimizer switched Muon -> AdamW at resume: the AdamW moments of the %lld former Muon matrices (%lld "
               "elements) start at zero (new); the AdamW moments of the AdamW group and the step count are kept\n",
               (long long)matrices, (long long)elements);
    return DS4_OK;
}

/* Loads the requested checkpoint if the folder has one; returns the step to continue after. */
static ds4_status maybe_resume(trainer *tr, int64_t *start) {
    const ds4_train_cfg *c = tr->cfg;
    *start = 0;
    if (!c->ckpt_folder[0] || c->load_step == -2) return DS4_OK;
    char path[4096];
    if (ds4_checkpoint_find(c->ckpt_folder, c->load_step, path, sizeof path) != DS4_OK) {
        if (c->load_step >= 0) return DS4_ERR_MISSING; /* asked for a step that is not there */
        return DS4_OK;                                 /* nothing to resume: fresh run */
    }
    ds4_ckpt_meta meta;
    DS4_TRY(ds4_checkpoint_check_config(path, ds4_model_config(tr->m)));
    DS4_TRY(ds4_train_state_load(tr->s, path, &meta));
    DS4_TRY(switch_optimizer(tr, &meta));
    DS4_TRY(loader_restore_text(tr->train, path, meta.data_state));
    *start = meta.step;
    if (tr->lead) printf("resumed from %s (step %lld)\n", path, (long long)meta.step);
    return DS4_OK;
}

/* The step of a metrics line ({"step": N, ...}), or -1 when it is not one. */
static int64_t metrics_line_step(const char *line, size_t n) {
    static const char head[] = "{\"step\": ";
    const size_t h = sizeof head - 1;
    if (n <= h || memcmp(line, head, h) != 0) return -1;
    int64_t s = 0;
    size_t i = h;
    for (; i < n && line[i] >= '0' && line[i] <= '9' && s < INT64_MAX / 10 - 10; i++) s = s * 10 + (line[i] - '0');
    return i > h && i < n && line[i] == ',' ? s : -1;
}

/* The metrics file keeps the complete lines of steps <= `last` (the steps before a resume; a killed run
 * re-runs the later ones), rewritten atomically; then the file is reopened for appending. */
static ds4_status truncate_metrics(trainer *tr, int64_t last) {
    const char *path = tr->cfg->jsonl;
    char *txt = NULL;
    size_t len = 0;
    if (access(path, F_OK) != 0) return DS4_OK;
    DS4_TRY(ds4_read_file(path, &txt, &len));
    size_t w = 0;
    for (size_t i = 0; i < len;) {
        const char *nl = memchr(txt + i, '\n', len - i);
        if (!nl) break; /* a line cut by a kill: dropped */
        size_t n = (size_t)(nl - (txt + i)) + 1;
        int64_t step = metrics_line_step(txt + i, n);
        if (step >= 0 && step <= last) {
            memmove(txt + w, txt + i, n);
            w += n;
        }
        i += n;
    }
    ds4_status st = w == len ? DS4_OK : ds4_write_file_atomic(path, txt, w);
    ds4_free(txt);
    if (st != DS4_OK || w == len) return st;
    if (tr->jsonl && fclose(tr->jsonl) != 0) st = ds4_fail(DS4_ERR_IO, "%s: cannot close: %s", path, strerror(errno));
    tr->jsonl = fopen(path, "a");
    if (!tr->jsonl && st == DS4_OK)
        st = ds4_fail(DS4_ERR_IO, "%s: cannot open the metrics file: %s", path, strerror(errno));
    return st;
}

/* Where the run continues: the checkpoint (or 0), and on rank 0 the metrics file cut back to it. */
static ds4_status resume_and_trim(trainer *tr, int64_t *start) {
    DS4_TRY(maybe_resume(tr, start));
    const ds4_train_cfg *c = tr->cfg;
    if (tr->tb && *start > 0) DS4_TRY(ds4_tfevents_restart(tr->tb, *start + 1, wall_clock()));
    if (!tr->lead || !tr->jsonl || !c->ckpt_folder[0] || c->load_step == -2) return DS4_OK;
    return truncate_metrics(tr, *start);
}

/* Validation under a pipeline: the batches through ds4_pp_eval_rank in groups (each rank runs its chunks'
 * forwards; every rank reads the same batches), a group's losses added to *sum in batch order, as the
 * one-process loop adds them. A group is 8 micro-batches a chunk (the pipeline full past its fill) within
 * the tags; a stop signal on any rank ends it before a group, on every rank alike. */
static ds4_status validate_pipelined(trainer *tr, ds4_dataloader *v, int64_t batches, double *sum, int64_t *n) {
    const ds4_train_cfg *c = tr->cfg;
    const int64_t nc = tr->layout->pp * tr->layout->vpp, per = c->micro_batch * c->seq_len; /* checked sizes */
    int64_t group = 8 * nc < 32767 / nc ? 8 * nc : 32767 / nc;
    if (group > batches) group = batches;
    if (group < 1) group = 1;
    int32_t *ids = ds4_alloc(DS4_MEM_OTHER, (size_t)(group * per) * sizeof(int32_t)); /* [group, B, T] */
    if (!ids) return ds4_fail(DS4_ERR_OOM, "out of memory for %lld validation micro-batches", (long long)group);
    const ds4_pass_opts o = {.need_backward = false, .bf16_acts = ds4_train_state_bf16(tr->s),
                             .hooks = ds4_train_state_hooks(tr->s)}; /* pp x fsdp: the stage's FSDP gathers */
    ds4_status st = DS4_OK;
    while (st == DS4_OK && *n < batches) {
        int64_t stop = g_stop ? 1 : 0;
        st = ds4_comm_sum_i64(tr->world, &stop, 1);
        if (st != DS4_OK || stop) break;
        const int64_t g = batches - *n < group ? batches - *n : group;
        for (int64_t i = 0; i < g && st == DS4_OK; i++) st = ds4_data_next(v, ids + i * per);
        const ds4_pp_local_args a = {.layout = tr->layout, .micro_batches = g, .B = c->micro_batch,
                                     .T = c->seq_len, .ids = ids, .opts = &o};
        if (st == DS4_OK) st = ds4_pp_eval_rank(tr->m, ds4_train_state_pipe(tr->s), &a, sum);
        if (st == DS4_OK) *n += g;
    }
    ds4_free(ids);
    return st;
}

static ds4_status run_validation(trainer *tr) {
    const ds4_train_cfg *c = tr->cfg;
    if (!c->val_data[0] || c->val_batches <= 0) return DS4_OK;
    ds4_dataloader *v;
    DS4_TRY(loader_open(c->val_data, c->micro_batch, c->seq_len, (uint64_t)c->seed, false,
                        ds4_model_config(tr->m)->vocab_size, 0, 1, &v)); /* every rank: the same batches */
    /* at most one pass over the validation rows (at least one batch, as the loader wraps) */
    int64_t batches = ds4_data_n_rows(v) / c->micro_batch;
    if (batches < 1) batches = 1;
    if (batches > c->val_batches) batches = c->val_batches;
    double sum = 0;
    int64_t n = 0;
    ds4_status st = tr->layout ? validate_pipelined(tr, v, batches, &sum, &n) : DS4_OK;
    for (int64_t b = 0; !tr->layout && b < batches && st == DS4_OK && !g_stop; b++) { /* a stop signal ends it too */
        st = ds4_data_next(v, tr->ids);
        ds4_pass_opts o = {.need_backward = false, .hooks = ds4_train_state_hooks(tr->s),
                           .bf16_acts = ds4_train_state_bf16(tr->s)};
        ds4_pass *p = NULL;
        if (st == DS4_OK) st = ds4_forward(tr->m, tr->ids, c->micro_batch, c->seq_len, &o, &p);
        if (st == DS4_OK) {
            sum += ds4_pass_losses(p)->loss;
            n++;
        }
        ds4_pass_free(p);
    }
    ds4_data_close(v);
    if (st == DS4_OK && n > 0 && tr->lead) {
        printf("validation loss %.4f ppl %.2f (%lld batches)\n", sum / (double)n, exp(sum / (double)n), (long long)n);
        const char *tag = "val_loss";
        const double loss = sum / (double)n;
        if (tr->tb) st = ds4_tfevents_scalars(tr->tb, tr->step, wall_clock(), 1, &tag, &loss);
    }
    return st;
}

/* A stop signal on any rank stops every rank after the same step (a collective when sharded). */
static ds4_status check_stop(trainer *tr) {
    int64_t any = g_stop ? 1 : 0;
    if (tr->W > 1) DS4_TRY(ds4_comm_sum_i64(tr->world, &any, 1));
    tr->stopped = any > 0;
    return DS4_OK;
}

static void print_model_line(trainer *tr) {
    const ds4_train_cfg *c = tr->cfg;
    const ds4_config *mc = ds4_model_config(tr->m);
    char rc[64];
    printf("model: %lld parameters, %lld layers + %lld MTP; %.3f MFLOPs/token (train, sparse-aware); "
           "peak %.1f GFLOP/s (%s), %s matmul; recompute %s; %d threads\n",
           (long long)ds4_train_state_numel(tr->s), (long long)mc->n_layers, (long long)mc->n_mtp_layers,
           tr->flops_per_token / 1e6, tr->peak_flops / 1e9, tr->peak_how,
           ds4_matmul_precision_name(ds4_train_state_exec(tr->s)->matmul_precision),
           ds4_recompute_describe(&c->recompute, rc, sizeof rc), ds4_get_threads());
    if (c->optimizer == &ds4_optimizer_muon) {
        static const char *const adjust[] = {"rms_norm", "spectral_norm", "none"};
        printf("optimizer: Muon for the matrices (momentum %g%s, %lld Newton-Schulz iterations of which %lld final, "
               "adjust_lr %s, update_rms %g), AdamW for the rest\n",
               c->muon.momentum, c->muon.nesterov ? " Nesterov" : "", (long long)c->muon.ns_steps,
               (long long)c->muon.ns_final_steps, adjust[c->muon.adjust], c->muon.update_rms);
    }
    if (c->swap_optimizer || c->swap_layer_input)
        printf("offload: %s%s%s to %s\n", c->swap_optimizer ? "optimizer state" : "",
               c->swap_optimizer && c->swap_layer_input ? ", " : "", c->swap_layer_input ? "layer inputs" : "",
               c->offload_dir[0] ? c->offload_dir : "$TMPDIR or /tmp");
    const int F = ds4_train_state_data_ranks(tr->s);
    if (tr->layout && F == 1)
        printf("parallel: pipeline of %lld stages x %lld chunks (world = pp, each rank holds its stage's parameters, "
               "gradients and optimizer state), %lld micro-batches per step\n", (long long)tr->layout->pp,
               (long long)tr->layout->vpp, (long long)(c->global_batch / c->micro_batch));
    else if (tr->layout)
        printf("parallel: pipeline of %lld stages x %lld chunks x FSDP over %d data ranks (world = pp x fsdp, rank = "
               "stage x %d + data rank; each stage's parameters, gradients and optimizer state sharded over its data "
               "ranks, expert parallel %lld inside each stage), %lld micro-batches per data rank per step\n",
               (long long)tr->layout->pp, (long long)tr->layout->vpp, F, F, (long long)c->ep,
               (long long)(c->global_batch / (c->micro_batch * F)));
    else if (tr->W > 1)
        printf("parallel: %d ranks, FSDP over %d, expert parallel %lld (%lld micro-batches per rank per step)\n", tr->W,
               tr->W, (long long)c->ep, (long long)(c->global_batch / (c->micro_batch * tr->W)));
}

/* A pipeline: what each rank holds once its state is set up, as the allocator counts it (rank 0 prints one
 * line per rank): parameters (its groups' values with their bf16 copy, the integer tables), gradients and
 * optimizer state, beside the bytes of the regions of its groups (ds4_model_held_bytes). */
static ds4_status print_stage_memory(trainer *tr) {
    enum { K = 5 };
    ds4_mem_stats ms;
    ds4_mem_get(&ms);
    const int64_t mine[K] = {ms.live[DS4_MEM_PARAM], ds4_model_held_bytes(tr->m, false), ms.live[DS4_MEM_GRAD],
                             ds4_model_held_bytes(tr->m, true), ms.live[DS4_MEM_OPTIM]};
    int64_t *all = ds4_alloc(DS4_MEM_OTHER, (size_t)(K * tr->W) * sizeof(int64_t));
    int64_t *cd = ds4_alloc(DS4_MEM_OTHER, 2 * (size_t)tr->W * sizeof(int64_t));
    ds4_status st = all && cd ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory gathering the stages' memory");
    for (int r = 0; st == DS4_OK && r < tr->W; r++) cd[r] = K, cd[tr->W + r] = (int64_t)K * r;
    if (st == DS4_OK) st = ds4_comm_allgatherv(tr->world, mine, K, all, cd, cd + tr->W, sizeof(int64_t));
    for (int r = 0; st == DS4_OK && tr->lead && r < tr->W; r++) {
        const int64_t *x = all + K * r;
        if (ds4_train_state_data_ranks(tr->s) > 1) /* pp x fsdp: world rank = stage x fsdp + data rank */
            printf("rank %d (stage %d, data rank %d) holds: parameters %lld bytes, gradients %lld bytes, optimizer "
                   "state %lld bytes\n", r, r / ds4_train_state_data_ranks(tr->s), r % ds4_train_state_data_ranks(tr->s),
                   (long long)x[0], (long long)x[2], (long long)x[4]);
        else printf("pipeline rank %d holds: parameters %lld bytes (its groups' values %lld), gradients %lld bytes (its "
               "groups' %lld), optimizer state %lld bytes\n", r, (long long)x[0], (long long)x[1], (long long)x[2],
               (long long)x[3], (long long)x[4]);
    }
    ds4_free(all);
    ds4_free(cd);
    return st;
}

/* The peaks of the run's first step by category (--memory-report). */
static void report_peaks(trainer *tr, int64_t step) {
    if (tr->report_pending && tr->lead) {
        ds4_mem_stats ms;
        ds4_mem_get(&ms);
        fprintf(stderr, "  step %lld peak by category:", (long long)step);
        for (int k = 0; k < DS4_MEM_NCAT; k++)
            fprintf(stderr, " %s %lld", ds4_mem_cat_name((ds4_mem_cat)k), (long long)ms.peak[k]);
        fprintf(stderr, "; total %lld bytes\n", (long long)ms.peak_total);
    }
    tr->report_pending = false;
}

/* The steps after `start`. On failure *agreed says whether every rank failed the same way: a
 * non-finite loss or norm (both global) and a failed save (ds4_train_state_save agrees) are; anything
 * else may be this rank's alone. */
static ds4_status run_steps(trainer *tr, int64_t start, int64_t *last, bool *agreed) {
    const ds4_train_cfg *c = tr->cfg;
    ds4_status st = DS4_OK;
    int64_t step = start;
    *agreed = false;
    while (step < c->steps && st == DS4_OK && !tr->stopped) {
        step++;
        double t0 = ds4_now(), lr = ds4_lr_at(&c->sched, step), x0[DS4_NUM_LANES], x1[DS4_NUM_LANES];
        ds4_comm_exposed(x0);
        ds4_mem_reset_peak();
        tr->step = step;
        const ds4_step_args args = step_args(tr, step, lr);
        ds4_step_result r;
        st = ds4_train_step(tr->s, &args, &r);
        if (st != DS4_OK) {
            *agreed = r.agreed;
            break;
        }
        ds4_comm_exposed(x1);
        const step_times t = {ds4_now() - t0, x1[DS4_LANE_FSDP] - x0[DS4_LANE_FSDP], x1[DS4_LANE_EP] - x0[DS4_LANE_EP],
                              x1[DS4_LANE_OTHER] - x0[DS4_LANE_OTHER]};
        report_peaks(tr, step); /* after the whole step (its last part, the router bias rule, allocates nothing) */
        st = ds4_train_agree(tr->world, log_step(tr, step, &r, lr, &t)); /* rank 0 writes */
        if (st != DS4_OK) {
            *agreed = true;
            break;
        }
        if (c->ckpt_folder[0] && c->ckpt_interval > 0 && step % c->ckpt_interval == 0 && step < c->steps) {
            st = save_ckpt(tr, step);
            *agreed = st != DS4_OK;
            if (st != DS4_OK) break;
        }
        st = check_stop(tr);
    }
    *last = step;
    return st;
}

static ds4_status train_loop(trainer *tr, bool *agreed) {
    const ds4_train_cfg *c = tr->cfg;
    int64_t start = 0, step = 0;
    ds4_status st = ds4_train_agree(tr->world, resume_and_trim(tr, &start));
    if (st != DS4_OK) return st;
    tr->flops_per_token = ds4_train_flops_per_token(ds4_model_config(tr->m), c->seq_len);
    if (c->peak_tflops > 0) {
        tr->peak_flops = c->peak_tflops * 1e12;
        snprintf(tr->peak_how, sizeof tr->peak_how, "metrics.peak_tflops = %g", c->peak_tflops);
    } else {
        const ds4_peak pk = ds4_probe_peak(ds4_train_state_exec(tr->s));
        tr->peak_flops = pk.flops;
        snprintf(tr->peak_how, sizeof tr->peak_how, "%s", pk.how);
    }
    if (tr->lead) print_model_line(tr);
    if (tr->layout) DS4_TRY(ds4_train_agree(tr->world, print_stage_memory(tr)));
    st = check_stop(tr); /* a stop signal during start-up: no step at all */
    if (st == DS4_OK) st = ds4_comm_set_link(c->sim_link_gbps, c->sim_link_latency_us);
    if (st == DS4_OK && c->trace_file[0]) st = ds4_trace_begin(tr->world);
    if (st == DS4_OK) st = run_steps(tr, start, &step, agreed);
    /* the trace is written after the steps (a collective); a failed step leaves no file */
    if (c->trace_file[0]) {
        ds4_status ts = ds4_trace_end(st == DS4_OK ? tr->world : NULL, c->trace_file);
        if (st == DS4_OK && (st = ds4_train_agree(tr->world, ts)) != DS4_OK) *agreed = true;
    }
    (void)ds4_comm_set_link(0, 0);
    if (st == DS4_OK && c->ckpt_folder[0] && step > start) {
        st = save_ckpt(tr, step);
        *agreed = true;
    }
    if (tr->stopped && st == DS4_OK && tr->lead) {
        if (step > start) printf("interrupted: saved step %lld, exiting\n", (long long)step);
        else printf("interrupted before the first step, exiting\n");
    }
    if (st == DS4_OK && !tr->stopped) {
        *agreed = false;
        st = run_validation(tr);
    }
    return st;
}

/* Rank 0, before any work: the checkpoint folder is writable and this run's alone (a second run on it
 * fails here instead of resuming the first one's steps), the metrics file can be appended to. Every
 * folder a path names is created as by mkdir -p (TorchTitan's ./outputs/checkpoint included). */
static ds4_status open_outputs(trainer *tr) {
    const ds4_train_cfg *c = tr->cfg;
    if (c->ckpt_folder[0]) DS4_TRY(ds4_checkpoint_lock(c->ckpt_folder, &tr->lock_fd));
    if (c->jsonl[0]) DS4_TRY(ds4_mkdirs_parent(c->jsonl, "folder of the metrics file"));
    if (c->trace_file[0]) DS4_TRY(ds4_mkdirs_parent(c->trace_file, "folder of the trace file"));
    if (c->jsonl[0] && !(tr->jsonl = fopen(c->jsonl, "a")))
        return ds4_fail(DS4_ERR_IO, "%s: cannot open the metrics file: %s", c->jsonl, strerror(errno));
    if (c->tb_folder[0]) DS4_TRY(ds4_tfevents_open(c->tb_folder, wall_clock(), &tr->tb));
    return DS4_OK;
}

ds4_status ds4_train_run_world(const ds4_train_cfg *cfg, bool *agreed) {
    ds4_comm *world = ds4_comm_world();
    ds4_train_cfg run = *cfg; /* completed for this world and model by resolve_for_run */
    const ds4_train_cfg *c = &run;
    trainer tr = {.cfg = c, .report_pending = c->memory_report, .world = world, .rank = ds4_comm_rank(world),
                  .W = ds4_comm_size(world), .lock_fd = -1};
    tr.lead = tr.rank == 0;
    *agreed = true;
    ds4_status st = check_ranges(c); /* also for a cfg filled by a program, not by ds4_train_cfg_from_toml */
    if (st != DS4_OK) return st;
    g_stop = 0;
    stop_signals(on_stop_signal); /* from the start: a signal once the run's files exist is handled */
    if (c->threads > 0) ds4_set_threads((int)c->threads);
    st = ds4_train_agree(world, tr.lead ? open_outputs(&tr) : DS4_OK); /* before any work */
    if (st == DS4_OK && c->offload_dir[0] && (c->swap_optimizer || c->swap_layer_input)) /* each rank's own */
        st = ds4_train_agree(world, ds4_mkdirs(c->offload_dir, "offload folder"));
    if (st == DS4_OK) st = open_model(&run, &tr);
    const ds4_config *mc = tr.m ? ds4_model_config(tr.m) : NULL;
    const bool pipe = c->recompute.pipe.pp > 1; /* every stage reads every micro-batch's ids */
    if (st == DS4_OK && pipe) {
        tr.layout = ds4_alloc(DS4_MEM_OTHER, sizeof *tr.layout);
        st = tr.layout ? ds4_pp_layout_make(&c->recompute.pipe, mc->n_layers, mc->n_mtp_layers, tr.layout)
                       : ds4_fail(DS4_ERR_OOM, "out of memory for the pipeline layout");
    }
    if (st == DS4_OK)
        st = loader_open(c->train_data, c->micro_batch, c->seq_len, (uint64_t)c->seed, true, mc->vocab_size,
                         pipe ? tr.rank % data_ranks(c, tr.W) : tr.rank, data_ranks(c, tr.W), &tr.train);
    if (st == DS4_OK) {
        int64_t tokens = 0, loads = 0; /* [micro_batch, seq_len], [n_blocks, E]: sizes checked before */
        bool sized = ds4_mul_i64(c->micro_batch, c->seq_len, &tokens) &&
                     ds4_mul_i64(mc->n_layers + mc->n_mtp_layers, mc->n_routed_experts, &loads);
        tr.ids = sized ? ds4_alloc(DS4_MEM_OTHER, (size_t)tokens * sizeof(int32_t)) : NULL;
        tr.loads = sized ? ds4_calloc(DS4_MEM_OTHER, (size_t)loads * sizeof(int64_t)) : NULL;
        if (!tr.ids || !tr.loads)
            st = ds4_fail(DS4_ERR_OOM, "out of memory for a micro-batch of %lld x %lld tokens",
                          (long long)c->micro_batch, (long long)c->seq_len);
    }
    if (st == DS4_OK) ds4_recompute_masks(&c->recompute, mc, tr.masks);
    st = ds4_train_agree(world, st); /* a rank that cannot start stops them all */
    if (st == DS4_OK) st = train_loop(&tr, agreed);
    if (tr.jsonl && fclose(tr.jsonl) != 0 && st == DS4_OK) {
        st = ds4_fail(DS4_ERR_IO, "%s: cannot write the metrics: %s", c->jsonl, strerror(errno));
        *agreed = true; /* rank 0 reports it; the others have nothing left to wait for */
    }
    ds4_status tb_st = ds4_tfevents_close(tr.tb);
    if (tb_st != DS4_OK && st == DS4_OK) {
        st = tb_st;
        *agreed = true; /* as for the metrics file */
    }
    ds4_checkpoint_unlock(tr.lock_fd);
    ds4_free(tr.ids);
    ds4_free(tr.loads);
    ds4_free(tr.layout);
    ds4_data_close(tr.train);
    ds4_train_state_free(tr.s);
    stop_signals(SIG_DFL);
    return st;
}

ds4_status ds4_train_run(const ds4_train_cfg *c) {
    bool agreed;
    return ds4_train_run_world(c, &agreed);
}
