/* The kernel profile (ds4/profile.h): off, nothing is counted; on, a training step of a model with every
 * attention kind, the indexer and its KL, routed experts and MTP lists the ops it ran with their calls, its
 * ops' times add up to no more than the step's wall time, and the step's losses, gradients and updated
 * weights are the bits of the same step unprofiled. FLOP estimates of a GEMM, a linear layer and the
 * sparse attention against their definitions; a plan's calls are not counted. */
#include <stdlib.h>

#include "ds4/profile.h"
#include "ds4/trainer.h"
#include "kernels/kernels.h"
#include "test.h"

#define CONFIG "tests/configs/tiny-a.json"
#define B_ROWS 2
#define T_SEQ 64

typedef struct {
    double loss, mtp_loss, indexer_loss, grad_norm, wall;
    float *params, *grads;
    int64_t numel;
} step_out;

/* One training step of a fresh state (seed 7), profiled (only the step: from a reset) when `profile`;
 * false if any part failed. */
static bool run_step(const ds4_config *c, bool profile, step_out *out) {
    memset(out, 0, sizeof *out);
    ds4_train_state *s;
    const ds4_train_state_opts so = {.ep = 1};
    if (ds4_train_state_open(c, NULL, 7, ds4_comm_self(), &so, &s) != DS4_OK) return false;
    int32_t ids[B_ROWS * T_SEQ];
    for (int64_t i = 0; i < B_ROWS * T_SEQ; i++) ids[i] = (int32_t)(ds4_rng_u64(41, 0, (uint64_t)i) % (uint64_t)c->vocab_size);
    int64_t *loads = calloc((size_t)((c->n_layers + c->n_mtp_layers) * c->n_routed_experts), sizeof(int64_t));
    const ds4_adamw_cfg ac = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    const ds4_step_args a = {.step = 1, .micro_batches = 1, .B = B_ROWS, .T = T_SEQ, .ids = ids, .loads = loads,
                             .adamw = &ac, .lr = 1e-3, .max_norm = 0.5, .router_bias_gamma = 1e-3};
    ds4_step_result r;
    ds4_profile_reset();
    ds4_profile_enable(profile);
    const double t0 = ds4_now();
    const bool ok = loads && ds4_train_step(s, &a, &r) == DS4_OK;
    out->wall = ds4_now() - t0;
    ds4_profile_enable(false);
    if (ok) {
        ds4_model *m = ds4_train_state_model(s);
        out->loss = r.loss, out->mtp_loss = r.mtp_loss, out->indexer_loss = r.indexer_loss, out->grad_norm = r.grad_norm;
        out->numel = ds4_model_numel(m);
        out->params = malloc((size_t)out->numel * sizeof(float));
        out->grads = malloc((size_t)out->numel * sizeof(float));
        memcpy(out->params, ds4_model_params_flat(m), (size_t)out->numel * sizeof(float));
        memcpy(out->grads, ds4_model_grads_flat(m), (size_t)out->numel * sizeof(float));
    }
    free(loads);
    ds4_train_state_free(s);
    return ok;
}

static ds4_profile_op op_named(const char *name) {
    for (int i = 0; i < ds4_profile_op_count(); i++)
        if (!strcmp(ds4_profile_get(i).name, name)) return ds4_profile_get(i);
    return (ds4_profile_op){.name = NULL};
}

