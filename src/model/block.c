/* A DeepSeek-V4 block, forward and backward, as a list of units (docs/dsv4-architecture.md §2–§5):
 *   hc_pre_attn → attn_norm → q_down → q_up → kv → compressor → indexer → indexer_topk → sparse_attn →
 *   o_proj → hc_post_attn → hc_pre_ffn → ffn_norm → router → moe → hc_post_ffn
 * The units (units_hc.c, units_attn.c, units_ffn.c) declare what they read and save; the activation
 * store's model side (unit_acts.c) does the saving, releasing and replaying. */
#include "model/block.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

/* ================================================================== the block */
const unit_decl *const k_block_units[U_COUNT] = {
    [U_HC_PRE_ATTN] = &unit_hc_pre_attn,   [U_ATTN_NORM] = &unit_attn_norm,
    [U_Q_DOWN] = &unit_q_down,             [U_Q_UP] = &unit_q_up,
    [U_KV] = &unit_kv,                     [U_COMPRESSOR] = &unit_compressor,
    [U_INDEXER] = &unit_indexer,           [U_INDEXER_TOPK] = &unit_indexer_topk,
    [U_SPARSE_ATTN] = &unit_sparse_attn,   [U_O_PROJ] = &unit_o_proj,
    [U_HC_POST_ATTN] = &unit_hc_post_attn, [U_HC_PRE_FFN] = &unit_hc_pre_ffn,
    [U_FFN_NORM] = &unit_ffn_norm,         [U_ROUTER] = &unit_router,
    [U_MOE] = &unit_moe,                   [U_HC_POST_FFN] = &unit_hc_post_ffn,
};

/* Who holds a unit's own buffers (its work() and outputs; memplan --memory-report): the unit, by its
 * declaration's name (memplan tells units from the other owners with ds4_unit_find). */
const char *unit_owner(unit_id u) { return (unsigned)u < U_COUNT ? k_block_units[u]->name : NULL; }

/* Backward: the forward order reversed, except that the indexer's KL (it reads the attention's
 * log-sum-exp and inputs) runs before sparse attention's backward; the router (inside moe's) and the
 * top-k selection have no backward of their own. */
const unit_id k_block_bwd_order[] = {
    U_HC_POST_FFN, U_MOE,     U_FFN_NORM, U_HC_PRE_FFN, U_HC_POST_ATTN, U_O_PROJ,    U_INDEXER,
    U_SPARSE_ATTN, U_COMPRESSOR, U_KV,    U_Q_UP,       U_Q_DOWN,       U_ATTN_NORM, U_HC_PRE_ATTN,
};
const int k_block_bwd_steps = (int)(sizeof k_block_bwd_order / sizeof k_block_bwd_order[0]);

/* ================================================================== shared by the units */
float *work_zeros(const block_ctx *bc, int64_t n) { return dev_zalloc(bc->m, DS4_MEM_WORK, (size_t)n * sizeof(float)); }
float *work(const block_ctx *bc, int64_t n) { return dev_alloc(bc->m, DS4_MEM_WORK, (size_t)n * sizeof(float)); }
void work_free(const block_ctx *bc, void *p) { dev_free(bc->m, p); }

const ds4_rope *block_rope(const block_ctx *bc, int64_t ratio) { return ratio > 0 ? bc->rope_cmp : bc->rope_main; }

ds4_rope rope_view(const ds4_rope *r, int64_t pos) {
    ds4_rope at = *r;
    at.cos += pos * (r->rd / 2);
    at.sin += pos * (r->rd / 2);
    at.max_pos = 1;
    return at;
}

float attn_scale(const ds4_config *c) { return (float)(1.0 / sqrt((double)c->head_dim)); }
float indexer_wscale(const ds4_config *c) {
    return (float)(1.0 / sqrt((double)c->index_head_dim) / sqrt((double)c->index_n_heads));
}

ds4_status kernel_status(int64_t before, const char *what) {
    return ds4_alloc_failures() == before ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in %s", what);
}

const int32_t *attn_selection(const block_ctx *bc, const block_acts *a) {
    return (a->ratio == 4 && !bc->dense_csa) ? I32(U_INDEXER_TOPK, TOPK_SEL) : NULL;
}

/* ================================================================== forward */
/* Forward-only pass: the indexer KL cannot wait for backward. The kernel writes the layer's KL and rows into
 * kl_sum / kl_rows, the layer's slots of the pass's scalars on the backend. */
