/* Model subcommands: init, inspect, debug-state. */
#include "cli.h"
#include "cmds.h"
#include "ds4/actstore.h"
#include "ds4/io.h"
#include "ds4/kernels.h"
#include "ds4/model.h"
#include "ds4/offload.h"
#include "ds4/recompute.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define NFLAGS(f) ((int)(sizeof(f) / sizeof((f)[0])))

/* ------------------------------------------------------------------ the census of a config (--dry-run) */
static void print_census(const char *path, const ds4_config *c, const ds4_param_census *k) {
    printf("config %s: valid; %lld layers + %lld MTP, %lld routed experts (%lld per token) + %lld shared, "
           "%lld hash layers\n",
           path, (long long)c->n_layers, (long long)c->n_mtp_layers, (long long)c->n_routed_experts,
           (long long)c->n_activated_experts, (long long)c->n_shared_experts, (long long)c->n_hash_layers);
    if (c->dspark_n_stages)
        printf("DSpark drafter: %lld stages (carried through training, checkpoints and export; not trained)\n",
               (long long)c->dspark_n_stages);
    printf("parameters:\n");
    printf("  expert      %16lld  (routed experts of the main layers)\n", (long long)k->params_expert);
    printf("  non-expert  %16lld  (embedding, attention, mHC, routers, shared experts, head)\n",
           (long long)k->params_dense);
    printf("  MTP         %16lld  (the MTP block, its experts included)\n", (long long)k->params_mtp);
    if (k->params_dspark)
        printf("  DSpark      %16lld  (the drafter's stages, experts included; carried, not trained)\n",
               (long long)k->params_dspark);
    printf("  total       %16lld\n", (long long)k->params_total);
    if (k->hash_entries)
        printf("  hash tables %16lld  I64 entries of tid2eid (fixed, not trained)\n", (long long)k->hash_entries);
    printf("checkpoint (%s): %lld tensors, %lld stored elements, %lld bytes\n",
           !k->quantized   ? "BF16, F32 where kept"
           : k->expert_fp4 ? "official: FP8 e4m3 + E8M0 128x128 block scales, FP4 routed experts + E8M0 per 32"
                           : "official: FP8 e4m3 + E8M0 128x128 block scales",
           (long long)k->stored_tensors, (long long)k->stored_elements, (long long)k->total_bytes);
    for (int t = 0; t < DS4_DTYPE_COUNT; t++)
        if (k->bytes[t]) printf("  %-8s %18lld bytes\n", ds4_dtype_name((ds4_dtype)t), (long long)k->bytes[t]);
    /* a carried DSpark tensor is an fp32 weight only: no gradient, no optimizer state */
    const double trained = (double)(k->params_total - k->params_dspark), gib = 1024.0 * 1024.0 * 1024.0;
    printf("training state (fp32 weights, gradients, AdamW m and v: 16 bytes per trained parameter, 4 per carried "
           "one): %.1f GiB before sharding\n",
           (16.0 * trained + 4.0 * (double)k->params_dspark) / gib);
}

int cmd_config_census(const char *path) {
    ds4_config cfg;
    ds4_param_census k;
    if (ds4_check_input(path, NULL) != DS4_OK || ds4_config_load(path, &cfg) != DS4_OK) return cli_fail();
    if (ds4_model_census(&cfg, &k) != DS4_OK) return cli_fail();
    print_census(path, &cfg, &k);
    return 0;
}

