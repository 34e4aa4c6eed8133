/* The cpu backend's GEMM: the blocked driver behind its gemm_nt/nn/tn entries (cpu_gemm_*), portable C
 * built for the target's baseline. It runs the engine that the dispatch (dispatch.c) chose for the
 * current matmul precision: the engine brings its panel layouts, packers, register-tile kernel and
 * blocking sizes (x86/); without an engine (DS4_ISA=generic, a CPU below AVX2, a non-x86 target) the
 * reference GEMMs compute (cpu/gemm.c, cpu/gemm_bf16.c). The plan backend's GEMM (cpu_gemm_*_plan)
 * takes the same packing buffers and computes nothing.
 *
 * Layout (the classic five loops): for each NC-wide column block of C and each KC-deep slice of K,
 * B's slice is packed once into NR-wide panels; the output is cut into tasks (MC rows × up to NT
 * columns) shared among the threads; a task packs its MC×kc slice of A into MR-tall panels and runs the
 * MR×NR tile kernel over its panels.
 *
 * Determinism: C[i,j] = beta·C[i,j] + Σ over K slices of (the engine's sum over the slice, k
 * ascending), slices added in order. The K slicing is fixed by the engine, so every element gets the
 * same operations in the same order whichever thread computes it and whatever the thread count or tile
 * position. Rounding differs from the reference (FMA, slice partial sums), not its meaning. */
#include <omp.h>
#include <string.h>

#include "ds4/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/dispatch.h"

/* The packing workspace is sized for the largest slices of any engine: KC × NC of B, KC × MC of A per
 * thread, in floats (the bf16 engines' slices are twice as deep with half the bytes per element). */
#define POOL_KC 256
#define POOL_NC 8192
#define POOL_MC 224
#define PAR_MIN ((int64_t)1 << 20) /* below this many multiply-adds, one thread */

/* ---------------------------------------------------------------- portable packers */

void gemm_pack_a_f32(float *dst, int64_t MR, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
    for (int64_t k = 0; k < kc; k++)
        for (int64_t r = 0; r < MR; r++) dst[k * MR + r] = r < mr ? A.p[(i0 + r) * A.rs + (k0 + k) * A.cs] : 0.0f;
}

void gemm_pack_b_f32(float *dst, int64_t NR, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    if (B.cs == 1) { /* rows of B contiguous in j */
        for (int64_t k = 0; k < kc; k++) {
            const float *src = B.p + (k0 + k) * B.rs + j0;
            for (int64_t c = 0; c < NR; c++) dst[k * NR + c] = c < nr ? src[c] : 0.0f;
        }
        return;
    }
    for (int64_t c = 0; c < NR; c++) { /* B^T stored: column c is a run over k */
        const float *src = B.p + (j0 + c) * B.cs + k0 * B.rs;
        for (int64_t k = 0; k < kc; k++) dst[k * NR + c] = c < nr ? src[k * B.rs] : 0.0f;
    }
}

void gemm_pack_b_bf16_f32(float *dst, int64_t NR, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    if (B.cs == 1) { /* rows of B contiguous in j */
        for (int64_t k = 0; k < kc; k++) {
            const uint16_t *src = B.h + (k0 + k) * B.rs + j0;
            for (int64_t c = 0; c < NR; c++) dst[k * NR + c] = c < nr ? bf16_widen(src[c]) : 0.0f;
        }
        return;
    }
    for (int64_t c = 0; c < NR; c++) { /* B^T stored: column c is a run over k */
        const uint16_t *src = B.h + (j0 + c) * B.cs + k0 * B.rs;
        for (int64_t k = 0; k < kc; k++) dst[k * NR + c] = c < nr ? bf16_widen(src[k * B.rs]) : 0.0f;
    }
}

/* In place: every value of a packed fp32 panel rounded to bf16 (gemm_bf16_round; zeros stay zeros). */
static void round_panel_bf16(void *panel, size_t bytes) {
    bf16_round_array(panel, (int64_t)(bytes / sizeof(float)));
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }

/* Task shape: start from mc rows × nt columns and shrink (columns first, then rows) until there
 * are at least 4 tasks per thread, so threads stay balanced on skinny outputs. Only the split of
 * the work changes, never the arithmetic of an element. */
