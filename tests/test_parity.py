#!/usr/bin/python3
"""Parity of the C engine against the PyTorch reference (docs/contract.md, "Agreement").

For each test config: `BUILD/ds4 init` a random model, make a batch, run `BUILD/ds4 debug-state` and
`ref/ds4_ref.py` on the same model and batch, then check per config:
  names   the same set of tensor names on both sides
  logits  logits and mtp_logits relative error ||c-r||/||r|| <= 1e-4
  losses  loss, mtp_loss, indexer_loss, total_loss relative error <= 1e-4
  grads   every grad.* relative error <= 1e-3 (an all-zero reference gradient needs ||c|| <= 1e-8)
  topk    indexer_topk.<L> sets equal row by row
Prints the worst relative error per tensor group and `test_parity: N passed, N failed`; exit 1 on failure.
On a numeric failure the reference is also run in float64 to show which side is off.

    /usr/bin/python3 tests/test_parity.py --build BUILD [--only tiny-a] [--keep DIR] [--ref-dtype float64]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ref"))
import safetensors_io  # noqa: E402

PY = "/usr/bin/python3"
# (name, config, batch, seq): tiny-b's T=150 is neither a multiple of 4 nor of 32, so both
# compressors drop a tail, and top-k (8 of up to 37 entries) and the 32-token window both bite.
CASES = [("tiny-a", "tests/configs/tiny-a.json", 2, 64, None), ("tiny-b", "tests/configs/tiny-b.json", 2, 150, None)]
# opt-in (--only tiny-a-dense): the dense CSA stage. Not in the default run: its mtp.0.hc_head_* gradients
# are tiny sums of cancelling terms (the final RMSNorm is scale-invariant), and their float32 rounding
# alone reaches ~1e-3 relative on both sides.
EXTRA = [("tiny-a-dense", "tests/configs/tiny-a.json", 2, 64, {"csa_dense": True})]
GROUPS = ["logits", "losses", "grad.embed/head", "grad.layers.*.attn.*", "grad.*.indexer.*", "grad.*.ffn.*",
          "grad.*hc_*", "grad.mtp.*"]
TOL_OUT, TOL_GRAD, ZERO_NORM = 1e-4, 1e-3, 1e-8
CHECKS = ["names", "logits", "losses", "grads", "topk"]

passed = failed = 0


def check(cond, msg):
    global passed, failed
    if cond:
        passed += 1
        print(f"ok   {msg}")
    else:
        failed += 1
        print(f"FAIL {msg}")


def group_of(name):
    if name in ("logits", "mtp_logits"):
        return "logits"
    if name in ("loss", "mtp_loss", "indexer_loss", "total_loss"):
        return "losses"
    if name.startswith("grad.mtp."):
        return "grad.mtp.*"
    if ".indexer." in name:
        return "grad.*.indexer.*"
    if "hc_" in name:
        return "grad.*hc_*"
    if ".attn." in name or name.endswith("attn_norm.weight"):
        return "grad.layers.*.attn.*"
    if ".ffn." in name or name.endswith("ffn_norm.weight"):
        return "grad.*.ffn.*"
    return "grad.embed/head"


def rel_err(c, r):
    """||c - r|| / ||r|| in float64; for an all-zero r, ||c|| itself (reported against ZERO_NORM)."""
    c, r = c.double(), r.double()
    nr = float(r.norm())
    d = float((c - r).norm())
    return (d / nr, False) if nr > 0 else (d, True)


def run(cmd, what, timeout=600):
    """Runs a command; returns None on success or a one-line reason."""
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        return f"{what}: cannot run {cmd[0]}: {e}"
    except subprocess.TimeoutExpired:
        return f"{what}: timed out after {timeout} s"
    if p.returncode != 0:
        tail = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["(no output)"]
        return f"{what}: exit {p.returncode}: {tail[0]}"
    return None


def compare(name, c, r, ref64=None):
    """Returns (bad tensor lines, per-group worst errors) for one config."""
    bad, worst = [], {g: 0.0 for g in GROUPS}
    for k in sorted(set(c) & set(r)):
        if k.startswith("indexer_topk."):
            continue
        g = group_of(k)
        if list(c[k].shape) != list(r[k].shape):
            bad.append(f"{k}: shape {list(c[k].shape)} vs reference {list(r[k].shape)}")
            worst[g] = float("inf")
            continue
        e, zero_ref = rel_err(c[k], r[k])
        tol = ZERO_NORM if zero_ref else (TOL_GRAD if k.startswith("grad.") else TOL_OUT)
        if not zero_ref:
            worst[g] = max(worst[g], e)
        if not e <= tol:
            line = f"{k}: {'||c|| (zero reference)' if zero_ref else 'rel err'} {e:.3e} > {tol:.0e}"
            if ref64 is not None and k in ref64:
                e64c, _ = rel_err(c[k], ref64[k])
                e64r, _ = rel_err(r[k], ref64[k])
                line += f"   [vs float64 ref: c {e64c:.2e}, ref32 {e64r:.2e}]"
            bad.append(line)
    return bad, worst


def topk_rows_differ(a, b):
    """Number of (b, t) rows whose selected-id sets differ."""
    sa = torch.sort(a.long(), dim=-1).values
    sb = torch.sort(b.long(), dim=-1).values
    return int((sa != sb).any(-1).sum())


def run_case(name, cfg_rel, B, T, override, build, work, ref_dtype):
    cfg_path = os.path.join(ROOT, cfg_rel)
    with open(cfg_path) as f:
        cfg = json.load(f)
    vocab = int(cfg["vocab_size"])
    if override:
        cfg_path = os.path.join(work, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(dict(cfg, **override), f, indent=2)
    ds4 = os.path.join(build, "ds4")
    mdir = os.path.join(work, "model")
    batch, c_out = os.path.join(work, "batch.safetensors"), os.path.join(work, "c.safetensors")
    r_out, r64_out = os.path.join(work, "r.safetensors"), os.path.join(work, "r64.safetensors")
    t0 = time.time()
    err = None
    if not os.access(ds4, os.X_OK):
        err = f"{ds4} not found or not executable (build it first)"
    err = err or run([ds4, "init", "--config", cfg_path, "--seed", "1", "--out", mdir], "ds4 init")
    err = err or run([PY, "ref/make_batch.py", "--vocab", str(vocab), "--batch", str(B), "--seq", str(T),
                      "--seed", "1", "--out", batch], "make_batch")
    t1 = time.time()
    err = err or run([ds4, "debug-state", "--model", mdir, "--batch", batch, "--out", c_out], "ds4 debug-state")
    t2 = time.time()
    err = err or run([PY, "ref/ds4_ref.py", "--model", mdir, "--batch", batch, "--out", r_out,
                      "--dtype", ref_dtype], "ref/ds4_ref.py")
    t3 = time.time()
    if err:
        for chk in CHECKS:
            check(False, f"{name} {chk}: not compared — {err}")
        return
    print(f"{name}: B={B} T={T}; ds4 debug-state {t2 - t1:.1f} s, reference ({ref_dtype}) {t3 - t2:.1f} s")
    c, r = safetensors_io.load(c_out), safetensors_io.load(r_out)

    only_c, only_r = sorted(set(c) - set(r)), sorted(set(r) - set(c))
    check(not only_c and not only_r,
          f"{name} names: {len(c)} vs {len(r)} tensors; only in ds4 {only_c[:4]}, only in reference {only_r[:4]}")

    bad, worst = compare(name, c, r)
    if bad:  # rerun the reference in float64 to tell which side is off
        if ref_dtype != "float64" and not run([PY, "ref/ds4_ref.py", "--model", mdir, "--batch", batch,
                                               "--out", r64_out, "--dtype", "float64"], "ref float64"):
            bad, worst = compare(name, c, r, safetensors_io.load(r64_out))
    for g in GROUPS:
        print(f"     {name} max rel err {g:22s} {worst[g]:.3e}")
    for line in bad[:40]:
        print(f"     {name} {line}")
    if len(bad) > 40:
        print(f"     {name} ... {len(bad) - 40} more")

    def bad_in(pred):
        return [b for b in bad if pred(b.split(":")[0])]
    check(not bad_in(lambda k: k in ("logits", "mtp_logits")) and "logits" in r,
          f"{name} logits: logits, mtp_logits rel err {worst['logits']:.2e} (limit {TOL_OUT:.0e})")
    check(not bad_in(lambda k: group_of(k) == "losses"),
          f"{name} losses: rel err {worst['losses']:.2e} (limit {TOL_OUT:.0e}) "
          f"(loss {float(r['loss'][0]):.6f} ds4 {float(c['loss'][0]) if 'loss' in c else float('nan'):.6f})")
    gbad = bad_in(lambda k: k.startswith("grad."))
    gw = max(worst[g] for g in GROUPS if g.startswith("grad"))
    check(not gbad and any(k.startswith("grad.") for k in r),
          f"{name} grads: {sum(k.startswith('grad.') for k in r)} tensors, worst rel err {gw:.2e} (limit {TOL_GRAD:.0e})"
          f" ({len(gbad)} over)")

    tk = sorted(k for k in r if k.startswith("indexer_topk."))
    lines = []
    for k in tk:
        if k not in c:
            lines.append(f"{k} missing in ds4")
        elif c[k].dtype != torch.int32 or list(c[k].shape) != list(r[k].shape):
            lines.append(f"{k}: ds4 {c[k].dtype} {list(c[k].shape)} vs reference int32 {list(r[k].shape)}")
        else:
            n = topk_rows_differ(c[k], r[k])
            if n:
                lines.append(f"{k}: {n} of {r[k].shape[0] * r[k].shape[1]} rows select different sets")
    for line in lines:
        print(f"     {name} {line}")
    check(bool(tk) and not lines, f"{name} topk: {len(tk)} CSA layers, sets equal row by row")
    print(f"{name}: {time.time() - t0:.1f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default="build", help="build dir holding the ds4 binary")
    ap.add_argument("--only", default=None, help="run only this case (tiny-a, tiny-b, tiny-a-dense)")
    ap.add_argument("--keep", default=None, help="keep models and outputs under this dir")
    ap.add_argument("--ref-dtype", default="float32", choices=["float32", "float64"])
    a = ap.parse_args()
    build = a.build if os.path.isabs(a.build) else os.path.join(ROOT, a.build)
    cases = CASES if a.only is None else [c for c in CASES + EXTRA if c[0] == a.only]
    if not cases:
        print(f"error: unknown config '{a.only}'", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        base = a.keep or tmp
        for name, cfg, B, T, override in cases:
            work = os.path.join(base, name)
            os.makedirs(work, exist_ok=True)
            run_case(name, cfg, B, T, override, build, work, a.ref_dtype)
    print(f"test_parity: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
