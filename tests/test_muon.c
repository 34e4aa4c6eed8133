/* Muon's pieces one by one (ds4/train.h, docs/muon.md): the Newton–Schulz output's singular values lie in
 * the band its schedule promises; a tall matrix is the transpose of its transpose's result, bit for bit;
 * the Muon group is the documented list; AdamW leaves the Muon group alone and changes no bit of its own
 * elements; Muon's state is 4 bytes per element of its group; the momentum streamed through the offload
 * store (--swap-optimizer) gives the resident bits; the registry's names.
 * The step against an independent PyTorch implementation is tests/test_muon_ref.py. */
#include "ds4/offload.h"
#include "ds4/train.h"
#include "test.h"
#include "test_models.h"

/* ------------------------------------------------------------------ singular values */
/* The eigenvalues of the symmetric s [n, n] (destroyed) into ev [n], by cyclic Jacobi rotations (double). */
static void jacobi_eigen(double *s, int n, double *ev) {
    for (int sweep = 0; sweep < 100; sweep++) {
        double off = 0;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) off += s[p * n + q] * s[p * n + q];
        if (off < 1e-30) break;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) {
                const double apq = s[p * n + q];
                if (fabs(apq) < 1e-300) continue;
                const double th = (s[q * n + q] - s[p * n + p]) / (2 * apq);
                const double t = (th >= 0 ? 1 : -1) / (fabs(th) + sqrt(th * th + 1)), c = 1 / sqrt(t * t + 1), sn = t * c;
                for (int k = 0; k < n; k++) { /* columns p, q */
                    const double kp = s[k * n + p], kq = s[k * n + q];
                    s[k * n + p] = c * kp - sn * kq;
                    s[k * n + q] = sn * kp + c * kq;
                }
                for (int k = 0; k < n; k++) { /* rows p, q */
                    const double pk = s[p * n + k], qk = s[q * n + k];
                    s[p * n + k] = c * pk - sn * qk;
                    s[q * n + k] = sn * pk + c * qk;
                }
            }
    }
    for (int i = 0; i < n; i++) ev[i] = s[i * n + i];
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* The min(r, c) singular values of x [r, c], ascending: square roots of the eigenvalues of the Gram matrix. */
static void singular_values(const float *x, int r, int c, double *sv) {
    const int k = r < c ? r : c;
    double *gram = malloc((size_t)k * k * sizeof(double));
    for (int i = 0; i < k; i++)
        for (int j = 0; j < k; j++) {
            double s = 0;
            for (int t = 0; t < (r < c ? c : r); t++)
                s += r < c ? (double)x[i * c + t] * x[j * c + t] : (double)x[t * c + i] * x[t * c + j];
            gram[i * k + j] = s;
        }
    jacobi_eigen(gram, k, sv);
    for (int i = 0; i < k; i++) sv[i] = sqrt(fmax(sv[i], 0));
    qsort(sv, (size_t)k, sizeof(double), cmp_double);
    free(gram);
}

/* ------------------------------------------------------------------ Newton–Schulz */
static const int k_shapes[][2] = {{32, 64}, {64, 32}, {48, 48}, {16, 200}, {96, 24}};

/* The schedule cfg applied to uniform random matrices: every singular value of the output at most hi, and
 * all but the ones whose input singular value is below 2e-3 of the Frobenius norm at least lo (the
 * iterations raise a small σ by at most 3.4445 each, so those few may stay below). */
static void check_band(const ds4_muon_cfg *cfg, double lo, double hi, const char *what) {
    ds4_ns_coef coef[DS4_MUON_NS_MAX];
    for (int64_t i = 0; i < cfg->ns_steps; i++) coef[i] = ds4_muon_coef(cfg, i);
    for (size_t s = 0; s < sizeof k_shapes / sizeof k_shapes[0]; s++) {
        const int r = k_shapes[s][0], c = k_shapes[s][1], k = r < c ? r : c;
        float *x = malloc((size_t)r * c * sizeof(float));
        double *in = malloc((size_t)k * sizeof(double)), *out = malloc((size_t)k * sizeof(double));
        t_fill(x, (long)r * c, 11 + (unsigned)s, 1.0f);
        singular_values(x, r, c, in);
        double fro = 0;
        for (int i = 0; i < k; i++) fro += in[i] * in[i];
        int small = 0;
        while (small < k && in[small] < 2e-3 * sqrt(fro)) small++;
        CHECK(ds4_newton_schulz(CPU_EXEC, x, r, c, coef, cfg->ns_steps, 1e-7f) == DS4_OK, "%s", ds4_errmsg());
        singular_values(x, r, c, out);
        CHECK(out[k - 1] <= hi, "%s %dx%d: largest singular value %.6f above %.4f", what, r, c, out[k - 1], hi);
        CHECK(out[small] >= lo, "%s %dx%d: singular value %.6f below %.4f (%d inputs under 2e-3 of the norm)", what, r,
              c, out[small], lo, small);
        CHECK(small <= 2, "%s %dx%d: %d tiny input singular values (the test matrix proves little)", what, r, c, small);
        free(x);
        free(in);
        free(out);
    }
}

