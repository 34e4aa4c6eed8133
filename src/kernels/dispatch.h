/* Internal to the cpu kernel backend: the engines of its blocked GEMM (gemm.c) and the run-time
 * dispatch that picks one per kernel family from the CPU at start (dispatch.c). Public side: ds4_isa_*
 * in ds4/core.h.
 *
 * A family is one kernel entry point with several engines: today the GEMM in fp32 and the GEMM in bf16
 * (matmul precision bf16). Each engine is compiled in its own file with the target attributes it needs
 * (x86/), so the library is built for the baseline of its target and runs the best engine the CPU has.
 * The other kernels (cpu/) are portable C, compiled by the Makefile once per ISA level (generic, avx2,
 * avx512) into one table each (ds4_cpu_kernels_<level>, cpu/cpu.h); the level picks the table too. With
 * no FMA contraction and no reassociation every table gives the same bits (tests/test_isa_levels.c). */
#ifndef DS4_KERNELS_DISPATCH_H
#define DS4_KERNELS_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#include "ds4/core.h"
#include "ds4/kernels.h"
#include "kernels/backend.h"

/* Whether this build compiles the x86 engines: GCC on x86-64 (per-file target pragmas), unless the
 * build asks for the portable library only (-DDS4_PORTABLE_ONLY, what a non-x86 target gets) or leaves
 * x86/ out (-DDS4_NO_X86_DIR: the Makefile on a non-x86 target, or X86_64=0). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(DS4_PORTABLE_ONLY) && \
    !defined(DS4_NO_X86_DIR)
#define DS4_X86_ENGINES 1
#else
#define DS4_X86_ENGINES 0
#endif

/* A matrix seen through strides: element (r, c) at p[r·rs + c·cs], or, when h is set (a B operand of the
 * bf16 GEMM: a weight's bf16 compute copy), the bf16 bits h[r·rs + c·cs]. */
typedef struct {
    const float *p;
    int64_t rs, cs;
    const uint16_t *h;
} gemm_view;

/* An engine of the blocked GEMM driver (gemm.c): its blocking sizes, packers and register-tile kernel. */
typedef struct {
    const char *name;   /* shown by `ds4 info`, e.g. "avx2 fp32 6x16" */
    int64_t mr, nr;     /* tile kernel rows, columns */
    int64_t kc;         /* K slice depth: fixes the summation order of every element */
    int64_t mc, nt, nc; /* rows and columns per task at most; columns of B packed per slice */
    int64_t kalign;     /* packed K of a slice is rounded up to a multiple of this (zero filled) */
    size_t elem;        /* bytes of one packed element */
    /* dst: A rows [i0, i0+mr) × k [k0, k0+kc) in the engine's panel layout, rows >= mr zero. */
    void (*pack_a)(void *dst, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc);
    /* dst: B (viewed K×N) rows [k0, k0+kc) × columns [j0, j0+nr), columns >= nr zero. */
    void (*pack_b)(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr);
    /* The same panel from B.h: what pack_b (and the driver's rounding) makes of the fp32 values whose
     * rounding the bits are, read without rounding: bf16 engines copy the bits, fp32 engines widen them.
     * NULL: the engine cannot read bf16 B (the driver then runs the reference). */
    void (*pack_b_bf16)(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr);
    /* C tile [mr, nr] = cscale·C + a·b over one packed slice (kc as passed to the packers). */
    void (*tile)(int64_t kc, const void *a, const void *b, float *C, int64_t ldc, int64_t mr, int64_t nr,
                 float cscale);
    void (*thread_begin)(void), (*thread_end)(void); /* around a thread's tiles; NULL: nothing */
    /* An fp32 engine run as a bf16 one: the driver rounds every packed fp32 panel to bf16 values
     * (gemm_bf16_round) before the tile kernel sees it; the products of bf16 values are exact in fp32,
     * so the FMA chain then sums the exact bf16 products like a bf16 dot-product unit. */
    int round_bf16;
} gemm_engine;

/* Portable fp32 packers (gemm.c) that engines with plain [kc][MR] / [kc][NR] float panels share. */
void gemm_pack_a_f32(float *dst, int64_t MR, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc);
void gemm_pack_b_f32(float *dst, int64_t NR, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr);
/* gemm_pack_b_f32's panel from bf16 bits B.h, each widened to its float (a shift: exact). */
void gemm_pack_b_bf16_f32(float *dst, int64_t NR, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr);

/* The engines, each NULL when this build has no code for it (another target, or a compiler without the
 * instructions). Whether the CPU can run one is the dispatch's business, not theirs. */
const gemm_engine *gemm_engine_avx2_f32(void);       /* AVX2 + FMA, 6×16 */
const gemm_engine *gemm_engine_avx512_f32(void);     /* AVX-512F, 14×32 */
const gemm_engine *gemm_engine_avx512bf16(void);     /* AVX512-BF16 VDPBF16PS, 14×32 */
const gemm_engine *gemm_engine_amx_bf16(void);       /* AMX-BF16 tiles, 32×32 */
/* The VDPBF16PS engine's packers with a portable C tile kernel of the same arithmetic: lets tests check
 * that engine's panel layouts on any CPU (the real tile kernel runs where AVX512-BF16 exists). */
const gemm_engine *gemm_engine_dpbf16_portable(void);

/* The engines in use, chosen from the CPU and the ISA cap (DS4_ISA, ds4_isa_select). NULL: the
 * reference kernel of that family (cpu_gemm_*_ref, cpu_gemm_*_bf16_ref). */
typedef struct {
    ds4_isa isa;
    const gemm_engine *gemm_f32;
    const gemm_engine *gemm_bf16;
    const ds4_kernel_backend *kernels; /* the cpu backend's table (ds4_kernel_backend_cpu) */
    ds4_isa kernels_isa;               /* the level that table was compiled for (at most isa) */
} cpu_engines;
const cpu_engines *cpu_engines_active(void);

/* The cpu kernel table the dispatch runs at level isa: the one compiled for the highest level at or
 * below isa that this build has (*built: that level). Whether the CPU can run it is not asked here
 * (ds4_isa_best says): tests run each table the CPU allows against the generic one. */
const ds4_kernel_backend *cpu_kernels_for(ds4_isa isa, ds4_isa *built);

/* Tests only: run the bf16 GEMM family on this engine (NULL: back to the dispatch's choice). */
void kernels_override_gemm_bf16(const gemm_engine *e);

#endif