static void task_shape(const gemm_engine *e, int64_t M, int64_t N, int nth, int64_t *mc, int64_t *nt) {
    *mc = e->mc;
    *nt = e->nt;
    if (nth <= 1) return;
    while (cdiv(M, *mc) * cdiv(N, *nt) < 4 * nth && *nt > 2 * e->nr) *nt /= 2;
    while (cdiv(M, *mc) * cdiv(N, *nt) < 4 * nth && *mc > 4 * e->mr) *mc = e->mr * (*mc / e->mr / 2);
}

/* Packing workspace reserved for a model's lifetime: GEMMs inside a pass then allocate nothing, so a
 * pass's memory (and memplan's prediction of it) does not depend on the routing of tokens to experts.
 * Reserved whatever the engine (even none), so a plan does not depend on the CPU that makes it. A pool
 * the plan backend reserved (counted, no memory behind it) serves only plan GEMMs; one the cpu backend
 * reserved, only real ones. */
#define POOL_B_BYTES ((size_t)POOL_KC * POOL_NC * sizeof(float))
#define POOL_A_BYTES ((size_t)POOL_KC * POOL_MC * sizeof(float)) /* per thread */
static struct {
    char *bp, *ap;
    int threads;
    int refs;
    bool plan; /* reserved by the plan backend */
} g_ws;

static void workspace_reserve(bool plan) {
    if (g_ws.refs++ > 0) return;
    g_ws.threads = omp_get_max_threads();
    g_ws.plan = plan;
    g_ws.bp = ds4_alloc_for(plan, DS4_MEM_WORK, POOL_B_BYTES);
    g_ws.ap = ds4_alloc_for(plan, DS4_MEM_WORK, (size_t)g_ws.threads * POOL_A_BYTES);
}

void cpu_gemm_workspace_reserve(void) { workspace_reserve(false); }
void cpu_gemm_workspace_reserve_plan(void) { workspace_reserve(true); }

void cpu_gemm_workspace_release(void) {
    if (g_ws.refs <= 0 || --g_ws.refs > 0) return;
    ds4_free(g_ws.bp);
    ds4_free(g_ws.ap);
    memset(&g_ws, 0, sizeof g_ws);
}

static bool workspace_usable(bool plan, int nth, size_t b_bytes, size_t a_bytes) {
    return g_ws.bp && g_ws.ap && nth <= g_ws.threads && g_ws.plan == plan && !omp_in_parallel() &&
           b_bytes <= POOL_B_BYTES && a_bytes <= POOL_A_BYTES;
}

/* The packing buffers of one GEMM (M, N, K > 0) on engine e: B slices at bp; nth threads' packed A
 * blocks at ap, a_bytes apart; the task shape mc × nt. From the pool when it fits (pooled), else
 * allocated. */
typedef struct {
    char *bp, *ap;
    size_t a_bytes;
    int nth;
    int64_t mc, nt;
    bool pooled;
} gemm_buffers;

/* False (nothing held) when an allocation failed. plan: the caller is the plan backend. */
static bool buffers_take(gemm_buffers *w, bool plan, const gemm_engine *e, int64_t M, int64_t N, int64_t K) {
    int nth = omp_in_parallel() || M * N * K < PAR_MIN ? 1 : omp_get_max_threads();
    int64_t nc_max = min64(N, e->nc), kcp_max = round_up(min64(K, e->kc), e->kalign), mc, nt;
    task_shape(e, M, nc_max, nth, &mc, &nt);
    if (nth > cdiv(M, mc) * cdiv(nc_max, nt)) nth = (int)(cdiv(M, mc) * cdiv(nc_max, nt));
    size_t b_bytes = (size_t)(kcp_max * round_up(nc_max, e->nr)) * e->elem;
    size_t a_bytes = (size_t)(kcp_max * round_up(min64(M, mc), e->mr)) * e->elem; /* packed A per thread */
    *w = (gemm_buffers){.nth = nth, .mc = mc, .nt = nt, .pooled = workspace_usable(plan, nth, b_bytes, a_bytes)};
    if (w->pooled) {
        w->bp = g_ws.bp;
        w->ap = g_ws.ap;
        w->a_bytes = POOL_A_BYTES; /* the pool's per-thread stride */
        return true;
    }
    w->bp = ds4_alloc_for(plan, DS4_MEM_WORK, b_bytes);
    w->ap = ds4_alloc_for(plan, DS4_MEM_WORK, (size_t)nth * a_bytes);
    w->a_bytes = a_bytes;
    if (w->bp && w->ap) return true;
    ds4_free(w->bp);
    ds4_free(w->ap);
    return false;
}

