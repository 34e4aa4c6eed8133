/* ds4 train --config FILE.toml [--section.key value ...] [recompute flags] [--memory-report]
 * Under mpirun every rank runs this; a failure every rank shares (bad flags or config, a failed start
 * or save) is printed once, by rank 0, and every rank exits 1. A failure only one rank knows (inside a
 * step) is printed by that rank, which then aborts the world: the others may wait in a collective. */
#include "cli.h"
#include "cmds.h"
#include "ds4/trainer.h"

#include <stdio.h>
#include <string.h>

#ifdef DS4_HAVE_MPI
#include <mpi.h>
#endif

/* A failure every rank returns alike: rank 0 prints it. `code`: the exit code. */
static int fail_all(int code) {
    if (ds4_comm_rank(ds4_comm_world()) == 0) fprintf(stderr, "error: %s\n", ds4_errmsg());
    return code;
}

/* A failure of this rank alone. */
static int fail_alone(void) {
    ds4_comm *w = ds4_comm_world();
    if (ds4_comm_size(w) == 1) return cli_fail();
    fprintf(stderr, "error: rank %d: %s\n", ds4_comm_rank(w), ds4_errmsg());
    fflush(stderr);
#ifdef DS4_HAVE_MPI
    MPI_Abort(MPI_COMM_WORLD, 1);
#endif
    return 1;
}

/* Rank 0: what became of each TorchTitan key (ignored ones as warnings, with the reason). */
static void print_note(void *ctx, const char *key, ds4_toml_note_kind kind, const char *what) {
    (void)ctx;
    if (kind == DS4_TOML_IGNORED) fprintf(stderr, "warning: config key %s ignored: %s\n", key, what);
    else if (kind == DS4_TOML_ALIAS) printf("config: %s read as %s\n", key, what);
    else printf("config: %s mapped: %s\n", key, what);
}

/* Flags that are short names of config keys: --prefetch-depth N is --parallel.prefetch_depth N. */
static const char *const k_aliases[][2] = {{"--prefetch-depth", "parallel.prefetch_depth"},
                                           {"--sim-link-gbps", "parallel.sim_link_gbps"},
                                           {"--sim-link-latency-us", "parallel.sim_link_latency_us"},
                                           {"--trace", "metrics.trace_file"}};

/* Sets the key of every alias flag in t and removes the flag and its value from argv. */
static ds4_status apply_aliases(const char *cmd, ds4_toml *t, int *argc, char **argv) {
    int out = 1;
    for (int i = 1; i < *argc; i++) {
        const char *key = NULL;
        for (size_t k = 0; k < sizeof k_aliases / sizeof k_aliases[0]; k++)
            if (!strcmp(argv[i], k_aliases[k][0])) key = k_aliases[k][1];
        if (!key) {
            argv[out++] = argv[i];
            continue;
        }
        if (i + 1 >= *argc) return ds4_fail(DS4_ERR_ARG, "ds4 %s: %s needs a value", cmd, argv[i]);
        DS4_TRY(ds4_toml_set(t, key, argv[++i]));
    }
    *argc = out;
    return DS4_OK;
}

/* --config FILE or TorchTitan's --job.config_file FILE (the same file if both are given), taken out of argv. */
static ds4_status take_config_path(const char *cmd, int *argc, char **argv, const char **path) {
    int out = 1;
    *path = NULL;
    for (int i = 1; i < *argc; i++) {
        if (strcmp(argv[i], "--config") && strcmp(argv[i], "--job.config_file")) {
            argv[out++] = argv[i];
            continue;
        }
        if (i + 1 >= *argc) return ds4_fail(DS4_ERR_ARG, "ds4 %s: %s needs a file", cmd, argv[i]);
        if (*path && strcmp(*path, argv[i + 1]))
            return ds4_fail(DS4_ERR_ARG, "ds4 %s: --config / --job.config_file given twice, as %s and %s: give one",
                            cmd, *path, argv[i + 1]);
        *path = argv[++i];
    }
    *argc = out;
    return DS4_OK;
}

