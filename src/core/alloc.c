/* The one allocator: 64-byte aligned blocks with a header recording size and category, so live
 * and peak bytes per category are exact (requested bytes, not rounded sizes). */
#include "ds4/core.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <string.h>

#define HDR 64
#define MAGIC 0x64733461ULL /* "ds4a" */

typedef struct {
    uint64_t magic;
    uint64_t bytes;
    uint32_t cat;
    uint32_t owner_gen; /* the owners' generation it was counted in (0: none) */
    int32_t owner;      /* its owner's slot in that generation */
} hdr_t;

static _Atomic int64_t g_live[DS4_MEM_NCAT];
static _Atomic int64_t g_peak[DS4_MEM_NCAT];
static _Atomic int64_t g_live_total;
static _Atomic int64_t g_peak_total;
static _Atomic int64_t g_n_allocs;
/* the offload tier, counted apart from memory */
static _Atomic int64_t g_off_live[DS4_MEM_NCAT];
static _Atomic int64_t g_off_peak[DS4_MEM_NCAT];
static _Atomic int64_t g_off_live_total;
static _Atomic int64_t g_off_peak_total;

/* allocation-failure injection: allocations left until the one that fails (0: off); failures so far */
static _Atomic int64_t g_fail_countdown;
static _Atomic int64_t g_fail_count;

void ds4_alloc_fail_after(int64_t n) { atomic_store(&g_fail_countdown, n > 0 ? n : 0); }

/* cJSON allocates through ds4_alloc_hooked_malloc from the start: its failures are counted (a JSON
 * builder checks the count, since cJSON_Add* failures are easy to miss) and injected. Its blocks stay
 * malloc'd, so free() and cJSON_free() both release them. */
__attribute__((constructor)) static void route_cjson_allocations(void) {
    cJSON_Hooks h = {.malloc_fn = ds4_alloc_hooked_malloc, .free_fn = free};
    cJSON_InitHooks(&h);
}

int64_t ds4_alloc_failures(void) { return atomic_load(&g_fail_count); }

/* True for the one allocation injection picks; each allocation counts once, from any thread. */
static bool injected_failure(void) {
    int64_t c = atomic_load(&g_fail_countdown);
    while (c > 0) {
        if (atomic_compare_exchange_weak(&g_fail_countdown, &c, c - 1)) return c == 1;
    }
    return false;
}

void *ds4_alloc_hooked_malloc(size_t bytes) {
    void *p = injected_failure() ? NULL : malloc(bytes);
    if (!p) {
        atomic_fetch_add(&g_fail_count, 1);
        ds4_fail(DS4_ERR_OOM, "out of memory allocating %zu bytes", bytes);
    }
    return p;
}

static void atomic_max(_Atomic int64_t *p, int64_t v) {
    int64_t cur = atomic_load(p);
    while (v > cur && !atomic_compare_exchange_weak(p, &cur, v)) {
    }
}

const char *ds4_mem_cat_name(ds4_mem_cat c) {
    static const char *names[DS4_MEM_NCAT] = {"params", "grads", "optim", "activations",
                                              "workspace", "comm", "other"};
    return (unsigned)c < DS4_MEM_NCAT ? names[c] : "?";
}

static void count_plain(ds4_mem_cat cat, int64_t delta) {
    int64_t l = atomic_fetch_add(&g_live[cat], delta) + delta;
    atomic_max(&g_peak[cat], l);
    int64_t t = atomic_fetch_add(&g_live_total, delta) + delta;
    atomic_max(&g_peak_total, t);
}

/* ------------------------------------------------------------------ owners (ds4/core.h) */
/* Slot 0 is no owner. While started, every count takes the lock, so a category's peak and the owners'
 * bytes copied at it are one moment; stopped, counting is the atomics above alone. */
typedef struct {
    const char *name;
    int64_t live[DS4_MEM_NCAT], max[DS4_MEM_NCAT], at_peak[DS4_MEM_NCAT];
    int64_t items[DS4_MEM_NCAT], items_at_peak[DS4_MEM_NCAT];
    bool seen[DS4_MEM_NCAT]; /* held bytes of the category at some point */
} owner_t;