/* ------------------------------------------------------------------ ds4 init */
int cmd_init(int argc, char **argv) {
    cli_flag f[] = {{"config", false, NULL, "CONFIG.json (Hugging Face DeepSeek-V4 keys)"},
                    {"seed", false, NULL, "random seed (default 0)"},
                    {"out", false, NULL, "output model directory"},
                    {"dtype", false, NULL, "f32 (default) or bf16"},
                    {"dry-run", true, NULL, "validate CONFIG.json and print its parameter counts and checkpoint "
                                            "bytes; allocate and write nothing"}};
    const char *pos[1];
    int npos;
    if (cli_want_help(argc, argv)) {
        cli_usage("init", "--config CONFIG.json (--seed N --out DIR | --dry-run)", f, NFLAGS(f));
        return 0;
    }
    if (!cli_parse("init", argc, argv, f, NFLAGS(f), pos, 0, &npos)) return 2;
    const char *cfgp = cli_get(f, NFLAGS(f), "config"), *out = cli_get(f, NFLAGS(f), "out");
    if (cfgp && cli_get(f, NFLAGS(f), "dry-run")) return cmd_config_census(cfgp);
    const char *seeds = cli_get(f, NFLAGS(f), "seed"), *dts = cli_get(f, NFLAGS(f), "dtype");
    if (!cfgp || !out) {
        fprintf(stderr, "error: ds4 init: --config and --out are required\n");
        return 2;
    }
    int64_t seed = 0;
    if (seeds && !cli_int("init", "seed", seeds, &seed)) return 2;
    ds4_dtype dt = DS4_F32;
    if (dts && !strcmp(dts, "bf16")) dt = DS4_BF16;
    else if (dts && strcmp(dts, "f32")) {
        fprintf(stderr, "error: ds4 init: --dtype must be f32 or bf16, got '%s'\n", dts);
        return 2;
    }
    ds4_config cfg;
    if (ds4_check_input(cfgp, NULL) != DS4_OK || ds4_config_load(cfgp, &cfg) != DS4_OK) return cli_fail();
    ds4_model *m;
    if (ds4_model_create(NULL, &cfg, false, &m) != DS4_OK) return cli_fail();
    if (ds4_mkdirs(out, "output folder (--out)") != DS4_OK) {
        ds4_model_free(m);
        return cli_fail();
    }
    ds4_status st = ds4_model_init_random(m, (uint64_t)seed);
    if (st == DS4_OK) st = ds4_model_save(m, out, dt);
    if (st == DS4_OK)
        printf("wrote %s: %lld tensors, %lld parameters\n", out, (long long)ds4_model_nparams(m),
               (long long)ds4_model_numel(m));
    ds4_model_free(m);
    return st == DS4_OK ? 0 : cli_fail();
}

/* ------------------------------------------------------------------ ds4 debug-state */
static ds4_status read_batch(const char *path, int32_t **ids, int64_t *B, int64_t *T) {
    ds4_st_file *f;
    DS4_TRY(ds4_check_input(path, NULL));
    DS4_TRY(ds4_st_open(path, &f));
    const ds4_st_entry *e = ds4_st_find(f, "input_ids");
    ds4_status st = DS4_OK;
    if (!e) st = ds4_fail(DS4_ERR_MISSING, "%s: tensor input_ids not found", path);
    else if (e->dtype != DS4_I32 || e->ndim != 2)
        st = ds4_fail(DS4_ERR_SHAPE, "%s: tensor input_ids: expected I32 [B, T], got %s of rank %d", path,
                      ds4_dtype_name(e->dtype), e->ndim);
    if (st == DS4_OK) {
        *B = e->shape[0];
        *T = e->shape[1];
        *ids = ds4_alloc(DS4_MEM_OTHER, (size_t)(*B * *T) * sizeof(int32_t));
        if (!*ids) st = DS4_ERR_OOM;
        else memcpy(*ids, ds4_st_bytes(f, e), (size_t)(*B * *T) * sizeof(int32_t));
    }
    ds4_st_close(f);
    return st;
}

typedef struct {
    void *bufs[4096];
    int n;
} owned_bufs;

static void *own(owned_bufs *o, void *p) {
    if (p && o->n < 4096) o->bufs[o->n++] = p;
    return p;
}

static ds4_status add_scalar(ds4_st_writer *w, owned_bufs *o, const char *name, double v) {
    float *x = own(o, ds4_alloc(DS4_MEM_OTHER, sizeof(float)));
    if (!x) return DS4_ERR_OOM;
    *x = (float)v;
    int64_t one = 1;
    return ds4_st_writer_add(w, name, DS4_F32, 1, &one, x);
}

static void print_memory_report(const ds4_pass *p, const ds4_config *c) {
    printf("memory report (per layer and unit: output bytes, kept or released, replays)\n");
    for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers; l++)
        for (int u = 0; u < DS4_NUM_UNITS; u++) {
            ds4_unit_report r = ds4_pass_unit_report(p, l, u);
            if (!r.bytes) continue;
            printf("  layer %3lld %-13s %12lld B  %-8s replays %lld  %.3f ms\n", (long long)l, ds4_unit_name(u),
                   (long long)r.bytes, r.released ? "released" : "kept", (long long)r.replays, 1e3 * r.replay_seconds);
        }
    ds4_mem_stats s;
    ds4_mem_get(&s);
    printf("peak by category:");
    for (int k = 0; k < DS4_MEM_NCAT; k++) printf(" %s %lld", ds4_mem_cat_name((ds4_mem_cat)k), (long long)s.peak[k]);
    printf("; total %lld bytes; offload tier %lld bytes\n", (long long)s.peak_total, (long long)s.offload_peak_total);
}

