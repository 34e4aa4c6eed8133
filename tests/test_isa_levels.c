/* The cpu kernels at every ISA level give the generic level's bits. The Makefile compiles src/kernels/cpu/
 * once per level (generic, avx2, avx512) into one table each, and the dispatch runs the table of the level
 * in use; with no FMA contraction (-ffp-contract=off) and no reassociation the compiler's vector code must
 * change no result, so each table must give exactly the generic table's bits.
 *
 * Each table the CPU can run is compared with the generic one on the whole model (forward and backward of
 * tiny-a, tiny-b and tiny-dspark, in fp32 and in bf16 mixed precision: logits, losses, every gradient),
 * with the GEMM engine held fixed (the driver runs the dispatch's engine whatever the table), and on the
 * few ops no pass calls (direct calls on random inputs). Every entry of the table runs at least once, or
 * the test fails naming the entry. Levels the CPU lacks print SKIP. */
#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ds4/config.h"
#include "ds4/core.h"
#include "ds4/kernels.h"
#include "ds4/model.h"
#include "kernels/cpu/cpu.h"
#include "kernels/dispatch.h"
#include "test.h"

/* ------------------------------------------------------------------ a table that counts its calls */
enum {
#define DS4_OP(name, plan, cpu, params, args) OPI_##name,
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) OPI_##name,
#include "kernels/ops.def"
    OPI_COUNT
};

static const ds4_kernel_backend *g_inner; /* the table the counting one forwards to */
static int64_t g_calls[OPI_COUNT];

#define DS4_OP(name, plan, cpu, params, args)  \
    static void count_##name params {          \
        g_calls[OPI_##name]++;                 \
        g_inner->name args;                    \
    }
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) \
    static type count_##name params {                          \
        g_calls[OPI_##name]++;                                 \
        return g_inner->name args;                             \
    }
#include "kernels/ops.def"

static const ds4_kernel_backend k_counting = {
    .name = "cpu",
    .plan = &ds4_kernel_backend_plan_table,
#define DS4_OP(name, plan, cpu, params, args) .name = count_##name,
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) .name = count_##name,
#include "kernels/ops.def"
};

/* ------------------------------------------------------------------ the model on one table */
typedef struct {
    ds4_losses losses;
    float *logits, *grads; /* [B·T·V], [numel] */
    int64_t nlogits, numel;
} pass_bits;

enum { B_ = 2, T_ = 64 };

/* Forward and backward of the config at path, random weights (seed 5), on table kb (through the counting
 * table); bf16: mixed precision (the bf16 compute copy, bf16 GEMMs and held activations). */
static bool run_model(const ds4_kernel_backend *kb, const char *path, bool bf16, pass_bits *out) {
    memset(out, 0, sizeof *out);
    ds4_config c;
    CHECK(ds4_config_load(path, &c) == DS4_OK, "%s", ds4_errmsg());
    g_inner = kb;
    const ds4_exec ex = {.backend = &k_counting, .matmul_precision = bf16 ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32};
    ds4_model *m = NULL;
    CHECK((bf16 ? ds4_model_create_bf16 : ds4_model_create)(&ex, &c, false, &m) == DS4_OK, "%s: %s", path,
          ds4_errmsg());
    if (!m) return false;
    ds4_model_init_random(m, 5);
    if (bf16) ds4_model_refresh_bf16(m);
    ds4_model_zero_grad(m);
    int32_t ids[B_ * T_];
    for (int64_t i = 0; i < B_ * T_; i++) ids[i] = (int32_t)((i * 37 + 11) % c.vocab_size);
    const ds4_pass_opts o = {.need_backward = true, .keep_logits = true, .bf16_acts = bf16};
    ds4_pass *p = NULL;
    bool ok = ds4_forward(m, ids, B_, T_, &o, &p) == DS4_OK;
    CHECK(ok, "%s forward: %s", path, ds4_errmsg());
    if (ok) {
        out->nlogits = (int64_t)B_ * T_ * c.vocab_size;
        out->logits = malloc((size_t)out->nlogits * sizeof(float));
        memcpy(out->logits, ds4_pass_logits(p), (size_t)out->nlogits * sizeof(float));
        ok = ds4_backward(m, p) == DS4_OK;
        CHECK(ok, "%s backward: %s", path, ds4_errmsg());
    }
    if (ok) {
        out->losses = *ds4_pass_losses(p);
        out->numel = ds4_model_numel(m);
        out->grads = malloc((size_t)out->numel * sizeof(float));
        memcpy(out->grads, ds4_model_grads_flat(m), (size_t)out->numel * sizeof(float));
    }
    ds4_pass_free(p);
    ds4_model_free(m);
    return ok;
}

