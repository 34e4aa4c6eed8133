/* The optimizer socket (ds4/train.h): the registry, the state of an optimizer (its runs of parameters and
 * each group's arrays, resident or in the offload store), AdamW's update of its group and optim.state;
 * also the LR schedule, clipping and the router bias rule. Muon's own update is muon.c. The per-element
 * arithmetic is in src/core/norm.c: this file walks runs and calls it. */
#include "ds4/train.h"

#include "ds4/io.h"
#include "ds4/offload.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* ------------------------------------------------------------------ the registry */
static const ds4_optimizer *const k_registry[] = {&ds4_optimizer_adamw, &ds4_optimizer_muon};
enum { NREGISTRY = sizeof k_registry / sizeof *k_registry };

const ds4_optimizer *ds4_optimizer_at(int i) { return i >= 0 && i < NREGISTRY ? k_registry[i] : NULL; }

ds4_status ds4_optimizer_find(const char *name, const ds4_optimizer **out) {
    *out = NULL;
    char known[256] = "";
    size_t at = 0;
    for (int i = 0; i < NREGISTRY; i++) {
        if (!strcasecmp(name, k_registry[i]->name)) {
            *out = k_registry[i];
            return DS4_OK;
        }
        if (at < sizeof known) at += (size_t)snprintf(known + at, sizeof known - at, "%s\"%s\"", i ? ", " : "", k_registry[i]->name);
    }
    return ds4_fail(DS4_ERR_CONFIG, "key optimizer.name: unknown optimizer '%s' (known: %s)", name, known);
}

bool ds4_optimizer_takes(const ds4_optimizer *opt, const ds4_param *p) {
    return opt && opt->takes && !p->is_int && !p->no_grad && opt->takes(p);
}

static const ds4_optimizer *entry_or_adamw(const ds4_optimizer *opt) { return opt ? opt : &ds4_optimizer_adamw; }

/* ------------------------------------------------------------------ the runs */
static int run_cmp(const void *a, const void *b) {
    const int64_t x = ((const ds4_opt_run *)a)->off, y = ((const ds4_opt_run *)b)->off;
    return x < y ? -1 : x > y;
}

/* The runs being laid out: written to out (NULL: only counted), the last one kept for merging. */
typedef struct {
    ds4_opt_run *out;
    int64_t cnt;
    ds4_opt_run last;
} run_list;

/* Appends [off, off + n) under a rule, merged into the last run when it continues it with the same rule. */
static void run_put(run_list *l, int64_t off, int64_t n, bool decay, bool frozen, bool own, bool absent) {
    if (n <= 0) return;
    if (l->cnt > 0 && l->last.decay == decay && l->last.frozen == frozen && l->last.own == own &&
        l->last.absent == absent)
        l->last.n += n;
    else {
        l->last = (ds4_opt_run){.off = off, .n = n, .decay = decay, .frozen = frozen, .own = own, .absent = absent};
        l->cnt++;
    }
    if (l->out) l->out[l->cnt - 1] = l->last;
}

/* The runs covering [0, n) back to back: the sorted ranges r [nr], the gaps between them trained by AdamW
 * without decay (gaps_absent: absent), neighbours of the same rule merged. Returns how many. */
static int64_t cover(const ds4_opt_run *r, int64_t nr, int64_t n, bool gaps_absent, ds4_opt_run *out) {
    run_list l = {.out = out};
    int64_t at = 0;
    for (int64_t i = 0; i < nr; i++) {
        run_put(&l, at, r[i].off - at, false, false, false, gaps_absent);
        run_put(&l, r[i].off, r[i].n, r[i].decay, r[i].frozen, r[i].own, r[i].absent);
        at = r[i].off + r[i].n;
    }
    run_put(&l, at, n - at, false, false, false, gaps_absent);
    return l.cnt;
}

/* r [nr] sorted by offset: each inside [0, n), none overlapping the next. */
static ds4_status ranges_check(const ds4_opt_run *r, int64_t nr, int64_t n) {
    for (int64_t i = 0; i < nr; i++) {
        if (r[i].off < 0 || r[i].n < 0 || r[i].off > n - r[i].n)
            return ds4_fail(DS4_ERR_ARG, "optimizer: range [%lld, %lld) is outside the %lld elements of the state",
                            (long long)r[i].off, (long long)(r[i].off + r[i].n), (long long)n);
        if (i > 0 && r[i].off < r[i - 1].off + r[i - 1].n)
            return ds4_fail(DS4_ERR_ARG, "optimizer: ranges [%lld, %lld) and [%lld, %lld) overlap",
                            (long long)r[i - 1].off, (long long)(r[i - 1].off + r[i - 1].n), (long long)r[i].off,
                            (long long)(r[i].off + r[i].n));
    }
    return DS4_OK;
}

