/* The walk over the parameter table: every tensor a config gives a model, in table order, built from the
 * declaration in ds4/tensors.h. ds4_model_create lays the model out from it (params.c) and
 * ds4_model_expected_tensors lists it without a model (param_table.c): one table, one order. */
#ifndef DS4_MODEL_PARAM_TABLE_H
#define DS4_MODEL_PARAM_TABLE_H

#include "model/model_internal.h"

#include "ds4/tensors.h"

/* One tensor as the walk meets it. */
typedef struct {
    char name[112];       /* official name (ds4_param.name) */
    int ndim;
    int64_t shape[2];
    ds4_init_rule init;   /* also decides weight decay, gradients and int storage */
    bool gemm;            /* read by GEMMs: its compute dtype is bf16 under mixed precision (param_table.c) */
    bool carried;         /* the DSpark drafter's: kept outside the flat layout, never trained */
    float **w, **g;       /* its slots in the walk's value / gradient structs; NULL without them or for ints */
} param_entry;

typedef struct param_walk param_walk;
struct param_walk {
    const ds4_config *c;
    model_w *W, *G;  /* the named slots to hand out (their blocks and expert arrays allocated), or NULL */
    void *ctx;
    /* a new flat region of `group` starts (expert -1: dense), before the tensors that lie in it */
    void (*region)(param_walk *w, int64_t group, int64_t expert);
    /* the next tensor; returns false to stop the walk */
    bool (*tensor)(param_walk *w, const param_entry *e);
    bool stopped;
    bool carrying;   /* inside the DSpark stages: entries are carried, no regions, no slots */
};

void param_walk_run(param_walk *w);

#endif
