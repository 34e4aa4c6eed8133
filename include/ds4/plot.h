/* Training curves: the JSONL metrics written by `ds4 train` (one object per line, src/train/trainer.c)
 * read into per-key series, and line charts of them as a self-contained SVG (one panel per key,
 * x = step). PNG output goes through an SVG converter when the machine has one.
 *
 * Reading: blank lines are skipped; every other line must be a JSON object with a numeric "step".
 * A metric that is absent, null, NaN or infinite (the trainer prints C's "nan"/"inf", which are read
 * as null) becomes a gap in its line. Rows are sorted by step and a step logged twice (a resumed run
 * appends to the same file) keeps its last line. */
#ifndef DS4_PLOT_H
#define DS4_PLOT_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The plottable keys, in log_step order (step is the x axis, not a key). */
#define DS4_PLOT_NKEYS 13
const char *ds4_plot_key_name(int key);  /* "loss", ..., "step_time" */
const char *ds4_plot_key_title(int key); /* panel title, e.g. "peak memory (GiB)" */
int ds4_plot_key_find(const char *name); /* -1 if unknown */

/* One metrics file. */
typedef struct {
    char path[1024];              /* as given: the legend label */
    int64_t n;                    /* rows, ascending distinct steps */
    double *step;                 /* [n] */
    double *val[DS4_PLOT_NKEYS];  /* [n] each; NaN where the row has no finite value */
} ds4_metrics;

/* Errors: unreadable file; "FILE:LINE: ..." for a line that is not a JSON object, has no numeric
 * step, or holds a non-number for a known key. */
ds4_status ds4_metrics_load(const char *path, ds4_metrics *out);
void ds4_metrics_free(ds4_metrics *m); /* zeroes *m; safe on a zeroed struct */
/* Rows of m with a finite value for key. */
int64_t ds4_metrics_count(const ds4_metrics *m, int key);

/* Layout in pixels, fixed so a test can compute coordinates by hand. Panels stack vertically under
 * a legend band (only with several runs: LEGEND_PAD + LEGEND_ROW per run). Within a panel whose top
 * is at y = top, the plot area is x in [PLOT_L, WIDTH - PLOT_R], y in [top + PLOT_T, top + PANEL_H -
 * PLOT_B]; a value v on an axis [lo, hi] maps linearly, hi at the top. Axes span whole multiples of
 * a 1-2-5 tick step covering the data (a constant series gets ±10% of its value, or ±1 at 0). */
#define DS4_PLOT_WIDTH 720
#define DS4_PLOT_PANEL_H 300
#define DS4_PLOT_L 80
#define DS4_PLOT_R 40
#define DS4_PLOT_T 40
#define DS4_PLOT_B 60
#define DS4_PLOT_LEGEND_PAD 12
#define DS4_PLOT_LEGEND_ROW 18
#define DS4_PLOT_MAX_RUNS 16

/* The SVG text of nkeys panels (keys[] from ds4_plot_key_find) over nruns files; each maximal run
 * of finite points is one <polyline> (a lone point a <circle>), clipped to the plot area. *svg is
 * NUL-terminated, allocated with ds4_alloc (free with ds4_free); *len excludes the NUL. */
ds4_status ds4_plot_svg(const ds4_metrics *runs, int nruns, const int *keys, int nkeys, char **svg, size_t *len);
/* Writes the chart to path: ".svg" directly (atomically), ".png" through ds4_plot_png_converter(). */
ds4_status ds4_plot_write(const char *path, const ds4_metrics *runs, int nruns, const int *keys, int nkeys);
/* rsvg-convert on PATH, else /usr/bin/convert (ImageMagick); NULL when neither exists. */
const char *ds4_plot_png_converter(void);

#ifdef __cplusplus
}
#endif
#endif
