/* Run-time choice of kernel engines: the CPU's features are read once (CPUID, the OS's saved-state mask
 * XCR0, Linux's AMX permission), give the best ISA level, DS4_ISA or ds4_isa_select may cap it, and the
 * level picks the engine of each kernel family (dispatch.h). Nothing here assumes a CPU model. */
#include <errno.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define DS4_X86 1
#else
#define DS4_X86 0
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "kernels/cpu/cpu.h"
#include "kernels/dispatch.h"
#include "kernels/kernels.h"

/* The cpu kernel tables of the levels above generic exist where the Makefile built them
 * (-DDS4_CPU_LEVELS) and a level above generic can be chosen at all. */
#if DS4_X86_ENGINES && defined(DS4_CPU_LEVELS)
#define CPU_LEVEL_TABLES 1
#else
#define CPU_LEVEL_TABLES 0
#endif

/* The Makefile compiles x86/ only for an x86-64 target: elsewhere its engines are absent. */
#ifdef DS4_NO_X86_DIR
const gemm_engine *gemm_engine_avx2_f32(void) { return NULL; }
const gemm_engine *gemm_engine_avx512_f32(void) { return NULL; }
const gemm_engine *gemm_engine_avx512bf16(void) { return NULL; }
const gemm_engine *gemm_engine_amx_bf16(void) { return NULL; }
const gemm_engine *gemm_engine_dpbf16_portable(void) { return NULL; }
#endif

/* ---------------------------------------------------------------- CPU features */

typedef struct {
    char brand[49];
    bool fma, avx2, avx512f, avx512vl, avx512bw, avx512dq, avx512bf16, amx_tile, amx_bf16;
    bool os_ymm, os_zmm, os_tiles; /* the OS saves these registers (XCR0) */
    int amx_permission;            /* 0: Linux granted tile data; else an errno value */
} cpu_features;

#if DS4_X86
static bool bit(unsigned reg, int b) { return (reg >> b) & 1u; }

static uint64_t read_xcr0(void) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

/* Linux keeps AMX tile data off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA = 18);
 * the grant is process-wide, for present and future threads. Returns 0 or an errno value. */
static int request_amx_permission(void) {
#if defined(__linux__) && defined(__x86_64__)
    enum { ARCH_GET_XCOMP_PERM_ = 0x1022, ARCH_REQ_XCOMP_PERM_ = 0x1023, XFEATURE_XTILEDATA_ = 18 };
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM_, XFEATURE_XTILEDATA_) != 0) return errno;
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM_, &granted) != 0) return errno;
    return granted & (1ul << XFEATURE_XTILEDATA_) ? 0 : EPERM;
#else
    return ENOSYS;
#endif
}

static void read_brand(char brand[49]) {
    unsigned r[12] = {0}, a, b, c, d;
    brand[0] = 0;
    if (!__get_cpuid(0x80000000u, &a, &b, &c, &d) || a < 0x80000004u) return;
    for (unsigned i = 0; i < 3; i++) __get_cpuid(0x80000002u + i, &r[4 * i], &r[4 * i + 1], &r[4 * i + 2], &r[4 * i + 3]);
    memcpy(brand, r, 48);
    brand[48] = 0;
    size_t s = 0, n = strlen(brand);
    while (s < n && brand[s] == ' ') s++;
    memmove(brand, brand + s, n - s + 1);
}

