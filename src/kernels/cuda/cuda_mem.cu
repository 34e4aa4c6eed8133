/* The memory half of the CUDA backend: devices, device and pinned allocations, copies in each
 * direction, fills, streams and events. Plain wrappers: every CUDA error becomes a ds4_status. */
#include "kernels/cuda/cuda_common.cuh"

ds4_status cuda_device_count(int *n) {
    *n = 0;
    cudaError_t e = cudaGetDeviceCount(n);
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) { /* no GPU or no driver: none */
        (void)cudaGetLastError();
        *n = 0;
        return DS4_OK;
    }
    return cuda_status(e, "cudaGetDeviceCount", __FILE__, __LINE__);
}

ds4_status cuda_device_describe(int dev, char *buf, size_t cap) {
    cudaDeviceProp p;
    CUDA_TRY(cudaGetDeviceProperties(&p, dev));
    snprintf(buf, cap, "cuda:%d %s, sm_%d%d, %.1f GiB, %d SMs, L2 %d MiB", dev, p.name, p.major, p.minor,
             (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), p.multiProcessorCount, p.l2CacheSize >> 20);
    return DS4_OK;
}

ds4_status cuda_device_memory(size_t *free_bytes, size_t *total_bytes) {
    CUDA_TRY(cudaMemGetInfo(free_bytes, total_bytes));
    return DS4_OK;
}

/* *p = bytes of device (pinned: page-locked host) memory; out of memory is DS4_ERR_OOM. */
static ds4_status alloc_mem(void **p, size_t bytes, bool pinned) {
    *p = NULL;
    if (bytes == 0) return DS4_OK;
    cudaError_t e = pinned ? cudaMallocHost(p, bytes) : cudaMalloc(p, bytes);
    if (e != cudaSuccess) {
        *p = NULL;
        (void)cudaGetLastError();
        return ds4_fail(e == cudaErrorMemoryAllocation ? DS4_ERR_OOM : DS4_ERR_INTERNAL,
                        "cuda: allocating %zu bytes of %s memory: %s", bytes, pinned ? "pinned host" : "device",
                        cudaGetErrorString(e));
    }
    return DS4_OK;
}

ds4_status cuda_alloc(void **p, size_t bytes) { return alloc_mem(p, bytes, false); }
ds4_status cuda_alloc_pinned(void **p, size_t bytes) { return alloc_mem(p, bytes, true); }

ds4_status cuda_free(void *p) {
    if (p) CUDA_TRY(cudaFree(p));
    return DS4_OK;
}
ds4_status cuda_free_pinned(void *p) {
    if (p) CUDA_TRY(cudaFreeHost(p));
    return DS4_OK;
}

ds4_status cuda_copy_h2d(cudaStream_t s, void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
    return DS4_OK;
}
ds4_status cuda_copy_d2h(cudaStream_t s, void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
    return DS4_OK;
}
ds4_status cuda_copy_d2d(cudaStream_t s, void *dst, const void *src, size_t bytes) {
    if (bytes) CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
    return DS4_OK;
}
ds4_status cuda_fill(cudaStream_t s, void *dst, int byte, size_t bytes) {
    if (bytes) CUDA_TRY(cudaMemsetAsync(dst, byte, bytes, s));
    return DS4_OK;
}

/* dst [n] = value */
static __global__ void fill_f32_kernel(float *dst, float value, int64_t n) {
    CUDA_GRID_STRIDE(i, n) dst[i] = value;
}
ds4_status cuda_fill_f32(cudaStream_t s, float *dst, float value, int64_t n) {
    CUDA_ARG(n >= 0, "fill_f32", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    fill_f32_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(dst, value, n);
    CUDA_LAUNCHED("fill_f32");
    return DS4_OK;
}

ds4_status cuda_stream_create(cudaStream_t *s) {
    CUDA_TRY(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    return DS4_OK;
}
ds4_status cuda_stream_destroy(cudaStream_t s) {
    if (s) CUDA_TRY(cudaStreamDestroy(s));
    return DS4_OK;
}
ds4_status cuda_stream_sync(cudaStream_t s) {
    CUDA_TRY(cudaStreamSynchronize(s));
    return DS4_OK;
}
ds4_status cuda_event_create(cudaEvent_t *e) {
    CUDA_TRY(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    return DS4_OK;
}
ds4_status cuda_event_destroy(cudaEvent_t e) {
    if (e) CUDA_TRY(cudaEventDestroy(e));
    return DS4_OK;
}
ds4_status cuda_event_record(cudaEvent_t e, cudaStream_t s) {
    CUDA_TRY(cudaEventRecord(e, s));
    return DS4_OK;
}
ds4_status cuda_stream_wait(cudaStream_t s, cudaEvent_t e) {
    CUDA_TRY(cudaStreamWaitEvent(s, e, 0));
    return DS4_OK;
}
ds4_status cuda_event_sync(cudaEvent_t e) {
    CUDA_TRY(cudaEventSynchronize(e));
    return DS4_OK;
}
