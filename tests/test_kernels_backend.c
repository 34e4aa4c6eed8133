/* The kernel backend seam: the cpu table fills every entry, a plan context runs the plan table, and
 * each plan entry counts exactly the workspace its cpu kernel allocates (memplan's byte-for-byte
 * prediction rests on it) while touching no data. */
#include <stddef.h>
#include <stdint.h>

#include "ds4/core.h"
#include "kernels/kernels.h"
#include "test.h"

static const ds4_exec k_plan_ctx = {.plan = true}; /* the context of a plan step (memplan) */

/* A backend made by copying the cpu table and replacing one entry: what a context names runs. */
static int g_counted_norms;
static void counting_rmsnorm_fwd(const ds4_exec *ex, float *y, float *rstd, const float *x, const float *w, int64_t N,
                                 int64_t D, float eps) {
    g_counted_norms++;
    ds4_kernel_backend_cpu()->rmsnorm_fwd(ex, y, rstd, x, w, N, D, eps);
}

static void test_tables(void) {
    const ds4_kernel_backend *cpu = ds4_kernel_backend_cpu(), *plan = ds4_kernel_backend_plan();
    const char *missing = ds4_kernel_backend_missing(cpu);
    CHECK(missing == NULL, "the cpu backend lacks %s", missing);
    CHECK(!strcmp(cpu->name, "cpu") && !strcmp(plan->name, "plan"), "names %s, %s", cpu->name, plan->name);
    CHECK(ds4_kernel_backend_missing(plan) != NULL, "the plan backend computes nothing: it has NULL entries");
    CHECK(cpu->plan == plan && plan->plan == NULL, "the plan backend is the cpu backend's plan twin");
    /* the names and the table come from one list: one name per entry after the name and plan fields */
    const size_t entries = (sizeof(ds4_kernel_backend) - offsetof(ds4_kernel_backend, buf_alloc)) / sizeof(void (*)(void));
    CHECK((size_t)ds4_kernel_op_count == entries && !strcmp(ds4_kernel_op_names[0], "buf_alloc") &&
              !strcmp(ds4_kernel_op_names[ds4_kernel_op_count - 1], "newton_schulz"),
          "%d ops listed for %zu entries, first %s", ds4_kernel_op_count, entries, ds4_kernel_op_names[0]);
    CHECK(ds4_exec_kernels(NULL) == cpu && ds4_exec_kernels(CPU_EXEC) == cpu, "no backend named: the cpu runs");
    CHECK(ds4_exec_kernels(&k_plan_ctx) == plan, "a plan context runs the plan of its backend");
    /* the context alone picks: no process-wide backend */
    ds4_kernel_backend custom = *cpu;
    custom.name = "custom";
    custom.rmsnorm_fwd = counting_rmsnorm_fwd;
    const ds4_exec on_custom = {.backend = &custom}, plan_custom = {.plan = true, .backend = &custom};
    CHECK(ds4_exec_kernels(&on_custom) == &custom && ds4_exec_kernels(&plan_custom) == plan,
          "a context's backend runs it, and its plan twin plans it");
    CHECK(ds4_kernel_backend_missing(&custom) == NULL, "a copy of the cpu table is complete");
    custom.swiglu_bwd = NULL;
    CHECK(ds4_kernel_backend_missing(&custom) && !strcmp(ds4_kernel_backend_missing(&custom), "swiglu_bwd"),
          "a NULL entry is named");
    float x[2 * 4] = {1, 2, 3, 4, 5, 6, 7, 8}, y[8], rstd[2], y2[8], rstd2[2];
    rmsnorm_fwd(&on_custom, y, rstd, x, NULL, 2, 4, 1e-6f);
    rmsnorm_fwd(CPU_EXEC, y2, rstd2, x, NULL, 2, 4, 1e-6f);
    CHECK(g_counted_norms == 1 && !memcmp(y, y2, sizeof y) && !memcmp(rstd, rstd2, sizeof rstd),
          "the wrapper ran the context's entry once (%d) with the cpu's result", g_counted_norms);
}

