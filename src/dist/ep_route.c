/* Expert parallelism's route of one MoE pass (ds4_ep_route, ds4/model.h): made by the EP layer's route
 * operation, read by the model's MoE unit, freed through the operations' free_route. */
#include "ds4/dist.h"

ds4_ep_route *ds4_ep_route_new(int nsrc, int64_t e0, int64_t e1) {
    ds4_ep_route *r = ds4_calloc(DS4_MEM_OTHER, sizeof *r);
    if (!r) return NULL;
    r->nsrc = nsrc;
    r->e0 = e0;
    r->e1 = e1;
    r->recv_cnt = ds4_calloc(DS4_MEM_OTHER, (size_t)((e1 - e0) * nsrc + 1) * sizeof(int64_t));
    r->send_cnt = ds4_calloc(DS4_MEM_OTHER, (size_t)nsrc * sizeof(int64_t));
    r->recv_from = ds4_calloc(DS4_MEM_OTHER, (size_t)nsrc * sizeof(int64_t));
    if (!r->recv_cnt || !r->send_cnt || !r->recv_from) {
        ds4_ep_route_free(r);
        return NULL;
    }
    return r;
}

void ds4_ep_route_free(ds4_ep_route *r) {
    if (!r) return;
    ds4_free(r->recv_cnt);
    ds4_free(r->send_cnt);
    ds4_free(r->recv_from);
    ds4_free(r);
}
