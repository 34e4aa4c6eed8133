/* Routed SwiGLU experts on rows grouped by expert (cpu_moe_experts_fwd/bwd, cpu.h; semantics:
 * kernels.h) on the cpu backend's GEMMs and SwiGLU kernels. Several experts run side by side, one per
 * thread, on the serial GEMMs (cpu_gemm_serial_*) with the thread's own packing buffer: an expert's rows,
 * its slices of the saved and scratch activations and its weight gradients are its own, and the serial
 * GEMMs give the threaded driver's bits, so neither who runs an expert nor whether experts run side by side
 * (one expert, or one thread: the threaded driver, expert after expert) changes a bit. */
#include <omp.h>
#include <string.h>

#include "kernels/cpu/cpu.h"

/* Where the experts' weights are read: fp32, or their bf16 compute copy (moe_experts_args.hcopy); the
 * matmul precision of the GEMMs on fp32 operands; the thread's packing buffer (NULL: the threaded driver). */
typedef struct {
    const float *wbase;
    const uint16_t *hcopy;
    ds4_matmul_precision prec;
    void *ws;
} weights_at;

/* out[N,OC] = inp[N,IC] · w[OC,IC]^T, on the bf16 copy of w when there is one (cpu_linear_fwd's GEMMs). */
static void lin_fwd(weights_at at, float *out, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC) {
    const uint16_t *hw = at.hcopy ? at.hcopy + (w - at.wbase) : NULL;
    if (!at.ws) {
        if (hw) cpu_linear_fwd_bf16w(out, inp, hw, N, IC, OC);
        else cpu_linear_fwd(at.prec, out, inp, w, N, IC, OC);
    } else if (hw) {
        cpu_gemm_serial_nt_hb(at.ws, N, OC, IC, inp, IC, hw, IC, out, OC, 0);
    } else {
        cpu_gemm_serial_nt(at.prec, at.ws, N, OC, IC, inp, IC, w, IC, out, OC, 0);
    }
}

/* dinp[N,IC] += dout[N,OC] · w[OC,IC];  dw[OC,IC] += dout^T · inp[N,IC] (cpu_linear_bwd's GEMMs). */
static void lin_bwd(weights_at at, float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                    int64_t N, int64_t IC, int64_t OC) {
    const uint16_t *hw = at.hcopy ? at.hcopy + (w - at.wbase) : NULL;
    if (!at.ws) {
        if (hw) cpu_linear_bwd_bf16w(at.prec, dinp, dw, dout, inp, hw, N, IC, OC);
        else cpu_linear_bwd(at.prec, dinp, dw, dout, inp, w, N, IC, OC);
        return;
    }
    if (hw) cpu_gemm_serial_nn_hb(at.ws, N, IC, OC, dout, OC, hw, IC, dinp, IC, 1);
    else cpu_gemm_serial_nn(at.prec, at.ws, N, IC, OC, dout, OC, w, IC, dinp, IC, 1);
    cpu_gemm_serial_tn(at.prec, at.ws, OC, IC, N, dout, OC, inp, IC, dw, IC, 1);
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

/* Threads the experts of a call run on side by side: 1 (the threaded driver) for a single expert (expert
 * parallelism calls one at a time), a single thread, or inside a parallel region. */
static int experts_threads(const moe_experts_args *a) {
    const int P = omp_get_max_threads();
    if (a->nexp < 2 || P < 2 || omp_in_parallel()) return 1;
    return P < a->nexp ? P : (int)a->nexp;
}

/* One thread's packing buffer: the largest serial GEMM of an expert whatever its row count (the bound
 * stops growing at a row block and a K slice), so the bytes do not depend on the routing. */
static size_t experts_ws_bytes(const moe_experts_args *a) {
    const int64_t many = (int64_t)1 << 30;
    return cpu_gemm_serial_bytes(many, a->D > a->I ? a->D : a->I, many);
}

/* The buffers of P threads side by side (NULL when P == 1 or they cannot be had: the threaded driver runs
 * instead, the same bits). Shared with the plan mirrors. */
static char *experts_ws(const moe_experts_args *a, bool plan, int *P) {
    *P = experts_threads(a);
    char *ws = *P > 1 ? ds4_alloc_for(plan, DS4_MEM_WORK, (size_t)*P * experts_ws_bytes(a)) : NULL;
    if (!ws) *P = 1;
    return ws;
}

static weights_at experts_at(const moe_experts_args *a, ds4_matmul_precision prec, char *ws) {
    return (weights_at){a->wbase, a->hcopy, prec, ws ? ws + (size_t)omp_get_thread_num() * experts_ws_bytes(a) : NULL};
}

/* Every expert with rows: forward into y (g NULL) or backward (g), side by side when experts_threads says. */
static void experts_each(ds4_matmul_precision prec, const moe_experts_args *a, const moe_experts_grads *g, float *y) {
    const int64_t D = a->D, I = a->I;
    int P;
    char *ws = experts_ws(a, false, &P);
#pragma omp parallel for schedule(dynamic, 1) num_threads(P) if (P > 1)
    for (int64_t e = 0; e < a->nexp; e++) {
        const int64_t o = a->off[e], ne = a->off[e + 1] - o;
        const weights_at at = experts_at(a, prec, ws);
        if (ne > 0 && !g)
            expert_fwd(at, &a->w[e], a->x + o * D, a->rw + o, ne, D, I, a->limit, a->h1 + o * I, a->h3 + o * I,
                       a->act + o * I, y + o * D);
        else if (ne > 0)
            expert_bwd(at, &a->w[e], &g->g[e], a->x + o * D, g->dy + o * D, a->rw + o, a->h1 + o * I, a->h3 + o * I,
                       ne, D, I, a->limit, g->dx + o * D, g->dw + o, a->act + o * I, g->dact + o * I, g->dh1 + o * I,
                       g->dh3 + o * I);
    }
    ds4_free(ws);
}

void cpu_moe_experts_fwd(ds4_matmul_precision prec, const moe_experts_args *a, float *y) {
    experts_each(prec, a, NULL, y);
}

void cpu_moe_experts_bwd(ds4_matmul_precision prec, const moe_experts_args *a, const moe_experts_grads *g) {
    experts_each(prec, a, g, NULL);
}

/* The plan mirrors: the packing buffers of the experts side by side, allocated and freed. */
void cpu_moe_experts_fwd_plan(ds4_matmul_precision prec, const moe_experts_args *a, float *y) {
    (void)prec, (void)y;
    int P;
    ds4_free(experts_ws(a, true, &P));
}

void cpu_moe_experts_bwd_plan(ds4_matmul_precision prec, const moe_experts_args *a, const moe_experts_grads *g) {
    (void)prec, (void)g;
    int P;
    ds4_free(experts_ws(a, true, &P));
}
