/* The plan backend: what the kernels do while memplan plans a step (a plan context). Tensors have no
 * memory behind them then, so no entry touches data. The entries that allocate workspace in the cpu
 * backend (GEMM packing buffers, attention and indexer scratch) are that backend's workspace mirrors
 * (cpu/cpu.h): same bytes, allocated and freed in the same order, so a plan counts what a real step
 * allocates, byte for byte. moe_expert_counts gives balanced routing's counts, which size expert
 * parallelism's rows in a plan. Every other entry is NULL: the kernels.h wrapper does nothing. */
#include "kernels/cpu/cpu.h"

static const ds4_kernel_backend k_plan = {
    .name = "plan",
    .gemm_nt = cpu_gemm_nt_plan,
    .gemm_nn = cpu_gemm_nn_plan,
    .gemm_tn = cpu_gemm_tn_plan,
    .gemm_workspace_reserve = cpu_gemm_workspace_reserve_plan,
    .gemm_workspace_release = cpu_gemm_workspace_release,
    .linear_fwd = cpu_linear_fwd_plan,
    .linear_bwd = cpu_linear_bwd_plan,
    .grouped_linear_fwd = cpu_grouped_linear_fwd_plan,
    .grouped_linear_bwd = cpu_grouped_linear_bwd_plan,
    .linear_fwd_bf16w = cpu_linear_fwd_bf16w_plan,
    .linear_bwd_bf16w = cpu_linear_bwd_bf16w_plan,
    .grouped_linear_fwd_bf16w = cpu_grouped_linear_fwd_bf16w_plan,
    .grouped_linear_bwd_bf16w = cpu_grouped_linear_bwd_bf16w_plan,
    .sparse_attn_fwd = cpu_sparse_attn_fwd_plan,
    .sparse_attn_bwd = cpu_sparse_attn_bwd_plan,
    .indexer_topk_fwd = cpu_indexer_topk_fwd_plan,
    .indexer_kl_fwd_bwd = cpu_indexer_kl_fwd_bwd_plan,
    .moe_expert_counts = cpu_moe_expert_counts_plan, /* a plan routes as moe_force_balance does */
};

const ds4_kernel_backend *ds4_kernel_backend_plan(void) { return &k_plan; }
