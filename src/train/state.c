/* The state a training step updates, in one of two forms behind one interface (ds4/trainer.h):
 *  - whole: the model and its optimizer state in this process (one rank, ep = 1: the single-process path,
 *    the same calls in the same order as before there was a second form, so the same bits);
 *  - sharded: this rank's FSDP + EP shard (ds4/dist.h). The model is unmapped; the hooks gather a
 *    group's weights around its use and reduce-scatter its gradients into the shard, where they
 *    accumulate over micro-batches. The optimizer, clipping and the router bias rule run on the shard.
 * Checkpoints: the one-writer format (rank 0 gathers the packed parameters and optimizer arrays and writes them
 * as one process does), or with per_rank every rank writes its own shard file (ckpt_shards.c); on load
 * every rank reads its elements from either. So a run saved by N ranks resumes on any number of ranks.
 * Offload (--swap-optimizer, --swap-layer-input) puts the optimizer state and the layer input streams in one
 * offload store (ds4/offload.h) owned here; the optimizer's arrays come back to memory only around checkpoints.
 * A plan state (memplan) is the same state under a plan context (ds4_exec): opened, stepped and freed
 * with the allocator counting it, its optimizer state and FSDP (on a plan communicator) touching no values. */
#include "ds4/io.h"
#include "ds4/offload.h"
#include "ds4/trainer.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

struct ds4_train_state {
    ds4_exec exec;    /* real or plan */
    bool sharded;
    ds4_model *m;     /* whole, or unmapped behind the FSDP hooks */
    ds4_fsdp *f;      /* NULL: whole */
    ds4_comm *world;
    ds4_optim opt;    /* over [numel] whole, [shard_numel] sharded */
    ds4_offload *store;     /* NULL: no offload */
    ds4_act_swap *swap;     /* --swap-layer-input */
    ds4_act_swap *swap2;    /* ... of the second live pass under --moe-fb-overlap, made at its first step */
    ds4_fsdp_yielding yielding; /* --moe-fb-overlap: the EP ops that give way between start and wait */
    bool bf16;              /* mixed precision: bf16 GEMMs and activations, fp32 weights and optimizer state */
    bool per_rank;          /* sharded saves: every rank writes its own file */
    ds4_pp_layout *pp;      /* a pipeline stage (this rank's groups held, ds4_model_hold), else NULL: the layout
                             * of a stage_ctx */
};

/* A pipeline stage's layout and, for pp x fsdp, its communicators: this data rank's pp ranks (rank = stage)
 * and this stage's fsdp ranks (rank = data rank d), its groups' FSDP; NULL with world = pp. Kept behind the
 * state's layout pointer, so a state without a pipeline counts the bytes it did (memplan's golden numbers). */
typedef struct {
    ds4_pp_layout L; /* first: s->pp points here */
    ds4_comm *pipe, *stage;
} stage_ctx;
static stage_ctx *stage_ctx_of(const ds4_train_state *s) { return (stage_ctx *)s->pp; }
#define PIPE(s) (s->pp ? stage_ctx_of(s)->pipe : NULL)
#define STAGE(s) (s->pp ? stage_ctx_of(s)->stage : NULL)

/* The pipeline this rank is a stage of (world = pp: the world), its stage and its data rank: world rank
 * stage * fsdp + d (pp outermost, as Megatron orders its ranks). */
static ds4_comm *pipe_of(const ds4_train_state *s) { return PIPE(s) ? PIPE(s) : s->world; }
static int stage_of(const ds4_train_state *s) { return ds4_comm_rank(pipe_of(s)); }
static int data_rank_of(const ds4_train_state *s) { return STAGE(s) ? ds4_comm_rank(STAGE(s)) : 0; }

/* ------------------------------------------------------------------ agreement between ranks */
/* What one rank tells the others about how a phase ended. */
typedef struct {
    int64_t status;
    char msg[504];
} rank_outcome;

ds4_status ds4_train_agree(ds4_comm *world, ds4_status st) {
    const int W = ds4_comm_size(world);
    if (W == 1) return st;
    rank_outcome mine = {.status = st};
    if (st != DS4_OK) snprintf(mine.msg, sizeof mine.msg, "%s", ds4_errmsg());
    rank_outcome *all = ds4_calloc(DS4_MEM_OTHER, (size_t)W * sizeof *all);
    int64_t *cd = ds4_alloc(DS4_MEM_OTHER, 2 * (size_t)W * sizeof(int64_t));
    ds4_status rc = all && cd ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory exchanging the ranks' status");
    for (int r = 0; rc == DS4_OK && r < W; r++) {
        cd[r] = 1;
        cd[W + r] = r;
    }
    if (rc == DS4_OK) rc = ds4_comm_allgatherv(world, &mine, 1, all, cd, cd + W, sizeof mine);
    for (int r = 0; rc == DS4_OK && r < W; r++) {
        if (all[r].status == DS4_OK) continue;
        if (r == ds4_comm_rank(world)) rc = st; /* keep this rank's own message */
        else rc = ds4_fail((ds4_status)all[r].status, "rank %d: %s", r, all[r].msg);
        break;
    }
    ds4_free(all);
    ds4_free(cd);
    return rc;
}

/* ------------------------------------------------------------------ open / free */
/* ------------------------------------------------------------------ a pipeline stage's groups
 * Each rank holds the groups of its chunks (ds4_model_hold: values, gradients, bf16 copy) and the optimizer
 * state of those alone; the rank of the last chunk also the embedding's values, which its MTP block reads
 * (rank 0 trains them and sends them after each update: ds4_train_state_share). */
static int64_t head_group(const ds4_config *c) { return c->n_layers + 1; }

/* The rank whose chunk runs group g (the head and the MTP block: the loss's chunk). */
static int group_owner(const ds4_pp_layout *L, const ds4_config *c, int64_t g) {
    for (int64_t k = 0; k < L->pp * L->vpp; k++) {
        const ds4_pp_chunk *ch = &L->chunk[k];
        const bool layer = g >= 1 && g < head_group(c) && g - 1 >= ch->layer_begin && g - 1 < ch->layer_end;
        if ((g == 0 && ch->embedding) || (g >= head_group(c) && ch->loss) || layer) return (int)(k % L->pp);
    }
    return 0;
}

/* The rank that reads the embedding without training it (the loss's chunk with the MTP block), -1: none. */
static int embed_reader(const ds4_train_state *s) {
    const ds4_config *c = ds4_model_config(s->m);
    const ds4_pp_layout *L = s->pp;
    const int last = (int)((L->pp * L->vpp - 1) % L->pp);
    return c->n_mtp_layers > 0 && last != group_owner(L, c, 0) ? last : -1;
}

/* The owner of p's group (a float parameter of a pipeline stage's model). */
static int param_owner(const ds4_train_state *s, const ds4_param *p) {
    const int64_t r = ds4_model_region_at(s->m, p->data - ds4_model_params_flat(s->m));
    return group_owner(s->pp, ds4_model_config(s->m), ds4_model_region(s->m, r)->group);
}

/* pp x fsdp (world = pp * fsdp ranks, fsdp > 1): the world split into this data rank's pipeline (the same d
 * on every stage) and this stage's FSDP group (its fsdp data ranks). */
