/* The pipeline layout (ds4/pipeline.h): Megatron's layout strings and the uniform split, every error
 * class as one line naming its problem, and the recompute priority against hand-computed examples of the
 * RFC (docs/reference-recompute.md §3.2) and of MindSpeed's uniform formula. */
#include "test.h"

#include "ds4/model.h"
#include "ds4/pipeline.h"
#include "ds4/recompute.h"

static ds4_pp_cfg cfg_of(int64_t pp, int64_t vpp, const char *layout) {
    ds4_pp_cfg c;
    ds4_pp_cfg_defaults(&c);
    c.pp = pp;
    c.vpp = vpp;
    snprintf(c.layout, sizeof c.layout, "%s", layout);
    return c;
}

static ds4_pp_layout g_L; /* ~20 KiB: one, not one per call */

static const ds4_pp_chunk *chunk(int64_t p, int64_t v) {
    const ds4_pp_chunk *c = NULL;
    CHECK(ds4_pp_chunk_at(&g_L, p, v, &c) == DS4_OK, "chunk (%lld, %lld): %s", (long long)p, (long long)v, ds4_errmsg());
    return c;
}

static void check_chunk(int64_t p, int64_t v, int64_t b, int64_t e, int64_t mtp, bool emb, bool loss) {
    const ds4_pp_chunk *c = chunk(p, v);
    if (!c) return;
    CHECK(c->layer_begin == b && c->layer_end == e && c->n_mtp == mtp && c->embedding == emb && c->loss == loss,
          "chunk (%lld, %lld): layers [%lld, %lld) mtp %lld E %d L %d; want [%lld, %lld) mtp %lld E %d L %d",
          (long long)p, (long long)v, (long long)c->layer_begin, (long long)c->layer_end, (long long)c->n_mtp,
          c->embedding, c->loss, (long long)b, (long long)e, (long long)mtp, emb, loss);
}

