/* An activation store for the tests that run a pass with recompute and no swap: hc_pre_attn, the
 * compressor and sparse attention are released after their last forward reader and replayed before
 * backward (test_guard, tests/cuda/test_cuda_model). */
#ifndef DS4_TEST_STORE_H
#define DS4_TEST_STORE_H

#include "ds4/model.h"

static inline ds4_act_policy test_recompute_policy(void *ctx, int64_t layer, int unit) {
    (void)ctx, (void)layer;
    return unit == ds4_unit_find("hc_pre_attn") || unit == ds4_unit_find("sparse_attn") ||
                   unit == ds4_unit_find("compressor")
               ? DS4_ACT_RECOMPUTE
               : DS4_ACT_KEEP;
}
static inline void test_release_nothing(void *ctx, int64_t layer, int unit, int slot) {
    (void)ctx, (void)layer, (void)unit, (void)slot;
}
/* policy, save, fetch, release: nothing is swapped */
static const ds4_act_store_ops test_recompute_store = {test_recompute_policy, NULL, NULL, test_release_nothing};

#endif
