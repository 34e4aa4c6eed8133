/* Pipeline schedules (ds4_pp_schedule_make): every rank's list holds each (chunk, micro-batch) forward and
 * backward once, with the right boundary sides, each chunk's forwards and backwards in micro-batch order,
 * its backward after its forward; all ranks simulated together with receives that block (sends buffered, as
 * isend) run to the end; the peak of micro-batches in flight per rank and the bubble of a unit-cost
 * timeline are the schedules' theory; the executor's release points of a backward's sends deadlock no run;
 * the refusals are one line each. */
#include "ds4/pp_schedule.h"
#include "test.h"

#define MAXC 16 /* chunks */
#define MAXM 32 /* micro-batches */

/* One rank's list on its own. */
static void check_list(const ds4_pp_schedule *s, int64_t *peak) {
    const int64_t pp = s->pp, vpp = s->vpp, m = s->m, nc = pp * vpp;
    int fwd[MAXC][MAXM] = {{0}}, bwd[MAXC][MAXM] = {{0}};
    int64_t next_f[MAXC] = {0}, next_b[MAXC] = {0}, live = 0;
    *peak = 0;
    CHECK(s->n == 2 * vpp * m, "%lld actions", (long long)s->n);
    for (int64_t i = 0; i < s->n; i++) {
        const ds4_pp_action *x = &s->a[i];
        const bool f = x->op == DS4_PP_FORWARD;
        CHECK(x->vchunk >= 0 && x->vchunk < vpp && x->chunk == x->vchunk * pp + s->rank && x->mb >= 0 && x->mb < m,
              "action %lld: vchunk %lld chunk %lld mb %lld", (long long)i, (long long)x->vchunk, (long long)x->chunk,
              (long long)x->mb);
        if (!(x->chunk >= 0 && x->chunk < nc && x->mb >= 0 && x->mb < m)) return;
        const int64_t from = f ? x->chunk - 1 : x->chunk + 1, to = f ? x->chunk + 1 : x->chunk - 1;
        CHECK(x->from_chunk == (from >= 0 && from < nc ? from : -1) && x->from_rank == (x->from_chunk < 0 ? -1 : from % pp),
              "action %lld from %lld/%lld", (long long)i, (long long)x->from_rank, (long long)x->from_chunk);
        CHECK(x->to_chunk == (to >= 0 && to < nc ? to : -1) && x->to_rank == (x->to_chunk < 0 ? -1 : to % pp),
              "action %lld to %lld/%lld", (long long)i, (long long)x->to_rank, (long long)x->to_chunk);
        if (f) {
            fwd[x->chunk][x->mb]++;
            CHECK(x->mb == next_f[x->chunk]++, "chunk %lld: forward of mb %lld out of order", (long long)x->chunk,
                  (long long)x->mb);
            if (++live > *peak) *peak = live;
        } else {
            bwd[x->chunk][x->mb]++;
            CHECK(fwd[x->chunk][x->mb] == 1, "chunk %lld mb %lld: backward before its forward", (long long)x->chunk,
                  (long long)x->mb);
            CHECK(x->mb == next_b[x->chunk]++, "chunk %lld: backward of mb %lld out of micro-batch order",
                  (long long)x->chunk, (long long)x->mb);
            live--;
        }
    }
    for (int64_t v = 0; v < vpp; v++)
        for (int64_t mb = 0; mb < m; mb++) {
            const int64_t k = v * pp + s->rank;
            CHECK(fwd[k][mb] == 1 && bwd[k][mb] == 1, "rank %lld chunk %lld mb %lld: %d forwards, %d backwards",
                  (long long)s->rank, (long long)k, (long long)mb, fwd[k][mb], bwd[k][mb]);
        }
}

/* All ranks: an action runs when its rank reaches it and its input has been sent (receives block, sends are
 * buffered); unit cost per action, so its start is max(rank free, input sent). Returns false on a deadlock;
 * *makespan and idle[r] (time rank r waits inside [0, makespan]). */
