/* Many processes: communicators (single process | MPI | a simulated world for memplan), and FSDP with
 * expert parallelism around the model (docs/DESIGN.md idea 6). The model sees full tensors of one group at a
 * time through ds4_param_hooks; this layer gathers them before use, reduce-scatters gradients after, and
 * moves MoE token rows to the experts' owners with all-to-all on a communicator of its own (the
 * practice report's fix: FSDP's all-gather / reduce-scatter never queue behind EP's all-to-all). */
#ifndef DS4_DIST_H
#define DS4_DIST_H

#include "ds4/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_comm ds4_comm;
/* A backend's queue (opaque; NULL: the default, host-synchronous). The collectives and the wait of a
 * communicator's table take one, so a device communicator orders its collectives with the kernels; the
 * functions below pass NULL today. */
typedef struct ds4_stream ds4_stream;

/* Starts MPI when the process was launched by mpirun (Open MPI / PMIx / PMI environment), else nothing.
 * Errors if launched by mpirun but built without MPI. */
ds4_status ds4_dist_init(void);
void ds4_dist_finalize(void);
ds4_comm *ds4_comm_world(void); /* the world; a one-rank communicator without mpirun */
ds4_comm *ds4_comm_self(void);  /* this process alone (one rank, also under mpirun) */
/* A simulated world of `size` ranks seen from `rank` (memplan): collectives move no data. The
 * communicator of a plan step (ds4_exec): FSDP on it plans (counts, touches no values). */
ds4_status ds4_comm_plan(int size, int rank, ds4_comm **out);
/* Ranks of c with the same color form a new communicator, ordered by key. Always a new one, also when
 * it has the same ranks as c. size, rank: what the caller expects it to be; a plan communicator makes
 * exactly that (it knows no other rank's color), a real one fails when it is not. */
ds4_status ds4_comm_split(ds4_comm *c, int color, int key, int size, int rank, ds4_comm **out);
void ds4_comm_free(ds4_comm *c); /* not the world or self */
/* A communicator over the same ranks as inner whose collectives take buffers of ex's backend (device
 * memory) and move them through host copies (src/dist/comm_staged.c); its splits are staged too. inner
 * stays the caller's (freed after this one). Sums, barriers and count exchanges carry host values. */
ds4_status ds4_comm_staged(ds4_comm *inner, const ds4_exec *ex, ds4_comm **out);
int ds4_comm_rank(const ds4_comm *c);
int ds4_comm_size(const ds4_comm *c);
bool ds4_comm_is_plan(const ds4_comm *c);

/* Collectives (all ranks of c call them in the same order). Counts and displacements in elements of
 * `elem` bytes. Each calls through c's table (self, MPI or plan: src/dist/comm_impl.h). */
ds4_status ds4_comm_allgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                               const int64_t *rdispls, size_t elem);
ds4_status ds4_comm_alltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                              void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem);
ds4_status ds4_comm_gatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                            const int64_t *rdispls, size_t elem, int root);
/* x [n] := Σ over ranks, added in rank order: the same bits on every rank and every run. */
ds4_status ds4_comm_sum_f64(ds4_comm *c, double *x, int64_t n);
ds4_status ds4_comm_sum_i64(ds4_comm *c, int64_t *x, int64_t n);
ds4_status ds4_comm_barrier(ds4_comm *c);

/* Non-blocking variants: the collective starts and *req tracks it; ds4_comm_wait completes and frees it
 * (send and receive buffers must stay untouched until then; the count arrays may go at once). *req is
 * NULL when the collective is already complete (one process, a plan). All ranks of c start the same
 * collectives in the same order. Progress is MPI's own: every MPI call (and ds4_comm_progress, which
 * the FSDP hooks call) moves the outstanding requests on; ds4 runs no communication thread, as MPI is
 * initialised FUNNELED and a thread would take one of the few cores from compute. */
typedef struct ds4_comm_req ds4_comm_req;
ds4_status ds4_comm_iallgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                                const int64_t *rdispls, size_t elem, ds4_comm_req **req);
ds4_status ds4_comm_ialltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                               void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem,
                               ds4_comm_req **req);
/* recv [n·per] := from every rank r of c (n ranks), the block of r's send [n·per] addressed to this
 * rank (elements [rank·per, (rank + 1)·per)): an all-to-all of equal blocks of int64 counts on the host
 * (EP's row counts per expert). A plan communicator answers as a world where every rank sends what this
 * rank sends itself: balanced routing. */
