/* The activation store's policies (ds4/actstore.h): recompute masks and the layer-input swap, answered
 * per (layer, unit) to the model, which does the saving, releasing and replaying they ask for. */
#include "ds4/actstore.h"

#include "ds4/config.h"

struct ds4_act_swap {
    ds4_offload *offload;
    int64_t held[DS4_MAX_LAYERS]; /* handle of layer l's input stream, -1 while it is in memory */
    ds4_act_swap_stats moved;     /* streams moved out and back so far */
};

ds4_status ds4_act_swap_new(ds4_offload *offload, ds4_act_swap **out) {
    *out = NULL;
    ds4_act_swap *s = ds4_calloc(DS4_MEM_OTHER, sizeof *s);
    if (!s) return ds4_fail(DS4_ERR_OOM, "swap-layer-input: out of memory");
    s->offload = offload;
    for (int64_t l = 0; l < DS4_MAX_LAYERS; l++) s->held[l] = -1;
    *out = s;
    return DS4_OK;
}

int64_t ds4_act_swap_held(const ds4_act_swap *s) {
    int64_t n = 0;
    for (int64_t l = 0; l < DS4_MAX_LAYERS; l++) n += s->held[l] >= 0;
    return n;
}

ds4_act_swap_stats ds4_act_swap_moved(const ds4_act_swap *s) { return s->moved; }

ds4_offload *ds4_act_swap_offload(const ds4_act_swap *s) { return s->offload; }

static void swap_drop(ds4_act_swap *s, int64_t layer) {
    if (layer < 0 || layer >= DS4_MAX_LAYERS) return;
    ds4_offload_drop(s->offload, s->held[layer]);
    s->held[layer] = -1;
}

void ds4_act_swap_free(ds4_act_swap *s) {
    if (!s) return;
    for (int64_t l = 0; l < DS4_MAX_LAYERS; l++) swap_drop(s, l);
    ds4_free(s);
}

/* ------------------------------------------------------------------ the interface the model calls */
static ds4_act_policy policy(void *ctx, int64_t layer, int unit) {
    const ds4_act_policies *p = ctx;
    if (unit == DS4_UNIT_INPUT) return p->swap ? DS4_ACT_SWAP : DS4_ACT_KEEP;
    return p->recompute && (p->recompute[layer] >> unit & 1u) ? DS4_ACT_RECOMPUTE : DS4_ACT_KEEP;
}

static ds4_status save(void *ctx, int64_t layer, int unit, int slot, void **buf, size_t bytes) {
    ds4_act_swap *s = ((const ds4_act_policies *)ctx)->swap;
    if (!s || unit != DS4_UNIT_INPUT || slot != 0 || layer < 0 || layer >= DS4_MAX_LAYERS || s->held[layer] >= 0)
        return ds4_fail(DS4_ERR_INTERNAL, "swap-layer-input: layer %lld's input cannot be saved (already out, or not "
                        "a layer input; one pass at a time per store)", (long long)layer);
    if (!*buf) return DS4_OK;
    DS4_TRY(ds4_offload_put_dev(s->offload, DS4_MEM_ACT, *buf, bytes, &s->held[layer]));
    ds4_dev_free(ds4_offload_exec(s->offload), *buf);
    *buf = NULL;
    s->moved.saves++;
    s->moved.bytes_out += (int64_t)bytes;
    return DS4_OK;
}

static ds4_status fetch(void *ctx, int64_t layer, int unit, int slot, void **buf, size_t bytes) {
    ds4_act_swap *s = ((const ds4_act_policies *)ctx)->swap;
    if (!s || unit != DS4_UNIT_INPUT || slot != 0 || layer < 0 || layer >= DS4_MAX_LAYERS || s->held[layer] < 0 ||
        *buf)
        return DS4_OK;
    void *x = ds4_dev_alloc(ds4_offload_exec(s->offload), DS4_MEM_ACT, bytes);
    if (!x) return ds4_fail_prefix(DS4_ERR_OOM, "swap-layer-input: restoring layer %lld's input", (long long)layer);
    ds4_status st = ds4_offload_get_dev(s->offload, s->held[layer], x);
    if (st != DS4_OK) {
        ds4_dev_free(ds4_offload_exec(s->offload), x);
        return ds4_fail_prefix(st, "swap-layer-input: restoring layer %lld's input", (long long)layer);
    }
    swap_drop(s, layer);
    s->moved.fetches++;
    s->moved.bytes_in += (int64_t)bytes;
    *buf = x;
    return DS4_OK;
}

static void release(void *ctx, int64_t layer, int unit, int slot) {
    ds4_act_swap *s = ((const ds4_act_policies *)ctx)->swap;
    if (s && unit == DS4_UNIT_INPUT && slot == 0) swap_drop(s, layer);
}

static const ds4_act_store_ops k_ops = {.policy = policy, .save = save, .fetch = fetch, .release = release};

ds4_act_store ds4_act_store_of(const ds4_act_policies *p) { return (ds4_act_store){&k_ops, (void *)p}; }
