/* fp32 vs BF16 mixed precision (docs/mixed-precision.md), side by side in one run:
 *  - the time of one training step (the trainer's own ds4_train_step: forward, backward, clip, AdamW) on
 *    a whole state, the two precisions interleaved round-robin so that drift of a shared machine hits
 *    both alike; medians of --steps timed steps and their ratio;
 *  - the activation bytes a main layer holds per token after forward (its units' saved outputs plus its
 *    input stream), per precision, from the pass's unit report;
 *  - the peak of the step by category (allocator counters).
 * One thread by default (see bench/recompute.c for why); --threads N on an idle machine.
 *
 * Usage: precision [--config bench/configs/recompute-flash-shape.json] [--seq 1024] [--batch 1] [--steps 5]
 *                  [--threads 1] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4/config.h"
#include "ds4/core.h"
#include "ds4/dist.h"
#include "ds4/model.h"
#include "ds4/trainer.h"
#include "stats.h"

#define MAX_STEPS 64

typedef struct {
    const char *name;
    bool bf16;
    ds4_train_state *s;
    double t[MAX_STEPS];
    double loss;
    int64_t act_layer_bytes;  /* main layers' held bytes after forward, summed over layers */
    int64_t peak[DS4_MEM_NCAT], peak_total;
} precision_run;

typedef struct {
    precision_run *run;
    int64_t N, streams;  /* tokens, stream elements per main layer (N·n·D) */
} report_ctx;

/* Called by the step after backward: the saved outputs each main layer held after forward. */
static void on_pass(void *ctx, int64_t micro, const ds4_pass *p) {
    (void)micro;
    report_ctx *r = ctx;
    precision_run *run = r->run;
    run->act_layer_bytes = 0;
    const ds4_config *c = ds4_model_config(ds4_train_state_model(run->s));
    for (int64_t l = 0; l < c->n_layers; l++) {
        for (int u = 0; u < DS4_NUM_UNITS; u++) run->act_layer_bytes += ds4_pass_unit_report(p, l, u).bytes;
        run->act_layer_bytes += r->streams * (run->bf16 ? 2 : 4);
    }
}

static const ds4_adamw_cfg k_adamw = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

static ds4_status timed_step(precision_run *run, int k, int32_t *ids, int64_t *loads, int64_t B, int64_t T,
                             report_ctx *rc) {
    const ds4_step_args a = {.step = k + 1, .micro_batches = 1, .B = B, .T = T, .ids = ids, .loads = loads,
                             .adamw = &k_adamw, .lr = k_adamw.lr, .max_norm = 1.0, .router_bias_gamma = 1e-3,
                             .on_pass = on_pass, .ctx = rc};
    ds4_step_result r;
    ds4_mem_stats s0, s1;
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    const double t0 = ds4_now();
    DS4_TRY(ds4_train_step(run->s, &a, &r));
    run->t[k] = ds4_now() - t0;
    ds4_mem_get(&s1);
    for (int c = 0; c < DS4_MEM_NCAT; c++) run->peak[c] = s1.peak[c] - s0.live[c];
    run->peak_total = s1.peak_total - s0.live_total;
    run->loss = r.loss;
    return DS4_OK;
}

static double mib(int64_t b) { return (double)b / (1024.0 * 1024.0); }

int main(int argc, char **argv) {
    const char *cfg_path = "bench/configs/recompute-flash-shape.json";
    int64_t T = 1024, B = 1;
    int steps = 5, threads = 1;
    ds4_host_memory_keep(); /* as the ds4 command runs */
    for (int i = 1; i < argc; i++) {
        bool has = i + 1 < argc;
        if (!strcmp(argv[i], "--config") && has) cfg_path = argv[++i];
        else if (!strcmp(argv[i], "--seq") && has) T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && has) B = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && has) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && has) threads = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--config FILE.json] [--seq T] [--batch B] [--steps N (5..%d)] [--threads N]\n",
                    argv[0], MAX_STEPS);
            return 2;
        }
    }
    if (T < 2 || B < 1 || T > 1 << 20 || B > 1 << 10 || steps < 5 || steps > MAX_STEPS || threads < 1 || threads > 256) {
        fprintf(stderr, "precision: need --seq >= 2, --batch >= 1, --steps 5..%d, --threads 1..256\n", MAX_STEPS);
        return 2;
    }
    ds4_set_threads(threads);
    ds4_config c;
    if (ds4_config_load(cfg_path, &c) != DS4_OK) {
        fprintf(stderr, "precision: %s\n", ds4_errmsg());
        return 1;
    }
    precision_run runs[2] = {{.name = "fp32", .bf16 = false}, {.name = "bf16 mixed", .bf16 = true}};
    int32_t *ids = malloc((size_t)(B * T) * sizeof(int32_t));
    int64_t *loads = calloc((size_t)((c.n_layers + c.n_mtp_layers) * c.n_routed_experts), sizeof(int64_t));
    for (int64_t i = 0; i < B * T; i++) ids[i] = (int32_t)(ds4_rng_u64(3, 1, (uint64_t)i) % (uint64_t)c.vocab_size);
    ds4_status st = DS4_OK;
    for (int r = 0; r < 2 && st == DS4_OK; r++) {
        const ds4_train_state_opts so = {.ep = 1, .bf16 = runs[r].bf16};
        st = ds4_train_state_open(&c, NULL, 1, ds4_comm_self(), &so, &runs[r].s);
    }
    report_ctx rc[2] = {{&runs[0], B * T, B * T * c.hc_mult * c.dim}, {&runs[1], B * T, B * T * c.hc_mult * c.dim}};
    /* one untimed step each (first-touch of the buffers), then the timed ones, interleaved */
    for (int k = -1; k < steps && st == DS4_OK; k++)
        for (int r = 0; r < 2 && st == DS4_OK; r++) st = timed_step(&runs[r], k < 0 ? 0 : k, ids, loads, B, T, &rc[r]);
    if (st != DS4_OK) {
        fprintf(stderr, "precision: %s\n", ds4_errmsg());
        return 1;
    }
    printf("## fp32 vs bf16 mixed precision: %s, B=%lld, T=%lld, %d threads, %d steps each (interleaved)\n\n", cfg_path,
           (long long)B, (long long)T, threads, steps);
    printf("| precision | step s (median) | vs fp32 | ACT bytes / token / layer | ACT peak MiB | step peak MiB | "
           "loss (last step) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    const double t0 = bench_median(runs[0].t, steps);
    for (int r = 0; r < 2; r++) {
        const double t = bench_median(runs[r].t, steps);
        printf("| %s | %.3f | %.2fx | %.0f | %.1f | %.1f | %.6f |\n", runs[r].name, t, t0 / t,
               (double)runs[r].act_layer_bytes / (double)(B * T) / (double)c.n_layers, mib(runs[r].peak[DS4_MEM_ACT]),
               mib(runs[r].peak_total), runs[r].loss);
    }
    printf("\nvs fp32: fp32 median / this median (> 1: faster). ACT bytes: the saved unit outputs and input stream a main "
           "layer holds after forward, per token.\n");
    for (int r = 0; r < 2; r++) ds4_train_state_free(runs[r].s);
    free(ids);
    free(loads);
    return 0;
}