static ds4_status split_stage(ds4_train_state *s) {
    const int W = ds4_comm_size(s->world), rank = ds4_comm_rank(s->world), pp = (int)s->pp->pp, F = W / pp;
    DS4_TRY(ds4_comm_split(s->world, rank % F, rank / F, pp, rank / F, &stage_ctx_of(s)->pipe));
    return ds4_comm_split(s->world, F + rank / F, rank % F, F, rank % F, &stage_ctx_of(s)->stage);
}

static ds4_status open_stage(ds4_train_state *s, const ds4_config *mc, const ds4_train_state_opts *o) {
    if (!o->pp_cfg) return ds4_fail(DS4_ERR_INTERNAL, "pipeline: the train state needs the layout's options");
    stage_ctx *x = ds4_calloc(DS4_MEM_OTHER, sizeof *x);
    if (!(s->pp = x ? &x->L : NULL))
        return ds4_fail(DS4_ERR_OOM, "out of memory for the pipeline layout");
    DS4_TRY(ds4_pp_layout_make(o->pp_cfg, mc->n_layers, mc->n_mtp_layers, s->pp));
    const int W = ds4_comm_size(s->world);
    if (W % s->pp->pp)
        return ds4_fail(DS4_ERR_ARG, "pipeline: pp %lld runs on a multiple of %lld ranks (pp x fsdp), the world has %d",
                        (long long)s->pp->pp, (long long)s->pp->pp, W);
    if (W > s->pp->pp) DS4_TRY(split_stage(s));
    const int stage = stage_of(s);
    for (int64_t g = 0; !STAGE(s) && g < ds4_model_ngroups(s->m); g++) /* pp x fsdp: the stage's FSDP shards them */
        if (group_owner(s->pp, mc, g) == stage) DS4_TRY(ds4_model_hold(s->m, g, true));
    return embed_reader(s) == stage ? ds4_model_hold(s->m, 0, false) : DS4_OK;
}

/* pp x fsdp: the FSDP of this stage's groups over its data ranks (no other group has a piece here); the
 * embedding's values the MTP block's stage reads are held whole there, initialised or loaded like a stage's. */
static ds4_status open_stage_sharded(ds4_train_state *s, const ds4_model_dir *d, uint64_t seed,
                                     const ds4_train_state_opts *o) {
    const ds4_config *mc = ds4_model_config(s->m);
    const int64_t ng = ds4_model_ngroups(s->m);
    bool *mine = ds4_calloc(DS4_MEM_OTHER, (size_t)ng * sizeof(bool));
    if (!mine) return ds4_fail(DS4_ERR_OOM, "out of memory for the stage's groups");
    for (int64_t g = 0; g < ng; g++) mine[g] = group_owner(s->pp, mc, g) == stage_of(s);
    ds4_status st = ds4_fsdp_create_groups(s->m, STAGE(s), o->ep, mine, &s->f);
    ds4_free(mine);
    DS4_TRY(st);
    DS4_TRY(ds4_fsdp_set_prefetch(s->f, o->prefetch_depth));
    DS4_TRY(d ? ds4_fsdp_load(s->f, d) : ds4_fsdp_init_random(s->f, seed));
    if (embed_reader(s) == stage_of(s)) DS4_TRY(d ? ds4_model_load(s->m, d) : ds4_model_init_random(s->m, seed));
    return ds4_optim_init_shard(&s->opt, o->optimizer, s->f, o->swap_optimizer ? s->store : NULL, o->swap_chunk_bytes);
}

/* The model first (the order memplan's numbers were first taken in): whole, or unmapped behind FSDP or as a
 * pipeline stage's groups. */
static ds4_status open_model(ds4_train_state *s, const ds4_config *mc, const ds4_train_state_opts *o) {
    const bool unmapped = s->sharded || o->pipeline;
    DS4_TRY(s->bf16 ? ds4_model_create_bf16(&s->exec, mc, unmapped, &s->m)
                    : ds4_model_create(&s->exec, mc, unmapped, &s->m));
    return o->pipeline ? open_stage(s, mc, o) : DS4_OK;
}

/* The offload store and the layer-input swap, when a swap policy asks for them. */
static ds4_status open_offload(ds4_train_state *s, const ds4_train_state_opts *o) {
    if (!o->swap_optimizer && !o->swap_layer_input) return DS4_OK;
    DS4_TRY(ds4_offload_open(&s->exec, o->offload_dir, &s->store));
    return o->swap_layer_input ? ds4_act_swap_new(s->store, &s->swap) : DS4_OK;
}

static ds4_status open_whole(ds4_train_state *s, const ds4_model_dir *d, uint64_t seed, const ds4_train_state_opts *o) {
    if (d) DS4_TRY(ds4_model_load(s->m, d));
    else DS4_TRY(ds4_model_init_random(s->m, seed));
    return ds4_optim_init(&s->opt, o->optimizer, s->m, o->swap_optimizer ? s->store : NULL, o->swap_chunk_bytes);
}

static ds4_status open_sharded(ds4_train_state *s, const ds4_model_dir *d, uint64_t seed, int ep,
                               const ds4_train_state_opts *o) {
    DS4_TRY(ds4_fsdp_create(s->m, s->world, ep, &s->f));
    DS4_TRY(ds4_fsdp_set_prefetch(s->f, o->prefetch_depth));
    DS4_TRY(d ? ds4_fsdp_load(s->f, d) : ds4_fsdp_init_random(s->f, seed));
    return ds4_optim_init_shard(&s->opt, o->optimizer, s->f, o->swap_optimizer ? s->store : NULL, o->swap_chunk_bytes);
}

/* A plan communicator moves no data: only a plan steps on it, and a sharded plan needs one. */
static ds4_status check_world(const ds4_train_state *s, const ds4_comm *world) {
    if (ds4_comm_is_plan(world) && !s->exec.plan)
        return ds4_fail(DS4_ERR_ARG, "a simulated world (plan communicator) can only run a plan step");
    if (s->sharded && s->exec.plan && !ds4_comm_is_plan(world))
        return ds4_fail(DS4_ERR_ARG, "a sharded plan runs on a plan communicator (ds4_comm_plan), not on a real world");
    return DS4_OK;
}

ds4_status ds4_train_state_new(const ds4_exec *exec, ds4_train_state **out) {
    *out = ds4_calloc(DS4_MEM_OTHER, sizeof **out);
    if (!*out) return DS4_ERR_OOM;
    (*out)->exec = exec ? *exec : (ds4_exec){0};
    return DS4_OK;
}

ds4_status ds4_train_state_setup(ds4_train_state *s, const ds4_config *mc, const ds4_model_dir *d, uint64_t seed,
                                 ds4_comm *world, const ds4_train_state_opts *opts) {
    if (s->m) return ds4_fail(DS4_ERR_INTERNAL, "train state: set up twice");
    s->world = world;
    /* a pipeline's FSDP + EP is its stages' (open_stage_sharded) */
    s->sharded = !opts->pipeline && (ds4_comm_size(world) > 1 || opts->ep > 1 || opts->shard);
    if (opts->pipeline && (opts->shard || (opts->ep > 1 && opts->pp_cfg && ds4_comm_size(world) == opts->pp_cfg->pp)))
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline: EP needs FSDP inside a stage (pp x fsdp ranks; ep %d)", opts->ep);
    s->bf16 = opts->bf16;
    if (s->bf16) s->exec.matmul_precision = DS4_MATMUL_BF16; /* mixed precision runs its GEMMs on bf16 operands */
    s->per_rank = opts->per_rank_ckpt;
    ds4_status st = check_world(s, world);
    if (st == DS4_OK) st = open_model(s, mc, opts);
    if (st == DS4_OK) st = open_offload(s, opts);
    if (st == DS4_OK)
        st = STAGE(s) ? open_stage_sharded(s, d, seed, opts)
           : s->sharded ? open_sharded(s, d, seed, opts->ep, opts) : open_whole(s, d, seed, opts);
    if (st == DS4_OK) ds4_train_state_refresh_bf16(s);
    return st;
}

