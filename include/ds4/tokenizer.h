/* ds4 tokenizers: text bytes <-> token ids.
 *
 * Two kinds, one interface:
 *  - "byte": ids 0..255 are the bytes, 256 = <|begin_of_text|> (BOS), 257 = <|end_of_text|> (EOS);
 *    vocab 258. Needs no file; good for tiny demos.
 *  - a Hugging Face tokenizer.json with a byte-level BPE model (GPT-2 / Llama-3 / DeepSeek-V3/V4
 *    layout): model.type "BPE" with `vocab` and `merges` ("a b" strings or ["a", "b"] pairs),
 *    `added_tokens` matched in the raw text before pre-tokenisation (leftmost, longest first),
 *    pre_tokenizer ByteLevel / Split (PCRE2 regex or literal string, all five behaviours, invert) /
 *    Digits, alone or in a Sequence, as DeepSeek's tokenizer.json uses:
 *        Sequence[Split(\p{N}{1,3}), Split(CJK runs), Split(words/punct/space), ByteLevel(no regex)].
 *    Merges apply lowest rank first, leftmost first among equal ranks; `ignore_merges` is honoured.
 *    Not supported (clear error): normalizers other than none/empty Sequence, non-byte-level
 *    models, subword prefixes/suffixes. Added-token flags lstrip/rstrip/single_word are ignored.
 *
 * BOS/EOS come from tokenizer_config.json beside tokenizer.json (bos_token / eos_token) when it is
 * there, else from well-known added-token names (<｜begin▁of▁sentence｜>, <|begin_of_text|>, <s>,
 * ... / <｜end▁of▁sentence｜>, <|end_of_text|>, <|endoftext|>, </s>, ...); -1 when none.
 *
 * Encoding is thread-safe (a tokenizer is read-only after loading); decode(encode(x)) == x for
 * any bytes x when specials are not parsed (invalid UTF-8 included). */
#ifndef DS4_TOKENIZER_H
#define DS4_TOKENIZER_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ds4_tokenizer ds4_tokenizer;

/* A growable id list (ds4_alloc'ed, DS4_MEM_OTHER). Zero-initialise, then encode appends. */
typedef struct {
    int32_t *ids;
    int64_t n, cap;
} ds4_tokens;
void ds4_tokens_free(ds4_tokens *t);
ds4_status ds4_tokens_push(ds4_tokens *t, int32_t id);

ds4_status ds4_tokenizer_byte(ds4_tokenizer **out);
/* The byte tokenizer as the Hugging Face files of a model folder: DIR/tokenizer.json (a byte-level BPE
 * without merges, ids = bytes, BOS 256 / EOS 257 special, BOS first as ds4 generate starts) and
 * DIR/tokenizer_config.json (model_max_length when > 0). */
ds4_status ds4_tokenizer_byte_write_hf(const char *dir, int64_t model_max_length);
/* `path` is a tokenizer.json, or a directory holding one. */
ds4_status ds4_tokenizer_load(const char *path, ds4_tokenizer **out);
/* From JSON text; `name` is used in messages; `config_json` is the tokenizer_config.json text or NULL. */
ds4_status ds4_tokenizer_parse(const char *json, size_t len, const char *name, const char *config_json,
                               ds4_tokenizer **out);
/* "byte" or a path (as ds4_tokenizer_load). */
ds4_status ds4_tokenizer_open(const char *spec, ds4_tokenizer **out);
void ds4_tokenizer_free(ds4_tokenizer *t); /* NULL is a no-op */

int64_t ds4_tokenizer_vocab_size(const ds4_tokenizer *t); /* largest id + 1 */
int32_t ds4_tokenizer_bos(const ds4_tokenizer *t);        /* -1 when none */
int32_t ds4_tokenizer_eos(const ds4_tokenizer *t);        /* -1 when none */
const char *ds4_tokenizer_name(const ds4_tokenizer *t);   /* "byte" or the file path */
/* Id of an added/special token by its exact text, or -1. */
int32_t ds4_tokenizer_special_id(const ds4_tokenizer *t, const char *content);

/* Appends the ids of text[0, len) to *out. With parse_special, added tokens written in the text
 * (e.g. "<|end_of_text|>") become their ids; without, they are encoded as ordinary text. */
ds4_status ds4_tokenizer_encode(const ds4_tokenizer *t, const char *text, size_t len, bool parse_special,
                                ds4_tokens *out);

/* The bytes of one token (not NUL-terminated); NULL when id has no token. */
const char *ds4_tokenizer_token(const ds4_tokenizer *t, int32_t id, size_t *len);
/* ids -> bytes; *text is ds4_alloc'ed (DS4_MEM_OTHER), NUL-terminated, *len excludes the NUL. */
ds4_status ds4_tokenizer_decode(const ds4_tokenizer *t, const int32_t *ids, int64_t n, char **text, size_t *len);

#ifdef __cplusplus
}
#endif
#endif
