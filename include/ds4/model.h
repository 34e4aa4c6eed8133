/* The DeepSeek-V4 model: parameter table with the official tensor names, initialisation, load/save,
 * and one forward + backward pass producing the contract's losses and gradients.
 *
 * The model knows nothing about parallelism, offload or recompute policy: those wrap it (hooks). */
#ifndef DS4_MODEL_H
#define DS4_MODEL_H

#include "ds4/config.h"
#include "ds4/core.h"
#include "ds4/tensors.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_model_dir ds4_model_dir;

/* One named tensor of the model. Float parameters live in one contiguous fp32 buffer (data) with a
 * matching gradient buffer (grad); integer tables (tid2eid) are kept as int64 (idata) and have no
 * gradient. */
typedef struct {
    char name[112];
    int ndim;
    bool gemm;          /* a matrix the GEMMs read: compute dtype bf16 under mixed precision, fp32 otherwise
                         * (docs/mixed-precision.md lists them) */
    int64_t shape[3];
    int64_t numel;
    bool is_int;        /* tid2eid */
    bool no_decay;      /* norms, biases, mHC base/scale, sinks, ape: no weight decay */
    bool no_grad;       /* router bias: updated by the load-balancing rule, not by gradients */
    bool carried;       /* the DSpark drafter's (mtp.* of a DSpark config): its own fp32 buffer outside the flat
                         * layout, no gradient, loaded / checkpointed / exported, never trained */
    ds4_init_rule init; /* the table's init rule (ds4/tensors.h) */
    float *data;        /* fp32 value (NULL when is_int) */
    float *grad;        /* fp32 gradient (NULL when is_int or carried) */
    int64_t *idata;     /* int table (NULL unless is_int) */
} ds4_param;

/* A float tensor of the flat layout (the trained ones, the router bias included). */
static inline bool ds4_param_in_flat(const ds4_param *p) { return !p->is_int && !p->carried; }

typedef struct ds4_model ds4_model;

/* A model of `cfg` for steps run as `exec` (NULL: real), parameters zero. unmapped = false: its flat value
 * and gradient buffers are allocated. unmapped = true (for FSDP / EP wrappers): they are reserved address
 * ranges with no memory behind them; a wrapper makes a range resident with ds4_model_map before the
 * model reads or writes it and gives it back with ds4_model_unmap. Every region starts on a page. In a
 * plan (memplan) the model's buffers are counted but never touched: init, zero_grad and map/unmap only
 * count, and its passes read and write no tensor data (routing is balanced, as moe_force_balance makes
 * it). A pass must run under the context the model was made for (ds4_forward checks). */
ds4_status ds4_model_create(const ds4_exec *exec, const ds4_config *cfg, bool unmapped, ds4_model **out);
/* The same model for mixed precision: it also holds a bf16 compute copy of the parameters whose compute
 * dtype is bf16 (ds4_param.gemm), a uint16 buffer parallel to the flat one (DS4_MEM_PARAM), which its
 * GEMMs read instead of the fp32 values: every GEMM of its passes is then a bf16 GEMM. Regions never mix
 * the two compute dtypes (ds4_region.bf16), and in an unmapped model every region starts on a page of
 * the copy too. The copy is the owner's to keep current: ds4_model_refresh_bf16 (a whole model) or the
 * FSDP wrapper's gather (an unmapped one). */
ds4_status ds4_model_create_bf16(const ds4_exec *exec, const ds4_config *cfg, bool unmapped, ds4_model **out);
/* [numel] the bf16 compute copy (NULL without one); in an unmapped model a reserved range, mapped per
 * bf16 region by ds4_model_map_bf16. */
uint16_t *ds4_model_bf16_flat(ds4_model *m);
/* A whole model: the copy of every bf16 region becomes the rounding (gemm_bf16_bits) of its fp32 values.
 * Call after the fp32 values change (init, load, an optimizer step). A no-op without a copy. */
void ds4_model_refresh_bf16(ds4_model *m);
/* dst [n] = the bf16 bits of src [n] as the copy holds them (the GEMMs' operand rounding), on m's backend;
 * a kernel op, so a plan skips it. For the owners of a sharded copy. */