ds4_status ds4_train_state_open(const ds4_config *mc, const ds4_model_dir *d, uint64_t seed, ds4_comm *world,
                                const ds4_train_state_opts *opts, ds4_train_state **out) {
    *out = NULL;
    ds4_train_state *s;
    DS4_TRY(ds4_train_state_new(opts->exec, &s));
    ds4_status st = ds4_train_state_setup(s, mc, d, seed, world, opts);
    if (st != DS4_OK) {
        ds4_train_state_free(s);
        return st;
    }
    *out = s;
    return DS4_OK;
}

void ds4_train_state_free(ds4_train_state *s) {
    if (!s) return;
    ds4_act_swap_free(s->swap);
    ds4_act_swap_free(s->swap2);
    ds4_optim_free(&s->opt);
    ds4_offload_close(s->store); /* after everything it holds */
    ds4_fsdp_free(s->f);
    ds4_comm_free(PIPE(s));
    ds4_comm_free(STAGE(s));
    ds4_model_free(s->m);
    ds4_free(s->pp);
    ds4_free(s);
}

const ds4_exec *ds4_train_state_exec(const ds4_train_state *s) { return &s->exec; }
int ds4_train_state_ranks(const ds4_train_state *s) { return ds4_comm_size(s->world); }
ds4_comm *ds4_train_state_pipe(ds4_train_state *s) { return s->pp ? pipe_of(s) : NULL; }
int ds4_train_state_data_ranks(const ds4_train_state *s) { return STAGE(s) ? ds4_comm_size(STAGE(s)) : 1; }

ds4_model *ds4_train_state_model(ds4_train_state *s) { return s->m; }
const ds4_param_hooks *ds4_train_state_hooks(ds4_train_state *s) { return s->f ? ds4_fsdp_hooks(s->f) : NULL; }
ds4_act_swap *ds4_train_state_swap(ds4_train_state *s) { return s->swap; }
ds4_status ds4_train_state_swap_slot(ds4_train_state *s, int slot, ds4_act_swap **out) {
    *out = NULL;
    if (!s->swap) return DS4_OK;
    if (slot == 0) *out = s->swap;
    else if (s->swap2 || ds4_act_swap_new(s->store, &s->swap2) == DS4_OK) *out = s->swap2;
    return *out ? DS4_OK : ds4_fail_prefix(DS4_ERR_OOM, "--moe-fb-overlap: the second pass's layer-input swap");
}
const ds4_ep_ops *ds4_train_state_yielding_ep(ds4_train_state *s, void (*yield)(void *ctx), void *ctx) {
    const ds4_param_hooks *h = ds4_train_state_hooks(s);
    if (!h || !h->ep) return NULL;
    ds4_fsdp_yielding_init(s->f, yield, ctx, &s->yielding);
    return &s->yielding.ops;
}
/* The elements of the float parameters of m (own: those whose gradients it holds): a stage's model has
 * region padding. */
static int64_t param_elements(ds4_model *m, bool own) {
    int64_t n = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (ds4_param_in_flat(p) && (!own || ds4_model_param_held(m, p, true))) n += p->numel;
    }
    return n;
}

int64_t ds4_train_state_numel(const ds4_train_state *s) {
    if (s->f) return ds4_fsdp_packed_numel(s->f);
    return s->pp ? param_elements(s->m, false) : ds4_model_numel(s->m);
}

int64_t ds4_train_state_held_numel(const ds4_train_state *s) {
    if (s->f) return ds4_fsdp_shard_numel(s->f);
    return s->pp ? param_elements(s->m, true) : ds4_model_numel(s->m);
}

/* ------------------------------------------------------------------ one step */
void ds4_train_state_zero_grads(ds4_train_state *s) {
    if (s->f) ds4_fsdp_zero_grads(s->f);
    else ds4_model_zero_grad(s->m);
}

void ds4_train_state_scale_grads(ds4_train_state *s, int64_t micro_batches) {
    if (micro_batches <= 1 || s->exec.plan) return;
    if (!s->f) {
        ds4_model_scale_held_grads(s->m, 1.0f / (float)micro_batches);
        return;
    }
    ds4_dev_scale(&s->exec, ds4_fsdp_shard_grads(s->f), ds4_fsdp_shard_numel(s->f), 1.0f / (float)micro_batches);
}

ds4_status ds4_train_state_mean(ds4_train_state *s, double *x, int64_t n) {
    ds4_comm *data = s->pp ? STAGE(s) : s->world; /* pp x fsdp: the stage's data ranks (the same on every stage) */
    const int W = data ? ds4_comm_size(data) : 1;
    if (!s->f || W == 1) return DS4_OK;
    DS4_TRY(ds4_comm_sum_f64(data, x, n));
    for (int64_t i = 0; i < n; i++) x[i] /= (double)W;
    return DS4_OK;
}

ds4_status ds4_train_state_clip(ds4_train_state *s, double max_norm, double *norm) {
    if (s->f && s->pp) return ds4_fsdp_clip_grad_norm_over(s->f, s->world, max_norm, norm); /* every stage's limbs */
    if (s->f) return ds4_fsdp_clip_grad_norm(s->f, max_norm, norm); /* FSDP plans by itself */
    *norm = 0;
    return s->exec.plan ? DS4_OK : ds4_clip_grad_norm_over(s->m, s->pp ? s->world : NULL, max_norm, norm);
}

enum { TAG_EMBED = 32000, TAG_CKPT = 32001 }; /* above the schedule's tags, whose messages are all received */

/* Region [start, end) of the values from rank `from` to rank `to` of the pipeline, in place (a pipeline's
 * model is in host memory: ds4_pp_run_rank refuses any other), so a step allocates nothing for it. */
static ds4_status send_values(ds4_train_state *s, int from, int to, int64_t start, int64_t end) {
    float *v = ds4_model_params_flat(s->m) + start;
    if (!ds4_exec_host_memory(&s->exec))
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline: sending the embedding of a model in device memory is not built yet");
    ds4_comm_req *req = NULL;
    ds4_comm *pipe = pipe_of(s);
    ds4_status st = ds4_comm_rank(pipe) == from
                        ? ds4_comm_isend(pipe, v, end - start, sizeof(float), to, TAG_EMBED, &req)
                        : ds4_comm_irecv(pipe, v, end - start, sizeof(float), from, TAG_EMBED, &req);
    return st == DS4_OK ? ds4_comm_wait(req) : st;
}

