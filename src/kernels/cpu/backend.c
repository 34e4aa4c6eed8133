/* The cpu backend's table: every entry of ds4_kernel_backend, on the kernels of this folder and the
 * GEMM driver (../gemm.c) that runs the engine the dispatch (../dispatch.c) chose from the CPU. The cpu
 * runs each op inline on the calling thread (its stream is NULL), so an entry is the op's cpu_<name>
 * function (cpu/cpu.h) given what it takes of the context (ops.def's `cpu` column: nothing, or the
 * matmul precision). Its plan twin is the plan backend (../plan.c). */
#include "kernels/cpu/cpu.h"

#define DS4_OP(name, plan, cpu, params, args) \
    static void cpu_entry_##name params { CPU_CALL_##cpu(cpu_##name, args); }
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) \
    static type cpu_entry_##name params { return CPU_CALL_##cpu(cpu_##name, args); }
#include "kernels/ops.def"

static const ds4_kernel_backend k_cpu = {
    .name = "cpu",
    .plan = &ds4_kernel_backend_plan_table,
#define DS4_OP(name, plan, cpu, params, args) .name = cpu_entry_##name,
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) .name = cpu_entry_##name,
#include "kernels/ops.def"
};

const ds4_kernel_backend *ds4_kernel_backend_cpu(void) { return &k_cpu; }
