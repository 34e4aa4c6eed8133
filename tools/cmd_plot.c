/* ds4 plot --metrics FILE.jsonl [--metrics FILE2.jsonl ...] --out FILE.svg|FILE.png [--y KEY ...] */
#include "cli.h"
#include "cmds.h"
#include "ds4/plot.h"

#include <stdio.h>
#include <string.h>

static void plot_usage(void) {
    fprintf(stderr,
            "usage: ds4 plot --metrics FILE.jsonl [--metrics FILE2.jsonl ...] --out FILE.svg [--y KEY ...]\n"
            "  --metrics FILE.jsonl   metrics written by ds4 train ([metrics] jsonl); repeat to overlay runs\n"
            "  --out FILE.svg|.png    chart to write (PNG needs rsvg-convert or ImageMagick)\n"
            "  --y KEY[,KEY...]       one panel per key (default: loss, memory_gib); keys:\n"
            "                        ");
    for (int k = 0; k < DS4_PLOT_NKEYS; k++) fprintf(stderr, " %s", ds4_plot_key_name(k));
    fprintf(stderr, "\n");
}

/* Appends the comma-separated keys of s to keys[]. */
static bool add_keys(const char *s, int *keys, int *nkeys) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int k = ds4_plot_key_find(tok);
        if (k < 0) {
            fprintf(stderr, "error: ds4 plot: unknown key '%s' for --y; known keys:", tok);
            for (int j = 0; j < DS4_PLOT_NKEYS; j++) fprintf(stderr, " %s", ds4_plot_key_name(j));
            fprintf(stderr, "\n");
            return false;
        }
        if (*nkeys == DS4_PLOT_NKEYS) {
            fprintf(stderr, "error: ds4 plot: at most %d panels\n", DS4_PLOT_NKEYS);
            return false;
        }
        keys[(*nkeys)++] = k;
    }
    return true;
}

int cmd_plot(int argc, char **argv) {
    if (cli_want_help(argc, argv)) {
        plot_usage();
        return 0;
    }
    const char *files[DS4_PLOT_MAX_RUNS], *out = NULL;
    int nfiles = 0, keys[DS4_PLOT_NKEYS], nkeys = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool takes = !strcmp(a, "--metrics") || !strcmp(a, "--out") || !strcmp(a, "--y");
        if (!takes) {
            fprintf(stderr, "error: ds4 plot: unknown argument '%s' (see ds4 plot --help)\n", a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "error: ds4 plot: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--out")) {
            out = v;
        } else if (!strcmp(a, "--y")) {
            if (!add_keys(v, keys, &nkeys)) return 2;
        } else if (nfiles == DS4_PLOT_MAX_RUNS) {
            fprintf(stderr, "error: ds4 plot: at most %d --metrics files\n", DS4_PLOT_MAX_RUNS);
            return 2;
        } else {
            files[nfiles++] = v;
        }
    }
    if (nfiles == 0 || !out) {
        fprintf(stderr, "error: ds4 plot: %s is required (see ds4 plot --help)\n",
                nfiles == 0 ? "--metrics FILE.jsonl" : "--out FILE.svg");
        return 2;
    }
    if (nkeys == 0) add_keys("loss,memory_gib", keys, &nkeys);
    ds4_metrics runs[DS4_PLOT_MAX_RUNS];
    memset(runs, 0, sizeof runs);
    ds4_status st = DS4_OK;
    for (int r = 0; r < nfiles && st == DS4_OK; r++) {
        st = ds4_metrics_load(files[r], &runs[r]);
        if (st == DS4_OK && runs[r].n == 0) fprintf(stderr, "warning: %s has no metrics rows\n", files[r]);
    }
    if (st == DS4_OK) st = ds4_plot_write(out, runs, nfiles, keys, nkeys);
    for (int r = 0; r < nfiles; r++) ds4_metrics_free(&runs[r]);
    if (st != DS4_OK) return cli_fail();
    printf("wrote %s (%d panel%s, %d run%s)\n", out, nkeys, nkeys == 1 ? "" : "s", nfiles, nfiles == 1 ? "" : "s");
    return 0;
}