/* Each group's elements numbered in run order (soff), and each group's list of runs; without an own group
 * AdamW's group is every run at its flat offset, and nothing is kept for it. */
static ds4_status index_groups(ds4_optim *o) {
    o->ngrun[DS4_OPT_ADAMW] = o->nruns;
    o->g[DS4_OPT_ADAMW].n = o->n;
    bool absent = false;
    for (int64_t i = 0; i < o->nruns; i++) absent = absent || o->runs[i].absent;
    if (!o->opt->takes && !absent) return DS4_OK;
    o->ngrun[DS4_OPT_ADAMW] = 0;
    for (int64_t i = 0; i < o->nruns; i++)
        if (!o->runs[i].absent) o->ngrun[o->runs[i].own]++;
    if (!(o->soff = ds4_alloc(DS4_MEM_OTHER, (size_t)o->nruns * sizeof(int64_t))))
        return ds4_fail(DS4_ERR_OOM, "out of memory for %lld optimizer runs", (long long)o->nruns);
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        if (!(o->grun[g] = ds4_alloc(DS4_MEM_OTHER, (size_t)o->ngrun[g] * sizeof(int64_t))))
            return ds4_fail(DS4_ERR_OOM, "out of memory for %lld optimizer runs", (long long)o->nruns);
    int64_t next[DS4_OPT_NGROUPS] = {0, 0}, cnt[DS4_OPT_NGROUPS] = {0, 0};
    for (int64_t i = 0; i < o->nruns; i++) {
        const int g = o->runs[i].own;
        o->soff[i] = next[g]; /* an absent run: where the next one starts (it has no element) */
        if (o->runs[i].absent) continue;
        next[g] += o->runs[i].n;
        o->grun[g][cnt[g]++] = i;
    }
    for (int g = 0; g < DS4_OPT_NGROUPS; g++) o->g[g].n = next[g];
    return DS4_OK;
}

/* The runs of the rules r [nr] (replacing the ones there); the elements in none of them absent when
 * gaps_absent, else AdamW's without decay. */
static ds4_status set_runs(ds4_optim *o, const ds4_opt_run *r, int64_t nr, bool gaps_absent) {
    if (nr < 0) return ds4_fail(DS4_ERR_ARG, "optimizer: %lld ranges", (long long)nr);
    ds4_opt_run *sorted = ds4_alloc(DS4_MEM_OTHER, (size_t)nr * sizeof *sorted), *runs = NULL;
    if (!sorted) return ds4_fail(DS4_ERR_OOM, "out of memory for %lld optimizer ranges", (long long)nr);
    int64_t ns = 0; /* the non-empty ones: an empty range has no element to rule */
    for (int64_t i = 0; i < nr; i++)
        if (r[i].n != 0) sorted[ns++] = r[i];
    for (int64_t i = 0; i < ns; i++)
        sorted[i].own = sorted[i].own && !sorted[i].frozen && !sorted[i].absent && o->opt->takes;
    qsort(sorted, (size_t)ns, sizeof *sorted, run_cmp);
    ds4_status st = ranges_check(sorted, ns, o->n);
    if (st == DS4_OK &&
        !(runs = ds4_alloc(DS4_MEM_OTHER, (size_t)cover(sorted, ns, o->n, gaps_absent, NULL) * sizeof *runs)))
        st = ds4_fail(DS4_ERR_OOM, "out of memory for %lld optimizer ranges", (long long)nr);
    if (st == DS4_OK) {
        ds4_free(o->runs);
        o->runs = runs;
        o->nruns = cover(sorted, ns, o->n, gaps_absent, runs);
    }
    ds4_free(sorted);
    return st;
}

/* The run (index into o->runs) at position i of group g's runs, and where it starts in the group's arrays. */
static int64_t grun(const ds4_optim *o, int g, int64_t i) { return o->grun[g] ? o->grun[g][i] : i; }
static int64_t run_soff(const ds4_optim *o, int64_t r) { return o->soff ? o->soff[r] : o->runs[r].off; }

