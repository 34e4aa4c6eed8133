/* The cpu backend's table: every entry of ds4_kernel_backend, on the kernels of this folder and the
 * GEMM driver (../gemm.c) that runs the engine the dispatch (../dispatch.c) chose from the CPU. The cpu
 * runs each op inline on the calling thread (its stream is NULL), so an entry is the op's cpu_<name>
 * function (cpu/cpu.h) given what it takes of the context (ops.def's `cpu` column: nothing, or the
 * matmul precision). Its plan twin is the plan backend (../plan.c).
 *
 * This folder is compiled once per ISA level (the Makefile: DS4_CPU_LEVEL names the level, generic when
 * unset), and each compile makes its own table, ds4_cpu_kernels_<level>: the only symbol a level above
 * generic keeps global. ds4_kernel_backend_cpu() (../dispatch.c) returns the table of the level in use. */
#include "kernels/cpu/cpu.h"

#ifndef DS4_CPU_LEVEL
#define DS4_CPU_LEVEL generic
#endif
#define CPU_TABLE_(level) ds4_cpu_kernels_##level
#define CPU_TABLE(level) CPU_TABLE_(level)

#define DS4_OP(name, plan, cpu, params, args) \
    static void cpu_entry_##name params { CPU_CALL_##cpu(cpu_##name, args); }
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) \
    static type cpu_entry_##name params { return CPU_CALL_##cpu(cpu_##name, args); }
#include "kernels/ops.def"

__attribute__((visibility("default"))) const ds4_kernel_backend CPU_TABLE(DS4_CPU_LEVEL) = {
    .name = "cpu",
    .plan = &ds4_kernel_backend_plan_table,
    .host_memory = true,
#define DS4_OP(name, plan, cpu, params, args) .name = cpu_entry_##name,
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) .name = cpu_entry_##name,
#include "kernels/ops.def"
};
