/* ds4 train --config FILE.toml [--section.key value ...] [recompute flags] [--memory-report] */
#include "cli.h"
#include "cmds.h"
#include "ds4/trainer.h"

#include <stdio.h>
#include <string.h>

static void train_usage(void) {
    fprintf(stderr,
            "usage: ds4 train --config FILE.toml [--section.key value ...] [options]\n"
            "  --config FILE.toml              training config ([model] [training] [optimizer] [lr_scheduler]\n"
            "                                  [data] [checkpoint] [metrics])\n"
            "  --section.key VALUE             override one config key (TorchTitan style)\n"
            "  --recompute-csa-attention       release and replay q-up, compressor, indexer, sparse attention, o-proj\n"
            "  --mhc-recompute                 release and replay mHC pre (attn, ffn) and mHC post (attn)\n"
            "  --recompute-norm                release and replay attn_norm / ffn_norm\n"
            "  --recompute-norm-num-layers N   ... on the first N layers by recompute priority\n"
            "  --recompute-granularity full|selective, --recompute-method uniform|block, --recompute-num-layers N\n"
            "  --memory-report                 per layer and unit: bytes kept/released, replays (first step)\n");
}

int cmd_train(int argc, char **argv) {
    if (cli_want_help(argc, argv)) {
        train_usage();
        return 0;
    }
    const char *cfg_path = NULL;
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--config")) cfg_path = argv[i + 1];
    if (!cfg_path) {
        fprintf(stderr, "error: ds4 train: --config FILE.toml is required\n");
        return 2;
    }
    ds4_toml *t;
    if (ds4_toml_load(cfg_path, &t) != DS4_OK) return cli_fail();
    if (ds4_toml_apply_overrides(t, &argc, argv) != DS4_OK) {
        ds4_toml_free(t);
        return cli_fail();
    }
    ds4_train_cfg cfg;
    ds4_status st = ds4_train_cfg_from_toml(t, &cfg);
    ds4_toml_free(t);
    if (st != DS4_OK) return cli_fail();
    for (int i = 1; i < argc; i++) {
        bool used = false;
        if (!strcmp(argv[i], "--config")) {
            i++;
            continue;
        }
        if (!strcmp(argv[i], "--memory-report")) {
            cfg.memory_report = true;
            continue;
        }
        if (ds4_recompute_parse_arg(&cfg.recompute, argc, argv, &i, &used) != DS4_OK) return cli_fail();
        if (!used) {
            fprintf(stderr, "error: ds4 train: unknown argument '%s' (see ds4 train --help)\n", argv[i]);
            return 2;
        }
    }
    if (ds4_train_run(&cfg) != DS4_OK) return cli_fail();
    return 0;
}
