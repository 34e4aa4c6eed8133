#!/usr/bin/python3
"""Writes a random model directory for a config (docs/contract.md init rules):

    python3 ref/make_model.py --config CFG.json --seed N --out DIR [--bf16]

DIR/config.json (the config as given) and DIR/model.safetensors with the official tensor names.
Linear/expert/gate/hc_*_fn weights N(0, 0.02); RMSNorm weights 1; hc_*_base 0; hc_*_scale 1;
attn_sink 0; ape 0; router bias 0; tid2eid: num_experts_per_tok distinct ids per token row.
The values come from torch's generator, not ds4's RNG: this is for testing the reference alone.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ds4_ref  # noqa: E402
import safetensors_io  # noqa: E402


def init_params(cfg, seed):
    """{name: tensor} for every parameter of `cfg`, drawn from a torch generator seeded with `seed`."""
    g = torch.Generator().manual_seed(seed)
    P = {}
    for name, shape, kind in ds4_ref.param_specs(cfg):
        if kind == "normal":
            P[name] = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
        elif kind in ("norm", "one"):
            P[name] = torch.ones(shape, dtype=torch.float32)
        elif kind == "zero":
            P[name] = torch.zeros(shape, dtype=torch.float32)
        elif kind == "tid2eid":
            V, K = shape
            P[name] = torch.rand(V, cfg.n_experts, generator=g).argsort(dim=-1)[:, :K].to(torch.int64)
        else:
            raise AssertionError(kind)
    return P


def main(argv=None):
    ap = argparse.ArgumentParser(description="random ds4 model directory")
    ap.add_argument("--config", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", action="store_true", help="store float tensors as BF16")
    a = ap.parse_args(argv)
    try:
        with open(a.config) as f:
            raw = json.load(f)
        cfg = ds4_ref.Config(raw, a.config)
    except (OSError, json.JSONDecodeError, ds4_ref.RefError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    P = init_params(cfg, a.seed)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")
    dtypes = {k: "BF16" for k, v in P.items() if a.bf16 and v.is_floating_point()}
    safetensors_io.save(os.path.join(a.out, "model.safetensors"), P, dtypes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