void ds4_model_pack_bf16(const ds4_model *m, uint16_t *dst, const float *src, int64_t n);
void ds4_model_free(ds4_model *m);
const ds4_config *ds4_model_config(const ds4_model *m);
int64_t ds4_model_nparams(const ds4_model *m);                          /* number of named tensors */
ds4_param *ds4_model_param(ds4_model *m, int64_t i);
ds4_param *ds4_model_find(ds4_model *m, const char *name);
int64_t ds4_model_numel(const ds4_model *m);                            /* float elements in total */
/* [numel] the parameters and their gradients, in the memory of the model's backend (the host's on the cpu
 * backend): code above the model reaches their bytes through ds4_model_to_host / ds4_model_to_device. */
float *ds4_model_params_flat(ds4_model *m);                              /* [numel] */
float *ds4_model_grads_flat(ds4_model *m);                               /* [numel] */
/* The host/device boundary of the model's tensors: dst [bytes] on the host = src [bytes] on the model's
 * backend, and the reverse; both return once the bytes have crossed. A plan copies nothing. */
void ds4_model_to_host(const ds4_model *m, void *dst, const void *src, size_t bytes);
void ds4_model_to_device(const ds4_model *m, void *dst, const void *src, size_t bytes);
void ds4_model_zero_grad(ds4_model *m);
/* The context the model was made for (its backend, plan or real, matmul precision). */
const ds4_exec *ds4_model_exec(const ds4_model *m);

/* ------------------------------------------------------------------ flat arrays on a context's backend
 * What the layers above the model (the optimizers, the trainer's step) do with the bytes of a backend:
 * buffers, the copies across the host/device boundary, and the step's ops (src/kernels/ops.def, "the step
 * around the passes"), each run on ex's backend with the cpu's bits. A plan allocates (counted, no memory)
 * and computes nothing. */
void *ds4_dev_alloc(const ds4_exec *ex, ds4_mem_cat cat, size_t bytes);  /* NULL + message on failure */
void *ds4_dev_zalloc(const ds4_exec *ex, ds4_mem_cat cat, size_t bytes); /* the same, zeroed */
void ds4_dev_free(const ds4_exec *ex, void *p);                          /* NULL: nothing */
/* dst [bytes] on the host = src [bytes] on the device, and the reverse; both return once the bytes crossed. */
void ds4_dev_to_host(const ds4_exec *ex, void *dst, const void *src, size_t bytes);
void ds4_dev_to_device(const ds4_exec *ex, void *dst, const void *src, size_t bytes);
void ds4_dev_copy(const ds4_exec *ex, void *dst, const void *src, size_t bytes); /* device to device */
/* A host view of device buffer src [bytes]: src itself where the backend's memory is the host's, else a
 * host copy (NULL and the message when out of memory). Given back with ds4_dev_host_view_free. */
const void *ds4_dev_host_view(const ds4_exec *ex, const void *src, size_t bytes);
void ds4_dev_host_view_free(const ds4_exec *ex, const void *view, const void *src);
/* Waits for ex's backend, then its ops' first failure since the last call (DS4_OK: none; the cpu's ops
 * report through the allocator instead): what a step checks at its end. */
ds4_status ds4_dev_status(const ds4_exec *ex);
/* *out = the non-finite elements of x [n], computed on the device and read back: the one wait of it. Fails
 * only out of memory (a plan: 0). */
ds4_status ds4_dev_count_nonfinite(const ds4_exec *ex, const float *x, int64_t n, int64_t *out);
/* *acc = ds4_sumsq_exact(x [n]) computed on the device and read back (a plan: zero). */
ds4_status ds4_dev_sumsq_exact(const ds4_exec *ex, const float *x, int64_t n, ds4_sumsq_acc *acc);
/* g [len] += Σ_r recv [n][len] in rank order (ops.def rank_sum_add), g and recv on the device. */
void ds4_dev_rank_sum_add(const ds4_exec *ex, float *g, const float *recv, int n, int64_t len);
/* dst [bytes] = 0 on the device. */
void ds4_dev_zero(const ds4_exec *ex, void *dst, size_t bytes);
/* x [n] *= s (ds4_scale_f32). */
void ds4_dev_scale(const ds4_exec *ex, float *x, int64_t n, float s);
/* ds4_adamw_update, ds4_muon_momentum and ds4_muon_apply (ds4/core.h) on device arrays. */
void ds4_dev_adamw_update(const ds4_exec *ex, int64_t n, float *w, const float *g, float *m, float *v,
                          ds4_adamw_consts k, bool decay);
