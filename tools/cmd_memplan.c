/* ds4 memplan --model DIR|CONFIG.json --seq T --micro-batch B [--world N --ep E [--rank R]]
 *              [recompute flags] [--swap-optimizer] [--swap-layer-input] [--muon]
 *              [--mixed-precision-param bfloat16|float32] [--matmul-precision fp32|bf16] [--prefetch-depth D] [--moe-fb-overlap] [--threads N]
 *              [--device-memory SIZE] [--device NAME]
 *              [--policies] [--saved-activations] [--memory-report]
 * ds4 memplan --config FILE.toml [overrides] [--world N [--rank R]] [--device-memory SIZE] [--saved-activations]
 *              [--memory-report] */
#include "cli.h"
#include "cmds.h"
#include "ds4/dist.h"
#include "ds4/io.h"
#include "ds4/memplan.h"
#include "ds4/pp_schedule.h"
#include "ds4/recompute.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double gib(int64_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

static ds4_status load_config(const char *path, ds4_config *c) {
    size_t n = strlen(path);
    if (n > 5 && !strcmp(path + n - 5, ".json")) return ds4_config_load(path, c);
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", path);
    return ds4_config_load(p, c);
}

static void usage(void) {
    fprintf(stderr, "usage: ds4 memplan --model DIR|CONFIG.json --seq T --micro-batch B [--threads N]\n"
                    "       [--world N --ep E [--rank R]] [--device-memory SIZE] [--policies]\n"
                    "       [--recompute-csa-attention] [--mhc-recompute] [--recompute-norm ...]\n"
                    "       [--recompute-granularity full --recompute-method uniform|block --recompute-num-layers N]\n"
                    "       [--pp P [--vpp V | --num-layers-per-virtual-pipeline-stage N] [--layout LAYOUT]\n"
                    "        [--enable-recompute-layers-per-pp-rank] [--world N --ep E [--rank R]] [--policies]]\n"
                    "       [--swap-optimizer] [--swap-layer-input] [--muon] [--mixed-precision-param bfloat16]\n"
                    "       [--matmul-precision fp32|bf16] [--device NAME]\n"
                    "       [--prefetch-depth D] [--moe-fb-overlap] [--saved-activations] [--memory-report]\n"
                    "Peak memory of one training step by category: the trainer's own step run as a plan\n"
                    "(every allocation counted, no data touched).\n"
                    "--swap-optimizer: AdamW state in the offload tier between updates; --swap-layer-input: each\n"
                    "layer's input stream in the offload tier from its forward to its backward. The offload\n"
                    "tier's peak is printed apart. --muon: the step of optimizer.name = \"Muon\" (the momentum\n"
                    "and the whole matrices Newton-Schulz works on are counted).\n"
                    "--mixed-precision-param bfloat16: the step of training.mixed_precision_param = \"bfloat16\"\n"
                    "(bf16 GEMM operands, the bf16-safe activations held in bf16; fp32 weights and state).\n"
                    "--matmul-precision bf16: the step of training.matmul_precision = \"bf16\" (bf16 GEMM operands on\n"
                    "fp32 weights and activations; the GEMM engines' buffers differ).\n"
                    "--device NAME: plan the step on that backend (default cpu; ds4 info lists them): its plan\n"
                    "twin counts the workspace that backend allocates.\n"
                    "--world N --ep E: one rank (--rank, default 0) of N processes with FSDP over all N and\n"
                    "expert parallelism of degree E (as mpirun -np N ds4 train ... --parallel.ep E), balanced\n"
                    "routing; --micro-batch is per rank. --prefetch-depth D: FSDP groups in flight (parallel.prefetch_depth,\n"
                    "default 1 as in ds4 train; 0: blocking collectives); their buffers are counted.\n"
                    "--moe-fb-overlap: the step of parallel.moe_fb_overlap, two micro-batches, the second's forward\n"
                    "beside the first's backward (both passes' activations alive).\n"
                    "--device-memory SIZE (64GiB, 64GB, 1.5TiB, 68719476736): whether the step's peak (the memory\n"
                    "tier; the offload tier is the host's) fits a device of SIZE, and the bytes free or over.\n"
                    "--policies: plan every recompute setting (off, csa, mhc, norm, csa+mhc, csa+mhc+norm, full),\n"
                    "each alone, with --swap-optimizer, with --swap-layer-input and with both, one line each\n"
                    "(instead of recompute and swap flags).\n"
                    "--saved-activations: after the plan, every tensor one block of each kind (compress ratio, recompute\n"
                    "mask, MTP) keeps from its forward for its backward: its unit, shape, dtype as held, bytes, and\n"
                    "whether it is kept, recomputed or swapped; per block and over all blocks, against the act peak.\n"
                    "With --pp, after the table, each stage's rank: its chunks' blocks, and the kept bytes of the\n"
                    "passes its schedule keeps at once (per chunk), against that rank's act peak.\n"
                    "--memory-report: after the plan, the grads and workspace peaks by what held them then, as counted\n"
                    "at the allocations: the gradients resident (fp32, FSDP's shard) and unsharded (FSDP groups open in\n"
                    "their backward or waiting for their reduce-scatter, with their number), and every workspace user\n"
                    "(an op's workspace, a unit's or the pass's own buffers) with the most bytes it held at once and what\n"
                    "it held at the workspace peak, largest first.\n"
                    "--pp P, --vpp V, --layout LAYOUT (Megatron's --pipeline-model-parallel-size,\n"
                    "--pipeline-model-parallel-layout, docs/pipeline.md): the stage table (each chunk's layers and\n"
                    "their recompute priorities), then every pp rank's plan: its stage's parameters, gradients and\n"
                    "optimizer state and its schedule of pp micro-batches (1F1B, interleaved with vpp > 1); with\n"
                    "--world N (a multiple of P: pp x fsdp) and --ep E, the ranks of --rank's data rank, each stage's\n"
                    "groups an FSDP (+ EP) shard over its N / P data ranks; --policies: a line per policy a pipeline\n"
                    "runs, every stage's peak; --device-memory: each stage's margin; --memory-report: rank --rank's\n"
                    "report after the table. With --config, a run with\n"
                    "parallel.pp plans one rank (--rank) of its pipeline (--world: pp x fsdp ranks).\n"
                    "The exit code is 0 whether or not the step fits: memplan reports, it does not judge.\n"
                    "\n"
                    "usage: ds4 memplan --config FILE.toml [--section.key value ...] [ds4 train's flags]\n"
                    "       [--world N [--rank R]] [--device-memory SIZE] [--saved-activations] [--memory-report]\n"
                    "The first step of the run `ds4 train --config FILE.toml ...` describes, read as ds4 train reads\n"
                    "it (TorchTitan keys, overrides, recompute and swap flags) and planned through the trainer's own\n"
                    "builders: every setting of the run counts (batch and micro-batches, training.device, matmul\n"
                    "precision, optimizer, training.csa_dense_steps, parallel.ep, prefetch depth, MoE overlap).\n"
                    "--world N: as rank R (default 0) of mpirun -np N.\n");
}