static pthread_mutex_t g_own_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic bool g_own_on;
static uint32_t g_own_gen; /* bumped by each start, so a block counted before it is not uncounted after */
static owner_t g_own[DS4_MEM_OWNERS_MAX];
static int g_nown = 1;
static _Thread_local const char *t_owner;

const char *ds4_mem_owner_enter(const char *name) {
    const char *prev = t_owner;
    t_owner = name;
    return prev;
}

void ds4_mem_owner_leave(const char *prev) { t_owner = prev; }

/* The slot of name (lock held), made on first use; 0 when none or the table is full. */
static int owner_slot(const char *name) {
    if (!name) return 0;
    for (int i = 1; i < g_nown; i++)
        if (g_own[i].name == name || !strcmp(g_own[i].name, name)) return i;
    if (g_nown == DS4_MEM_OWNERS_MAX) return 0;
    g_own[g_nown].name = name;
    return g_nown++;
}

static void owner_add(int slot, ds4_mem_cat cat, int64_t delta) {
    owner_t *o = &g_own[slot];
    o->live[cat] += delta;
    if (o->live[cat] > o->max[cat]) o->max[cat] = o->live[cat];
    o->seen[cat] |= delta > 0;
}

/* A count while owners are on (lock held): to slot's owner, then the totals; a new peak of the category
 * copies every owner's bytes. */
static void count_owned(ds4_mem_cat cat, int64_t delta, int slot) {
    owner_add(slot, cat, delta);
    const int64_t l = atomic_fetch_add(&g_live[cat], delta) + delta;
    if (l > atomic_load(&g_peak[cat])) {
        atomic_store(&g_peak[cat], l);
        for (int i = 0; i < g_nown; i++) {
            g_own[i].at_peak[cat] = g_own[i].live[cat];
            g_own[i].items_at_peak[cat] = g_own[i].items[cat];
        }
    }
    atomic_max(&g_peak_total, atomic_fetch_add(&g_live_total, delta) + delta);
}

/* Counts delta under cat for the current owner; *gen, *slot (may be NULL): where it went (gen 0: nowhere). */
static void count(ds4_mem_cat cat, int64_t delta, uint32_t *gen, int32_t *slot) {
    if (gen) *gen = 0;
    if (!atomic_load(&g_own_on)) {
        count_plain(cat, delta);
        return;
    }
    pthread_mutex_lock(&g_own_mu);
    const int s = owner_slot(t_owner);
    count_owned(cat, delta, s);
    if (gen) *gen = g_own_gen, *slot = s;
    pthread_mutex_unlock(&g_own_mu);
}

/* A block's bytes going back: to its owner when it was counted in this generation. */
static void uncount(const hdr_t *h) {
    const int64_t b = (int64_t)h->bytes;
    if (atomic_load(&g_own_on)) {
        pthread_mutex_lock(&g_own_mu);
        if (h->owner_gen == g_own_gen) owner_add(h->owner, (ds4_mem_cat)h->cat, -b);
        atomic_fetch_sub(&g_live[h->cat], b);
        atomic_fetch_sub(&g_live_total, b);
        pthread_mutex_unlock(&g_own_mu);
        return;
    }
    atomic_fetch_sub(&g_live[h->cat], b);
    atomic_fetch_sub(&g_live_total, b);
}

void ds4_mem_owner_move(ds4_mem_cat cat, const char *from, const char *to, int64_t bytes) {
    if ((unsigned)cat >= DS4_MEM_NCAT || !atomic_load(&g_own_on)) return;
    pthread_mutex_lock(&g_own_mu);
    owner_add(owner_slot(from), cat, -bytes);
    owner_add(owner_slot(to), cat, bytes);
    pthread_mutex_unlock(&g_own_mu);
}

