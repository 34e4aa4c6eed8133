/* The block's unit declarations (model/block.h) are consistent: the names the policies use, inputs
 * that only name units run earlier, output slots that fit the store, and a backward order that runs
 * every unit's backward exactly once. Everything the activation store derives (release, replay, free)
 * rests on these. */
#include "model/block.h"
#include "test.h"

static void test_names(void) {
    for (int u = 0; u < U_COUNT; u++) {
        const unit_decl *ud = k_block_units[u];
        CHECK(ud && ud->name, "unit %d has no declaration", u);
        if (!ud || !ud->name) continue;
        CHECK(!strcmp(ds4_unit_name(u), ud->name), "unit %d: %s vs %s", u, ds4_unit_name(u), ud->name);
        CHECK(ds4_unit_find(ud->name) == u, "ds4_unit_find(%s) = %d, expected %d", ud->name, ds4_unit_find(ud->name), u);
    }
    CHECK(U_COUNT == DS4_NUM_UNITS, "%d units, the public count says %d", U_COUNT, DS4_NUM_UNITS);
}

static void test_inputs_point_back(void) {
    const uint32_t all = (1u << U_COUNT) - 1;
    for (int u = 0; u < U_COUNT; u++) {
        const unit_decl *ud = k_block_units[u];
        CHECK((ud->inputs & ~((1u << u) - 1)) == 0, "%s reads a unit that runs after it (inputs %#x)", ud->name,
              ud->inputs);
        CHECK((ud->bwd_reads & ~all) == 0, "%s: backward reads an unknown unit", ud->name);
        CHECK(ud->fwd != NULL, "%s has no forward", ud->name);
    }
}

static void test_slots(void) {
    for (int u = 0; u < U_COUNT; u++) {
        const unit_decl *ud = k_block_units[u];
        CHECK(ud->nouts >= 0 && ud->nouts <= UNIT_MAX_OUTS, "%s: %d outputs, the store holds %d", ud->name,
              ud->nouts, UNIT_MAX_OUTS);
        CHECK((ud->nouts == 0) == (ud->outs == NULL), "%s: outs and nouts disagree", ud->name);
        for (int s = 0; s < ud->nouts; s++) {
            const act_slot *sl = &ud->outs[s];
            CHECK(sl->name != NULL, "%s slot %d has no name (a gap in the slot table)", ud->name, s);
            CHECK(sl->dtype == ACT_F32 || sl->dtype == ACT_F32_BF16 || sl->dtype == ACT_BF16 || sl->dtype == ACT_I32 ||
                      sl->dtype == ACT_I64, "%s.%s: dtype %d", ud->name, sl->name ? sl->name : "?", (int)sl->dtype);
            CHECK(sl->dim[0] != X_1, "%s.%s has no shape", ud->name, sl->name ? sl->name : "?");
        }
    }
}

static void test_backward_order(void) {
    int seen[U_COUNT] = {0};
    for (int s = 0; s < k_block_bwd_steps; s++) {
        unit_id u = k_block_bwd_order[s];
        CHECK((unsigned)u < U_COUNT, "step %d names unit %d", s, (int)u);
        if ((unsigned)u >= U_COUNT) continue;
        seen[u]++;
        CHECK(k_block_units[u]->bwd != NULL, "step %d: %s has no backward", s, k_block_units[u]->name);
        /* a unit's backward reads its own outputs or runs only on what later units handed down */
        CHECK(k_block_units[u]->bwd_reads != 0, "%s: backward reads nothing", k_block_units[u]->name);
    }
    for (int u = 0; u < U_COUNT; u++)
        CHECK(seen[u] == (k_block_units[u]->bwd != NULL), "%s: backward runs %d times", k_block_units[u]->name, seen[u]);
}

int main(void) {
    RUN(test_names);
    RUN(test_inputs_point_back);
    RUN(test_slots);
    RUN(test_backward_order);
    TEST_MAIN_END("test_units");
}