static bool simulate(const ds4_pp_schedule *s, int64_t pp, int64_t *makespan, int64_t *idle) {
    int64_t done_f[MAXC][MAXM], done_b[MAXC][MAXM], pos[MAXC] = {0}, free_at[MAXC] = {0};
    for (int c = 0; c < MAXC; c++)
        for (int k = 0; k < MAXM; k++) done_f[c][k] = done_b[c][k] = -1;
    const int64_t n = s[0].n;
    bool progress = true;
    while (progress) {
        progress = false;
        for (int64_t r = 0; r < pp; r++) {
            while (pos[r] < n) {
                const ds4_pp_action *x = &s[r].a[pos[r]];
                int64_t ready = 0;
                if (x->from_chunk >= 0) {
                    ready = x->op == DS4_PP_FORWARD ? done_f[x->from_chunk][x->mb] : done_b[x->from_chunk][x->mb];
                    if (ready < 0) break; /* the receive blocks */
                    /* the sender's chunk really is where the action says */
                    CHECK(x->from_rank == x->from_chunk % pp);
                } else if (x->op == DS4_PP_BACKWARD)
                    CHECK(done_f[x->chunk][x->mb] >= 0, "the last chunk's backward before its forward");
                const int64_t start = ready > free_at[r] ? ready : free_at[r];
                free_at[r] = start + 1;
                (x->op == DS4_PP_FORWARD ? done_f : done_b)[x->chunk][x->mb] = start + 1;
                pos[r]++;
                progress = true;
            }
        }
    }
    *makespan = 0;
    for (int64_t r = 0; r < pp; r++) {
        if (pos[r] < n) return false;
        if (free_at[r] > *makespan) *makespan = free_at[r];
    }
    for (int64_t r = 0; r < pp; r++) idle[r] = *makespan - n;
    return true;
}

static void check(int64_t pp, int64_t vpp, int64_t m) {
    ds4_pp_schedule s[MAXC];
    for (int64_t r = 0; r < pp; r++) {
        CHECK(ds4_pp_schedule_make(pp, vpp, m, r, &s[r]) == DS4_OK, "pp %lld vpp %lld m %lld: %s", (long long)pp,
              (long long)vpp, (long long)m, ds4_errmsg());
        int64_t peak;
        check_list(&s[r], &peak);
        /* the theory: 1F1B keeps pp - rank micro-batches (fewer when m is smaller); interleaved its warm-up
         * (pp - rank - 1) * 2 + (vpp - 1) * pp plus the one in steady state, all when m = pp */
        const int64_t total = vpp * m;
        int64_t want = vpp == 1 ? (pp - r < m ? pp - r : m)
                                : (m == pp ? total : (pp - r - 1) * 2 + (vpp - 1) * pp + 1);
        if (want > total) want = total;
        CHECK(peak == want, "pp %lld vpp %lld m %lld rank %lld: %lld in flight, want %lld", (long long)pp,
              (long long)vpp, (long long)m, (long long)r, (long long)peak, (long long)want);
    }
    int64_t makespan, idle[MAXC];
    const bool ok = simulate(s, pp, &makespan, idle);
    CHECK(ok, "pp %lld vpp %lld m %lld: the ranks deadlock", (long long)pp, (long long)vpp, (long long)m);
    /* every rank's bubble: 1F1B (p - 1) / (m + p - 1); interleaved, each chunk a unit,
     * (p - 1) / (v·m + p - 1) */
    for (int64_t r = 0; ok && r < pp; r++)
        CHECK(idle[r] * (vpp * m + pp - 1) == (pp - 1) * makespan,
              "pp %lld vpp %lld m %lld rank %lld: bubble %lld / %lld, theory %lld / %lld", (long long)pp,
              (long long)vpp, (long long)m, (long long)r, (long long)idle[r], (long long)makespan, (long long)(pp - 1),
              (long long)(vpp * m + pp - 1));
    for (int64_t r = 0; r < pp; r++) ds4_pp_schedule_free(&s[r]);
}

static void test_1f1b(void) {
    for (int64_t pp = 1; pp <= 8; pp++)
        for (int64_t m = 1; m <= 12; m++) check(pp, 1, m);
}

static void test_interleaved(void) {
    for (int64_t pp = 1; pp <= 4; pp++)
        for (int64_t vpp = 2; vpp <= 4; vpp++)
            for (int64_t m = pp; m <= 4 * pp; m += pp) check(pp, vpp, m);
}

