/* The recompute RFC's acceptance table: for no recompute, each fine-grained flag set and full
 * recompute, the peak memory of one forward + backward step (allocator counters), the step time
 * (median of --steps timed steps, policies interleaved round-robin so drift of a shared machine hits
 * them alike), the extra compute vs off and the memory reduction vs off. Every policy's losses
 * must equal off's bit for bit (the table says so). Markdown on stdout.
 *
 * One thread by default: on a shared 2-core machine a second OpenMP thread that loses its core
 * stalls every barrier for a scheduler slice, and step times then swing by 10x and mean nothing.
 * --threads N for an idle machine. --budget S: stop timing after the round that would pass S
 * seconds (a warning says how many steps the medians hold).
 *
 * A second table plans memplan's policies (those settings, each alone and with --swap-optimizer,
 * --swap-layer-input and both) for one device of a large run (the trainer's step run as a plan on one
 * rank of a simulated FSDP + EP world), in fp32 and bf16 side by side, each against a device budget
 * (fits? by how much): by default DeepSeek-V4-Flash at 4K, micro-batch 1, FSDP 128 + EP 128 and 64 GiB
 * per device as in the practice report; then fp32 by category, and the report's published memory figures
 * (weights per die, resident bytes per parameter with and without SwapOptimizer) beside ours.
 * --plan none skips the plans; --plan-only skips the measured table.
 *
 * Usage: recompute [--config bench/configs/recompute-1k.json] [--seq 1024] [--batch 1] [--steps 5]
 *                  [--threads 1] [--budget 170] [--plan-only]
 *                  [--plan configs/deepseek-v4-flash.json|none] [--plan-seq 4096] [--plan-world 128] [--plan-ep 128]
 *                  [--plan-device-memory 64GiB] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4/actstore.h"
#include "ds4/config.h"
#include "ds4/core.h"
#include "ds4/dist.h"
#include "ds4/memplan.h"
#include "ds4/model.h"
#include "ds4/recompute.h"
#include "stats.h"

/* The measured table runs the recompute settings of memplan's policy list (its first entries, without
 * offload: the measured step is forward + backward, which the offload options do not change). */
#define NPOL DS4_MEMPLAN_RECOMPUTE_POLICIES
#define MAX_STEPS 64

typedef struct {
    uint32_t masks[DS4_MAX_LAYERS];
    int64_t peak;      /* peak_total − live_total before the step */
    int64_t act_peak;  /* peak of DS4_MEM_ACT − its live bytes before */
    double loss, total;
    bool same_memory;  /* every step had the same peaks */
    double t[MAX_STEPS];
} result;

static ds4_status policy_masks(int k, const ds4_config *c, uint32_t *masks) {
    ds4_step_opts so = {0};
    return ds4_memplan_policy_opts(ds4_memplan_policy_at(k), c, masks, &so);
}

/* One forward + backward; fills the peaks (first call) or checks they repeat, and the losses. */
static ds4_status one_step(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, result *r, bool first,
                           double *seconds) {
    const ds4_act_policies pol = {.recompute = r->masks};
    ds4_pass_opts o = {.need_backward = true, .store = ds4_act_store_of(&pol)};
    ds4_mem_stats a, b;
    ds4_pass *p;
    ds4_model_zero_grad(m);
    ds4_mem_reset_peak();
    ds4_mem_get(&a);
    double t0 = ds4_now();
    DS4_TRY(ds4_forward(m, ids, B, T, &o, &p));
    ds4_status st = ds4_backward(m, p);
    if (st == DS4_OK) {
        r->loss = ds4_pass_losses(p)->loss;
        r->total = ds4_pass_losses(p)->total_loss;
    }
    ds4_pass_free(p);
    *seconds = ds4_now() - t0;
    ds4_mem_get(&b);
    int64_t peak = b.peak_total - a.live_total, act = b.peak[DS4_MEM_ACT] - a.live[DS4_MEM_ACT];
    if (first) {
        r->peak = peak, r->act_peak = act, r->same_memory = true;
    } else if (peak != r->peak || act != r->act_peak) {
        r->same_memory = false;
    }
    return st;
}

static double minimum(const double *t, int n) {
    double m = t[0];
    for (int i = 1; i < n; i++) m = t[i] < m ? t[i] : m;
    return m;
}

static double mib(int64_t bytes) { return (double)bytes / (1024.0 * 1024.0); }