static void detect(cpu_features *f) {
    unsigned a, b, c, d;
    read_brand(f->brand);
    if (!__get_cpuid(1, &a, &b, &c, &d)) return;
    bool osxsave = bit(c, 27), avx = bit(c, 28);
    f->fma = bit(c, 12);
    uint64_t xcr0 = osxsave ? read_xcr0() : 0;
    f->os_ymm = avx && (xcr0 & 0x6) == 0x6;                /* SSE, AVX state */
    f->os_zmm = f->os_ymm && (xcr0 & 0xe0) == 0xe0;        /* opmask, ZMM_Hi256, Hi16_ZMM */
    f->os_tiles = (xcr0 & (3ull << 17)) == (3ull << 17);   /* XTILECFG, XTILEDATA */
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        f->avx2 = bit(b, 5);
        f->avx512f = bit(b, 16);
        f->avx512dq = bit(b, 17);
        f->avx512bw = bit(b, 30);
        f->avx512vl = bit(b, 31);
        f->amx_bf16 = bit(d, 22);
        f->amx_tile = bit(d, 24);
        unsigned max_sub = a;
        if (max_sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &c, &d)) f->avx512bf16 = bit(a, 5);
    }
    f->amx_permission = f->amx_tile && f->amx_bf16 && f->os_tiles ? request_amx_permission() : ENOTSUP;
}
#else
static void detect(cpu_features *f) { f->amx_permission = ENOTSUP; }
#endif

/* What level `isa` needs that this CPU (or this build) lacks, or NULL. */
static const char *missing_for(const cpu_features *f, ds4_isa isa) {
    if (isa >= DS4_ISA_AVX2) {
        if (!DS4_X86) return "an x86-64 CPU";
        if (!DS4_X86_ENGINES) return "x86 engines in this build (built portable-only or by a compiler without them)";
        if (!f->avx2) return "AVX2";
        if (!f->fma) return "FMA";
        if (!f->os_ymm) return "OS support for AVX state (XCR0)";
    }
    if (isa >= DS4_ISA_AVX512) {
        if (!f->avx512f) return "AVX512F";
        if (!f->avx512vl) return "AVX512VL";
        if (!f->avx512bw) return "AVX512BW";
        if (!f->avx512dq) return "AVX512DQ";
        if (!f->os_zmm) return "OS support for AVX-512 state (XCR0)";
    }
    if (isa >= DS4_ISA_AVX512BF16 && !f->avx512bf16) return "AVX512-BF16";
    if (isa >= DS4_ISA_AMX) {
        if (!f->amx_tile) return "AMX-TILE";
        if (!f->amx_bf16) return "AMX-BF16";
        if (!f->os_tiles) return "OS support for AMX tile state (XCR0)";
        if (f->amx_permission) return "Linux's AMX tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM)";
    }
    return NULL;
}

/* ---------------------------------------------------------------- levels and tables */

static const char *const k_isa_names[DS4_ISA_COUNT] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};

const char *ds4_isa_name(ds4_isa isa) { return isa >= 0 && isa < DS4_ISA_COUNT ? k_isa_names[isa] : "?"; }

bool ds4_isa_parse(const char *s, ds4_isa *out) {
    for (int i = 0; s && i < DS4_ISA_COUNT; i++)
        if (!strcmp(s, k_isa_names[i])) {
            *out = (ds4_isa)i;
            return true;
        }
    return false;
}

static struct {
    pthread_once_t once;
    cpu_features cpu;
    ds4_isa best, cap;
    bool env_bad; /* DS4_ISA set but unusable: the cap went to generic, ds4_isa_from_env says why */
    cpu_engines table;
    gemm_engine avx2_bf16, avx512_bf16; /* the fp32 engines run on bf16-rounded panels */
    const gemm_engine *bf16_override;
} g = {.once = PTHREAD_ONCE_INIT};

static const gemm_engine *as_bf16(gemm_engine *slot, const gemm_engine *f32, const char *name) {
    if (!f32) return NULL;
    *slot = *f32;
    slot->round_bf16 = 1;
    slot->name = name;
    return slot;
}

const ds4_kernel_backend *cpu_kernels_for(ds4_isa isa, ds4_isa *built) {
#if CPU_LEVEL_TABLES
    if (isa >= DS4_ISA_AVX512) return *built = DS4_ISA_AVX512, &ds4_cpu_kernels_avx512;
    if (isa >= DS4_ISA_AVX2) return *built = DS4_ISA_AVX2, &ds4_cpu_kernels_avx2;
#else
    (void)isa;
#endif
    *built = DS4_ISA_GENERIC;
    return &ds4_cpu_kernels_generic;
}