void ds4_dev_muon_momentum(const ds4_exec *ex, int64_t n, const float *g, float *mom, float *u, float mu,
                           bool nesterov);
void ds4_dev_muon_apply(const ds4_exec *ex, int64_t n, float *w, const float *o, float decay, float step);

/* The router bias of block b ("layers.L.ffn.gate.bias": L, "mtp.K.ffn.gate.bias": n_layers + K), -1 for
 * any other tensor (hash-routed blocks have none). */
int64_t ds4_param_router_block(const ds4_config *c, const ds4_param *p);
/* Aux-loss-free balancing (noaux_tc) of one block on experts [e0, e1): bias [e1 - e0] +=
 * γ·sign(mean_load − load_e), loads: [E] token counts of the step. */
void ds4_router_bias_rule(const int64_t *loads, int64_t E, double gamma, int64_t e0, int64_t e1, float *bias);

/* docs/contract.md init rules, every value a function of (seed, tensor name, index). */
/* The values are made on the host and copied to the model's device in chunks; a plan does nothing. */
ds4_status ds4_model_init_random(ds4_model *m, uint64_t seed);
ds4_status ds4_model_init_param(ds4_model *m, int64_t i, uint64_t seed); /* one tensor of the table */
/* Elements [k0, k1) of float parameter p under the init rules, into out [k1 - k0]. */
void ds4_param_init_values(const ds4_param *p, uint64_t seed, int64_t k0, int64_t k1, float *out);
/* Reads tensor i of the table from a model directory (checks shape and, for tid2eid, the ids). */
ds4_status ds4_model_load_param(ds4_model *m, const ds4_model_dir *d, int64_t i);
/* Loads every tensor by its official name; each must exist with the right shape. */
ds4_status ds4_model_load(ds4_model *m, const ds4_model_dir *d);
/* Writes DIR/config.json + DIR/model.safetensors (F32 or BF16 floats; tid2eid I64). */
ds4_status ds4_model_save(ds4_model *m, const char *dir, ds4_dtype float_dtype);

/* ------------------------------------------------------------------ parameter groups and regions
 * The parameters fall into groups in the order a pass uses them: 0 = embed, 1 + l = layers.l,
 * n_layers + 1 = the final norm, head and hc_head, n_layers + 2 = the MTP block with its extras.
 * A region is a contiguous flat range [start, end) of one group: dense (expert = -1) or one routed
 * expert's w1, w2, w3. Regions cover every float parameter; a parameter lies in exactly one. In a model
 * with the bf16 copy a group's dense range is cut further where the compute dtype changes. */
enum { DS4_HELD_VALUES = 1, DS4_HELD_GRADS = 2 };
typedef struct {
    int64_t group;
    int32_t expert;
    bool bf16;    /* a model with the bf16 copy: its parameters' compute dtype is bf16 (ds4_param.gemm) */
    uint8_t held; /* an unmapped model's region resident for good (ds4_model_hold): DS4_HELD_VALUES (with the
                   * bf16 copy) | DS4_HELD_GRADS; 0 in a whole model, which holds everything */
    int64_t start, end;
} ds4_region;

int64_t ds4_model_ngroups(const ds4_model *m);
int64_t ds4_model_nregions(const ds4_model *m);
const ds4_region *ds4_model_region(const ds4_model *m, int64_t i);
/* Unmapped models: makes flat values (grad = false) or gradients [start, end) resident and zero,
 * counted as DS4_MEM_PARAM / DS4_MEM_GRAD; unmap returns the pages (contents are lost). Both must
 * cover whole regions. A no-op count-only in a plan (memplan). */
ds4_status ds4_model_map(ds4_model *m, int64_t start, int64_t end, bool grad);
void ds4_model_unmap(ds4_model *m, int64_t start, int64_t end, bool grad);
/* The bytes ds4_model_map(.., grad = true) counted for [start, end), handed from owner `from` to `to`
 * (ds4_mem_owner_move: a group's gradients leaving its backward for its reduce-scatter). */