static void buffers_give_back(const gemm_buffers *w) {
    if (w->pooled) return;
    ds4_free(w->bp);
    ds4_free(w->ap);
}

/* One K slice [pc, pc + kc) of one column block [jc, jc + nc) of a product: what its packers and tiles
 * need. The threaded and the serial loops below run the same three steps on it. */
typedef struct {
    const gemm_engine *e;
    void (*pack_b)(void *, gemm_view, int64_t, int64_t, int64_t, int64_t);
    bool round_b; /* round B's packed fp32 panels to bf16 (an fp32 engine run as a bf16 one) */
    gemm_view A, B;
    float *C;
    int64_t ldc, M, mc, nt, jc, nc, pc, kc;
    size_t a_pan, b_pan; /* bytes of one packed A, B panel */
    float cscale;        /* beta on the first slice, then 1 */
    char *bp;            /* the slice's packed B */
} gemm_slice;

static gemm_slice slice_of(const gemm_engine *e, const gemm_buffers *w, int64_t M, gemm_view A, gemm_view B,
                           float *C, int64_t ldc, float beta, int64_t N, int64_t K, int64_t jc, int64_t pc) {
    /* B given as bf16 bits: its panels are bf16 values already, rounding them again would change nothing */
    gemm_slice s = {.e = e, .pack_b = B.h ? e->pack_b_bf16 : e->pack_b, .round_b = e->round_bf16 && !B.h, .A = A,
                    .B = B, .C = C, .ldc = ldc, .M = M, .mc = w->mc, .nt = w->nt, .jc = jc,
                    .nc = min64(e->nc, N - jc), .pc = pc, .kc = min64(e->kc, K - pc), .cscale = pc == 0 ? beta : 1,
                    .bp = w->bp};
    int64_t kcp = round_up(s.kc, e->kalign);
    s.a_pan = (size_t)(kcp * e->mr) * e->elem;
    s.b_pan = (size_t)(kcp * e->nr) * e->elem;
    return s;
}

/* Panel p of the slice's B (cdiv(nc, nr) panels). */
static void slice_pack_b(const gemm_slice *s, int64_t p) {
    const gemm_engine *e = s->e;
    char *pan = s->bp + (size_t)p * s->b_pan;
    s->pack_b(pan, s->B, s->pc, s->kc, s->jc + p * e->nr, min64(e->nr, s->nc - p * e->nr));
    if (s->round_b) round_panel_bf16(pan, s->b_pan);
}

/* Row block ib of A (rows [ib·mc, +mc)) into apt: cdiv(rows, mr) panels. */
static void slice_pack_a(const gemm_slice *s, char *apt, int64_t ib) {
    const gemm_engine *e = s->e;
    const int64_t i0 = ib * s->mc, mcur = min64(s->mc, s->M - i0);
    for (int64_t ir = 0; ir < mcur; ir += e->mr) {
        char *pan = apt + (size_t)(ir / e->mr) * s->a_pan;
        e->pack_a(pan, s->A, i0 + ir, min64(e->mr, mcur - ir), s->pc, s->kc);
        if (e->round_bf16) round_panel_bf16(pan, s->a_pan);
    }
}

/* Task (ib, jt): the tiles of row block ib (packed at apt) × columns [jt·nt, +nt) of the block. */
static void slice_task(const gemm_slice *s, const char *apt, int64_t ib, int64_t jt) {
    const gemm_engine *e = s->e;
    const int64_t i0 = ib * s->mc, mcur = min64(s->mc, s->M - i0), j_end = min64(s->nc, (jt + 1) * s->nt);
    for (int64_t jr = jt * s->nt; jr < j_end; jr += e->nr) {
        const char *b = s->bp + (size_t)(jr / e->nr) * s->b_pan;
        for (int64_t ir = 0; ir < mcur; ir += e->mr)
            e->tile(s->kc, apt + (size_t)(ir / e->mr) * s->a_pan, b, s->C + (i0 + ir) * s->ldc + s->jc + jr, s->ldc,
                    min64(e->mr, mcur - ir), min64(e->nr, j_end - jr), s->cscale);
    }
}

