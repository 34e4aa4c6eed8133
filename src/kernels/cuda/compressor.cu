/* Compressor pooling on the GPU (docs/dsv4-architecture.md §4.4, backward at the end of §4.10; semantics:
 * kernels.h compressor_pool_*). One thread per output channel (b, i, ch): the slots in order, as
 * cpu/compressor.inc walks them (max, then Σ e and Σ e·a), so the sums are the cpu's but for expf.
 *
 * Backward: each a / z element belongs to one slot of one entry (with overlap, a token's columns [0, d)
 * are the next entry's previous block and [d, 2d) its own entry's current block), so da and dz have one
 * writer each. dape[u] sums over every (b, i): the per-(entry, slot) terms go to a workspace, then one
 * thread per dape element adds them in (b, i) order, into dape, as the cpu does. */
#include "kernels/cuda/attn_util.cuh"

/* Slot s of entry i: its token, its place u in its block and its column offset; false for an absent
 * slot (cpu/compressor.c cp_slot). */
__device__ __forceinline__ bool cp_slot(int64_t s, int64_t i, int64_t r, int64_t d, bool overlap, int64_t *tok,
                                        int64_t *u, int64_t *off) {
    if (!overlap) {
        *tok = i * r + s, *u = s, *off = 0;
        return true;
    }
    if (s < r) {
        if (i == 0) return false;
        *tok = (i - 1) * r + s, *u = s, *off = 0;
        return true;
    }
    *tok = i * r + (s - r), *u = s - r, *off = d;
    return true;
}

/* Softmax statistics of entry (b, i), channel ch: max m, Σ e, Σ e·a with e = exp(z + ape − m), slots in
 * order. */
__device__ __forceinline__ void cp_stats(float *m, float *se, float *sa, const compressor_pool_args &a, int64_t b,
                                         int64_t i, int64_t ch) {
    const int64_t T = a.dims.T, r = a.dims.r, d = a.dims.d;
    const bool ov = a.dims.overlap;
    const int64_t C = ov ? 2 * d : d, ns = ov ? 2 * r : r;
    float mx = -INFINITY, e_sum = 0.f, ea_sum = 0.f;
    for (int64_t s = 0; s < ns; s++) {
        int64_t tok, u, off;
        if (!cp_slot(s, i, r, d, ov, &tok, &u, &off)) continue;
        float v = a.z[(b * T + tok) * C + off + ch] + a.ape[u * C + off + ch];
        mx = v > mx ? v : mx;
    }
    for (int64_t s = 0; s < ns; s++) {
        int64_t tok, u, off;
        if (!cp_slot(s, i, r, d, ov, &tok, &u, &off)) continue;
        const int64_t row = (b * T + tok) * C + off + ch;
        float e = expf(a.z[row] + a.ape[u * C + off + ch] - mx);
        e_sum += e;
        ea_sum += e * a.a[row];
    }
    *m = mx, *se = e_sum, *sa = ea_sum;
}

/* out [B, Nc, d]: one thread per (b, i, ch). */
__global__ void cp_fwd_kernel(compressor_pool_args a, int64_t Nc) {
    const int64_t d = a.dims.d;
    CUDA_GRID_STRIDE(x, a.dims.B * Nc * d) {
        const int64_t ch = x % d, bi = x / d, b = bi / Nc, i = bi % Nc;
        float m, se, sa;
        cp_stats(&m, &se, &sa, a, b, i, ch);
        a.out[x] = sa / se;
    }
}

/* One thread per (b, i, ch): w_u = e_u / Σ e, g = dout; da += w_u·g, dz += w_u·g·(a_u − pooled); the dz
 * term of slot s also to dsc [B, Nc, ns, d] (for dape) when dsc != NULL. */
