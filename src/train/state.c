/* The state a training step updates, in one of two forms behind one interface (ds4/trainer.h):
 *  - whole: the model and its AdamW state in this process (one rank, ep = 1: the single-process path,
 *    the same calls in the same order as before there was a second form, so the same bits);
 *  - sharded: this rank's FSDP + EP shard (ds4/dist.h). The model is unmapped; the hooks gather a
 *    group's weights around its use and reduce-scatter its gradients into the shard, where they
 *    accumulate over micro-batches. AdamW, clipping and the router bias rule run on the shard.
 * Checkpoints: the one-writer format (rank 0 gathers the packed parameters and moments and writes them
 * as one process does), or with per_rank every rank writes its own shard file (ckpt_shards.c); on load
 * every rank reads its elements from either. So a run saved by N ranks resumes on any number of ranks.
 * Offload (--swap-optimizer, --swap-layer-input) puts the AdamW state and the layer input streams in one
 * offload store (ds4/offload.h) owned here; the moments come back to memory only around checkpoints.
 * A plan state (memplan) is the same state under a plan context (ds4_exec): opened, stepped and freed
 * with the allocator counting it, its AdamW state and FSDP (on a plan communicator) touching no values. */
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
    ds4_adamw opt;    /* [numel] whole, [shard_numel] sharded */
    ds4_offload *store;     /* NULL: no offload */
    ds4_act_swap *swap;     /* --swap-layer-input */
    ds4_act_swap *swap2;    /* ... of the second live pass under --moe-fb-overlap, made at its first step */
    ds4_fsdp_yielding yielding; /* --moe-fb-overlap: the EP ops that give way between start and wait */
    bool bf16;              /* mixed precision: bf16 GEMMs and activations, fp32 weights and optimizer state */
    bool per_rank;          /* sharded saves: every rank writes its own file */
};

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
/* The model first (the order memplan's numbers were first taken in): whole, or unmapped behind FSDP. */
static ds4_status open_model(ds4_train_state *s, const ds4_config *mc) {
    return s->bf16 ? ds4_model_create_bf16(&s->exec, mc, s->sharded, &s->m)
                   : ds4_model_create(&s->exec, mc, s->sharded, &s->m);
}

/* The offload store and the layer-input swap, when a swap policy asks for them. */
static ds4_status open_offload(ds4_train_state *s, const ds4_train_state_opts *o) {
    if (!o->swap_optimizer && !o->swap_layer_input) return DS4_OK;
    DS4_TRY(ds4_offload_open(&s->exec, o->offload_dir, &s->store));
    return o->swap_layer_input ? ds4_act_swap_new(s->store, &s->swap) : DS4_OK;
}

static ds4_status open_whole(ds4_train_state *s, const ds4_model_dir *d, uint64_t seed, const ds4_train_state_opts *o) {
    if (d) DS4_TRY(ds4_model_load(s->m, d));
    else ds4_model_init_random(s->m, seed);
    DS4_TRY(o->swap_optimizer ? ds4_adamw_init_swapped(&s->opt, s->m, s->store, o->swap_chunk_bytes)
                              : ds4_adamw_init(&s->opt, s->m));
    return o->muon ? ds4_adamw_group_muon(&s->opt, s->m) : DS4_OK;
}