/* Workspace of one call: peak bytes of DS4_MEM_WORK above what was live, and allocations made. */
typedef struct {
    int64_t peak, allocs, left;
} ws_use;

static ws_use measure_begin(void) {
    ds4_mem_reset_peak();
    ds4_mem_stats s;
    ds4_mem_get(&s);
    return (ws_use){s.live[DS4_MEM_WORK], s.n_allocs, s.live[DS4_MEM_WORK]};
}

static ws_use measure_end(ws_use b) {
    ds4_mem_stats s;
    ds4_mem_get(&s);
    return (ws_use){s.peak[DS4_MEM_WORK] - b.peak, s.n_allocs - b.allocs, s.live[DS4_MEM_WORK] - b.left};
}

/* Runs fn(ctx) for real, then in a plan context (the allocator's too), and compares the workspace both used. */
static void check_same_workspace(const char *what, void (*fn)(const ds4_exec *, void *), void *ctx, bool expect_some) {
    ws_use b = measure_begin();
    fn(CPU_EXEC, ctx);
    ws_use real = measure_end(b);
    b = measure_begin();
    fn(&k_plan_ctx, ctx);
    ws_use plan = measure_end(b);
    CHECK(real.peak == plan.peak && real.allocs == plan.allocs,
          "%s: real %lld bytes in %lld allocations, plan %lld in %lld", what, (long long)real.peak,
          (long long)real.allocs, (long long)plan.peak, (long long)plan.allocs);
    CHECK(real.left == 0 && plan.left == 0, "%s: workspace left behind", what);
    CHECK(!expect_some || real.peak > 0, "%s: no workspace to compare", what);
}

enum { B = 2, T = 48, H = 4, C = 32, NC = 12, KSEL = 4, HI = 4, DI = 16, GM = 128, GN = 128, GK = 96 };

typedef struct {
    float q[B * T * H * C], kv[B * T * C], kvc[B * NC * C], sink[H], o[B * T * H * C], lse[B * T * H];
    float dq[B * T * H * C], dkv[B * T * C], dkvc[B * NC * C], dsink[H];
    float qi[B * T * HI * DI], ki[B * NC * DI], w[B * T * HI], dqi[B * T * HI * DI], dki[B * NC * DI], dw[B * T * HI];
    int32_t topk[B * T * KSEL];
    float a[GM * GK], bm[GK * GN], cm[GM * GN], da[GM * GK], dbm[GK * GN];
} tensors;

static sparse_attn_args attn_args(tensors *x) {
    return (sparse_attn_args){.dims = {.B = B, .T = T, .H = H, .c = C, .window = 8, .ratio = 4, .Nc = NC, .K = KSEL},
                              .scale = 0.2f, .q = x->q, .kv = x->kv, .kvc = x->kvc, .sink = x->sink,
                              .topk = x->topk, .o = x->o, .lse = x->lse};
}

static void run_attn_fwd(const ds4_exec *ex, void *p) {
    sparse_attn_args a = attn_args(p);
    sparse_attn_fwd(ex, &a);
}

static void run_attn_bwd(const ds4_exec *ex, void *p) {
    tensors *x = p;
    sparse_attn_args a = attn_args(x);
    sparse_attn_bwd(ex, &a, &(sparse_attn_grads){.dout = x->q, .dq = x->dq, .dkv = x->dkv, .dkvc = x->dkvc,
                                             .dsink = x->dsink});
}

static void run_topk(const ds4_exec *ex, void *p) {
    tensors *x = p;
    indexer_topk_fwd(ex, &(indexer_topk_args){.dims = {.B = B, .T = T, .HI = HI, .dI = DI, .Nc = NC, .ratio = 4,
                                                   .K = KSEL},
                                          .wscale = 0.5f, .qi = x->qi, .ki = x->ki, .w = x->w, .topk = x->topk});
}

