/* AdamW's per-element update on the device: src/train/optim.c's adamw_update, operation for operation
 * (no FMA contraction), so the same bits as the cpu optimizer for the same constants. */
#include <math.h>

#include "kernels/cuda/cuda_common.cuh"

/* The constants of update number `step` (1-based), computed in double and rounded once, as optim.c's
 * adamw_consts computes them. */
cuda_adamw_k cuda_adamw_consts(int64_t step, double beta1, double beta2, double eps, double weight_decay, double lr) {
    const double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
    cuda_adamw_k k;
    k.b1 = (float)beta1;
    k.b2 = (float)beta2;
    k.eps = (float)eps;
    k.omb1 = (float)(1.0 - beta1);
    k.omb2 = (float)(1.0 - beta2);
    k.step_size = (float)(lr / bc1);
    k.inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    k.decay = (float)(lr * weight_decay);
    return k;
}

/* m, v, w, g: [n] */
static __global__ void adamw_kernel(cuda_adamw_k k, int64_t n, float *m, float *v, bool decay, float *w,
                                    const float *g) {
    CUDA_GRID_STRIDE(i, n) {
        const float gi = g[i];
        const float mi = k.b1 * m[i] + k.omb1 * gi;
        const float vi = k.b2 * v[i] + k.omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        const float denom = sqrtf(vi) * k.inv_sqrt_bc2 + k.eps;
        float wi = w[i];
        if (decay) wi -= k.decay * wi;
        w[i] = wi - k.step_size * mi / denom;
    }
}

ds4_status cuda_adamw_update(cudaStream_t s, const cuda_adamw_k *k, int64_t n, float *m, float *v, int decay, float *w,
                             const float *g) {
    CUDA_ARG(n >= 0, "adamw_update", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    adamw_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(*k, n, m, v, decay != 0, w, g);
    CUDA_LAUNCHED("adamw_update");
    return DS4_OK;
}

/* ---------------------------------------------------------------- Muon's per-element steps
 * ds4_muon_momentum and ds4_muon_apply (src/core/norm.c), operation for operation. */
static __global__ void muon_momentum_kernel(int64_t n, const float *g, float *mom, float *u, float mu, bool nesterov) {
    CUDA_GRID_STRIDE(i, n) {
        const float mi = mu * mom[i] + g[i];
        mom[i] = mi;
        u[i] = nesterov ? g[i] + mu * mi : mi;
    }
}
ds4_status cuda_muon_momentum(cudaStream_t s, int64_t n, const float *g, float *mom, float *u, float mu, int nesterov) {
    CUDA_ARG(n >= 0, "muon_momentum", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    muon_momentum_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(n, g, mom, u, mu, nesterov != 0);
    CUDA_LAUNCHED("muon_momentum");
    return DS4_OK;
}

static __global__ void muon_apply_kernel(int64_t n, float *w, const float *o, float decay, float step) {
    CUDA_GRID_STRIDE(i, n) {
        float wi = w[i];
        wi -= decay * wi;
        w[i] = wi - step * o[i];
    }
}
ds4_status cuda_muon_apply(cudaStream_t s, int64_t n, float *w, const float *o, float decay, float step) {
    CUDA_ARG(n >= 0, "muon_apply", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    muon_apply_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(n, w, o, decay, step);
    CUDA_LAUNCHED("muon_apply");
    return DS4_OK;
}

/* FSDP's reduce-scatter sum: each element's n versions added in rank order, then into g (the cpu's order). */
static __global__ void rank_sum_add_kernel(float *g, const float *recv, int n, int64_t len) {
    CUDA_GRID_STRIDE(i, len) {
        float t = recv[i];
        for (int r = 1; r < n; r++) t += recv[(int64_t)r * len + i];
        g[i] += t;
    }
}
ds4_status cuda_rank_sum_add(cudaStream_t s, float *g, const float *recv, int n, int64_t len) {
    CUDA_ARG(len >= 0 && n >= 1, "rank_sum_add", "n = %d, len = %lld", n, (long long)len);
    if (len == 0) return DS4_OK;
    rank_sum_add_kernel<<<cuda_blocks(len, 256), 256, 0, s>>>(g, recv, n, len);
    CUDA_LAUNCHED("rank_sum_add");
    return DS4_OK;
}