/* DeepSeek-V4's hybrid schedule. In exact arithmetic 8 quintic steps map every σ in [2e-3, 1] into
 * [0.6818, 1.1344] and the 2 settling steps map that into [1.0000, 1.0005] (iterating the scalar maps);
 * fp32 products leave a few 1e-6: the band [0.999, 1.001] holds with room. */
static void test_ns_band_deepseek_v4(void) {
    ds4_muon_cfg c = ds4_muon_defaults();
    check_band(&c, 0.999, 1.001, "deepseek-v4 8+2");
}

/* Keller Jordan's 5 quintic steps (Moonlight's recipe): every σ in [2e-3, 1] lands in [0.6818, 1.2024]. */
static void test_ns_band_keller(void) {
    ds4_muon_cfg c = ds4_muon_defaults();
    c.ns_steps = 5;
    c.ns_final_steps = 0;
    check_band(&c, 0.68, 1.21, "keller 5");
}

/* A tall matrix is worked on as its transpose: NS(x) = NS(xᵀ)ᵀ exactly. */
static void test_ns_tall_is_transpose(void) {
    const int r = 40, c = 24;
    ds4_muon_cfg cfg = ds4_muon_defaults();
    ds4_ns_coef coef[DS4_MUON_NS_MAX];
    for (int64_t i = 0; i < cfg.ns_steps; i++) coef[i] = ds4_muon_coef(&cfg, i);
    float *x = malloc((size_t)r * c * sizeof(float)), *xt = malloc((size_t)r * c * sizeof(float));
    t_fill(x, (long)r * c, 5, 0.3f);
    for (int i = 0; i < r; i++)
        for (int j = 0; j < c; j++) xt[j * r + i] = x[i * c + j];
    CHECK(ds4_newton_schulz(CPU_EXEC, x, r, c, coef, cfg.ns_steps, 1e-7f) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_newton_schulz(CPU_EXEC, xt, c, r, coef, cfg.ns_steps, 1e-7f) == DS4_OK, "%s", ds4_errmsg());
    int diff = 0;
    for (int i = 0; i < r; i++)
        for (int j = 0; j < c; j++) diff += memcmp(&x[i * c + j], &xt[j * r + i], sizeof(float)) != 0;
    CHECK(diff == 0, "%d elements of NS(x) differ from NS(xT)T", diff);
    float z[4] = {0};
    CHECK(ds4_newton_schulz(CPU_EXEC, z, 0, 4, coef, 1, 1e-7f) == DS4_ERR_ARG && strstr(ds4_errmsg(), "0 x 4"),
          "a 0 x 4 matrix: %s", ds4_errmsg());
    CHECK(ds4_newton_schulz(CPU_EXEC, z, 2, 2, coef, 1, 1e-7f) == DS4_OK && z[0] == 0 && z[3] == 0,
          "a zero matrix stays zero");
    free(x);
    free(xt);
}