ds4_status ds4_comm_ialltoall_counts(ds4_comm *c, const int64_t *send, int64_t per, int64_t *recv,
                                     ds4_comm_req **req);
/* Point to point (a pipeline's stage boundaries): count elements of `elem` bytes to / from rank peer of c
 * (never this rank), matched by tag; both complete at ds4_comm_wait (send: buf may be reused then; receive:
 * buf holds them). A plan communicator moves nothing; a one-rank one has no peer (an error). */
ds4_status ds4_comm_isend(ds4_comm *c, const void *buf, int64_t count, size_t elem, int peer, int tag,
                          ds4_comm_req **req);
ds4_status ds4_comm_irecv(ds4_comm *c, void *buf, int64_t count, size_t elem, int peer, int tag,
                          ds4_comm_req **req);
ds4_status ds4_comm_wait(ds4_comm_req *req); /* NULL: nothing to wait for */
/* Whether req has completed (NULL: true), moving it on without blocking; once true, ds4_comm_wait returns at
 * once (it is still the call that frees req). With a simulated link, also whether the link has carried it. */
bool ds4_comm_test(ds4_comm_req *req);
/* What the trace calls it (a string that outlives the request; default: the collective's name). */
void ds4_comm_req_label(ds4_comm_req *req, const char *label);
void ds4_comm_progress(void);

/* What a communicator's traffic is, for the exposed-time breakdown and the trace's lanes. */
typedef enum { DS4_LANE_OTHER, DS4_LANE_FSDP, DS4_LANE_EP, DS4_NUM_LANES } ds4_comm_lane;
void ds4_comm_set_lane(ds4_comm *c, ds4_comm_lane lane);
const char *ds4_comm_lane_name(ds4_comm_lane lane); /* "other", "fsdp", "ep" */

/* A simulated link (--sim-link-gbps, --sim-link-latency-us): every MPI collective completes no sooner
 * than latency + bytes / bandwidth after it could start on its lane's link (one link per lane: FSDP's
 * two communicators share one, EP has its own, transfers on a link one after another; bytes: what this
 * rank receives from or sends to the others, the larger). Waits sleep until then, so exposed communication can be measured on one machine.
 * gbps <= 0: off. Collectives on one process or a plan are not delayed. */
ds4_status ds4_comm_set_link(double gbps, double latency_us);
/* Seconds this process has spent blocked in collectives (blocking calls and waits), per lane, since it
 * started. */
void ds4_comm_exposed(double out[DS4_NUM_LANES]);
/* Bytes this process has received from the other ranks in all-gathers, per lane, since it started (on
 * DS4_LANE_FSDP: FSDP's parameter gathers). */
void ds4_comm_allgather_bytes(int64_t out[DS4_NUM_LANES]);
/* The trace (Chrome trace JSON, viewable in Perfetto): from ds4_trace_begin, a collective of world (it
 * aligns the ranks' clocks with a barrier), every rank records lanes "compute" (time not blocked in a
 * collective), "fsdp", "ep" and "other" (each collective from when it could start to its completion), "pp"
 * (ds4_trace_span);
 * ds4_trace_end gathers every rank's events on rank 0, which writes `path` (one process per rank). */
ds4_status ds4_trace_begin(ds4_comm *world);
ds4_status ds4_trace_end(ds4_comm *world, const char *path); /* world NULL: drop the events, no collective */
/* A span on this rank's "pp" row of the trace (a pipeline's actions and waits, src/train/pp_mpi.c): name
 * (copied) from t0 to t1, seconds of ds4_now's clock. Nothing while no trace is on. */
void ds4_trace_span(const char *name, double t0, double t1);

/* A route of expert parallelism (ds4/model.h) with zeroed counts, in one DS4_MEM_OTHER allocation (free:
 * ds4_ep_route_free or ds4_free); NULL on allocation failure. */
ds4_ep_route *ds4_ep_route_new(int nsrc, int64_t e0, int64_t e1);
void ds4_ep_route_free(ds4_ep_route *r);

/* ------------------------------------------------------------------ FSDP + EP */
/* World of W ranks, EP degree ep (divides W and n_routed_experts). Dense regions are sharded over all W
 * ranks (the FSDP communicator); expert e lives on EP rank e / (E / ep) of each EP group (ranks
 * [g·ep, (g+1)·ep)) and is sharded over the W / ep ranks holding it. Each rank keeps only its shard of
 * parameters, gradients and optimizer state; a group's full weights exist only between gather and drop.
 * Gradients are summed in a fixed order, so N ranks give the same bits on every run: a dense parameter
 * over all ranks in rank order; a routed expert first over the sources of each EP group in rank order
 * (its owner accumulates their rows), then over the EP groups in order. */