/* C[M,N] = beta·C + A·B with A viewed M×K and B viewed K×N (M, N, K > 0), packed in the buffers w, on
 * w->nth threads. */
static void gemm_run(const gemm_engine *e, const gemm_buffers *w, int64_t M, int64_t N, int64_t K, gemm_view A,
                     gemm_view B, float *C, int64_t ldc, float beta) {
#pragma omp parallel num_threads(w->nth)
    {
        char *apt = w->ap + (size_t)omp_get_thread_num() * w->a_bytes;
        if (e->thread_begin) e->thread_begin();
        for (int64_t jc = 0; jc < N; jc += e->nc)
            for (int64_t pc = 0; pc < K; pc += e->kc) {
                const gemm_slice s = slice_of(e, w, M, A, B, C, ldc, beta, N, K, jc, pc);
                const int64_t ntn = cdiv(s.nc, s.nt), ntasks = cdiv(M, s.mc) * ntn;
#pragma omp for schedule(static)
                for (int64_t p = 0; p < cdiv(s.nc, e->nr); p++) slice_pack_b(&s, p);
                /* tasks in row-block-major order; a thread keeps its packed A block while it
                 * takes tasks of the same row block. Dynamic: a descheduled thread does not hold
                 * the others back (results do not depend on who computes a task). */
                int64_t packed_ib = -1;
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < ntasks; t++) {
                    if (t / ntn != packed_ib) slice_pack_a(&s, apt, packed_ib = t / ntn);
                    slice_task(&s, apt, t / ntn, t % ntn);
                }
            }
        if (e->thread_end) e->thread_end();
    }
}

/* The same product on the calling thread, without OpenMP (kernels that run it per block call it
 * thousands of times a step: no team to start). */
static void gemm_run_here(const gemm_engine *e, const gemm_buffers *w, int64_t M, int64_t N, int64_t K, gemm_view A,
                          gemm_view B, float *C, int64_t ldc, float beta) {
    if (e->thread_begin) e->thread_begin();
    for (int64_t jc = 0; jc < N; jc += e->nc)
        for (int64_t pc = 0; pc < K; pc += e->kc) {
            const gemm_slice s = slice_of(e, w, M, A, B, C, ldc, beta, N, K, jc, pc);
            for (int64_t p = 0; p < cdiv(s.nc, e->nr); p++) slice_pack_b(&s, p);
            for (int64_t ib = 0; ib < cdiv(M, s.mc); ib++) {
                slice_pack_a(&s, w->ap, ib);
                for (int64_t jt = 0; jt < cdiv(s.nc, s.nt); jt++) slice_task(&s, w->ap, ib, jt);
            }
        }
    if (e->thread_end) e->thread_end();
}

/* C = beta·C for an empty sum (K = 0). */
static void gemm_scale_only(int64_t M, int64_t N, float *C, int64_t ldc, float beta) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0 ? 0 : beta * C[i * ldc + j];
}

/* C[M,N] = beta·C + A·B with A viewed M×K and B viewed K×N. Returns false (nothing written) when
 * the packing buffers cannot be allocated. */
static bool gemm_fast(const gemm_engine *e, int64_t M, int64_t N, int64_t K, gemm_view A, gemm_view B, float *C,
                      int64_t ldc, float beta) {
    if (M <= 0 || N <= 0) return true;
    if (K <= 0) {
        gemm_scale_only(M, N, C, ldc, beta);
        return true;
    }
    if (!(B.h ? e->pack_b_bf16 : e->pack_b)) return false;
    gemm_buffers w;
    if (!buffers_take(&w, false, e, M, N, K)) return false;
    gemm_run(e, &w, M, N, K, A, B, C, ldc, beta);
    buffers_give_back(&w);
    return true;
}

/* ---------------------------------------------------------------- one thread, the caller's buffer */

/* The serial GEMMs' buffer bound, whatever the engine (a plan must not depend on the CPU that makes it):
 * fp32 panels KC deep; B's columns and A's rows rounded up to any multiple of at most SERIAL_ROUND (every
 * fp32 engine's nr, mr) fit in the count + SERIAL_ROUND. */