/* The command line. */
typedef struct {
    const char *model;
    int64_t T, B, world, ep, rank;
    int64_t device; /* --device-memory bytes; 0: none */
    bool policies;
    bool saved;      /* --saved-activations */
    bool report;     /* --memory-report */
    bool matmul_set; /* --matmul-precision given */
    ds4_recompute_cfg rc;
    ds4_step_opts so; /* swap and muon flags (masks filled later) */
} memplan_args;

/* Returns 0 when the arguments are good, else the exit code (the error printed). */
static int parse_args(int argc, char **argv, memplan_args *a) {
    *a = (memplan_args){.B = 1, .world = 1, .ep = 1, .so = {.prefetch_depth = DS4_PREFETCH_DEFAULT}};
    ds4_recompute_defaults(&a->rc);
    for (int i = 1; i < argc; i++) {
        bool used;
        if (ds4_recompute_parse_arg(&a->rc, argc, argv, &i, &used) != DS4_OK) return cli_fail();
        if (used) continue;
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--swap-optimizer")) { /* flags without a value */
            a->so.swap_optimizer = true;
            continue;
        }
        if (!strcmp(f, "--swap-layer-input")) {
            a->so.swap_layer_input = true;
            continue;
        }
        if (!strcmp(f, "--muon")) {
            a->so.muon = true;
            continue;
        }
        if (!strcmp(f, "--moe-fb-overlap")) { /* two micro-batches: the peak of two passes alive */
            a->so.moe_fb_overlap = true;
            a->so.micro_batches = 2;
            continue;
        }
        if (!strcmp(f, "--policies")) {
            a->policies = true;
            continue;
        }
        if (!strcmp(f, "--saved-activations")) {
            a->saved = true;
            continue;
        }
        if (!strcmp(f, "--memory-report")) {
            a->report = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "error: ds4 memplan: '%s' needs a value or is unknown\n", f);
            return 2;
        }
        i++;
        if (!strcmp(f, "--model")) a->model = v;
        else if (!strcmp(f, "--seq")) {
            if (!cli_int("memplan", "seq", v, &a->T)) return 2;
        } else if (!strcmp(f, "--micro-batch")) {
            if (!cli_int("memplan", "micro-batch", v, &a->B)) return 2;
        } else if (!strcmp(f, "--world")) {
            if (!cli_int("memplan", "world", v, &a->world)) return 2;
        } else if (!strcmp(f, "--ep")) {
            if (!cli_int("memplan", "ep", v, &a->ep)) return 2;
        } else if (!strcmp(f, "--rank")) {
            if (!cli_int("memplan", "rank", v, &a->rank)) return 2;
        } else if (!strcmp(f, "--threads")) {
            if (!cli_threads("memplan", v)) return 2;
        } else if (!strcmp(f, "--prefetch-depth")) {
            int64_t d;
            if (!cli_int("memplan", "prefetch-depth", v, &d)) return 2;
            if (d < 0 || d > DS4_PREFETCH_MAX) {
                fprintf(stderr, "error: ds4 memplan: --prefetch-depth %lld: expected 0..%d\n", (long long)d,
                        DS4_PREFETCH_MAX);
                return 2;
            }
            a->so.prefetch_depth = (int)d;
        } else if (!strcmp(f, "--device")) {
            ds4_exec ex = {.plan = true};
            if (!cli_device("memplan", v, false, &ex)) return 2;
            a->so.backend = ex.backend;
        } else if (!strcmp(f, "--matmul-precision")) {
            if (strcmp(v, "fp32") && strcmp(v, "bf16")) {
                fprintf(stderr, "error: ds4 memplan: --matmul-precision '%s': expected fp32 or bf16\n", v);
                return 2;
            }
            a->so.matmul_precision = strcmp(v, "bf16") ? DS4_MATMUL_FP32 : DS4_MATMUL_BF16;
            a->matmul_set = true;
        } else if (!strcmp(f, "--mixed-precision-param")) {
            if (strcmp(v, "bfloat16") && strcmp(v, "float32")) {
                fprintf(stderr, "error: ds4 memplan: --mixed-precision-param '%s': expected bfloat16 or float32\n", v);
                return 2;
            }
            a->so.bf16 = !strcmp(v, "bfloat16");
        } else if (!strcmp(f, "--device-memory")) {
            if (ds4_parse_bytes("--device-memory", v, &a->device) != DS4_OK) {
                fprintf(stderr, "error: ds4 memplan: %s\n", ds4_errmsg());
                return 2;
            }
            if (a->device < 1) {
                fprintf(stderr, "error: ds4 memplan: --device-memory %s: a device holds at least one byte\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "error: ds4 memplan: unknown flag '%s' (see ds4 memplan --help)\n", f);
            return 2;
        }
    }
    if (!a->model || a->T < 2 || a->B < 1) {
        fprintf(stderr, "error: ds4 memplan: --model, --seq (>= 2) and --micro-batch (>= 1) are required\n");
        return 2;
    }
    if (a->world < 1 || a->world > 1 << 20 || a->ep < 1 || a->rank < 0 || a->rank >= a->world) {
        fprintf(stderr, "error: ds4 memplan: --world %lld --ep %lld --rank %lld: need world >= 1, ep >= 1 and "
                        "0 <= rank < world\n", (long long)a->world, (long long)a->ep, (long long)a->rank);
        return 2;
    }
    if (a->so.bf16 && a->matmul_set && a->so.matmul_precision != DS4_MATMUL_BF16) {
        fprintf(stderr, "error: ds4 memplan: --matmul-precision fp32 contradicts --mixed-precision-param bfloat16 "
                        "(bf16 mixed precision runs bf16 GEMMs)\n");
        return 2;
    }
    if (a->so.bf16) a->so.matmul_precision = DS4_MATMUL_BF16;
    if (a->policies && (ds4_recompute_any(&a->rc) || a->so.swap_optimizer || a->so.swap_layer_input)) {
        fprintf(stderr, "error: ds4 memplan: --policies plans every recompute and swap setting itself; drop the "
                        "recompute and --swap-* flags\n");
        return 2;
    }
    if (a->policies && (a->saved || a->report)) {
        fprintf(stderr, "error: ds4 memplan: %s explains the plan of one policy; --policies plans them all: drop "
                        "one\n", a->saved ? "--saved-activations" : "--memory-report");
        return 2;
    }
    return 0;
}