static ds4_status debug_state(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, const char *out,
                              const ds4_recompute_cfg *rc, bool report, ds4_act_swap *swap, bool bf16) {
    const ds4_config *c = ds4_model_config(m);
    const int64_t V = c->vocab_size, N = B * T, K = c->index_topk;
    uint32_t masks[DS4_MAX_LAYERS];
    DS4_TRY(ds4_recompute_validate(rc, c));
    ds4_recompute_masks(rc, c, masks);
    const ds4_act_policies pol = {.recompute = ds4_recompute_any(rc) ? masks : NULL, .swap = swap};
    ds4_pass_opts opts = {.need_backward = true, .keep_logits = true, .store = ds4_act_store_of(&pol),
                          .bf16_acts = bf16};
    ds4_mem_reset_peak();
    ds4_pass *p;
    DS4_TRY(ds4_forward(m, ids, B, T, &opts, &p));
    owned_bufs *o = calloc(1, sizeof *o);
    ds4_st_writer *w = NULL;
    ds4_status st = o ? ds4_st_writer_new(&w) : DS4_ERR_OOM;
    int64_t lshape[3] = {B, T, V}, kshape[3] = {B, T, K};
    /* keep copies of what backward releases */
    float *logits = own(o, ds4_alloc(DS4_MEM_OTHER, (size_t)(N * V) * sizeof(float)));
    float *mtp = c->n_mtp_layers ? own(o, ds4_alloc(DS4_MEM_OTHER, (size_t)(N * V) * sizeof(float))) : NULL;
    if (st == DS4_OK && (!logits || (c->n_mtp_layers && !mtp))) st = DS4_ERR_OOM;
    if (st == DS4_OK) {
        ds4_model_to_host(m, logits, ds4_pass_logits(p), (size_t)(N * V) * sizeof(float));
        st = ds4_st_writer_add(w, "logits", DS4_F32, 3, lshape, logits);
    }
    if (st == DS4_OK && mtp) {
        ds4_model_to_host(m, mtp, ds4_pass_mtp_logits(p), (size_t)(N * V) * sizeof(float));
        st = ds4_st_writer_add(w, "mtp_logits", DS4_F32, 3, lshape, mtp);
    }
    static char names[DS4_MAX_LAYERS][48];
    for (int64_t l = 0; st == DS4_OK && l < c->n_layers; l++) {
        if (ds4_layer_ratio(c, l) != 4) continue;
        if (!ds4_pass_topk(p, l)) { /* the pass keeps it for keep_logits whatever the recompute policy */
            st = ds4_fail(DS4_ERR_INTERNAL, "debug-state: the pass holds no indexer_topk.%lld", (long long)l);
            break;
        }
        int32_t *tk = own(o, ds4_alloc(DS4_MEM_OTHER, (size_t)(N * K) * sizeof(int32_t)));
        if (!tk) {
            st = DS4_ERR_OOM;
            break;
        }
        ds4_model_to_host(m, tk, ds4_pass_topk(p, l), (size_t)(N * K) * sizeof(int32_t));
        snprintf(names[l], sizeof names[l], "indexer_topk.%lld", (long long)l);
        st = ds4_st_writer_add(w, names[l], DS4_I32, 3, kshape, tk);
    }
    if (st == DS4_OK) {
        ds4_model_zero_grad(m);
        st = ds4_backward(m, p);
    }
    if (st == DS4_OK) {
        const ds4_losses *L = ds4_pass_losses(p);
        st = add_scalar(w, o, "loss", L->loss);
        if (st == DS4_OK) st = add_scalar(w, o, "mtp_loss", L->mtp_loss);
        if (st == DS4_OK) st = add_scalar(w, o, "indexer_loss", L->indexer_loss);
        if (st == DS4_OK) st = add_scalar(w, o, "total_loss", L->total_loss);
        printf("loss %.6f mtp_loss %.6f indexer_loss %.6f total_loss %.6f\n", L->loss, L->mtp_loss,
               L->indexer_loss, L->total_loss);
        if (report) print_memory_report(p, c);
    }
    char (*gnames)[120] = NULL;
    float *grads = NULL; /* the host's copy of the flat gradients */
    if (st == DS4_OK) {
        gnames = own(o, ds4_alloc(DS4_MEM_OTHER, (size_t)ds4_model_nparams(m) * 120));
        grads = own(o, ds4_alloc(DS4_MEM_OTHER, (size_t)ds4_model_numel(m) * sizeof(float)));
        if (!gnames || !grads) st = DS4_ERR_OOM;
        else ds4_model_to_host(m, grads, ds4_model_grads_flat(m), (size_t)ds4_model_numel(m) * sizeof(float));
    }
    for (int64_t i = 0; st == DS4_OK && i < ds4_model_nparams(m); i++) {
        ds4_param *pr = ds4_model_param(m, i);
        if (!ds4_param_in_flat(pr)) continue;
        snprintf(gnames[i], 120, "grad.%s", pr->name);
        st = ds4_st_writer_add(w, gnames[i], DS4_F32, pr->ndim, pr->shape, grads + (pr->grad - ds4_model_grads_flat(m)));
    }
    if (st == DS4_OK) st = ds4_st_writer_write(w, out);
    ds4_st_writer_free(w);
    ds4_pass_free(p);
    if (o) {
        for (int i = 0; i < o->n; i++) ds4_free(o->bufs[i]);
        free(o);
    }
    return st;
}

