/* ds4's training step on command, for a driver that interleaves it with other engines' steps
 * (bench/torch_compare.py): one process holds one train state (fp32, or bf16 mixed with --bf16) and runs a
 * whole step (the trainer's ds4_train_step: forward, backward, clip, AdamW) each time it reads a command.
 *
 * Usage: train_step (--model DIR | --config FILE.json) [--ids FILE] [--seq T] [--batch B] [--threads N] [--bf16]
 *                   [--device NAME]
 *   --model: weights of a model directory (ds4 init / ds4 convert); --config: random weights (seed 1).
 *   --device: the backend the state lives and runs on (cpu, cuda, ...: ds4 info lists them; default cpu).
 *   --ids: B·T int32 token ids, raw little-endian (the driver gives both engines the same); else a fixed
 *   pseudo-random sequence.
 * Commands, one a line on stdin; each answer is one line on stdout:
 *   step        -> "step SECONDS LOSS MTP_LOSS INDEXER_LOSS" (LOSS: the LM loss, means over the batch)
 *   profile K   -> K more steps with the kernel profile on (ds4/profile.h): its markdown table, then
 *                  "end SECONDS" (their wall time)
 *   quit
 * After opening the state it prints "ready PARAMS flops-per-token F [peak-gflops P]" (F:
 * ds4_train_flops_per_token, the architecture's sparse-aware FLOPs of a training step per token at this T,
 * for MFU; P on the cpu: ds4_probe_gemm_rate, the GEMM engine's measured rate on one core, times the threads). A failure prints
 * "error MESSAGE" and exits 1.
 * Built with DS4_TRAIN_STEP_BASIC defined, it uses only ds4_train_state_open / ds4_train_step (no kernel
 * profile, no --device but cpu, no malloc policy): what bench/torch_compare.sh --before REV compiles against an
 * older tree, so the same driver times the code as it was. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4/config.h"
#include "ds4/core.h"
#include "ds4/dist.h"
#include "ds4/io.h"
#include "ds4/kernels.h"
#include "ds4/model.h"
#ifndef DS4_TRAIN_STEP_BASIC
#include "ds4/profile.h"
#endif
#include "ds4/trainer.h"

static const ds4_adamw_cfg k_adamw = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

typedef struct {
    ds4_train_state *s;
    int32_t *ids;
    int64_t *loads;
    int64_t B, T, step;
} bench_state;

static int fail(const char *what) {
    printf("error %s: %s\n", what, ds4_errmsg());
    return 1;
}

static ds4_status one_step(bench_state *b, ds4_step_result *r, double *seconds) {
    const ds4_step_args a = {.step = ++b->step, .micro_batches = 1, .B = b->B, .T = b->T, .ids = b->ids,
                             .loads = b->loads, .adamw = &k_adamw, .lr = k_adamw.lr, .max_norm = 1.0,
                             .router_bias_gamma = 1e-3};
    const double t0 = ds4_now();
    DS4_TRY(ds4_train_step(b->s, &a, r));
    *seconds = ds4_now() - t0;
    return DS4_OK;
}

static ds4_status read_ids(const char *path, int32_t *ids, int64_t n, int64_t vocab) {
    FILE *f = fopen(path, "rb");
    if (!f) return ds4_fail(DS4_ERR_IO, "--ids %s: cannot open", path);
    const size_t got = fread(ids, sizeof(int32_t), (size_t)n, f);
    fclose(f);
    if (got != (size_t)n) return ds4_fail(DS4_ERR_ARG, "--ids %s: %zu ids, expected B*T = %lld", path, got, (long long)n);
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab)
            return ds4_fail(DS4_ERR_ARG, "--ids %s: id %d at %lld is outside the vocabulary [0, %lld)", path, ids[i],
                            (long long)i, (long long)vocab);
    return DS4_OK;
}

#ifndef DS4_TRAIN_STEP_BASIC
/* "profile K": K more steps with the kernel profile on, its table, then "end SECONDS". */
static ds4_status profile_steps(bench_state *b, int k) {
    if (k < 1) return ds4_fail(DS4_ERR_ARG, "profile %d: need a number of steps >= 1", k);
    ds4_step_result r;
    double t, wall = 0;
    ds4_status st = DS4_OK;
    ds4_profile_reset();
    ds4_profile_enable(true);
    for (int i = 0; i < k && st == DS4_OK; i++) {
        st = one_step(b, &r, &t);
        wall += t;
    }
    ds4_profile_enable(false);
    if (st != DS4_OK) return st;
    ds4_profile_print(stdout, wall, k);
    printf("end %.6f\n", wall);
    return DS4_OK;
}
#endif

