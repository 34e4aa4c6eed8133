/* The MFU's peak (ds4_probe_peak) does not depend on what else runs at start-up. The probe runs in a
 * thread pinned to one core, once alone and once at the lowest priority (nice 19) while two threads spin on
 * that core (three times): there it gets a few percent of the core's wall time, and must still measure at
 * least 60% of the rate it measures alone. (A probe timed in wall time measures a few percent there, unless
 * each of its products happens to fit in one of its time slices.) */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "ds4/core.h"
#include "ds4/model.h"
#include "test.h"

static atomic_int g_spin;
static cpu_set_t g_core; /* the one core everything below runs on */

static void *spin(void *arg) {
    (void)arg;
    pthread_setaffinity_np(pthread_self(), sizeof g_core, &g_core);
    volatile double x = 1;
    while (atomic_load(&g_spin)) x = x * 1.0000001 + 1e-9;
    return NULL;
}

typedef struct {
    int nice;
    ds4_peak peak;
} probe_job;

static void *probe(void *arg) {
    probe_job *j = arg;
    pthread_setaffinity_np(pthread_self(), sizeof g_core, &g_core);
    if (j->nice) setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), j->nice); /* this thread only */
    j->peak = ds4_probe_peak(NULL);
    return NULL;
}

static ds4_peak probe_in_thread(int nice) {
    probe_job j = {.nice = nice};
    pthread_t t;
    pthread_create(&t, NULL, probe, &j);
    pthread_join(t, NULL);
    return j.peak;
}

static void test_peak_ignores_other_load(void) {
    cpu_set_t all;
    CHECK(pthread_getaffinity_np(pthread_self(), sizeof all, &all) == 0, "affinity");
    int cpu = -1;
    for (int i = 0; i < CPU_SETSIZE && cpu < 0; i++)
        if (CPU_ISSET(i, &all)) cpu = i;
    CPU_ZERO(&g_core);
    CPU_SET(cpu, &g_core);
    const ds4_peak idle = probe_in_thread(0);
    atomic_store(&g_spin, 1);
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, spin, NULL);
    ds4_peak busy = probe_in_thread(19);
    for (int r = 1; r < 3; r++) { /* three probes: each must hold */
        const ds4_peak b = probe_in_thread(19);
        if (b.core_flops < busy.core_flops) busy = b;
    }
    atomic_store(&g_spin, 0);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    CHECK(idle.core_flops > 0 && busy.core_flops >= 0.6 * idle.core_flops,
          "one core's rate: %.2f GFLOP/s (the least of three) at nice 19 beside two spinning threads, %.2f GFLOP/s alone",
          busy.core_flops / 1e9, idle.core_flops / 1e9);
    CHECK(idle.threads == ds4_get_threads() && idle.flops == idle.core_flops * idle.threads,
          "the peak is one core's rate times the run's threads (%d)", idle.threads);
    CHECK(strstr(idle.how, "GEMM probe") && strstr(idle.how, "CPU time") && strstr(idle.how, "best of"),
          "the description says how: %s", idle.how);
}

int main(void) {
    RUN(test_peak_ignores_other_load);
    TEST_MAIN_END("test_peak");
}
