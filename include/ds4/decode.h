/* Incremental decoding and sampling (docs/dsv4-architecture.md §4.8).
 *
 * A decoder feeds one token at a time at the next position and returns the main head's logits for
 * the token after it: the same numbers as the full-sequence forward (ds4_forward) at that position,
 * computed from a cache instead of the whole prefix. Per main layer the cache holds only what a new
 * position needs:
 *   - the window: the last `window` kv rows (a ring buffer, position p in slot p % window);
 *   - the compressor's pending block: the wkv / wgate rows of the current block of r tokens (and of
 *     the previous block for the overlapping ratio-4 compressor); an entry is emitted, normalised
 *     and roped at i·r, when (p + 1) % r == 0;
 *   - the compressed entries so far (main keys, and the indexer's keys on CSA layers).
 * The mHC streams are per token, so nothing else is kept. Memory is O(window + max_len / r) per
 * layer, allocated once in ds4_decoder_new (DS4_MEM_ACT); a step's one-token unit outputs come and go
 * through the activation store as in a forward-only pass.
 * MTP is not used for decoding. */
#ifndef DS4_DECODE_H
#define DS4_DECODE_H

#include "ds4/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_decoder ds4_decoder;

/* A decoder for positions [0, max_len) of model m (m must outlive it; its weights are read at
 * every step, so a decoder sees weight changes made between steps). */
ds4_status ds4_decoder_new(ds4_model *m, int64_t max_len, ds4_decoder **out);
/* Feeds `token` at the next position p and writes the logits [V] predicting position p + 1.
 * Errors: token outside the vocabulary, p == max_len. */
ds4_status ds4_decoder_step(ds4_decoder *dec, int32_t token, float *logits_out);
/* Forgets every position (the next step is position 0); keeps the allocation. */
void ds4_decoder_reset(ds4_decoder *dec);
void ds4_decoder_free(ds4_decoder *dec); /* NULL is a no-op */
int64_t ds4_decoder_pos(const ds4_decoder *dec);       /* positions fed so far */
int64_t ds4_decoder_max_len(const ds4_decoder *dec);
int64_t ds4_decoder_bytes(const ds4_decoder *dec);     /* bytes the decoder holds (cache + scratch) */

/* ------------------------------------------------------------------ sampling */
typedef struct {
    double temperature; /* <= 0: greedy (argmax, ties to the lower id) */
    double top_p;       /* nucleus: keep the most probable tokens whose mass reaches top_p; >= 1: all */
    uint64_t seed;      /* the draw of step i is ds4_rng_uniform(seed, DS4_SAMPLE_STREAM, i) */
} ds4_sample_opts;

#define DS4_SAMPLE_STREAM 0x73616d706c65ull /* "sample" */

ds4_sample_opts ds4_sample_defaults(void); /* greedy, top_p 1, seed 0 */

/* Picks the next token from logits [V] (NaN counts as −inf). `step` indexes the random draw, so
 * the same (logits, opts, step) always give the same token. Weights are exp((l − max)/T) in
 * double; for the nucleus they are sorted by weight (ties to the lower id) and the shortest prefix
 * whose share of the total reaches top_p is kept (at least one token); the token is then drawn
 * from the kept ones in proportion to their weights. Error when every logit is −inf or NaN. */
ds4_status ds4_sample(const float *logits, int64_t V, const ds4_sample_opts *o, uint64_t step, int32_t *token);

#ifdef __cplusplus
}
#endif
#endif