/* The 1F1B list of pp 4, m 6, rank 1: warm-up 2 forwards, then F B in turn, then the cool-down. */
static void test_1f1b_order(void) {
    ds4_pp_schedule s;
    CHECK(ds4_pp_schedule_make(4, 1, 6, 1, &s) == DS4_OK, "%s", ds4_errmsg());
    char got[128] = "";
    size_t n = 0;
    for (int64_t i = 0; i < s.n; i++)
        n += (size_t)snprintf(got + n, sizeof got - n, "%c%lld ", s.a[i].op == DS4_PP_FORWARD ? 'F' : 'B',
                              (long long)s.a[i].mb);
    CHECK(!strcmp(got, "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5 "), "%s", got);
    CHECK(s.warmup == 2);
    ds4_pp_schedule_free(&s);
    /* interleaved pp 2, vpp 2, m 4, rank 0: warm-up (2 - 0 - 1)·2 + 2 = 4 */
    CHECK(ds4_pp_schedule_make(2, 2, 4, 0, &s) == DS4_OK, "%s", ds4_errmsg());
    n = 0;
    got[0] = 0;
    for (int64_t i = 0; i < s.n; i++)
        n += (size_t)snprintf(got + n, sizeof got - n, "%c%lld.%lld ", s.a[i].op == DS4_PP_FORWARD ? 'F' : 'B',
                              (long long)s.a[i].chunk, (long long)s.a[i].mb);
    CHECK(!strcmp(got, "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3 "), "%s",
          got);
    ds4_pp_schedule_free(&s);
}

/* The executor's release points (ds4_pp_send_release): every rank run with timed actions (forward cf, backward
 * cb), receives blocking (B of chunk 0 also on the last chunk's MTP rows), and each action waiting, before it
 * starts, until the receivers of the sends released there have started. Returns the makespan, -1 on a
 * deadlock; waits false: the same run without them. */
static int64_t run_released(const ds4_pp_schedule *s, int64_t *const *rel, bool mtp, int64_t cf, int64_t cb,
                            bool waits) {
    const int64_t pp = s[0].pp, nc = pp * s[0].vpp, n = s[0].n;
    int64_t start[2][MAXC][MAXM], pos[MAXC] = {0}, free_at[MAXC] = {0}, end = 0;
    for (int o = 0; o < 2; o++)
        for (int c = 0; c < MAXC; c++)
            for (int k = 0; k < MAXM; k++) start[o][c][k] = -1;
#define END_OF(o, k, mb) (start[o][k][mb] < 0 ? -1 : start[o][k][mb] + ((o) ? cb : cf))
    for (bool progress = true; progress;) {
        progress = false;
        for (int64_t r = 0; r < pp; r++)
            for (bool go = true; go && pos[r] < n;) {
                const ds4_pp_action *x = &s[r].a[pos[r]];
                const int o = x->op == DS4_PP_BACKWARD;
                int64_t t = free_at[r], need[3] = {0, 0, 0};
                if (x->from_chunk >= 0) need[0] = END_OF(o, x->from_chunk, x->mb);
                if (o && x->chunk == 0 && nc > 1 && mtp) need[1] = END_OF(1, nc - 1, x->mb);
                for (int64_t j = 0; waits && j < pos[r]; j++) { /* the sends released before this action */
                    const ds4_pp_action *y = &s[r].a[j];
                    if (rel[r][j] != pos[r]) continue;
                    int64_t got = y->chunk > 0 ? start[1][y->chunk - 1][y->mb] : 0;
                    if (got >= 0 && y->chunk == nc - 1 && nc > 1 && mtp && start[1][0][y->mb] < 0) got = -1;
                    if (got < 0) need[2] = -1;
                    else if (got >= need[2] && need[2] >= 0) need[2] = got;
                }
                for (int i = 0; i < 3; i++) {
                    if (need[i] < 0) go = false;
                    else if (need[i] > t) t = need[i];
                }
                if (!go) break;
                start[o][x->chunk][x->mb] = t;
                free_at[r] = t + (o ? cb : cf);
                if (free_at[r] > end) end = free_at[r];
                pos[r]++;
                progress = true;
            }
    }
#undef END_OF
    for (int64_t r = 0; r < pp; r++)
        if (pos[r] < n) return -1;
    return end;
}

/* For every schedule: a backward's sends are released at a later action or at the end (n), nothing else is;
 * the waits deadlock no run whatever the actions cost, and with forward 1, backward 2 (the costs the points
 * come from) they delay nothing. */