void ds4_model_grads_hand_over(ds4_model *m, int64_t start, int64_t end, const char *from, const char *to);
/* The same for the bf16 compute copy [start, end) (DS4_MEM_PARAM, 2 bytes per element). */
ds4_status ds4_model_map_bf16(ds4_model *m, int64_t start, int64_t end);
void ds4_model_unmap_bf16(ds4_model *m, int64_t start, int64_t end);

/* Resident groups (a pipeline stage, docs/pipeline.md): an unmapped model run without hooks holds, for good,
 * the groups of its chunks. ds4_model_hold maps every region of `group`: its values (and their bf16 copy)
 * and, with grads, its gradients, zero (a stage that reads a group it does not train, the embedding the MTP
 * block reads on the last stage, holds its values only); ds4_model_free gives them back. On such a model
 * ds4_model_init_random, ds4_model_load, ds4_model_zero_grad and ds4_model_refresh_bf16 touch the held
 * parts only (every integer table and carried tensor is always there). */
ds4_status ds4_model_hold(ds4_model *m, int64_t group, bool grads);
/* Whether region i's values (grads false) or gradients are resident: always in a whole model; in an unmapped
 * one, when its group is held by ds4_model_hold (what FSDP maps for a while is not held). */
bool ds4_model_region_held(const ds4_model *m, int64_t i, bool grads);
/* The region of flat element i (region padding belongs to its region), -1 outside the layout. */
int64_t ds4_model_region_at(const ds4_model *m, int64_t i);
/* ds4_model_region_held of p's region; an integer table or carried tensor: values yes, gradients no. */
bool ds4_model_param_held(const ds4_model *m, const ds4_param *p, bool grads);
/* Bytes an unmapped model holds for good: its held regions' values with their bf16 copy (grads false) or
 * gradients, padding included: what ds4_model_hold counted (0 for a whole model). */
int64_t ds4_model_held_bytes(const ds4_model *m, bool grads);

/* Expert parallelism as the MoE unit sees it. The routed assignments of a pass (expert-major,
 * counts cnt[E]) travel to the ranks owning the experts; each rank runs its experts [e0, e1) on the
 * rows it received and sends the results back. Received rows are laid out expert-major, then by
 * source rank, so each (expert, source) pair is a contiguous block. */
typedef struct {
    int nsrc;                /* ranks of the EP group */
    int64_t e0, e1;          /* this rank's experts */
    int64_t rows;            /* rows received in total */
    int64_t *recv_cnt;       /* [(e1 - e0) · nsrc]: rows of expert e0 + i from source s at [i·nsrc + s] */
    int64_t *send_cnt;       /* [nsrc] rows this rank sends to each peer */
    int64_t *recv_from;      /* [nsrc] rows this rank receives from each peer */
} ds4_ep_route;

typedef struct {
    void *ctx;
    int64_t e0, e1;          /* this rank's experts */
    /* Exchanges the per-expert counts cnt[E] of this rank's assignments (a collective of the EP group).
     * In a plan (memplan) the counts are those of balanced routing. *out is one allocation: the model
     * frees it with ds4_free. */
    ds4_status (*route)(void *ctx, const int64_t *cnt, ds4_ep_route **out);
    /* rows [N·K, width] in assignment order → recv [rows, width] (dispatch) and back (combine). */
    ds4_status (*dispatch)(void *ctx, const ds4_ep_route *r, const float *send, float *recv, int64_t width);
    ds4_status (*combine)(void *ctx, const ds4_ep_route *r, const float *recv, float *send, int64_t width);
} ds4_ep_ops;

#define DS4_HOOK_AHEAD 8
/* What a parallel wrapper does around the model (NULL members: nothing). The model calls gather
 * before it reads a group's weights and drop after its last read; grad_begin before the first
 * gradient of a group accumulates and grad_end once the group's gradients of the pass are complete. */