static ds4_status open_sharded(ds4_train_state *s, const ds4_model_dir *d, uint64_t seed, int ep,
                               const ds4_train_state_opts *o) {
    DS4_TRY(ds4_fsdp_create(s->m, s->world, ep, &s->f));
    DS4_TRY(ds4_fsdp_set_prefetch(s->f, o->prefetch_depth));
    DS4_TRY(d ? ds4_fsdp_load(s->f, d) : ds4_fsdp_init_random(s->f, seed));
    int64_t n = ds4_fsdp_shard_numel(s->f);
    DS4_TRY(o->swap_optimizer ? ds4_adamw_init_n_swapped(&s->opt, n, s->store, o->swap_chunk_bytes)
                              : ds4_adamw_init_n(&s->opt, n));
    s->opt.muon = o->muon; /* after the init, which clears it */
    return ds4_fsdp_adamw_ranges(s->f, &s->opt);
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
    const ds4_exec prev = ds4_exec_enter(&s->exec);
    s->world = world;
    s->sharded = ds4_comm_size(world) > 1 || opts->ep > 1 || opts->shard;
    s->bf16 = opts->bf16;
    if (s->bf16) s->exec.matmul_precision = DS4_MATMUL_BF16; /* mixed precision runs its GEMMs on bf16 operands */
    s->per_rank = opts->per_rank_ckpt;
    ds4_status st = check_world(s, world);
    if (st == DS4_OK) st = open_model(s, mc);
    if (st == DS4_OK) st = open_offload(s, opts);
    if (st == DS4_OK) st = s->sharded ? open_sharded(s, d, seed, opts->ep, opts) : open_whole(s, d, seed, opts);
    if (st == DS4_OK) ds4_train_state_refresh_bf16(s);
    s->opt.plan = s->exec.plan; /* after the AdamW init, which clears it */
    ds4_exec_leave(prev);
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
    const ds4_exec prev = ds4_exec_enter(&s->exec);
    ds4_act_swap_free(s->swap);
    ds4_act_swap_free(s->swap2);
    ds4_adamw_free(&s->opt);
    ds4_offload_close(s->store); /* after everything it holds */
    ds4_fsdp_free(s->f);
    ds4_model_free(s->m);
    ds4_exec_leave(prev);
    ds4_free(s);
}

const ds4_exec *ds4_train_state_exec(const ds4_train_state *s) { return &s->exec; }
int ds4_train_state_ranks(const ds4_train_state *s) { return ds4_comm_size(s->world); }

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
int64_t ds4_train_state_numel(const ds4_train_state *s) {
    return s->f ? ds4_fsdp_packed_numel(s->f) : ds4_model_numel(s->m);
}

int64_t ds4_train_state_held_numel(const ds4_train_state *s) {
    return s->f ? ds4_fsdp_shard_numel(s->f) : ds4_model_numel(s->m);
}

/* ------------------------------------------------------------------ one step */
void ds4_train_state_zero_grads(ds4_train_state *s) {
    if (s->f) ds4_fsdp_zero_grads(s->f);
    else ds4_model_zero_grad(s->m);
}

void ds4_train_state_scale_grads(ds4_train_state *s, int64_t micro_batches) {
    if (micro_batches <= 1 || s->exec.plan) return;
    float *g = s->f ? ds4_fsdp_shard_grads(s->f) : ds4_model_grads_flat(s->m), k = 1.0f / (float)micro_batches;
    int64_t n = s->f ? ds4_fsdp_shard_numel(s->f) : ds4_model_numel(s->m);
    for (int64_t i = 0; i < n; i++) g[i] *= k;
}

ds4_status ds4_train_state_mean(ds4_train_state *s, double *x, int64_t n) {
    const int W = ds4_comm_size(s->world);
    if (!s->f || W == 1) return DS4_OK;
    DS4_TRY(ds4_comm_sum_f64(s->world, x, n));
    for (int64_t i = 0; i < n; i++) x[i] /= (double)W;
    return DS4_OK;
}

ds4_status ds4_train_state_clip(ds4_train_state *s, double max_norm, double *norm) {
    if (s->f) return ds4_fsdp_clip_grad_norm(s->f, max_norm, norm); /* FSDP plans by itself */
    *norm = s->exec.plan ? 0 : ds4_clip_grad_norm(s->m, max_norm);
    return DS4_OK;
}

ds4_status ds4_train_state_muon_step(ds4_train_state *s, const ds4_muon_cfg *c, double weight_decay, double lr) {
    if (s->f) return ds4_fsdp_muon_step(s->f, &s->opt, c, weight_decay, lr);
    return ds4_muon_step(&s->opt, s->m, c, weight_decay, lr);
}

bool ds4_train_state_muon(const ds4_train_state *s) { return s->opt.muon; }
bool ds4_train_state_bf16(const ds4_train_state *s) { return s->bf16; }

ds4_status ds4_train_state_adamw_step(ds4_train_state *s, const ds4_adamw_cfg *c, double lr) {
    if (s->f) return ds4_adamw_step_flat(&s->opt, ds4_fsdp_shard_params(s->f), ds4_fsdp_shard_grads(s->f), c, lr);
    return ds4_adamw_step(&s->opt, s->m, c, lr);
}

void ds4_train_state_refresh_bf16(ds4_train_state *s) {
    if (!s->bf16) return;
    if (s->f) ds4_fsdp_refresh_bf16(s->f);
    else ds4_model_refresh_bf16(s->m);
}

