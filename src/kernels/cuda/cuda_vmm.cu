/* Reserved ranges on the GPU (ops.def: range_reserve / range_map / range_unmap / range_release): an FSDP
 * model's flat layout is one stretch of device addresses of which only the gathered groups are backed by
 * memory. CUDA's virtual memory management does exactly that: cuMemAddressReserve reserves addresses,
 * cuMemCreate + cuMemMap back a granule (2 MiB on Hopper) of them, cuMemUnmap + cuMemRelease give it back.
 * ds4's pieces start on 4 KiB pages, so neighbouring pieces may share a granule: each granule counts the
 * pieces mapped in it and lives while one does. The driver's entry points are looked up through the
 * runtime (cudaGetDriverEntryPointByVersion), so the backend links no libcuda of its own. */
#include <cuda.h>
#include <cudaTypedefs.h>

#include "kernels/cuda/cuda_common.cuh"

/* The driver calls this file makes, found once. */
typedef struct {
    PFN_cuMemAddressReserve_v10020 reserve;
    PFN_cuMemAddressFree_v10020 free;
    PFN_cuMemCreate_v10020 create;
    PFN_cuMemRelease_v10020 release;
    PFN_cuMemMap_v10020 map;
    PFN_cuMemUnmap_v10020 unmap;
    PFN_cuMemSetAccess_v10020 access;
    PFN_cuMemGetAllocationGranularity_v10020 granularity;
    size_t granule;
    int device;
} vmm_api;

static vmm_api g_vmm;
static bool g_vmm_ready;

static ds4_status entry(const char *name, void **fn) {
    cudaDriverEntryPointQueryResult q;
    cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || !*fn) {
        (void)cudaGetLastError();
        return ds4_fail(DS4_ERR_INTERNAL, "cuda: the driver has no %s (reserved ranges need CUDA 12 or later)", name);
    }
    return DS4_OK;
}

static CUmemAllocationProp granule_prop(int device) {
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = device;
    return p;
}