typedef struct {
    void *ctx;
    ds4_status (*gather)(void *ctx, int64_t group);
    void (*drop)(void *ctx, int64_t group);
    ds4_status (*grad_begin)(void *ctx, int64_t group);
    ds4_status (*grad_end)(void *ctx, int64_t group);
    /* After each gather: the groups the pass will gather next, nearest first (n <= DS4_HOOK_AHEAD); a
     * wrapper may start fetching some of them. */
    ds4_status (*prefetch)(void *ctx, const int64_t *next, int64_t n);
    /* At the end of a forward or backward (also a failed one): whatever the wrapper still has in flight
     * completes (a backward's gradients are all in place after it). */
    ds4_status (*sync)(void *ctx);
    const ds4_ep_ops *ep;    /* NULL: every expert is local */
} ds4_param_hooks;

/* ------------------------------------------------------------------ the activation store
 * What becomes of a training pass's saved tensors between their last forward reader and backward is
 * the store's decision, asked per (layer, unit): a unit of ds4_unit_name, or DS4_UNIT_INPUT for main
 * layer l's input stream X[l] ([N, n, D] floats, slot 0). The model derives everything else from the
 * units' declarations (when a unit's last forward reader has run, replay order, the per-unit report).
 * The implementation with the trainer's policies (recompute masks, --swap-layer-input) is the memory
 * layer's (ds4/actstore.h). */
#define DS4_NUM_UNITS 16
#define DS4_UNIT_INPUT DS4_NUM_UNITS /* a main layer's input stream */
typedef enum {
    DS4_ACT_KEEP = 0,  /* stays in memory until backward has read it */
    DS4_ACT_RECOMPUTE, /* freed; backward replays the unit (its released inputs first) */
    DS4_ACT_SWAP,      /* moved out by save, brought back by fetch before the first backward reader (and
                        * before any replay that reads it); layer inputs only */
} ds4_act_policy;

typedef struct {
    ds4_act_policy (*policy)(void *ctx, int64_t layer, int unit);
    /* SWAP: *buf [bytes] leaves memory: the store keeps its bytes, frees *buf and sets it NULL. */
    ds4_status (*save)(void *ctx, int64_t layer, int unit, int slot, void **buf, size_t bytes);
    /* SWAP: *buf becomes a new DS4_MEM_ACT buffer with the saved bytes (no-op when it is not held). */
    ds4_status (*fetch)(void *ctx, int64_t layer, int unit, int slot, void **buf, size_t bytes);
    /* The pass is freed: forget anything still held for (layer, unit, slot). */
    void (*release)(void *ctx, int64_t layer, int unit, int slot);
} ds4_act_store_ops;

typedef struct {
    const ds4_act_store_ops *ops; /* NULL: every saved tensor stays in memory */
    void *ctx;
} ds4_act_store;

/* ------------------------------------------------------------------ one pass */
typedef struct {
    double loss, mtp_loss, indexer_loss, total_loss;
} ds4_losses;

typedef struct {
    bool need_backward;     /* false: forward only (eval); no activations kept beyond use */
    bool keep_logits;       /* keep logits / mtp_logits, and every CSA layer's top-k even when recompute
                               releases it, for the caller (debug-state) */
    bool csa_dense;         /* attend all usable compressed entries on CSA layers */
    const ds4_param_hooks *hooks; /* NULL: the whole model is resident and local */
    /* Benchmarks and memplan checks (TorchTitan's moe_force_load_balance): slot k of token t goes to
     * expert (t·K + k) mod E, weighted by its normalised score; gradients follow that choice. */
    bool moe_force_balance;
    /* Recompute and offload of saved tensors (training passes; MTP blocks always keep theirs). */
    ds4_act_store store;
    /* Mixed precision (training.mixed_precision_param = "bfloat16"): the block outputs each unit declares
     * bf16-safe are rounded to bf16 when made and held as bf16 between their last forward reader and
     * backward; statistics, softmax / Sinkhorn inputs, router scores and the residual streams stay fp32
     * (docs/mixed-precision.md). Every recompute and offload policy keeps the same bits. */
    bool bf16_acts;
} ds4_pass_opts;

typedef struct ds4_pass ds4_pass;

/* Forward of input_ids [B, T] (int32, each < vocab). The indexer loss of a training pass is computed
 * in backward from the saved log-sum-exp; for a forward-only pass it is computed in forward. */
