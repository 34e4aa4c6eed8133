/* The whole model on the "cuda" backend (src/kernels/cuda/backend.cu): the model made in a context that
 * names it keeps its parameters, gradients and activations in device memory, and a pass (forward,
 * backward; with recompute too) runs every op there. Checked against the same model on the cpu:
 *  - determinism, exactly: two passes on the GPU, and a pass with csa+mhc-style recompute, give the same
 *    bits (losses, logits, gradients);
 *  - agreement with the cpu: the GPU's GEMMs and reductions sum in other orders than the cpu's, each op
 *    within the bound its own test derives (test_cuda_basic, _attn, _hc); through the whole model those
 *    differences stay at the level of fp32 rounding, relative 1e-4 on the losses and 1e-3 (L2) on the
 *    logits and gradients, where one wrong op moves them by order 1. The values are printed. */
#include "cuda_check.h"

#include "ds4/model.h"
#include "../test_store.h"

static const char *const CONFIG = "tests/configs/tiny-a.json";
enum { B_ROWS = 2, T_SEQ = 64 };

typedef struct {
    ds4_losses losses;
    float *logits, *grads; /* host copies */
} pass_out;

/* One forward + backward of m on the fixed batch (bf16: mixed precision's activations); results copied to
 * the host. */
static bool run_pass(ds4_model *m, bool recompute, bool bf16, pass_out *out) {
    const ds4_config *c = ds4_model_config(m);
    const int64_t N = B_ROWS * T_SEQ, V = c->vocab_size, n = ds4_model_numel(m);
    int32_t ids[B_ROWS * T_SEQ];
    for (int64_t i = 0; i < N; i++) ids[i] = (int32_t)((i * 7 + 3) % V);
    ds4_pass_opts o = {};
    o.need_backward = true;
    o.keep_logits = true;
    o.bf16_acts = bf16;
    if (recompute) o.store.ops = &test_recompute_store;
    ds4_model_zero_grad(m);
    ds4_pass *p = NULL;
    bool ok = ds4_forward(m, ids, B_ROWS, T_SEQ, &o, &p) == DS4_OK;
    out->logits = (float *)malloc((size_t)(N * V) * sizeof(float));
    out->grads = (float *)malloc((size_t)n * sizeof(float));
    if (ok) ds4_model_to_host(m, out->logits, ds4_pass_logits(p), (size_t)(N * V) * sizeof(float));
    ok = ok && ds4_backward(m, p) == DS4_OK;
    if (ok) {
        out->losses = *ds4_pass_losses(p);
        ds4_model_to_host(m, out->grads, ds4_model_grads_flat(m), (size_t)n * sizeof(float));
    }
    ds4_pass_free(p);
    return ok;
}

static void pass_free(pass_out *o) {
    free(o->logits);
    free(o->grads);
}

/* ‖a − b‖ / ‖b‖ over n floats. */
static double rel_l2(const float *a, const float *b, int64_t n) {
    double d = 0, r = 0;
    for (int64_t i = 0; i < n; i++) {
        d += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        r += (double)b[i] * b[i];
    }
    return r > 0 ? sqrt(d / r) : sqrt(d);
}

/* The model in fp32, or in bf16 mixed precision (the bf16 compute copy of the weights, bf16 GEMMs and
 * activations): on the GPU deterministic and recompute-exact; against the cpu within fp32 rounding (fp32),
 * or within bf16 rounding (bf16: a sum that lands on the other side of a bf16 rounding boundary moves that
 * element by 2^-8 relative, so the bound is 1e-2 on the losses and 5e-2 on logits and gradients). */
