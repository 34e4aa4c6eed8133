/* The model's side of the activation store: every rule about a block's saved unit outputs, derived
 * from the unit declarations (model/block.h) and nothing else:
 *   - a unit's outputs are allocated from its declared slots (shape expression, dtype) just before its
 *     forward, in slot order;
 *   - a unit the store recomputes (ds4_act_store's policy, gathered by the pass into the block's mask)
 *     is released once its last forward reader (the last unit whose declared inputs name it) has run;
 *   - before a backward reads a unit, the unit is made present again by replaying its forward, its
 *     released inputs first (in forward order);
 *   - after the last backward that reads a unit, its outputs are freed;
 *   - per unit: the bytes of one copy, the releases, the replays and their time (--memory-report).
 * What the store decides (keep, recompute, swap a layer input to the offload tier) is the memory
 * layer's (src/memory/actstore.c, behind ds4_act_store in ds4/model.h); the shapes, readers and replay
 * order are the model's, since only the model knows its units. */
#include "model/block.h"

#include <string.h>

const char *unit_name(unit_id u) { return (unsigned)u < U_COUNT ? k_block_units[u]->name : "?"; }

bool unit_runs_here(unit_id u, const block_acts *a) {
    switch (k_block_units[u]->on) {
    case ON_COMPRESSED: return a->ratio > 0;
    case ON_CSA: return a->ratio == 4;
    default: return true;
    }
}

/* ================================================================== derived from the declarations */
/* The last unit whose forward reads u: u may be released once that unit has run. */
static unit_id last_forward_reader(unit_id u) {
    unit_id last = u;
    for (int v = (int)u + 1; v < U_COUNT; v++)
        if (k_block_units[v]->inputs & UNIT_BIT(u)) last = (unit_id)v;
    return last;
}

/* The last step of k_block_bwd_order whose backward reads u (-1: none). */
static int last_backward_reader(unit_id u) {
    int last = -1;
    for (int s = 0; s < k_block_bwd_steps; s++)
        if (k_block_units[k_block_bwd_order[s]]->bwd_reads & UNIT_BIT(u)) last = s;
    return last;
}

/* What the symbolic dimensions are worth in one block of one pass; rows: the routed rows under expert
 * parallelism (NULL: N·K, every expert local). */
typedef struct {
    const ds4_config *c;
    int64_t B, T, ratio, Nc;
    const int64_t *rows;
} dim_env;

static int64_t act_dim_value(const dim_env *e, act_dim d) {
    const ds4_config *c = e->c;
    const int64_t N = e->B * e->T, K = c->n_activated_experts;
    switch (d) {
    case X_1: return 1;
    case X_N: return N;
    case X_B: return e->B;
    case X_D: return c->dim;
    case X_HC: return c->hc_mult;
    case X_MIX: return mix_hc(c);
    case X_QR: return c->q_lora_rank;
    case X_H: return c->n_heads;
    case X_HD: return c->head_dim;
    case X_NC: return e->Nc;
    case X_CMP_C: return (e->ratio == 4 ? 2 : 1) * c->head_dim;
    case X_HI: return c->index_n_heads;
    case X_DI: return c->index_head_dim;
    case X_IDX_C: return 2 * c->index_head_dim;
    case X_TOPK: return c->index_topk;
    case X_GR: return c->o_groups * c->o_lora_rank;
    case X_E: return c->n_routed_experts;
    case X_E1: return c->n_routed_experts + 1;
    case X_K: return K;
    case X_ROWS: return e->rows ? *e->rows : N * K;
    case X_I: return c->moe_inter_dim;
    case X_IS: return c->moe_inter_dim * c->n_shared_experts;
    }
    return 0;
}

static int64_t slot_numel(const dim_env *e, const act_slot *sl) {
    int64_t numel = 1;
    for (int k = 0; k < 3; k++) numel *= act_dim_value(e, sl->dim[k]);
    return numel;
}

static size_t act_dtype_size(act_dtype t) { return t == ACT_I64 ? sizeof(int64_t) : t == ACT_I32 ? 4 : sizeof(float); }

static bool slot_bf16(const block_acts *a, unit_id u, int s) {
    return a->bf16 && s < k_block_units[u]->nouts && k_block_units[u]->outs[s].dtype == ACT_F32_BF16 && a->out[u][s];
}