/* ------------------------------------------------------------------ the Muon group */
static void test_group_is_the_documented_list(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 1);
    if (!m) return;
    static const char *const muon[] = {"layers.0.attn.wq_a.weight", "layers.0.attn.wq_b.weight",
                                       "layers.0.attn.wkv.weight", "layers.0.attn.wo_a.weight",
                                       "layers.0.attn.wo_b.weight", "layers.1.attn.compressor.wkv.weight",
                                       "layers.1.attn.compressor.wgate.weight", "layers.1.attn.indexer.wq_b.weight",
                                       "layers.1.attn.indexer.weights_proj.weight",
                                       "layers.1.attn.indexer.compressor.wkv.weight", "layers.0.ffn.gate.weight",
                                       "layers.0.ffn.experts.0.w1.weight", "layers.3.ffn.experts.7.w2.weight",
                                       "layers.2.ffn.shared_experts.w3.weight", "mtp.0.e_proj.weight",
                                       "mtp.0.h_proj.weight", "mtp.0.ffn.experts.3.w3.weight"};
    static const char *const adamw[] = {"embed.weight", "head.weight", "norm.weight", "layers.0.attn_norm.weight",
                                        "layers.0.hc_attn_fn", "layers.0.hc_attn_base", "layers.0.hc_ffn_scale",
                                        "layers.2.attn.attn_sink", "layers.1.attn.compressor.ape",
                                        "layers.1.attn.compressor.norm.weight", "layers.0.attn.q_norm.weight",
                                        "hc_head_fn", "mtp.0.hc_head_fn", "mtp.0.enorm.weight"};
    for (size_t i = 0; i < sizeof muon / sizeof *muon; i++) {
        ds4_param *p = ds4_model_find(m, muon[i]);
        CHECK(p && ds4_param_is_muon(p), "%s should be in the Muon group", muon[i]);
    }
    for (size_t i = 0; i < sizeof adamw / sizeof *adamw; i++) {
        ds4_param *p = ds4_model_find(m, adamw[i]);
        CHECK(p && !ds4_param_is_muon(p), "%s should stay on AdamW", adamw[i]);
    }
    int64_t bias = 0, muon_n = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (p->no_grad || p->is_int) bias += ds4_param_is_muon(p);
        muon_n += ds4_param_is_muon(p);
    }
    CHECK(bias == 0, "the router bias or a hash table in the Muon group");
    /* per block: 5 attention + gate + 8·3 experts + 3 shared = 33; CSA (layers 1, 3) +2 compressor +2
     * indexer +2 indexer compressor, HCA (layer 2) +2 compressor; MTP block (SWA) 33 + e_proj, h_proj */
    CHECK(muon_n == 4 * 33 + 2 * 6 + 2 + 35, "%lld Muon matrices in tiny-a", (long long)muon_n);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------ AdamW beside Muon */
static const ds4_adamw_cfg k_adamw = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

static void fill_grads(ds4_model *m, int s) {
    t_fill(ds4_model_grads_flat(m), (long)ds4_model_numel(m), 40 + (unsigned)s, 0.5f);
}

/* Elements of the model's float parameters in the Muon group. */
static int64_t muon_elements(ds4_model *m) {
    int64_t n = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (ds4_param_in_flat(p) && ds4_param_is_muon(p)) n += p->numel;
    }
    return n;
}

/* In a Muon state, an AdamW step changes exactly the AdamW group, with the bits of an AdamW step over
 * everything, and its moments are those of the AdamW state at the same elements; Muon then changes exactly
 * the Muon group. */