static ds4_status vmm_init(void) {
    if (g_vmm_ready) return DS4_OK;
    vmm_api a;
    memset(&a, 0, sizeof a);
    DS4_TRY(entry("cuMemAddressReserve", (void **)&a.reserve));
    DS4_TRY(entry("cuMemAddressFree", (void **)&a.free));
    DS4_TRY(entry("cuMemCreate", (void **)&a.create));
    DS4_TRY(entry("cuMemRelease", (void **)&a.release));
    DS4_TRY(entry("cuMemMap", (void **)&a.map));
    DS4_TRY(entry("cuMemUnmap", (void **)&a.unmap));
    DS4_TRY(entry("cuMemSetAccess", (void **)&a.access));
    DS4_TRY(entry("cuMemGetAllocationGranularity", (void **)&a.granularity));
    CUDA_TRY(cudaGetDevice(&a.device));
    CUmemAllocationProp p = granule_prop(a.device);
    if (a.granularity(&a.granule, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS || a.granule == 0)
        return ds4_fail(DS4_ERR_INTERNAL, "cuda: cuMemGetAllocationGranularity failed");
    g_vmm = a;
    g_vmm_ready = true;
    return DS4_OK;
}

/* A granule backed by memory: its address, its handle and how many mapped pieces lie in it. */
typedef struct {
    uintptr_t addr;
    CUmemGenericAllocationHandle h;
    int64_t pieces;
} granule;
static granule *g_gran;
static int64_t g_ngran, g_capgran;

static granule *granule_find(uintptr_t addr) {
    for (int64_t i = 0; i < g_ngran; i++)
        if (g_gran[i].addr == addr) return &g_gran[i];
    return NULL;
}

static size_t round_up(size_t n, size_t g) { return (n + g - 1) / g * g; }

ds4_status cuda_range_reserve(void **p, size_t bytes) {
    *p = NULL;
    DS4_TRY(vmm_init());
    CUdeviceptr d = 0;
    if (g_vmm.reserve(&d, round_up(bytes ? bytes : 1, g_vmm.granule), g_vmm.granule, 0, 0) != CUDA_SUCCESS)
        return ds4_fail(DS4_ERR_OOM, "cuda: reserving %zu bytes of device addresses failed", bytes);
    *p = (void *)d;
    return DS4_OK;
}

/* Backs granule `addr` (or counts one more piece in it). */
static ds4_status granule_get(uintptr_t addr) {
    granule *g = granule_find(addr);
    if (g) {
        g->pieces++;
        return DS4_OK;
    }
    if (!ds4_grow((void **)&g_gran, &g_capgran, g_ngran + 1, sizeof *g_gran)) return DS4_ERR_OOM;
    CUmemAllocationProp prop = granule_prop(g_vmm.device);
    CUmemGenericAllocationHandle h;
    if (g_vmm.create(&h, g_vmm.granule, &prop, 0) != CUDA_SUCCESS)
        return ds4_fail(DS4_ERR_OOM, "cuda: out of device memory mapping a %zu-byte granule", g_vmm.granule);
    CUmemAccessDesc acc;
    memset(&acc, 0, sizeof acc);
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (g_vmm.map((CUdeviceptr)addr, g_vmm.granule, 0, h, 0) != CUDA_SUCCESS ||
        g_vmm.access((CUdeviceptr)addr, g_vmm.granule, &acc, 1) != CUDA_SUCCESS) {
        g_vmm.unmap((CUdeviceptr)addr, g_vmm.granule);
        g_vmm.release(h);
        return ds4_fail(DS4_ERR_INTERNAL, "cuda: mapping a granule of a reserved range failed");
    }
    g_gran[g_ngran++] = (granule){addr, h, 1};
    return DS4_OK;
}

/* One piece less in granule `addr`; the last one gives its memory back. */
static void granule_put(uintptr_t addr) {
    granule *g = granule_find(addr);
    if (!g || --g->pieces > 0) return;
    g_vmm.unmap((CUdeviceptr)addr, g_vmm.granule);
    g_vmm.release(g->h);
    *g = g_gran[--g_ngran];
}

ds4_status cuda_range_map(cudaStream_t s, void *p, size_t bytes) {
    DS4_TRY(vmm_init());
    if (bytes == 0) return DS4_OK;
    const uintptr_t a = (uintptr_t)p, G = g_vmm.granule;
    for (uintptr_t g = a / G * G; g < a + bytes; g += G) {
        ds4_status st = granule_get(g);
        if (st != DS4_OK) {
            for (uintptr_t u = a / G * G; u < g; u += G) granule_put(u);
            return st;
        }
    }
    CUDA_TRY(cudaMemsetAsync(p, 0, bytes, s)); /* a granule kept by a neighbour holds old bytes */
    return DS4_OK;
}

ds4_status cuda_range_unmap(cudaStream_t s, void *p, size_t bytes) {
    if (!g_vmm_ready || bytes == 0) return DS4_OK;
    CUDA_TRY(cudaStreamSynchronize(s)); /* the ops queued on the piece finish before its memory goes */
    const uintptr_t a = (uintptr_t)p, G = g_vmm.granule;
    for (uintptr_t g = a / G * G; g < a + bytes; g += G) granule_put(g);
    return DS4_OK;
}

ds4_status cuda_range_release(cudaStream_t s, void *p, size_t bytes) {
    if (!p || !g_vmm_ready) return DS4_OK;
    CUDA_TRY(cudaStreamSynchronize(s));
    const uintptr_t a = (uintptr_t)p, end = a + round_up(bytes ? bytes : 1, g_vmm.granule);
    for (int64_t i = 0; i < g_ngran; i++) /* granules still backed go with it */
        if (g_gran[i].addr >= a && g_gran[i].addr < end) {
            g_gran[i].pieces = 1;
            granule_put(g_gran[i--].addr);
        }
    if (g_vmm.free((CUdeviceptr)p, end - a) != CUDA_SUCCESS)
        return ds4_fail(DS4_ERR_INTERNAL, "cuda: freeing a reserved range of %zu bytes failed", bytes);
    return DS4_OK;
}
