/* The plan backend: what the kernels do while memplan plans a step on the cpu backend (a plan context).
 * Tensors have no memory behind them then, so no entry touches data. The ops marked MIRROR in ops.def
 * allocate workspace in the cpu backend (GEMM packing buffers, attention and indexer scratch); their entry
 * here is that kernel's workspace mirror (cpu/cpu.h, cpu_<op>_plan, given what the cpu kernel takes of the
 * context): same bytes, allocated and freed in the same order, so a plan counts what a real step
 * allocates, byte for byte. moe_expert_counts gives balanced routing's counts, which size expert
 * parallelism's rows in a plan. The SKIP ops have no entry: their wrapper does nothing. */
#include "kernels/cpu/cpu.h"

/* Releasing the GEMM workspace is the same in a plan: it frees what the mirror reserved. */
static void cpu_gemm_workspace_release_plan(void) { cpu_gemm_workspace_release(); }

/* Each op's workspace counted under the op (memplan --memory-report); buf_alloc, a query, allocates for
 * its caller and keeps the caller's owner. */
#define PLAN_ENTRY_MIRROR(name, cpu, params, args)                          \
    static void plan_entry_##name params {                                  \
        const char *owner_ = ds4_mem_owner_enter("op " #name);              \
        CPU_CALL_##cpu(cpu_##name##_plan, args);                            \
        ds4_mem_owner_leave(owner_);                                        \
    }
/* A memory entry counts what it allocates under its caller's owner (a mapped range remembers none). */
#define PLAN_ENTRY_KEEP(name, cpu, params, args) \
    static void plan_entry_##name params { CPU_CALL_##cpu(cpu_##name##_plan, args); }
#define PLAN_ENTRY_SKIP(name, cpu, params, args)
#define PLAN_QUERY_MIRROR(name, cpu, type, params, args) \
    static type plan_entry_##name params { return CPU_CALL_##cpu(cpu_##name##_plan, args); }
#define PLAN_QUERY_KEEP PLAN_QUERY_MIRROR
#define PLAN_QUERY_SKIP(name, cpu, type, params, args)
#define DS4_OP(name, plan, cpu, params, args) PLAN_ENTRY_##plan(name, cpu, params, args)
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) PLAN_QUERY_##plan(name, cpu, type, params, args)
#include "kernels/ops.def"

#define PLAN_INIT_MIRROR(name) .name = plan_entry_##name,
#define PLAN_INIT_KEEP(name) .name = plan_entry_##name,
#define PLAN_INIT_SKIP(name)
const ds4_kernel_backend ds4_kernel_backend_plan_table = {
    .name = "plan",
#define DS4_OP(name, plan, cpu, params, args) PLAN_INIT_##plan(name)
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) PLAN_INIT_##plan(name)
#include "kernels/ops.def"
};

const ds4_kernel_backend *ds4_kernel_backend_plan(void) { return &ds4_kernel_backend_plan_table; }
