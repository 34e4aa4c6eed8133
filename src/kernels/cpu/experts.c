/* Routed SwiGLU experts on rows grouped by expert (cpu_moe_experts_fwd/bwd, cpu.h; semantics:
 * kernels.h), one expert at a time on the cpu backend's linear and SwiGLU kernels. */
#include <string.h>

#include "kernels/cpu/cpu.h"

/* Where the experts' weights are read: fp32, or their bf16 compute copy (moe_experts_args.hcopy); and the
 * matmul precision of the GEMMs on fp32 operands. */
typedef struct {
    const float *wbase;
    const uint16_t *hcopy;
    ds4_matmul_precision prec;
} weights_at;

/* One of an expert's linear layers, on the bf16 copy of its weight w when there is one. */
static void lin_fwd(weights_at at, float *out, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC) {
    if (at.hcopy) cpu_linear_fwd_bf16w(out, inp, at.hcopy + (w - at.wbase), N, IC, OC);
    else cpu_linear_fwd(at.prec, out, inp, w, N, IC, OC);
}

static void lin_bwd(weights_at at, float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                    int64_t N, int64_t IC, int64_t OC) {
    if (at.hcopy) cpu_linear_bwd_bf16w(at.prec, dinp, dw, dout, inp, at.hcopy + (w - at.wbase), N, IC, OC);
    else cpu_linear_bwd(at.prec, dinp, dw, dout, inp, w, N, IC, OC);
}

/* One expert on ne rows: x [ne, D] with routing weights w [ne] → h1, h3 [ne, I] and
 * y [ne, D] = w2(w · swiglu(h1, h3)). act: [ne, I] scratch. */
static void expert_fwd(weights_at at, const moe_expert_w *ew, const float *x, const float *w, int64_t ne, int64_t D, int64_t I,
                       float limit, float *h1, float *h3, float *act, float *y) {
    lin_fwd(at, h1, x, ew->w1, ne, D, I);
    lin_fwd(at, h3, x, ew->w3, ne, D, I);
    cpu_swiglu_fwd(act, h1, h3, ne, I, limit);
    for (int64_t i = 0; i < ne; i++)
        for (int64_t k = 0; k < I; k++) act[i * I + k] *= w[i]; /* routing weight before w2 */
    lin_fwd(at, y, act, ew->w2, ne, I, D);
}

void cpu_moe_experts_fwd(ds4_matmul_precision prec, const moe_experts_args *a, float *y) {
    const int64_t D = a->D, I = a->I;
    for (int64_t e = 0; e < a->nexp; e++) {
        const int64_t o = a->off[e], ne = a->off[e + 1] - o;
        if (ne > 0)
            expert_fwd((weights_at){a->wbase, a->hcopy, prec}, &a->w[e], a->x + o * D, a->rw + o, ne, D, I, a->limit, a->h1 + o * I, a->h3 + o * I, a->act,
                       y + o * D);
    }
}

/* Backward of one expert on ne rows (expert_fwd's inputs x, w, saved h1, h3; dy = d of its output):
 * dx [ne, D] and dw [ne] are overwritten; weight gradients accumulate into eg. Scratch act, dact, dh1,
 * dh3: [ne, I]. */
static void expert_bwd(weights_at at, const moe_expert_w *ew, moe_expert_w *eg, const float *x, const float *dy, const float *w,
                       const float *h1, const float *h3, int64_t ne, int64_t D, int64_t I, float limit, float *dx,
                       float *dw, float *act, float *dact, float *dh1, float *dh3) {
    cpu_swiglu_fwd(act, h1, h3, ne, I, limit); /* unweighted activation */
    float *wact = dh1;                         /* scratch: the weighted activation that fed w2 */
    for (int64_t i = 0; i < ne; i++)
        for (int64_t k = 0; k < I; k++) wact[i * I + k] = act[i * I + k] * w[i];
    memset(dact, 0, (size_t)(ne * I) * sizeof(float));
    lin_bwd(at, dact, eg->w2, dy, wact, ew->w2, ne, I, D);
    /* d weight = ⟨d wact, act⟩; d act = d wact · weight */
    for (int64_t i = 0; i < ne; i++) {
        double s = 0;
        for (int64_t k = 0; k < I; k++) s += (double)dact[i * I + k] * act[i * I + k];
        dw[i] = (float)s;
        for (int64_t k = 0; k < I; k++) dact[i * I + k] *= w[i];
    }
    memset(dh1, 0, (size_t)(ne * I) * sizeof(float));
    memset(dh3, 0, (size_t)(ne * I) * sizeof(float));
    cpu_swiglu_bwd(dh1, dh3, dact, h1, h3, ne, I, limit);
    memset(dx, 0, (size_t)(ne * D) * sizeof(float));
    lin_bwd(at, dx, eg->w1, dh1, x, ew->w1, ne, D, I);
    lin_bwd(at, dx, eg->w3, dh3, x, ew->w3, ne, D, I);
}

void cpu_moe_experts_bwd(ds4_matmul_precision prec, const moe_experts_args *a, const moe_experts_grads *g) {
    const int64_t D = a->D, I = a->I;
    for (int64_t e = 0; e < a->nexp; e++) {
        const int64_t o = a->off[e], ne = a->off[e + 1] - o;
        if (ne > 0)
            expert_bwd((weights_at){a->wbase, a->hcopy, prec}, &a->w[e], &g->g[e], a->x + o * D, g->dy + o * D, a->rw + o, a->h1 + o * I, a->h3 + o * I, ne,
                       D, I, a->limit, g->dx + o * D, g->dw + o, a->act, g->dact, g->dh1, g->dh3);
    }
}