static double gib(int64_t bytes) { return (double)bytes / (1024.0 * 1024.0 * 1024.0); }

static void usage(const char *prog) {
    fprintf(stderr,
            "usage: %s [--config FILE.json] [--seq T] [--batch B] [--steps N (5..%d)] [--threads N] [--budget S]\n"
            "          [--plan-only] [--plan CONFIG.json|none] [--plan-seq T] [--plan-world N] [--plan-ep E]\n"
            "          [--plan-device-memory 64GiB]\n",
            prog, MAX_STEPS);
}

static double gb(int64_t bytes) { return (double)bytes / 1e9; }

/* What to plan per device. */
typedef struct {
    const char *config;
    int64_t T, world, ep;
    int64_t device; /* bytes of one device, --plan-device-memory */
} plan_args;

/* One policy planned in both precisions. */
typedef struct {
    ds4_step_memory fp32, bf16;
    bool has_bf16;
} policy_plan;

/* The same policy in bf16 mixed precision (training.mixed_precision_param = "bfloat16": bf16 GEMM operands
 * and the bf16-safe activations held in bf16; fp32 weights and optimizer state). */
static ds4_status plan_bf16(const ds4_config *c, const plan_args *a, ds4_comm *sim, ds4_step_opts so,
                            policy_plan *r) {
    so.bf16 = true;
    DS4_TRY(ds4_step_memory_run_dist_opts(c, 1, a->T, &so, true, sim, (int)a->ep, true, &r->bf16));
    r->has_bf16 = true;
    return DS4_OK;
}

/* "| 12.34 | yes | +3.21 " for a plan against the device, or n/a cells. */
static void fit_cells(const ds4_step_memory *m, bool have, int64_t device) {
    if (!have) {
        printf("| n/a | n/a | n/a ");
        return;
    }
    const ds4_device_fit f = ds4_step_memory_fit(m, device);
    printf("| %.2f | %s | %+.2f ", gib(f.need), f.fits ? "yes" : "**no**", gib(f.margin));
}

/* One of our figures from a plan, as table text. */
typedef void (*figure_fn)(const ds4_step_memory *m, char *buf, size_t n);

static void elements_held(const ds4_step_memory *m, char *buf, size_t n) {
    snprintf(buf, n, "%.3fB held (the shard, page padding included)", (double)m->params_held / 1e9);
}

static void weights_held(const ds4_step_memory *m, char *buf, size_t n) {
    const int64_t w = m->resident[DS4_MEM_PARAM];
    snprintf(buf, n, "%.2f GB = %.2f GiB (resident params)", gb(w), gib(w));
}

/* Resident bytes per parameter element held: what stays between steps over the shard's elements. */
static void bytes_per_param(const ds4_step_memory *m, char *buf, size_t n) {
    int k = snprintf(buf, n, "%.2f (%.2f GiB / %.3fB elements", (double)m->after_step / (double)m->params_held,
                     gib(m->after_step), (double)m->params_held / 1e9);
    if (k > 0 && (size_t)k < n && m->offload_after_step)
        k += snprintf(buf + k, n - (size_t)k, "; %.2f GiB in the offload tier", gib(m->offload_after_step));
    if (k > 0 && (size_t)k < n) snprintf(buf + k, n - (size_t)k, ")");
}

/* "| figure | theirs | ours in fp32 | ours in bf16 |" */
static void figure_row(const char *figure, const char *theirs, figure_fn ours, const policy_plan *p) {
    char fp32[160], bf16[160] = "n/a";
    ours(&p->fp32, fp32, sizeof fp32);
    if (p->has_bf16) ours(&p->bf16, bf16, sizeof bf16);
    printf("| %s | %s | %s | %s |\n", figure, theirs, fp32, bf16);
}

/* The practice report's published memory figures beside ours (seed 004: DeepSeek-V4-Flash on A3, 64 cards
 * = 128 dies, FSDP 128 + EP 128, MBS 1, 4K, BF16 training). Theirs are quoted with the section they are in
 * (§ 极简分布式并行优化 › 内存收益, "minimal parallelism › memory benefit"; § 内存卸载优化, "memory
 * offload"); ours come from the plans of `off` and `off +swap-opt` (what stays resident does not depend
 * on recompute). */