ds4_status ds4_train_state_share(ds4_train_state *s) {
    if (!s->pp || s->exec.plan) return DS4_OK;
    const int reader = embed_reader(s), owner = group_owner(s->pp, ds4_model_config(s->m), 0);
    const int rank = stage_of(s);
    if (reader < 0 || (rank != reader && rank != owner)) return DS4_OK;
    /* pp x fsdp: the owner stage's FSDP gathers the embedding (every data rank of the stage), and each data
     * rank sends it to the same data rank of the reader's stage */
    const ds4_param_hooks *h = s->f && rank == owner ? ds4_fsdp_hooks(s->f) : NULL;
    if (h) DS4_TRY(h->gather(h->ctx, 0));
    ds4_status st = DS4_OK;
    for (int64_t i = 0; st == DS4_OK && i < ds4_model_nregions(s->m); i++) {
        const ds4_region *r = ds4_model_region(s->m, i);
        if (r->group == 0) st = send_values(s, owner, reader, r->start, r->end);
    }
    if (h) h->drop(h->ctx, 0);
    return st;
}

ds4_status ds4_train_state_own_step(ds4_train_state *s, const void *cfg, double weight_decay, double lr) {
    const ds4_opt_target t = {.m = s->m, .f = s->f};
    return ds4_optim_own_step(&s->opt, &t, cfg, weight_decay, lr);
}

const ds4_optimizer *ds4_train_state_optimizer(const ds4_train_state *s) { return s->opt.opt; }
bool ds4_train_state_bf16(const ds4_train_state *s) { return s->bf16; }

ds4_status ds4_train_state_adamw_step(ds4_train_state *s, const ds4_adamw_cfg *c, double lr) {
    if (s->f) return ds4_adamw_step_flat(&s->opt, ds4_fsdp_shard_params(s->f), ds4_fsdp_shard_grads(s->f), c, lr);
    return ds4_adamw_step(&s->opt, s->m, c, lr);
}

void ds4_train_state_refresh_bf16(ds4_train_state *s) {
    if (!s->bf16) return;
    if (s->f) ds4_fsdp_refresh_bf16(s->f);
    if (!s->f || s->pp) ds4_model_refresh_bf16(s->m); /* pp x fsdp: the held embedding of the MTP block's stage */
}

ds4_status ds4_train_state_router_bias(ds4_train_state *s, int64_t *loads, double gamma) {
    if (!s->f) {
        return s->exec.plan ? DS4_OK : ds4_router_bias_update(s->m, loads, gamma);
    }
    const ds4_config *c = ds4_model_config(s->m);
    /* pp x fsdp: the pipeline summed its stages' loads; the data ranks' are summed here */
    DS4_TRY(ds4_comm_sum_i64(s->pp ? STAGE(s) : s->world, loads, (c->n_layers + c->n_mtp_layers) * c->n_routed_experts));
    return ds4_fsdp_router_bias_update(s->f, loads, gamma);
}

/* ------------------------------------------------------------------ checkpoints */
/* --swap-optimizer: the optimizer's arrays come back to memory around a checkpoint (as MindSpeed does) and
 * go back to the store after it, also after a failure (a resident state steps the same, so nothing is lost). */
static ds4_status moments_in(ds4_train_state *s) { return s->opt.store ? ds4_optim_swap_in(&s->opt) : DS4_OK; }
static ds4_status moments_out(ds4_train_state *s, ds4_status st) {
    ds4_status out = s->opt.store ? ds4_optim_swap_out(&s->opt, NULL, 0) : DS4_OK;
    return st != DS4_OK ? st : out;
}

/* Array a of group g of the resident state in the shard's layout, copied to the host into *tmp
 * [shard_numel] (0 outside the group), where the gathers read it: the state lives on the backend. */
static ds4_status shard_array(const ds4_train_state *s, int g, int a, float **out, float **tmp) {
    if (!(*tmp = ds4_alloc(DS4_MEM_OPTIM, (size_t)(s->opt.n > 0 ? s->opt.n : 1) * sizeof(float))))
        return ds4_fail(DS4_ERR_OOM, "out of memory laying out %s for a checkpoint", s->opt.g[g].names[a]);
    *out = *tmp;
    if (s->opt.g[g].n == s->opt.n) return ds4_optim_read(&s->opt, g, a, 0, s->opt.n, *tmp); /* the group is all */
    return ds4_optim_expand(&s->opt, g, a, *tmp);
}

/* The sink of ds4_fsdp_stream_packed on rank 0: the values of the parameters of one optimizer group
 * (group < 0: all) go straight into the file being written. */
typedef struct {
    ds4_st_writer *w;
    ds4_model *m;
    const ds4_optimizer *opt;
    int group;
} sink_ctx;
static ds4_status put_values(void *ctx, int64_t param, const float *values, int64_t n) {
    const sink_ctx *c = ctx;
    if (!c->w) return DS4_OK; /* rank 0 after a failed write: it gathers with the others, writes nothing */
    const int g = ds4_optimizer_takes(c->opt, ds4_model_param(c->m, param)) ? DS4_OPT_OWN : DS4_OPT_ADAMW;
    if (c->group >= 0 && g != c->group) return DS4_OK;
    return ds4_st_writer_put(c->w, values, (size_t)n * sizeof(float));
}

/* bytes of the model's backend into the file, through a host copy. */
static ds4_status put_from_device(ds4_model *m, ds4_st_writer *w, const void *src, size_t bytes) {
    void *h = ds4_alloc(DS4_MEM_OTHER, bytes);
    if (!h) return ds4_fail(DS4_ERR_OOM, "out of memory for a %zu-byte checkpoint tensor", bytes);
    ds4_model_to_host(m, h, src, bytes);
    ds4_status st = ds4_st_writer_put(w, h, bytes);
    ds4_free(h);
    return st;
}

/* dir/model.safetensors as ds4_model_save lays it out (8-byte integer tables first, then the floats in
 * table order), header written and the integer tables put; the floats follow from the shards. */
static ds4_status begin_model_file(ds4_model *m, const char *dir, ds4_st_writer *w) {
    for (int pass = 0; pass < 2; pass++)
        for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
            const ds4_param *p = ds4_model_param(m, i);
            if (p->is_int == (pass == 0))
                DS4_TRY(ds4_st_writer_declare(w, p->name, p->is_int ? DS4_I64 : DS4_F32, p->ndim, p->shape));
        }
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    DS4_TRY(ds4_st_writer_begin(w, path));
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (p->is_int) DS4_TRY(put_from_device(m, w, p->idata, (size_t)p->numel * sizeof(int64_t)));
    }
    return DS4_OK;
}

/* dir/optim.state as the whole-model save lays it out (adamw.step, the mark, then each group's arrays over
 * the packed elements of its parameters), the step put. */
static ds4_status begin_optim_file(const ds4_train_state *s, const char *dir, ds4_st_writer *w) {
    const ds4_optim *o = &s->opt;
    int64_t count[DS4_OPT_NGROUPS] = {0, 0}, one = 1;
    for (int64_t i = 0; i < ds4_model_nparams(s->m); i++) {
        const ds4_param *p = ds4_model_param(s->m, i);
        if (ds4_param_in_flat(p)) count[ds4_optimizer_takes(o->opt, p) ? DS4_OPT_OWN : DS4_OPT_ADAMW] += p->numel;
    }
    DS4_TRY(ds4_st_writer_declare(w, "adamw.step", DS4_I64, 1, &one));
    if (o->opt->mark) DS4_TRY(ds4_st_writer_declare(w, o->opt->mark, DS4_I64, 1, &one));
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < o->g[g].k; a++) DS4_TRY(ds4_st_writer_declare(w, o->g[g].names[a], DS4_F32, 1, &count[g]));
    char path[4200];
    snprintf(path, sizeof path, "%s/optim.state", dir);
    DS4_TRY(ds4_st_writer_begin(w, path));
    DS4_TRY(ds4_st_writer_put(w, &o->step, sizeof o->step));
    return o->opt->mark ? ds4_st_writer_put(w, &o->step, sizeof o->step) : DS4_OK;
}