static void test_adamw_leaves_the_muon_group(void) {
    ds4_model *a = tiny_model("tests/configs/tiny-a.json", 2), *b = tiny_model("tests/configs/tiny-a.json", 2);
    if (!a || !b) return;
    const int64_t n = ds4_model_numel(a);
    ds4_optim oa, ob;
    CHECK(ds4_optim_init(&oa, NULL, a, NULL, 0) == DS4_OK && ds4_optim_init(&ob, &ds4_optimizer_muon, b, NULL, 0) == DS4_OK,
          "%s", ds4_errmsg());
    float *w0 = malloc((size_t)n * sizeof(float));
    memcpy(w0, ds4_model_params_flat(b), (size_t)n * sizeof(float));
    fill_grads(a, 0);
    fill_grads(b, 0);
    CHECK(ds4_adamw_step(&oa, a, &k_adamw, 1e-3) == DS4_OK && ds4_adamw_step(&ob, b, &k_adamw, 1e-3) == DS4_OK);
    const float *wa = ds4_model_params_flat(a), *wb = ds4_model_params_flat(b);
    int64_t bad_adamw = 0, bad_muon = 0;
    for (int64_t i = 0; i < ds4_model_nparams(b); i++) {
        const ds4_param *p = ds4_model_param(b, i);
        if (p->is_int) continue;
        const int64_t o = p->data - wb;
        for (int64_t k = 0; k < p->numel; k++) {
            int64_t j;
            const int g = ds4_optim_locate(&ob, o + k, &j);
            if (ds4_param_is_muon(p)) bad_muon += wb[o + k] != w0[o + k] || g != DS4_OPT_OWN || ob.g[g].mem[0][j] != 0;
            else
                bad_adamw += memcmp(&wa[o + k], &wb[o + k], sizeof(float)) != 0 || g != DS4_OPT_ADAMW ||
                             memcmp(&oa.g[0].mem[0][o + k], &ob.g[0].mem[0][j], sizeof(float)) != 0 ||
                             memcmp(&oa.g[0].mem[1][o + k], &ob.g[0].mem[1][j], sizeof(float)) != 0;
        }
    }
    CHECK(bad_adamw == 0, "%lld AdamW-group weights or moments differ from a plain AdamW step", (long long)bad_adamw);
    CHECK(bad_muon == 0, "%lld Muon-group elements touched by AdamW", (long long)bad_muon);
    const ds4_muon_cfg mc = ds4_muon_defaults();
    memcpy(w0, wb, (size_t)n * sizeof(float));
    CHECK(ds4_muon_step(&ob, b, &mc, k_adamw.weight_decay, 1e-3) == DS4_OK, "%s", ds4_errmsg());
    int64_t moved = 0, strays = 0;
    for (int64_t i = 0; i < ds4_model_nparams(b); i++) {
        const ds4_param *p = ds4_model_param(b, i);
        if (p->is_int) continue;
        const int64_t o = p->data - wb;
        for (int64_t k = 0; k < p->numel; k++) {
            if (ds4_param_is_muon(p)) moved += wb[o + k] != w0[o + k];
            else strays += wb[o + k] != w0[o + k];
        }
    }
    CHECK(strays == 0, "Muon changed %lld AdamW-group weights", (long long)strays);
    CHECK(moved > n / 2, "Muon moved only %lld of %lld elements", (long long)moved, (long long)n);
    CHECK(ds4_muon_step(&oa, a, &mc, 0.1, 1e-3) == DS4_ERR_ARG && strstr(ds4_errmsg(), "not Muon's"),
          "Muon on an AdamW state: %s", ds4_errmsg());
    ds4_optim_free(&oa);
    ds4_optim_free(&ob);
    free(w0);
    ds4_model_free(a);
    ds4_model_free(b);
}

/* Muon owns its state: 4 bytes per element of its group (the momentum) and AdamW's 8 per element of the rest,
 * measured by the allocator, resident and in the offload store; nothing else per element. */
static void test_state_bytes_per_element(void) {
    ds4_model *m = tiny_model("tests/configs/tiny-a.json", 1);
    ds4_offload *store = NULL;
    CHECK(ds4_offload_open(NULL, NULL, &store) == DS4_OK, "%s", ds4_errmsg());
    if (!m || !store) return;
    const int64_t n = ds4_model_numel(m), nm = muon_elements(m);
    CHECK(nm > n / 2 && nm < n, "%lld of %lld elements in the Muon group", (long long)nm, (long long)n);
    for (int swapped = 0; swapped < 2; swapped++) {
        ds4_mem_stats s0, s1;
        ds4_mem_get(&s0);
        ds4_optim o;
        CHECK(ds4_optim_init(&o, &ds4_optimizer_muon, m, swapped ? store : NULL, 0) == DS4_OK, "%s", ds4_errmsg());
        ds4_mem_get(&s1);
        const int64_t res = s1.live[DS4_MEM_OPTIM] - s0.live[DS4_MEM_OPTIM],
                      off = s1.offload_live[DS4_MEM_OPTIM] - s0.offload_live[DS4_MEM_OPTIM];
        CHECK((swapped ? off : res) == 4 * nm + 8 * (n - nm) && (swapped ? res : off) == 0,
              "%s: %lld resident + %lld offloaded optimizer bytes for %lld Muon and %lld AdamW elements (expected 4 and 8 "
              "bytes each)", swapped ? "swapped" : "resident", (long long)res, (long long)off, (long long)nm,
              (long long)(n - nm));
        CHECK(o.g[DS4_OPT_OWN].n == nm && o.g[DS4_OPT_OWN].k == 1 && o.g[DS4_OPT_ADAMW].n == n - nm &&
                  !strcmp(o.g[DS4_OPT_OWN].names[0], "muon.momentum"),
              "groups %lld + %lld", (long long)o.g[DS4_OPT_OWN].n, (long long)o.g[DS4_OPT_ADAMW].n);
        ds4_optim_free(&o);
    }
    ds4_offload_close(store);
    ds4_model_free(m);
}

