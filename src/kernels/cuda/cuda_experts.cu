/* Routed SwiGLU experts on rows grouped by expert (kernels.h moe_experts_fwd/bwd), one expert at a time
 * on the CUDA linear and SwiGLU launchers, the steps of cpu/experts.c in the same order.
 *
 * The expert offsets a->off are read ON THE HOST: each expert's GEMMs need its row count to be launched.
 * This is the one place the routing's counts reach the host in an MoE layer; the caller copies eoff
 * (cuda_moe_group_by_expert's, on the device) to the host once per layer before calling. */
#include "kernels/cuda/cuda_common.cuh"

/* out [ne, I] = in [ne, I] · w[i] per row (out may be in) */
static __global__ void rows_scale_kernel(float *out, const float *in, const float *w, int64_t ne, int64_t I) {
    CUDA_GRID_STRIDE(q, ne * I) out[q] = in[q] * w[q / I];
}
static ds4_status rows_scale(cudaStream_t s, float *out, const float *in, const float *w, int64_t ne, int64_t I) {
    rows_scale_kernel<<<cuda_blocks(ne * I, 256), 256, 0, s>>>(out, in, w, ne, I);
    CUDA_LAUNCHED("moe_experts row scale");
    return DS4_OK;
}

/* dw [i] = ⟨dact[i], act[i]⟩ in double, a block per row (fixed tree order), rounded once. */
static __global__ void row_dot_kernel(float *dw, const float *dact, const float *act, int64_t I) {
    const int64_t i = blockIdx.x;
    double s = 0;
    for (int64_t k = threadIdx.x; k < I; k += blockDim.x) s += (double)dact[i * I + k] * act[i * I + k];
    s = cuda_block_sum(s);
    if (threadIdx.x == 0) dw[i] = (float)s;
}

/* Where the experts' weights are read: fp32, or their bf16 compute copy (hcopy + (w − wbase)). */
typedef struct {
    cuda_blas *b;
    cudaStream_t s;
    ds4_matmul_precision p;
    const float *wbase;
    const uint16_t *hcopy;
} expert_ctx;

static ds4_status lin_fwd(const expert_ctx *c, float *out, const float *inp, const float *w, int64_t N, int64_t IC,
                          int64_t OC) {
    if (c->hcopy) return cuda_linear_fwd_bf16w(c->b, c->s, out, inp, c->hcopy + (w - c->wbase), N, IC, OC);
    return cuda_linear_fwd(c->b, c->s, c->p, out, inp, w, N, IC, OC);
}
static ds4_status lin_bwd(const expert_ctx *c, float *dinp, float *dw, const float *dout, const float *inp,
                          const float *w, int64_t N, int64_t IC, int64_t OC) {
    if (c->hcopy)
        return cuda_linear_bwd_bf16w(c->b, c->s, c->p, dinp, dw, dout, inp, c->hcopy + (w - c->wbase), N, IC, OC);
    return cuda_linear_bwd(c->b, c->s, c->p, dinp, dw, dout, inp, w, N, IC, OC);
}

static ds4_status check_off(const moe_experts_args *a, const char *op) {
    CUDA_ARG(a->nexp >= 0 && a->D >= 1 && a->I >= 1 && (a->nexp == 0 || a->off), "moe_experts", "%s: nexp %lld D %lld I %lld",
             op, (long long)a->nexp, (long long)a->D, (long long)a->I);
    for (int64_t e = 0; e < a->nexp; e++)
        CUDA_ARG(a->off[e] >= 0 && a->off[e + 1] >= a->off[e], "moe_experts", "%s: host offsets not ascending at expert %lld (%lld, %lld)",
                 op, (long long)e, (long long)a->off[e], (long long)a->off[e + 1]);
    return DS4_OK;
}

