/* Flag parsing shared by the subcommands. */
#include "cli.h"
#include "ds4/kernels.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool cli_parse(const char *cmd, int argc, char **argv, cli_flag *flags, int nflags, const char **pos, int max_pos,
               int *npos) {
    *npos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) {
            if (*npos >= max_pos) {
                fprintf(stderr, "error: ds4 %s: unexpected argument '%s'\n", cmd, a);
                return false;
            }
            pos[(*npos)++] = a;
            continue;
        }
        int f = -1;
        for (int k = 0; k < nflags; k++)
            if (strcmp(a + 2, flags[k].name) == 0) f = k;
        if (f < 0) {
            fprintf(stderr, "error: ds4 %s: unknown flag '%s' (see ds4 %s --help)\n", cmd, a, cmd);
            return false;
        }
        if (flags[f].is_switch) {
            flags[f].value = "1";
        } else {
            if (i + 1 >= argc) {
                fprintf(stderr, "error: ds4 %s: flag '%s' needs a value\n", cmd, a);
                return false;
            }
            flags[f].value = argv[++i];
        }
    }
    return true;
}

const char *cli_get(const cli_flag *flags, int nflags, const char *name) {
    for (int k = 0; k < nflags; k++)
        if (strcmp(flags[k].name, name) == 0) return flags[k].value;
    return NULL;
}

bool cli_int(const char *cmd, const char *flag, const char *s, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end) {
        fprintf(stderr, "error: ds4 %s: --%s expects an integer, got '%s'\n", cmd, flag, s);
        return false;
    }
    *out = v;
    return true;
}

bool cli_device(const char *cmd, const char *s, bool run, ds4_exec *ex) {
    if (!s) return true;
    if (ds4_backend_find("--device", s, &ex->backend) == DS4_OK &&
        (!run || ds4_backend_ready("--device", ex->backend) == DS4_OK))
        return true;
    fprintf(stderr, "error: ds4 %s: %s\n", cmd, ds4_errmsg());
    return false;
}

bool cli_threads(const char *cmd, const char *s) {
    int64_t n;
    if (!s) return true;
    if (!cli_int(cmd, "threads", s, &n)) return false;
    if (n < 0 || n > DS4_MAX_THREADS) {
        fprintf(stderr, "error: ds4 %s: --threads %s: expected an integer in [0, %d] (0: every core)\n", cmd, s,
                DS4_MAX_THREADS);
        return false;
    }
    ds4_set_threads((int)n);
    return true;
}

void cli_usage(const char *cmd, const char *synopsis, const cli_flag *flags, int nflags) {
    fprintf(stderr, "usage: ds4 %s %s\n", cmd, synopsis);
    for (int k = 0; k < nflags; k++)
        fprintf(stderr, "  --%-28s %s\n", flags[k].name, flags[k].help ? flags[k].help : "");
}

int cli_fail(void) {
    fprintf(stderr, "error: %s\n", ds4_errmsg());
    return 1;
}

bool cli_want_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return true;
    return false;
}