__global__ void cp_bwd_kernel(compressor_pool_args a, compressor_pool_grads g, int64_t Nc, float *dsc) {
    const int64_t T = a.dims.T, r = a.dims.r, d = a.dims.d;
    const bool ov = a.dims.overlap;
    const int64_t C = ov ? 2 * d : d, ns = ov ? 2 * r : r;
    CUDA_GRID_STRIDE(x, a.dims.B * Nc * d) {
        const int64_t ch = x % d, bi = x / d, b = bi / Nc, i = bi % Nc;
        float m, se, sa;
        cp_stats(&m, &se, &sa, a, b, i, ch);
        const float pooled = sa / se, gs = g.dout[x] / se;
        for (int64_t s = 0; s < ns; s++) {
            int64_t tok, u, off;
            if (!cp_slot(s, i, r, d, ov, &tok, &u, &off)) continue;
            const int64_t row = (b * T + tok) * C + off + ch;
            const float e = expf(a.z[row] + a.ape[u * C + off + ch] - m); /* the bits cp_stats summed */
            const float wg = e * gs, t = wg * (a.a[row] - pooled);
            if (g.da) g.da[row] += wg;
            if (g.dz) g.dz[row] += t;
            if (dsc) dsc[(bi * ns + s) * d + ch] = t;
        }
    }
}

/* dape [r, C]: one thread per element, the (b, i) terms in order. */
__global__ void cp_dape_kernel(float *dape, const float *dsc, int64_t B, int64_t Nc, int64_t r, int64_t d, bool ov) {
    const int64_t C = ov ? 2 * d : d, ns = ov ? 2 * r : r;
    CUDA_GRID_STRIDE(x, r * C) {
        const int64_t u = x / C, col = x % C, ch = col % d;
        const int64_t s = ov && col >= d ? r + u : u; /* the slot that reads this column */
        float v = dape[x];
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = (ov && s < r) ? 1 : 0; i < Nc; i++) v += dsc[((b * Nc + i) * ns + s) * d + ch];
        dape[x] = v;
    }
}

static ds4_status cp_check(const compressor_dims *d, const char *op) {
    if (d->B < 0 || d->T < 0 || d->d < 0)
        return ds4_fail(DS4_ERR_ARG, "cuda %s: negative size (B %lld, T %lld, d %lld)", op, (long long)d->B,
                        (long long)d->T, (long long)d->d);
    return DS4_OK;
}

ds4_status cuda_compressor_pool_fwd(cudaStream_t s, const compressor_pool_args *a) {
    DS4_TRY(cp_check(&a->dims, "compressor_pool_fwd"));
    if (a->dims.r <= 0) return DS4_OK;
    const int64_t Nc = a->dims.T / a->dims.r, n = a->dims.B * Nc * a->dims.d;
    if (n == 0) return DS4_OK;
    cp_fwd_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(*a, Nc);
    CUDA_LAUNCHED("compressor_pool_fwd");
    return DS4_OK;
}

size_t cuda_compressor_pool_bwd_workspace_bytes(const compressor_pool_args *a, const compressor_pool_grads *g) {
    const compressor_dims *d = &a->dims;
    if (!g->dape || d->r <= 0) return 0;
    return (size_t)(d->B * (d->T / d->r) * (d->overlap ? 2 * d->r : d->r) * d->d) * sizeof(float);
}

ds4_status cuda_compressor_pool_bwd_ws(cudaStream_t s, const compressor_pool_args *a, const compressor_pool_grads *g,
                                       void *ws) {
    DS4_TRY(cp_check(&a->dims, "compressor_pool_bwd"));
    if (a->dims.r <= 0 || (!g->da && !g->dz && !g->dape)) return DS4_OK;
    const int64_t Nc = a->dims.T / a->dims.r, n = a->dims.B * Nc * a->dims.d;
    if (n == 0) return DS4_OK;
    float *dsc = g->dape ? (float *)ws : NULL;
    cp_bwd_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(*a, *g, Nc, dsc);
    CUDA_LAUNCHED("compressor_pool_bwd");
    if (g->dape) {
        const int64_t C = a->dims.overlap ? 2 * a->dims.d : a->dims.d;
        cp_dape_kernel<<<cuda_blocks(a->dims.r * C, 256), 256, 0, s>>>(g->dape, dsc, a->dims.B, Nc, a->dims.r,
                                                                       a->dims.d, a->dims.overlap);
        CUDA_LAUNCHED("compressor_pool_bwd");
    }
    return DS4_OK;
}

ds4_status cuda_compressor_pool_bwd(cudaStream_t s, const compressor_pool_args *a, const compressor_pool_grads *g) {
    DS4_TRY(cp_check(&a->dims, "compressor_pool_bwd")); /* before sizing the workspace with them */
    return au_with_ws(s, cuda_compressor_pool_bwd_workspace_bytes(a, g),
                      [&](void *ws) { return cuda_compressor_pool_bwd_ws(s, a, g, ws); });
}