/* One plan of the step under so, on this process or on one rank of the simulated world. */
static ds4_status plan(const memplan_args *a, const ds4_config *c, const ds4_step_opts *so, ds4_step_memory *r) {
    if (a->world == 1 && a->ep == 1) return ds4_step_memory_run_opts(c, a->B, a->T, so, true, r);
    ds4_comm *sim = NULL;
    ds4_status st = ds4_comm_plan((int)a->world, (int)a->rank, &sim);
    if (st == DS4_OK) st = ds4_step_memory_run_dist_opts(c, a->B, a->T, so, true, sim, (int)a->ep, true, r);
    ds4_comm_free(sim);
    return st;
}

static void describe_world(const memplan_args *a, char *where, size_t n) {
    const char *fbo = a->so.moe_fb_overlap ? ", MoE FB overlap (2 micro-batches)" : "";
    if (a->world == 1 && a->ep == 1) snprintf(where, n, "one process%s", fbo);
    else
        snprintf(where, n, "rank %lld of %lld, FSDP %lld, EP %lld, balanced routing, prefetch depth %d%s",
                 (long long)a->rank, (long long)a->world, (long long)a->world, (long long)a->ep, a->so.prefetch_depth,
                 fbo);
}

/* "fits, 12.000 GiB (... bytes) free at the peak" or "does not fit: 3.000 GiB (... bytes) over". */
static void print_fit(int64_t device, const ds4_step_memory *r) {
    const ds4_device_fit f = ds4_step_memory_fit(r, device);
    const int64_t m = f.fits ? f.margin : -f.margin;
    printf("device memory %.3f GiB (%lld bytes): the step %s %.3f GiB (%lld bytes) %s\n", gib(device),
           (long long)device, f.fits ? "fits," : "does not fit:", gib(m), (long long)m,
           f.fits ? "free at its peak" : "over");
}

/* ------------------------------------------------------------------ --saved-activations */
/* The step whose blocks' saved tensors are listed. */
typedef struct {
    int64_t B, T, ep, rank;
    const uint32_t *masks; /* per main layer; NULL: no recompute */
    bool swap_input, bf16;
    const bool *on;        /* [n_layers + n_mtp_layers] the blocks listed (a pipeline rank's); NULL: all */
} saved_step;

/* Under expert parallelism, the routed rows this rank's experts compute: balanced routing as a plan counts
 * it (cpu_moe_expert_counts_plan: expert e gets N·K / E assignments, one more for e < N·K mod E) with every
 * rank routing as this one (the plan communicator); the rank's experts are [(rank mod ep)·E/ep, +E/ep). */
static int64_t balanced_rows(const ds4_config *c, const saved_step *s) {
    const int64_t E = c->n_routed_experts, NK = s->B * s->T * c->n_activated_experts, L = E / s->ep;
    int64_t rows = 0;
    for (int64_t e = (s->rank % s->ep) * L; e < (s->rank % s->ep + 1) * L; e++) rows += NK / E + (e < NK % E);
    return rows * s->ep;
}

static ds4_saved_opts saved_opts(const ds4_config *c, const saved_step *s, int64_t l) {
    return (ds4_saved_opts){.B = s->B, .T = s->T, .release_mask = s->masks && l < c->n_layers ? s->masks[l] : 0,
                            .swap_input = s->swap_input, .bf16 = s->bf16, .ep = s->ep > 1,
                            .routed_rows = s->ep > 1 ? balanced_rows(c, s) : 0};
}

/* Blocks with the same rows: the same compress ratio and recompute mask, both main or both MTP. */
static bool same_kind(const ds4_config *c, const saved_step *s, int64_t a, int64_t b) {
    const ds4_saved_opts x = saved_opts(c, s, a), y = saved_opts(c, s, b);
    return (a >= c->n_layers) == (b >= c->n_layers) && ds4_layer_ratio(c, a) == ds4_layer_ratio(c, b) &&
           x.release_mask == y.release_mask;
}

/* How many blocks are of block l's kind; 0 when an earlier block is (the kind's table is printed there). */
static int64_t kind_count(const ds4_config *c, const saved_step *s, int64_t l) {
    int64_t count = 0;
    for (int64_t k = 0; k < c->n_layers + c->n_mtp_layers; k++) {
        if ((s->on && !s->on[k]) || !same_kind(c, s, l, k)) continue;
        if (k < l) return 0;
        count++;
    }
    return count;
}

static void kind_name(const ds4_config *c, int64_t l, char *buf, size_t n) {
    const int64_t r = ds4_layer_ratio(c, l);
    const char *what = r == 0 ? "sliding window" : r == 4 ? "CSA" : "HCA";
    if (l >= c->n_layers) snprintf(buf, n, "MTP block (%s, compress ratio %lld)", what, (long long)r);
    else snprintf(buf, n, "%s layer (compress ratio %lld)", what, (long long)r);
}

static const char *saved_dtype_name(ds4_saved_dtype t) {
    return t == DS4_SAVED_BF16 ? "bf16" : t == DS4_SAVED_I32 ? "i32" : t == DS4_SAVED_I64 ? "i64" : "fp32";
}

static const char *saved_status(ds4_act_policy p) {
    return p == DS4_ACT_RECOMPUTE ? "recomputed" : p == DS4_ACT_SWAP ? "swapped" : "kept";
}

/* The rows of block l; bytes[policy] += each row's bytes (indexed by ds4_act_policy: keep, recompute, swap). */
static void print_block_rows(const ds4_config *c, const saved_step *s, int64_t l, int64_t bytes[3]) {
    ds4_saved_tensor t[DS4_SAVED_MAX];
    const ds4_saved_opts o = saved_opts(c, s, l);
    const int n = ds4_block_saved(c, l, &o, t);
    printf("  %-13s %-8s %-20s %-5s %14s  %s\n", "unit", "tensor", "shape", "dtype", "bytes", "status");
    for (int i = 0; i < n; i++) {
        char shape[64];
        int k = snprintf(shape, sizeof shape, "[%lld", (long long)t[i].shape[0]);
        for (int d = 1; d < t[i].ndim; d++) k += snprintf(shape + k, sizeof shape - (size_t)k, ", %lld", (long long)t[i].shape[d]);
        snprintf(shape + k, sizeof shape - (size_t)k, "]");
        printf("  %-13s %-8s %-20s %-5s %14lld  %s\n", t[i].unit == DS4_UNIT_INPUT ? "input" : ds4_unit_name(t[i].unit),
               t[i].name, shape, saved_dtype_name(t[i].dtype), (long long)t[i].bytes, saved_status(t[i].policy));
        bytes[t[i].policy] += t[i].bytes;
    }
}