ds4_status ds4_forward(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, const ds4_pass_opts *opts,
                       ds4_pass **out);
/* Backward of total_loss; ACCUMULATES into the model's gradients; fills the final losses. */
ds4_status ds4_backward(ds4_model *m, ds4_pass *p);
const ds4_losses *ds4_pass_losses(const ds4_pass *p);
const float *ds4_pass_logits(const ds4_pass *p);       /* [B, T, V] if keep_logits */
const float *ds4_pass_mtp_logits(const ds4_pass *p);   /* [B, T, V] if keep_logits and MTP */
const int32_t *ds4_pass_topk(const ds4_pass *p, int64_t layer); /* [B, T, index_topk] or NULL */
/* Per-expert token counts of each MoE layer in the pass ([n_layers + n_mtp][E]), for load balancing. */
const int64_t *ds4_pass_expert_load(const ds4_pass *p, int64_t layer);
void ds4_pass_free(ds4_pass *p);

/* ------------------------------------------------------------------ a stage of a pass
 * The pass cut at layer boundaries, for a pipeline schedule (docs/pipeline.md): a stage runs decoder layers
 * [layer_begin, layer_end) on the residual stream X [B, T, hc_mult, dim]; the embedding makes X[0] before
 * layer 0 on the first stage, the head, its loss and the MTP block (with its loss and the embedding of
 * the next ids) follow the last layer on the last. Running the stages of a cut one after another on one
 * model (forward 0, 1, ..., each given the previous one's stream_out; backward last, ..., 0, each given the
 * next one's stream_grad) gives the bits of ds4_forward / ds4_backward: every gradient, and the losses
 * through ds4_losses_combine. Every stage reads the whole batch's ids (hash routing, targets). The model
 * knows no pipeline: the stage is a layer range. A stage with the MTP block but not the embedding of an
 * unmapped model hands its MTP rows on (mtp_rows_out), else it is refused. */
typedef struct {
    int64_t layer_begin, layer_end; /* decoder layers [layer_begin, layer_end) */
    bool embedding;                 /* X[0] from the ids (layer_begin = 0); else from X_in */
    bool head;                      /* the heads, losses and MTP after the last layer (layer_end = n_layers) */
    /* A head stage without the embedding: the MTP rows' gradient (∂/∂embed[ids_next], [B·T, dim]) is handed on
     * (ds4_pass_mtp_rows_grad) for the embedding's stage to scatter (ds4_stage_backward_rows) before its own
     * rows, instead of being scattered here: a pipeline's embedding gradient then sums micro-batch by
     * micro-batch in the whole pass's order (MTP rows, then the main rows), whichever stage runs first. */
    bool mtp_rows_out;
} ds4_stage;
/* X_in [B, T, hc_mult, dim] on the model's backend (copied): the stream X[layer_begin] of a stage without the
 * embedding, NULL with it. The pass holds what its backward needs; its losses are its own: the heads' on
 * the last stage, its layers' indexer KL (ds4_pass_layer_kl). */
ds4_status ds4_stage_forward(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, const ds4_pass_opts *opts,
                             const ds4_stage *stage, const float *X_in, ds4_pass **out);
/* [B, T, hc_mult, dim] X[layer_end], for the next stage (NULL on the head's stage); valid until the backward. */
const float *ds4_pass_stream_out(const ds4_pass *p);
/* Backward of the stage; ACCUMULATES into the model's gradients. dX_out [B, T, hc_mult, dim]: ∂total_loss/∂X[layer_end]
 * from the next stage (copied), NULL on the head's stage. */
ds4_status ds4_stage_backward(ds4_model *m, ds4_pass *p, const float *dX_out);
/* [B, T, hc_mult, dim] ∂total_loss/∂X[layer_begin] after the backward of a stage without the embedding (else
 * NULL), for the previous stage; freed with the pass. */
const float *ds4_pass_stream_grad(const ds4_pass *p);
/* ds4_stage_backward of the embedding's stage (without the head) that also scatters mtp_rows [B·T, dim], the
 * head stage's ds4_pass_mtp_rows_grad of the same micro-batch, into the embedding's gradient before its own
 * rows; mtp_rows NULL: ds4_stage_backward. */