/* ================================================================== mixed precision
 * A bf16 slot's values are rounded when its unit has run; from its last forward reader on it is held
 * as bf16 (half the bytes) and widened again, exactly, when backward needs it. An ACT_BF16 slot is
 * packed when its unit has run (the same rounding) and never widened: its readers take bf16. */
/* Slot s of unit u [n] converted to or from bf16, its byte count kept. */
static ds4_status convert_slot(const block_ctx *bc, block_acts *a, unit_id u, int s, int64_t n, bool to_bf16) {
    DS4_TRY(act_convert_bf16(&bc->m->exec, &a->out[u][s], n, to_bf16));
    a->bytes[u][s] = (size_t)n * (to_bf16 ? sizeof(uint16_t) : sizeof(float));
    return DS4_OK;
}

static ds4_status round_outputs(const block_ctx *bc, block_acts *a, unit_id u) {
    const unit_decl *ud = k_block_units[u];
    for (int s = 0; s < ud->nouts; s++) {
        if (!a->bf16 || !a->out[u][s]) continue;
        const int64_t n = (int64_t)(a->bytes[u][s] / sizeof(float));
        if (slot_bf16(a, u, s)) tensor_round_bf16(&bc->m->exec, F32(u, s), n);
        if (act_held_bf16(a, u, s) && convert_slot(bc, a, u, s, n, true) != DS4_OK)
            return ds4_fail(DS4_ERR_OOM, "out of memory holding block %lld's %s in bf16", (long long)bc->layer,
                            unit_name(u));
    }
    return DS4_OK;
}

ds4_status act_convert_bf16(const ds4_exec *ex, void **buf, int64_t n, bool to_bf16) {
    void *to = buf_alloc(ex, DS4_MEM_ACT, (size_t)n * (to_bf16 ? sizeof(uint16_t) : sizeof(float)));
    if (!to) return DS4_ERR_OOM;
    if (to_bf16) tensor_pack_bf16(ex, to, *buf, n);
    else tensor_unpack_bf16(ex, to, *buf, n);
    buf_free(ex, *buf);
    *buf = to;
    return DS4_OK;
}

static ds4_status pack_outputs(const block_ctx *bc, block_acts *a, unit_id u) {
    for (int s = 0; s < UNIT_MAX_OUTS; s++) {
        if (!slot_bf16(a, u, s) || (a->packed[u] >> s & 1u)) continue;
        const int64_t n = (int64_t)(a->bytes[u][s] / sizeof(float));
        if (convert_slot(bc, a, u, s, n, true) != DS4_OK)
            return ds4_fail(DS4_ERR_OOM, "out of memory holding block %lld's %s in bf16", (long long)bc->layer,
                            unit_name(u));
        a->packed[u] |= (uint8_t)(1u << s);
    }
    return DS4_OK;
}

static ds4_status unpack_outputs(const block_ctx *bc, block_acts *a, unit_id u) {
    for (int s = 0; s < UNIT_MAX_OUTS; s++) {
        if (!(a->packed[u] >> s & 1u)) continue;
        const int64_t n = (int64_t)(a->bytes[u][s] / sizeof(uint16_t));
        if (convert_slot(bc, a, u, s, n, false) != DS4_OK)
            return ds4_fail(DS4_ERR_OOM, "out of memory widening block %lld's %s from bf16", (long long)bc->layer,
                            unit_name(u));
        a->packed[u] &= (uint8_t)~(1u << s);
    }
    return DS4_OK;
}

/* ================================================================== allocation and release */
static ds4_status alloc_outputs(const block_ctx *bc, block_acts *a, unit_id u) {
    const unit_decl *ud = k_block_units[u];
    for (int s = 0; s < ud->nouts; s++) {
        const act_slot *sl = &ud->outs[s];
        if (sl->ep_only && !bc->ep) continue;
        const dim_env e = {&bc->m->cfg, bc->B, bc->T, a->ratio, a->Nc, bc->ep && a->route ? &a->route->rows : NULL};
        a->m = bc->m;
        a->bytes[u][s] = (size_t)slot_numel(&e, sl) * act_dtype_size(sl->dtype);
        a->out[u][s] = dev_alloc(bc->m, DS4_MEM_ACT, a->bytes[u][s]);
        if (!a->out[u][s]) return ds4_fail(DS4_ERR_OOM, "out of memory in block %lld", (long long)bc->layer);
    }
    return DS4_OK;
}

