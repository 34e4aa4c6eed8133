/* The activation store of a training pass (docs/DESIGN.md idea 2): the policies the trainer sets for
 * saved tensors, behind the interface the model calls (ds4_act_store in ds4/model.h).
 *   keep       the default: a saved tensor stays in memory until backward has read it;
 *   recompute  per main layer, the units of a mask (ds4/recompute.h: ds4_recompute_masks) are freed
 *              after their last forward reader and replayed in backward;
 *   swap       --swap-layer-input: each main layer's input stream X[l] goes to the offload tier
 *              (ds4/offload.h) after block l's forward and comes back just before block l's backward,
 *              so recompute replays find it too. X[n_layers] is never offered (the heads and MTP read
 *              it in forward and first thing in backward).
 * Losses and gradients are bitwise those of keeping everything. */
#ifndef DS4_ACTSTORE_H
#define DS4_ACTSTORE_H

#include "ds4/model.h"
#include "ds4/offload.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The layer inputs held in an offload store (the store must outlive it). One pass at a time. */
typedef struct ds4_act_swap ds4_act_swap;
ds4_status ds4_act_swap_new(ds4_offload *offload, ds4_act_swap **out);
int64_t ds4_act_swap_held(const ds4_act_swap *s); /* streams in the offload tier now */
/* Streams moved out (save) and back (fetch) so far, and their bytes. */
typedef struct {
    int64_t saves, fetches, bytes_out, bytes_in;
} ds4_act_swap_stats;
ds4_act_swap_stats ds4_act_swap_moved(const ds4_act_swap *s);
void ds4_act_swap_free(ds4_act_swap *s);          /* drops what it still holds; NULL: no-op */
ds4_offload *ds4_act_swap_offload(const ds4_act_swap *s); /* the store it puts streams in */

/* The policies of a pass. A value the caller keeps for the pass's lifetime; nothing is allocated. */
typedef struct {
    const uint32_t *recompute; /* [n_layers] masks: bit u = recompute unit u (ds4_unit_name order); NULL: none */
    ds4_act_swap *swap;        /* where layer inputs go; NULL: they stay in memory */
} ds4_act_policies;

/* The store the model calls (ds4_pass_opts.store) for these policies. */
ds4_act_store ds4_act_store_of(const ds4_act_policies *p);

#ifdef __cplusplus
}
#endif
#endif