static void run_kl(const ds4_exec *ex, void *p) {
    tensors *x = p;
    double kl = -1;
    int64_t rows = -1;
    indexer_kl_fwd_bwd(ex, &(indexer_kl_args){
        .dims = {.B = B, .T = T, .HI = HI, .dI = DI, .Nc = NC, .ratio = 4, .K = KSEL}, .H = H, .c = C,
        .scale = 0.2f, .wscale = 0.5f, .grad_scale = 1.0f, .qi = x->qi, .ki = x->ki, .w = x->w, .q = x->q,
        .kvc = x->kvc, .lse = x->lse, .topk = x->topk, .dqi = x->dqi, .dki = x->dki, .dw = x->dw, .kl_sum = &kl,
        .n_rows = &rows});
    CHECK(rows >= 0 && kl >= 0, "the KL loss writes its sums in both modes (%lld rows, %g)", (long long)rows, kl);
}

static void run_gemms(const ds4_exec *ex, void *p) {
    tensors *x = p;
    gemm_nt(ex, GM, GN, GK, x->a, GK, x->bm, GK, x->cm, GN, 0); /* bm as [GN, GK] */
    gemm_nn(ex, GM, GN, GK, x->a, GK, x->bm, GN, x->cm, GN, 1); /* bm as [GK, GN] */
    gemm_tn(ex, GK, GN, GM, x->cm, GK, x->bm, GN, x->da, GN, 0); /* cm as [GM, GK], bm as [GM, GN]: GM·GK <= GM·GN */
    linear_fwd(ex, x->cm, x->a, x->bm, GM, GK, GN);              /* cm [GM, GN] = a [GM, GK] · bm [GN, GK]^T */
    linear_bwd(ex, x->da, x->dbm, x->cm, x->a, x->bm, GM, GK, GN);
}

static void test_plan_counts_the_cpu_workspace(void) {
    tensors *x = calloc(1, sizeof *x);
    t_fill(x->q, B * T * H * C, 1, 1.0f);
    t_fill(x->kv, B * T * C, 2, 1.0f);
    t_fill(x->kvc, B * NC * C, 3, 1.0f);
    t_fill(x->qi, B * T * HI * DI, 4, 1.0f);
    t_fill(x->ki, B * NC * DI, 5, 1.0f);
    t_fill(x->w, B * T * HI, 6, 1.0f);
    t_fill(x->a, GM * GK, 7, 1.0f);
    t_fill(x->bm, GK * GN, 8, 1.0f);
    for (int t = 0; t < 2; t++) { /* one thread, then the team: the workspace depends on the thread count */
        ds4_set_threads(t == 0 ? 1 : 4);
        check_same_workspace("indexer top-k", run_topk, x, true);
        check_same_workspace("sparse attention forward", run_attn_fwd, x, true);
        check_same_workspace("sparse attention backward", run_attn_bwd, x, true);
        check_same_workspace("indexer KL", run_kl, x, true);
        /* the GEMM engine's packing buffers; the reference GEMMs (no engine) allocate none */
        check_same_workspace("gemm and linear", run_gemms, x, ds4_isa_current() != DS4_ISA_GENERIC);
    }
    free(x);
}