static void check_release(int64_t pp, int64_t vpp, int64_t m, bool mtp) {
    ds4_pp_schedule s[MAXC];
    int64_t *rel[MAXC];
    const int64_t nc = pp * vpp;
    for (int64_t r = 0; r < pp; r++) {
        CHECK(ds4_pp_schedule_make(pp, vpp, m, r, &s[r]) == DS4_OK, "%s", ds4_errmsg());
        rel[r] = malloc((size_t)s[r].n * sizeof *rel[r]);
        CHECK(rel[r] && ds4_pp_send_release(&s[r], mtp, rel[r]) == DS4_OK, "%s", ds4_errmsg());
        for (int64_t i = 0; i < s[r].n; i++) {
            const ds4_pp_action *x = &s[r].a[i];
            const bool sends = x->op == DS4_PP_BACKWARD && (x->chunk > 0 || (nc > 1 && mtp && x->chunk == nc - 1));
            CHECK(sends ? rel[r][i] > i && rel[r][i] <= s[r].n : rel[r][i] == -1,
                  "pp %lld vpp %lld m %lld rank %lld action %lld: released at %lld", (long long)pp, (long long)vpp,
                  (long long)m, (long long)r, (long long)i, (long long)rel[r][i]);
        }
    }
    static const int64_t costs[][2] = {{1, 2}, {1, 1}, {3, 1}, {1, 5}};
    for (size_t c = 0; c < sizeof costs / sizeof costs[0]; c++) {
        const int64_t with = run_released(s, rel, mtp, costs[c][0], costs[c][1], true);
        CHECK(with >= 0, "pp %lld vpp %lld m %lld mtp %d, costs %lld/%lld: the release waits deadlock", (long long)pp,
              (long long)vpp, (long long)m, mtp, (long long)costs[c][0], (long long)costs[c][1]);
        if (c == 0)
            CHECK(with == run_released(s, rel, mtp, 1, 2, false), "pp %lld vpp %lld m %lld: the waits delay the run",
                  (long long)pp, (long long)vpp, (long long)m);
    }
    for (int64_t r = 0; r < pp; r++) {
        ds4_pp_schedule_free(&s[r]);
        free(rel[r]);
    }
}

static void test_send_release(void) {
    for (int mtp = 0; mtp < 2; mtp++) {
        for (int64_t pp = 1; pp <= 8; pp++)
            for (int64_t m = 1; m <= 12; m++) check_release(pp, 1, m, mtp);
        for (int64_t pp = 1; pp <= 4; pp++)
            for (int64_t vpp = 2; vpp <= 4; vpp++)
                for (int64_t m = pp; m <= 4 * pp; m += pp) check_release(pp, vpp, m, mtp);
    }
}

static void test_refusals(void) {
    static const struct {
        int64_t pp, vpp, m, rank;
        const char *want;
    } bad[] = {
        {2, 2, 3, 0, "3 micro-batches are not a multiple of pp"},
        {4, 2, 6, 1, "6 micro-batches are not a multiple of pp"},
        {2, 1, 2, 2, "rank 2 is outside the 2 pipeline ranks"},
        {2, 1, 2, -1, "rank -1 is outside"},
        {0, 1, 2, 0, "each must be >= 1"},
        {2, 1, 0, 0, "each must be >= 1"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ds4_pp_schedule s;
        const ds4_status st = ds4_pp_schedule_make(bad[i].pp, bad[i].vpp, bad[i].m, bad[i].rank, &s);
        CHECK(st != DS4_OK && strstr(ds4_errmsg(), bad[i].want) && !s.a, "case %zu: %s", i,
              st == DS4_OK ? "accepted" : ds4_errmsg());
        ds4_pp_schedule_free(&s);
    }
    /* 1F1B takes any m, fewer micro-batches than stages too */
    ds4_pp_schedule s;
    CHECK(ds4_pp_schedule_make(4, 1, 3, 0, &s) == DS4_OK && s.warmup == 3, "%s", ds4_errmsg());
    ds4_pp_schedule_free(&s);
}

int main(void) {
    RUN(test_1f1b);
    RUN(test_interleaved);
    RUN(test_1f1b_order);
    RUN(test_send_release);
    RUN(test_refusals);
    TEST_MAIN_END("test_pp_schedule");
}