/* Runs commands until quit or end of input. */
static int serve(bench_state *b) {
    char line[256];
    while (fgets(line, sizeof line, stdin)) {
        ds4_step_result r;
        double t;
        if (!strncmp(line, "quit", 4)) break;
        if (!strncmp(line, "step", 4)) {
            if (one_step(b, &r, &t) != DS4_OK) return fail("step");
            printf("step %.6f %.9g %.9g %.9g\n", t, r.loss, r.mtp_loss, r.indexer_loss);
#ifndef DS4_TRAIN_STEP_BASIC
        } else if (!strncmp(line, "profile", 7)) {
            if (profile_steps(b, atoi(line + 7)) != DS4_OK) return fail("profile");
#endif
        } else {
            printf("error unknown command '%.*s' (step, profile K, quit)\n", (int)strcspn(line, "\n"), line);
            return 1;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *model = NULL, *config = NULL, *ids_path = NULL, *device = NULL;
    int64_t T = 1024, B = 1;
    int threads = 1;
    bool bf16 = false;
    setvbuf(stdout, NULL, _IOLBF, 0);
#ifndef DS4_TRAIN_STEP_BASIC
    ds4_host_memory_keep(); /* as the ds4 command runs */
#endif
    for (int i = 1; i < argc; i++) {
        const bool has = i + 1 < argc;
        if (!strcmp(argv[i], "--model") && has) model = argv[++i];
        else if (!strcmp(argv[i], "--config") && has) config = argv[++i];
        else if (!strcmp(argv[i], "--ids") && has) ids_path = argv[++i];
        else if (!strcmp(argv[i], "--seq") && has) T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && has) B = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && has) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bf16")) bf16 = true;
        else if (!strcmp(argv[i], "--device") && has) device = argv[++i];
        else {
            fprintf(stderr, "usage: %s (--model DIR | --config FILE.json) [--ids FILE] [--seq T] [--batch B] "
                            "[--threads N] [--bf16] [--device NAME]\n", argv[0]);
            return 2;
        }
    }
    if (!model == !config || T < 2 || B < 1 || T > 1 << 20 || B > 1 << 10 || threads < 1 || threads > 256) {
        fprintf(stderr, "train_step: need one of --model / --config, --seq >= 2, --batch >= 1, --threads 1..256\n");
        return 2;
    }
    ds4_set_threads(threads);
#ifdef DS4_TRAIN_STEP_BASIC
    if (device && strcmp(device, "cpu")) return printf("error --device %s: built for the cpu only\n", device), 1;
#else
    ds4_exec ex = {0};
    if (device && (ds4_backend_find("--device", device, &ex.backend) != DS4_OK ||
                   ds4_backend_ready("--device", ex.backend) != DS4_OK))
        return fail("--device");
#endif
    ds4_model_dir *d = NULL;
    ds4_config c;
    if (model) {
        if (ds4_model_dir_open(model, &d) != DS4_OK) return fail("--model");
        c = *ds4_model_dir_config(d);
    } else if (ds4_config_load(config, &c) != DS4_OK) {
        return fail("--config");
    }
    bench_state b = {.B = B, .T = T};
    b.ids = malloc((size_t)(B * T) * sizeof(int32_t));
    b.loads = calloc((size_t)((c.n_layers + c.n_mtp_layers) * c.n_routed_experts), sizeof(int64_t));
    if (!b.ids || !b.loads) return printf("error out of memory\n"), 1;
    if (ids_path) {
        if (read_ids(ids_path, b.ids, B * T, c.vocab_size) != DS4_OK) return fail("--ids");
    } else {
        for (int64_t i = 0; i < B * T; i++) b.ids[i] = (int32_t)(ds4_rng_u64(3, 1, (uint64_t)i) % (uint64_t)c.vocab_size);
    }
#ifdef DS4_TRAIN_STEP_BASIC
    const ds4_train_state_opts so = {.ep = 1, .bf16 = bf16};
#else
    const ds4_train_state_opts so = {.ep = 1, .bf16 = bf16, .exec = &ex};
#endif
    if (ds4_train_state_open(&c, d, 1, ds4_comm_self(), &so, &b.s) != DS4_OK) return fail("train state");
    printf("ready %lld flops-per-token %.6g", (long long)ds4_model_numel(ds4_train_state_model(b.s)),
           ds4_train_flops_per_token(&c, T));
#ifndef DS4_TRAIN_STEP_BASIC
    if (!device || !strcmp(device, "cpu")) /* the GEMM engine's own rate at these threads, for "% of GEMM peak" */
        printf(" peak-gflops %.6g", ds4_probe_gemm_rate(ds4_train_state_exec(b.s)) * ds4_get_threads() / 1e9);
#endif
    printf("\n");
    const int rc = serve(&b);
    ds4_train_state_free(b.s);
    ds4_model_dir_close(d);
    free(b.ids);
    free(b.loads);
    return rc;
}