/* One table per kind of the blocks s->on lists (all when NULL); all [3] := their sums by policy. */
static void print_kinds(const ds4_config *c, const saved_step *s, int64_t all[3]) {
    const int64_t nb = c->n_layers + c->n_mtp_layers;
    for (int64_t l = 0; l < nb; l++) {
        const int64_t count = s->on && !s->on[l] ? 0 : kind_count(c, s, l);
        int64_t one[3] = {0};
        if (!count) continue;
        char kind[64];
        kind_name(c, l, kind, sizeof kind);
        printf("%s: %lld block%s (the first is block %lld)\n", kind, (long long)count, count > 1 ? "s" : "", (long long)l);
        print_block_rows(c, s, l, one);
        printf("  one block: %lld bytes kept (%.3f GiB), %lld recomputed, %lld swapped; %lld block%s: %lld bytes kept\n",
               (long long)one[DS4_ACT_KEEP], gib(one[DS4_ACT_KEEP]), (long long)one[DS4_ACT_RECOMPUTE],
               (long long)one[DS4_ACT_SWAP], (long long)count, count > 1 ? "s" : "", (long long)(count * one[DS4_ACT_KEEP]));
        for (int p = 0; p < 3; p++) all[p] += count * one[p];
    }
}

/* One table per kind of block, then the blocks' sum against the step's activation peak. */
static void print_saved(const ds4_config *c, const saved_step *s, const ds4_step_memory *r) {
    const int64_t nb = c->n_layers + c->n_mtp_layers;
    int64_t all[3] = {0};
    printf("saved activations: the tensors each block keeps from its forward for its backward (%lld tokens)\n",
           (long long)(s->B * s->T));
    print_kinds(c, s, all);
    printf("all %lld blocks: %lld bytes kept in memory (%.3f GiB), %lld recomputed, %lld swapped to the offload tier\n",
           (long long)nb, (long long)all[DS4_ACT_KEEP], gib(all[DS4_ACT_KEEP]), (long long)all[DS4_ACT_RECOMPUTE],
           (long long)all[DS4_ACT_SWAP]);
    printf("act peak %lld bytes = the blocks' kept %lld + %lld: the pass's tensors outside the blocks (token ids, the "
           "last stream, the heads and their logits, the MTP input) and the backward's transients (tensors widened "
           "from bf16, replays)\n", (long long)r->peak[DS4_MEM_ACT], (long long)all[DS4_ACT_KEEP],
           (long long)(r->peak[DS4_MEM_ACT] - all[DS4_ACT_KEEP]));
}

/* The bytes block l keeps (policy keep) for one micro-batch. */
static int64_t block_kept(const ds4_config *c, const saved_step *s, int64_t l) {
    ds4_saved_tensor t[DS4_SAVED_MAX];
    const ds4_saved_opts o = saved_opts(c, s, l);
    const int n = ds4_block_saved(c, l, &o, t);
    int64_t kept = 0;
    for (int i = 0; i < n; i++) kept += t[i].policy == DS4_ACT_KEEP ? t[i].bytes : 0;
    return kept;
}

/* --saved-activations of pipeline stage p (world rank `rank`, its plan r): the tables of its chunks' blocks (a
 * micro-batch's), then the passes its schedule of M micro-batches keeps at once where their blocks keep the
 * most (each forward adds its chunk's blocks, each backward frees them), against the rank's activation peak. */
static int print_stage_saved(const ds4_config *c, saved_step s, const ds4_pp_layout *L, int64_t p, int64_t M,
                             bool pp_alone, const ds4_step_memory *r) {
    const int64_t nb = c->n_layers + c->n_mtp_layers, nc = L->pp * L->vpp;
    bool *on = calloc((size_t)nb, sizeof *on);
    if (!on) return cli_fail();
    int64_t chunk_kept[DS4_PP_MAX_CHUNKS] = {0}, blocks = 0;
    for (int64_t k = p; k < nc; k += L->pp) {
        const ds4_pp_chunk *ch = &L->chunk[k];
        for (int64_t l = 0; l < nb; l++) {
            const bool here = l < c->n_layers ? l >= ch->layer_begin && l < ch->layer_end : ch->loss;
            if (!here) continue;
            on[l] = true, blocks++;
            chunk_kept[k] += block_kept(c, &s, l);
        }
    }
    s.on = on;
    printf("saved activations of %s %lld (stage %lld): the tensors each block of its chunks keeps from its forward "
           "for its backward, a micro-batch (%lld tokens)\n", pp_alone ? "pp rank" : "rank",
           (long long)s.rank, (long long)p, (long long)(s.B * s.T));
    int64_t all[3] = {0};
    print_kinds(c, &s, all);
    printf("all %lld blocks of its chunks:", (long long)blocks);
    for (int64_t k = p; k < nc; k += L->pp) printf(" chunk %lld %lld", (long long)k, (long long)chunk_kept[k]);
    printf("; %lld bytes kept a micro-batch (%.3f GiB), %lld recomputed, %lld swapped to the offload tier\n",
           (long long)all[DS4_ACT_KEEP], gib(all[DS4_ACT_KEEP]), (long long)all[DS4_ACT_RECOMPUTE],
           (long long)all[DS4_ACT_SWAP]);
    free(on);
    ds4_pp_schedule sch;
    if (ds4_pp_schedule_make(L->pp, L->vpp, M, p, &sch) != DS4_OK) return cli_fail();
    int64_t live[DS4_PP_MAX_CHUNKS] = {0}, at_most[DS4_PP_MAX_CHUNKS] = {0}, kept = 0, most = 0;
    for (int64_t i = 0; i < sch.n; i++) {
        const ds4_pp_action *x = &sch.a[i];
        const int64_t d = x->op == DS4_PP_FORWARD ? 1 : -1;
        live[x->chunk] += d;
        kept += d * chunk_kept[x->chunk];
        if (kept > most) {
            most = kept;
            memcpy(at_most, live, sizeof live);
        }
    }
    ds4_pp_schedule_free(&sch);
    printf("in flight where they keep the most (%s of %lld micro-batches):", L->vpp > 1 ? "interleaved 1F1B" : "1F1B",
           (long long)M);
    for (int64_t k = p; k < nc; k += L->pp) printf(" chunk %lld x %lld", (long long)k, (long long)at_most[k]);
    printf("; %lld bytes kept (%.3f GiB)\n", (long long)most, gib(most));
    printf("act peak %lld bytes = the in-flight blocks' kept %lld + %lld: each pass's tensors outside the blocks "
           "(token ids, the stream it hands on; on the head's chunk the heads, their logits and the MTP input) and the "
           "backward's transients\n", (long long)r->peak[DS4_MEM_ACT], (long long)most,
           (long long)(r->peak[DS4_MEM_ACT] - most));
    return 0;
}

/* ------------------------------------------------------------------ --memory-report */
static const char *owner_name(const ds4_mem_owner_stat *o) { return o->name ? o->name : "(no owner)"; }

/* An owner as printed: a unit's buffers are counted under the unit's name, shown as "unit NAME". */
static const char *owner_label(const ds4_mem_owner_stat *o, char *buf, size_t n) {
    if (!o->name || ds4_unit_find(o->name) < 0) return owner_name(o);
    snprintf(buf, n, "unit %s", o->name);
    return buf;
}