static void report_block(const ds4_config *c, const plan_args *a, const policy_plan *off, const policy_plan *swap) {
    printf("\n### Beside the practice report's published figures (seed 004)\n\n");
    printf("The report trains DeepSeek-V4-Flash on A3 with FSDP 128 + EP 128 (64 cards = 128 dies, one rank per "
           "die), MBS 1, 4K, BF16, AdamW; its weight and gradient figures count 4 bytes per parameter "
           "(\"按照混合精度训练场景下常见的 4 字节大小计算\"). Ours: rank 0 of FSDP %lld + EP %lld at T=%lld, as "
           "planned above.\n\n",
           (long long)a->world, (long long)a->ep, (long long)a->T);
    printf("| figure | practice report (section) | ds4 plan, fp32 | ds4 plan, bf16 |\n|---|---|---|---|\n");
    ds4_param_census cen;
    if (ds4_model_census(c, &cen) == DS4_OK)
        printf("| parameters | 285B: 277B routed-expert + 8B other (§ 极简分布式并行优化 › 内存收益, its table) "
               "| %.1fB: %.1fB routed-expert + %.1fB other + %.1fB MTP (census) | the same |\n",
               (double)cen.params_total / 1e9, (double)cen.params_expert / 1e9, (double)cen.params_dense / 1e9,
               (double)cen.params_mtp / 1e9);
    figure_row("parameter elements per die", "~2B expert + 0.06B other at FSDP128/EP128 (§ 内存收益, its table)",
               elements_held, off);
    figure_row("weights per die", "\"单卡权重内存仅约 8~9GB\" (\"weights per card only about 8~9GB\") after "
               "init (§ 内存收益)", weights_held, off);
    figure_row("resident bytes/param, AdamW", "16: weight 4 + grad 4 + optimizer 8 (§ 内存卸载优化)",
               bytes_per_param, off);
    figure_row("resident bytes/param, SwapOptimizer", "8: weight + grad only (§ 内存卸载优化)", bytes_per_param,
               swap);
    printf("| device memory | 64GB per die (\"A3 单卡 64GB\", § 内存收益) | budget above: %.2f GiB | the same |\n",
           gib(a->device));
    printf("\nbytes/param = resident bytes after the step (weights, gradients, optimizer state, the hash tables and "
           "metadata) / parameter elements held; ds4 keeps fp32 master weights, gradients and AdamW m, v in both "
           "precisions (bf16 is the GEMM operands and the saved activations)%s.\n",
           off->has_bf16 && off->bf16.after_step == off->fp32.after_step ? ": the resident bytes are the same, only "
                                                                          "the step peak moves" : "");
}

