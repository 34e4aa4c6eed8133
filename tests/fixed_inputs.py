"""Fixed inputs of the tests that compare bits (tests/test_golden.py, tests/test_guard_cli.py): token batches
and shards from a 64-bit hash, the same on every Python."""
import json
import struct


def mix(a, b):
    """A 64-bit hash of two integers (splitmix64 finaliser): the same on every Python."""
    z = (a * 0x9E3779B97F4A7C15 + b + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def write_batch(path, b, t, vocab, seed):
    """BATCH.safetensors: input_ids I32 [b, t], tokens in [2, vocab)."""
    ids = [2 + mix(seed, i) % (vocab - 2) for i in range(b * t)]
    data = struct.pack(f"<{len(ids)}i", *ids)
    head = json.dumps({"input_ids": {"dtype": "I32", "shape": [b, t], "data_offsets": [0, len(data)]}}).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + data)


def write_shard(path, vocab, n_docs, doc_len, seed):
    """A ds4 token shard (include/ds4/shard.h): u16 tokens, no BOS/EOS, n_docs documents of doc_len tokens."""
    docs = [[2 + mix(seed * 1000 + d, i) % (vocab - 2) for i in range(doc_len)] for d in range(n_docs)]
    n_tok = n_docs * doc_len
    out = b"DS4TOKS\0" + struct.pack("<IIIiiI", 1, vocab, 2, -1, -1, 0) + struct.pack("<QQ", n_tok, n_docs)
    out += struct.pack(f"<{n_docs + 1}Q", *[d * doc_len for d in range(n_docs + 1)])
    out += b"".join(struct.pack(f"<{doc_len}H", *d) for d in docs)
    with open(path, "wb") as f:
        f.write(out)