ds4_status ds4_stage_backward_rows(ds4_model *m, ds4_pass *p, const float *dX_out, const float *mtp_rows);
/* [B·T, dim] the MTP rows' gradient after the backward of a stage with mtp_rows_out (NULL otherwise, or for a
 * model without MTP), for the embedding's stage; freed with the pass. */
const float *ds4_pass_mtp_rows_grad(const ds4_pass *p);
/* Main layer `layer`'s indexer KL (its mean over the rows it scored) in this pass; 0 for a layer that has
 * none or is not the pass's. */
double ds4_pass_layer_kl(const ds4_pass *p, int64_t layer);
/* The pass's losses from their parts: the head's loss, the MTP head's, layer_kl [n_layers] (summed in layer
 * order); what every pass's losses are made by, so the stages' parts combine to the whole pass's bits. */
ds4_losses ds4_losses_combine(const ds4_config *c, double loss, double mtp_loss, const double *layer_kl);

/* ------------------------------------------------------------------ Newton–Schulz (the Muon optimizer)
 * The newton_schulz op (ds4_ns_coef: ds4/core.h) with its arguments checked. */
/* x [rows, cols] := its approximate orthogonal factor U·Vᵀ (singular values pushed towards 1): divided
 * by its Frobenius norm + eps, then iters iterations with coef[i] on the short side (xᵀ when rows > cols),
 * every product through the GEMM engines. Its workspace (2·r² + 2·r·c floats, r = min(rows, cols), the
 * transposed copy only when rows > cols) is counted as DS4_MEM_OPTIM. ex: the context (its matmul precision;
 * a plan: only the workspace is counted, x untouched; NULL: real, fp32). Fails on bad sizes or out of
 * memory. */
ds4_status ds4_newton_schulz(const ds4_exec *ex, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                             int64_t iters, float eps);

/* The theoretical peak FLOP/s of this machine with the run's threads (ds4_get_threads), for the engine of
 * context ex (its ISA level and matmul precision): one core's clock, measured by a chain of dependent adds
 * in the probing thread's CPU time (the best of 16 short chains, so other processes holding the core do
 * not lower it; ~5 ms), times the engine's FLOPs per cycle at most (two FMA pipes of its vector width;
 * AMX: 1024 in bf16), times the threads. how: the same in words, for a log's header line. A backend off the
 * host's cores (cuda): flops 0 and how says to set metrics.peak_tflops. */
typedef struct {
    double flops;        /* core_flops · threads */
    double core_flops;   /* clock_hz · flops_per_cycle */
    double clock_hz;     /* one core's measured clock */
    int flops_per_cycle; /* the engine's at most */
    int threads;
    char how[224];
} ds4_peak;
ds4_peak ds4_probe_peak(const ds4_exec *ex);
/* The GEMM engine's measured rate on one core, FLOP/s, for the benchmarks' "of GEMM peak": a 512³ product
 * in ex's precision, the best of 3 to 9 repeats (~0.3 s) in the thread's CPU time. On a quiet machine only:
 * where the core is time-shared its caches and clock recover slowly after each wait and it reads low.
 * 0 in a plan or off the host's cores. */
double ds4_probe_gemm_rate(const ds4_exec *ex);

/* ------------------------------------------------------------------ units (for policies and reports) */
const char *ds4_unit_name(int unit);  /* "hc_pre_attn", "attn_norm", ..., "hc_post_ffn" */
int ds4_unit_find(const char *name);  /* -1 if unknown */
typedef struct {
    int64_t bytes;          /* bytes of the unit's outputs (one copy) in this pass */
    int64_t released;       /* releases after forward */
    int64_t replays;        /* replays for backward */
    double replay_seconds;
} ds4_unit_report;
/* Per (block, unit) figures of a pass; valid after forward (released) and after backward (replays). */
ds4_unit_report ds4_pass_unit_report(const ds4_pass *p, int64_t layer, int unit);

/* ------------------------------------------------------------------ what a block saves for its backward
 * One row per tensor block `layer` (n_layers: the MTP block) keeps from its forward for its backward,
 * derived from the units' declarations (their output slots, in forward order, on the layers where the
 * unit runs; the sizes the store allocates), then the block's input stream: what the activation
 * category of a training pass holds for that block between forward and backward (ds4 memplan
 * --saved-activations; docs/mixed-precision.md). Nothing is allocated. */
