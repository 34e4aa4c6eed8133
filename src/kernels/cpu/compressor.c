/* Compressor pooling kernels (§4.4): per-channel softmax pooling of r (or, with overlap,
 * 2r) token slots into one compressed entry. The code is in compressor.inc, compiled here in float
 * (cpu_<op>, cpu.h) and in double (`_f64` twins, kernels_f64.h). */
#include <math.h>
#include <stdbool.h>

#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

enum { CP_CB = 16 }; /* channels per work item */

/* Slot s of entry i: its token inside the sequence, its place u in its block, and the column offset
 * of its channels. With overlap, slots [0, r) are the previous block (columns [0, d); none for
 * i = 0) and slots [r, 2r) the current block (columns [d, 2d)); otherwise slots [0, r) are the
 * current block (columns [0, d)). Returns false for an absent slot (weight 0). */
static inline bool cp_slot(int64_t s, int64_t i, int64_t r, int64_t d, bool overlap, int64_t *tok, int64_t *u,
                           int64_t *off) {
    if (!overlap) {
        *tok = i * r + s, *u = s, *off = 0;
        return true;
    }
    if (s < r) {
        if (i == 0) return false;
        *tok = (i - 1) * r + s, *u = s, *off = 0;
        return true;
    }
    *tok = i * r + (s - r), *u = s - r, *off = d;
    return true;
}

/* Elementwise loops (no reductions): vectorised without changing any result bit. */
#define CP_SIMD _Pragma("omp simd")

#define KERNEL_TEMPLATE "compressor.inc"
#include "twin.h"