/* The carried tensors (the DSpark drafter's, whole on every rank), after the streamed floats: they end
 * the parameter table, so the file has the layout ds4_model_save gives it. */
static ds4_status put_carried(ds4_model *m, ds4_st_writer *w) {
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (p->carried) DS4_TRY(put_from_device(m, w, p->data, (size_t)p->numel * sizeof(float)));
    }
    return DS4_OK;
}

/* One file streamed from the shards: rank 0 (dir != NULL) writes it, every rank gathers the weights, or
 * each optimizer array in the shard's layout, in order. After a failure on rank 0 the gathers still run, so
 * no rank waits forever. */
static ds4_status stream_file(ds4_train_state *s, const char *dir, bool optim) {
    ds4_st_writer *w = NULL;
    ds4_status st = dir ? ds4_st_writer_new(&w) : DS4_OK;
    if (st == DS4_OK && dir) st = optim ? begin_optim_file(s, dir, w) : begin_model_file(s->m, dir, w);
    sink_ctx c = {.w = st == DS4_OK ? w : NULL, .m = s->m, .opt = s->opt.opt, .group = -1}; /* NULL: gather only */
    if (!optim) {
        const float *sp = ds4_fsdp_shard_params(s->f);
        const float *host = ds4_dev_host_view(&s->exec, sp, (size_t)ds4_fsdp_shard_numel(s->f) * sizeof(float));
        ds4_status gs = ds4_train_agree(s->world, host ? DS4_OK : DS4_ERR_OOM); /* all stream or none */
        if (gs == DS4_OK) gs = ds4_fsdp_stream_packed(s->f, host, 0, put_values, &c);
        ds4_dev_host_view_free(&s->exec, host, sp);
        if (st == DS4_OK) st = gs;
    }
    for (int g = 0; optim && g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < s->opt.g[g].k; a++) {
            float *in = NULL, *tmp = NULL;
            ds4_status gs = ds4_train_agree(s->world, shard_array(s, g, a, &in, &tmp)); /* all stream or none */
            c.group = g;
            if (gs == DS4_OK) gs = ds4_fsdp_stream_packed(s->f, in, 0, put_values, &c);
            ds4_free(tmp);
            if (st == DS4_OK) st = gs;
            if (gs != DS4_OK) break;
        }
    if (st == DS4_OK && dir && !optim) st = put_carried(s->m, w);
    if (st == DS4_OK && dir) st = ds4_st_writer_finish(w);
    ds4_st_writer_free(w); /* removes the temp file of an unfinished stream */
    return st;
}

/* Rank 0 writes the single-process format while the shards stream in, one region at a time: its memory
 * holds one region, never the whole model. */
static ds4_status save_sharded(ds4_train_state *s, const char *root, int64_t keep, const ds4_ckpt_meta *meta) {
    const bool writer = ds4_comm_rank(s->world) == 0;
    char tmp[4096] = "", cfg[4200];
    ds4_status st = writer ? ds4_checkpoint_begin(root, meta->step, tmp, sizeof tmp) : DS4_OK;
    snprintf(cfg, sizeof cfg, "%s/config.json", tmp);
    if (st == DS4_OK && writer) st = ds4_config_save(ds4_model_config(s->m), cfg);
    st = ds4_train_agree(s->world, st); /* nobody streams when rank 0 cannot write */
    if (st != DS4_OK) {
        ds4_checkpoint_abort(tmp);
        return st;
    }
    st = stream_file(s, writer ? tmp : NULL, false);
    ds4_status mo = ds4_train_agree(s->world, moments_in(s)); /* the same on every rank: all stream or none */
    if (mo == DS4_OK) {
        mo = stream_file(s, writer && st == DS4_OK ? tmp : NULL, true);
        mo = moments_out(s, mo);
    }
    if (st == DS4_OK) st = mo;
    if (st == DS4_OK && writer) st = ds4_checkpoint_commit(root, keep, tmp, meta); /* removes tmp on failure */
    else if (writer) ds4_checkpoint_abort(tmp); /* a failed stream leaves no .tmp-step-N behind */
    return ds4_train_agree(s->world, st); /* the others wait for the write and share its outcome */
}

/* ------------------------------------------------------------------ a pipeline's checkpoint
 * Rank 0 writes the one-process files while the other ranks send their groups' tensors, one tensor at a time
 * in the files' order: besides its own groups it holds one tensor of another rank's, never the model. */
typedef struct {
    ds4_train_state *s;
    ds4_st_writer *w; /* rank 0's file; NULL: elsewhere, or after a failed write (it still receives) */
    float *buf;       /* [the largest float tensor] */
    const float *shard; /* pp x fsdp: the array being written in the stage's shard layout (host memory) */
    ds4_status st;    /* the first failure here */
} stage_sink;

/* pp x fsdp: p's elements of k->shard gathered on data rank 0 of its owner stage, which sends them to world
 * rank 0 (stage 0's data rank 0 gathers them in place); the other ranks take no part. */
static void stage_put_sharded(stage_sink *k, const ds4_param *p) {
    ds4_train_state *s = k->s;
    const int rank = ds4_comm_rank(s->world), owner = param_owner(s, p), F = ds4_comm_size(STAGE(s));
    const bool mine = stage_of(s) == owner;
    if (!mine && rank != 0) return;
    ds4_status st = mine ? ds4_fsdp_gather_param(s->f, k->shard, p, k->buf, 0) : DS4_OK;
    if (owner != 0 && (rank == 0 || (mine && data_rank_of(s) == 0))) { /* sent even after a failure: rank 0 waits */
        ds4_comm_req *req = NULL;
        ds4_status cs = rank == 0 ? ds4_comm_irecv(s->world, k->buf, p->numel, sizeof(float), owner * F, TAG_CKPT, &req)
                                  : ds4_comm_isend(s->world, k->buf, p->numel, sizeof(float), 0, TAG_CKPT, &req);
        if (cs == DS4_OK) cs = ds4_comm_wait(req);
        if (st == DS4_OK) st = cs;
    }
    if (st == DS4_OK && rank == 0 && k->w) st = ds4_st_writer_put(k->w, k->buf, (size_t)p->numel * sizeof(float));
    if (st != DS4_OK && rank == 0) k->w = NULL;
    if (k->st == DS4_OK) k->st = st;
}

