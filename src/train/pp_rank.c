/* What the pipeline's executors share (src/train/pp_impl.h): a chunk's stage pass, the checks of a rank's
 * run over MPI, a boundary tensor's receive. */
#include "ds4/kernels.h"
#include "pp_impl.h"

#include <stdlib.h>

ds4_stage pp_stage_of(const ds4_model *m, const ds4_pp_layout *L, int64_t k) {
    const ds4_pp_chunk *ch = &L->chunk[k];
    const bool mtp = ds4_model_config(m)->n_mtp_layers > 0;
    return (ds4_stage){.layer_begin = ch->layer_begin, .layer_end = ch->layer_end, .embedding = ch->embedding,
                       .head = ch->loss, .mtp_rows_out = ch->loss && !ch->embedding && mtp};
}

ds4_status pp_check_args(const ds4_model *m, const ds4_pp_local_args *a) {
    const ds4_config *c = ds4_model_config(m);
    const ds4_pp_layout *L = a->layout;
    if (L->n_layers != c->n_layers || L->n_mtp != c->n_mtp_layers)
        return ds4_fail(DS4_ERR_ARG, "pipeline: the layout has %lld layers and %lld MTP layers, the model %lld and %lld",
                        (long long)L->n_layers, (long long)L->n_mtp, (long long)c->n_layers, (long long)c->n_mtp_layers);
    if (a->micro_batches < 1 || a->B < 1 || a->T < 2)
        return ds4_fail(DS4_ERR_ARG, "pipeline: %lld micro-batches of %lld x %lld tokens (need >= 1, >= 1, >= 2)",
                        (long long)a->micro_batches, (long long)a->B, (long long)a->T);
    return DS4_OK;
}

ds4_status pp_check_rank(const ds4_model *m, const ds4_comm *pipe, const ds4_pp_local_args *a, int64_t kinds) {
    const ds4_pp_layout *L = a->layout;
    if (ds4_comm_size(pipe) != L->pp)
        return ds4_fail(DS4_ERR_ARG, "pipeline over MPI: the layout has pp %lld, the communicator %d ranks (world = pp "
                        "for now)", (long long)L->pp, ds4_comm_size(pipe));
    if (!ds4_exec_host_memory(ds4_model_exec(m)))
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline over MPI: a model in device memory (its boundary buffers "
                        "through a staged communicator) is not built yet");
    DS4_TRY(pp_check_args(m, a));
    const int64_t nc = L->pp * L->vpp, M = a->micro_batches;
    if (kinds * nc * M > 32767) /* MPI guarantees tags up to 32767 */
        return ds4_fail(DS4_ERR_UNSUPPORTED, "pipeline over MPI: %lld chunks x %lld micro-batches exceed the tags",
                        (long long)nc, (long long)M);
    return DS4_OK;
}

ds4_status pp_recv_into(ds4_comm *pipe, float **buf, int64_t count, int64_t from_rank, int tag) {
    *buf = ds4_alloc_for(ds4_comm_is_plan(pipe), DS4_MEM_COMM, (size_t)count * sizeof(float));
    if (!*buf) return ds4_fail(DS4_ERR_OOM, "pipeline: out of memory for a receive of %lld floats", (long long)count);
    ds4_comm_req *req = NULL;
    DS4_TRY(ds4_comm_irecv(pipe, *buf, count, sizeof(float), (int)from_rank, tag, &req));
    return ds4_comm_wait(req);
}

ds4_status pp_swaps_make(const ds4_pp_local_args *a, pp_swaps *out) {
    *out = (pp_swaps){.M = a->micro_batches};
    if (!a->policies || !a->policies->swap) return DS4_OK;
    const int64_t M = a->micro_batches;
    out->pol = ds4_calloc(DS4_MEM_OTHER, (size_t)M * sizeof *out->pol);
    out->swap = ds4_calloc(DS4_MEM_OTHER, (size_t)M * sizeof *out->swap);
    if (!out->pol || !out->swap) {
        pp_swaps_free(out);
        return ds4_fail(DS4_ERR_OOM, "pipeline: out of memory for %lld micro-batches' layer-input swaps", (long long)M);
    }
    ds4_offload *tier = ds4_act_swap_offload(a->policies->swap);
    for (int64_t mb = 0; mb < M; mb++) {
        const ds4_status st = ds4_act_swap_new(tier, &out->swap[mb]);
        if (st != DS4_OK) {
            pp_swaps_free(out);
            return st;
        }
        out->pol[mb] = (ds4_act_policies){.recompute = a->policies->recompute, .swap = out->swap[mb]};
    }
    return DS4_OK;
}

ds4_pass_opts pp_opts_of(const ds4_pp_local_args *a, const pp_swaps *s, int64_t mb) {
    ds4_pass_opts o = *a->opts;
    o.need_backward = true;
    if (s->pol) o.store = ds4_act_store_of(&s->pol[mb]);
    return o;
}

void pp_swaps_free(pp_swaps *s) {
    for (int64_t mb = 0; s->swap && mb < s->M; mb++) ds4_act_swap_free(s->swap[mb]);
    ds4_free(s->pol);
    ds4_free(s->swap);
    *s = (pp_swaps){0};
}
