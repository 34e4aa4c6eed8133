/* Core: allocator accounting, tensors and views, RNG, status messages. */
#include "ds4/core.h"
#include "test.h"

static void test_alloc_counts_exact_bytes(void) {
    ds4_mem_stats a, b, c;
    ds4_mem_get(&a);
    void *p = ds4_alloc(DS4_MEM_ACT, 1000);
    void *q = ds4_alloc(DS4_MEM_GRAD, 24);
    ds4_mem_get(&b);
    CHECK(p && q);
    CHECK(((uintptr_t)p & 63) == 0, "not 64-byte aligned");
    CHECK(b.live[DS4_MEM_ACT] - a.live[DS4_MEM_ACT] == 1000);
    CHECK(b.live[DS4_MEM_GRAD] - a.live[DS4_MEM_GRAD] == 24);
    CHECK(b.live_total - a.live_total == 1024);
    CHECK(ds4_alloc_size(p) == 1000);
    ds4_free(p);
    ds4_mem_get(&c);
    CHECK(c.live[DS4_MEM_ACT] == a.live[DS4_MEM_ACT]);
    CHECK(c.peak[DS4_MEM_ACT] >= a.live[DS4_MEM_ACT] + 1000);
    ds4_free(q);
}

static void test_peak_tracks_sum(void) {
    ds4_mem_reset_peak();
    ds4_mem_stats a, b;
    ds4_mem_get(&a);
    void *p = ds4_alloc(DS4_MEM_ACT, 4096);
    ds4_free(p);
    void *q = ds4_alloc(DS4_MEM_WORK, 100);
    ds4_mem_get(&b);
    CHECK(b.peak_total - a.live_total == 4096, "peak %lld live %lld", (long long)b.peak_total,
          (long long)a.live_total);
    ds4_free(q);
}

static void test_tensor_views_share_storage(void) {
    ds4_tensor t, v;
    int64_t shape[2] = {3, 5};
    CHECK(ds4_tensor_zeros(&t, DS4_MEM_ACT, DS4_F32, 2, shape) == DS4_OK);
    CHECK(ds4_tensor_numel(&t) == 15 && ds4_tensor_bytes(&t) == 60);
    v = ds4_tensor_view(&t);
    ds4_f32(&v)[4] = 2.5f;
    CHECK(ds4_f32(&t)[4] == 2.5f);
    ds4_mem_stats a, b;
    ds4_mem_get(&a);
    ds4_tensor_free(&t);
    ds4_mem_get(&b);
    CHECK(b.live[DS4_MEM_ACT] == a.live[DS4_MEM_ACT], "storage freed while a view is alive");
    ds4_tensor_free(&v);
    ds4_mem_get(&b);
    CHECK(a.live[DS4_MEM_ACT] - b.live[DS4_MEM_ACT] == 60);
    char buf[64];
    CHECK(strcmp(ds4_dims_str(2, shape, buf, sizeof buf), "[3, 5]") == 0);
}

static void test_rng_counter_based(void) {
    CHECK(ds4_rng_u64(1, 2, 3) == ds4_rng_u64(1, 2, 3));
    CHECK(ds4_rng_u64(1, 2, 3) != ds4_rng_u64(1, 2, 4));
    CHECK(ds4_rng_u64(1, 2, 3) != ds4_rng_u64(1, 3, 3));
    CHECK(ds4_rng_u64(1, 2, 3) != ds4_rng_u64(2, 2, 3));
    double s = 0, s2 = 0;
    int n = 200000;
    for (int i = 0; i < n; i++) {
        double x = ds4_rng_normal(7, 0, (uint64_t)i);
        s += x;
        s2 += x * x;
    }
    CHECK(fabs(s / n) < 0.01, "mean %g", s / n);
    CHECK(fabs(s2 / n - 1.0) < 0.02, "var %g", s2 / n);
    for (int i = 0; i < 1000; i++) {
        float u = ds4_rng_uniform(3, 4, (uint64_t)i);
        CHECK(u >= 0.0f && u < 1.0f);
    }
}

static void test_status_messages(void) {
    ds4_status s = ds4_fail(DS4_ERR_FORMAT, "file %s: bad %d", "x.bin", 7);
    CHECK(s == DS4_ERR_FORMAT);
    CHECK(strcmp(ds4_errmsg(), "file x.bin: bad 7") == 0);
    ds4_fail_prefix(s, "loading");
    CHECK(strcmp(ds4_errmsg(), "loading: file x.bin: bad 7") == 0);
}

static void test_bf16_roundtrip(void) {
    CHECK(ds4_bf16_to_f32(ds4_f32_to_bf16(1.0f)) == 1.0f);
    CHECK(ds4_bf16_to_f32(ds4_f32_to_bf16(-3.5f)) == -3.5f);
    float x = 1.00390625f; /* 1 + 2^-8: exactly half way between bf16 neighbours, rounds to even */
    CHECK(ds4_bf16_to_f32(ds4_f32_to_bf16(x)) == 1.0f);
    CHECK(isnan(ds4_bf16_to_f32(ds4_f32_to_bf16(NAN))));
    CHECK(ds4_f16_to_f32(0x3c00) == 1.0f && ds4_f16_to_f32(0xc000) == -2.0f);
    ds4_dtype d;
    CHECK(ds4_dtype_from_name("F8_E4M3", &d) && d == DS4_F8_E4M3 && ds4_dtype_size(d) == 1);
    CHECK(!ds4_dtype_from_name("F99", &d));
}

int main(void) {
    RUN(test_alloc_counts_exact_bytes);
    RUN(test_peak_tracks_sum);
    RUN(test_tensor_views_share_storage);
    RUN(test_rng_counter_based);
    RUN(test_status_messages);
    RUN(test_bf16_roundtrip);
    TEST_MAIN_END("test_core");
}