/* The first run of o->runs that holds flat element i (0 <= i < n). */
static int64_t run_at(const ds4_optim *o, int64_t i) {
    int64_t lo = 0, hi = o->nruns - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (o->runs[mid].off <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

/* The first position in group g's run list whose run holds state element j (0 <= j < the group's n). */
static int64_t grun_at(const ds4_optim *o, int g, int64_t j) {
    int64_t lo = 0, hi = o->ngrun[g] - 1;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo + 1) / 2;
        if (run_soff(o, grun(o, g, mid)) <= j) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

bool ds4_optim_holds(const ds4_optim *o, int64_t i) { return i >= 0 && i < o->n && !o->runs[run_at(o, i)].absent; }

int ds4_optim_locate(const ds4_optim *o, int64_t i, int64_t *j) {
    const int64_t k = run_at(o, i);
    *j = run_soff(o, k) + (i - o->runs[k].off);
    return o->runs[k].own ? DS4_OPT_OWN : DS4_OPT_ADAMW;
}

/* ------------------------------------------------------------------ the arrays */
static int64_t chunk_elems(size_t chunk_bytes) {
    const size_t per = 2 * sizeof(float); /* AdamW's m, v */
    const int64_t n = (int64_t)((chunk_bytes ? chunk_bytes : DS4_ADAMW_SWAP_CHUNK) / per);
    return n > 0 ? n : 1;
}

/* The arrays of each group, zero: resident, or (store) made in the store. */
static ds4_status make_arrays(ds4_optim *o) {
    for (int g = 0; g < DS4_OPT_NGROUPS; g++) {
        ds4_opt_group *G = &o->g[g];
        for (int a = 0; a < G->k; a++) {
            const size_t bytes = (size_t)G->n * sizeof(float);
            if (G->n == 0) continue;
            if (o->store) DS4_TRY(ds4_offload_alloc(o->store, DS4_MEM_OPTIM, bytes, &G->h[a]));
            else if (!(G->mem[a] = ds4_dev_zalloc(&o->exec, DS4_MEM_OPTIM, bytes)))
                return ds4_fail(DS4_ERR_OOM, "out of memory for the optimizer state (%lld elements of %s)",
                                (long long)G->n, G->names[a]);
        }
    }
    return DS4_OK;
}

static ds4_status init_runs(ds4_optim *o, const ds4_exec *ex, const ds4_optimizer *opt, int64_t n,
                            const ds4_opt_run *r, int64_t nr, bool gaps_absent, ds4_offload *store,
                            size_t chunk_bytes) {
    memset(o, 0, sizeof *o);
    o->exec = ex ? *ex : (ds4_exec){0};
    o->opt = entry_or_adamw(opt);
    o->n = n;
    o->store = store;
    o->swapped = store != NULL;
    o->chunk = chunk_elems(chunk_bytes);
    o->g[DS4_OPT_ADAMW] = (ds4_opt_group){.k = 2, .names = ds4_optimizer_adamw.state_names};
    if (o->opt->takes) o->g[DS4_OPT_OWN] = (ds4_opt_group){.k = o->opt->nstate, .names = o->opt->state_names};
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < DS4_OPT_ARRAYS_MAX; a++) o->g[g].h[a] = -1;
    /* one run over everything (AdamW, no decay) until the rules replace it */
    ds4_status st = set_runs(o, NULL, 0, false);
    if (st == DS4_OK) st = set_runs(o, r, nr, gaps_absent);
    if (st == DS4_OK) st = index_groups(o);
    if (st == DS4_OK) st = make_arrays(o);
    if (st != DS4_OK) ds4_optim_free(o);
    return st;
}

ds4_status ds4_optim_init_runs(ds4_optim *o, const ds4_exec *ex, const ds4_optimizer *opt, int64_t n,
                               const ds4_opt_run *r, int64_t nr, ds4_offload *store, size_t chunk_bytes) {
    return init_runs(o, ex, opt, n, r, nr, false, store, chunk_bytes);
}

ds4_status ds4_optim_init(ds4_optim *o, const ds4_optimizer *opt, ds4_model *m, ds4_offload *store, size_t chunk_bytes) {
    const float *base = ds4_model_params_flat(m);
    ds4_opt_run *r = ds4_alloc(DS4_MEM_OTHER, (size_t)ds4_model_nparams(m) * sizeof *r);
    if (!r) return ds4_fail(DS4_ERR_OOM, "out of memory for the optimizer ranges");
    int64_t nr = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (ds4_param_in_flat(p) && ds4_model_param_held(m, p, true))
            r[nr++] = (ds4_opt_run){.off = p->data - base, .n = p->numel, .decay = !p->no_decay, .frozen = p->no_grad,
                                    .own = ds4_optimizer_takes(entry_or_adamw(opt), p)};
    }
    /* an unmapped model (a pipeline stage): what it does not train, and the padding, has no state */
    ds4_status st = init_runs(o, ds4_model_exec(m), opt, ds4_model_numel(m), r, nr, ds4_model_held_bytes(m, true) > 0,
                              store, chunk_bytes);
    ds4_free(r);
    return st;
}