static void pass_bits_free(pass_bits *b) {
    free(b->logits);
    free(b->grads);
}

static int64_t differing(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += memcmp(a + i, b + i, sizeof(float)) != 0;
    return d;
}

static bool same_losses(const ds4_losses *a, const ds4_losses *b) {
    return !memcmp(&a->loss, &b->loss, sizeof(double)) && !memcmp(&a->mtp_loss, &b->mtp_loss, sizeof(double)) &&
           !memcmp(&a->indexer_loss, &b->indexer_loss, sizeof(double)) &&
           !memcmp(&a->total_loss, &b->total_loss, sizeof(double));
}

/* ------------------------------------------------------------------ the ops no pass above calls */
/* The entries the passes leave out: the bare GEMMs (the model calls them through linear_* and the
 * experts), one token's Sinkhorn (hc_pre runs its own), expert parallelism's row packing, the expert counts
 * and balanced routing's table, and the step's ops around the passes (norms, the finite count, the optimizers'
 * updates, Newton–Schulz on a tall matrix), FSDP's exact norm and rank-ordered sum, and the reserved ranges
 * of an FSDP model. Random inputs, each on both tables (the calls are counted like the
 * passes'); the outputs byte for byte equal. */
enum { DM = 13, DN = 11, DK = 17, SN = 4, SM = (2 + SN) * SN, RN = 23, RD = 9, RK = 3, RE = 5, ON = 4099, NR = 24,
       NC = 10 };
typedef struct { /* the outputs of one table */
    float nt[DM * DN], nn[DM * DN], tn[DM * DN];
    float pre[SN], post[SN], comb[SN * SN], dmixes[SM], dscale[3], dbase[SM];
    float packed[RN * (RD + 1)], x[RN * RD], w[RN], dx[RN * RD], dgw[RN * RK];
    int64_t cnt[RE], table[RN * RK];
    int32_t ids[RN];
    double sumsq;
    int64_t nonfinite;
    float scaled[ON], aw[ON], am[ON], av[ON], mw[ON], mmom[ON], mu[ON], ns[NR * NC];
    ds4_sumsq_acc exact;
    float rsum[ON];
    bool mapped_zero; /* a mapped piece of a reserved range read zeros */
} direct_out;