void ds4_mem_owner_items(ds4_mem_cat cat, const char *owner, int64_t delta) {
    if ((unsigned)cat >= DS4_MEM_NCAT || !atomic_load(&g_own_on)) return;
    pthread_mutex_lock(&g_own_mu);
    g_own[owner_slot(owner)].items[cat] += delta;
    pthread_mutex_unlock(&g_own_mu);
}

void ds4_mem_owners_start(void) {
    pthread_mutex_lock(&g_own_mu);
    memset(g_own, 0, sizeof g_own);
    g_nown = 1;
    if (++g_own_gen == 0) g_own_gen = 1; /* 0 marks a block counted under no generation */
    atomic_store(&g_own_on, true);
    pthread_mutex_unlock(&g_own_mu);
}

void ds4_mem_owners_stop(void) { atomic_store(&g_own_on, false); }

int ds4_mem_owners_get(ds4_mem_cat cat, ds4_mem_owner_stat *out, int cap) {
    int n = 0;
    if ((unsigned)cat >= DS4_MEM_NCAT) return 0;
    pthread_mutex_lock(&g_own_mu);
    for (int i = 0; i < g_nown; i++) {
        const owner_t *o = &g_own[i];
        if (!o->seen[cat] && !o->items_at_peak[cat]) continue;
        if (n < cap) out[n] = (ds4_mem_owner_stat){o->name, o->max[cat], o->at_peak[cat], o->items_at_peak[cat]};
        n++;
    }
    pthread_mutex_unlock(&g_own_mu);
    return n;
}

void ds4_mem_track(ds4_mem_cat cat, int64_t delta) {
    if ((unsigned)cat < DS4_MEM_NCAT) count(cat, delta, NULL, NULL);
}

void ds4_mem_track_offload(ds4_mem_cat cat, int64_t delta) {
    if ((unsigned)cat >= DS4_MEM_NCAT) return;
    atomic_max(&g_off_peak[cat], atomic_fetch_add(&g_off_live[cat], delta) + delta);
    atomic_max(&g_off_peak_total, atomic_fetch_add(&g_off_live_total, delta) + delta);
}

/* A counted block of `bytes` under cat; backed: memory behind the pointer, else only the header (a plan's). */
static void *alloc_block(ds4_mem_cat cat, size_t bytes, bool backed) {
    if ((unsigned)cat >= DS4_MEM_NCAT) {
        ds4_fail(DS4_ERR_ARG, "ds4_alloc: bad memory category %d", (int)cat);
        return NULL;
    }
    size_t total = HDR + ((bytes + 63) & ~(size_t)63);
    if (total < bytes) {
        atomic_fetch_add(&g_fail_count, 1);
        ds4_fail(DS4_ERR_OOM, "ds4_alloc: size %zu overflows", bytes);
        return NULL;
    }
    /* a plan: only the header is real; the data pointer must never be dereferenced */
    void *base = injected_failure() ? NULL : aligned_alloc(64, backed ? total : HDR);
    if (!base) {
        atomic_fetch_add(&g_fail_count, 1);
        ds4_fail(DS4_ERR_OOM, "out of memory allocating %zu bytes of %s", bytes, ds4_mem_cat_name(cat));
        return NULL;
    }
    hdr_t *h = base;
    h->magic = MAGIC;
    h->bytes = bytes;
    h->cat = (uint32_t)cat;
    count(cat, (int64_t)bytes, &h->owner_gen, &h->owner);
    atomic_fetch_add(&g_n_allocs, 1);
    return (char *)base + HDR;
}

void *ds4_alloc(ds4_mem_cat cat, size_t bytes) { return alloc_block(cat, bytes, true); }

void *ds4_alloc_plan(ds4_mem_cat cat, size_t bytes) { return alloc_block(cat, bytes, cat == DS4_MEM_OTHER); }

void *ds4_alloc_for(bool plan, ds4_mem_cat cat, size_t bytes) {
    return plan ? ds4_alloc_plan(cat, bytes) : ds4_alloc(cat, bytes);
}