/* What one debug-state run computes with: the model (from a directory, or initialised from a config with a
 * seed), the context (backend, GEMM precision), the batch and output files and the pass's policies. */
typedef struct {
    ds4_model_dir *dir;      /* weights from here; NULL: ds4_model_init_random(config, seed) */
    ds4_config config;       /* the model's config when dir is NULL */
    uint64_t seed;
    ds4_exec ex;
    const char *batch, *out;
    ds4_recompute_cfg rc;
    bool report, swap_input, bf16;
    const char *offload_dir; /* NULL or "": $TMPDIR, else /tmp */
} debug_run;

/* Runs r and closes its model directory. */
static int run_debug_state(debug_run *r) {
    ds4_model *m = NULL;
    int32_t *ids = NULL;
    int64_t B = 0, T = 0;
    ds4_status st = ds4_model_create(&r->ex, r->dir ? ds4_model_dir_config(r->dir) : &r->config, false, &m);
    if (st == DS4_OK) st = r->dir ? ds4_model_load(m, r->dir) : ds4_model_init_random(m, r->seed);
    ds4_model_dir_close(r->dir);
    r->dir = NULL;
    if (st == DS4_OK) st = read_batch(r->batch, &ids, &B, &T);
    ds4_offload *store = NULL;
    ds4_act_swap *swap = NULL;
    if (st == DS4_OK && r->swap_input) {
        st = ds4_offload_open(&r->ex, r->offload_dir, &store);
        if (st == DS4_OK) st = ds4_act_swap_new(store, &swap);
    }
    if (st == DS4_OK) {
        st = debug_state(m, ids, B, T, r->out, &r->rc, r->report, swap, r->bf16);
        if (st == DS4_ERR_ARG && strstr(ds4_errmsg(), "input_ids")) ds4_fail_prefix(st, "%s", r->batch);
    }
    ds4_act_swap_free(swap);
    ds4_offload_close(store);
    ds4_free(ids);
    ds4_model_free(m);
    return st == DS4_OK ? 0 : cli_fail();
}

/* Removes `--name VALUE` from argv and returns VALUE (NULL: absent; *bad: given without a value). */
static const char *take_flag(const char *name, int *argc, char **argv, bool *bad) {
    const char *v = NULL;
    int out = 1;
    for (int i = 1; i < *argc; i++) {
        if (strcmp(argv[i], name)) {
            argv[out++] = argv[i];
            continue;
        }
        if (i + 1 >= *argc) *bad = true;
        else v = argv[++i];
    }
    *argc = out;
    return v;
}

/* debug-state --config FILE.toml: the pass of the run's first micro-batch as `ds4 train` would compute it
 * (model.dir's weights or model.config initialised with model.seed; training.device, mixed precision and
 * matmul precision; the recompute and swap settings), on the tokens of --batch. */
