/* The census of a config (ds4 init --dry-run, ds4 inspect --config): the real April V4-Flash config
 * gives the official checkpoint's tensor count, stored elements and bytes (its index's total_size,
 * docs/dsv4-architecture.md §8) without allocating anything; V4-Pro gives the counts of the parameter
 * table; a tiny model's census equals what ds4_model_create builds; bad configs fail with one line. */
#include "ds4/model.h"
#include "test.h"

static bool census_of(const char *path, ds4_config *c, ds4_param_census *k) {
    return ds4_config_load(path, c) == DS4_OK && ds4_model_census(c, k) == DS4_OK;
}

/* DeepSeek-V4-Flash: 46 shards, 69,187 tensors, 158,069,433,298 stored elements, total_size
 * 159,609,485,896 B in model.safetensors.index.json; the groups as the table counts them. */
static void test_flash_official(void) {
    ds4_config c;
    ds4_param_census k;
    ds4_mem_stats before, after;
    CHECK(ds4_config_load("configs/deepseek-v4-flash.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_reset_peak();
    ds4_mem_get(&before);
    CHECK(ds4_model_census(&c, &k) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_get(&after);
    CHECK(after.peak_total == before.peak_total && after.n_allocs == before.n_allocs,
          "the census allocated %lld bytes", (long long)(after.peak_total - before.peak_total));
    CHECK(k.quantized && k.expert_fp4);
    CHECK(k.total_bytes == 159609485896LL, "%lld", (long long)k.total_bytes);
    CHECK(k.stored_elements == 158069433298LL, "%lld", (long long)k.stored_elements);
    CHECK(k.stored_tensors == 69187, "%lld", (long long)k.stored_tensors);
    CHECK(k.params_expert == 277025390592LL, "%lld", (long long)k.params_expert);
    CHECK(k.params_dense == 7306849879LL, "%lld", (long long)k.params_dense);
    CHECK(k.params_mtp == 6610048891LL, "%lld", (long long)k.params_mtp);
    CHECK(k.params_total == k.params_expert + k.params_dense + k.params_mtp);
    CHECK(k.hash_entries == 3 * 129280 * 6, "%lld", (long long)k.hash_entries);
    /* main model without MTP: the advertised 284B */
    CHECK(k.params_expert + k.params_dense > 284000000000LL && k.params_expert + k.params_dense < 285000000000LL);
    CHECK(k.bytes[DS4_F8_E4M3] == 6023020544LL && k.bytes[DS4_F8_E8M0] == 8858737664LL, "fp8 / scales");
    CHECK(k.bytes[DS4_I8] == 141733920768LL && k.bytes[DS4_BF16] == 2830518528LL, "fp4 / bf16");
    CHECK(k.bytes[DS4_F32] == 144672072LL && k.bytes[DS4_I64] == 18616320LL, "f32 / i64");
}

/* DeepSeek-V4-Pro: 1.6T parameters (1.57T without MTP); counts and bytes of the parameter table. */
static void test_pro(void) {
    ds4_config c;
    ds4_param_census k;
    CHECK(census_of("configs/deepseek-v4-pro.json", &c, &k), "%s", ds4_errmsg());
    CHECK(k.params_expert == 1547396186112LL, "%lld", (long long)k.params_expert);
    CHECK(k.params_dense == 25601015651LL, "%lld", (long long)k.params_dense);
    CHECK(k.params_mtp == 25840145979LL, "%lld", (long long)k.params_mtp);
    CHECK(k.params_total == 1598837347742LL, "%lld", (long long)k.params_total);
    CHECK(k.stored_tensors == 145116, "%lld", (long long)k.stored_tensors);
    CHECK(k.total_bytes == 864704792696LL, "%lld", (long long)k.total_bytes);
}

/* A tiny model: the census counts what ds4_model_create lays out, tensor for tensor. */
static void test_matches_model(void) {
    ds4_config c;
    ds4_param_census k;
    CHECK(census_of("tests/configs/tiny-a.json", &c, &k), "%s", ds4_errmsg());
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    CHECK(k.params_total == ds4_model_numel(m), "%lld vs %lld", (long long)k.params_total,
          (long long)ds4_model_numel(m));
    CHECK(k.tensors == ds4_model_nparams(m) && k.stored_tensors == k.tensors);
    int64_t mtp = 0, hash = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (!strncmp(p->name, "mtp.", 4) && !p->is_int) mtp += p->numel;
        if (p->is_int) hash += p->numel;
    }
    CHECK(k.params_mtp == mtp && k.hash_entries == hash, "mtp %lld vs %lld, hash %lld vs %lld",
          (long long)k.params_mtp, (long long)mtp, (long long)k.hash_entries, (long long)hash);
    CHECK(!k.quantized && k.bytes[DS4_F8_E4M3] == 0 && k.bytes[DS4_I8] == 0);
    CHECK(k.bytes[DS4_BF16] % 2 == 0 && k.bytes[DS4_F32] > 0);
    CHECK(k.total_bytes == 2 * (k.stored_elements - k.hash_entries) + 2 * (k.bytes[DS4_F32] / 4) + 8 * k.hash_entries);
    ds4_model_free(m);
}

/* DeepSeek-V4-Flash-0731: the main model is April's without its MTP block, and the three DSpark stages
 * (FP8 main_proj and projections, FP4 experts) bring the checkpoint to the official index's total_size,
 * 166,878,536,440 B (docs/dspark.md). */
static void test_flash_0731(void) {
    ds4_config c;
    ds4_param_census k;
    CHECK(census_of("tests/data/deepseek-v4-flash-0731.config.json", &c, &k), "%s", ds4_errmsg());
    CHECK(k.total_bytes == 166878536440LL, "%lld", (long long)k.total_bytes);
    CHECK(k.params_expert == 277025390592LL && k.params_dense == 7306849879LL && k.params_mtp == 0,
          "expert %lld, dense %lld, mtp %lld", (long long)k.params_expert, (long long)k.params_dense,
          (long long)k.params_mtp);
    CHECK(k.params_dspark > 0 && k.params_total == k.params_expert + k.params_dense + k.params_dspark);
}

/* A tiny DSpark model: the census's drafter count is the carried tensors ds4_model_create holds. */
static void test_dspark_matches_model(void) {
    ds4_config c;
    ds4_param_census k;
    CHECK(census_of("tests/configs/tiny-dspark.json", &c, &k), "%s", ds4_errmsg());
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    int64_t carried = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++)
        if (ds4_model_param(m, i)->carried) carried += ds4_model_param(m, i)->numel;
    CHECK(carried > 0 && k.params_dspark == carried, "census %lld, model %lld", (long long)k.params_dspark,
          (long long)carried);
    CHECK(k.params_total - k.params_dspark == ds4_model_numel(m));
    ds4_model_free(m);
}

static void test_bad_config(void) {
    ds4_config c;
    ds4_param_census k;
    CHECK(ds4_config_load("configs/deepseek-v4-flash.json", &c) == DS4_OK, "%s", ds4_errmsg());
    c.o_groups = 7; /* does not divide the 64 heads */
    CHECK(ds4_model_census(&c, &k) == DS4_ERR_CONFIG);
    CHECK(strstr(ds4_errmsg(), "o_groups") != NULL && !strchr(ds4_errmsg(), '\n'), "%s", ds4_errmsg());
}

int main(void) {
    RUN(test_flash_official);
    RUN(test_pro);
    RUN(test_matches_model);
    RUN(test_flash_0731);
    RUN(test_dspark_matches_model);
    RUN(test_bad_config);
    TEST_MAIN_END("test_census");
}