/* Each piece of an FSDP shard as a run in shard offsets: counted (r NULL) or written. */
typedef struct {
    ds4_opt_run *r;
    int64_t n;
    const ds4_optimizer *opt;
} piece_ctx;
static void piece_run(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    piece_ctx *c = ctx;
    if (c->r)
        c->r[c->n] = (ds4_opt_run){.off = s0, .n = k1 - k0, .decay = !p->no_decay, .frozen = p->no_grad,
                                   .own = ds4_optimizer_takes(c->opt, p)};
    c->n++;
}

ds4_status ds4_optim_init_shard(ds4_optim *o, const ds4_optimizer *opt, const ds4_fsdp *f, ds4_offload *store,
                                size_t chunk_bytes) {
    piece_ctx c = {.opt = entry_or_adamw(opt)};
    ds4_fsdp_for_each_piece(f, piece_run, &c);
    c.r = ds4_alloc(DS4_MEM_OTHER, (size_t)c.n * sizeof *c.r);
    if (!c.r) return ds4_fail(DS4_ERR_OOM, "fsdp: out of memory for %lld optimizer ranges", (long long)c.n);
    c.n = 0;
    ds4_fsdp_for_each_piece(f, piece_run, &c);
    ds4_status st = ds4_optim_init_runs(o, ds4_fsdp_exec(f), opt, ds4_fsdp_shard_numel(f), c.r, c.n, store, chunk_bytes);
    ds4_free(c.r);
    return st;
}

void ds4_optim_free(ds4_optim *o) {
    for (int g = 0; g < DS4_OPT_NGROUPS; g++) {
        for (int a = 0; a < o->g[g].k; a++) {
            ds4_dev_free(&o->exec, o->g[g].mem[a]);
            if (o->store) ds4_offload_drop(o->store, o->g[g].h[a]); /* -1 (never made): no-op */
        }
        ds4_free(o->grun[g]);
    }
    ds4_free(o->soff);
    ds4_free(o->runs);
    memset(o, 0, sizeof *o);
}

/* Elements [i0, i0 + n) of array a of group g: bounds checked. */
static ds4_status span_check(const ds4_optim *o, int g, int a, int64_t i0, int64_t n) {
    if (g < 0 || g >= DS4_OPT_NGROUPS || a < 0 || a >= o->g[g].k || i0 < 0 || n < 0 || i0 > o->g[g].n ||
        n > o->g[g].n - i0)
        return ds4_fail(DS4_ERR_ARG, "optimizer state: group %d array %d elements [%lld, %lld) outside [0, %lld)", g, a,
                        (long long)i0, (long long)(i0 + n), (long long)(g >= 0 && g < DS4_OPT_NGROUPS ? o->g[g].n : 0));
    return DS4_OK;
}

ds4_status ds4_optim_read(const ds4_optim *o, int g, int a, int64_t i0, int64_t n, float *dst) {
    DS4_TRY(span_check(o, g, a, i0, n));
    if (o->exec.plan || n == 0) return DS4_OK;
    const ds4_opt_group *G = &o->g[g];
    if (!o->swapped) {
        ds4_dev_to_host(&o->exec, dst, G->mem[a] + i0, (size_t)n * sizeof(float));
        return DS4_OK;
    }
    return ds4_offload_read(o->store, G->h[a], (size_t)i0 * sizeof(float), dst, (size_t)n * sizeof(float));
}