/* Expert e on its ne rows: h1 = w1 x, h3 = w3 x, act = swiglu(h1, h3) · rw, y = w2 act. */
ds4_status cuda_moe_experts_fwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, const moe_experts_args *a,
                                float *y) {
    DS4_TRY(check_off(a, "moe_experts_fwd"));
    const expert_ctx c = {b, s, p, a->wbase, a->hcopy};
    const int64_t D = a->D, I = a->I;
    for (int64_t e = 0; e < a->nexp; e++) {
        const int64_t o = a->off[e], ne = a->off[e + 1] - o;
        if (ne == 0) continue;
        const moe_expert_w *w = &a->w[e];
        float *h1 = a->h1 + o * I, *h3 = a->h3 + o * I;
        DS4_TRY(lin_fwd(&c, h1, a->x + o * D, w->w1, ne, D, I));
        DS4_TRY(lin_fwd(&c, h3, a->x + o * D, w->w3, ne, D, I));
        DS4_TRY(cuda_swiglu_fwd(s, a->act, h1, h3, ne, I, a->limit));
        DS4_TRY(rows_scale(s, a->act, a->act, a->rw + o, ne, I)); /* routing weight before w2 */
        DS4_TRY(lin_fwd(&c, y + o * D, a->act, w->w2, ne, I, D));
    }
    return DS4_OK;
}

/* Backward of expert e (cpu/experts.c's steps): dx [ne, D] and dw [ne] overwritten, weight gradients
 * accumulated into g->g[e]. */
ds4_status cuda_moe_experts_bwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, const moe_experts_args *a,
                                const moe_experts_grads *g) {
    DS4_TRY(check_off(a, "moe_experts_bwd"));
    const expert_ctx c = {b, s, p, a->wbase, a->hcopy};
    const int64_t D = a->D, I = a->I;
    for (int64_t e = 0; e < a->nexp; e++) {
        const int64_t o = a->off[e], ne = a->off[e + 1] - o;
        if (ne == 0) continue;
        CUDA_ARG(ne <= INT32_MAX, "moe_experts_bwd", "expert %lld has %lld rows", (long long)e, (long long)ne);
        const moe_expert_w *w = &a->w[e];
        moe_expert_w *eg = &g->g[e];
        const float *h1 = a->h1 + o * I, *h3 = a->h3 + o * I, *x = a->x + o * D, *rw = a->rw + o;
        const size_t bytes = (size_t)(ne * I) * sizeof(float);
        DS4_TRY(cuda_swiglu_fwd(s, a->act, h1, h3, ne, I, a->limit)); /* unweighted activation */
        float *wact = g->dh1;                                          /* scratch: what fed w2 */
        DS4_TRY(rows_scale(s, wact, a->act, rw, ne, I));
        DS4_TRY(cuda_fill(s, g->dact, 0, bytes));
        DS4_TRY(lin_bwd(&c, g->dact, eg->w2, g->dy + o * D, wact, w->w2, ne, I, D));
        /* d routing weight = ⟨d wact, act⟩; d act = d wact · weight */
        row_dot_kernel<<<(unsigned)ne, CUDA_ROW_THREADS, 0, s>>>(g->dw + o, g->dact, a->act, I);
        CUDA_LAUNCHED("moe_experts_bwd dw");
        DS4_TRY(rows_scale(s, g->dact, g->dact, rw, ne, I));
        DS4_TRY(cuda_fill(s, g->dh1, 0, bytes));
        DS4_TRY(cuda_fill(s, g->dh3, 0, bytes));
        DS4_TRY(cuda_swiglu_bwd(s, g->dh1, g->dh3, g->dact, h1, h3, ne, I, a->limit));
        DS4_TRY(cuda_fill(s, g->dx + o * D, 0, (size_t)(ne * D) * sizeof(float)));
        DS4_TRY(lin_bwd(&c, g->dx + o * D, eg->w1, g->dh1, x, w->w1, ne, D, I));
        DS4_TRY(lin_bwd(&c, g->dx + o * D, eg->w3, g->dh3, x, w->w3, ne, D, I));
    }
    return DS4_OK;
}
