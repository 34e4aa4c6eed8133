/* The cpu backend's table: every entry of ds4_kernel_backend, on the kernels of this folder and the
 * GEMM driver (../gemm.c) that runs the engine the dispatch (../dispatch.c) chose from the CPU. */
#include "kernels/cpu/cpu.h"

static const ds4_kernel_backend k_cpu = {
    .name = "cpu",
    .gemm_nt = cpu_gemm_nt,
    .gemm_nn = cpu_gemm_nn,
    .gemm_tn = cpu_gemm_tn,
    .gemm_workspace_reserve = cpu_gemm_workspace_reserve,
    .gemm_workspace_release = cpu_gemm_workspace_release,
    .linear_fwd = cpu_linear_fwd,
    .linear_bwd = cpu_linear_bwd,
    .grouped_linear_fwd = cpu_grouped_linear_fwd,
    .grouped_linear_bwd = cpu_grouped_linear_bwd,
    .embedding_fwd = cpu_embedding_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .rmsnorm_fwd = cpu_rmsnorm_fwd,
    .rmsnorm_bwd = cpu_rmsnorm_bwd,
    .rope_fwd = cpu_rope_fwd,
    .rope_bwd = cpu_rope_bwd,
    .hc_split_sinkhorn_fwd = cpu_hc_split_sinkhorn_fwd,
    .hc_split_sinkhorn_bwd = cpu_hc_split_sinkhorn_bwd,
    .hc_pre_fwd = cpu_hc_pre_fwd,
    .hc_pre_bwd = cpu_hc_pre_bwd,
    .hc_post_fwd = cpu_hc_post_fwd,
    .hc_post_bwd = cpu_hc_post_bwd,
    .hc_head_fwd = cpu_hc_head_fwd,
    .hc_head_bwd = cpu_hc_head_bwd,
    .compressor_pool_fwd = cpu_compressor_pool_fwd,
    .compressor_pool_bwd = cpu_compressor_pool_bwd,
    .sparse_attn_fwd = cpu_sparse_attn_fwd,
    .sparse_attn_bwd = cpu_sparse_attn_bwd,
    .indexer_topk_fwd = cpu_indexer_topk_fwd,
    .indexer_kl_fwd_bwd = cpu_indexer_kl_fwd_bwd,
    .moe_gate_fwd = cpu_moe_gate_fwd,
    .moe_gate_bwd = cpu_moe_gate_bwd,
    .swiglu_fwd = cpu_swiglu_fwd,
    .swiglu_bwd = cpu_swiglu_bwd,
    .cross_entropy_fwd_bwd = cpu_cross_entropy_fwd_bwd,
};

const ds4_kernel_backend *ds4_kernel_backend_cpu(void) { return &k_cpu; }
