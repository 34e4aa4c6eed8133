/* ds4 data loader: token shards -> batches of training rows.
 *
 * Packing. The shards (in the order given; a glob or directory expands sorted) form one stream:
 * every document becomes  [BOS] tokens [EOS]  (BOS only when the tokenizer has one; EOS therefore
 * separates documents), documents back to back. The stream is cut into rows of exactly T = seq_len
 * tokens with no overlap; a tail shorter than T is dropped. The model is trained to predict token
 * t+1 from token t inside a row (docs/contract.md: there is no label tensor), so a row of T tokens
 * gives T-1 targets and consecutive rows need not overlap (the one pair that straddles two rows is
 * simply not a target). Rows cross document boundaries; attention is not masked at them.
 *
 * Order. With shuffle, each epoch visits every row once in an order that is a pure function of
 * (seed, epoch): a Fisher-Yates permutation drawn from ds4's counter RNG. Without, rows go in
 * stream order. Data parallelism: each batch call consumes B * dp_size rows of that order and rank r
 * takes rows [r*B, (r+1)*B) of them, so the ranks together see exactly what one rank with batch
 * B * dp_size would.
 *
 * Resume. The position is a small state (epoch, row within the epoch, plus the seed and row count
 * it belongs to). Save it with the checkpoint; a new loader over the same shards restored to it
 * continues with bitwise the same batches.
 *
 * Validation. split = TRAIN / VAL holds out the last val_fraction of the rows (in stream order) as
 * validation; or open a second loader (split ALL) over separate validation shards. */
#ifndef DS4_DATA_H
#define DS4_DATA_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { DS4_SPLIT_ALL = 0, DS4_SPLIT_TRAIN, DS4_SPLIT_VAL } ds4_data_split;

#define DS4_DATA_FROM_SHARDS (-2) /* bos_id / eos_id: take the ids recorded in the shards */

typedef struct {
    int64_t seq_len;         /* T: tokens per row (required) */
    int64_t batch_size;      /* B: rows per batch on this rank (default 1) */
    uint64_t seed;           /* shuffle seed (default 0) */
    bool shuffle;            /* default true */
    int64_t max_vocab;       /* > 0: the shards' vocab must not exceed it (the model's vocab_size) */
    int32_t bos_id, eos_id;  /* DS4_DATA_FROM_SHARDS (default), an id, or -1 for none */
    ds4_data_split split;    /* default ALL */
    double val_fraction;     /* TRAIN / VAL: the last val_fraction of the rows is validation */
    int dp_rank, dp_size;    /* default 0 / 1 */
} ds4_data_opts;

ds4_data_opts ds4_data_defaults(void);

typedef struct {
    uint64_t epoch;          /* epochs completed */
    uint64_t position;       /* next row of this epoch's order */
    uint64_t seed;           /* the loader's seed and row count: restore checks they match */
    uint64_t n_rows;
} ds4_data_state;

typedef struct ds4_dataloader ds4_dataloader;

/* Each pattern is a shard file, a directory (all its *.bin, sorted) or a glob (sorted). All shards
 * must agree on vocab and BOS/EOS; every error names the shard or pattern. */
ds4_status ds4_data_open(const char *const *patterns, int64_t n_patterns, const ds4_data_opts *opts, ds4_dataloader **out);
void ds4_data_close(ds4_dataloader *d); /* NULL is a no-op */

/* The next batch of this rank: out[B, T], int32. Wraps into the next epoch as needed. */
ds4_status ds4_data_next(ds4_dataloader *d, int32_t *out);
/* Row i (0 <= i < n_rows) of this split in stream order: out[T]. */
ds4_status ds4_data_row(const ds4_dataloader *d, int64_t i, int32_t *out);

void ds4_data_get_state(const ds4_dataloader *d, ds4_data_state *st);
ds4_status ds4_data_set_state(ds4_dataloader *d, const ds4_data_state *st);

int64_t ds4_data_n_rows(const ds4_dataloader *d);        /* rows in this split */
int64_t ds4_data_n_shards(const ds4_dataloader *d);
int64_t ds4_data_stream_tokens(const ds4_dataloader *d); /* all shards, BOS/EOS included */
int64_t ds4_data_vocab_size(const ds4_dataloader *d);
int32_t ds4_data_bos(const ds4_dataloader *d);
int32_t ds4_data_eos(const ds4_dataloader *d);

#ifdef __cplusplus
}
#endif
#endif
