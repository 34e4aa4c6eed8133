/* ds4 token shards: tokenized documents, ready to be packed into training rows.
 *
 * File layout (little-endian):
 *   offset  size  field
 *        0     8  magic "DS4TOKS\0"
 *        8     4  u32 version (1)
 *       12     4  u32 vocab_size
 *       16     4  u32 token_bytes: 2 (u16 tokens) when vocab_size <= 65536, else 4 (u32)
 *       20     4  i32 bos_id (-1: none)  the tokenizer's BOS / EOS, so a loader needs no tokenizer
 *       24     4  i32 eos_id (-1: none)
 *       28     4  u32 reserved, 0
 *       32     8  u64 n_tokens
 *       40     8  u64 n_docs
 *       48  8(n_docs+1)  u64 doc_offsets: document i is tokens [off[i], off[i+1]); off[0] = 0,
 *                        off[n_docs] = n_tokens, non-decreasing
 *        .  token_bytes * n_tokens  tokens, each < vocab_size
 * Documents carry no BOS/EOS; the loader adds them when it packs rows.
 * The file size is exactly the sum of the parts: anything else is truncation or trailing junk. */
#ifndef DS4_SHARD_H
#define DS4_SHARD_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DS4_SHARD_MAGIC "DS4TOKS"  /* 8 bytes with its NUL */
#define DS4_SHARD_VERSION 1u
#define DS4_SHARD_HEADER_BYTES 48

/* An open (mmap'ed, validated) shard. */
typedef struct {
    char *path;
    int64_t vocab_size;
    int64_t token_bytes;          /* 2 or 4 */
    int32_t bos_id, eos_id;       /* -1: none */
    int64_t n_tokens, n_docs;
    const uint64_t *doc_offsets;  /* [n_docs + 1] */
    const void *tokens;           /* [n_tokens] of u16 or u32 */
    void *map;
    size_t map_bytes;
} ds4_shard;

/* Opens and checks everything: magic, version, vocab (== expect_vocab unless that is 0), token
 * width, sizes (truncation / trailing bytes), offsets (range, monotonic), every token < vocab.
 * Errors are one line naming the file. */
ds4_status ds4_shard_open(const char *path, int64_t expect_vocab, ds4_shard *out);
void ds4_shard_close(ds4_shard *s);

/* The same checks on bytes in memory; fills *out with pointers into `data` (path = NULL). */
ds4_status ds4_shard_check(const void *data, size_t len, const char *name, int64_t expect_vocab, ds4_shard *out);

static inline uint32_t ds4_shard_token(const ds4_shard *s, int64_t i) {
    return s->token_bytes == 2 ? ((const uint16_t *)s->tokens)[i] : ((const uint32_t *)s->tokens)[i];
}
/* tokens [begin, begin + n) -> out[n] */
void ds4_shard_read(const ds4_shard *s, int64_t begin, int64_t n, int32_t *out);

/* Writer: documents are collected in memory, then close() writes the file atomically (temp file in
 * the same directory, fsync, rename, fsync the directory). */
typedef struct ds4_shard_writer ds4_shard_writer;
ds4_status ds4_shard_writer_open(const char *path, int64_t vocab_size, int32_t bos_id, int32_t eos_id,
                                 ds4_shard_writer **out);
ds4_status ds4_shard_writer_add(ds4_shard_writer *w, const int32_t *tokens, int64_t n); /* one document */
int64_t ds4_shard_writer_tokens(const ds4_shard_writer *w);
int64_t ds4_shard_writer_docs(const ds4_shard_writer *w);
ds4_status ds4_shard_writer_close(ds4_shard_writer *w);  /* writes, then frees w (also on error) */
void ds4_shard_writer_abort(ds4_shard_writer *w);        /* frees w, writes nothing; NULL is a no-op */

#ifdef __cplusplus
}
#endif
#endif
