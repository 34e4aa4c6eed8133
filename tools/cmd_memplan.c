/* ds4 memplan --model DIR|CONFIG.json --seq T --micro-batch B [recompute flags] [--threads N] */
#include "cli.h"
#include "cmds.h"
#include "ds4/io.h"
#include "ds4/memplan.h"
#include "ds4/recompute.h"

#include <stdio.h>
#include <string.h>

static double gib(int64_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

static ds4_status load_config(const char *path, ds4_config *c) {
    size_t n = strlen(path);
    if (n > 5 && !strcmp(path + n - 5, ".json")) return ds4_config_load(path, c);
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", path);
    return ds4_config_load(p, c);
}

int cmd_memplan(int argc, char **argv) {
    if (cli_want_help(argc, argv)) {
        fprintf(stderr, "usage: ds4 memplan --model DIR|CONFIG.json --seq T --micro-batch B [--threads N]\n"
                        "       [--recompute-csa-attention] [--mhc-recompute] [--recompute-norm ...]\n"
                        "       [--recompute-granularity full --recompute-method uniform|block --recompute-num-layers N]\n"
                        "Peak memory of one training step by category, from a shape-only run of the real code path.\n");
        return 0;
    }
    ds4_recompute_cfg rc;
    ds4_recompute_defaults(&rc);
    const char *model = NULL;
    int64_t T = 0, B = 1, threads = 0;
    for (int i = 1; i < argc; i++) {
        bool used;
        if (ds4_recompute_parse_arg(&rc, argc, argv, &i, &used) != DS4_OK) return cli_fail();
        if (used) continue;
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "error: ds4 memplan: '%s' needs a value or is unknown\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--seq")) {
            if (!cli_int("memplan", "seq", v, &T)) return 2;
        } else if (!strcmp(a, "--micro-batch")) {
            if (!cli_int("memplan", "micro-batch", v, &B)) return 2;
        } else if (!strcmp(a, "--threads")) {
            if (!cli_int("memplan", "threads", v, &threads)) return 2;
        } else {
            fprintf(stderr, "error: ds4 memplan: unknown flag '%s' (see ds4 memplan --help)\n", a);
            return 2;
        }
    }
    if (!model || T < 2 || B < 1) {
        fprintf(stderr, "error: ds4 memplan: --model, --seq (>= 2) and --micro-batch (>= 1) are required\n");
        return 2;
    }
    if (threads > 0) ds4_set_threads((int)threads);
    ds4_config c;
    if (load_config(model, &c) != DS4_OK || ds4_recompute_validate(&rc, &c) != DS4_OK) return cli_fail();
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_recompute_masks(&rc, &c, masks);
    ds4_step_memory r;
    if (ds4_step_memory_run(&c, B, T, ds4_recompute_any(&rc) ? masks : NULL, true, &r) != DS4_OK) return cli_fail();
    char desc[64];
    printf("memplan: %s, seq %lld, micro-batch %lld, recompute %s, %d threads (one process)\n", model, (long long)T,
           (long long)B, ds4_recompute_describe(&rc, desc, sizeof desc), ds4_get_threads());
    printf("  %-12s %20s %12s\n", "category", "peak bytes", "GiB");
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        printf("  %-12s %20lld %12.3f\n", ds4_mem_cat_name((ds4_mem_cat)k), (long long)r.peak[k], gib(r.peak[k]));
    printf("  %-12s %20lld %12.3f\n", "peak total", (long long)r.peak_total, gib(r.peak_total));
    printf("  %-12s %20lld %12.3f\n", "resident", (long long)r.after_step, gib(r.after_step));
    printf("(planned in %.2f s)\n", r.seconds);
    return 0;
}
