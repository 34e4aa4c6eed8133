/* The kernel backend seam: one table of entry points per backend. Model code never names a backend's
 * functions; it calls the wrappers of kernels.h with its context (ds4_exec), which call through the
 * table ds4_exec_kernels() picks for that context. The ops are listed once, in ops.def.
 *
 * Backends today (README.md in this folder says how to add one, e.g. CUDA):
 *  - "cpu"  (cpu/, x86/): portable C with OpenMP and vector types; its GEMM runs the engine that
 *           dispatch.c picks from the CPU at start (ISA level, DS4_ISA caps it).
 *  - "plan" (plan.c): what a plan step runs (memplan): no data is touched; the entries that
 *           allocate workspace in the cpu backend allocate and free the same bytes, so a plan counts
 *           what a real step allocates; every other entry is NULL (the wrapper does nothing).
 * ds4_exec_kernels() is the one place that picks between them, from the context it is given. */
#ifndef DS4_KERNELS_BACKEND_H
#define DS4_KERNELS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ds4/core.h"

/* The descriptors of the ops with many operands (defined, with their shapes, in kernels.h). */
typedef struct rope_args rope_args;
typedef struct hc_sinkhorn_args hc_sinkhorn_args;
typedef struct hc_sinkhorn_grads hc_sinkhorn_grads;
typedef struct hc_pre_args hc_pre_args;
typedef struct hc_pre_grads hc_pre_grads;
typedef struct hc_post_args hc_post_args;
typedef struct hc_post_grads hc_post_grads;
typedef struct hc_head_args hc_head_args;
typedef struct hc_head_grads hc_head_grads;
typedef struct compressor_pool_args compressor_pool_args;
typedef struct compressor_pool_grads compressor_pool_grads;
typedef struct sparse_attn_args sparse_attn_args;
typedef struct sparse_attn_grads sparse_attn_grads;
typedef struct indexer_topk_args indexer_topk_args;
typedef struct indexer_kl_args indexer_kl_args;
typedef struct moe_gate_args moe_gate_args;
typedef struct moe_gate_grads moe_gate_grads;
typedef struct moe_expert_w moe_expert_w;
typedef struct moe_experts_args moe_experts_args;
typedef struct moe_experts_grads moe_experts_grads;

/* C[M,N] = beta·C + op(A)·op(B): the signature of the cpu GEMMs (cpu/cpu.h). */
typedef void gemm_signature(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                            int64_t ldb, float *C, int64_t ldc, float beta);

/* The same with B given as bf16 bits (gemm_nt / gemm_nn of a weight's bf16 compute copy). */
typedef void gemm_signature_hb(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B,
                               int64_t ldb, float *C, int64_t ldc, float beta);

/* One backend: its name, the plan of it (what memplan runs in its place), and one entry per op of
 * ops.def, each taking the context first. A NULL op entry does nothing (a query returns its absent
 * value): only a plan backend has them; a compute backend fills every entry
 * (ds4_kernel_backend_missing checks). */
typedef struct ds4_kernel_backend ds4_kernel_backend;
struct ds4_kernel_backend {
    const char *name;
    const ds4_kernel_backend *plan; /* the plan of this backend; NULL in a plan backend itself */
    /* Whether it can run here (its device present, its runtime up): DS4_OK, or an error saying what is
     * missing. Asked when a command picks the backend by name. NULL: always (the cpu's). */
    ds4_status (*ready)(void);
    /* Its devices, one line each ("cuda:0 NVIDIA H200, sm_90, ..."), into buf [cap] (ds4 info). NULL: the
     * host is its device (the cpu's: ds4 info describes the CPU above). */
    void (*describe)(char *buf, size_t cap);
    /* Its buffers are host memory others (MPI) may touch directly; false: device memory (ds4/kernels.h,
     * ds4_exec_host_memory). */
    bool host_memory;
#define DS4_OP(name, plan, cpu, params, args) void(*name) params;
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) type(*name) params;
#include "kernels/ops.def"
};

/* The table an op runs on in context x: x's backend (NULL: cpu), or that backend's plan when x is a
 * plan. The only place that picks; nothing reads a process-wide backend. */
const ds4_kernel_backend *ds4_exec_kernels(const ds4_exec *x);
/* The backends, for tests and `ds4 info`. */
const ds4_kernel_backend *ds4_kernel_backend_cpu(void);
const ds4_kernel_backend *ds4_kernel_backend_plan(void);
/* "cpu-guard" (guard/guard.c): the cpu's arithmetic on buffers the host cannot reach outside its ops: a
 * test backend that makes any byte touched above the kernels fault, naming the place. */
const ds4_kernel_backend *ds4_kernel_backend_guard(void);
/* The name of the first NULL entry of b, or NULL when b fills every entry (a compute backend must). */
const char *ds4_kernel_backend_missing(const ds4_kernel_backend *b);
/* Every op entry's name in ops.def order, and how many (tests walk the table by name). */
extern const char *const ds4_kernel_op_names[];
extern const int ds4_kernel_op_count;

/* Drops the first of a parenthesised argument list: DS4_DROP_FIRST (x, a, b) is a, b (a backend whose
 * functions take no context adapts them with it). */
#define DS4_DROP_FIRST(first, ...) __VA_ARGS__
#define DS4_FIRST(first, ...) first

#endif