typedef struct ds4_fsdp ds4_fsdp;

/* m: unmapped. On a plan communicator (ds4_comm_plan) it is the FSDP of a plan step (ds4_exec): every
 * buffer is counted as in a real run, no value is read, written or exchanged. */
ds4_status ds4_fsdp_create(ds4_model *m, ds4_comm *world, int ep, ds4_fsdp **out);
/* The same over the groups marked in groups [ngroups] alone (a pipeline stage's: world is the stage's
 * communicator); the model's other groups have no piece here, and gather / drop / grad hooks of them do
 * nothing (the stage holds what it reads of them). Whole-model views (collect, stream_packed) need every
 * group: use ds4_fsdp_gather_param instead. */
ds4_status ds4_fsdp_create_groups(ds4_model *m, ds4_comm *world, int ep, const bool *groups, ds4_fsdp **out);
bool ds4_fsdp_holds_group(const ds4_fsdp *f, int64_t group); /* sharded here (every group of a whole one) */
void ds4_fsdp_free(ds4_fsdp *f);
/* Overlap of communication with compute (parallel.prefetch_depth): 0 (the default of a new FSDP) gathers
 * a group when the model asks for it and reduce-scatters its gradients at once, blocking; depth d >= 1
 * starts the all-gathers of the next d groups the model will use while it computes (their weights are
 * mapped, counted as parameters, from then on), and leaves up to d groups' reduce-scatters in flight
 * (their full gradients and receive buffers stay until completion) while the previous groups' backward
 * runs. The same bits for every depth: every sum is added in rank order on completion. */
ds4_status ds4_fsdp_set_prefetch(ds4_fsdp *f, int depth);
#define DS4_PREFETCH_MAX 8
#define DS4_PREFETCH_DEFAULT 1 /* parallel.prefetch_depth's default, which memplan plans too */
const ds4_param_hooks *ds4_fsdp_hooks(ds4_fsdp *f);
/* MoE forward-backward overlap (--moe-fb-overlap): f's EP ops (route, dispatch, combine) whose all-to-alls
 * call yield(ctx) after their start and before their wait, so the caller can run another pass's compute
 * while the rows travel. The caller owns *y and keeps it while passes use y->ops. */
typedef struct {
    ds4_fsdp *f;
    void (*yield)(void *ctx);
    void *ctx;
    ds4_ep_ops ops; /* ctx: y */
} ds4_fsdp_yielding;
void ds4_fsdp_yielding_init(ds4_fsdp *f, void (*yield)(void *ctx), void *ctx, ds4_fsdp_yielding *y);
int64_t ds4_fsdp_shard_numel(const ds4_fsdp *f);
const ds4_exec *ds4_fsdp_exec(const ds4_fsdp *f); /* the context of its model (ds4_model_exec) */
float *ds4_fsdp_shard_params(ds4_fsdp *f); /* [shard_numel] DS4_MEM_PARAM */
float *ds4_fsdp_shard_grads(ds4_fsdp *f);  /* [shard_numel] DS4_MEM_GRAD, accumulated by grad_end */
void ds4_fsdp_zero_grads(ds4_fsdp *f);
/* Mixed precision (a model with the bf16 copy, ds4_model_create_bf16): the shard keeps fp32 values only;
 * gather casts each bf16 piece from them (into a DS4_MEM_COMM buffer [piece], freed once the all-gather
 * completes) and all-gathers it, 2 bytes per element, into the model's bf16 copy, leaving the fp32 range
 * of that region unmapped (fp32 regions as before). refresh has nothing to keep current (a no-op, kept
 * for the train state's one call for both layouts). */
void ds4_fsdp_refresh_bf16(ds4_fsdp *f);

/* Fills this rank's shard: the init rules of docs/contract.md (the same values as a single process)
 * or a model directory; the integer tables are filled on every rank. */
ds4_status ds4_fsdp_init_random(ds4_fsdp *f, uint64_t seed);
ds4_status ds4_fsdp_load(ds4_fsdp *f, const ds4_model_dir *d);
/* Every piece of a float parameter this rank's shard holds, in table order: elements [k0, k1) of p sit at
 * shard offset s0 (the shard's optimizer runs are built from these, ds4_optim_init_shard in ds4/train.h). */