static void model_on_cuda(bool bf16) {
    const ds4_kernel_backend *gpu = ds4_kernel_backend_cuda();
    CHECK(ds4_kernel_backend_missing(gpu) == NULL, "the cuda table lacks %s", ds4_kernel_backend_missing(gpu));
    const ds4_kernel_backend *found = NULL;
    CHECK(ds4_backend_find("--device", "cuda", &found) == DS4_OK && found == gpu, "the registry finds it: %s",
          ds4_errmsg());
    ds4_config c;
    CHECK(ds4_config_load(CONFIG, &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_exec on_cpu = {}, on_gpu = {};
    on_gpu.backend = gpu;
    on_cpu.matmul_precision = on_gpu.matmul_precision = bf16 ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32;
    ds4_model *mc = NULL, *mg = NULL;
    ds4_status (*create)(const ds4_exec *, const ds4_config *, bool, ds4_model **) =
        bf16 ? ds4_model_create_bf16 : ds4_model_create;
    CHECK(create(&on_cpu, &c, false, &mc) == DS4_OK && create(&on_gpu, &c, false, &mg) == DS4_OK, "%s", ds4_errmsg());
    if (!mc || !mg) return;
    ds4_model_init_random(mc, 11);
    ds4_model_refresh_bf16(mc);
    const int64_t n = ds4_model_numel(mc), nl = (int64_t)B_ROWS * T_SEQ * c.vocab_size;
    ds4_model_to_device(mg, ds4_model_params_flat(mg), ds4_model_params_flat(mc), (size_t)n * sizeof(float));
    for (int64_t i = 0; i < ds4_model_nparams(mc); i++) {
        const ds4_param *pc = ds4_model_param(mc, i), *pg = ds4_model_param(mg, i);
        if (pc->is_int) ds4_model_to_device(mg, pg->idata, pc->idata, (size_t)pc->numel * sizeof(int64_t));
    }
    ds4_model_refresh_bf16(mg); /* the GPU rounds its own copy of the weights */
    pass_out cpu = {}, g1 = {}, g2 = {}, gr = {};
    CHECK(run_pass(mc, false, bf16, &cpu), "cpu pass: %s", ds4_errmsg());
    CHECK(run_pass(mg, false, bf16, &g1) && ds4_cuda_backend_status() == DS4_OK, "gpu pass: %s", ds4_errmsg());
    CHECK(run_pass(mg, false, bf16, &g2) && ds4_cuda_backend_status() == DS4_OK, "gpu pass again: %s", ds4_errmsg());
    CHECK(run_pass(mg, true, bf16, &gr) && ds4_cuda_backend_status() == DS4_OK, "gpu pass with recompute: %s",
          ds4_errmsg());
    /* exact: the GPU against itself */
    CHECK(!memcmp(&g1.losses, &g2.losses, sizeof g1.losses) && !memcmp(g1.logits, g2.logits, (size_t)nl * 4) &&
              !memcmp(g1.grads, g2.grads, (size_t)n * 4),
          "two gpu passes differ");
    CHECK(!memcmp(&g1.losses, &gr.losses, sizeof g1.losses) && !memcmp(g1.logits, gr.logits, (size_t)nl * 4) &&
              !memcmp(g1.grads, gr.grads, (size_t)n * 4),
          "recompute changed the gpu's bits");
    /* the cpu's values within fp32 rounding through the model */
    const ds4_losses *a = &g1.losses, *b = &cpu.losses;
    const double dl = fabs(a->loss - b->loss) / b->loss, dm = fabs(a->mtp_loss - b->mtp_loss) / b->mtp_loss,
                 di = fabs(a->indexer_loss - b->indexer_loss) / (b->indexer_loss > 0 ? b->indexer_loss : 1);
    const double el = rel_l2(g1.logits, cpu.logits, nl), eg = rel_l2(g1.grads, cpu.grads, n);
    t_note("  %s gpu vs cpu: loss %.9g vs %.9g (rel %.2e), mtp rel %.2e, indexer %.9g vs %.9g (rel %.2e); logits rel L2 "
           "%.2e, gradients rel L2 %.2e",
           bf16 ? "bf16" : "fp32", a->loss, b->loss, dl, dm, a->indexer_loss, b->indexer_loss, di, el, eg);
    const double tl = bf16 ? 1e-2 : 1e-4, tv = bf16 ? 5e-2 : 1e-3;
    CHECK(dl < tl && dm < tl && di < tl, "losses: rel %.3g %.3g %.3g", dl, dm, di);
    CHECK(el < tv && eg < tv, "logits rel L2 %.3g, gradients rel L2 %.3g", el, eg);
    CHECK(b->indexer_loss > 0 && a->indexer_loss > 0, "the indexer loss is computed on both");
    /* what a second process must reproduce (scripts/gpu-check.sh reruns the binary and compares) */
    cc_hash_bytes(&g1.losses, sizeof g1.losses);
    cc_hash_bytes(g1.logits, (size_t)nl * 4);
    cc_hash_bytes(g1.grads, (size_t)n * 4);
    pass_free(&cpu), pass_free(&g1), pass_free(&g2), pass_free(&gr);
    ds4_model_free(mc);
    ds4_model_free(mg);
    ds4_cuda_backend_release();
    CHECK(ds4_cuda_backend_status() == DS4_OK, "%s", ds4_errmsg());
}

static void test_model_fp32(void) { model_on_cuda(false); }
static void test_model_bf16(void) { model_on_cuda(true); }

int main(void) {
    CUDA_TEST_BEGIN("test_cuda_model");
    RUN(test_model_fp32);
    RUN(test_model_bf16);
    CUDA_TEST_END("test_cuda_model");
}