/* p's values (g < 0) or array a of optimizer group g, read by its owner, into rank 0's file. */
static void stage_put(stage_sink *k, const ds4_param *p, int g, int a) {
    ds4_train_state *s = k->s;
    if (s->f) {
        stage_put_sharded(k, p);
        return;
    }
    const int rank = ds4_comm_rank(s->world), owner = param_owner(s, p);
    if (rank != owner && rank != 0) return;
    const size_t bytes = (size_t)p->numel * sizeof(float);
    const int64_t off = p->data - ds4_model_params_flat(s->m);
    ds4_status st = DS4_OK;
    if (rank == owner && g < 0) ds4_model_to_host(s->m, k->buf, p->data, bytes);
    int64_t j;
    if (rank == owner && g >= 0 && ds4_optim_locate(&s->opt, off, &j) == g)
        st = ds4_optim_read(&s->opt, g, a, j, p->numel, k->buf);
    else if (rank == owner && g >= 0)
        st = ds4_fail(DS4_ERR_INTERNAL, "%s: not in optimizer group %d of its stage's state", p->name, g);
    if (owner != 0) { /* sent even after a failed read: rank 0 waits for it */
        ds4_comm_req *req = NULL;
        ds4_status cs = rank == owner ? ds4_comm_isend(s->world, k->buf, p->numel, sizeof(float), 0, TAG_CKPT, &req)
                                      : ds4_comm_irecv(s->world, k->buf, p->numel, sizeof(float), owner, TAG_CKPT, &req);
        if (cs == DS4_OK) cs = ds4_comm_wait(req);
        if (st == DS4_OK) st = cs;
    }
    if (st == DS4_OK && rank == 0 && k->w) st = ds4_st_writer_put(k->w, k->buf, bytes);
    if (st != DS4_OK && rank == 0) k->w = NULL;
    if (k->st == DS4_OK) k->st = st;
}

/* model.safetensors (dir: rank 0) or optim.state, in ds4_model_save's and ds4_optim_state_save's layouts. */
static ds4_status stream_stage_file(ds4_train_state *s, const char *dir, bool optim, float *buf) {
    ds4_st_writer *w = NULL;
    ds4_status st = dir ? ds4_st_writer_new(&w) : DS4_OK;
    if (st == DS4_OK && dir) st = optim ? begin_optim_file(s, dir, w) : begin_model_file(s->m, dir, w);
    stage_sink k = {.s = s, .w = st == DS4_OK ? w : NULL, .buf = buf};
    for (int g = optim ? 0 : -1; g < (optim ? DS4_OPT_NGROUPS : 0); g++)
        for (int a = 0; a < (g < 0 ? 1 : s->opt.g[g].k); a++) {
            float *tmp = NULL, *arr = NULL;
            if (s->f && g < 0) k.shard = ds4_dev_host_view(&s->exec, ds4_fsdp_shard_params(s->f),
                                                           (size_t)ds4_fsdp_shard_numel(s->f) * sizeof(float));
            ds4_status as = s->f && g >= 0 ? shard_array(s, g, a, &arr, &tmp) : DS4_OK;
            if (s->f && g >= 0) k.shard = arr;
            as = s->f ? ds4_train_agree(s->world, as == DS4_OK && !k.shard ? DS4_ERR_OOM : as) : DS4_OK;
            for (int64_t i = 0; as == DS4_OK && i < ds4_model_nparams(s->m); i++) {
                const ds4_param *p = ds4_model_param(s->m, i);
                const int pg = ds4_optimizer_takes(s->opt.opt, p) ? DS4_OPT_OWN : DS4_OPT_ADAMW;
                if (ds4_param_in_flat(p) && (g < 0 || pg == g)) stage_put(&k, p, g, a);
            }
            if (s->f && g < 0) ds4_dev_host_view_free(&s->exec, k.shard, ds4_fsdp_shard_params(s->f));
            ds4_free(tmp);
            if (k.st == DS4_OK) k.st = as;
        }
    if (st == DS4_OK) st = k.st;
    if (st == DS4_OK && dir && !optim) st = put_carried(s->m, w);
    if (st == DS4_OK && dir) st = ds4_st_writer_finish(w);
    ds4_st_writer_free(w); /* removes the temp file of an unfinished stream */
    return st;
}

static ds4_status save_stage(ds4_train_state *s, const char *root, int64_t keep, const ds4_ckpt_meta *meta) {
    const bool writer = ds4_comm_rank(s->world) == 0;
    char tmp[4096] = "", cfg[4200];
    int64_t most = 1;
    for (int64_t i = 0; i < ds4_model_nparams(s->m); i++) {
        const ds4_param *p = ds4_model_param(s->m, i);
        if (ds4_param_in_flat(p) && p->numel > most) most = p->numel;
    }
    float *buf = ds4_alloc(DS4_MEM_OTHER, (size_t)most * sizeof(float));
    ds4_status st = buf ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory for a %lld-element checkpoint tensor",
                                            (long long)most);
    if (st == DS4_OK && writer) st = ds4_checkpoint_begin(root, meta->step, tmp, sizeof tmp);
    snprintf(cfg, sizeof cfg, "%s/config.json", tmp);
    if (st == DS4_OK && writer) st = ds4_config_save(ds4_model_config(s->m), cfg);
    st = ds4_train_agree(s->world, st); /* nobody streams when rank 0 cannot write */
    if (st == DS4_OK) {
        st = stream_stage_file(s, writer ? tmp : NULL, false, buf);
        ds4_status so = stream_stage_file(s, writer && st == DS4_OK ? tmp : NULL, true, buf);
        if (st == DS4_OK) st = so;
    }
    ds4_free(buf);
    if (st == DS4_OK && writer) st = ds4_checkpoint_commit(root, keep, tmp, meta); /* removes tmp on failure */
    else if (writer) ds4_checkpoint_abort(tmp);
    return ds4_train_agree(s->world, st); /* the others wait for the write and share its outcome */
}

/* ------------------------------------------------------------------ per-rank checkpoints */
/* This rank's shard as packed ranges [packed offset, shard offset, length], neighbours merged. */
typedef struct {
    ds4_model *m;
    int64_t *poff;   /* [nparams] packed offset of each float parameter */
    int64_t *r;      /* [n][3] */
    int64_t n, cap;  /* ranges, and triples allocated */
    bool oom;
} ranges_ctx;
static void add_range(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    ranges_ctx *c = ctx;
    int64_t a = c->poff[p - ds4_model_param(c->m, 0)] + k0, *last = c->n ? c->r + 3 * (c->n - 1) : NULL;
    if (last && last[0] + last[2] == a && last[1] + last[2] == s0) {
        last[2] += k1 - k0;
        return;
    }
    if (!ds4_grow((void **)&c->r, &c->cap, 3 * (c->n + 1), sizeof(int64_t))) {
        c->oom = true;
        return;
    }
    c->r[3 * c->n] = a, c->r[3 * c->n + 1] = s0, c->r[3 * c->n + 2] = k1 - k0;
    c->n++;
}

static ds4_status shard_ranges(ds4_train_state *s, ranges_ctx *c) {
    *c = (ranges_ctx){.m = s->m};
    const int64_t np = ds4_model_nparams(s->m);
    c->poff = ds4_alloc(DS4_MEM_OTHER, (size_t)(np + 1) * sizeof(int64_t));
    if (!c->poff) return ds4_fail(DS4_ERR_OOM, "out of memory listing the shard's ranges");
    for (int64_t i = 0, off = 0; i < np; i++) {
        const ds4_param *p = ds4_model_param(s->m, i);
        c->poff[i] = off;
        off += ds4_param_in_flat(p) ? p->numel : 0;
    }
    ds4_fsdp_for_each_piece(s->f, add_range, c);
    return c->oom ? ds4_fail(DS4_ERR_OOM, "out of memory listing the shard's ranges") : DS4_OK;
}