static void direct_run(const ds4_kernel_backend *kb, direct_out *o) {
    const ds4_exec ex = {.backend = &k_counting};
    g_inner = kb;
    memset(o, 0, sizeof *o);
    float a[DM * DK], bnt[DN * DK], bnn[DK * DN], atn[DK * DM];
    t_fill(a, DM * DK, 1, 1.0f), t_fill(bnt, DN * DK, 2, 1.0f), t_fill(bnn, DK * DN, 3, 1.0f), t_fill(atn, DK * DM, 4, 1.0f);
    t_fill(o->nn, DM * DN, 5, 1.0f); /* beta = 0.5 reads C */
    gemm_nt(&ex, DM, DN, DK, a, DK, bnt, DK, o->nt, DN, 0.0f);
    gemm_nn(&ex, DM, DN, DK, a, DK, bnn, DN, o->nn, DN, 0.5f);
    gemm_tn(&ex, DM, DN, DK, atn, DM, bnn, DN, o->tn, DN, 0.0f);

    float mixes[SM], scale[3], base[SM], dpre[SN], dpost[SN], dcomb[SN * SN];
    t_fill(mixes, SM, 6, 2.0f), t_fill(scale, 3, 7, 0.5f), t_fill(base, SM, 8, 0.5f);
    t_fill(dpre, SN, 9, 1.0f), t_fill(dpost, SN, 10, 1.0f), t_fill(dcomb, SN * SN, 11, 1.0f);
    const hc_sinkhorn_args sa = {.n = SN, .iters = 20, .eps = 1e-6f, .mixes = mixes, .scale = scale, .base = base,
                                 .pre = o->pre, .post = o->post, .comb = o->comb};
    hc_split_sinkhorn_fwd(&ex, &sa);
    hc_split_sinkhorn_bwd(&ex, &sa, &(hc_sinkhorn_grads){.dpre = dpre, .dpost = dpost, .dcomb = dcomb,
                                                         .dmixes = o->dmixes, .dscale = o->dscale, .dbase = o->dbase});

    float x[RN * RD], w[RN], src[RN * (RD + 1)];
    int32_t rows[RN], etok[RN], eslot[RN];
    t_fill(x, RN * RD, 12, 1.0f), t_fill(w, RN, 13, 1.0f), t_fill(src, RN * (RD + 1), 14, 1.0f);
    for (int32_t i = 0; i < RN; i++) rows[i] = (i * 7) % RN, etok[i] = (i * 5) % RN, eslot[i] = i % RK;
    rows_pack(&ex, o->packed, x, rows, w, RN, RD);
    rows_unpack(&ex, o->x, o->w, src, RN, RD);
    moe_unpack_grads_add(&ex, o->dx, o->dgw, src, etok, eslot, RN, RD, RK);
    const int64_t eoff[RE + 1] = {0, 4, 4, 11, 19, RN};
    moe_expert_counts(&ex, o->cnt, eoff, RE, RN);
    moe_balanced_table(&ex, o->table, o->ids, RN, RK, RE);

    float g[ON], bad[ON];
    t_fill(g, ON, 15, 1.0f), t_fill(o->scaled, ON, 16, 1.0f), t_fill(o->aw, ON, 17, 1.0f);
    t_fill(o->am, ON, 18, 0.1f), t_fill(o->av, ON, 19, 0.1f), t_fill(o->mw, ON, 20, 1.0f), t_fill(o->mmom, ON, 21, 1.0f);
    for (int i = 0; i < ON; i++) o->av[i] *= o->av[i], bad[i] = i % 97 ? g[i] : NAN;
    sumsq(&ex, &o->sumsq, g, ON);
    count_nonfinite(&ex, &o->nonfinite, bad, ON);
    scale_f32(&ex, o->scaled, ON, 0.37f);
    const ds4_adamw_consts k = {.b1 = 0.9f, .b2 = 0.95f, .eps = 1e-8f, .omb1 = 0.1f, .omb2 = 0.05f, .step_size = 3e-3f, .inv_sqrt_bc2 = 1.3f,
                                .decay = 3e-4f};
    adamw_update(&ex, ON, o->aw, g, o->am, o->av, k, true);
    muon_momentum(&ex, ON, g, o->mmom, o->mu, 0.95f, true);
    muon_apply(&ex, ON, o->mw, o->mu, 3e-4f, 0.02f);
    const ds4_ns_coef coef[3] = {{3.4445f, -4.775f, 2.0315f}, {3.4445f, -4.775f, 2.0315f}, {2.0f, -1.5f, 0.5f}};
    t_fill(o->ns, NR * NC, 22, 1.0f);
    newton_schulz(&ex, o->ns, NR, NC, coef, 3, 1e-7f);
    sumsq_exact(&ex, &o->exact, g, ON);
    t_fill(o->rsum, ON, 23, 1.0f);
    float *parts = malloc(3 * ON * sizeof(float));
    if (parts) {
        t_fill(parts, 3 * ON, 24, 1.0f);
        rank_sum_add(&ex, o->rsum, parts, 3, ON);
        free(parts);
    }
    const size_t pg = 4096;
    unsigned char *r = range_reserve(&ex, 3 * pg);
    if (r && range_map(&ex, r + pg, pg, DS4_MEM_PARAM)) {
        o->mapped_zero = true;
        for (size_t i = 0; i < pg; i++) o->mapped_zero = o->mapped_zero && r[pg + i] == 0;
        range_unmap(&ex, r + pg, pg, DS4_MEM_PARAM);
    }
    range_release(&ex, r, 3 * pg);
}

