/* The cpu backend's memory half (ops.def, "memory and ordering"): its device is the host, so a buffer is a
 * counted host block, a copy across the boundary is a memcpy, and ops run inline (nothing to wait for).
 * The plan mirrors count the same blocks with no memory behind them. */
#include <string.h>

#include "kernels/cpu/cpu.h"

void *cpu_buf_alloc(ds4_mem_cat cat, size_t bytes) { return ds4_alloc(cat, bytes); }
void cpu_buf_free(void *p) { ds4_free(p); }
void cpu_copy_to_device(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
void cpu_copy_to_host(void *dst, const void *src, size_t bytes) {
    if (bytes) memcpy(dst, src, bytes);
}
void cpu_synchronize(void) {}
ds4_status cpu_ops_status(void) { return DS4_OK; } /* a failing cpu op moves the allocator's failure count */

void *cpu_buf_alloc_plan(ds4_mem_cat cat, size_t bytes) { return ds4_alloc_plan(cat, bytes); }
void cpu_buf_free_plan(void *p) { ds4_free(p); }

void *cpu_range_reserve(size_t bytes) {
    void *p = ds4_range_reserve(bytes);
    if (!p) ds4_fail(DS4_ERR_OOM, "out of address space reserving %zu bytes", bytes);
    return p;
}
void cpu_range_release(void *p, size_t bytes) { ds4_range_release(p, bytes); }
bool cpu_range_map(void *p, size_t bytes, ds4_mem_cat cat) { return ds4_range_map(false, p, bytes, cat); }
void cpu_range_unmap(void *p, size_t bytes, ds4_mem_cat cat) { ds4_range_unmap(false, p, bytes, cat); }
void *cpu_range_reserve_plan(size_t bytes) { return cpu_range_reserve(bytes); }
void cpu_range_release_plan(void *p, size_t bytes) { ds4_range_release(p, bytes); }
bool cpu_range_map_plan(void *p, size_t bytes, ds4_mem_cat cat) { return ds4_range_map(true, p, bytes, cat); }
void cpu_range_unmap_plan(void *p, size_t bytes, ds4_mem_cat cat) { ds4_range_unmap(true, p, bytes, cat); }
