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
 * A second table plans the same policies for one device of a large run with memplan (the trainer's step
 * run as a plan on one rank of a simulated FSDP + EP world): by default DeepSeek-V4-Flash at 4K,
 * micro-batch 1, FSDP 128 + EP 128 as in the practice report (--plan none skips it).
 *
 * Usage: recompute [--config bench/configs/recompute-1k.json] [--seq 1024] [--batch 1] [--steps 5]
 *                  [--threads 1] [--budget 170]
 *                  [--plan configs/deepseek-v4-flash.json|none] [--plan-seq 4096] [--plan-world 128] [--plan-ep 128] */
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

typedef struct {
    const char *name;
    const char *argv[8];
} policy;

static const policy k_policies[] = {
    {"off", {NULL}},
    {"csa", {"--recompute-csa-attention", NULL}},
    {"mhc", {"--mhc-recompute", NULL}},
    {"norm", {"--recompute-norm", NULL}},
    {"csa+mhc", {"--recompute-csa-attention", "--mhc-recompute", NULL}},
    {"csa+mhc+norm", {"--recompute-csa-attention", "--mhc-recompute", "--recompute-norm", NULL}},
    {"full (uniform)",
     {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1", NULL}},
};
#define NPOL ((int)(sizeof k_policies / sizeof k_policies[0]))
#define MAX_STEPS 64

typedef struct {
    uint32_t masks[DS4_MAX_LAYERS];
    int64_t peak;      /* peak_total − live_total before the step */
    int64_t act_peak;  /* peak of DS4_MEM_ACT − its live bytes before */
    double loss, total;
    bool same_memory;  /* every step had the same peaks */
    double t[MAX_STEPS];
} result;

static ds4_status policy_masks(const policy *p, const ds4_config *c, uint32_t *masks) {
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    int argc = 0;
    while (p->argv[argc]) argc++;
    for (int i = 0; i < argc; i++) {
        bool used;
        DS4_TRY(ds4_recompute_parse_arg(&r, argc, (char **)p->argv, &i, &used));
        if (!used) return ds4_fail(DS4_ERR_ARG, "%s: unknown flag %s", p->name, p->argv[i]);
    }
    DS4_TRY(ds4_recompute_validate(&r, c));
    ds4_recompute_masks(&r, c, masks);
    return DS4_OK;
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

static int cmp_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static double median(const double *t, int n) {
    double s[MAX_STEPS];
    memcpy(s, t, (size_t)n * sizeof(double));
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? s[n / 2] : 0.5 * (s[n / 2 - 1] + s[n / 2]);
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
            "          [--plan CONFIG.json|none] [--plan-seq T] [--plan-world N] [--plan-ep E]\n",
            prog, MAX_STEPS);
}

/* What to plan per device. */
typedef struct {
    const char *config;
    int64_t T, world, ep;
} plan_args;

/* memplan of every policy on rank 0 of the simulated world, micro-batch 1; Markdown on stdout. */
static ds4_status plan_table(const plan_args *a) {
    ds4_config c;
    DS4_TRY(ds4_config_load(a->config, &c));
    ds4_comm *sim;
    DS4_TRY(ds4_comm_plan((int)a->world, 0, &sim));
    ds4_step_memory r[NPOL];
    ds4_status st = DS4_OK;
    for (int k = 0; k < NPOL && st == DS4_OK; k++) {
        uint32_t masks[DS4_MAX_LAYERS];
        st = policy_masks(&k_policies[k], &c, masks);
        if (st == DS4_OK) st = ds4_step_memory_run_dist(&c, 1, a->T, masks, true, sim, (int)a->ep, true, &r[k]);
    }
    ds4_comm_free(sim);
    DS4_TRY(st);
    printf("\n## memplan per device: %s, T=%lld, micro-batch 1, rank 0 of FSDP %lld + EP %lld (balanced routing), "
           "fp32 weights, grads and AdamW\n\n",
           a->config, (long long)a->T, (long long)a->world, (long long)a->ep);
    printf("| policy | params GiB | grads GiB | optim GiB | ACT peak GiB | ACT vs off | workspace GiB | comm GiB "
           "| step peak GiB | step peak vs off | planned in (s) |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int k = 0; k < NPOL; k++) {
        const int64_t *p = r[k].peak, *p0 = r[0].peak;
        printf("| %s | %.2f | %.2f | %.2f | %.2f | %+.1f%% | %.2f | %.2f | %.2f | %+.1f%% | %.2f |\n",
               k_policies[k].name, gib(p[DS4_MEM_PARAM]), gib(p[DS4_MEM_GRAD]), gib(p[DS4_MEM_OPTIM]),
               gib(p[DS4_MEM_ACT]), 100.0 * ((double)p[DS4_MEM_ACT] / (double)p0[DS4_MEM_ACT] - 1.0),
               gib(p[DS4_MEM_WORK]), gib(p[DS4_MEM_COMM]), gib(r[k].peak_total),
               100.0 * ((double)r[k].peak_total / (double)r[0].peak_total - 1.0), r[k].seconds);
    }
    printf("\nparams / grads: the rank's shard plus the groups gathered at the worst moment; optim: AdamW m, v and "
           "masks of the shard; step peak = peak of the sum of all categories.\n");
    return DS4_OK;
}

int main(int argc, char **argv) {
    const char *cfg_path = "bench/configs/recompute-1k.json";
    int64_t T = 1024, B = 1;
    int steps = 5, threads = 1;
    double budget = 170;
    plan_args plan = {"configs/deepseek-v4-flash.json", 4096, 128, 128};
    for (int i = 1; i < argc; i++) {
        bool has = i + 1 < argc;
        if (!strcmp(argv[i], "--config") && has) cfg_path = argv[++i];
        else if (!strcmp(argv[i], "--seq") && has) T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--batch") && has) B = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && has) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && has) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--budget") && has) budget = atof(argv[++i]);
        else if (!strcmp(argv[i], "--plan") && has) plan.config = argv[++i];
        else if (!strcmp(argv[i], "--plan-seq") && has) plan.T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--plan-world") && has) plan.world = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--plan-ep") && has) plan.ep = atoll(argv[++i]);
        else {
            usage(argv[0]);
            return 2;
        }
    }
    if (T < 1 || B < 1 || steps < 5 || steps > MAX_STEPS || plan.T < 2 || plan.world < 1 || plan.world > 1 << 20 ||
        plan.ep < 1) {
        usage(argv[0]);
        return 2;
    }
    if (threads > 0) ds4_set_threads(threads);
    ds4_config c;
    ds4_model *m;
    if (ds4_config_load(cfg_path, &c) != DS4_OK || ds4_model_create(NULL, &c, false, &m) != DS4_OK) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return 1;
    }
    ds4_model_init_random(m, 1);
    int32_t *ids = malloc((size_t)(B * T) * sizeof(int32_t));
    for (int64_t i = 0; i < B * T; i++) ids[i] = (int32_t)(ds4_rng_u64(3, 0, (uint64_t)i) % (uint64_t)c.vocab_size);
    result *res = calloc(NPOL, sizeof(result));
    ds4_status st = DS4_OK;
    for (int k = 0; k < NPOL && st == DS4_OK; k++) st = policy_masks(&k_policies[k], &c, res[k].masks);
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
        return 1;
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
    double med_off = median(off->t, steps), min_off = minimum(off->t, steps);
    bool all_same = true;
    for (int k = 0; k < NPOL; k++) {
        const result *r = &res[k];
        double med = median(r->t, steps), mn = minimum(r->t, steps);
        bool same = r->loss == off->loss && r->total == off->total;
        all_same = all_same && same && r->same_memory;
        printf("| %s | %.2f | %.1f%% | %.2f | %.1f%% | %.3f | %.3f | %+.1f%% | %+.1f%% | %s |\n", k_policies[k].name,
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
        if (!res[k].same_memory) printf("warning: %s: peak memory changed between steps\n", k_policies[k].name);
    free(res);
    free(ids);
    ds4_model_free(m);
    if (strcmp(plan.config, "none") && plan_table(&plan) != DS4_OK) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return 1;
    }
    return all_same ? 0 : 1;
}
