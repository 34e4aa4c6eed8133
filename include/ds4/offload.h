/* The offload tier (docs/DESIGN.md idea 3): a backing store outside counted memory, and the two policies
 * that use it, as MindSpeed names them:
 *   --swap-optimizer    the optimizer's arrays (AdamW's m and v, Muon's momentum) live in the store
 *                       between updates (ds4/train.h: ds4_optim_swap_out); the update streams them through
 *                       a bounded buffer.
 *   --swap-layer-input  the layer input streams X[l] of a training pass go to the store after block l's
 *                       forward and come back just before block l's backward (ds4/actstore.h).
 *
 * On this CPU engine the store is an unlinked temporary file in a caller-given directory, written with
 * pwrite and read back with pread: offloaded bytes leave the process's memory (the kernel may keep them
 * in its reclaimable page cache, which no allocator counts). Bytes held by the store are counted in the
 * offload tier of ds4_mem_stats (offload_live / offload_peak, by category), never in the memory tier.
 * A plan (memplan): the store opens no file and does no I/O; it only counts. */
#ifndef DS4_OFFLOAD_H
#define DS4_OFFLOAD_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_offload ds4_offload;

/* Opens a store for steps run as `exec` (NULL: real) backed by a new, already unlinked file in `dir`
 * (NULL or "": $TMPDIR, else /tmp). Fails naming the directory and the OS error (missing, not writable,
 * ...). A plan store (memplan) makes no file and does no I/O: it only counts. One thread at a time per
 * store. */
ds4_status ds4_offload_open(const ds4_exec *exec, const char *dir, ds4_offload **out);
/* Drops every handle still held (their bytes leave the offload tier) and closes the file. NULL: no-op. */
void ds4_offload_close(ds4_offload *s);

/* A handle names `bytes` bytes of the store counted under `cat`. alloc: contents zero. put: a copy of
 * src[bytes] (the caller then frees its buffer). Handles are >= 0; a dropped handle's space is reused. */
ds4_status ds4_offload_alloc(ds4_offload *s, ds4_mem_cat cat, size_t bytes, int64_t *handle);
ds4_status ds4_offload_put(ds4_offload *s, ds4_mem_cat cat, const void *src, size_t bytes, int64_t *handle);
/* Copies all of the handle's bytes back into dst. */
ds4_status ds4_offload_get(ds4_offload *s, int64_t handle, void *dst);
/* Byte range [off, off + len) of a handle: read into dst / overwrite from src (streaming users). */
ds4_status ds4_offload_read(ds4_offload *s, int64_t handle, size_t off, void *dst, size_t len);
ds4_status ds4_offload_write(ds4_offload *s, int64_t handle, size_t off, const void *src, size_t len);
/* put and get for a buffer of the backend of the store's context (`exec` at open), staged through a host
 * buffer of at most 1 MiB: the host never touches the device buffer. */
ds4_status ds4_offload_put_dev(ds4_offload *s, ds4_mem_cat cat, const void *src, size_t bytes, int64_t *handle);
ds4_status ds4_offload_get_dev(ds4_offload *s, int64_t handle, void *dst);
/* read and write of a byte range, for a buffer of that backend, staged the same way. */
ds4_status ds4_offload_read_dev(ds4_offload *s, int64_t handle, size_t off, void *dst, size_t len);
ds4_status ds4_offload_write_dev(ds4_offload *s, int64_t handle, size_t off, const void *src, size_t len);
const ds4_exec *ds4_offload_exec(const ds4_offload *s);
/* Forgets a handle; its bytes leave the offload tier and its file space is reused (the file shrinks when
 * its tail is free). Negative or unknown handles: no-op. */
void ds4_offload_drop(ds4_offload *s, int64_t handle);
size_t ds4_offload_size(const ds4_offload *s, int64_t handle); /* 0 for an unknown handle */
int64_t ds4_offload_file_bytes(const ds4_offload *s);         /* extent of the backing file */
const char *ds4_offload_dir(const ds4_offload *s);

#ifdef __cplusplus
}
#endif
#endif