typedef void (*ds4_fsdp_piece_fn)(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0);
void ds4_fsdp_for_each_piece(const ds4_fsdp *f, ds4_fsdp_piece_fn fn, void *ctx);
/* The full flat parameters (grads = false) or gradients on rank `root` (out: [ds4_model_numel] there,
 * ignored elsewhere); a collective. */
ds4_status ds4_fsdp_collect(ds4_fsdp *f, bool grads, float *out, int root);
/* The same for any shard buffer [shard_numel] laid out like the parameters (e.g. AdamW moments), in host
 * memory (a shard on a device backend: through ds4_dev_host_view). */
ds4_status ds4_fsdp_collect_buf(ds4_fsdp *f, const float *shard, float *out, int root);
/* The packed layout: the float parameters back to back in table order, without region padding (the
 * flat layout of a whole model made by ds4_model_create, and of checkpoints). */
int64_t ds4_fsdp_packed_numel(const ds4_fsdp *f);
/* A shard buffer (host memory, as for ds4_fsdp_collect_buf) streamed to root in the packed layout, one region gathered at a time (a collective):
 * on root, sink(ctx, i, values, n) for every float parameter i of the table, in table order. After a
 * sink error the gathers go on (no rank is left waiting) and root returns the first error. */
typedef ds4_status (*ds4_packed_sink_fn)(void *ctx, int64_t param, const float *values, int64_t n);
ds4_status ds4_fsdp_stream_packed(ds4_fsdp *f, const float *shard, int root, ds4_packed_sink_fn sink, void *ctx);
/* The inverse, on this rank alone: its elements of a packed source into shard [shard_numel] on the model's
 * backend; read(ctx, off, n, dst) copies packed elements [off, off + n) into dst (host memory). */
typedef ds4_status (*ds4_packed_read_fn)(void *ctx, int64_t off, int64_t n, float *dst);
ds4_status ds4_fsdp_scatter_packed(const ds4_fsdp *f, ds4_packed_read_fn read, void *ctx, float *shard);
/* Whole matrices for an optimizer that needs them (Muon). For every float parameter ops->pick selects,
 * in table order: part_out fills this rank's elements [k0, k1) of it (shard offset s0) into part; the
 * parts are gathered on the matrix's owner rank — round-robin over the selected parameters of each
 * communicator (dense: all ranks; a routed expert: the ranks holding it), so the work spreads — where
 * whole runs on the full matrix x [numel] and may change it; x goes back in parts and part_in takes this
 * rank's. An expert this rank holds alone (EP = ranks) never travels. A collective; after a failure the
 * exchanges go on (no rank waits forever) and the first error is returned. On a plan communicator only
 * the buffers are counted. */
typedef struct {
    void *ctx;
    bool (*pick)(const ds4_param *p);
    ds4_status (*part_out)(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0, float *part);
    ds4_status (*whole)(void *ctx, ds4_param *p, float *x);
    ds4_status (*part_in)(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0, const float *part);
} ds4_matrix_ops;
ds4_status ds4_fsdp_for_each_matrix(ds4_fsdp *f, const ds4_matrix_ops *ops);
/* Global L2 norm of the sharded gradients, the squares summed exactly (ds4_sumsq_exact, limbs summed over
 * the ranks): the same bits for any EP degree, any split of the shards and any thread count; NaN when a
 * gradient is not finite. Clips like ds4_clip_grad_norm when max_norm > 0. */
ds4_status ds4_fsdp_clip_grad_norm(ds4_fsdp *f, double max_norm, double *norm);
/* The same with the limbs summed over `all` (a pipeline's world: every stage's FSDP shards its own groups). */
ds4_status ds4_fsdp_clip_grad_norm_over(ds4_fsdp *f, ds4_comm *all, double max_norm, double *norm);
/* Float parameter p's values from a shard buffer (host memory, laid out as the shard) gathered on rank root
 * of f's world into out [p->numel] (root only): a dense one from every rank, a routed expert from the ranks
 * of its EP rank; a collective of f's world. */
ds4_status ds4_fsdp_gather_param(ds4_fsdp *f, const float *shard, const ds4_param *p, float *out, int root);
/* ds4_router_bias_update on the shards; loads: [n_blocks, E] summed over all ranks. Fails out of memory. */
ds4_status ds4_fsdp_router_bias_update(ds4_fsdp *f, const int64_t *loads, double gamma);

#ifdef __cplusplus
}
#endif
#endif