/* The plan entries never read or write a tensor: every data pointer NULL, no crash, no output. */
static void test_plan_touches_no_data(void) {
    double kl = -1;
    int64_t rows = -1;
    sparse_attn_args a = {.dims = {.B = B, .T = T, .H = H, .c = C, .window = 8, .ratio = 4, .Nc = NC, .K = KSEL}};
    sparse_attn_fwd(&k_plan_ctx, &a);
    sparse_attn_bwd(&k_plan_ctx, &a, &(sparse_attn_grads){0});
    indexer_kl_fwd_bwd(&k_plan_ctx, &(indexer_kl_args){.dims = {.B = B, .T = T, .HI = HI, .dI = DI, .Nc = NC, .ratio = 4},
                                          .H = H, .c = C, .kl_sum = &kl, .n_rows = &rows});
    hc_pre_fwd(&k_plan_ctx, &(hc_pre_args){.dims = {.N = 8, .n = 4, .D = 16, .iters = 3}});
    moe_gate_fwd(&k_plan_ctx, &(moe_gate_args){.dims = {.N = 8, .E = 16, .K = 2}});
    rmsnorm_fwd(&k_plan_ctx, NULL, NULL, NULL, NULL, 8, 16, 1e-6f);
    cross_entropy_fwd_bwd(&k_plan_ctx, NULL, NULL, NULL, NULL, NULL, 8, 16, 1.0f);
    gemm_nt(&k_plan_ctx, GM, GN, GK, NULL, GK, NULL, GK, NULL, GN, 0);
    tensor_copy(&k_plan_ctx, NULL, NULL, 64); /* the model's copies and fills are ops too: skipped in a plan */
    tensor_zero(&k_plan_ctx, NULL, 64);
    shift_ids(&k_plan_ctx, NULL, NULL, 2, 8, 1, 0);
    streams_expand(&k_plan_ctx, NULL, 8, 4, 16);
    streams_add(&k_plan_ctx, NULL, NULL, 8, 4, 16);
    streams_sum(&k_plan_ctx, NULL, NULL, 8, 4, 16);
    moe_group_by_expert(&k_plan_ctx, NULL, NULL, NULL, NULL, 8, 16, 2); /* routing is data: skipped too */
    moe_experts_fwd(&k_plan_ctx, &(moe_experts_args){.nexp = 16, .D = 16, .I = 8}, NULL);
    rows_scatter_add(&k_plan_ctx, NULL, NULL, NULL, 8, 16);
    tensor_add(&k_plan_ctx, NULL, NULL, 64);
    CHECK(kl == 0 && rows == 0, "the plan KL loss writes 0 rows and loss 0, as the kernel does before computing");
}

/* MoE routing: grouped by expert with tokens ascending; a plan counts balanced routing's rows. */
static void test_routing_ops(void) {
    const int32_t idx[3 * 2] = {2, 0, 0, 3, 2, 3}; /* N = 3 tokens, K = 2 slots, E = 4 experts */
    int64_t eoff[5], cnt[4];
    int32_t etok[6], eslot[6];
    moe_group_by_expert(CPU_EXEC, eoff, etok, eslot, idx, 3, 4, 2);
    const int64_t want_off[5] = {0, 2, 2, 4, 6};
    const int32_t want_tok[6] = {0, 1, 0, 2, 1, 2}, want_slot[6] = {1, 0, 0, 0, 1, 1};
    CHECK(!memcmp(eoff, want_off, sizeof eoff), "offsets %lld %lld %lld %lld %lld", (long long)eoff[0],
          (long long)eoff[1], (long long)eoff[2], (long long)eoff[3], (long long)eoff[4]);
    CHECK(!memcmp(etok, want_tok, sizeof etok) && !memcmp(eslot, want_slot, sizeof eslot), "assignments");
    moe_expert_counts(CPU_EXEC, cnt, eoff, 4, 6);
    CHECK(cnt[0] == 2 && cnt[1] == 0 && cnt[2] == 2 && cnt[3] == 2, "counts of the routing");
    moe_expert_counts(&k_plan_ctx, cnt, NULL, 4, 10);
    CHECK(cnt[0] == 3 && cnt[1] == 3 && cnt[2] == 2 && cnt[3] == 2, "a plan's counts are balanced routing's");
    CHECK(indexer_kl_rows(CPU_EXEC, 2, 8, 4) == 10 && indexer_kl_rows(CPU_EXEC, 2, 3, 4) == 0, "KL rows: those that see an entry");
}

int main(void) {
    RUN(test_tables);
    RUN(test_plan_counts_the_cpu_workspace);
    RUN(test_plan_touches_no_data);
    RUN(test_routing_ops);
    TEST_MAIN_END("test_kernels_backend");
}