#define SERIAL_ROUND 32
size_t cpu_gemm_serial_bytes(int64_t M, int64_t N, int64_t K) {
    if (M <= 0 || N <= 0 || K <= 0) return 0;
    int64_t kc = min64(K < 16 ? 16 : K, POOL_KC); /* the bf16 engines pad K up to 32 at 2 bytes */
    return (size_t)(kc * (min64(N, POOL_NC) + min64(M, POOL_MC) + 2 * SERIAL_ROUND)) * sizeof(float) + 128;
}

/* Engine e's product on one thread with ws (cpu_gemm_serial_bytes(M, N, K) bytes, any alignment: the
 * bound holds 64 bytes to align the panels); false when there is no engine, it cannot read B as given, or
 * its panels would not fit (the caller then runs the reference the driver would run). */
static bool gemm_serial(const gemm_engine *e, void *ws, int64_t M, int64_t N, int64_t K, gemm_view A, gemm_view B,
                        float *C, int64_t ldc, float beta) {
    if (!e || !(B.h ? e->pack_b_bf16 : e->pack_b)) return false;
    if (M <= 0 || N <= 0) return true;
    if (K <= 0) {
        gemm_scale_only(M, N, C, ldc, beta);
        return true;
    }
    int64_t kcp = round_up(min64(K, e->kc), e->kalign);
    size_t b_bytes = (size_t)(kcp * round_up(min64(N, e->nc), e->nr)) * e->elem, b_room = (b_bytes + 63) & ~(size_t)63;
    size_t a_bytes = (size_t)(kcp * round_up(min64(M, e->mc), e->mr)) * e->elem;
    if (b_room + a_bytes + 64 > cpu_gemm_serial_bytes(M, N, K)) return false;
    char *bp = (char *)(((uintptr_t)ws + 63) & ~(uintptr_t)63); /* panels are loaded aligned */
    gemm_buffers w = {.bp = bp, .ap = bp + b_room, .a_bytes = a_bytes, .nth = 1, .mc = e->mc, .nt = e->nt,
                      .pooled = true};
    gemm_run_here(e, &w, M, N, K, A, B, C, ldc, beta);
    return true;
}

/* The engine of matmul precision prec; NULL: the reference of that precision computes. */
static const gemm_engine *engine_of(ds4_matmul_precision prec, bool *bf16) {
    const cpu_engines *t = cpu_engines_active();
    *bf16 = prec == DS4_MATMUL_BF16;
    return *bf16 ? t->gemm_bf16 : t->gemm_f32;
}

/* The bf16 GEMM with B given as bf16 bits (a weight's compute copy), whatever the matmul precision:
 * the same bits as cpu_gemm_nt/nn in bf16 precision on the fp32 values the bits were rounded from. */
static const gemm_engine *bf16_engine(void) { return cpu_engines_active()->gemm_bf16; }

/* C[M,N] = beta*C + A[M,K] · B[N,K]^T, on this thread */
void cpu_gemm_serial_nt(ds4_matmul_precision prec, void *ws, int64_t M, int64_t N, int64_t K, const float *A,
                        int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    bool bf16;
    const gemm_engine *e = engine_of(prec, &bf16);
    if (!gemm_serial(e, ws, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){B, 1, ldb, NULL}, C, ldc, beta))
        (bf16 ? cpu_gemm_nt_bf16_ref : cpu_gemm_nt_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N], on this thread */