ds4_status ds4_optim_write(ds4_optim *o, int g, int a, int64_t i0, int64_t n, const float *src) {
    DS4_TRY(span_check(o, g, a, i0, n));
    if (o->exec.plan || n == 0) return DS4_OK;
    ds4_opt_group *G = &o->g[g];
    if (!o->swapped) {
        ds4_dev_to_device(&o->exec, G->mem[a] + i0, src, (size_t)n * sizeof(float));
        return DS4_OK;
    }
    return ds4_offload_write(o->store, G->h[a], (size_t)i0 * sizeof(float), src, (size_t)n * sizeof(float));
}

/* A plan goes through too: its store counts the staging buffer a real read holds, and moves nothing. */
ds4_status ds4_optim_read_dev(const ds4_optim *o, int g, int a, int64_t i0, int64_t n, float *dst) {
    DS4_TRY(span_check(o, g, a, i0, n));
    if (n == 0) return DS4_OK;
    const ds4_opt_group *G = &o->g[g];
    if (!o->swapped) {
        ds4_dev_copy(&o->exec, dst, G->mem[a] + i0, (size_t)n * sizeof(float));
        return DS4_OK;
    }
    return ds4_offload_read_dev(o->store, G->h[a], (size_t)i0 * sizeof(float), dst, (size_t)n * sizeof(float));
}

ds4_status ds4_optim_write_dev(ds4_optim *o, int g, int a, int64_t i0, int64_t n, const float *src) {
    DS4_TRY(span_check(o, g, a, i0, n));
    if (n == 0) return DS4_OK;
    ds4_opt_group *G = &o->g[g];
    if (!o->swapped) {
        ds4_dev_copy(&o->exec, G->mem[a] + i0, src, (size_t)n * sizeof(float));
        return DS4_OK;
    }
    return ds4_offload_write_dev(o->store, G->h[a], (size_t)i0 * sizeof(float), src, (size_t)n * sizeof(float));
}

ds4_status ds4_optim_expand(const ds4_optim *o, int g, int a, float *out) {
    memset(out, 0, (size_t)o->n * sizeof(float));
    for (int64_t i = 0; i < o->ngrun[g]; i++) {
        const int64_t k = grun(o, g, i);
        DS4_TRY(ds4_optim_read(o, g, a, run_soff(o, k), o->runs[k].n, out + o->runs[k].off));
    }
    return DS4_OK;
}

/* ------------------------------------------------------------------ AdamW's update */
static ds4_adamw_consts adamw_consts(int64_t step, const ds4_adamw_cfg *c, double lr) {
    const double bc1 = 1.0 - pow(c->beta1, (double)step), bc2 = 1.0 - pow(c->beta2, (double)step);
    return (ds4_adamw_consts){.b1 = (float)c->beta1, .b2 = (float)c->beta2, .eps = (float)c->eps,
                              .omb1 = (float)(1.0 - c->beta1), .omb2 = (float)(1.0 - c->beta2), .step_size = (float)(lr / bc1), .inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2)),
                              .decay = (float)(lr * c->weight_decay)};
}

/* The AdamW group's state elements [a, b) of a span that starts at state element j0 (m, v point at j0),
 * each under the rule of its run; w, g: the flat arrays. */
static void update_part(const ds4_optim *o, ds4_adamw_consts k, int64_t j0, int64_t a, int64_t b, float *m, float *v,
                        float *w, const float *g) {
    const int G = DS4_OPT_ADAMW;
    for (int64_t i = a < b ? grun_at(o, G, a) : o->ngrun[G]; i < o->ngrun[G] && run_soff(o, grun(o, G, i)) < b; i++) {
        const ds4_opt_run *q = &o->runs[grun(o, G, i)];
        const int64_t s0 = run_soff(o, grun(o, G, i));
        const int64_t x = s0 > a ? s0 : a, y = s0 + q->n < b ? s0 + q->n : b;
        const int64_t at = q->off + (x - s0); /* the flat element of state element x */
        if (!q->frozen) ds4_dev_adamw_update(&o->exec, y - x, w + at, g + at, m + (x - j0), v + (x - j0), k, q->decay);
    }
}

/* State elements [j0, j0 + n): one update op per piece of a run (each op shares its elements among the
 * backend's threads; every element's arithmetic is fixed, so the split changes no bit). */
static void update_span(const ds4_optim *o, ds4_adamw_consts k, int64_t j0, int64_t n, float *m, float *v, float *w,
                        const float *g) {
    update_part(o, k, j0, j0, j0 + n, m, v, w, g);
}

