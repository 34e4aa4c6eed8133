/* FSDP + expert parallelism (ds4/dist.h), private to src/dist: the shard layout every FSDP file reads.
 *
 * Every region of the model's flat layout is cut into equal chunks over the ranks that hold it: dense
 * regions over the FSDP communicator (all ranks), expert regions over the ranks holding that expert
 * (one per EP group, the replica communicator). A rank's pieces, concatenated, are its shard of
 * parameters, gradients and optimizer state. Communicators: FSDP, EP (all-to-all of token rows) and
 * expert replicas are three separate ones.
 *
 * The files, by concern:
 *   fsdp.c        the layout: create / free, the pieces, the shard buffers and their accessors
 *   fsdp_hooks.c  the model's parameter hooks: gather / drop, grad_begin / grad_end (reduce-scatter),
 *                 prefetch and the overlap state (ds4_fsdp_set_prefetch)
 *   ep.c          expert parallelism: the route and its counts, dispatch / combine, the yielding ops
 *   fsdp_io.c     filling and reading shards: init, load, whole-model collect, packed streaming
 *                 (checkpoints)
 *   fsdp_optim.c  what the optimizer step needs from the shards: grad-norm clipping, the router bias
 *                 rule, whole matrices for Muon
 *   dist_kernels.c  the rank-ordered sums and EP's row permutes, in kernel shape */
#ifndef DS4_DIST_FSDP_IMPL_H
#define DS4_DIST_FSDP_IMPL_H

#include "ds4/dist.h"

typedef struct {
    int64_t region, group;
    int64_t start, end, map_end; /* the region, and the end of its last page */
    bool expert;                 /* sharded over the expert-replica communicator, else FSDP */
    bool bf16;                   /* gathered from the shard's bf16 copy into the model's (region.bf16) */
    int64_t chunk;               /* elements of every rank's piece (the last ones may be shorter) */
    int64_t off, len;            /* this rank's piece: flat [start + off, start + off + len) */
    int64_t shard_off;           /* where it lives in the shard buffers */
} piece;

/* What overlap keeps in flight (prefetch depth > 0; made by ds4_fsdp_set_prefetch, so a blocking FSDP
 * holds none of it). */
typedef struct {
    int depth;
    bool *w_flight, *g_flight;   /* [ngroups] all-gather / reduce-scatter started, not completed */
    int64_t *gq, gq_head, gq_n;  /* [ngroups] ring: the groups whose reduce-scatter is in flight, oldest first */
    ds4_comm_req **wreq, **greq; /* [npieces] each piece's all-gather and reduce-scatter in flight */
    uint16_t **wsrc;             /* [npieces] a bf16 piece's all-gather source [len] (its cast) while in flight */
    float **grecv;               /* [npieces] the reduce-scatter's receive buffer [n · len] while in flight */
} overlap;

struct ds4_fsdp {
    ds4_model *m;
    ds4_comm *world, *fsdp, *ep, *rep; /* rep: ranks holding the same experts (one per EP group) */
    ds4_comm *staged;                  /* on a device backend: the world, host-staged (fsdp and rep are its
                                        * splits, so the shards' collectives take device buffers); else NULL */
    int W;
    int ep_size : 31;                  /* (bit fields: the struct keeps its size, memplan's counted bytes) */
    unsigned whole : 1;                /* every group sharded; else a pipeline stage's groups alone, marked in
                                        * g_mapped[ngroups + g] (g_mapped is [2 ngroups] then) */
    int64_t eloc;                      /* experts per EP rank; this rank's are [ops.e0, ops.e1) */
    piece *pieces;
    int64_t npieces;
    int64_t *piece_of_region;          /* [nregions] piece index or -1 */
    bool *w_mapped, *g_mapped;         /* [ngroups] */
    overlap *ov;                       /* NULL: blocking collectives (prefetch depth 0) */
    float *sp, *sg;                    /* [ns] on the model's backend; the bf16 copy exists only gathered, cast
                                        * from sp at each gather */
    int64_t ns;
    ds4_param_hooks hooks;
    ds4_ep_ops ops;
};

/* On a plan communicator FSDP plans: shards and buffers are counted, no value is read, written or sent. */
static inline bool fsdp_planning(const ds4_fsdp *f) { return ds4_comm_is_plan(f->world); }

/* The context the shards live in: the model's backend (its buffers, copies and ops). */
static inline const ds4_exec *fsdp_ex(const ds4_fsdp *f) { return ds4_model_exec(f->m); }

/* The communicator piece p is sharded over. */
static inline ds4_comm *piece_comm(const ds4_fsdp *f, const piece *p) { return p->expert ? f->rep : f->fsdp; }

/* Length of rank r's piece of a region of len elements cut in chunks. */
static inline int64_t piece_len(int64_t len, int64_t chunk, int r) {
    int64_t a = (int64_t)r * chunk, b = a + chunk < len ? a + chunk : len;
    return b > a ? b - a : 0;
}

/* fsdp_hooks.c: f's parameter hooks (ctx f; ep: the EP ops when ep > 1), and everything they hold let go
 * (in-flight collectives completed, gathered ranges dropped, the overlap state freed). */
void fsdp_hooks_init(ds4_fsdp *f, const ds4_ep_ops *ep);
void fsdp_hooks_release(ds4_fsdp *f);

/* ep.c: f's EP ops for this rank's experts [e0, e0 + eloc). */
void fsdp_ep_init(ds4_fsdp *f, int64_t e0);

#endif