ds4_status ds4_train_state_router_bias(ds4_train_state *s, int64_t *loads, double gamma) {
    if (!s->f) {
        if (!s->exec.plan) ds4_router_bias_update(s->m, loads, gamma);
        return DS4_OK;
    }
    const ds4_config *c = ds4_model_config(s->m);
    DS4_TRY(ds4_comm_sum_i64(s->world, loads, (c->n_layers + c->n_mtp_layers) * c->n_routed_experts));
    ds4_fsdp_router_bias_update(s->f, loads, gamma);
    return DS4_OK;
}

/* ------------------------------------------------------------------ checkpoints */
/* --swap-optimizer: the moments come back to memory around a checkpoint (as MindSpeed does) and go back
 * to the store after it, also after a failure (a resident state steps the same, so nothing is lost). */
static ds4_status moments_in(ds4_train_state *s) { return s->opt.store ? ds4_adamw_swap_in(&s->opt) : DS4_OK; }
static ds4_status moments_out(ds4_train_state *s, ds4_status st) {
    ds4_status out = s->opt.store ? ds4_adamw_swap_out(&s->opt, NULL, 0) : DS4_OK;
    return st != DS4_OK ? st : out;
}

/* The sink of ds4_fsdp_stream_packed on rank 0: the values go straight into the file being written. */
static ds4_status put_values(void *w, int64_t param, const float *values, int64_t n) {
    (void)param;
    return ds4_st_writer_put(w, values, (size_t)n * sizeof(float));
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
        if (p->is_int) DS4_TRY(ds4_st_writer_put(w, p->idata, (size_t)p->numel * sizeof(int64_t)));
    }
    return DS4_OK;
}

/* dir/optim.state as the whole-model save lays it out (adamw.step, then m and v), the step put. */
static ds4_status begin_optim_file(const ds4_train_state *s, const char *dir, ds4_st_writer *w) {
    int64_t shape[1] = {ds4_fsdp_packed_numel(s->f)}, one = 1;
    DS4_TRY(ds4_st_writer_declare(w, "adamw.step", DS4_I64, 1, &one));
    if (s->opt.muon) DS4_TRY(ds4_st_writer_declare(w, DS4_CKPT_MUON_MARK, DS4_I64, 1, &one));
    DS4_TRY(ds4_st_writer_declare(w, "adamw.m", DS4_F32, 1, shape));
    DS4_TRY(ds4_st_writer_declare(w, "adamw.v", DS4_F32, 1, shape));
    char path[4200];
    snprintf(path, sizeof path, "%s/optim.state", dir);
    DS4_TRY(ds4_st_writer_begin(w, path));
    DS4_TRY(ds4_st_writer_put(w, &s->opt.step, sizeof s->opt.step));
    return s->opt.muon ? ds4_st_writer_put(w, &s->opt.step, sizeof s->opt.step) : DS4_OK;
}

/* The carried tensors (the DSpark drafter's, whole on every rank), after the streamed floats: they end
 * the parameter table, so the file has the layout ds4_model_save gives it. */
static ds4_status put_carried(ds4_model *m, ds4_st_writer *w) {
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (p->carried) DS4_TRY(ds4_st_writer_put(w, p->data, (size_t)p->numel * sizeof(float)));
    }
    return DS4_OK;
}

/* One file streamed from the shards: rank 0 (dir != NULL) writes it, every rank gathers the shard
 * buffers in[nin] in order. After a failure on rank 0 the gathers still run, so no rank waits forever. */