/* Every rank's ranges on every rank: sizes [W][2] (ranges, shard elements), all [sum ranges][3] (allocated
 * here). A shard also holds region padding, so its elements can outnumber its ranges' lengths. */
static ds4_status share_ranges(ds4_train_state *s, const ranges_ctx *c, int64_t **sizes, int64_t **all) {
    const int W = ds4_comm_size(s->world);
    int64_t *cd = ds4_alloc(DS4_MEM_OTHER, 2 * (size_t)W * sizeof(int64_t));
    *sizes = ds4_alloc(DS4_MEM_OTHER, 2 * (size_t)W * sizeof(int64_t));
    *all = NULL;
    ds4_status st = cd && *sizes ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory sharing the shards' ranges");
    const int64_t mine[2] = {c->n, ds4_fsdp_shard_numel(s->f)};
    for (int r = 0; st == DS4_OK && r < W; r++) cd[r] = 2, cd[W + r] = 2 * r;
    if (st == DS4_OK) st = ds4_comm_allgatherv(s->world, mine, 2, *sizes, cd, cd + W, sizeof(int64_t));
    int64_t total = 0;
    for (int r = 0; st == DS4_OK && r < W; r++) {
        cd[r] = 3 * (*sizes)[2 * r];
        cd[W + r] = total;
        total += cd[r];
    }
    if (st == DS4_OK) *all = ds4_alloc(DS4_MEM_OTHER, (size_t)(total > 0 ? total : 1) * sizeof(int64_t));
    if (st == DS4_OK && !*all) st = ds4_fail(DS4_ERR_OOM, "out of memory sharing the shards' ranges");
    if (st == DS4_OK) st = ds4_comm_allgatherv(s->world, c->r, 3 * c->n, *all, cd, cd + W, sizeof(int64_t));
    ds4_free(cd);
    return st;
}

/* This rank's file: its shard of the weights and the optimizer's arrays as they are, each over its group's
 * elements (brought back to memory when swapped); rank 0's also the integer tables and carried tensors. */
static ds4_status write_rank_file(ds4_train_state *s, const char *tmp) {
    const int rank = ds4_comm_rank(s->world);
    DS4_TRY(moments_in(s));
    const float *sp = ds4_fsdp_shard_params(s->f);
    const int64_t ns = ds4_fsdp_shard_numel(s->f);
    ds4_ckpt_shard_data d = {.params = ds4_dev_host_view(&s->exec, sp, (size_t)ns * sizeof(float)), .n = ns,
                             .step = s->opt.step, .mark = s->opt.opt->mark, .tables = rank == 0 ? s->m : NULL};
    const float *dev[DS4_CKPT_ARRAYS_MAX];
    bool ok = d.params || !sp;
    for (int g = 0; g < DS4_OPT_NGROUPS; g++) /* the arrays as the host sees them (copies on a device) */
        for (int a = 0; a < s->opt.g[g].k && d.narrays < DS4_CKPT_ARRAYS_MAX; a++, d.narrays++) {
            d.names[d.narrays] = s->opt.g[g].names[a];
            dev[d.narrays] = s->opt.g[g].mem[a];
            d.arrays[d.narrays] = ds4_dev_host_view(&s->exec, dev[d.narrays], (size_t)s->opt.g[g].n * sizeof(float));
            d.lens[d.narrays] = s->opt.g[g].n;
            ok = ok && (d.arrays[d.narrays] || !dev[d.narrays]);
        }
    ds4_status st = ok ? ds4_checkpoint_write_shard(tmp, rank, ds4_comm_size(s->world), &d) : DS4_ERR_OOM;
    for (int i = 0; i < d.narrays; i++) ds4_dev_host_view_free(&s->exec, d.arrays[i], dev[i]);
    ds4_dev_host_view_free(&s->exec, d.params, sp);
    return moments_out(s, st);
}

/* Every rank writes its shard file into rank 0's hidden step folder at the same time; rank 0 writes the
 * index and commits only when every rank has written (else it removes the folder: the checkpoints stay as
 * they were). */
static ds4_status save_per_rank(ds4_train_state *s, const char *root, int64_t keep, const ds4_ckpt_meta *meta) {
    const bool lead = ds4_comm_rank(s->world) == 0;
    char tmp[4096] = "", cfg[4200];
    ds4_status st = lead ? ds4_checkpoint_begin(root, meta->step, tmp, sizeof tmp) : DS4_OK;
    snprintf(cfg, sizeof cfg, "%s/config.json", tmp);
    if (st == DS4_OK && lead) st = ds4_config_save(ds4_model_config(s->m), cfg);
    ranges_ctx rc = {0};
    int64_t *sizes = NULL, *all = NULL;
    if (st == DS4_OK) st = shard_ranges(s, &rc);
    st = ds4_train_agree(s->world, st); /* the folder exists before anyone writes into it */
    if (st == DS4_OK) st = ds4_train_agree(s->world, share_ranges(s, &rc, &sizes, &all));
    if (st == DS4_OK) {
        ds4_checkpoint_tmp_name(root, meta->step, tmp, sizeof tmp);
        st = ds4_train_agree(s->world, write_rank_file(s, tmp));
    }
    if (st == DS4_OK && lead)
        st = ds4_checkpoint_write_index(tmp, ds4_comm_size(s->world), ds4_fsdp_packed_numel(s->f), sizes, all);
    if (st == DS4_OK && lead) st = ds4_checkpoint_commit(root, keep, tmp, meta); /* removes tmp on failure */
    else if (lead) ds4_checkpoint_abort(tmp); /* a failed rank leaves no .tmp-step-N behind */
    ds4_free(rc.poff);
    ds4_free(rc.r);
    ds4_free(sizes);
    ds4_free(all);
    return ds4_train_agree(s->world, st);
}

/* A per-rank checkpoint into this rank's shard: the packed ranges it holds, read from whichever files
 * hold them (any world, any EP degree). */
static ds4_status load_shard_per_rank(ds4_train_state *s, const char *path) {
    ds4_ckpt_shards *r;
    DS4_TRY(ds4_ckpt_shards_open(path, ds4_fsdp_packed_numel(s->f), &r));
    ds4_status st = ds4_fsdp_scatter_packed(s->f, ds4_ckpt_shards_read, r, ds4_fsdp_shard_params(s->f));
    if (st == DS4_OK) st = ds4_ckpt_shards_load_tables(r, s->m);
    ds4_ckpt_shards_close(r);
    return st;
}

/* ------------------------------------------------------------------ non-finite values */
/* Non-finite values of this rank's optimizer state, every array of every group, read in chunks when
 * swapped. */
static ds4_status state_nonfinite(const ds4_optim *o, int64_t *bad) {
    *bad = 0;
    const int64_t C = (int64_t)(DS4_ADAMW_SWAP_CHUNK / sizeof(float));
    float *buf = o->swapped ? ds4_alloc(DS4_MEM_OPTIM, (size_t)C * sizeof(float)) : NULL;
    if (o->swapped && !buf) return ds4_fail(DS4_ERR_OOM, "out of memory checking the optimizer state");
    ds4_status st = DS4_OK;
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < o->g[g].k && st == DS4_OK; a++) {
            const int64_t N = o->g[g].n;
            int64_t k = 0;
            if (!o->swapped) st = ds4_dev_count_nonfinite(&o->exec, o->g[g].mem[a], N, &k);
            *bad += k;
            for (int64_t i0 = 0; o->swapped && i0 < N && st == DS4_OK; i0 += C) {
                const int64_t n = N - i0 < C ? N - i0 : C;
                st = ds4_optim_read(o, g, a, i0, n, buf);
                if (st == DS4_OK) *bad += ds4_count_nonfinite(buf, n);
            }
        }
    ds4_free(buf);
    return st;
}