/* memplan of every policy on rank 0 of the simulated world, micro-batch 1, fp32 and bf16; Markdown on stdout. */
static ds4_status plan_table(const plan_args *a) {
    ds4_config c;
    DS4_TRY(ds4_config_load(a->config, &c));
    ds4_comm *sim;
    DS4_TRY(ds4_comm_plan((int)a->world, 0, &sim));
    const int n = ds4_memplan_policy_count();
    policy_plan *r = calloc((size_t)n, sizeof *r);
    ds4_status st = r ? DS4_OK : ds4_fail(DS4_ERR_OOM, "recompute: out of memory for %d plans", n);
    for (int k = 0; k < n && st == DS4_OK; k++) {
        uint32_t masks[DS4_MAX_LAYERS];
        ds4_step_opts so = {.prefetch_depth = DS4_PREFETCH_DEFAULT}; /* what ds4 train runs */
        st = ds4_memplan_policy_opts(ds4_memplan_policy_at(k), &c, masks, &so);
        if (st == DS4_OK)
            st = ds4_step_memory_run_dist_opts(&c, 1, a->T, &so, true, sim, (int)a->ep, true, &r[k].fp32);
        if (st == DS4_OK) st = plan_bf16(&c, a, sim, so, &r[k]);
    }
    ds4_comm_free(sim);
    if (st != DS4_OK) {
        free(r);
        return st;
    }
    printf("\n## memplan per device: %s, T=%lld, micro-batch 1, rank 0 of FSDP %lld + EP %lld (balanced routing), "
           "AdamW, device memory %.2f GiB\n\n",
           a->config, (long long)a->T, (long long)a->world, (long long)a->ep, gib(a->device));
    printf("| policy | fp32 peak GiB | fits %.0f GiB | margin GiB | bf16 peak GiB | fits %.0f GiB | margin GiB "
           "| offload GiB (fp32) | resident GiB (fp32) |\n",
           gib(a->device), gib(a->device));
    printf("|---|---:|:---:|---:|---:|:---:|---:|---:|---:|\n");
    for (int k = 0; k < n; k++) {
        printf("| %s ", ds4_memplan_policy_at(k)->name);
        fit_cells(&r[k].fp32, true, a->device);
        fit_cells(&r[k].bf16, r[k].has_bf16, a->device);
        printf("| %.2f | %.2f |\n", gib(r[k].fp32.offload_peak_total), gib(r[k].fp32.after_step));
    }
    printf("\npeak = peak of the sum of all categories in device memory during the step; margin = device memory − "
           "peak (negative: over); offload = the offload tier's peak (host memory); resident = what stays on the "
           "device between steps.\n");
    printf("\n### fp32 by category (recompute settings, no offload)\n\n");
    printf("| policy | params GiB | grads GiB | optim GiB | ACT peak GiB | ACT vs off | workspace GiB | comm GiB "
           "| step peak GiB | step peak vs off | planned in (s) |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int k = 0; k < NPOL; k++) {
        const ds4_step_memory *m = &r[k].fp32, *m0 = &r[0].fp32;
        const int64_t *p = m->peak, *p0 = m0->peak;
        printf("| %s | %.2f | %.2f | %.2f | %.2f | %+.1f%% | %.2f | %.2f | %.2f | %+.1f%% | %.2f |\n",
               ds4_memplan_policy_at(k)->name, gib(p[DS4_MEM_PARAM]), gib(p[DS4_MEM_GRAD]), gib(p[DS4_MEM_OPTIM]),
               gib(p[DS4_MEM_ACT]), 100.0 * ((double)p[DS4_MEM_ACT] / (double)p0[DS4_MEM_ACT] - 1.0),
               gib(p[DS4_MEM_WORK]), gib(p[DS4_MEM_COMM]), gib(m->peak_total),
               100.0 * ((double)m->peak_total / (double)m0->peak_total - 1.0), m->seconds);
    }
    printf("\nparams / grads: the rank's shard plus the groups gathered at the worst moment; optim: AdamW m, v and "
           "masks of the shard; step peak = peak of the sum of all categories.\n");
    int swap = 0; /* off +swap-opt: no recompute flag, the optimizer swapped alone */
    for (int k = 0; k < n; k++) {
        const ds4_memplan_policy *p = ds4_memplan_policy_at(k);
        if (!swap && !p->flags[0] && p->swap_optimizer && !p->swap_layer_input) swap = k;
    }
    report_block(&c, a, &r[0], &r[swap]);
    free(r);
    return DS4_OK;
}

/* The measured table: every recompute setting stepped on cfg_path, [B, T]; 0: every policy gave off's losses
 * and the same peaks at every step, 1: not, 2: an error (printed). */
