/* libFuzzer target: model.safetensors.index.json text -> ds4_model_dir_open of a directory with a
 * valid config and two valid shards, then lookups and --check. The index may name shards, tensors
 * and paths at will; it must never reach outside the directory or crash. */
#include "ds4/io.h"
#include "ds4/model.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[512], g_index[600];

static const char k_config[] =
    "{\"vocab_size\":256,\"hidden_size\":64,\"num_hidden_layers\":2,\"num_nextn_predict_layers\":0,\"num_hash_layers\":1,"
    "\"num_attention_heads\":4,\"num_key_value_heads\":1,\"head_dim\":32,\"qk_rope_head_dim\":8,\"q_lora_rank\":32,"
    "\"o_groups\":2,\"o_lora_rank\":16,\"sliding_window\":16,\"compress_ratios\":[0,4],\"index_n_heads\":2,"
    "\"index_head_dim\":16,\"index_topk\":4,\"n_routed_experts\":8,\"n_shared_experts\":1,\"num_experts_per_tok\":2,"
    "\"moe_intermediate_size\":32,\"routed_scaling_factor\":1.5,\"swiglu_limit\":10.0,\"hc_mult\":4,"
    "\"hc_sinkhorn_iters\":20,\"hc_eps\":1e-6,\"rms_norm_eps\":1e-6,\"rope_theta\":10000,\"compress_rope_theta\":160000}";

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(p, 1, n, f) != n) abort();
    fclose(f);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *base = getenv("DS4_FUZZ_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/ds4_fuzz_index_XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(g_dir)) abort();
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", g_dir);
    write_file(p, k_config, strlen(k_config));
    ds4_config c;
    if (ds4_config_load(p, &c) != DS4_OK) {
        fprintf(stderr, "fuzz_index: fixture config rejected: %s\n", ds4_errmsg());
        abort();
    }
    float w[32 * 64] = {0};
    uint8_t q[32 * 64] = {0x38}, sc[1] = {127};
    int64_t s2[2] = {32, 64}, s1[1] = {64}, ss[2] = {1, 1}, ti[2] = {256, 2};
    static int64_t tid[512];
    const char *shard[2] = {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
    for (int k = 0; k < 2; k++) {
        ds4_st_writer *wr;
        if (ds4_st_writer_new(&wr) != DS4_OK) abort();
        if (k == 0) {
            ds4_st_writer_add(wr, "embed.weight", DS4_F32, 1, s1, w);
            ds4_st_writer_add(wr, "layers.0.attn.wq_a.weight", DS4_F8_E4M3, 2, s2, q);
            ds4_st_writer_add(wr, "layers.0.ffn.gate.tid2eid", DS4_I64, 2, ti, tid);
        } else {
            ds4_st_writer_add(wr, "layers.0.attn.wq_a.scale", DS4_F8_E8M0, 2, ss, sc);
            ds4_st_writer_add(wr, "model.layers.1.self_attn.kv_proj.weight", DS4_F32, 2, s2, w);
        }
        snprintf(p, sizeof p, "%s/%s", g_dir, shard[k]);
        if (ds4_st_writer_write(wr, p) != DS4_OK) abort();
        ds4_st_writer_free(wr);
    }
    snprintf(g_index, sizeof g_index, "%s/model.safetensors.index.json", g_dir);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    write_file(g_index, data, size);
    ds4_model_dir *d = NULL;
    ds4_status s = ds4_model_dir_open(g_dir, &d);
    if (s != DS4_OK) {
        if (d || !ds4_errmsg()[0]) abort();
    } else {
        static const char *names[] = {"embed.weight", "layers.0.attn.wq_a.weight", "layers.1.attn.wkv.weight",
                                      "layers.0.ffn.gate.tid2eid", "nothing"};
        for (int i = 0; i < 5; i++) {
            ds4_tensor_loc loc;
            if (ds4_model_dir_locate(d, names[i], &loc) == DS4_OK) {
                ds4_tensor_stats st;
                (void)ds4_tensor_loc_stats(&loc, &st);
            }
        }
        int64_t n;
        if (ds4_model_dir_check(d, NULL, NULL, &n) != DS4_OK) abort();
        if (getenv("DS4_FUZZ_VERBOSE")) fprintf(stderr, "opened: %lld shards, %lld check problems\n", (long long)ds4_model_dir_nfiles(d), (long long)n);
        ds4_model_dir_close(d);
    }
    ds4_mem_stats m;
    ds4_mem_get(&m);
    if (m.live_total != 0) abort();
    return 0;
}