/* The gradients at their peak by owner (the allocator's count at that moment): the owners' bytes sum to
 * the grads peak. */
static void print_grads_split(const ds4_step_memory *r) {
    ds4_mem_owner_stat o[DS4_MEM_OWNERS_MAX];
    const int n = ds4_mem_owners_get(DS4_MEM_GRAD, o, DS4_MEM_OWNERS_MAX);
    int64_t sum = 0;
    printf("grads at their peak, by what held them:\n");
    for (int i = 0; i < n && i < DS4_MEM_OWNERS_MAX; i++) {
        char items[32] = "";
        if (o[i].items_at_peak) snprintf(items, sizeof items, "  %lld group%s", (long long)o[i].items_at_peak,
                                          o[i].items_at_peak == 1 ? "" : "s");
        printf("  %-38s %20lld %12.3f%s\n", owner_name(&o[i]), (long long)o[i].at_peak, gib(o[i].at_peak), items);
        sum += o[i].at_peak;
    }
    printf("  %-38s %20lld %12.3f  (grads peak %lld)\n", "sum", (long long)sum, gib(sum), (long long)r->peak[DS4_MEM_GRAD]);
}

static int by_max_desc(const void *a, const void *b) {
    const ds4_mem_owner_stat *x = a, *y = b;
    if (x->max != y->max) return x->max < y->max ? 1 : -1;
    return strcmp(owner_name(x), owner_name(y));
}

/* Every workspace user, the most bytes it held at once first, and what it held at the workspace peak. */
static void print_workspace_users(const ds4_step_memory *r) {
    ds4_mem_owner_stat o[DS4_MEM_OWNERS_MAX];
    int n = ds4_mem_owners_get(DS4_MEM_WORK, o, DS4_MEM_OWNERS_MAX);
    if (n > DS4_MEM_OWNERS_MAX) n = DS4_MEM_OWNERS_MAX;
    qsort(o, (size_t)n, sizeof o[0], by_max_desc);
    int64_t sum = 0;
    printf("workspace users (op: a kernel's workspace; unit, block, head, MTP, backward: the model's own buffers):\n");
    printf("  %-38s %20s %12s %20s\n", "user", "most bytes at once", "GiB", "at the peak");
    for (int i = 0; i < n; i++) {
        char label[64];
        printf("  %-38s %20lld %12.3f %20lld\n", owner_label(&o[i], label, sizeof label), (long long)o[i].max,
               gib(o[i].max), (long long)o[i].at_peak);
        sum += o[i].at_peak;
    }
    printf("  %-38s %20s %12s %20lld  (workspace peak %lld)\n", "sum", "", "", (long long)sum,
           (long long)r->peak[DS4_MEM_WORK]);
}

static void print_report(const ds4_step_memory *r) {
    print_grads_split(r);
    print_workspace_users(r);
}

static void print_step(const ds4_step_memory *r, bool bf16, ds4_matmul_precision prec, bool swap, int64_t device);

static int plan_one(const memplan_args *a, const ds4_config *c, ds4_step_opts so) {
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_recompute_masks(&a->rc, c, masks);
    so.masks = ds4_recompute_any(&a->rc) ? masks : NULL;
    ds4_step_memory r;
    if (plan(a, c, &so, &r) != DS4_OK) return cli_fail();
    char desc[64], where[160];
    describe_world(a, where, sizeof where);
    printf("memplan: %s, seq %lld, micro-batch %lld, recompute %s, swap %s, %d threads (%s)\n", a->model,
           (long long)a->T, (long long)a->B, ds4_recompute_describe(&a->rc, desc, sizeof desc),
           so.swap_optimizer ? (so.swap_layer_input ? "optimizer+layer-input" : "optimizer")
                             : (so.swap_layer_input ? "layer-input" : "off"),
           ds4_get_threads(), where);
    print_step(&r, so.bf16, so.matmul_precision, so.swap_optimizer || so.swap_layer_input, a->device);
    if (a->saved) {
        const saved_step ss = {a->B, a->T, a->ep, a->rank, so.masks, so.swap_layer_input, so.bf16, NULL};
        print_saved(c, &ss, &r);
    }
    if (a->report) print_report(&r);
    return 0;
}

/* The categories of one planned step, its offload tier when it has one, and the fit of a device. */
static void print_step(const ds4_step_memory *rp, bool bf16, ds4_matmul_precision prec, bool swap, int64_t device) {
    const ds4_step_memory r = *rp;
    if (bf16)
        printf("  mixed precision: bfloat16 compute (bf16 GEMM operands and activations), float32 weights and state\n");
    else if (prec == DS4_MATMUL_BF16)
        printf("  matmul precision: bf16 GEMM operands on float32 weights and activations\n");
    printf("  %-12s %20s %12s\n", "category", "peak bytes", "GiB");
    for (int k = 0; k < DS4_MEM_NCAT; k++)
        printf("  %-12s %20lld %12.3f\n", ds4_mem_cat_name((ds4_mem_cat)k), (long long)r.peak[k], gib(r.peak[k]));
    printf("  %-12s %20lld %12.3f\n", "peak total", (long long)r.peak_total, gib(r.peak_total));
    printf("  %-12s %20lld %12.3f\n", "resident", (long long)r.after_step, gib(r.after_step));
    if (swap) {
        printf("  offload tier (outside memory)\n");
        for (int k = 0; k < DS4_MEM_NCAT; k++)
            if (r.offload_peak[k])
                printf("  %-12s %20lld %12.3f\n", ds4_mem_cat_name((ds4_mem_cat)k), (long long)r.offload_peak[k],
                       gib(r.offload_peak[k]));
        printf("  %-12s %20lld %12.3f\n", "peak total", (long long)r.offload_peak_total, gib(r.offload_peak_total));
        printf("  %-12s %20lld %12.3f\n", "resident", (long long)r.offload_after_step, gib(r.offload_after_step));
    }
    if (device) print_fit(device, &r);
    printf("(planned in %.2f s)\n", r.seconds);
}

