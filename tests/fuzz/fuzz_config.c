/* libFuzzer target: config.json text -> parse + validate, then (small configs) the expected tensor
 * table. An accepted config must validate; a rejected one must carry a message naming the file. */
#include "ds4/io.h"
#include "ds4/model.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static ds4_status count(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int) {
    (void)name, (void)ndim, (void)shape, (void)is_int;
    (*(int64_t *)ctx)++;
    return DS4_OK;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ds4_config c;
    ds4_status s = ds4_config_parse((const char *)data, size, "fuzz.json", &c);
    if (s != DS4_OK) {
        if (!strstr(ds4_errmsg(), "fuzz.json")) abort();
    } else {
        if (ds4_config_validate(&c, "fuzz.json") != DS4_OK) abort();
        int64_t n = 0;
        if ((c.n_layers + c.n_mtp_layers) * (c.n_routed_experts + 64) < 100000 && ds4_model_expected_tensors(&c, count, &n) != DS4_OK)
            abort();
    }
    ds4_mem_stats m;
    ds4_mem_get(&m);
    if (m.live_total != 0) abort();
    return 0;
}
