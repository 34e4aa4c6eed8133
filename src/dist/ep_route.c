/* Expert parallelism's route of one MoE pass (ds4_ep_route, ds4/model.h): made by the EP layer's route
 * operation, read by the model's MoE unit. One allocation (the struct, then its three count arrays), so
 * whoever holds it frees it with ds4_free. */
#include "ds4/dist.h"

ds4_ep_route *ds4_ep_route_new(int nsrc, int64_t e0, int64_t e1) {
    const int64_t nrecv = (e1 - e0) * nsrc + 1;
    ds4_ep_route *r = ds4_calloc(DS4_MEM_OTHER, sizeof *r + (size_t)(nrecv + 2 * nsrc) * sizeof(int64_t));
    if (!r) return NULL;
    r->nsrc = nsrc;
    r->e0 = e0;
    r->e1 = e1;
    r->recv_cnt = (int64_t *)(r + 1); /* [(e1 - e0)·nsrc + 1] */
    r->send_cnt = r->recv_cnt + nrecv;  /* [nsrc] */
    r->recv_from = r->send_cnt + nsrc;  /* [nsrc] */
    return r;
}

void ds4_ep_route_free(ds4_ep_route *r) { ds4_free(r); }
