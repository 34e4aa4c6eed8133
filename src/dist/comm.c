/* Communicators: one process, MPI, or a simulated world for memplan. Sums are computed by gathering
 * every rank's values and adding them in rank order, so results do not depend on MPI's reduction
 * algorithm. */
#include "ds4/dist.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#ifdef DS4_HAVE_MPI
#include <mpi.h>
#endif

typedef enum { COMM_SELF, COMM_MPI, COMM_PLAN } comm_kind;

struct ds4_comm {
    comm_kind kind;
    int rank, size;
#ifdef DS4_HAVE_MPI
    MPI_Comm mpi;
#endif
};

static ds4_comm g_world = {COMM_SELF, 0, 1
#ifdef DS4_HAVE_MPI
                           ,
                           0
#endif
};
static bool g_mpi_started;

/* mpirun (Open MPI), PMIx or PMI launchers leave one of these in the environment. */
static bool launched_by_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_SIZE");
}

ds4_status ds4_dist_init(void) {
    if (g_mpi_started || !launched_by_mpirun()) return DS4_OK;
#ifdef DS4_HAVE_MPI
    int provided = 0;
    if (MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return ds4_fail(DS4_ERR_IO, "MPI_Init failed");
    g_mpi_started = true;
    g_world.kind = COMM_MPI;
    g_world.mpi = MPI_COMM_WORLD;
    MPI_Comm_rank(MPI_COMM_WORLD, &g_world.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_world.size);
    return DS4_OK;
#else
    return ds4_fail(DS4_ERR_ARG, "launched by mpirun, but this ds4 was built without MPI (install libopenmpi-dev)");
#endif
}

void ds4_dist_finalize(void) {
#ifdef DS4_HAVE_MPI
    if (g_mpi_started) MPI_Finalize();
#endif
    g_mpi_started = false;
}

ds4_comm *ds4_comm_world(void) { return &g_world; }

ds4_comm *ds4_comm_self(void) {
    static ds4_comm self = {COMM_SELF, 0, 1
#ifdef DS4_HAVE_MPI
                            ,
                            0
#endif
    };
    return &self;
}

ds4_status ds4_comm_plan(int size, int rank, ds4_comm **out) {
    if (size < 1 || rank < 0 || rank >= size)
        return ds4_fail(DS4_ERR_ARG, "plan communicator: rank %d of %d ranks is not valid", rank, size);
    ds4_comm *c = ds4_calloc(DS4_MEM_OTHER, sizeof *c);
    if (!c) return DS4_ERR_OOM;
    c->kind = COMM_PLAN;
    c->rank = rank;
    c->size = size;
    *out = c;
    return DS4_OK;
}

int ds4_comm_rank(const ds4_comm *c) { return c->rank; }
int ds4_comm_size(const ds4_comm *c) { return c->size; }
bool ds4_comm_is_plan(const ds4_comm *c) { return c->kind == COMM_PLAN; }

ds4_status ds4_comm_split(ds4_comm *c, int color, int key, ds4_comm **out) {
    *out = NULL;
    ds4_comm *n = ds4_calloc(DS4_MEM_OTHER, sizeof *n);
    if (!n) return DS4_ERR_OOM;
    n->kind = c->kind;
    if (c->kind == COMM_MPI) {
#ifdef DS4_HAVE_MPI
        if (MPI_Comm_split(c->mpi, color, key, &n->mpi) != MPI_SUCCESS) {
            ds4_free(n);
            return ds4_fail(DS4_ERR_IO, "MPI_Comm_split failed");
        }
        MPI_Comm_rank(n->mpi, &n->rank);
        MPI_Comm_size(n->mpi, &n->size);
#endif
    } else if (c->kind == COMM_PLAN) {
        ds4_free(n);
        return ds4_fail(DS4_ERR_INTERNAL, "a plan communicator is not split: make the sub-world with ds4_comm_plan");
    } else {
        n->size = 1;
        n->rank = 0;
    }
    *out = n;
    return DS4_OK;
}

void ds4_comm_free(ds4_comm *c) {
    if (!c || c == &g_world || c == ds4_comm_self()) return;
#ifdef DS4_HAVE_MPI
    if (c->kind == COMM_MPI) MPI_Comm_free(&c->mpi);
#endif
    ds4_free(c);
}

#ifdef DS4_HAVE_MPI
/* MPI counts are int: elements of `elem` bytes travel as one contiguous datatype each. */
static ds4_status mpi_type(size_t elem, MPI_Datatype *t) {
    if (MPI_Type_contiguous((int)elem, MPI_BYTE, t) != MPI_SUCCESS || MPI_Type_commit(t) != MPI_SUCCESS)
        return ds4_fail(DS4_ERR_IO, "MPI: cannot make a %zu-byte datatype", elem);
    return DS4_OK;
}

static ds4_status to_int(const int64_t *v, int n, int *out, const char *what) {
    for (int i = 0; i < n; i++) {
        if (v[i] < 0 || v[i] > INT_MAX) return ds4_fail(DS4_ERR_ARG, "MPI: %s %lld does not fit an int", what, (long long)v[i]);
        out[i] = (int)v[i];
    }
    return DS4_OK;
}
#endif

/* Copies what a one-rank collective would deliver. */
static void self_copy(const void *send, int64_t count, void *recv, int64_t displ, size_t elem) {
    if (count > 0 && recv && send) memmove((char *)recv + (size_t)displ * elem, send, (size_t)count * elem);
}

/* All-gather (root < 0) or gather to root of variable counts: the one body both collectives share. */
static ds4_status gather_any(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                             const int64_t *rdispls, size_t elem, int root) {
    if (c->kind == COMM_PLAN) return DS4_OK; /* a plan: nothing moves */
    if (c->kind == COMM_SELF) {
        self_copy(send, scount, recv, rdispls[0], elem);
        return DS4_OK;
    }
#ifdef DS4_HAVE_MPI
    int n = c->size, *ic = malloc(sizeof(int) * 2 * (size_t)n), sc = 0;
    if (!ic) return DS4_ERR_OOM;
    MPI_Datatype t;
    ds4_status st = to_int(rcounts, n, ic, "count");
    if (st == DS4_OK) st = to_int(rdispls, n, ic + n, "displacement");
    if (st == DS4_OK) st = to_int(&scount, 1, &sc, "count");
    if (st == DS4_OK) st = mpi_type(elem, &t);
    if (st == DS4_OK) {
        int rc = root < 0 ? MPI_Allgatherv(send, sc, t, recv, ic, ic + n, t, c->mpi)
                          : MPI_Gatherv(send, sc, t, recv, ic, ic + n, t, root, c->mpi);
        if (rc != MPI_SUCCESS) st = ds4_fail(DS4_ERR_IO, "%s failed", root < 0 ? "MPI_Allgatherv" : "MPI_Gatherv");
        MPI_Type_free(&t);
    }
    free(ic);
    return st;
#else
    (void)root;
    return DS4_ERR_INTERNAL;
#endif
}

ds4_status ds4_comm_allgatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                               const int64_t *rdispls, size_t elem) {
    return gather_any(c, send, scount, recv, rcounts, rdispls, elem, -1);
}