static ds4_status indexer_kl_forward_only(const block_ctx *bc, block_acts *a, double *kl_sum, int64_t *kl_rows) {
    const ds4_config *c = &bc->m->cfg;
    const int32_t *sel = attn_selection(bc, a);
    const int64_t oom = ds4_alloc_failures();
    indexer_kl_fwd_bwd(&bc->m->exec, &(indexer_kl_args){.dims = {.B = bc->B, .T = bc->T, .HI = c->index_n_heads,
        .dI = c->index_head_dim, .Nc = a->Nc, .ratio = 4, .K = sel ? c->index_topk : 0}, .H = c->n_heads,
        .c = c->head_dim, .scale = attn_scale(c), .wscale = indexer_wscale(c), .grad_scale = 0.0f,
        .qi = F32(U_INDEXER, IDX_QI), .ki = KEYS_F32(U_INDEXER, IDX_CMP + CMP_OUT),
        .ki16 = KEYS_BF16(U_INDEXER, IDX_CMP + CMP_OUT), .w = F32(U_INDEXER, IDX_WI), .q = F32(U_Q_UP, QU_Q),
        .kvc = KEYS_F32(U_COMPRESSOR, CMP_OUT), .kvc16 = KEYS_BF16(U_COMPRESSOR, CMP_OUT), .lse = F32(U_SPARSE_ATTN, SA_LSE), .topk = sel,
        .dqi = NULL, .dki = NULL, .dw = NULL, .kl_sum = kl_sum, .n_rows = kl_rows});
    return kernel_status(oom, "the indexer loss");
}

/* What the pass learns from a unit as soon as it has run: the expert load of the routing, and (forward
 * only) the indexer KL. */
static ds4_status after_unit(const block_ctx *bc, block_acts *a, unit_id u, int64_t *expert_load, double *kl_sum,
                             int64_t *kl_rows) {
    if (u == U_SPARSE_ATTN && a->ratio == 4 && !bc->keep) return indexer_kl_forward_only(bc, a, kl_sum, kl_rows);
    if (u == U_ROUTER && expert_load) moe_expert_load(&bc->m->exec, expert_load, I64(U_ROUTER, RT_EOFF), bc->m->cfg.n_routed_experts);
    return DS4_OK;
}

ds4_status block_fwd(const block_ctx *bc, block_acts *a, const float *X_in, float *X_out, uint32_t release_mask,
                     unit_stats *stats, int64_t *expert_load, double *kl_sum, int64_t *kl_rows) {
    memset(a, 0, sizeof *a);
    a->X_in = X_in;
    a->X_out = X_out;
    a->ratio = ds4_layer_ratio(&bc->m->cfg, bc->layer);
    a->Nc = block_nc(bc->T, a->ratio);
    a->release_mask = bc->keep ? block_release_mask(release_mask) : 0;
    a->stats = stats;
    a->ep = bc->ep;
    a->bf16 = bc->bf16_acts;
    ds4_status st = DS4_OK;
    for (int u = 0; u < U_COUNT && st == DS4_OK; u++) {
        st = act_run(bc, a, (unit_id)u);
        a->present[u] = true;
        if (st != DS4_OK) break;
        if (stats) stats[u].bytes = act_unit_bytes(a, (unit_id)u);
        st = after_unit(bc, a, (unit_id)u, expert_load, kl_sum, kl_rows);
        if (st == DS4_OK) st = act_release_after_fwd(bc, a, (unit_id)u);
    }
    if (st != DS4_OK || !bc->keep) block_acts_free(a);
    return st;
}

/* ================================================================== backward */
#define NGRAD_BUFS ((int)(offsetof(block_grads, dX_out) / sizeof(float *)))

static void grads_free(const block_ctx *bc, block_grads *g) {
    float **f = (float **)g;
    for (int i = 0; i < NGRAD_BUFS; i++) work_free(bc, f[i]);
    memset(g, 0, sizeof *g);
}

/* Each gradient buffer lives from the step of its first writer to the step of its last reader (the units'
 * backwards in units_hc.c, units_ffn.c, units_attn.c), allocated zeroed (the units accumulate) just before
 * the first and freed just after the last, so no step runs beside buffers it is not between: the MoE
 * backward without the attention side's [N, H, hd] pair, the attention side's later units without it. */
