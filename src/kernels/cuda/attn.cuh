/* The CUDA launchers of ds4's attention-family ops (attn.cu, indexer.cu, compressor.cu): sparse shared-KV
 * attention with sinks, the lightning indexer's top-k and KL loss, compressor pooling. Callable from C;
 * the conventions of cuda.h: device tensor pointers in host descriptors, semantics of the kernels.h entry
 * of the same name (forward outputs overwritten, gradients accumulated, NULL gradient skipped), the
 * stream first, a ds4_status back (a shape the kernels cannot run or a failed launch is an error naming
 * the op), work queued and not finished on return.
 *
 * Deterministic: no float is added by two threads in a racing order; every sum runs in an order fixed by
 * the code and the sizes (docs/cuda-attention.md). The launchers that need device workspace take it
 * with cudaMallocAsync on the stream and free it there; their `_ws` twins run on a caller's workspace
 * of at least the *_workspace_bytes (what a plan counts) instead. */
#ifndef DS4_KERNELS_CUDA_ATTN_CUH
#define DS4_KERNELS_CUDA_ATTN_CUH

#include "kernels/cuda/cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

/* sparse_attn_fwd: o [B,T,H,c], lse [B,T,H]. One block per (b, t, h). */
ds4_status cuda_sparse_attn_fwd(cudaStream_t s, const sparse_attn_args *a);
/* sparse_attn_bwd: dq per query head; dkv / dkvc gathered per key row over the (query, head) pairs that use
 * it (queries ascending, heads ascending); dsink summed per head in a fixed tree (double). */
ds4_status cuda_sparse_attn_bwd(cudaStream_t s, const sparse_attn_args *a, const sparse_attn_grads *g);
ds4_status cuda_sparse_attn_bwd_ws(cudaStream_t s, const sparse_attn_args *a, const sparse_attn_grads *g, void *ws);
size_t cuda_sparse_attn_bwd_workspace_bytes(const sparse_attn_args *a, const sparse_attn_grads *g);

/* indexer_topk_fwd: topk [B,T,K]. The scores are the cpu kernel's bits (the same sums in the same order),
 * so the selection is the cpu's. One block per query row; its scores live in shared memory only. */
ds4_status cuda_indexer_topk_fwd(cudaStream_t s, const indexer_topk_args *a);
/* indexer_kl_fwd_bwd: a->kl_sum (double) and a->n_rows (int64) are DEVICE pointers, written on s.
 * (indexer_kl_rows is host arithmetic: cpu_indexer_kl_rows serves a CUDA table as it is.) */
ds4_status cuda_indexer_kl_fwd_bwd(cudaStream_t s, const indexer_kl_args *a);
ds4_status cuda_indexer_kl_fwd_bwd_ws(cudaStream_t s, const indexer_kl_args *a, void *ws);
size_t cuda_indexer_kl_workspace_bytes(const indexer_kl_args *a);

/* compressor_pool_fwd / _bwd. */
ds4_status cuda_compressor_pool_fwd(cudaStream_t s, const compressor_pool_args *a);
ds4_status cuda_compressor_pool_bwd(cudaStream_t s, const compressor_pool_args *a, const compressor_pool_grads *g);
ds4_status cuda_compressor_pool_bwd_ws(cudaStream_t s, const compressor_pool_args *a, const compressor_pool_grads *g,
                                       void *ws);
size_t cuda_compressor_pool_bwd_workspace_bytes(const compressor_pool_args *a, const compressor_pool_grads *g);

#ifdef __cplusplus
}
#endif
#endif