/* --policies: one line per policy of ds4_memplan_policy_at, with fits and margin under --device-memory. */
static int plan_policies(const memplan_args *a, const ds4_config *c) {
    char where[160];
    describe_world(a, where, sizeof where);
    printf("memplan: %s, seq %lld, micro-batch %lld, %s, %s, %d threads (%s), every policy", a->model,
           (long long)a->T, (long long)a->B, a->so.muon ? "Muon" : "AdamW",
           a->so.bf16 ? "bfloat16 mixed precision" : "float32", ds4_get_threads(), where);
    if (a->device) printf(", device memory %.3f GiB (%lld bytes)", gib(a->device), (long long)a->device);
    printf("\n  %-25s %16s %10s %12s", "policy", "peak bytes", "peak GiB", "resident GiB");
    if (a->device) printf(" %5s %16s %11s", "fits", "margin bytes", "margin GiB");
    printf(" %12s\n", "offload GiB");
    double seconds = 0;
    for (int i = 0; i < ds4_memplan_policy_count(); i++) {
        const ds4_memplan_policy *p = ds4_memplan_policy_at(i);
        uint32_t masks[DS4_MAX_LAYERS];
        ds4_step_opts so = a->so;
        ds4_step_memory r;
        if (ds4_memplan_policy_opts(p, c, masks, &so) != DS4_OK || plan(a, c, &so, &r) != DS4_OK) return cli_fail();
        printf("  %-25s %16lld %10.3f %12.3f", p->name, (long long)r.peak_total, gib(r.peak_total), gib(r.after_step));
        if (a->device) {
            const ds4_device_fit f = ds4_step_memory_fit(&r, a->device);
            printf(" %5s %16lld %11.3f", f.fits ? "yes" : "no", (long long)f.margin, gib(f.margin));
        }
        printf(" %12.3f\n", gib(r.offload_peak_total));
        seconds += r.seconds;
    }
    printf("peak: the step's peak in memory (GiB columns: 2^30 bytes); resident: what stays between steps; "
           "offload: the offload tier's peak (host memory, not the device's)%s\n",
           a->device ? "; margin: device memory - peak, negative when over" : "");
    printf("(planned in %.2f s)\n", seconds);
    return 0;
}

/* --saved-activations of a run description (resolved by the plan already: its model is read again). */
static int print_run_saved(ds4_train_cfg *run, int world, int64_t rank, const ds4_step_memory *r) {
    ds4_config c;
    ds4_model_dir *d = NULL;
    if (ds4_run_model(run, world, &c, &d) != DS4_OK) return cli_fail();
    ds4_model_dir_close(d);
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_recompute_masks(&run->recompute, &c, masks);
    const saved_step ss = {run->micro_batch, run->seq_len, run->ep, rank,
                           ds4_recompute_any(&run->recompute) ? masks : NULL, run->swap_layer_input, run->bf16_params,
                           NULL};
    if (run->recompute.pipe.pp < 2) {
        print_saved(&c, &ss, r);
        return 0;
    }
    /* a pipeline's rank: its stage's blocks, its data rank's micro-batches through the schedule */
    ds4_pp_layout *L = malloc(sizeof *L);
    if (!L || ds4_pp_layout_make(&run->recompute.pipe, c.n_layers, c.n_mtp_layers, L) != DS4_OK) {
        free(L);
        return cli_fail();
    }
    const int64_t F = world / L->pp, M = run->global_batch / (run->micro_batch * F);
    const int rc = print_stage_saved(&c, ss, L, rank / F, M, F == 1, r);
    free(L);
    return rc;
}

/* --config: memplan's own flags (--world, --rank, --device-memory) taken out of argv; the rest is the run
 * description, as ds4 train reads it. */
static int plan_run(int argc, char **argv) {
    int64_t world = 1, rank = 0, device = 0;
    int out = 1;
    bool saved = false, report = false;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(f, "--saved-activations")) {
            saved = true;
            continue;
        }
        if (!strcmp(f, "--memory-report")) {
            report = true;
            continue;
        }
        const bool ours = !strcmp(f, "--world") || !strcmp(f, "--rank") || !strcmp(f, "--device-memory");
        if (!strcmp(f, "--policies") || !strcmp(f, "--model")) {
            fprintf(stderr, "error: ds4 memplan: %s is a flag of the other form; with --config the run is the file's\n", f);
            return 2;
        }
        if (!ours) {
            argv[out++] = argv[i];
            continue;
        }
        if (!v) {
            fprintf(stderr, "error: ds4 memplan: '%s' needs a value\n", f);
            return 2;
        }
        i++;
        if (!strcmp(f, "--device-memory")) {
            if (ds4_parse_bytes("--device-memory", v, &device) != DS4_OK || device < 1) {
                fprintf(stderr, "error: ds4 memplan: --device-memory %s: expected a size of at least one byte\n", v);
                return 2;
            }
        } else if (!cli_int("memplan", f + 2, v, !strcmp(f, "--world") ? &world : &rank)) {
            return 2;
        }
    }
    ds4_train_cfg run;
    const int rc = cli_run_here("memplan", out, argv, &run);
    if (rc) return rc;
    if (run.recompute.pipe.pp > 1 && world == 1) world = run.recompute.pipe.pp; /* a pipeline: one rank per stage */
    if (world < 1 || world > 1 << 20 || rank < 0 || rank >= world) {
        fprintf(stderr, "error: ds4 memplan: --world %lld --rank %lld: need world >= 1 and 0 <= rank < world\n",
                (long long)world, (long long)rank);
        return 2;
    }
    ds4_comm *comm = NULL;
    ds4_status st = world > 1 ? ds4_comm_plan((int)world, (int)rank, &comm) : DS4_OK;
    ds4_step_memory r;
    if (st == DS4_OK) st = ds4_step_memory_of_run(&run, world > 1 ? comm : ds4_comm_self(), true, &r);
    ds4_comm_free(comm);
    if (st != DS4_OK) return cli_fail();
    char desc[64];
    printf("memplan: %s, seq %lld, micro-batch %lld x %lld per rank, recompute %s, swap %s, %s, %d threads "
           "(rank %lld of %lld, EP %lld)\n",
           run.model_dir[0] ? run.model_dir : run.model_config, (long long)run.seq_len, (long long)run.micro_batch,
           (long long)(run.global_batch / (run.micro_batch * (run.recompute.pipe.pp > 1 ? world / run.recompute.pipe.pp
                                                                                        : world))),
           ds4_recompute_describe(&run.recompute, desc, sizeof desc),
           run.swap_optimizer ? (run.swap_layer_input ? "optimizer+layer-input" : "optimizer")
                              : (run.swap_layer_input ? "layer-input" : "off"),
           run.optimizer ? run.optimizer->name : "AdamW", ds4_get_threads(), (long long)rank, (long long)world,
           (long long)run.ep);
    print_step(&r, run.bf16_params, run.matmul_precision, run.swap_optimizer || run.swap_layer_input, device);
    const int rs = saved ? print_run_saved(&run, (int)world, rank, &r) : 0;
    if (rs) return rs;
    if (report) print_report(&r);
    return 0;
}

/* The data ranks of each stage: --world N (a multiple of pp: world = pp x fsdp) over pp; 1 without --world. */
static int64_t stage_fsdp(const memplan_args *a, const ds4_pp_layout *L) {
    return a->world > 1 ? a->world / L->pp : 1;
}

