/* ds4 memplan --model DIR|CONFIG.json --seq T --micro-batch B [--world N --ep E [--rank R]]
 *              [recompute flags] [--swap-optimizer] [--swap-layer-input] [--threads N] */
#include "cli.h"
#include "cmds.h"
#include "ds4/dist.h"
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
                        "       [--world N --ep E [--rank R]]\n"
                        "       [--recompute-csa-attention] [--mhc-recompute] [--recompute-norm ...]\n"
                        "       [--recompute-granularity full --recompute-method uniform|block --recompute-num-layers N]\n"
                        "       [--swap-optimizer] [--swap-layer-input] [--muon]\n"
                        "Peak memory of one training step by category: the trainer's own step run as a plan\n"
                        "(every allocation counted, no data touched).\n"
                        "--swap-optimizer: AdamW state in the offload tier between updates; --swap-layer-input: each\n"
                        "layer's input stream in the offload tier from its forward to its backward. The offload\n"
                        "tier's peak is printed apart. --muon: the step of optimizer.name = \"Muon\" (the momentum\n"
                        "and the whole matrices Newton-Schulz works on are counted).\n"
                        "--world N --ep E: one rank (--rank, default 0) of N processes with FSDP over all N and\n"
                        "expert parallelism of degree E (as mpirun -np N ds4 train ... --parallel.ep E), balanced\n"
                        "routing; --micro-batch is per rank.\n");
        return 0;
    }
    ds4_recompute_cfg rc;
    ds4_recompute_defaults(&rc);
    const char *model = NULL;
    int64_t T = 0, B = 1, world = 1, ep = 1, rank = 0;
    const char *threads = NULL;
    ds4_step_opts so = {0};
    for (int i = 1; i < argc; i++) {
        bool used;
        if (ds4_recompute_parse_arg(&rc, argc, argv, &i, &used) != DS4_OK) return cli_fail();
        if (used) continue;
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--swap-optimizer")) { /* flags without a value */
            so.swap_optimizer = true;
            continue;
        }
        if (!strcmp(a, "--swap-layer-input")) {
            so.swap_layer_input = true;
            continue;
        }
        if (!strcmp(a, "--muon")) {
            so.muon = true;
            continue;
        }
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
        } else if (!strcmp(a, "--world")) {
            if (!cli_int("memplan", "world", v, &world)) return 2;
        } else if (!strcmp(a, "--ep")) {
            if (!cli_int("memplan", "ep", v, &ep)) return 2;
        } else if (!strcmp(a, "--rank")) {
            if (!cli_int("memplan", "rank", v, &rank)) return 2;
        } else if (!strcmp(a, "--threads")) {
            threads = v;
        } else {
            fprintf(stderr, "error: ds4 memplan: unknown flag '%s' (see ds4 memplan --help)\n", a);
            return 2;
        }
    }
    if (!model || T < 2 || B < 1) {
        fprintf(stderr, "error: ds4 memplan: --model, --seq (>= 2) and --micro-batch (>= 1) are required\n");
        return 2;
    }
    if (world < 1 || world > 1 << 20 || ep < 1 || rank < 0 || rank >= world) {
        fprintf(stderr, "error: ds4 memplan: --world %lld --ep %lld --rank %lld: need world >= 1, ep >= 1 and "
                        "0 <= rank < world\n", (long long)world, (long long)ep, (long long)rank);
        return 2;
    }
    if (!cli_threads("memplan", threads)) return 2;
    ds4_config c;
    if (load_config(model, &c) != DS4_OK || ds4_recompute_validate(&rc, &c) != DS4_OK) return cli_fail();
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_recompute_masks(&rc, &c, masks);
    so.masks = ds4_recompute_any(&rc) ? masks : NULL;
    const bool dist = world > 1 || ep > 1;
    ds4_step_memory r;
    ds4_comm *sim = NULL;
    ds4_status st = dist ? ds4_comm_plan((int)world, (int)rank, &sim) : DS4_OK;
    if (st == DS4_OK)
        st = dist ? ds4_step_memory_run_dist_opts(&c, B, T, &so, true, sim, (int)ep, true, &r)
                  : ds4_step_memory_run_opts(&c, B, T, &so, true, &r);
    ds4_comm_free(sim);
    if (st != DS4_OK) return cli_fail();
    char desc[64], where[96] = "one process";
    if (dist)
        snprintf(where, sizeof where, "rank %lld of %lld, FSDP %lld, EP %lld, balanced routing", (long long)rank,
                 (long long)world, (long long)world, (long long)ep);
    printf("memplan: %s, seq %lld, micro-batch %lld, recompute %s, swap %s, %d threads (%s)\n", model, (long long)T,
           (long long)B, ds4_recompute_describe(&rc, desc, sizeof desc),
           so.swap_optimizer ? (so.swap_layer_input ? "optimizer+layer-input" : "optimizer")
                             : (so.swap_layer_input ? "layer-input" : "off"),
           ds4_get_threads(), where);
    printf("  %-12s %20s %12s\n", "category", "peak bytes", "GiB");
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        printf("  %-12s %20lld %12.3f\n", ds4_mem_cat_name((ds4_mem_cat)k), (long long)r.peak[k], gib(r.peak[k]));
    printf("  %-12s %20lld %12.3f\n", "peak total", (long long)r.peak_total, gib(r.peak_total));
    printf("  %-12s %20lld %12.3f\n", "resident", (long long)r.after_step, gib(r.after_step));
    if (so.swap_optimizer || so.swap_layer_input) {
        printf("  offload tier (outside memory)\n");
        for (int k = 0; k < DS4_MEM_NCAT; k++)
            if (r.offload_peak[k])
                printf("  %-12s %20lld %12.3f\n", ds4_mem_cat_name((ds4_mem_cat)k), (long long)r.offload_peak[k],
                       gib(r.offload_peak[k]));
        printf("  %-12s %20lld %12.3f\n", "peak total", (long long)r.offload_peak_total, gib(r.offload_peak_total));
        printf("  %-12s %20lld %12.3f\n", "resident", (long long)r.offload_after_step, gib(r.offload_after_step));
    }
    printf("(planned in %.2f s)\n", r.seconds);
    return 0;
}