typedef enum { DS4_SAVED_F32, DS4_SAVED_BF16, DS4_SAVED_I32, DS4_SAVED_I64 } ds4_saved_dtype;
typedef struct {
    int unit;              /* ds4_unit_name's index, or DS4_UNIT_INPUT (the block's input stream) */
    const char *name;      /* the slot's name in its unit's declaration; "X_in" for the input stream */
    int ndim;
    int64_t shape[3];      /* for the pass's B·T tokens */
    ds4_saved_dtype dtype; /* as held between its last forward reader and its backward (recomputed: as it
                            * would be, were it kept) */
    int64_t bytes;         /* as held (recomputed: as it would be) */
    ds4_act_policy policy; /* KEEP: in memory; RECOMPUTE: freed, replayed in backward; SWAP: offload tier */
} ds4_saved_tensor;
typedef struct {
    int64_t B, T;
    uint32_t release_mask; /* the layer's recompute mask (ds4/recompute.h); the MTP block never recomputes */
    bool swap_input;       /* --swap-layer-input: a main layer's input stream goes to the offload tier */
    bool bf16;             /* mixed precision (ds4_pass_opts.bf16_acts) */
    bool ep;               /* expert parallelism (degree > 1): the received rows are saved too */
    int64_t routed_rows;   /* under ep, the routed rows this rank computes (its experts' share) */
} ds4_saved_opts;
#define DS4_SAVED_MAX (DS4_NUM_UNITS * 8 + 1)
/* Fills out[DS4_SAVED_MAX]; returns the number of rows. */
int ds4_block_saved(const ds4_config *c, int64_t layer, const ds4_saved_opts *o, ds4_saved_tensor *out);

/* ---------------------------------------------------------------- expected tensors of a config */
/* Calls fn for every tensor a model of `cfg` has, in the order and with the names and shapes of the
 * parameter table of ds4_model_create, without allocating the model. Stops at the first non-OK. */
typedef ds4_status (*ds4_expected_fn)(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int);
ds4_status ds4_model_expected_tensors(const ds4_config *cfg, ds4_expected_fn fn, void *ctx);

/* Verifies that directory d holds every tensor its config needs (official or HF names), with the
 * right logical shape and a usable dtype, and nothing else. Each problem is passed to fn with
 * what = "missing" | "shape" | "dtype" | "bad" | "extra"; *n_problems counts them. Returns non-OK
 * only when the check itself cannot run (out of memory). */
typedef void (*ds4_check_fn)(void *ctx, const char *what, const char *name, const char *detail);
ds4_status ds4_model_dir_check(const ds4_model_dir *d, ds4_check_fn fn, void *ctx, int64_t *n_problems);

/* ---------------------------------------------------------------- census of a config
 * What a model of `cfg` holds, from the parameter table alone (nothing allocated): float parameters
 * by group, the hash router's int tables, and the checkpoint the config describes (official FP8/FP4
 * with E8M0 scales when it has a quantization_config, else BF16), with F32 and I64 where
 * ds4/tensors.h keeps them. Validates the config first. */
typedef struct {
    int64_t params_expert;   /* routed experts of the main layers */
    int64_t params_dense;    /* embedding, the main layers without their routed experts, head */
    int64_t params_mtp;      /* the MTP block, its routed experts included */
    int64_t params_dspark;   /* the DSpark drafter's stages (carried, never trained), their experts included */
    int64_t params_total;    /* the four above */
    int64_t hash_entries;    /* tid2eid entries of the hash layers (fixed, not trained) */
    int64_t tensors;         /* named tensors of the table */
    int64_t stored_tensors;  /* in the checkpoint: weights plus their scales */
    int64_t stored_elements; /* in the checkpoint (FP4: bytes of two values each) */
    int64_t bytes[DS4_DTYPE_COUNT]; /* checkpoint bytes per stored dtype */
    int64_t total_bytes;
    bool quantized, expert_fp4;
} ds4_param_census;
ds4_status ds4_model_census(const ds4_config *cfg, ds4_param_census *out);

#ifdef __cplusplus
}
#endif
#endif