static int debug_state_of_run(int argc, char **argv) {
    bool bad = false;
    debug_run r = {.batch = take_flag("--batch", &argc, argv, &bad)};
    r.out = take_flag("--out", &argc, argv, &bad);
    if (bad || !r.batch || !r.out) {
        fprintf(stderr, "error: ds4 debug-state: --batch BATCH.safetensors and --out OUT.safetensors are required\n");
        return 2;
    }
    ds4_train_cfg run;
    const int rc = cli_run_here("debug-state", argc, argv, &run);
    if (rc) return rc;
    if (ds4_run_model(&run, 1, &r.config, &r.dir) != DS4_OK || ds4_run_exec(&run, false, &r.ex) != DS4_OK) {
        ds4_model_dir_close(r.dir);
        return cli_fail();
    }
    r.seed = (uint64_t)run.init_seed;
    r.rc = run.recompute;
    r.report = run.memory_report;
    r.swap_input = run.swap_layer_input;
    r.offload_dir = run.offload_dir;
    r.bf16 = run.bf16_params;
    return run_debug_state(&r);
}

int cmd_debug_state(int argc, char **argv) {
    cli_flag f[] = {{"model", false, NULL, "model directory (config.json + *.safetensors)"},
                    {"batch", false, NULL, "BATCH.safetensors with input_ids I32 [B, T]"},
                    {"out", false, NULL, "OUT.safetensors"},
                    {"threads", false, NULL, "OpenMP threads"},
                    {"device", false, NULL, "backend to compute on (default cpu; ds4 info lists them)"},
                    {"swap-layer-input", true, NULL, "offload each layer's input stream from forward to backward"},
                    {"offload-dir", false, NULL, "directory of the offload file (default $TMPDIR or /tmp)"},
                    {"mixed-precision-param", false, NULL,
                     "float32 (default) or bfloat16: the pass of training.mixed_precision_param = \"bfloat16\""}};
    const char *pos[1];
    int npos;
    if (cli_want_help(argc, argv)) {
        cli_usage("debug-state",
                  "--model DIR --batch BATCH.safetensors --out OUT.safetensors [recompute flags] [--memory-report]\n"
                  "       [--swap-layer-input [--offload-dir DIR]] [--mixed-precision-param bfloat16]\n"
                  "   or: ds4 debug-state --config FILE.toml --batch BATCH.safetensors --out OUT.safetensors\n"
                  "       [--section.key value ...] [ds4 train's flags]: the pass of that run (its model, device,\n"
                  "       precision, recompute and swap settings), as ds4 train reads it", f,
                  NFLAGS(f));
        return 0;
    }
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--config") || !strcmp(argv[i], "--job.config_file")) return debug_state_of_run(argc, argv);
    /* the recompute flags first (MindSpeed names), then the plain ones */
    debug_run r = {0};
    ds4_recompute_defaults(&r.rc);
    int kept = 1;
    for (int i = 1; i < argc; i++) {
        bool used = false;
        if (!strcmp(argv[i], "--memory-report")) {
            r.report = true;
            continue;
        }
        if (ds4_recompute_parse_arg(&r.rc, argc, argv, &i, &used) != DS4_OK) return cli_fail();
        if (!used) argv[kept++] = argv[i];
    }
    argc = kept;
    if (!cli_parse("debug-state", argc, argv, f, NFLAGS(f), pos, 0, &npos)) return 2;
    const char *md = cli_get(f, NFLAGS(f), "model"), *th = cli_get(f, NFLAGS(f), "threads");
    r.batch = cli_get(f, NFLAGS(f), "batch");
    r.out = cli_get(f, NFLAGS(f), "out");
    if (!md || !r.batch || !r.out) {
        fprintf(stderr, "error: ds4 debug-state: --model, --batch and --out are required\n");
        return 2;
    }
    if (!cli_threads("debug-state", th)) return 2;
    const char *mp = cli_get(f, NFLAGS(f), "mixed-precision-param");
    if (mp && strcmp(mp, "float32") && strcmp(mp, "bfloat16")) {
        fprintf(stderr, "error: ds4 debug-state: --mixed-precision-param '%s': expected bfloat16 or float32\n", mp);
        return 2;
    }
    r.bf16 = mp && !strcmp(mp, "bfloat16");
    /* bf16 activations imply bf16 GEMMs: the model runs in that precision, on the backend asked for */
    r.ex = (ds4_exec){.matmul_precision = r.bf16 ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32};
    if (!cli_device("debug-state", cli_get(f, NFLAGS(f), "device"), true, &r.ex)) return 2;
    r.swap_input = cli_get(f, NFLAGS(f), "swap-layer-input") != NULL;
    r.offload_dir = cli_get(f, NFLAGS(f), "offload-dir");
    if (ds4_model_dir_open(md, &r.dir) != DS4_OK) return cli_fail();
    return run_debug_state(&r);
}