/* --swap-optimizer: the momentum read and written through the store gives the resident bits, 3 steps. */
static void test_swapped_momentum_is_bitwise(void) {
    ds4_model *a = tiny_model("tests/configs/tiny-a.json", 4), *b = tiny_model("tests/configs/tiny-a.json", 4);
    ds4_offload *store = NULL;
    CHECK(ds4_offload_open(NULL, NULL, &store) == DS4_OK, "%s", ds4_errmsg());
    if (!a || !b || !store) return;
    const int64_t n = ds4_model_numel(a);
    ds4_optim oa, ob;
    CHECK(ds4_optim_init(&oa, &ds4_optimizer_muon, a, NULL, 0) == DS4_OK);
    CHECK(ds4_optim_init(&ob, &ds4_optimizer_muon, b, store, 4096) == DS4_OK);
    const ds4_muon_cfg mc = ds4_muon_defaults();
    const ds4_opt_target ta = {.m = a}, tb = {.m = b};
    for (int s = 0; s < 3; s++) {
        fill_grads(a, s);
        fill_grads(b, s);
        CHECK(ds4_adamw_step(&oa, a, &k_adamw, 2e-3) == DS4_OK && ds4_optim_own_step(&oa, &ta, &mc, 0.1, 2e-3) == DS4_OK);
        CHECK(ds4_adamw_step(&ob, b, &k_adamw, 2e-3) == DS4_OK && ds4_optim_own_step(&ob, &tb, &mc, 0.1, 2e-3) == DS4_OK,
              "%s", ds4_errmsg());
    }
    CHECK(memcmp(ds4_model_params_flat(a), ds4_model_params_flat(b), (size_t)n * sizeof(float)) == 0,
          "swapped weights differ from resident");
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int k = 0; k < oa.g[g].k; k++) {
            float *x = malloc((size_t)oa.g[g].n * sizeof(float));
            CHECK(ds4_optim_read(&ob, g, k, 0, ob.g[g].n, x) == DS4_OK);
            CHECK(memcmp(x, oa.g[g].mem[k], (size_t)oa.g[g].n * sizeof(float)) == 0, "swapped %s differs from resident",
                  oa.g[g].names[k]);
            free(x);
        }
    ds4_optim_free(&oa);
    ds4_optim_free(&ob);
    ds4_offload_close(store);
    ds4_model_free(a);
    ds4_model_free(b);
}

/* optimizer.name picks an entry of the registry, in any case; an unknown name is one error line naming the
 * key and every known name. */
static void test_registry(void) {
    const ds4_optimizer *e = NULL;
    CHECK(ds4_optimizer_find("muon", &e) == DS4_OK && e == &ds4_optimizer_muon, "muon");
    CHECK(ds4_optimizer_find("AdamW", &e) == DS4_OK && e == &ds4_optimizer_adamw, "AdamW");
    CHECK(ds4_optimizer_find("Lion", &e) == DS4_ERR_CONFIG && e == NULL, "an unknown name was accepted");
    const char *msg = ds4_errmsg();
    CHECK(strstr(msg, "optimizer.name") && strstr(msg, "'Lion'") && strstr(msg, "\"AdamW\"") && strstr(msg, "\"Muon\"") &&
              !strchr(msg, '\n'),
          "message: %s", msg);
    int n = 0;
    while (ds4_optimizer_at(n)) n++;
    CHECK(n == 2 && ds4_optimizer_at(0) == &ds4_optimizer_adamw, "%d entries", n);
}

int main(void) {
    ds4_set_threads(2);
    RUN(test_ns_band_deepseek_v4);
    RUN(test_ns_band_keller);
    RUN(test_ns_tall_is_transpose);
    RUN(test_group_is_the_documented_list);
    RUN(test_adamw_leaves_the_muon_group);
    RUN(test_state_bytes_per_element);
    RUN(test_swapped_momentum_is_bitwise);
    RUN(test_registry);
    TEST_MAIN_END("test_muon");
}