/* The plan of each stage's rank of --rank's data rank (world = pp: each pp rank) into r [pp]; *seconds added. */
static ds4_status plan_each_stage(const memplan_args *a, const ds4_config *c, const ds4_pp_layout *L,
                                  const ds4_step_opts *so, ds4_step_memory *r, double *seconds) {
    const int64_t F = stage_fsdp(a, L), W = L->pp * F, d = a->rank % F;
    for (int64_t p = 0; p < L->pp; p++) {
        DS4_TRY(ds4_step_memory_run_stage(c, a->B, a->T, so, &a->rc.pipe, (int)W, (int)a->ep, (int)(p * F + d),
                                          &r[p]));
        *seconds += r[p].seconds;
    }
    return DS4_OK;
}

/* The first line of a pipeline's plans (no newline): the world, the schedule, recompute (NULL: every policy)
 * and the optimizer and precision. */
static void print_stages_header(const memplan_args *a, const ds4_pp_layout *L, const ds4_step_opts *so,
                                const char *recompute) {
    const int64_t F = stage_fsdp(a, L), W = L->pp * F, d = a->rank % F;
    if (F == 1) printf("memplan: each pipeline rank");
    else
        printf("memplan: each stage's rank of data rank %lld, world %lld = pp %lld x fsdp %lld (rank = stage x %lld + "
               "data rank), EP %lld inside each stage, balanced routing, prefetch depth %d", (long long)d,
               (long long)W, (long long)L->pp, (long long)F, (long long)F, (long long)a->ep, so->prefetch_depth);
    printf(", seq %lld, micro-batch %lld, %lld micro-batches%s (%s), ", (long long)a->T, (long long)a->B,
           (long long)L->pp, F > 1 ? " a data rank" : "", L->vpp > 1 ? "interleaved 1F1B" : "1F1B");
    if (recompute) printf("recompute %s, ", recompute);
    printf("%s, %s, %d threads", so->muon ? "Muon" : "AdamW", so->bf16 ? "bfloat16 mixed precision" : "float32",
           ds4_get_threads());
}

/* --device-memory of a pipeline's plans r [n] (column p: world rank p * F + d): a row of each rank's margin (device - peak, negative when
 * over), and how many fit, with the largest peak's margin. */
static void print_stages_fit(int64_t device, const ds4_step_memory *r, int64_t n, int64_t F, int64_t d) {
    int64_t fit = 0, worst = 0;
    printf("  %-12s", "margin");
    for (int64_t p = 0; p < n; p++) {
        const ds4_device_fit f = ds4_step_memory_fit(&r[p], device);
        printf(" %20lld", (long long)f.margin);
        fit += f.fits;
        if (r[p].peak_total > r[worst].peak_total) worst = p;
    }
    const ds4_device_fit w = ds4_step_memory_fit(&r[worst], device);
    printf("\ndevice memory %.3f GiB (%lld bytes): %lld of %lld stages' ranks fit; the largest peak (%s %lld) %s "
           "%.3f GiB (%lld bytes) %s\n", gib(device), (long long)device, (long long)fit, (long long)n,
           F == 1 ? "pp rank" : "rank", (long long)(worst * F + d), w.fits ? "fits," : "does not fit:", gib(w.fits ? w.margin : -w.margin),
           (long long)(w.fits ? w.margin : -w.margin), w.fits ? "free at its peak" : "over");
}

static void print_report(const ds4_step_memory *r);

/* --memory-report with --pp: the report of world rank --rank (its stage's column), planned again last, so the
 * allocator's owners are that step's. */
static int report_stage(const memplan_args *a, const ds4_config *c, const ds4_pp_layout *L, const ds4_step_opts *so) {
    const int64_t F = stage_fsdp(a, L), W = L->pp * F;
    ds4_step_memory one;
    if (ds4_step_memory_run_stage(c, a->B, a->T, so, &a->rc.pipe, (int)W, (int)a->ep, (int)a->rank, &one) != DS4_OK)
        return cli_fail();
    printf("memory report of %s %lld (stage %lld, data rank %lld):\n", F == 1 ? "pp rank" : "rank",
           (long long)a->rank, (long long)(a->rank / F), (long long)(a->rank % F));
    print_report(&one);
    return 0;
}

/* Every pipeline rank's plan: its stage's parameters, gradients and optimizer state (pp x fsdp: their FSDP
 * shard over the stage's data ranks, EP inside them), and its schedule's micro-batches (as many as stages)
 * in flight, one column a stage: world = pp, each pp rank; pp x fsdp, the ranks of --rank's data rank. */
static int plan_stages(const memplan_args *a, const ds4_config *c, const ds4_pp_layout *L) {
    uint32_t masks[DS4_MAX_LAYERS];
    ds4_recompute_masks(&a->rc, c, masks); /* the layout's priorities */
    ds4_step_opts so = a->so;
    so.masks = ds4_recompute_any(&a->rc) ? masks : NULL;
    const int64_t F = stage_fsdp(a, L), d = a->rank % F;
    ds4_step_memory *r = calloc((size_t)L->pp, sizeof *r);
    if (!r) return cli_fail();
    double seconds = 0;
    if (plan_each_stage(a, c, L, &so, r, &seconds) != DS4_OK) {
        free(r);
        return cli_fail();
    }
    char desc[64];
    print_stages_header(a, L, &so, ds4_recompute_describe(&a->rc, desc, sizeof desc));
    printf("\n  %-12s", "category");
    for (int64_t p = 0; p < L->pp; p++)
        if (F == 1) printf(" %16s%-4lld", "pp rank ", (long long)p);
        else printf(" %13s%-7lld", "rank ", (long long)(p * F + d));
    printf("\n");
    for (int k = 0; k <= DS4_MEM_NCAT + 1; k++) {
        printf("  %-12s", k < DS4_MEM_NCAT ? ds4_mem_cat_name((ds4_mem_cat)k) : k == DS4_MEM_NCAT ? "peak total"
                                                                                                 : "resident");
        for (int64_t p = 0; p < L->pp; p++)
            printf(" %20lld", (long long)(k < DS4_MEM_NCAT ? r[p].peak[k] : k == DS4_MEM_NCAT ? r[p].peak_total
                                                                                              : r[p].after_step));
        printf("\n");
    }
    if (a->device) print_stages_fit(a->device, r, L->pp, F, d);
    printf("(bytes at each rank's peak; planned in %.2f s)\n", seconds);
    for (int64_t p = 0; a->saved && p < L->pp; p++) {
        const saved_step ss = {a->B, a->T, a->ep, p * F + d, so.masks, so.swap_layer_input, so.bf16, NULL};
        if (print_stage_saved(c, ss, L, p, so.micro_batches > 0 ? so.micro_batches : L->pp, F == 1, &r[p])) {
            free(r);
            return 1;
        }
    }
    free(r);
    return a->report ? report_stage(a, c, L, &so) : 0;
}