/* The engine of each family at level `isa`: the best one this build has at or below it. */
static void fill_table(ds4_isa isa) {
    cpu_engines *t = &g.table;
    t->isa = isa;
    t->kernels = cpu_kernels_for(isa, &t->kernels_isa);
    t->gemm_f32 = NULL;
    if (isa >= DS4_ISA_AVX512) t->gemm_f32 = gemm_engine_avx512_f32();
    if (!t->gemm_f32 && isa >= DS4_ISA_AVX2) t->gemm_f32 = gemm_engine_avx2_f32();
    t->gemm_bf16 = NULL;
    if (isa >= DS4_ISA_AMX) t->gemm_bf16 = gemm_engine_amx_bf16();
    if (!t->gemm_bf16 && isa >= DS4_ISA_AVX512BF16) t->gemm_bf16 = gemm_engine_avx512bf16();
    if (!t->gemm_bf16 && isa >= DS4_ISA_AVX512)
        t->gemm_bf16 = as_bf16(&g.avx512_bf16, gemm_engine_avx512_f32(), "avx512 fp32 FMA 14x32 on bf16-rounded operands");
    if (!t->gemm_bf16 && isa >= DS4_ISA_AVX2)
        t->gemm_bf16 = as_bf16(&g.avx2_bf16, gemm_engine_avx2_f32(), "avx2 fp32 FMA 6x16 on bf16-rounded operands");
    if (g.bf16_override) t->gemm_bf16 = g.bf16_override;
}

static ds4_isa min_isa(ds4_isa a, ds4_isa b) { return a < b ? a : b; }

static void init_once(void) {
    detect(&g.cpu);
    g.best = DS4_ISA_GENERIC;
    for (int i = DS4_ISA_AVX2; i < DS4_ISA_COUNT && !missing_for(&g.cpu, (ds4_isa)i); i++) g.best = (ds4_isa)i;
    g.cap = g.best;
    const char *env = getenv("DS4_ISA");
    ds4_isa want;
    if (env && *env) {
        if (ds4_isa_parse(env, &want) && want <= g.best) g.cap = want;
        else g.env_bad = true, g.cap = DS4_ISA_GENERIC;
    }
    fill_table(min_isa(g.cap, g.best));
}

static void ensure_init(void) { pthread_once(&g.once, init_once); }

const cpu_engines *cpu_engines_active(void) {
    ensure_init();
    return &g.table;
}

const ds4_kernel_backend *ds4_kernel_backend_cpu(void) {
    ensure_init();
    return g.table.kernels;
}

ds4_isa ds4_isa_best(void) {
    ensure_init();
    return g.best;
}

ds4_isa ds4_isa_current(void) {
    ensure_init();
    return g.table.isa;
}

ds4_status ds4_isa_select(ds4_isa isa) {
    ensure_init();
    if (isa < 0 || isa >= DS4_ISA_COUNT)
        return ds4_fail(DS4_ERR_ARG, "ISA level %d: unknown (expected generic, avx2, avx512, avx512bf16 or amx)",
                        (int)isa);
    const char *missing = missing_for(&g.cpu, isa);
    if (missing)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "ISA level %s: unavailable, missing %s (best level here: %s)",
                        ds4_isa_name(isa), missing, ds4_isa_name(g.best));
    g.cap = isa;
    fill_table(isa);
    return DS4_OK;
}

ds4_status ds4_isa_from_env(void) {
    ensure_init();
    const char *env = getenv("DS4_ISA");
    if (!env || !*env) return DS4_OK;
    ds4_isa want;
    if (!ds4_isa_parse(env, &want))
        return ds4_fail(DS4_ERR_ARG, "DS4_ISA=%s: unknown level (expected generic, avx2, avx512, avx512bf16 or amx)",
                        env);
    if (g.env_bad) {
        ds4_status st = ds4_isa_select(want); /* fails, and says what the CPU lacks */
        return ds4_fail_prefix(st, "DS4_ISA");
    }
    return DS4_OK;
}