static void direct_ops(const ds4_kernel_backend *lv, const char *name) {
    direct_out *o = malloc(2 * sizeof *o);
    direct_run(&ds4_cpu_kernels_generic, &o[0]);
    direct_run(lv, &o[1]);
#define SAME(f) (!memcmp(o[0].f, o[1].f, sizeof o->f))
    CHECK(SAME(nt) && SAME(nn) && SAME(tn), "%s: gemm_nt / nn / tn", name);
    CHECK(SAME(pre) && SAME(post) && SAME(comb), "%s: hc_split_sinkhorn_fwd", name);
    CHECK(SAME(dmixes) && SAME(dscale) && SAME(dbase), "%s: hc_split_sinkhorn_bwd", name);
    CHECK(SAME(packed) && SAME(x) && SAME(w), "%s: rows_pack / rows_unpack", name);
    CHECK(SAME(dx) && SAME(dgw), "%s: moe_unpack_grads_add", name);
    CHECK(SAME(cnt), "%s: moe_expert_counts", name);
    CHECK(SAME(table) && SAME(ids), "%s: moe_balanced_table", name);
    CHECK(!memcmp(&o[0].sumsq, &o[1].sumsq, sizeof o->sumsq) && o[0].nonfinite == o[1].nonfinite &&
          o[0].nonfinite == (ON + 96) / 97, "%s: sumsq, count_nonfinite (%lld)", name, (long long)o[1].nonfinite);
    CHECK(SAME(scaled) && SAME(aw) && SAME(am) && SAME(av), "%s: scale_f32, adamw_update", name);
    CHECK(SAME(mw) && SAME(mmom) && SAME(mu) && SAME(ns), "%s: muon_momentum, muon_apply, newton_schulz", name);
    CHECK(!memcmp(&o[0].exact, &o[1].exact, sizeof o->exact) && SAME(rsum), "%s: sumsq_exact, rank_sum_add", name);
    CHECK(o[0].mapped_zero && o[1].mapped_zero, "%s: range_reserve / map: a mapped piece reads zeros", name);
#undef SAME
    free(o);
}

/* ------------------------------------------------------------------ the test */
static const char *const k_configs[] = {"tests/configs/tiny-a.json", "tests/configs/tiny-b.json",
                                        "tests/configs/tiny-dspark.json"};
#define NCFG ((int)(sizeof k_configs / sizeof k_configs[0]))

/* Level lv's table against the generic one (refs: the generic table's passes, [NCFG][2]). */
static void compare_level(const ds4_kernel_backend *lv, ds4_isa built, pass_bits refs[][2]) {
    const char *name = ds4_isa_name(built);
    memset(g_calls, 0, sizeof g_calls);
    for (int ci = 0; ci < NCFG; ci++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            pass_bits got;
            const pass_bits *ref = &refs[ci][bf16];
            if (!run_model(lv, k_configs[ci], bf16, &got) || !ref->grads) {
                pass_bits_free(&got);
                continue;
            }
            CHECK(same_losses(&got.losses, &ref->losses),
                  "%s, %s, %s: losses %.17g %.17g %.17g, generic %.17g %.17g %.17g", name, k_configs[ci],
                  bf16 ? "bf16" : "fp32", got.losses.loss, got.losses.mtp_loss, got.losses.indexer_loss,
                  ref->losses.loss, ref->losses.mtp_loss, ref->losses.indexer_loss);
            int64_t dl = differing(got.logits, ref->logits, ref->nlogits);
            int64_t dg = got.numel == ref->numel ? differing(got.grads, ref->grads, ref->numel) : -1;
            CHECK(dl == 0 && dg == 0, "%s, %s, %s: %lld of %lld logits and %lld of %lld gradients differ from generic",
                  name, k_configs[ci], bf16 ? "bf16" : "fp32", (long long)dl, (long long)ref->nlogits, (long long)dg,
                  (long long)ref->numel);
            pass_bits_free(&got);
        }
    direct_ops(lv, name);
    for (int i = 0; i < OPI_COUNT; i++)
        CHECK(g_calls[i] > 0, "%s: the entry %s never ran: compare it here (a pass that calls it, or direct_ops)",
              name, ds4_kernel_op_names[i]);
}

