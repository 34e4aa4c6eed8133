/* Checkpoint save time, one writer vs per rank, side by side: the median of N saves of the same sharded
 * state (random weights, zero moments) in each format, every save fsynced and committed as `ds4 train`
 * does (keep_latest_k 1, so the disk holds one checkpoint per format).
 *
 *   mpirun -np W build/bench/ckpt_save [--config CONFIG.json] [--saves 5] [--dir DIR] [--ep E]
 *
 * One writer: rank 0 gathers the shards region by region and writes model.safetensors + optim.state.
 * Per rank (checkpoint.per_rank): every rank writes its own shard file at the same time. */
#include "ds4/trainer.h"
#include "stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Seconds of each of `saves` saves (all ranks done: a save returns every rank's outcome) into t [saves]. */
static ds4_status time_saves(const ds4_config *c, ds4_comm *world, int ep, bool per_rank, const char *root, int saves,
                             double *t, int64_t *numel) {
    ds4_train_state_opts o = {.ep = ep, .per_rank_ckpt = per_rank};
    ds4_train_state *s;
    DS4_TRY(ds4_train_state_open(c, NULL, 1, world, &o, &s));
    *numel = ds4_train_state_numel(s);
    ds4_status st = DS4_OK;
    for (int i = 0; st == DS4_OK && i < saves; i++) {
        ds4_ckpt_meta meta = {.step = i + 1, .seed = 1};
        st = ds4_comm_barrier(world);
        double t0 = now_s();
        if (st == DS4_OK) st = ds4_train_state_save(s, root, 1, &meta);
        t[i] = now_s() - t0;
    }
    ds4_train_state_free(s);
    return st;
}

int main(int argc, char **argv) {
    const char *cfg = "bench/configs/recompute-1k.json", *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    int saves = 5, ep = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--config")) cfg = argv[i + 1];
        else if (!strcmp(argv[i], "--saves")) saves = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--dir")) dir = argv[i + 1];
        else if (!strcmp(argv[i], "--ep")) ep = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: ckpt_save [--config CONFIG.json] [--saves N] [--dir DIR] [--ep E]\n");
            return 2;
        }
    }
    if (saves < 1 || saves > 100) saves = 5;
    ds4_status st = ds4_dist_init();
    ds4_comm *world = ds4_comm_world();
    const int W = ds4_comm_size(world), rank = ds4_comm_rank(world);
    ds4_config c;
    if (st == DS4_OK) st = ds4_config_load(cfg, &c);
    char root[2][1024];
    snprintf(root[0], sizeof root[0], "%s/ds4-bench-ckpt-one-writer", dir);
    snprintf(root[1], sizeof root[1], "%s/ds4-bench-ckpt-per-rank", dir);
    double t[2][100], med[2];
    int64_t numel = 0;
    for (int k = 0; k < 2 && st == DS4_OK; k++) {
        st = time_saves(&c, world, ep, k == 1, root[k], saves, t[k], &numel);
        med[k] = bench_median(t[k], saves);
    }
    if (st != DS4_OK) {
        fprintf(stderr, "error: rank %d: %s\n", rank, ds4_errmsg());
        ds4_dist_finalize();
        return 1;
    }
    if (rank == 0) {
        printf("checkpoint save, %d ranks (EP %d), %s (%lld parameters: %.0f MB of weights + AdamW moments), %s: "
               "median of %d saves\n", W, ep, cfg, (long long)numel, 12e-6 * (double)numel, dir, saves);
        const char *name[2] = {"one writer (rank 0)", "per rank (every rank)"};
        for (int k = 0; k < 2; k++) {
            printf("  %-22s %8.3f s   (", name[k], med[k]);
            for (int i = 0; i < saves; i++) printf("%s%.3f", i ? " " : "", t[k][i]);
            printf(")\n");
        }
        printf("  per rank / one writer: %.2fx faster\n", med[0] / med[1]);
        char cmd[2200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", root[0], root[1]);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s and %s\n", root[0], root[1]);
    }
    ds4_dist_finalize();
    return 0;
}
