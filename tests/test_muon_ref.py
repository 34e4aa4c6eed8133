#!/usr/bin/python3
"""ds4's Muon step (with AdamW for the rest) against an independent PyTorch implementation (ref/muon_ref.py).

`ds4 train --optimizer.name Muon` runs 3 steps on tiny-a from a `ds4 init` model, on a data shard of one
row (so every step sees the same batch, B = 1, T = 64), without clipping (max_norm 0), router bias rule off
(gamma 0), constant lr; it checkpoints every step. The gradient of step k is ds4's own at its weights of
step k-1 (`ds4 debug-state` on that checkpoint and the same row; its loss must equal the one `ds4 train`
logged for step k, so it is the gradient the step used). The reference starts from the same weights and
takes the same steps with those gradients, in float64 and in float32. Compared after step 1 and after
step 3: every weight tensor, and the optimizer state (Muon's momentum of its group, muon.momentum; both AdamW
moments of the rest, adamw.m and adamw.v, which hold nothing for the Muon group).

Tolerance, derived per tensor: ds4 and the float32 reference are two float32 evaluations of the same
formulas, so each lies within float32 rounding of the exact (float64) result; the test measures that
rounding as e32 = max|ref32 - ref64| and requires max|ds4 - ref64| <= 4 * e32 + 4 ulp(max|ref64|) (the ulp
term: both round the final weight once). The factor 4 allows a different summation order in the GEMMs
(ds4's blocked engine vs. PyTorch's BLAS) without admitting a wrong formula: a wrong coefficient, scale,
momentum or decay rule moves weights by ~lr * 0.18 = 5e-4, some 1e3 times more than e32.

    /usr/bin/python3 tests/test_muon_ref.py --build BUILD [--keep]
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "ref"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import muon_ref  # noqa: E402
import safetensors_io  # noqa: E402
from checks import check, finish  # noqa: E402

T, STEPS, LR, WD = 64, 3, 3e-3, 0.1
TOML = """[model]
dir = "{model}"
[training]
steps = {steps}
seq_len = {T}
global_batch_size = 1
micro_batch_size = 1
seed = 1
threads = 2
max_norm = 0
router_bias_gamma = 0
[optimizer]
name = "Muon"
lr = {lr}
weight_decay = {wd}
[lr_scheduler]
warmup_steps = 0
decay_type = "none"
[data]
train = "{data}"
[checkpoint]
folder = "{ckpt}"
interval = 1
keep_latest_k = 0
[metrics]
jsonl = "{jsonl}"
peak_tflops = 1.0
"""


def run(argv):
    env = dict(os.environ, DS4_ISA="generic", OMP_WAIT_POLICY="passive")
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: exit {r.returncode}: {(r.stdout + r.stderr)[-800:]}")
    return r.stdout


def write_one_row_shard(path, tokens):
    """A ds4 token shard (include/ds4/shard.h) of one document, no BOS/EOS: exactly one row of T tokens."""
    n = len(tokens)
    out = b"DS4TOKS\0" + struct.pack("<IIIiiI", 1, 256, 2, -1, -1, 0) + struct.pack("<QQ", n, 1)
    out += struct.pack("<2Q", 0, n) + struct.pack(f"<{n}H", *tokens)
    with open(path, "wb") as f:
        f.write(out)


def float_order(model_file):
    """The float tensors of a model.safetensors in table order (their order in the file): the packed layout
    that optim.state's arrays follow, each over its group's tensors (adamw.m / adamw.v: the AdamW group,
    muon.momentum: the Muon group)."""
    header, _ = safetensors_io.read_header(model_file)
    names = [k for k, v in header.items() if v["dtype"] == "F32"]
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


def unpack(flat, names, shapes):
    out, at = {}, 0
    for k in names:
        n = int(torch.tensor(shapes[k]).prod()) if shapes[k] else 1
        out[k] = flat[at:at + n].reshape(shapes[k])
        at += n
    return out


def compare(what, c, r64, r32):
    worst = None
    for k in r64:
        e32 = (r32[k].double() - r64[k]).abs().max().item()
        ec = (c[k].double() - r64[k]).abs().max().item()
        ulp = 2.0 ** -23 * r64[k].abs().max().item()
        tol = 4 * e32 + 4 * ulp
        if worst is None or ec / max(tol, 1e-30) > worst[0]:
            worst = (ec / max(tol, 1e-30), k, ec, e32, tol)
    ok = worst[0] <= 1
    check(what, ok, f"{worst[1]}: |ds4 - ref64| {worst[2]:.3g} > tol {worst[4]:.3g} (|ref32 - ref64| {worst[3]:.3g})")
    print(f"{'ok  ' if ok else 'FAIL'} {what}: worst {worst[1]} |ds4-ref64| {worst[2]:.3g}, "
          f"|ref32-ref64| {worst[3]:.3g}, tol {worst[4]:.3g}")


def main():
    args = sys.argv[1:]
    build = args[args.index("--build") + 1] if "--build" in args else "build"
    ds4 = os.path.join(ROOT, build, "ds4") if not os.path.isabs(build) else os.path.join(build, "ds4")
    tmp = tempfile.mkdtemp(prefix="ds4-muon-ref-")
    try:
        model, ckpt, jsonl = os.path.join(tmp, "init"), os.path.join(tmp, "ckpt"), os.path.join(tmp, "m.jsonl")
        run([ds4, "init", "--config", "tests/configs/tiny-a.json", "--seed", "5", "--out", model])
        g = torch.Generator().manual_seed(3)
        row = torch.randint(2, 256, (T,), generator=g).tolist()
        write_one_row_shard(os.path.join(tmp, "train.bin"), row)
        batch = os.path.join(tmp, "batch.safetensors")
        safetensors_io.save(batch, {"input_ids": torch.tensor([row], dtype=torch.int32)})
        cfg = os.path.join(tmp, "train.toml")
        with open(cfg, "w") as f:
            f.write(TOML.format(model=model, steps=STEPS, T=T, lr=LR, wd=WD, data=os.path.join(tmp, "train.bin"),
                               ckpt=ckpt, jsonl=jsonl))
        out = run([ds4, "train", "--config", cfg])
        check("ds4 train reports Muon", "optimizer: Muon" in out, out[-400:])
        losses = {}
        with open(jsonl) as f:
            for line in f:
                j = json.loads(line)
                losses[j["step"]] = j["loss"]

        w0 = safetensors_io.load(os.path.join(model, "model.safetensors"))
        names = float_order(os.path.join(model, "model.safetensors"))
        w0 = {k: w0[k] for k in names}
        shapes = {k: list(w0[k].shape) for k in names}
        muon_names = [n for n in names if muon_ref.is_muon(n, tuple(shapes[n]))]
        adamw_names = [n for n in names if n not in set(muon_names)]
        numel = {n: int(torch.tensor(shapes[n]).prod()) if shapes[n] else 1 for n in names}
        ref64 = muon_ref.Optimizer(w0, torch.float64, LR, WD)
        ref32 = muon_ref.Optimizer(w0, torch.float32, LR, WD)
        prev = model
        for k in range(1, STEPS + 1):
            gfile = os.path.join(tmp, f"grad-{k}.safetensors")
            run([ds4, "debug-state", "--model", prev, "--batch", batch, "--out", gfile, "--threads", "2"])
            dbg = safetensors_io.load(gfile)
            loss = float(dbg["loss"].reshape(-1)[0])
            check(f"step {k}: debug-state loss is the trained step's", abs(loss - losses[k]) <= 1e-6 * abs(loss),
                  f"{loss} vs {losses[k]}")
            grads = {n: dbg["grad." + n] for n in names}
            ref64.step(grads)
            ref32.step(grads)
            prev = os.path.join(ckpt, f"step-{k:08d}")
            if k not in (1, STEPS):
                continue
            c = safetensors_io.load(os.path.join(prev, "model.safetensors"))
            compare(f"step {k}: weights", {n: c[n] for n in names}, ref64.w, ref32.w)
            st = safetensors_io.load(os.path.join(prev, "optim.state"))
            check(f"step {k}: optim.state holds the Muon mark", "muon.step" in st, sorted(st))
            sizes = {a: st[a].numel() for a in ("adamw.m", "adamw.v", "muon.momentum") if a in st}
            want = {"adamw.m": sum(numel[n] for n in adamw_names), "adamw.v": sum(numel[n] for n in adamw_names),
                    "muon.momentum": sum(numel[n] for n in muon_names)}
            check(f"step {k}: each array covers its group alone", sizes == want, f"{sizes} vs {want}")
            if sizes != want:
                continue
            cm = unpack(st["adamw.m"], adamw_names, shapes)
            cm.update(unpack(st["muon.momentum"], muon_names, shapes))
            compare(f"step {k}: momentum and first moments", cm, ref64.m, ref32.m)
            adamw_only = lambda d: {n: d[n] for n in adamw_names}  # noqa: E731
            compare(f"step {k}: second moments", unpack(st["adamw.v"], adamw_names, shapes), adamw_only(ref64.v),
                    adamw_only(ref32.v))
    finally:
        if "--keep" in args:
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    finish("test_muon_ref")


if __name__ == "__main__":
    main()