static void test_step_profile(void) {
    ds4_config c;
    CHECK(ds4_config_load(CONFIG, &c) == DS4_OK, "%s", ds4_errmsg());
    step_out off, on;
    CHECK(run_step(&c, false, &off), "%s", ds4_errmsg());
    int64_t counted = 0;
    for (int i = 0; i < ds4_profile_op_count(); i++) counted += ds4_profile_get(i).calls;
    CHECK(counted == 0, "profile off: %lld calls counted", (long long)counted);

    CHECK(run_step(&c, true, &on), "%s", ds4_errmsg());
    const char *ran[] = {"linear_fwd", "linear_bwd", "grouped_linear_fwd", "grouped_linear_bwd", "rmsnorm_fwd",
                         "rmsnorm_bwd", "rope_fwd", "hc_pre_fwd", "hc_post_bwd", "compressor_pool_fwd",
                         "sparse_attn_fwd", "sparse_attn_bwd", "indexer_topk_fwd", "indexer_kl_fwd_bwd",
                         "moe_gate_fwd", "moe_experts_fwd", "moe_experts_bwd", "cross_entropy_fwd_bwd",
                         "embedding_fwd"};
    for (size_t i = 0; i < sizeof ran / sizeof ran[0]; i++) {
        const ds4_profile_op o = op_named(ran[i]);
        CHECK(o.name && o.calls > 0 && o.seconds > 0, "%s: %lld calls, %g s", ran[i], (long long)o.calls, o.seconds);
    }
    const char *gemm_like[] = {"linear_fwd", "linear_bwd", "sparse_attn_fwd", "sparse_attn_bwd", "indexer_topk_fwd",
                               "indexer_kl_fwd_bwd", "moe_experts_fwd", "moe_experts_bwd"};
    for (size_t i = 0; i < sizeof gemm_like / sizeof gemm_like[0]; i++)
        CHECK(op_named(gemm_like[i]).flops > 0, "%s: no FLOPs estimated", gemm_like[i]);
    double sum = 0;
    for (int i = 0; i < ds4_profile_op_count(); i++) sum += ds4_profile_get(i).seconds;
    CHECK(sum > 0 && sum <= on.wall, "ops %g s vs step wall %g s", sum, on.wall);

    CHECK(on.loss == off.loss && on.mtp_loss == off.mtp_loss && on.indexer_loss == off.indexer_loss &&
              on.grad_norm == off.grad_norm,
          "profiled step: losses %.17g %.17g %.17g norm %.17g vs %.17g %.17g %.17g %.17g", on.loss, on.mtp_loss,
          on.indexer_loss, on.grad_norm, off.loss, off.mtp_loss, off.indexer_loss, off.grad_norm);
    CHECK(on.numel == off.numel && on.params && off.params &&
              !memcmp(on.params, off.params, (size_t)on.numel * sizeof(float)) &&
              !memcmp(on.grads, off.grads, (size_t)on.numel * sizeof(float)),
          "profiled step: updated weights or gradients differ");

    /* the table names the ops that ran and the step */
    FILE *f = tmpfile();
    CHECK(f != NULL, "tmpfile");
    if (f) {
        ds4_profile_print(f, on.wall, 1);
        char buf[16384];
        rewind(f);
        const size_t n = fread(buf, 1, sizeof buf - 1, f);
        buf[n] = 0;
        fclose(f);
        CHECK(strstr(buf, "| sparse_attn_bwd |") && strstr(buf, "| linear_fwd |") && strstr(buf, "step (wall)"),
              "table:\n%s", buf);
        CHECK(!strstr(buf, "| copy_to_host |") || op_named("copy_to_host").calls > 0, "an op that did not run is listed");
    }
    free(on.params), free(on.grads), free(off.params), free(off.grads);
}

/* FLOPs against the definitions; a plan's calls are not counted. */
static void test_flops_and_plan(void) {
    enum { N = 3, IC = 5, OC = 7 };
    float x[N * IC], w[OC * IC], y[N * OC];
    t_fill(x, N * IC, 1, 1.0f), t_fill(w, OC * IC, 2, 1.0f);
    ds4_profile_reset();
    ds4_profile_enable(true);
    linear_fwd(CPU_EXEC, y, x, w, N, IC, OC);
    gemm_nt(CPU_EXEC, N, OC, IC, x, IC, w, IC, y, OC, 0.0f);
    const ds4_exec plan = {.plan = true};
    linear_fwd(&plan, y, x, w, N, IC, OC);
    ds4_profile_enable(false);
    linear_fwd(CPU_EXEC, y, x, w, N, IC, OC); /* off again: not counted */
    const ds4_profile_op lin = op_named("linear_fwd"), g = op_named("gemm_nt");
    CHECK(lin.calls == 1 && lin.flops == 2.0 * N * IC * OC, "linear_fwd: %lld calls, %g FLOPs (want 1, %d)",
          (long long)lin.calls, lin.flops, 2 * N * IC * OC);
    CHECK(g.calls == 1 && g.flops == 2.0 * N * IC * OC, "gemm_nt: %lld calls, %g FLOPs", (long long)g.calls, g.flops);

    /* sparse attention, T = 10, window 4, ratio 3, no top-k: query t reads min(t+1, 4) window keys and
     * floor((t+1)/3) compressed ones: 34 + 15 = 49 keys; 4·c FLOPs per key and head forward. */
    enum { B = 1, T = 10, H = 2, C = 8, W = 4, R = 3, NC = T / R };
    float q[B * T * H * C], kv[B * T * C], kvc[B * NC * C], sink[H], o[B * T * H * C], lse[B * T * H];
    t_fill(q, B * T * H * C, 3, 1.0f), t_fill(kv, B * T * C, 4, 1.0f), t_fill(kvc, B * NC * C, 5, 1.0f);
    t_fill(sink, H, 6, 1.0f);
    const sparse_attn_args a = {.dims = {.B = B, .T = T, .H = H, .c = C, .window = W, .ratio = R, .Nc = NC, .K = 0},
                                .scale = 0.3f, .q = q, .kv = kv, .kvc = kvc, .sink = sink, .o = o, .lse = lse};
    ds4_profile_reset();
    ds4_profile_enable(true);
    sparse_attn_fwd(CPU_EXEC, &a);
    ds4_profile_enable(false);
    const ds4_profile_op sa = op_named("sparse_attn_fwd");
    CHECK(sa.calls == 1 && sa.flops == 4.0 * C * B * H * 49, "sparse_attn_fwd: %g FLOPs, want %g", sa.flops,
          4.0 * C * B * H * 49);
}

int main(void) {
    ds4_set_threads(1);
    RUN(test_step_profile);
    RUN(test_flops_and_plan);
    TEST_MAIN_END("test_profile");
}