void *ds4_calloc_for(bool plan, ds4_mem_cat cat, size_t bytes) {
    void *p = ds4_alloc_for(plan, cat, bytes);
    if (p && (!plan || cat == DS4_MEM_OTHER)) memset(p, 0, bytes);
    return p;
}

void *ds4_calloc(ds4_mem_cat cat, size_t bytes) {
    void *p = ds4_alloc(cat, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

void ds4_free(void *p) {
    if (!p) return;
    hdr_t *h = (hdr_t *)((char *)p - HDR);
    if (h->magic != MAGIC) abort(); /* double free or foreign pointer: an internal bug, not input */
    h->magic = 0;
    uncount(h);
    free(h);
}

size_t ds4_alloc_size(const void *p) {
    return p ? ((const hdr_t *)((const char *)p - HDR))->bytes : 0;
}

void ds4_mem_get(ds4_mem_stats *out) {
    for (int c = 0; c < DS4_MEM_NCAT; c++) {
        out->live[c] = atomic_load(&g_live[c]);
        out->peak[c] = atomic_load(&g_peak[c]);
        out->offload_live[c] = atomic_load(&g_off_live[c]);
        out->offload_peak[c] = atomic_load(&g_off_peak[c]);
    }
    out->offload_live_total = atomic_load(&g_off_live_total);
    out->offload_peak_total = atomic_load(&g_off_peak_total);
    out->live_total = atomic_load(&g_live_total);
    out->peak_total = atomic_load(&g_peak_total);
    out->n_allocs = atomic_load(&g_n_allocs);
}

void ds4_mem_reset_peak(void) {
    for (int c = 0; c < DS4_MEM_NCAT; c++) {
        atomic_store(&g_peak[c], atomic_load(&g_live[c]));
        atomic_store(&g_off_peak[c], atomic_load(&g_off_live[c]));
    }
    atomic_store(&g_peak_total, atomic_load(&g_live_total));
    atomic_store(&g_off_peak_total, atomic_load(&g_off_live_total));
}

bool ds4_grow(void **arr, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return true;
    int64_t nc = *cap ? *cap : 16;
    while (nc < need) nc *= 2;
    void *n = ds4_alloc(DS4_MEM_OTHER, (size_t)nc * elem);
    if (!n) return false;
    if (*arr) {
        memcpy(n, *arr, (size_t)*cap * elem);
        ds4_free(*arr);
    }
    *arr = n;
    *cap = nc;
    return true;
}

char *ds4_strndup(const char *s, size_t n) {
    char *d = ds4_alloc(DS4_MEM_OTHER, n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

void ds4_host_memory_keep(void) {
#ifdef __GLIBC__
    mallopt(M_MMAP_MAX, 0);             /* large blocks from the heap, not one mapping each */
    mallopt(M_TRIM_THRESHOLD, INT_MAX); /* freed heap memory stays for the next step's blocks */
#endif
}

/* ------------------------------------------------------------------ reserved address ranges */
void *ds4_range_reserve(size_t bytes) {
    void *p = mmap(NULL, bytes ? bytes : 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void ds4_range_release(void *p, size_t bytes) {
    if (p) munmap(p, bytes ? bytes : 4096);
}

bool ds4_range_map(bool plan, void *p, size_t bytes, ds4_mem_cat cat) {
    if (!plan && mprotect(p, bytes, PROT_READ | PROT_WRITE) != 0) return false;
    ds4_mem_track(cat, (int64_t)bytes);
    return true;
}

void ds4_range_unmap(bool plan, void *p, size_t bytes, ds4_mem_cat cat) {
    if (!plan) { /* a plan's pages were never made resident */
        madvise(p, bytes, MADV_DONTNEED); /* the pages go back; the next map reads zeros */
        mprotect(p, bytes, PROT_NONE);     /* a read after unmap faults instead of seeing stale data */
    }
    ds4_mem_track(cat, -(int64_t)bytes);
}
