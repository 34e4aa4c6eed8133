/* libFuzzer target: a safetensors image -> header parse, then every tensor through the logical-tensor
 * readers (dequantization with scale siblings, row reads, integer reads, statistics). Any crash,
 * leak, sanitizer report or error without a message is a bug. */
#include "ds4/io.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds4_st_file *f = NULL;
    ds4_status s = ds4_st_open_memory(data, size, "fuzz.safetensors", &f);
    if (s != DS4_OK) {
        if (f || !ds4_errmsg()[0] || !strstr(ds4_errmsg(), "fuzz.safetensors")) abort();
        return 0;
    }
    for (int64_t i = 0; i < ds4_st_count(f); i++) {
        const ds4_st_entry *e = ds4_st_entry_at(f, i);
        ds4_tensor_loc loc;
        if (ds4_st_locate(f, e->name, &loc) != DS4_OK) {
            if (!ds4_errmsg()[0]) abort();
            continue;
        }
        if (loc.rows * loc.cols > (1 << 16) || ds4_st_entry_numel(e) > (1 << 16)) continue;
        float *buf = malloc((size_t)(loc.rows * loc.cols + 1) * sizeof(float));
        int64_t *ib = malloc((size_t)(ds4_st_entry_numel(e) + 1) * sizeof(int64_t));
        (void)ds4_tensor_loc_read_rows(&loc, 0, loc.rows, buf);
        if (loc.rows > 2) (void)ds4_tensor_loc_read_rows(&loc, 1, loc.rows - 1, buf);
        (void)ds4_tensor_loc_read_i64(&loc, ib);
        ds4_tensor_stats st;
        (void)ds4_tensor_loc_stats(&loc, &st);
        (void)ds4_st_read_f32(f, e->name, e->ndim, e->shape, buf);
        (void)ds4_st_read_i64(f, e->name, e->ndim, e->shape, ib);
        free(buf);
        free(ib);
    }
    ds4_st_close(f);
    ds4_mem_stats m;
    ds4_mem_get(&m);
    if (m.live_total != 0) abort();   /* every path returns what it allocated */
    return 0;
}
