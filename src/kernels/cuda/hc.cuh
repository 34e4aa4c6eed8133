/* The CUDA launchers of ds4's mHC ops (hc.cu; docs/dsv4-architecture.md §3): hc_split_sinkhorn, hc_pre,
 * hc_post, hc_head, forward and backward. Callable from C; the conventions of cuda.h (device tensors in
 * host descriptors, kernels.h semantics, stream first, ds4_status back, work queued on return).
 * n (hc_mult) is at most HC_CUDA_NMAX. Deterministic: every sum in an order fixed by the code and the
 * sizes; the dot products are cpu/hc.inc's hc_dot order exactly (docs/cuda.md). */
#ifndef DS4_KERNELS_CUDA_HC_CUH
#define DS4_KERNELS_CUDA_HC_CUH

#include "kernels/cuda/cuda.h"

#define HC_CUDA_NMAX 8 /* most streams the kernels hold per token (V4: 4) */

#ifdef __cplusplus
extern "C" {
#endif

/* One token (a's pointers are device pointers). */
ds4_status cuda_hc_split_sinkhorn_fwd(cudaStream_t s, const hc_sinkhorn_args *a);
ds4_status cuda_hc_split_sinkhorn_bwd(cudaStream_t s, const hc_sinkhorn_args *a, const hc_sinkhorn_grads *g);
ds4_status cuda_hc_pre_fwd(cudaStream_t s, const hc_pre_args *a);
ds4_status cuda_hc_pre_bwd(cudaStream_t s, const hc_pre_args *a, const hc_pre_grads *g);
ds4_status cuda_hc_post_fwd(cudaStream_t s, const hc_post_args *a);
ds4_status cuda_hc_post_bwd(cudaStream_t s, const hc_post_args *a, const hc_post_grads *g);
ds4_status cuda_hc_head_fwd(cudaStream_t s, const hc_head_args *a);
ds4_status cuda_hc_head_bwd(cudaStream_t s, const hc_head_args *a, const hc_head_grads *g);
/* Workspace of hc_pre_bwd / hc_head_bwd (M = (2+n)·n / n): per token pre [n], ∂mixes [M], dbase part
 * [M], dscale part [3]. The launchers take it with cudaMallocAsync on s; the `_ws` twins use a caller's. */
size_t cuda_hc_bwd_workspace_bytes(int64_t N, int64_t n, int64_t M);
ds4_status cuda_hc_pre_bwd_ws(cudaStream_t s, const hc_pre_args *a, const hc_pre_grads *g, void *ws);
ds4_status cuda_hc_head_bwd_ws(cudaStream_t s, const hc_head_args *a, const hc_head_grads *g, void *ws);

#ifdef __cplusplus
}
#endif
#endif