ds4_status ds4_comm_alltoallv(ds4_comm *c, const void *send, const int64_t *scounts, const int64_t *sdispls,
                              void *recv, const int64_t *rcounts, const int64_t *rdispls, size_t elem) {
    if (c->kind == COMM_PLAN) return DS4_OK; /* a plan: nothing moves */
    if (c->kind == COMM_SELF) {
        (void)rcounts;
        self_copy(send ? (const char *)send + (size_t)sdispls[0] * elem : NULL, scounts[0], recv, rdispls[0], elem);
        return DS4_OK;
    }
#ifdef DS4_HAVE_MPI
    int n = c->size, *ic = malloc(sizeof(int) * 4 * (size_t)n);
    if (!ic) return DS4_ERR_OOM;
    MPI_Datatype t;
    ds4_status st = to_int(scounts, n, ic, "count");
    if (st == DS4_OK) st = to_int(sdispls, n, ic + n, "displacement");
    if (st == DS4_OK) st = to_int(rcounts, n, ic + 2 * n, "count");
    if (st == DS4_OK) st = to_int(rdispls, n, ic + 3 * n, "displacement");
    if (st == DS4_OK) st = mpi_type(elem, &t);
    if (st == DS4_OK) {
        if (MPI_Alltoallv(send, ic, ic + n, t, recv, ic + 2 * n, ic + 3 * n, t, c->mpi) != MPI_SUCCESS)
            st = ds4_fail(DS4_ERR_IO, "MPI_Alltoallv failed");
        MPI_Type_free(&t);
    }
    free(ic);
    return st;
#else
    return DS4_ERR_INTERNAL;
#endif
}

ds4_status ds4_comm_gatherv(ds4_comm *c, const void *send, int64_t scount, void *recv, const int64_t *rcounts,
                            const int64_t *rdispls, size_t elem, int root) {
    return gather_any(c, send, scount, recv, rcounts, rdispls, elem, root);
}

/* Every rank's x gathered, then added in rank order on every rank. */
static ds4_status sum_ordered(ds4_comm *c, void *x, int64_t n, size_t elem, bool is_double) {
    if (c->kind != COMM_MPI || n <= 0) return DS4_OK;
    /* plain malloc: metadata of the exchange, outside the counted step memory (memplan cannot see it) */
    int64_t *cnt = malloc(sizeof(int64_t) * 2 * (size_t)c->size);
    char *all = malloc((size_t)(n * c->size) * elem);
    ds4_status st = cnt && all ? DS4_OK : DS4_ERR_OOM;
    for (int r = 0; st == DS4_OK && r < c->size; r++) {
        cnt[r] = n;
        cnt[c->size + r] = (int64_t)r * n;
    }
    if (st == DS4_OK) st = ds4_comm_allgatherv(c, x, n, all, cnt, cnt + c->size, elem);
    for (int64_t i = 0; st == DS4_OK && i < n; i++) {
        if (is_double) {
            double s = 0;
            for (int r = 0; r < c->size; r++) s += ((const double *)all)[(int64_t)r * n + i];
            ((double *)x)[i] = s;
        } else {
            int64_t s = 0;
            for (int r = 0; r < c->size; r++) s += ((const int64_t *)all)[(int64_t)r * n + i];
            ((int64_t *)x)[i] = s;
        }
    }
    free(cnt);
    free(all);
    return st;
}

ds4_status ds4_comm_sum_f64(ds4_comm *c, double *x, int64_t n) { return sum_ordered(c, x, n, sizeof(double), true); }
ds4_status ds4_comm_sum_i64(ds4_comm *c, int64_t *x, int64_t n) { return sum_ordered(c, x, n, sizeof(int64_t), false); }

ds4_status ds4_comm_barrier(ds4_comm *c) {
#ifdef DS4_HAVE_MPI
    if (c->kind == COMM_MPI && MPI_Barrier(c->mpi) != MPI_SUCCESS) return ds4_fail(DS4_ERR_IO, "MPI_Barrier failed");
#else
    (void)c;
#endif
    return DS4_OK;
}