static void test_levels_match_generic(void) {
    const ds4_isa best = ds4_isa_best();
    ds4_isa built;
    CHECK(cpu_kernels_for(DS4_ISA_GENERIC, &built) == &ds4_cpu_kernels_generic && built == DS4_ISA_GENERIC,
          "the generic level runs the generic table");
    pass_bits refs[NCFG][2];
    for (int ci = 0; ci < NCFG; ci++)
        for (int bf16 = 0; bf16 < 2; bf16++) run_model(&ds4_cpu_kernels_generic, k_configs[ci], bf16, &refs[ci][bf16]);
    const ds4_kernel_backend *done = &ds4_cpu_kernels_generic;
    int compared = 0;
    for (int i = DS4_ISA_AVX2; i < DS4_ISA_COUNT; i++) {
        const ds4_kernel_backend *t = cpu_kernels_for((ds4_isa)i, &built);
        if (i > (int)best) {
            t_note("test_isa_levels: SKIP level %s: this CPU's best level is %s", ds4_isa_name((ds4_isa)i),
                   ds4_isa_name(best));
            continue;
        }
        if (t == done || t == &ds4_cpu_kernels_generic) {
            t_note("test_isa_levels: level %s runs the %s table (compared above or generic itself)",
                   ds4_isa_name((ds4_isa)i), ds4_isa_name(built));
            continue;
        }
        CHECK(t->rmsnorm_fwd != ds4_cpu_kernels_generic.rmsnorm_fwd && t->sparse_attn_bwd != ds4_cpu_kernels_generic.sparse_attn_bwd,
              "level %s: a table of its own code", ds4_isa_name(built));
        compare_level(t, built, refs);
        done = t;
        compared++;
    }
#ifdef DS4_CPU_LEVELS
    /* the build has the avx2 and avx512 tables: each one the CPU can run was compared */
    const int expect = best >= DS4_ISA_AVX512 ? 2 : best >= DS4_ISA_AVX2 ? 1 : 0;
#else
    const int expect = 0;
#endif
    CHECK(compared == expect, "%d level tables compared, expected %d", compared, expect);
    for (int ci = 0; ci < NCFG; ci++)
        for (int bf16 = 0; bf16 < 2; bf16++) pass_bits_free(&refs[ci][bf16]);
}

/* The dispatch runs the table of the level in use, and ds4_isa_select moves it with the GEMM engines. */
static void test_dispatch_picks_the_level(void) {
    const ds4_isa start = ds4_isa_current();
    ds4_isa built;
    for (int i = 0; i <= (int)ds4_isa_best(); i++) {
        CHECK(ds4_isa_select((ds4_isa)i) == DS4_OK, "%s", ds4_errmsg());
        const ds4_kernel_backend *want = cpu_kernels_for((ds4_isa)i, &built);
        CHECK(ds4_kernel_backend_cpu() == want && cpu_engines_active()->kernels_isa == built && built <= (ds4_isa)i,
              "level %s: the cpu backend is the %s table", ds4_isa_name((ds4_isa)i), ds4_isa_name(built));
        CHECK(ds4_exec_kernels(NULL) == want, "a context without backend runs the level's table");
        CHECK(ds4_kernel_backend_guard()->rmsnorm_fwd != NULL && ds4_kernel_backend_missing(want) == NULL,
              "the table is complete");
    }
    CHECK(ds4_isa_select(start) == DS4_OK, "%s", ds4_errmsg());
}

int main(void) {
    RUN(test_dispatch_picks_the_level);
    RUN(test_levels_match_generic);
    TEST_MAIN_END("test_isa_levels");
}