void kernels_override_gemm_bf16(const gemm_engine *e) {
    ensure_init();
    g.bf16_override = e;
    fill_table(g.table.isa);
}

/* ---------------------------------------------------------------- precision names */

const char *ds4_matmul_precision_name(ds4_matmul_precision p) {
    return p == DS4_MATMUL_FP32 ? "fp32" : p == DS4_MATMUL_BF16 ? "bf16" : "?";
}

/* ---------------------------------------------------------------- description */

static void append(char *buf, size_t n, size_t *at, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void append(char *buf, size_t n, size_t *at, const char *fmt, ...) {
    if (*at >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *at, n - *at, fmt, ap);
    va_end(ap);
    if (w > 0) *at += (size_t)w < n - *at ? (size_t)w : n - *at - 1;
}

void ds4_isa_describe(char *buf, size_t n) {
    ensure_init();
    if (!buf || n == 0) return;
    buf[0] = 0;
    size_t at = 0;
    const cpu_features *f = &g.cpu;
    append(buf, n, &at, "cpu: %s\n", f->brand[0] ? f->brand : (DS4_X86 ? "x86 (no brand string)" : "not x86"));
    static const char *names[] = {"fma",      "avx2",       "avx512f",  "avx512vl", "avx512bw",
                                  "avx512dq", "avx512bf16", "amx-tile", "amx-bf16"};
    const bool has[] = {f->fma,      f->avx2,       f->avx512f,  f->avx512vl, f->avx512bw,
                        f->avx512dq, f->avx512bf16, f->amx_tile, f->amx_bf16};
    append(buf, n, &at, "cpu features:");
    for (size_t i = 0; i < sizeof has / sizeof *has; i++)
        if (has[i]) append(buf, n, &at, " %s", names[i]);
    append(buf, n, &at, "\ncpu lacks:");
    for (size_t i = 0; i < sizeof has / sizeof *has; i++)
        if (!has[i]) append(buf, n, &at, " %s", names[i]);
    append(buf, n, &at, "\nos saves: ymm %s, zmm %s, amx tiles %s%s\n", f->os_ymm ? "yes" : "no", f->os_zmm ? "yes" : "no",
           f->os_tiles ? "yes" : "no",
           f->amx_tile && f->os_tiles ? (f->amx_permission ? " (tile data refused)" : " (tile data granted)") : "");
    const char *env = getenv("DS4_ISA");
    append(buf, n, &at, "isa level: %s (best on this cpu: %s; DS4_ISA %s%s)\n", ds4_isa_name(g.table.isa),
           ds4_isa_name(g.best), env && *env ? "= " : "unset", env && *env ? env : "");
    if (g.best < DS4_ISA_COUNT - 1)
        append(buf, n, &at, "next level (%s) needs: %s\n", ds4_isa_name((ds4_isa)(g.best + 1)),
               missing_for(f, (ds4_isa)(g.best + 1)));
    append(buf, n, &at, "kernel backend: %s\n", ds4_kernel_backend_cpu()->name);
    append(buf, n, &at, "gemm fp32: %s\n", g.table.gemm_f32 ? g.table.gemm_f32->name : "portable C reference (one fp32 sum per element, k ascending)");
    append(buf, n, &at, "gemm bf16: %s\n", g.table.gemm_bf16 ? g.table.gemm_bf16->name : "portable C bf16 reference (double accumulation)");
    static const char *const level_flags[DS4_ISA_COUNT] = {
        [DS4_ISA_GENERIC] = "the build's baseline",
        [DS4_ISA_AVX2] = "AVX2 + FMA units",
        [DS4_ISA_AVX512] = "AVX-512 F/VL/BW/DQ",
    };
    append(buf, n, &at, "other kernels: %s: portable C compiled for %s (OpenMP; no FMA contraction: the bits of generic)\n",
           ds4_isa_name(g.table.kernels_isa), level_flags[g.table.kernels_isa]);
}