/* Swapped state: chunk by chunk, read m and v, update, write them back. The two buffers on the backend
 * (o->chunk elements each, 8 bytes per element) are all the optimizer holds in its memory. A plan runs
 * the first chunk only (the largest: what it holds, every chunk holds) and computes nothing. */
static ds4_status step_swapped(ds4_optim *o, float *w, const float *g, ds4_adamw_consts k) {
    const int G = DS4_OPT_ADAMW;
    const int64_t N = o->g[G].n, C = N < o->chunk ? N : o->chunk;
    float *buf[2];
    ds4_status st = DS4_OK;
    for (int a = 0; a < 2; a++)
        if (!(buf[a] = ds4_dev_alloc(&o->exec, DS4_MEM_OPTIM, (size_t)C * sizeof(float))))
            st = ds4_fail(DS4_ERR_OOM, "swap-optimizer: out of memory for %lld-element update buffers", (long long)C);
    for (int64_t j0 = 0; j0 < (o->exec.plan ? (N > 0) : N) && st == DS4_OK; j0 += C) {
        const int64_t n = N - j0 < C ? N - j0 : C;
        for (int a = 0; a < 2 && st == DS4_OK; a++) st = ds4_optim_read_dev(o, G, a, j0, n, buf[a]);
        if (st != DS4_OK) break;
        update_span(o, k, j0, n, buf[0], buf[1], w, g);
        for (int a = 0; a < 2 && st == DS4_OK; a++) st = ds4_optim_write_dev(o, G, a, j0, n, buf[a]);
    }
    for (int a = 0; a < 2; a++) ds4_dev_free(&o->exec, buf[a]);
    return st == DS4_OK ? DS4_OK : ds4_fail_prefix(st, "swap-optimizer step %lld", (long long)o->step);
}

ds4_status ds4_adamw_step(ds4_optim *o, ds4_model *m, const ds4_adamw_cfg *c, double lr) {
    return ds4_adamw_step_flat(o, ds4_model_params_flat(m), ds4_model_grads_flat(m), c, lr);
}

ds4_status ds4_adamw_step_flat(ds4_optim *o, float *w, const float *g, const ds4_adamw_cfg *c, double lr) {
    if (o->exec.plan && !o->swapped) return DS4_OK;
    const ds4_adamw_consts k = adamw_consts(o->step + 1, c, lr);
    ds4_opt_group *G = &o->g[DS4_OPT_ADAMW];
    ds4_status st = o->swapped ? step_swapped(o, w, g, k) : DS4_OK;
    if (!o->swapped) update_span(o, k, 0, G->n, G->mem[0], G->mem[1], w, g);
    if (st == DS4_OK && !o->exec.plan) o->step++;
    return st;
}

/* The AdamW entry's update: the AdamW group, on the whole model or the shard. */
static ds4_status adamw_entry_step(ds4_optim *o, const ds4_opt_target *t, const void *cfg, double weight_decay,
                                   double lr) {
    (void)weight_decay; /* its own, in cfg */
    if (t->f) return ds4_adamw_step_flat(o, ds4_fsdp_shard_params(t->f), ds4_fsdp_shard_grads(t->f), cfg, lr);
    return ds4_adamw_step(o, t->m, cfg, lr);
}

static const char *const k_adamw_names[] = {"adamw.m", "adamw.v"};
const ds4_optimizer ds4_optimizer_adamw = {
    .name = "AdamW", .takes = NULL, .nstate = 2, .state_names = k_adamw_names, .mark = NULL, .step = adamw_entry_step};

ds4_status ds4_optim_own_step(ds4_optim *o, const ds4_opt_target *t, const void *cfg, double weight_decay, double lr) {
    return o->opt->takes ? o->opt->step(o, t, cfg, weight_decay, lr) : DS4_OK;
}

