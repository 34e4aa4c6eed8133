/* The public switches of the kernel layer: the name of a GEMM precision and the ISA level of the cpu
 * backend's engines (src/kernels/dispatch.c implements them). */
#ifndef DS4_PUBLIC_KERNELS_H
#define DS4_PUBLIC_KERNELS_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- matmul precision */
/* The GEMM precision is a property of the context (ds4_exec.matmul_precision, ds4/core.h). On the cpu
 * backend BF16 runs on AMX tiles, AVX512-BF16 dot products, or fp32 FMAs of the rounded operands,
 * whichever the CPU has (ds4_isa_current). Every CPU runs it. */
const char *ds4_matmul_precision_name(ds4_matmul_precision p); /* "fp32", "bf16" */

/* ---------------------------------------------------------------- backends */
/* The compute backends built into this ds4, chosen by name the same way by every command
 * (training.device, --device): "cpu" always. A context names the one it runs on (ds4_exec.backend). */
int ds4_backend_count(void);
const char *ds4_backend_name(int i); /* i < ds4_backend_count() */
/* What backend i runs on, for ds4 info: its devices one per line (e.g. the GPUs), or why it cannot run here
 * (ready's message), into buf [cap]; "" for a backend on the host. */
void ds4_backend_describe(int i, char *buf, size_t cap);
/* *out = the backend called `name`. An unknown name is an error naming `what` (the key or flag the name
 * came from) and listing the backends built in. */
ds4_status ds4_backend_find(const char *what, const char *name, const struct ds4_kernel_backend **out);
/* Whether backend b (NULL: the cpu) can run here: its device present and its runtime up, else an error
 * naming `what` and what is missing. A command that computes asks before any work; a plan (memplan) needs
 * no device. */
ds4_status ds4_backend_ready(const char *what, const struct ds4_kernel_backend *b);
/* Whether the buffers of x's backend (in a plan: of the backend planned for) are ordinary host memory that
 * the host's libraries may read and write directly (the cpu's), or device memory that crosses to the host
 * only through the backend's copies (a GPU's, cpu-guard's): the communicator stages such buffers. */
bool ds4_exec_host_memory(const ds4_exec *x);

/* ---------------------------------------------------------------- kernel engines (ISA levels) */
/* The kernels are built for the target's baseline; engines for richer instruction sets are compiled
 * on the side and chosen at run time, once, from CPUID (and, for AMX, Linux's tile permission). Levels
 * are ordered: each includes the ones below it. The environment variable DS4_ISA (generic, avx2,
 * avx512, avx512bf16, amx) caps the level, e.g. to test the portable path on a big machine. */
typedef enum {
    DS4_ISA_GENERIC = 0, /* portable C: the reference GEMMs */
    DS4_ISA_AVX2,        /* AVX2 + FMA */
    DS4_ISA_AVX512,      /* AVX-512 F/VL/BW/DQ */
    DS4_ISA_AVX512BF16,  /* + AVX512-BF16 */
    DS4_ISA_AMX,         /* + AMX-TILE, AMX-BF16, tile data granted by the OS */
    DS4_ISA_COUNT
} ds4_isa;
const char *ds4_isa_name(ds4_isa isa);             /* "generic", "avx2", ... */
bool ds4_isa_parse(const char *s, ds4_isa *out);   /* the inverse; false for an unknown name */
ds4_isa ds4_isa_best(void);                        /* the best level this CPU and OS run */
ds4_isa ds4_isa_current(void);                     /* the level the kernels use now */
/* Use at most `isa` from now on. Fails (level unchanged) when the CPU lacks it; the message says what
 * is missing. Not while kernels run. */
ds4_status ds4_isa_select(ds4_isa isa);
/* Applies DS4_ISA if set: an unknown name or a level above the CPU's is an error naming the variable. */
ds4_status ds4_isa_from_env(void);
/* What was found and chosen, several lines for `ds4 info`: CPU features, level, engine of each family. */
void ds4_isa_describe(char *buf, size_t n);

#ifdef __cplusplus
}
#endif
#endif