/* --policies with --pp: every policy (the layer-input swap too: a store per in-flight micro-batch), one line
 * each: every stage's rank's peak (GiB) and the largest, the bytes of the largest. */
static int plan_stage_policies(const memplan_args *a, const ds4_config *c, const ds4_pp_layout *L) {
    print_stages_header(a, L, &a->so, NULL);
    printf(", every policy");
    if (a->device) printf(", device memory %.3f GiB (%lld bytes)", gib(a->device), (long long)a->device);
    printf("\n  %-22s", "policy");
    const int64_t F = stage_fsdp(a, L), d = a->rank % F;
    for (int64_t p = 0; p < L->pp; p++)
        if (F == 1) printf(" %6s%-3lld", "pp ", (long long)p);
        else printf(" %5s%-4lld", "rank ", (long long)(p * F + d));
    printf(" %9s %16s", "max GiB", "max bytes");
    if (a->device) printf(" %5s %16s", "fits", "margin bytes");
    printf(" %12s\n", "offload GiB");
    ds4_step_memory *r = calloc((size_t)L->pp, sizeof *r);
    if (!r) return cli_fail();
    double seconds = 0;
    for (int i = 0; i < ds4_memplan_policy_count(); i++) {
        const ds4_memplan_policy *p = ds4_memplan_policy_at(i);
        uint32_t masks[DS4_MAX_LAYERS];
        ds4_step_opts so = a->so;
        if (ds4_memplan_policy_opts_pipe(p, c, &a->rc, masks, &so) != DS4_OK || plan_each_stage(a, c, L, &so, r, &seconds) != DS4_OK) {
            free(r);
            return cli_fail();
        }
        int64_t most = 0, off = 0;
        printf("  %-22s", p->name);
        for (int64_t k = 0; k < L->pp; k++) {
            printf(" %9.3f", gib(r[k].peak_total));
            if (r[k].peak_total > most) most = r[k].peak_total;
            if (r[k].offload_peak_total > off) off = r[k].offload_peak_total;
        }
        printf(" %9.3f %16lld", gib(most), (long long)most);
        if (a->device) printf(" %5s %16lld", most <= a->device ? "yes" : "no", (long long)(a->device - most));
        printf(" %12.3f\n", gib(off));
    }
    printf("peak of each stage's rank in memory (GiB: 2^30 bytes); max: the largest of them; offload: the largest "
           "offload tier's peak (host memory)%s\n(planned in %.2f s)\n",
           a->device ? "; fits: every stage's rank fits the device memory; margin: device memory - max, negative "
                       "when over" : "", seconds);
    free(r);
    return 0;
}

/* --pp / --vpp / --layout with more than one chunk: the stage table (each chunk's pp rank, virtual chunk, what
 * it runs and its layers' recompute priorities), then every rank's plan (docs/pipeline.md). */
static int print_stages(const memplan_args *a, const ds4_config *c) {
    ds4_pp_layout L;
    if (ds4_pp_layout_make(&a->rc.pipe, c->n_layers, c->n_mtp_layers, &L) != DS4_OK) return cli_fail();
    if (a->world > 1 && (a->world % L.pp || a->world < L.pp)) {
        fprintf(stderr, "error: ds4 memplan: --world %lld with --pp %lld: a pipeline runs on pp x fsdp ranks, a "
                        "multiple of %lld\n", (long long)a->world, (long long)L.pp, (long long)L.pp);
        return 2;
    }
    if (a->ep > 1 && (stage_fsdp(a, &L) % a->ep || stage_fsdp(a, &L) == 1)) {
        fprintf(stderr, "error: ds4 memplan: --ep %lld with --pp %lld --world %lld: EP divides each stage's FSDP "
                        "group of world / pp = %lld data ranks (more than one)\n", (long long)a->ep, (long long)L.pp,
                (long long)a->world, (long long)stage_fsdp(a, &L));
        return 2;
    }
    printf("pipeline: pp %lld x vpp %lld chunks, %s; %lld decoder layers, %lld MTP; recompute priority %s\n",
           (long long)L.pp, (long long)L.vpp, a->rc.pipe.layout[0] ? "layout" : "uniform split",
           (long long)c->n_layers, (long long)c->n_mtp_layers,
           a->rc.per_pp_rank ? "per pp rank (chunks interleaved by depth)" : "per chunk (position in the chunk)");
    if (a->rc.pipe.layout[0]) printf("layout: %s\n", a->rc.pipe.layout);
    printf("%7s %5s  %-24s %6s  %s\n", "pp_rank", "chunk", "runs", "layers", "priorities");
    for (int64_t v = 0; v < L.vpp; v++)
        for (int64_t p = 0; p < L.pp; p++) {
            const ds4_pp_chunk *ch = &L.chunk[v * L.pp + p];
            char runs[96];
            int k = 0;
            runs[0] = 0;
            if (ch->embedding) k += snprintf(runs + k, sizeof runs - (size_t)k, "E ");
            if (ch->layer_end > ch->layer_begin)
                k += snprintf(runs + k, sizeof runs - (size_t)k, "t[%lld, %lld) ", (long long)ch->layer_begin,
                              (long long)ch->layer_end);
            if (ch->n_mtp) k += snprintf(runs + k, sizeof runs - (size_t)k, "m%lld ", (long long)ch->n_mtp);
            if (ch->loss) k += snprintf(runs + k, sizeof runs - (size_t)k, "L ");
            if (!k) snprintf(runs, sizeof runs, "(empty)");
            printf("%7lld %5lld  %-24s %6lld ", (long long)p, (long long)v, runs,
                   (long long)(ch->layer_end - ch->layer_begin));
            for (int64_t l = ch->layer_begin; l < ch->layer_end; l++) {
                int64_t prio;
                if (ds4_pp_priority_on(&L, p, v, l, a->rc.per_pp_rank, &prio) != DS4_OK) return cli_fail();
                printf(" %lld", (long long)prio);
            }
            printf("\n");
        }
    return a->policies ? plan_stage_policies(a, c, &L) : plan_stages(a, c, &L);
}

int cmd_memplan(int argc, char **argv) {
    if (cli_want_help(argc, argv)) {
        usage();
        return 0;
    }
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--config") || !strcmp(argv[i], "--job.config_file")) return plan_run(argc, argv);
    memplan_args a;
    const int rc = parse_args(argc, argv, &a);
    if (rc) return rc;
    ds4_config c;
    if (load_config(a.model, &c) != DS4_OK || ds4_recompute_validate(&a.rc, &c) != DS4_OK) return cli_fail();
    if (a.rc.pipe.pp > 1 || a.rc.pipe.vpp > 1 || a.rc.pipe.layout[0]) return print_stages(&a, &c);
    return a.policies ? plan_policies(&a, &c) : plan_one(&a, &c, a.so);
}