/* ------------------------------------------------------------------ --swap-optimizer */
ds4_status ds4_optim_swap_out(ds4_optim *o, ds4_offload *store, size_t chunk_bytes) {
    if (o->store && store && store != o->store)
        return ds4_fail(DS4_ERR_ARG, "swap-optimizer: the state is already in the offload store in %s",
                        ds4_offload_dir(o->store));
    if (!o->store && !store) return ds4_fail(DS4_ERR_ARG, "swap-optimizer: no offload store given");
    if (!o->store) o->store = store;
    if (chunk_bytes || !o->chunk) o->chunk = chunk_elems(chunk_bytes);
    if (o->swapped) { /* a swap-in that failed half way left copies of what the store holds */
        for (int g = 0; g < DS4_OPT_NGROUPS; g++)
            for (int a = 0; a < o->g[g].k; a++) {
                ds4_dev_free(&o->exec, o->g[g].mem[a]);
                o->g[g].mem[a] = NULL;
            }
        return DS4_OK;
    }
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < o->g[g].k; a++) {
            ds4_opt_group *G = &o->g[g];
            if (G->n == 0) continue;
            DS4_TRY(ds4_offload_put_dev(o->store, DS4_MEM_OPTIM, G->mem[a], (size_t)G->n * sizeof(float), &G->h[a]));
            ds4_dev_free(&o->exec, G->mem[a]);
            G->mem[a] = NULL;
        }
    o->swapped = true;
    return DS4_OK;
}

ds4_status ds4_optim_swap_in(ds4_optim *o) {
    if (!o->swapped) return DS4_OK;
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < o->g[g].k; a++) {
            ds4_opt_group *G = &o->g[g];
            if (G->n == 0 || G->mem[a]) continue;
            float *p = ds4_dev_alloc(&o->exec, DS4_MEM_OPTIM, (size_t)G->n * sizeof(float));
            if (!p) return ds4_fail(DS4_ERR_OOM, "swap-optimizer: out of memory bringing back %lld values of %s",
                                    (long long)G->n, G->names[a]);
            ds4_status st = ds4_offload_get_dev(o->store, G->h[a], p);
            if (st != DS4_OK) {
                ds4_dev_free(&o->exec, p);
                return st;
            }
            G->mem[a] = p;
        }
    for (int g = 0; g < DS4_OPT_NGROUPS; g++) /* all back: the store's copies go */
        for (int a = 0; a < o->g[g].k; a++) {
            ds4_offload_drop(o->store, o->g[g].h[a]);
            o->g[g].h[a] = -1;
        }
    o->swapped = false;
    return DS4_OK;
}

/* ------------------------------------------------------------------ optim.state */
/* Streams array a of group g into the writer through buf [C] on the host, from memory (the state's
 * backend) or from the store. */
static ds4_status array_put(const ds4_optim *o, int g, int a, ds4_st_writer *w, float *buf, int64_t C) {
    const ds4_opt_group *G = &o->g[g];
    for (int64_t i0 = 0; i0 < G->n; i0 += C) {
        const int64_t n = G->n - i0 < C ? G->n - i0 : C;
        DS4_TRY(ds4_optim_read(o, g, a, i0, n, buf));
        DS4_TRY(ds4_st_writer_put(w, buf, (size_t)n * sizeof(float)));
    }
    return DS4_OK;
}

ds4_status ds4_optim_state_save(const ds4_optim *o, const char *path) {
    const int64_t C = o->chunk > 0 ? o->chunk : chunk_elems(0);
    float *buf = ds4_alloc(o->swapped ? DS4_MEM_OPTIM : DS4_MEM_OTHER, (size_t)C * sizeof(float));
    ds4_st_writer *w = NULL;
    if (!buf) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the optimizer save buffer", path);
    ds4_status st = ds4_st_writer_new(&w);
    int64_t one = 1;
    /* the order ds4_st_writer_write lays tensors out in (8-byte elements first): an AdamW file has the
     * bytes it always had */
    if (st == DS4_OK) st = ds4_st_writer_declare(w, "adamw.step", DS4_I64, 1, &one);
    if (st == DS4_OK && o->opt->mark) st = ds4_st_writer_declare(w, o->opt->mark, DS4_I64, 1, &one);
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < o->g[g].k && st == DS4_OK; a++)
            st = ds4_st_writer_declare(w, o->g[g].names[a], DS4_F32, 1, &o->g[g].n);
    if (st == DS4_OK) st = ds4_st_writer_begin(w, path);
    if (st == DS4_OK) st = ds4_st_writer_put(w, &o->step, sizeof o->step);
    if (st == DS4_OK && o->opt->mark) st = ds4_st_writer_put(w, &o->step, sizeof o->step);
    for (int g = 0; g < DS4_OPT_NGROUPS; g++)
        for (int a = 0; a < o->g[g].k && st == DS4_OK; a++) st = array_put(o, g, a, w, buf, C);
    if (st == DS4_OK) st = ds4_st_writer_finish(w);
    ds4_st_writer_free(w);
    ds4_free(buf);
    return st;
}