static void train_usage(void) {
    fprintf(stderr,
            "usage: ds4 train --config FILE.toml [--section.key value ...] [options]\n"
            "  --config FILE.toml              training config ([job] [model] [training] [optimizer] [lr_scheduler]\n"
            "                                  [data] [checkpoint] [metrics] [parallel] [memory]; TorchTitan's\n"
            "                                  sections and keys too, see docs/torchtitan-configs.md)\n"
            "  --job.config_file FILE.toml     TorchTitan's spelling of --config\n"
            "  --section.key VALUE             override one config key (TorchTitan style)\n"
            "  --recompute-csa-attention       release and replay q-up, compressor, indexer, sparse attention, o-proj\n"
            "  --mhc-recompute                 release and replay mHC pre (attn, ffn) and mHC post (attn)\n"
            "  --recompute-norm                release and replay attn_norm / ffn_norm\n"
            "  --recompute-norm-num-layers N   ... on the first N layers by recompute priority\n"
            "  --recompute-granularity full|selective, --recompute-method uniform|block, --recompute-num-layers N\n"
            "  --enable-recompute-layers-per-pp-rank  recompute priority counted over a pp rank's chunks\n"
            "  --pp P, --vpp V, --layout LAYOUT  pipeline stages, chunks per stage, Megatron's layout string\n"
            "                                  (parallel.pp, parallel.vpp, parallel.layout; also\n"
            "                                  --pipeline-model-parallel-size, --pipeline-model-parallel-layout,\n"
            "                                  --num-layers-per-virtual-pipeline-stage): checked, then refused\n"
            "                                  while the pipeline schedules are not built (docs/pipeline.md)\n"
            "  --memory-report                 per layer and unit: bytes kept/released, replays (first step)\n"
            "  --parallel.ep E                 under mpirun -np N: FSDP over the N ranks, experts over E of them\n"
            "  --swap-optimizer                AdamW state in the offload store between updates ([memory])\n"
            "  --swap-layer-input              layer inputs in the offload store from forward to backward\n"
            "  --offload-dir DIR               the offload store's directory (default $TMPDIR, else /tmp)\n"
            "  --prefetch-depth D              FSDP groups gathered / reduced while computing (default 1; 0: blocking)\n"
            "  --moe-fb-overlap                MoE forward-backward overlap: micro-batch i's forward beside i-1's\n"
            "                                  backward, each one's EP all-to-alls under the other's compute\n"
            "  --sim-link-gbps G               a simulated link of G Gb/s under every MPI collective (0: off)\n"
            "  --sim-link-latency-us U         ... and U microseconds of latency per collective\n"
            "  --trace FILE                    Chrome trace JSON of the steps: compute, fsdp, ep lanes per rank\n");
}

int cli_run_description(const char *cmd, int argc, char **argv, bool notes, ds4_train_cfg *cfg) {
    const char *cfg_path = NULL;
    if (take_config_path(cmd, &argc, argv, &cfg_path) != DS4_OK) return 2;
    if (!cfg_path) {
        ds4_fail(DS4_ERR_ARG, "ds4 %s: --config FILE.toml (TorchTitan's --job.config_file FILE.toml) is required", cmd);
        return 2;
    }
    ds4_toml *t;
    if (ds4_toml_load(cfg_path, &t) != DS4_OK) return 1;
    ds4_status st = apply_aliases(cmd, t, &argc, argv);
    if (st == DS4_OK) st = ds4_toml_apply_overrides(t, &argc, argv);
    if (st == DS4_OK) st = ds4_train_cfg_from_toml(t, cfg);
    if (st == DS4_OK && notes) {
        ds4_train_toml_notes(t, print_note, NULL);
        fflush(stdout);
    }
    ds4_toml_free(t);
    if (st != DS4_OK) return 1;
    for (int i = 1; i < argc; i++) {
        bool used = false;
        if (!strcmp(argv[i], "--memory-report")) {
            cfg->memory_report = true;
            continue;
        }
        if (!strcmp(argv[i], "--swap-optimizer")) {
            cfg->swap_optimizer = true;
            continue;
        }
        if (!strcmp(argv[i], "--swap-layer-input")) {
            cfg->swap_layer_input = true;
            continue;
        }
        if (!strcmp(argv[i], "--moe-fb-overlap")) {
            cfg->moe_fb_overlap = true;
            continue;
        }
        if (!strcmp(argv[i], "--offload-dir")) {
            if (i + 1 >= argc) {
                ds4_fail(DS4_ERR_ARG, "ds4 %s: --offload-dir needs a directory", cmd);
                return 2;
            }
            snprintf(cfg->offload_dir, sizeof cfg->offload_dir, "%s", argv[++i]);
            continue;
        }
        if (ds4_recompute_parse_arg(&cfg->recompute, argc, argv, &i, &used) != DS4_OK) return 1;
        if (!used) {
            ds4_fail(DS4_ERR_ARG, "ds4 %s: unknown argument '%s' (see ds4 %s --help)", cmd, argv[i], cmd);
            return 2;
        }
    }
    return 0;
}

int cli_run_here(const char *cmd, int argc, char **argv, ds4_train_cfg *cfg) {
    const int rc = cli_run_description(cmd, argc, argv, false, cfg);
    if (rc) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return rc;
    }
    if (cfg->threads > 0) ds4_set_threads((int)cfg->threads);
    return 0;
}

int cmd_train(int argc, char **argv) {
    if (cli_want_help(argc, argv)) {
        train_usage();
        return 0;
    }
    ds4_train_cfg cfg;
    const int rc = cli_run_description("train", argc, argv, ds4_comm_rank(ds4_comm_world()) == 0, &cfg);
    if (rc) return fail_all(rc);
    bool agreed = true;
    if (ds4_train_run_world(&cfg, &agreed) != DS4_OK) return agreed ? fail_all(1) : fail_alone();
    return 0;
}