static int measured_table(const char *cfg_path, int64_t B, int64_t T, int steps, double budget) {
    ds4_config c;
    ds4_model *m;
    if (ds4_config_load(cfg_path, &c) != DS4_OK || ds4_model_create(NULL, &c, false, &m) != DS4_OK) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return 2;
    }
    ds4_model_init_random(m, 1);
    int32_t *ids = malloc((size_t)(B * T) * sizeof(int32_t));
    for (int64_t i = 0; i < B * T; i++) ids[i] = (int32_t)(ds4_rng_u64(3, 0, (uint64_t)i) % (uint64_t)c.vocab_size);
    result *res = calloc(NPOL, sizeof(result));
    ds4_status st = DS4_OK;
    for (int k = 0; k < NPOL && st == DS4_OK; k++) st = policy_masks(k, &c, res[k].masks);
    /* one step before anything (first-use allocations such as kernel workspaces stay live after it);
     * then round 0 measures memory and warms each policy up; rounds 1..steps are timed */
    double t_start = ds4_now(), dt = 0;
    result warm = res[0];
    if (st == DS4_OK) st = one_step(m, ids, B, T, &warm, true, &dt);
    int done = 0; /* timed rounds */
    for (int s = 0; s <= steps && st == DS4_OK; s++) {
        double r0 = ds4_now();
        for (int k = 0; k < NPOL && st == DS4_OK; k++) {
            st = one_step(m, ids, B, T, &res[k], s == 0, &dt);
            if (s > 0) res[k].t[s - 1] = dt;
        }
        if (s > 0) done = s;
        double now = ds4_now();
        if (s > 0 && s < steps && now + (now - r0) - t_start > budget) break;
    }
    if (st != DS4_OK) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return 2;
    }
    double wall = ds4_now() - t_start;
    bool short_run = done < steps;
    steps = done > 0 ? done : 1;

    printf("## Recompute: %s, B=%lld T=%lld, %d layers + %lld MTP, %d threads, median of %d steps\n\n", cfg_path,
           (long long)B, (long long)T, (int)c.n_layers, (long long)c.n_mtp_layers, ds4_get_threads(), steps);
    printf("| policy | peak step memory (MiB) | reduction vs off | peak ACT (MiB) | ACT reduction | median step (s) "
           "| min step (s) | extra compute vs off (median) | (min) | losses == off |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|\n");
    const result *off = &res[0];
    double med_off = bench_median(off->t, steps), min_off = minimum(off->t, steps);
    bool all_same = true;
    for (int k = 0; k < NPOL; k++) {
        const result *r = &res[k];
        double med = bench_median(r->t, steps), mn = minimum(r->t, steps);
        bool same = r->loss == off->loss && r->total == off->total;
        all_same = all_same && same && r->same_memory;
        printf("| %s | %.2f | %.1f%% | %.2f | %.1f%% | %.3f | %.3f | %+.1f%% | %+.1f%% | %s |\n",
               ds4_memplan_policy_at(k)->name,
               mib(r->peak), 100.0 * (1.0 - (double)r->peak / (double)off->peak), mib(r->act_peak),
               100.0 * (1.0 - (double)r->act_peak / (double)off->act_peak), med, mn, 100.0 * (med / med_off - 1.0),
               100.0 * (mn / min_off - 1.0), same ? "yes" : "NO");
    }
    printf("\npeak step memory = peak of all categories during forward + backward minus the bytes live before "
           "(parameters, gradients); ACT = saved activations only. Extra compute = step time / off's − 1 (from the median and from the fastest step; "
           "the minimum is the better estimate on a loaded machine).\n");
    printf("total wall time %.1f s%s\n", wall, all_same ? "" : "; WARNING: losses or peaks not reproducible");
    if (short_run)
        printf("WARNING: the %.0f s budget stopped the timing after %d steps per policy (machine loaded?)\n", budget,
               done);
    for (int k = 0; k < NPOL; k++)
        if (!res[k].same_memory)
            printf("warning: %s: peak memory changed between steps\n", ds4_memplan_policy_at(k)->name);
    free(res);
    free(ids);
    ds4_model_free(m);
    return all_same ? 0 : 1;
}

int main(int argc, char **argv) {
    const char *cfg_path = "bench/configs/recompute-1k.json";
    int64_t T = 1024, B = 1;
    int steps = 5, threads = 1;
    double budget = 170;
    bool plan_only = false;
    ds4_host_memory_keep(); /* as the ds4 command runs */
    plan_args plan = {"configs/deepseek-v4-flash.json", 4096, 128, 128, (int64_t)64 << 30};
    for (int i = 1; i < argc; i++) {
        bool has = i + 1 < argc;
        if (!strcmp(argv[i], "--config") && has) cfg_path = argv[++i];
        else if (!strcmp(argv[i], "--plan-only")) plan_only = true;
        else if (!strcmp(argv[i], "--seq") && has) T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && has) B = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && has) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && has) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--budget") && has) budget = atof(argv[++i]);
        else if (!strcmp(argv[i], "--plan") && has) plan.config = argv[++i];
        else if (!strcmp(argv[i], "--plan-seq") && has) plan.T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--plan-world") && has) plan.world = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--plan-ep") && has) plan.ep = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--plan-device-memory") && has) {
            if (ds4_parse_bytes("--plan-device-memory", argv[++i], &plan.device) != DS4_OK) {
                fprintf(stderr, "error: %s\n", ds4_errmsg());
                return 2;
            }
        }
        else {
            usage(argv[0]);
            return 2;
        }
    }
    if (T < 1 || B < 1 || steps < 5 || steps > MAX_STEPS || plan.T < 2 || plan.world < 1 || plan.world > 1 << 20 ||
        plan.ep < 1 || plan.device < 1) {
        usage(argv[0]);
        return 2;
    }
    if (threads > 0) ds4_set_threads(threads);
    const int measured = plan_only ? 0 : measured_table(cfg_path, B, T, steps, budget);
    if (measured == 2) return 1;
    if (strcmp(plan.config, "none") && plan_table(&plan) != DS4_OK) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return 1;
    }
    return measured;
}