ds4_status ds4_clip_grad_norm(ds4_model *m, double max_norm, double *norm) {
    return ds4_clip_grad_norm_over(m, NULL, max_norm, norm);
}

/* The exact sum of squares of the gradients m holds: the whole array, or each held region's. */
static ds4_status held_sumsq(ds4_model *m, ds4_sumsq_acc *a) {
    const ds4_exec *ex = ds4_model_exec(m);
    float *g = ds4_model_grads_flat(m);
    if (ds4_model_held_bytes(m, true) == 0) return ds4_dev_sumsq_exact(ex, g, ds4_model_numel(m), a);
    memset(a, 0, sizeof *a);
    for (int64_t i = 0; i < ds4_model_nregions(m); i++) {
        const ds4_region *r = ds4_model_region(m, i);
        if (!ds4_model_region_held(m, i, true)) continue;
        ds4_sumsq_acc part;
        DS4_TRY(ds4_dev_sumsq_exact(ex, g + r->start, r->end - r->start, &part));
        for (int k = 0; k <= DS4_SUMSQ_LIMBS; k++) a->limb[k] += part.limb[k]; /* integers: any order */
    }
    return DS4_OK;
}

void ds4_model_scale_held_grads(ds4_model *m, float s) {
    const ds4_exec *ex = ds4_model_exec(m);
    float *g = ds4_model_grads_flat(m);
    if (ds4_model_held_bytes(m, true) == 0) {
        ds4_dev_scale(ex, g, ds4_model_numel(m), s);
        return;
    }
    for (int64_t i = 0; i < ds4_model_nregions(m); i++) {
        const ds4_region *r = ds4_model_region(m, i);
        if (ds4_model_region_held(m, i, true)) ds4_dev_scale(ex, g + r->start, r->end - r->start, s);
    }
}

ds4_status ds4_clip_grad_norm_over(ds4_model *m, ds4_comm *pipe, double max_norm, double *norm) {
    float s;
    ds4_sumsq_acc a; /* exact: the same bits as one process's sum, whichever ranks hold which parts */
    DS4_TRY(held_sumsq(m, &a));
    if (pipe && ds4_comm_size(pipe) > 1) DS4_TRY(ds4_comm_sum_i64(pipe, a.limb, DS4_SUMSQ_LIMBS + 1));
    ds4_sumsq_normalize(&a);
    *norm = sqrt(ds4_sumsq_value(&a));
    if (ds4_clip_factor(max_norm, *norm, &s)) ds4_model_scale_held_grads(m, s);
    return DS4_OK;
}

/* The rule on the host, the bias [E] of each block brought over and back (E floats a block). */
ds4_status ds4_router_bias_update(ds4_model *m, const int64_t *loads, double gamma) {
    const ds4_config *c = ds4_model_config(m);
    const int64_t E = c->n_routed_experts;
    float *bias = ds4_alloc(DS4_MEM_OTHER, (size_t)(E > 0 ? E : 1) * sizeof(float));
    if (!bias) return ds4_fail(DS4_ERR_OOM, "out of memory for the router bias update");
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        int64_t b = ds4_param_router_block(c, p);
        if (b < 0 || !ds4_model_param_held(m, p, true)) continue; /* a pipeline stage: its own layers' */
        ds4_model_to_host(m, bias, p->data, (size_t)E * sizeof(float));
        ds4_router_bias_rule(loads + b * E, E, gamma, 0, E, bias);
        ds4_model_to_device(m, p->data, bias, (size_t)E * sizeof(float));
    }
    ds4_free(bias);
    return DS4_OK;
}

double ds4_lr_at(const ds4_lr_schedule *s, int64_t step) {
    if (s->warmup_steps > 0 && step <= s->warmup_steps) return s->lr * (double)step / (double)s->warmup_steps;
    const int64_t d0 = s->decay_start > s->warmup_steps ? s->decay_start : s->warmup_steps;
    if (s->decay == DS4_DECAY_NONE || s->total_steps <= d0 || step <= d0) return s->lr;
    double prog = (double)(step - d0) / (double)(s->total_steps - d0);
    if (prog > 1) prog = 1;
    double f = s->decay == DS4_DECAY_COSINE ? 0.5 * (1.0 + cos(M_PI * prog)) : 1.0 - prog;
    return s->min_lr + (s->lr - s->min_lr) * f;
}