#define GB(name) ((int)(offsetof(block_grads, name) / sizeof(float *)))
static const struct {
    int buf;              /* index of the buffer among block_grads' first NGRAD_BUFS pointers */
    unit_id first, last;  /* its first writer's and last reader's steps */
} k_grads_life[] = {
    {GB(dX_mid), U_HC_POST_FFN, U_HC_POST_ATTN}, {GB(dffn), U_HC_POST_FFN, U_MOE},
    {GB(dpostF), U_HC_POST_FFN, U_HC_PRE_FFN},   {GB(dcombF), U_HC_POST_FFN, U_HC_PRE_FFN},
    {GB(dxf), U_MOE, U_FFN_NORM},                {GB(dyF), U_FFN_NORM, U_HC_PRE_FFN},
    {GB(dattn), U_HC_POST_ATTN, U_O_PROJ},       {GB(dpostA), U_HC_POST_ATTN, U_HC_PRE_ATTN},
    {GB(dcombA), U_HC_POST_ATTN, U_HC_PRE_ATTN}, {GB(dz), U_O_PROJ, U_O_PROJ},
    {GB(do_), U_O_PROJ, U_Q_UP},                 {GB(dq), U_O_PROJ, U_Q_UP},
    {GB(dkv), U_SPARSE_ATTN, U_KV},              {GB(dkvc), U_SPARSE_ATTN, U_COMPRESSOR},
    {GB(dqr), U_Q_UP, U_Q_DOWN},                 {GB(dxa), U_COMPRESSOR, U_ATTN_NORM},
    {GB(dyA), U_ATTN_NORM, U_HC_PRE_ATTN},
};
#define NGRAD_LIFE ((int)(sizeof k_grads_life / sizeof k_grads_life[0]))
_Static_assert(sizeof k_grads_life / sizeof k_grads_life[0] == offsetof(block_grads, dX_out) / sizeof(float *),
               "every gradient buffer has a life");

/* Elements of each buffer. */
static void grads_numel(const block_ctx *bc, const block_acts *a, int64_t numel[NGRAD_BUFS]) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t N = bc->B * bc->T, D = c->dim, n = c->hc_mult, H = c->n_heads, hd = c->head_dim;
    numel[GB(dX_mid)] = N * n * D;
    numel[GB(dffn)] = numel[GB(dxf)] = numel[GB(dyF)] = N * D;
    numel[GB(dattn)] = numel[GB(dxa)] = numel[GB(dyA)] = N * D;
    numel[GB(dpostF)] = numel[GB(dpostA)] = N * n;
    numel[GB(dcombF)] = numel[GB(dcombA)] = N * n * n;
    numel[GB(dz)] = N * c->o_groups * c->o_lora_rank;
    numel[GB(do_)] = numel[GB(dq)] = N * H * hd;
    numel[GB(dkv)] = N * hd;
    numel[GB(dkvc)] = bc->B * a->Nc * hd + 1;
    numel[GB(dqr)] = N * c->q_lora_rank;
}

/* Allocates the buffers whose life starts at step u. */
static ds4_status grads_start(const block_ctx *bc, block_grads *g, const int64_t *numel, unit_id u) {
    float **f = (float **)g;
    const char *prev = ds4_mem_owner_enter("block backward: gradient buffers");
    ds4_status st = DS4_OK;
    for (int i = 0; i < NGRAD_LIFE && st == DS4_OK; i++)
        if (k_grads_life[i].first == u && !(f[k_grads_life[i].buf] = work_zeros(bc, numel[k_grads_life[i].buf])))
            st = ds4_fail(DS4_ERR_OOM, "out of memory for the gradients of block %lld", (long long)bc->layer);
    ds4_mem_owner_leave(prev);
    return st;
}

/* Frees the buffers whose life ends at step u. */
static void grads_end(const block_ctx *bc, block_grads *g, unit_id u) {
    float **f = (float **)g;
    for (int i = 0; i < NGRAD_LIFE; i++)
        if (k_grads_life[i].last == u) {
            work_free(bc, f[k_grads_life[i].buf]);
            f[k_grads_life[i].buf] = NULL;
        }
}

/* Each step: make what the unit's backward reads present (replaying released units), run it, free the
 * outputs no later step reads. */
ds4_status block_bwd(const block_ctx *bc, block_acts *a, const float *dX_out, float *dX_in, double *kl_sum,
                     int64_t *kl_rows) {
    block_grads g;
    memset(&g, 0, sizeof g);
    int64_t numel[NGRAD_BUFS];
    grads_numel(bc, a, numel);
    g.dX_out = dX_out;
    g.dX_in = dX_in;
    g.kl_sum = kl_sum;
    g.kl_rows = kl_rows;
    ds4_status st = DS4_OK;
    for (int s = 0; s < k_block_bwd_steps && st == DS4_OK; s++) {
        const unit_id u = k_block_bwd_order[s];
        const unit_decl *ud = k_block_units[u];
        st = grads_start(bc, &g, numel, u);
        if (st == DS4_OK) st = act_need(bc, a, ud->bwd_reads);
        if (st == DS4_OK && unit_runs_here(u, a)) {
            const char *prev = ds4_mem_owner_enter(unit_owner(u));
            st = ud->bwd(bc, a, &g);
            ds4_mem_owner_leave(prev);
        }
        act_free_after_bwd(a, s);
        grads_end(bc, &g, u);
    }
    grads_free(bc, &g);
    block_acts_free(a);
    return st;
}