static ds4_status stream_file(ds4_train_state *s, const char *dir, bool optim, float *const *in, int nin) {
    ds4_st_writer *w = NULL;
    ds4_status st = dir ? ds4_st_writer_new(&w) : DS4_OK;
    if (st == DS4_OK && dir) st = optim ? begin_optim_file(s, dir, w) : begin_model_file(s->m, dir, w);
    for (int k = 0; k < nin; k++) {
        ds4_status gs = ds4_fsdp_stream_packed(s->f, in[k], 0, put_values, w);
        if (st == DS4_OK) st = gs;
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
    float *params = ds4_fsdp_shard_params(s->f);
    st = stream_file(s, writer ? tmp : NULL, false, &params, 1);
    ds4_status mo = ds4_train_agree(s->world, moments_in(s)); /* the same on every rank: all stream or none */
    if (mo == DS4_OK) {
        float *moments[2] = {s->opt.m, s->opt.v};
        mo = stream_file(s, writer && st == DS4_OK ? tmp : NULL, true, moments, 2);
        mo = moments_out(s, mo);
    }
    if (st == DS4_OK) st = mo;
    if (st == DS4_OK && writer) st = ds4_checkpoint_commit(root, keep, tmp, meta); /* removes tmp on failure */
    else if (writer) ds4_checkpoint_abort(tmp); /* a failed stream leaves no .tmp-step-N behind */
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

/* This rank's file: its shard of the weights and moments (brought back to memory when swapped); rank 0's
 * also the integer tables and carried tensors. */
static ds4_status write_rank_file(ds4_train_state *s, const char *tmp) {
    const int rank = ds4_comm_rank(s->world);
    DS4_TRY(moments_in(s));
    ds4_ckpt_shard_data d = {.params = ds4_fsdp_shard_params(s->f), .m = s->opt.m, .v = s->opt.v,
                             .n = ds4_fsdp_shard_numel(s->f), .step = s->opt.step, .muon = s->opt.muon,
                             .tables = rank == 0 ? s->m : NULL};
    ds4_status st = ds4_checkpoint_write_shard(tmp, rank, ds4_comm_size(s->world), &d);
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
    if (st == DS4_OK) st = moments_in(s);
    if (st == DS4_OK) {
        ds4_ckpt_shards_select(r, DS4_CKPT_ADAMW_M);
        st = ds4_fsdp_scatter_packed(s->f, ds4_ckpt_shards_read, r, s->opt.m);
        ds4_ckpt_shards_select(r, DS4_CKPT_ADAMW_V);
        if (st == DS4_OK) st = ds4_fsdp_scatter_packed(s->f, ds4_ckpt_shards_read, r, s->opt.v);
        st = moments_out(s, st);
    }
    if (st == DS4_OK) s->opt.step = ds4_ckpt_shards_step(r);
    ds4_ckpt_shards_close(r);
    return st;
}

/* ------------------------------------------------------------------ non-finite values */
static int64_t count_nonfinite(const float *x, int64_t n) {
    int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
    for (int64_t i = 0; i < n; i++) bad += !isfinite(x[i]);
    return bad;
}

/* Non-finite elements of this rank's AdamW moment `which`, read in chunks when swapped. */
static ds4_status moment_nonfinite(const ds4_adamw *o, int which, int64_t *bad) {
    const float *mem = which == 0 ? o->m : o->v;
    *bad = 0;
    if (mem) {
        *bad = count_nonfinite(mem, o->n);
        return DS4_OK;
    }
    const int64_t C = (int64_t)(DS4_ADAMW_SWAP_CHUNK / sizeof(float));
    float *buf = ds4_alloc(DS4_MEM_OPTIM, (size_t)C * sizeof(float));
    if (!buf) return ds4_fail(DS4_ERR_OOM, "out of memory checking the optimizer state");
    ds4_status st = DS4_OK;
    for (int64_t i0 = 0; i0 < o->n && st == DS4_OK; i0 += C) {
        const int64_t n = o->n - i0 < C ? o->n - i0 : C;
        st = ds4_adamw_moment_read(o, which, i0, n, buf);
        if (st == DS4_OK) *bad += count_nonfinite(buf, n);
    }
    ds4_free(buf);
    return st;
}

/* The first float tensor of a whole model holding a non-finite value (for the message), or NULL. */
static const char *first_nonfinite_param(ds4_model *m) {
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (ds4_param_in_flat(p) && count_nonfinite(p->data, p->numel) > 0) return p->name;
    }
    return NULL;
}

/* The functions that read or write values: a plan state has none. */
static ds4_status needs_values(const ds4_train_state *s, const char *what) {
    return s->exec.plan ? ds4_fail(DS4_ERR_ARG, "%s: a plan state has no values", what) : DS4_OK;
}

ds4_status ds4_train_state_check_finite(ds4_train_state *s, int64_t step) {
    DS4_TRY(needs_values(s, "finite check"));
    int64_t bad[3] = {0, 0, 0}; /* weights, first moments, second moments */
    bad[0] = s->f ? count_nonfinite(ds4_fsdp_shard_params(s->f), ds4_fsdp_shard_numel(s->f))
                  : count_nonfinite(ds4_model_params_flat(s->m), ds4_model_numel(s->m));
    ds4_status st = moment_nonfinite(&s->opt, 0, &bad[1]);
    if (st == DS4_OK) st = moment_nonfinite(&s->opt, 1, &bad[2]);
    st = ds4_train_agree(s->world, st);
    if (st == DS4_OK && ds4_comm_size(s->world) > 1) st = ds4_comm_sum_i64(s->world, bad, 3);
    if (st != DS4_OK || bad[0] + bad[1] + bad[2] == 0) return st;
    const char *where = s->f ? NULL : first_nonfinite_param(s->m);
    char first[300] = "";
    if (where) snprintf(first, sizeof first, " (first in %s)", where);
    return ds4_fail(DS4_ERR_INTERNAL,
                    "step %lld: %lld non-finite weights%s and %lld + %lld non-finite AdamW moments: the run has diverged; "
                    "this step's checkpoint is not saved and the earlier ones are kept",
                    (long long)step, (long long)bad[0], first, (long long)bad[1], (long long)bad[2]);
}

ds4_status ds4_train_state_save(ds4_train_state *s, const char *root, int64_t keep_latest_k, const ds4_ckpt_meta *meta) {
    DS4_TRY(needs_values(s, "checkpoint save"));
    if (!s->f) return ds4_checkpoint_save(root, keep_latest_k, s->m, &s->opt, meta);
    return s->per_rank ? save_per_rank(s, root, keep_latest_k, meta) : save_sharded(s, root, keep_latest_k, meta);
}

/* This rank's elements of one moment, read in ranges from the mapped checkpoint file (no whole copy). */
static ds4_status load_moment(ds4_train_state *s, const char *path, const char *name, float *shard, int64_t *step) {
    ds4_ckpt_moment *mo;
    DS4_TRY(ds4_checkpoint_moment_open(path, name, ds4_fsdp_packed_numel(s->f), &mo, step));
    ds4_status st = ds4_fsdp_scatter_packed(s->f, ds4_ckpt_moment_read, mo, shard);
    ds4_ckpt_moment_close(mo);
    return st;
}

static ds4_status load_sharded(ds4_train_state *s, const char *path, ds4_ckpt_meta *meta) {
    DS4_TRY(ds4_checkpoint_load_meta(path, meta));
    if (ds4_checkpoint_is_per_rank(path)) return load_shard_per_rank(s, path);
    ds4_model_dir *d;
    DS4_TRY(ds4_model_dir_open(path, &d));
    ds4_status st = ds4_fsdp_load(s->f, d); /* one region resident at a time */
    ds4_model_dir_close(d);
    if (st != DS4_OK) return ds4_fail_prefix(st, "checkpoint %s", path);
    int64_t step = 0;
    st = moments_in(s);
    if (st == DS4_OK) st = load_moment(s, path, "adamw.m", s->opt.m, &step);
    if (st == DS4_OK) st = load_moment(s, path, "adamw.v", s->opt.v, &step);
    DS4_TRY(moments_out(s, st));
    s->opt.step = step;
    return DS4_OK;
}

ds4_status ds4_train_state_switch_optimizer(ds4_train_state *s, const ds4_ckpt_meta *meta, int64_t *elements,
                                            int64_t *matrices) {
    *elements = *matrices = 0;
    if (meta->muon == s->opt.muon) return DS4_OK;
    int64_t n[2] = {0, 0};
    ds4_status st = ds4_muon_reset_group(&s->opt, s->m, s->f, &n[0], &n[1]);
    st = ds4_train_agree(s->world, st);
    if (st == DS4_OK && s->f) {
        st = ds4_comm_sum_i64(s->world, n, 1); /* elements over the shards; matrices are the table's */
    }
    *elements = n[0];
    *matrices = n[1];
    return st;
}

ds4_status ds4_train_state_load(ds4_train_state *s, const char *path, ds4_ckpt_meta *meta) {
    DS4_TRY(needs_values(s, "checkpoint load"));
    DS4_TRY(s->f ? load_sharded(s, path, meta) : ds4_checkpoint_load(path, s->m, &s->opt, meta));
    ds4_train_state_refresh_bf16(s);
    return DS4_OK;
}
