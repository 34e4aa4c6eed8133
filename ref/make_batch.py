#!/usr/bin/python3
"""Writes a random batch: `input_ids` I32 [B, T], uniform in [0, vocab).

    python3 ref/make_batch.py --vocab V --batch B --seq T --seed N --out FILE
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description="random input_ids batch")
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.vocab < 1 or a.batch < 1 or a.seq < 1:
        print("error: --vocab, --batch and --seq must be >= 1", file=sys.stderr)
        return 1
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g, dtype=torch.int64).to(torch.int32)
    safetensors_io.save(a.out, {"input_ids": ids})
    return 0


if __name__ == "__main__":
    sys.exit(main())