void cpu_gemm_serial_nn(ds4_matmul_precision prec, void *ws, int64_t M, int64_t N, int64_t K, const float *A,
                        int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    bool bf16;
    const gemm_engine *e = engine_of(prec, &bf16);
    if (!gemm_serial(e, ws, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){B, ldb, 1, NULL}, C, ldc, beta))
        (bf16 ? cpu_gemm_nn_bf16_ref : cpu_gemm_nn_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[K,M]^T · B[K,N], on this thread */
void cpu_gemm_serial_tn(ds4_matmul_precision prec, void *ws, int64_t M, int64_t N, int64_t K, const float *A,
                        int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    bool bf16;
    const gemm_engine *e = engine_of(prec, &bf16);
    if (!gemm_serial(e, ws, M, N, K, (gemm_view){A, 1, lda, NULL}, (gemm_view){B, ldb, 1, NULL}, C, ldc, beta))
        (bf16 ? cpu_gemm_tn_bf16_ref : cpu_gemm_tn_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[N,K]^T, B: bf16 bits, on this thread (cpu_gemm_nt_hb's bits) */
void cpu_gemm_serial_nt_hb(void *ws, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B,
                           int64_t ldb, float *C, int64_t ldc, float beta) {
    if (!gemm_serial(bf16_engine(), ws, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){NULL, 1, ldb, B}, C, ldc,
                     beta))
        cpu_gemm_nt_hb_ref(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N], B: bf16 bits, on this thread (cpu_gemm_nn_hb's bits) */
void cpu_gemm_serial_nn_hb(void *ws, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B,
                           int64_t ldb, float *C, int64_t ldc, float beta) {
    if (!gemm_serial(bf16_engine(), ws, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){NULL, ldb, 1, B}, C, ldc,
                     beta))
        cpu_gemm_nn_hb_ref(M, N, K, A, lda, B, ldb, C, ldc, beta);
}


/* C[M,N] = beta*C + A[M,K] · B[N,K]^T */
void cpu_gemm_nt(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                 const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    bool bf16;
    const gemm_engine *e = engine_of(prec, &bf16);
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){B, 1, ldb, NULL}, C, ldc, beta))
        (bf16 ? cpu_gemm_nt_bf16_ref : cpu_gemm_nt_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N] */
void cpu_gemm_nn(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                 const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    bool bf16;
    const gemm_engine *e = engine_of(prec, &bf16);
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){B, ldb, 1, NULL}, C, ldc, beta))
        (bf16 ? cpu_gemm_nn_bf16_ref : cpu_gemm_nn_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}


/* C[M,N] = beta*C + A[M,K] · B[N,K]^T, B: bf16 bits */
void cpu_gemm_nt_hb(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B, int64_t ldb,
                    float *C, int64_t ldc, float beta) {
    const gemm_engine *e = bf16_engine();
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){NULL, 1, ldb, B}, C, ldc, beta))
        cpu_gemm_nt_hb_ref(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N], B: bf16 bits */
void cpu_gemm_nn_hb(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B, int64_t ldb,
                    float *C, int64_t ldc, float beta) {
    const gemm_engine *e = bf16_engine();
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, lda, 1, NULL}, (gemm_view){NULL, ldb, 1, B}, C, ldc, beta))
        cpu_gemm_nn_hb_ref(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[K,M]^T · B[K,N] */
void cpu_gemm_tn(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                 const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    bool bf16;
    const gemm_engine *e = engine_of(prec, &bf16);
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, 1, lda, NULL}, (gemm_view){B, ldb, 1, NULL}, C, ldc, beta))
        (bf16 ? cpu_gemm_tn_bf16_ref : cpu_gemm_tn_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* ---------------------------------------------------------------- the plan backend's GEMM */

/* What cpu_gemm_* allocates for an M×N×K product, allocated and given back: nothing without an engine
 * (the references allocate nothing) or with an empty product. The layout (nt, nn, tn) does not change
 * the buffers. */
static void gemm_plan_on(const gemm_engine *e, int64_t M, int64_t N, int64_t K) {
    gemm_buffers w;
    if (!e || M <= 0 || N <= 0 || K <= 0 || !buffers_take(&w, true, e, M, N, K)) return;
    buffers_give_back(&w);
}

static void gemm_plan(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K) {
    bool bf16;
    gemm_plan_on(engine_of(prec, &bf16), M, N, K);
}

/* The bf16-B GEMMs run the bf16 engine whatever the precision; an engine without a bf16 B packer runs
 * the reference, which allocates nothing. */
static void gemm_hb_plan(int64_t M, int64_t N, int64_t K) {
    const gemm_engine *e = bf16_engine();
    gemm_plan_on(e && e->pack_b_bf16 ? e : NULL, M, N, K);
}

void cpu_gemm_nt_hb_plan(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B, int64_t ldb,
                         float *C, int64_t ldc, float beta) {
    (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)beta;
    gemm_hb_plan(M, N, K);
}

void cpu_gemm_nn_hb_plan(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B, int64_t ldb,
                         float *C, int64_t ldc, float beta) {
    (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)beta;
    gemm_hb_plan(M, N, K);
}

void cpu_gemm_nt_plan(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)beta;
    gemm_plan(prec, M, N, K);
}

void cpu_gemm_nn_plan(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)beta;
    gemm_plan(prec, M, N, K);
}

void cpu_gemm_tn_plan(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                      const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)beta;
    gemm_plan(prec, M, N, K);
}
