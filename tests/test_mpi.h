/* The parent side of the tests that run their own binary again under mpirun (test_dist, test_ckpt_dist). */
#ifndef DS4_TEST_MPI_H
#define DS4_TEST_MPI_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "test.h"

/* Whether a run of `ranks` ranks is wanted: DS4_TEST_MAX_RANKS (unset: any) caps it, and a run above the cap
 * prints SKIP. `make asan` sets 2: under the sanitizers four oversubscribed ranks on a 2-core machine took
 * minutes, and the suite without sanitizers runs them. */
static inline bool t_mpirun_wanted(int ranks) {
    const char *cap = getenv("DS4_TEST_MAX_RANKS");
    if (!cap || !*cap || ranks <= atoi(cap)) return true;
    printf("SKIP mpirun -np %d: DS4_TEST_MAX_RANKS=%s\n", ranks, cap);
    return false;
}

/* Runs this binary as `mpirun -np ranks BINARY args` (as root, oversubscribed, one OpenMP thread per rank,
 * leak checks off: Open MPI keeps some of its own allocations to the end of the process), echoes its
 * output, CHECKs that it exited 0 and returns how many ranks printed "rank R: A ok, 0 not ok" with A ==
 * checks (checks 0: any A > 0). */
static inline int t_mpirun_self(int ranks, const char *args, int checks) {
    char self[4096];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    CHECK(k > 0);
    if (k <= 0) return 0;
    self[k] = 0;
    char cmd[16384];
    snprintf(cmd, sizeof cmd,
             "ASAN_OPTIONS=detect_leaks=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 "
             "OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1 timeout 300 mpirun -np %d --bind-to none '%s' %s "
             "2>&1",
             ranks, self, args);
    FILE *pf = popen(cmd, "r");
    CHECK(pf != NULL, "cannot run mpirun");
    if (!pf) return 0;
    char line[4096];
    int ok_ranks = 0;
    while (fgets(line, sizeof line, pf)) {
        fputs(line, stderr);
        int r, a, b;
        if (sscanf(line, "rank %d: %d ok, %d not ok", &r, &a, &b) == 3 && b == 0 && (checks ? a == checks : a > 0))
            ok_ranks++;
    }
    const int rc = pclose(pf);
    CHECK(rc == 0, "mpirun -np %d %s exited with %d", ranks, args, rc);
    return ok_ranks;
}

#endif