/* Non-finite values of the groups a pipeline stage trains. */
static ds4_status held_nonfinite(ds4_model *m, int64_t *bad) {
    *bad = 0;
    for (int64_t i = 0; i < ds4_model_nregions(m); i++) {
        const ds4_region *r = ds4_model_region(m, i);
        int64_t k = 0;
        if (!ds4_model_region_held(m, i, true)) continue;
        DS4_TRY(ds4_dev_count_nonfinite(ds4_model_exec(m), ds4_model_params_flat(m) + r->start, r->end - r->start, &k));
        *bad += k;
    }
    return DS4_OK;
}

/* The first float tensor of a whole model (or of the groups a stage trains) holding a non-finite value (for
 * the message), or NULL. */
static const char *first_nonfinite_param(ds4_model *m) {
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        int64_t bad = 0;
        if (ds4_param_in_flat(p) && ds4_model_param_held(m, p, true) &&
            ds4_dev_count_nonfinite(ds4_model_exec(m), p->data, p->numel, &bad) == DS4_OK && bad > 0)
            return p->name;
    }
    return NULL;
}

/* The functions that read or write values: a plan state has none. */
static ds4_status needs_values(const ds4_train_state *s, const char *what) {
    return s->exec.plan ? ds4_fail(DS4_ERR_ARG, "%s: a plan state has no values", what) : DS4_OK;
}

ds4_status ds4_train_state_check_finite(ds4_train_state *s, int64_t step) {
    DS4_TRY(needs_values(s, "finite check"));
    int64_t bad[2] = {0, 0}; /* weights, optimizer state */
    ds4_status st = s->f ? ds4_dev_count_nonfinite(&s->exec, ds4_fsdp_shard_params(s->f), ds4_fsdp_shard_numel(s->f), &bad[0])
                  : s->pp ? held_nonfinite(s->m, &bad[0])
                          : ds4_dev_count_nonfinite(&s->exec, ds4_model_params_flat(s->m), ds4_model_numel(s->m), &bad[0]);
    if (st == DS4_OK) st = state_nonfinite(&s->opt, &bad[1]);
    st = ds4_train_agree(s->world, st);
    if (st == DS4_OK && ds4_comm_size(s->world) > 1) st = ds4_comm_sum_i64(s->world, bad, 2);
    if (st != DS4_OK || bad[0] + bad[1] == 0) return st;
    const char *where = s->f ? NULL : first_nonfinite_param(s->m);
    char first[300] = "";
    if (where) snprintf(first, sizeof first, " (first in %s)", where);
    return ds4_fail(DS4_ERR_INTERNAL,
                    "step %lld: %lld non-finite weights%s and %lld non-finite %s optimizer state values: the run has "
                    "diverged; this step's checkpoint is not saved and the earlier ones are kept",
                    (long long)step, (long long)bad[0], first, (long long)bad[1], s->opt.opt->name);
}

ds4_status ds4_train_state_save(ds4_train_state *s, const char *root, int64_t keep_latest_k, const ds4_ckpt_meta *meta) {
    DS4_TRY(needs_values(s, "checkpoint save"));
    if (s->pp) return save_stage(s, root, keep_latest_k, meta); /* the one-process files, streamed to rank 0 */
    if (!s->f) return ds4_checkpoint_save(root, keep_latest_k, s->m, &s->opt, meta);
    return s->per_rank ? save_per_rank(s, root, keep_latest_k, meta) : save_sharded(s, root, keep_latest_k, meta);
}

static ds4_status load_sharded(ds4_train_state *s, const char *path, ds4_ckpt_meta *meta) {
    DS4_TRY(ds4_checkpoint_load_meta(path, meta));
    if (ds4_checkpoint_is_per_rank(path)) DS4_TRY(load_shard_per_rank(s, path));
    else {
        ds4_model_dir *d;
        DS4_TRY(ds4_model_dir_open(path, &d));
        ds4_status st = ds4_fsdp_load(s->f, d); /* one region resident at a time */
        if (st == DS4_OK && s->pp && embed_reader(s) == stage_of(s)) st = ds4_model_load(s->m, d); /* its held values */
        ds4_model_dir_close(d);
        if (st != DS4_OK) return ds4_fail_prefix(st, "checkpoint %s", path);
    }
    /* read in ranges from the mapped files (no whole copy), straight into the state's arrays or store */
    return ds4_checkpoint_load_optim(path, &s->opt, s->m, s->f, meta->optimizer, NULL);
}

/* Elements of this rank whose rule differs between the writer and this state, counted. */
typedef struct {
    const ds4_optimizer *writer, *reader;
    int64_t elements;
} switch_ctx;
static bool rule_differs(const switch_ctx *c, const ds4_param *p) {
    const bool w = ds4_optimizer_takes(c->writer, p), r = ds4_optimizer_takes(c->reader, p);
    return w != r || (w && c->writer != c->reader);
}
static void count_switched(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    (void)s0;
    switch_ctx *c = ctx;
    if (rule_differs(c, p)) c->elements += k1 - k0;
}

ds4_status ds4_train_state_switch_optimizer(ds4_train_state *s, const ds4_ckpt_meta *meta, int64_t *elements,
                                            int64_t *matrices) {
    *elements = *matrices = 0;
    switch_ctx c = {.writer = meta->optimizer ? meta->optimizer : &ds4_optimizer_adamw, .reader = s->opt.opt};
    if (c.writer == c.reader) return DS4_OK;
    for (int64_t i = 0; i < ds4_model_nparams(s->m); i++) {
        ds4_param *p = ds4_model_param(s->m, i);
        if (!ds4_param_in_flat(p) || !rule_differs(&c, p)) continue;
        (*matrices)++;
        if (!s->f) count_switched(&c, p, 0, p->numel, 0);
    }
    if (s->f) ds4_fsdp_for_each_piece(s->f, count_switched, &c);
    int64_t n[1] = {c.elements};
    ds4_status st = s->f ? ds4_comm_sum_i64(s->world, n, 1) : DS4_OK; /* elements over the shards */
    *elements = n[0];
    return st;
}

ds4_status ds4_train_state_load(ds4_train_state *s, const char *path, ds4_ckpt_meta *meta) {
    DS4_TRY(needs_values(s, "checkpoint load"));
    if (s->pp && ds4_checkpoint_is_per_rank(path)) /* a stage reads its groups' tensors by name */
        return ds4_fail(DS4_ERR_UNSUPPORTED, "checkpoint %s: a per-rank checkpoint (checkpoint.per_rank) does not resume "
                        "under a pipeline yet; resume it in one process or with FSDP and save it whole", path);
    /* a pipeline stage reads the tensors of its groups (and the embedding's values on the MTP block's rank) */
    DS4_TRY(s->f ? load_sharded(s, path, meta) : ds4_checkpoint_load(path, s->m, &s->opt, meta));
    ds4_train_state_refresh_bf16(s);
    return DS4_OK;
}