/* DeepSeek-V4 Flash's POC layout: pp 2 gives vpp 2, chunks VPP-major. */
static void test_v4_poc_layout(void) {
    ds4_pp_cfg c = cfg_of(2, 0, "Et*11|t*12|t*12|t*8mL");
    CHECK(ds4_pp_layout_make(&c, 43, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    CHECK(g_L.pp == 2 && g_L.vpp == 2);
    check_chunk(0, 0, 0, 11, 0, true, false);
    check_chunk(1, 0, 11, 23, 0, false, false);
    check_chunk(0, 1, 23, 35, 0, false, false);
    check_chunk(1, 1, 35, 43, 1, false, true);
    int64_t p, v, local;
    CHECK(ds4_pp_locate(&g_L, 30, &p, &v, &local) == DS4_OK && p == 0 && v == 1 && local == 7);
}

/* Repeats: "(...)*N" first, then "x*N"; ',' is dropped. 61 layers like DeepSeek-V3's, MTP with the loss. */
static void test_repeats(void) {
    ds4_pp_cfg c = cfg_of(6, 0, "Et*3|(tt|)*28,ttmL");
    CHECK(ds4_pp_layout_make(&c, 61, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    CHECK(g_L.vpp == 5, "vpp %lld", (long long)g_L.vpp);
    check_chunk(0, 0, 0, 3, 0, true, false);
    check_chunk(1, 0, 3, 5, 0, false, false);
    check_chunk(5, 4, 59, 61, 1, false, true);
    /* t*0 is nothing; a group may hold x*N; an empty chunk is allowed */
    c = cfg_of(2, 2, "E|(t*2|)*1t*0tt,|mL");
    CHECK(ds4_pp_layout_make(&c, 4, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    check_chunk(0, 0, 0, 0, 0, true, false);
    check_chunk(1, 0, 0, 2, 0, false, false);
    check_chunk(0, 1, 2, 4, 0, false, false);
    check_chunk(1, 1, 4, 4, 1, false, true);
}

static void test_uniform(void) {
    ds4_pp_cfg c = cfg_of(2, 2, "");
    CHECK(ds4_pp_layout_make(&c, 8, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    check_chunk(0, 0, 0, 2, 0, true, false);
    check_chunk(1, 0, 2, 4, 0, false, false);
    check_chunk(0, 1, 4, 6, 0, false, false);
    check_chunk(1, 1, 6, 8, 1, false, true);
    /* Megatron's --num-layers-per-virtual-pipeline-stage: 12 layers, pp 2, 3 per chunk: vpp 2 */
    c = cfg_of(2, 0, "");
    c.layers_per_vstage = 3;
    CHECK(ds4_pp_layout_make(&c, 12, 0, &g_L) == DS4_OK, "%s", ds4_errmsg());
    CHECK(g_L.vpp == 2);
    check_chunk(1, 1, 9, 12, 0, false, true);
    /* one stage: one chunk of every layer, everything on it */
    c = cfg_of(1, 0, "");
    CHECK(ds4_pp_layout_make(&c, 4, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    check_chunk(0, 0, 0, 4, 1, true, true);
}

/* Each error class: the layout is refused and the one line names the problem. */
static void test_errors(void) {
    static const struct {
        int64_t pp, vpp, lpv, n_layers, n_mtp;
        const char *layout, *want;
    } bad[] = {
        {2, 0, 0, 4, 1, "Etx|tmL", "'x' is not a layer"},
        {3, 0, 0, 4, 1, "Ett|ttmL", "not a multiple of the 3 pipeline stages"},
        {2, 2, 0, 4, 1, "Ett|ttmL", "pp 2 x vpp 2 = 4"},
        {2, 0, 0, 4, 1, "Ettt|ttmL", "5 decoder layers (t), the model has 4"},
        {2, 0, 0, 4, 1, "Ett|ttL", "0 MTP layers (m), the model has 1"},
        {2, 0, 0, 4, 1, "tEtt|tmL", "the embedding (E) must come once, first"},
        {2, 0, 0, 4, 1, "EEtt|ttmL", "the embedding (E) must come once, first"},
        {2, 0, 0, 4, 1, "EttL|ttm", "the loss (L) must come once, last"},
        {2, 0, 0, 4, 1, "Ett|ttmL|", "not a multiple"},
        {2, 0, 0, 4, 1, "Ettm|ttL", "a decoder layer (t) after an MTP layer (m)"},
        {3, 0, 0, 4, 1, "Ett|ttm|L", "must be on the last chunk with the loss"},
        {2, 0, 0, 4, 1, "E((t|)*2)*1tmL", "nested parentheses"},
        {2, 0, 0, 4, 1, "E(tt|tt,mL", "'(' without its ')'"},
        {2, 0, 0, 4, 1, "Ett)|ttmL", "')' without its '('"},
        {2, 0, 0, 4, 1, "E(tt|)tt,mL", "followed by *N"},
        {2, 0, 0, 4, 1, "Et*|t*3mL", "needs a count"},
        {2, 0, 0, 4, 1, "*2Ett|ttmL", "repeats nothing"},
        {2, 0, 0, 4, 1, "Et*99999999|mL", "expands to more than"},
        {3, 0, 0, 4, 1, "", "do not split evenly over pp 3 x vpp 1"},
        {2, 0, 3, 8, 1, "", "do not split into chunks of that many"},
        {2, 3, 2, 8, 1, "", "gives 2 virtual chunks per stage, but --vpp is 3"},
        {2, 0, 2, 4, 1, "Ett|ttmL", "give one"},
        {0, 0, 0, 4, 1, "", "--pipeline-model-parallel-size (parallel.pp) 0"},
        /* DeepSeek-V3's layout, legal in Megatron (a standalone MTP chunk), refused: ds4's MTP follows the head */
        {8, 0, 0, 61, 1, "Et*3|(tt|)*29,m|L", "must be on the last chunk with the loss"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ds4_pp_cfg c = cfg_of(bad[i].pp, bad[i].vpp, bad[i].layout);
        c.layers_per_vstage = bad[i].lpv;
        ds4_status st = ds4_pp_layout_make(&c, bad[i].n_layers, bad[i].n_mtp, &g_L);
        CHECK(st != DS4_OK, "'%s' accepted", bad[i].layout);
        if (st == DS4_OK) continue;
        CHECK(strstr(ds4_errmsg(), bad[i].want) != NULL, "'%s': message '%s' lacks '%s'", bad[i].layout, ds4_errmsg(),
              bad[i].want);
        CHECK(!strchr(ds4_errmsg(), '\n'), "'%s': message is more than one line", bad[i].layout);
    }
    /* a rank out of range and a layer that is not on the chunk asked for */
    ds4_pp_cfg c = cfg_of(2, 0, "Ett|tt|ttt|tmL");
    CHECK(ds4_pp_layout_make(&c, 8, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    const ds4_pp_chunk *ch;
    CHECK(ds4_pp_chunk_at(&g_L, 0, 2, &ch) != DS4_OK && strstr(ds4_errmsg(), "VPP rank 2 out of range [0, 2)"), "%s",
          ds4_errmsg());
    CHECK(ds4_pp_chunk_at(&g_L, 2, 0, &ch) != DS4_OK && strstr(ds4_errmsg(), "pp rank 2 out of range"), "%s",
          ds4_errmsg());
    int64_t prio;
    CHECK(ds4_pp_priority_on(&g_L, 0, 0, 5, true, &prio) != DS4_OK &&
              strstr(ds4_errmsg(), "layer 5 is not on pp rank 0, virtual chunk 0"), "%s", ds4_errmsg());
    CHECK(ds4_pp_priority_on(&g_L, 0, 3, 0, true, &prio) != DS4_OK && strstr(ds4_errmsg(), "VPP rank 3"), "%s",
          ds4_errmsg());
    CHECK(ds4_pp_priority(&g_L, 8, true, &prio) != DS4_OK && strstr(ds4_errmsg(), "layer 8 is not a decoder layer"),
          "%s", ds4_errmsg());
}

/* The RFC's worked example, layout "Ett|tt|ttt|tmL" with pp 2 (so vpp 2): layers 1..8 (1-based) on
 * (pp, vpp) = (0,0) (0,0) (1,0) (1,0) (0,1) (0,1) (0,1) (1,1), positions 0 1 0 1 0 1 2 0; per pp rank the
 * chunks interleave by depth: rank 0 has chunks of 2 and 3 layers, so depth 0 gives 0, 1, depth 1 gives
 * 2, 3 and depth 2 (only the second chunk) 4. */
static void test_priority_rfc_example(void) {
    ds4_pp_cfg c = cfg_of(2, 0, "Ett|tt|ttt|tmL");
    CHECK(ds4_pp_layout_make(&c, 8, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    const int64_t pp_of[8] = {0, 0, 1, 1, 0, 0, 0, 1}, vpp_of[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    const int64_t local[8] = {0, 1, 0, 1, 0, 1, 2, 0}, per_pp[8] = {0, 2, 0, 2, 1, 3, 4, 1};
    for (int64_t l = 0; l < 8; l++) {
        int64_t a = -1, b = -1;
        CHECK(ds4_pp_priority(&g_L, l, false, &a) == DS4_OK && a == local[l], "layer %lld: %lld, want %lld",
              (long long)l, (long long)a, (long long)local[l]);
        CHECK(ds4_pp_priority_on(&g_L, pp_of[l], vpp_of[l], l, true, &b) == DS4_OK && b == per_pp[l],
              "layer %lld per pp rank: %lld, want %lld", (long long)l, (long long)b, (long long)per_pp[l]);
    }
    /* an empty first chunk: rank 0's chunks hold 0 and 2 layers, so its layers get 0 and 1 */
    c = cfg_of(2, 2, "E|tt|tt|mL");
    CHECK(ds4_pp_layout_make(&c, 4, 1, &g_L) == DS4_OK, "%s", ds4_errmsg());
    const int64_t want[4] = {0, 1, 0, 1};
    for (int64_t l = 0; l < 4; l++) {
        int64_t a = -1;
        CHECK(ds4_pp_priority(&g_L, l, true, &a) == DS4_OK && a == want[l], "layer %lld: %lld", (long long)l,
              (long long)a);
    }
}

/* The recompute policy reads the priority from the run's layout: full block recompute of N layers takes
 * the first N of every chunk (Megatron: recompute_num_layers per stage), --recompute-norm-num-layers too. */
static void test_masks_follow_layout(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    r.granularity = DS4_RECOMPUTE_GRAN_FULL;
    r.method = DS4_RECOMPUTE_METHOD_BLOCK;
    r.num_layers = 1;
    uint32_t masks[DS4_MAX_LAYERS];
    CHECK(ds4_recompute_validate(&r, &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_recompute_masks(&r, &c, masks);
    CHECK(masks[0] && !masks[1] && !masks[2] && !masks[3], "one stage: only layer 0 in full");
    r.pipe = cfg_of(2, 0, "Ettt|tmL"); /* chunks [0, 3) and [3, 4) */
    CHECK(ds4_recompute_validate(&r, &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_recompute_masks(&r, &c, masks);
    CHECK(masks[0] && !masks[1] && !masks[2] && masks[3], "pp 2 uneven: layers 0 and 3 in full");
    /* norm on the first 2 by priority, per pp rank over its 2 chunks: "Et|t|tt|tmL": rank 0 holds [0, 1) and
     * [2, 4): priorities 0, 1, 2; rank 1 holds [1, 2) and [4, 4)... */
    ds4_recompute_defaults(&r);
    r.norm = true;
    r.norm_num_layers = 1;
    r.pipe = cfg_of(2, 0, "Et|t|tt|mL");
    r.per_pp_rank = true;
    CHECK(ds4_recompute_validate(&r, &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_recompute_masks(&r, &c, masks);
    const uint32_t norm = 1u << ds4_unit_find("attn_norm");
    /* rank 0: layer 0 (chunk 0, depth 0) prio 0, layer 2 (chunk 1, depth 0) prio 1, layer 3 prio 2;
     * rank 1: layer 1 prio 0 */
    CHECK((masks[0] & norm) && (masks[1] & norm) && !(masks[2] & norm) && !(masks[3] & norm),
          "norm masks %x %x %x %x", masks[0], masks[1], masks[2], masks[3]);
    /* a layout that does not fit the model is the validation's error */
    r.pipe = cfg_of(2, 0, "Et|t|tt|tmL");
    CHECK(ds4_recompute_validate(&r, &c) != DS4_OK && strstr(ds4_errmsg(), "5 decoder layers"), "%s", ds4_errmsg());
}

/* The flags: Megatron's names and ds4's short ones set the run's pipeline options. */
static void test_flags(void) {
    ds4_recompute_cfg r;
    ds4_recompute_defaults(&r);
    char *argv[] = {"x", "--pipeline-model-parallel-size", "4", "--vpp", "2", "--num-layers-per-virtual-pipeline-stage",
                    "3", "--layout", "Et|tmL", "--enable-recompute-layers-per-pp-rank", "--pp", "0"};
    const int argc = (int)(sizeof argv / sizeof argv[0]);
    int i = 1;
    bool used;
    for (; i < argc - 2; i++) CHECK(ds4_recompute_parse_arg(&r, argc, argv, &i, &used) == DS4_OK && used, "%s", argv[i]);
    CHECK(r.pipe.pp == 4 && r.pipe.vpp == 2 && r.pipe.layers_per_vstage == 3 && !strcmp(r.pipe.layout, "Et|tmL") &&
          r.per_pp_rank);
    CHECK(ds4_recompute_parse_arg(&r, argc, argv, &i, &used) != DS4_OK && strstr(ds4_errmsg(), "--pp"), "%s",
          ds4_errmsg());
}

int main(void) {
    RUN(test_v4_poc_layout);
    RUN(test_repeats);
    RUN(test_uniform);
    RUN(test_errors);
    RUN(test_priority_rfc_example);
    RUN(test_masks_follow_layout);
    RUN(test_flags);
    TEST_MAIN_END("test_pipeline");
}