static ds4_status run_unit(const block_ctx *bc, block_acts *a, unit_id u, unit_cache *kc) {
    const unit_decl *ud = k_block_units[u];
    if (ud->prepare) DS4_TRY(ud->prepare(bc, a));
    DS4_TRY(alloc_outputs(bc, a, u));
    DS4_TRY(kc && ud->decode ? ud->decode(bc, a, kc) : ud->fwd(bc, a));
    return round_outputs(bc, a, u);
}

ds4_status act_run_cached(const block_ctx *bc, block_acts *a, unit_id u, unit_cache *kc) {
    if (!unit_runs_here(u, a)) return DS4_OK;
    const char *prev = ds4_mem_owner_enter(unit_owner(u));
    const ds4_status st = run_unit(bc, a, u, kc);
    ds4_mem_owner_leave(prev);
    return st;
}

ds4_status act_run(const block_ctx *bc, block_acts *a, unit_id u) { return act_run_cached(bc, a, u, NULL); }

/* Frees a unit's outputs (their bytes go back to the allocator at once) and what its prepare made.
 * Reads of a released output then find NULL and crash loudly instead of reading stale memory. */
static void unit_release(block_acts *a, unit_id u) {
    for (int s = 0; s < UNIT_MAX_OUTS; s++) {
        if (a->out[u][s]) dev_free(a->m, a->out[u][s]);
        a->out[u][s] = NULL;
        a->bytes[u][s] = 0;
    }
    a->present[u] = false;
    a->packed[u] = 0;
    if (k_block_units[u]->discard) k_block_units[u]->discard(a);
}

ds4_status act_release_after_fwd(const block_ctx *bc, block_acts *a, unit_id u) {
    for (int v = 0; v <= (int)u; v++) {
        if (!a->present[v] || last_forward_reader((unit_id)v) != u) continue;
        if (a->release_mask & UNIT_BIT(v)) {
            if (v == U_INDEXER_TOPK && bc->topk_copy && a->out[v][TOPK_SEL])
                tensor_copy(&bc->m->exec, bc->topk_copy, a->out[v][TOPK_SEL],
                       (size_t)(bc->B * bc->T * bc->m->cfg.index_topk) * sizeof(int32_t));
            unit_release(a, (unit_id)v);
            if (a->stats) a->stats[v].released++;
        } else if (bc->keep && a->bf16) {
            DS4_TRY(pack_outputs(bc, a, (unit_id)v));
            if (a->stats) a->stats[v].bytes = act_unit_bytes(a, (unit_id)v);
        }
    }
    return DS4_OK;
}

void act_free_after_bwd(block_acts *a, int step) {
    for (int u = 0; u < U_COUNT; u++)
        if (last_backward_reader((unit_id)u) == step && a->present[u]) unit_release(a, (unit_id)u);
}

void block_acts_free(block_acts *a) {
    for (int u = 0; u < U_COUNT; u++) unit_release(a, (unit_id)u);
    memset(a, 0, sizeof *a);
}

/* ================================================================== replay */
/* Makes unit u's outputs present, replaying it (and its released inputs, in forward order) if needed. */
static ds4_status act_need_one(const block_ctx *bc, block_acts *a, unit_id u) {
    if (a->present[u]) return unpack_outputs(bc, a, u);
    if (u == U_HC_POST_FFN) return ds4_fail(DS4_ERR_INTERNAL, "hc_post_ffn is never replayed");
    for (int d = 0; d < (int)u; d++)
        if (k_block_units[u]->inputs & UNIT_BIT(d)) DS4_TRY(act_need_one(bc, a, (unit_id)d));
    double t0 = ds4_now();
    DS4_TRY(act_run(bc, a, u));
    a->present[u] = true;
    if (a->stats) {
        a->stats[u].replays++;
        a->stats[u].replay_seconds += ds4_now() - t0;
    }
    return DS4_OK;
}

ds4_status act_need(const block_ctx *bc, block_acts *a, uint32_t units) {
    for (int u = 0; u < U_COUNT; u++)
        if (units & UNIT_BIT(u)) DS4_TRY(act_need_one(bc, a, (unit_id)u));
    return DS4_OK;
}

/* ================================================================== accounting */
int64_t act_unit_bytes(const block_acts *a, unit_id u) {
    int64_t b = 0;
    for (int s = 0; s < UNIT_MAX_OUTS; s++)
        if (a->out[u][s]) b += (int64_t)a->bytes[u][s];
    return b;
}

/* ================================================================== the saved tensors, as a table */
_Static_assert(DS4_SAVED_MAX >= U_COUNT * UNIT_MAX_OUTS + 1, "DS4_SAVED_MAX holds every slot and the input");
_Static_assert(DS4_NUM_UNITS == U_COUNT, "ds4/model.h's unit count is the block's");

/* A slot's dtype between its last forward reader and its backward: what round_outputs and pack_outputs
 * leave it as when its unit is kept. */
static ds4_saved_dtype held_dtype(act_dtype t, bool bf16) {
    switch (t) {
    case ACT_I32: return DS4_SAVED_I32;
    case ACT_I64: return DS4_SAVED_I64;
    case ACT_F32: return DS4_SAVED_F32;
    default: return bf16 ? DS4_SAVED_BF16 : DS4_SAVED_F32;
    }
}

static int64_t saved_dtype_size(ds4_saved_dtype t) {
    return t == DS4_SAVED_I64 ? 8 : t == DS4_SAVED_BF16 ? 2 : 4;
}

/* The row of slot sl of unit u, its shape the declared dimensions (trailing X_1 dropped). */
static ds4_saved_tensor slot_row(const dim_env *e, unit_id u, const act_slot *sl, const ds4_saved_opts *o,
                                 uint32_t mask) {
    ds4_saved_tensor r = {.unit = (int)u, .name = sl->name, .dtype = held_dtype(sl->dtype, o->bf16)};
    for (int k = 0; k < 3 && sl->dim[k] != X_1; k++) r.shape[r.ndim++] = act_dim_value(e, sl->dim[k]);
    r.bytes = slot_numel(e, sl) * saved_dtype_size(r.dtype);
    r.policy = mask & UNIT_BIT(u) ? DS4_ACT_RECOMPUTE : DS4_ACT_KEEP;
    return r;
}

/* The block's input stream [N, n, D]: a main layer's X[l] is held bf16 under mixed precision and may go
 * to the offload tier (model.c: act_offload); the MTP block's input stays fp32 in memory. */
static ds4_saved_tensor input_row(const ds4_config *c, bool mtp, const ds4_saved_opts *o) {
    ds4_saved_tensor r = {.unit = DS4_UNIT_INPUT, .name = "X_in", .ndim = 3,
                          .shape = {o->B * o->T, c->hc_mult, c->dim},
                          .dtype = o->bf16 && !mtp ? DS4_SAVED_BF16 : DS4_SAVED_F32,
                          .policy = o->swap_input && !mtp ? DS4_ACT_SWAP : DS4_ACT_KEEP};
    r.bytes = r.shape[0] * r.shape[1] * r.shape[2] * saved_dtype_size(r.dtype);
    return r;
}

int ds4_block_saved(const ds4_config *c, int64_t layer, const ds4_saved_opts *o, ds4_saved_tensor *out) {
    const bool mtp = layer >= c->n_layers;
    const block_acts a = {.ratio = ds4_layer_ratio(c, layer)};
    const dim_env e = {c, o->B, o->T, a.ratio, block_nc(o->T, a.ratio), o->ep ? &o->routed_rows : NULL};
    const uint32_t mask = mtp ? 0 : block_release_mask(o->release_mask);
    int n = 0;
    for (int u = 0; u < U_COUNT; u++) {
        if (!unit_runs_here((unit_id)u, &a)) continue;
        const unit_decl *ud = k_block_units[u];
        for (int s = 0; s < ud->nouts; s++)
            if (!ud->outs[s].ep_only || o->ep) out[n++] = slot_row(&e, (unit_id)u, &ud->outs[s], o, mask);
    }
    out[n++] = input_row(c, mtp, o);
    return n;
}
