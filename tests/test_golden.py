"""Golden bits: the hashes of every bitwise result of ds4, recorded in tests/data/golden.txt, compared now.

What is hashed (each case is one ds4 run; a case's hash covers, in order, the name and sha256 of each entry):
  debug/<config>/<policy>  `ds4 debug-state` on a fresh `ds4 init` model (fixed seed) and a fixed batch, for
                           the bench configs (bench/configs/recompute-1k.json, recompute-flash-shape.json; B=1,
                           T=192 so that the window and every compression ratio are reached) and
                           tests/configs/tiny-a.json (B=2, T=64: top-k selection), once per recompute / offload
                           policy; entries: every tensor of OUT.safetensors (logits, losses, gradients, indexer
                           top-k) by name, with dtype and shape.
  train/<policy>           `ds4 train` on tiny-a, 3 steps, checkpoint at step 3 (bf16*: mixed precision); entries: the numbers of the
                           metrics JSONL (losses, grad_norm, lr; not time, throughput or memory), every tensor of
                           model.safetensors and optim.state, and state.json.
  mpi/<layout>             the same under `mpirun -np 2`: FSDP, and FSDP + EP 2 (SKIP when mpirun is absent).
  memplan/<config>/<policy> the byte numbers `ds4 memplan` prints (not the planning time).

Every ds4 command runs with DS4_ISA=generic: the fp32 sums of the GEMM engines differ between levels (generic,
avx2, avx512 add in different orders), so only the portable engines give the same bits on any x86-64 CPU. The
thread count is fixed as well (2; 1 per rank under mpirun), though no result depends on it (tests/test_threads.c;
memplan's workspace bytes do). The build uses -ffp-contract=off, so the compiler fuses no multiply-adds of its own either; the
libm of the C library, expf and the like, is assumed the same. OMP_WAIT_POLICY=passive changes no bit; it keeps
waiting OpenMP threads from spinning, which on a machine shared with other work made a 1 s run take 10-30 s.

On a mismatch the failing case is named with the entries (tensor names, metrics fields, memplan lines) whose
hashes differ, are missing or are new.

Re-recording (`python3 tests/test_golden.py --build build --record`) rewrites tests/data/golden.txt from the
current code. It is legitimate ONLY for an intended change of numerics (a new kernel, a changed formula, a
changed default), made in its own commit that says so; never to make a refactoring pass.

A backend gives the cpu's bits (docs/DESIGN.md), so `--device NAME` runs the same cases on backend NAME
(`--device`, `training.device`) against the same recorded hashes: `--device cpu-guard` is the proof that
everything above the kernels reaches tensor bytes only through the backend's ops and copies (its buffers
are unreachable from the host otherwise: a stray access kills the run naming the buffer). The cases whose
layers do not go through the backend yet are listed in NOT_ON_DEVICE with the reason, and print SKIP.

Usage: python3 tests/test_golden.py [--build DIR] [--record] [--only TEXT] [--device NAME] [--keep] [-v]
  --only TEXT: just the cases whose name contains TEXT (repeatable: any of them; not with --record); --keep:
  leave the temp folder;
  -v: each case's entry count and time."""
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, failed, finish  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "data", "golden.txt")
THREADS = 2
SHORT = 8  # hex digits of each entry's hash kept in the listing (the case hash is whole)

args = sys.argv[1:]
build = args[args.index("--build") + 1] if "--build" in args else "build"
DS4 = os.path.abspath(os.path.join(ROOT, build, "ds4") if not os.path.isabs(build) else os.path.join(build, "ds4"))
RECORD = "--record" in args
KEEP = "--keep" in args
ONLY = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--only"]  # any of them


def selected(name):
    return not ONLY or any(o in name for o in ONLY)

DEVICE = args[args.index("--device") + 1] if "--device" in args else ""
# Cases not run on a device backend yet (what keeps them on the host's memory), by name fragment.
NOT_ON_DEVICE = {
    "memplan/": "a plan touches no tensor memory: the plan of a backend is its workspace, checked on the cpu",
}



def sha(b):
    return hashlib.sha256(b).hexdigest()


def env(threads):
    e = dict(os.environ)
    e.update(DS4_ISA="generic", OMP_NUM_THREADS=str(threads), OMP_DYNAMIC="false", OMP_WAIT_POLICY="passive")
    return e


def ds4(argv, threads=THREADS, timeout=120):
    """Runs build/ds4 argv; returns stdout, or raises with the tail of stderr."""
    r = subprocess.run([DS4, *argv], capture_output=True, text=True, timeout=timeout, env=env(threads), cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"ds4 {' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()[-400:]}")
    return r.stdout


from fixed_inputs import write_batch, write_shard  # noqa: E402  (fixed inputs, no randomness of Python)


# ------------------------------------------------------------------ entries: name -> sha256 hex

def safetensors_entries(path, prefix=""):
    """Every tensor of a .safetensors file in file order: name -> sha256 of dtype, shape and data."""
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    head = json.loads(raw[8:8 + n])
    base = 8 + n
    out = []
    for name, v in sorted(((k, v) for k, v in head.items() if k != "__metadata__"),
                          key=lambda kv: kv[1]["data_offsets"][0]):
        s, e = v["data_offsets"]
        desc = f"{v['dtype']} {v['shape']} ".encode()
        out.append((prefix + name, sha(desc + raw[base + s:base + e])))
    return out


METRIC_FIELDS = ("loss", "mtp_loss", "indexer_loss", "total_loss", "grad_norm", "lr")


def metrics_entries(path):
    """The numbers of each step of the metrics JSONL (as logged), not time, throughput or memory."""
    out = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            for k in METRIC_FIELDS:
                out.append((f"metrics.step{rec['step']}.{k}", sha(repr(rec[k]).encode())))
    return out


def checkpoint_entries(folder, step):
    d = os.path.join(folder, f"step-{step:08d}")
    with open(os.path.join(d, "state.json")) as f:
        state = json.dumps(json.load(f), sort_keys=True)
    return (safetensors_entries(os.path.join(d, "model.safetensors"), "model:") +
            safetensors_entries(os.path.join(d, "optim.state"), "optim:") + [("state.json", sha(state.encode()))])


def memplan_entries(stdout):
    """Each `category  bytes  GiB` line of memplan (the offload tier's prefixed 'offload.')."""
    out, prefix = [], ""
    for line in stdout.splitlines():
        if "offload tier" in line:
            prefix = "offload."
        m = re.match(r"^\s+([a-z][a-z ]*?)\s+(\d+)\s+[\d.]+$", line)
        if m:
            out.append((prefix + m.group(1).replace(" ", "_"), sha(m.group(2).encode())))
    if not out:
        raise RuntimeError("memplan printed no byte lines")
    return out


# ------------------------------------------------------------------ the cases

BENCH = ("recompute-1k", "recompute-flash-shape")
FULL = ["--recompute-granularity", "full"]
POLICIES = {  # debug-state / train flags; every config has 4 layers
    "none": [],
    "csa-attention": ["--recompute-csa-attention"],
    "mhc": ["--mhc-recompute"],
    "norm": ["--recompute-norm"],
    "full-uniform": FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "4"],
    "select-layers": FULL + ["--recompute-method", "block", "--recompute-num-layers", "1", "--recompute-norm",
                             "--recompute-norm-num-layers", "2"],
    "all": FULL + ["--recompute-method", "block", "--recompute-num-layers", "2", "--recompute-csa-attention",
                   "--mhc-recompute", "--recompute-norm", "--recompute-norm-num-layers", "3", "--swap-layer-input"],
    "swap-layer-input": ["--swap-layer-input"],
}


def debug_cases(tmp):
    models = {"tiny-a": ("tests/configs/tiny-a.json", 2, 64, 256)}
    for name in BENCH:
        models[name] = (f"bench/configs/{name}.json", 1, 192, 1024)
    for cfg, (path, b, t, vocab) in models.items():
        model, batch = os.path.join(tmp, f"model-{cfg}"), os.path.join(tmp, f"batch-{cfg}.safetensors")

        def prepare(path=path, model=model, batch=batch, b=b, t=t, vocab=vocab):
            if not os.path.isdir(model):
                ds4(["init", "--config", path, "--seed", "7", "--out", model])
                write_batch(batch, b, t, vocab, seed=5)

        for pol, flags in POLICIES.items():
            def run(prepare=prepare, model=model, batch=batch, flags=flags, key=f"{cfg}-{pol}"):
                prepare()
                out = os.path.join(tmp, f"out-{key}.safetensors")
                extra = ["--offload-dir", tmp] if "--swap-layer-input" in flags else []
                ds4(["debug-state", "--model", model, "--batch", batch, "--out", out, "--threads", str(THREADS),
                     *flags, *extra, *(["--device", DEVICE] if DEVICE else [])])
                entries = safetensors_entries(out)
                os.remove(out)
                return entries
            yield f"debug/{cfg}/{pol}", run


TOML = """[model]
config = "{root}/tests/configs/tiny-a.json"
seed = 11
[training]
steps = 3
seq_len = 64
global_batch_size = 4
micro_batch_size = 1
seed = 2
threads = {threads}
[optimizer]
lr = 3e-3
[lr_scheduler]
warmup_steps = 1
decay_steps = 3
[data]
train = "{tmp}/train.bin"
[checkpoint]
interval = 3
keep_latest_k = 1
[metrics]
peak_tflops = 1.0
"""
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
               ASAN_OPTIONS="detect_leaks=0")


def train_setup(tmp):
    if not os.path.exists(os.path.join(tmp, "train.bin")):
        write_shard(os.path.join(tmp, "train.bin"), 256, 6, 700, seed=31)
        for threads in (1, THREADS):
            with open(os.path.join(tmp, f"train-{threads}.toml"), "w") as f:
                f.write(TOML.format(root=ROOT, tmp=tmp, threads=threads))


def train_run(tmp, name, flags, mpi):
    """ds4 train (one process with THREADS threads, or mpirun -np 2 with one thread per rank)."""
    train_setup(tmp)
    threads = 1 if mpi else THREADS
    folder, jsonl = os.path.join(tmp, f"ckpt-{name}"), os.path.join(tmp, f"metrics-{name}.jsonl")
    argv = [DS4, "train", "--config", os.path.join(tmp, f"train-{threads}.toml"), "--checkpoint.folder", folder,
            "--metrics.jsonl", jsonl, *flags, *(["--training.device", DEVICE] if DEVICE else [])]
    if any(f.startswith("--swap") for f in flags):
        argv += ["--offload-dir", tmp]
    e = env(threads)
    if mpi:
        e.update(MPI_ENV)
        argv = ["timeout", "120", "mpirun", "-np", "2", "--bind-to", "none", "-x", "DS4_ISA", "-x",
                "OMP_NUM_THREADS", *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=e, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[-12:])}: exit {r.returncode}: {(r.stdout + r.stderr).strip()[-600:]}")
    entries = metrics_entries(jsonl) + checkpoint_entries(folder, 3)
    shutil.rmtree(folder)
    return entries


BF16 = ["--training.mixed_precision_param", "bfloat16"]


def train_cases(tmp):
    rec = FULL + ["--recompute-method", "block", "--recompute-num-layers", "1", "--recompute-csa-attention",
                  "--mhc-recompute", "--recompute-norm"]
    for name, flags in (("none", []), ("recompute", rec), ("swap-optimizer", ["--swap-optimizer"]),
                        ("swap-layer-input", ["--swap-layer-input"]), ("bf16", BF16),
                        ("bf16-recompute-swap", BF16 + rec + ["--swap-layer-input", "--swap-optimizer"])):
        yield f"train/{name}", lambda name=name, flags=flags: train_run(tmp, name, flags, mpi=False)
    for name, flags in (("fsdp", []), ("fsdp-ep2", ["--parallel.ep", "2"]), ("bf16-fsdp-ep2", BF16 + ["--parallel.ep", "2"])):
        run = None if shutil.which("mpirun") is None else \
            (lambda name=name, flags=flags: train_run(tmp, "mpi-" + name, flags, mpi=True))
        yield f"mpi/{name}", run


def memplan_cases():
    base = ["--threads", str(THREADS)]
    pols = {
        "none": [],
        "fine": ["--recompute-csa-attention", "--mhc-recompute", "--recompute-norm"],
        "full-uniform": FULL + ["--recompute-method", "uniform", "--recompute-num-layers", "4"],
        "full-block-norm": FULL + ["--recompute-method", "block", "--recompute-num-layers", "2", "--recompute-norm",
                                   "--recompute-norm-num-layers", "3"],
        "swap": ["--swap-optimizer", "--swap-layer-input"],
    }
    for cfg in BENCH:
        for pol, flags in pols.items():
            yield (f"memplan/{cfg}/{pol}",
                   lambda cfg=cfg, flags=flags: memplan_entries(ds4(
                       ["memplan", "--model", f"bench/configs/{cfg}.json", "--seq", "1024", "--micro-batch", "2",
                        *base, *flags, *(["--device", DEVICE] if DEVICE else [])])))
    flash = ["memplan", "--model", "configs/deepseek-v4-flash.json", "--seq", "4096", "--micro-batch", "1",
             "--world", "128", "--ep", "128", *base, *(["--device", DEVICE] if DEVICE else [])]
    flash_pols = {"none": [], "fine": pols["fine"], "full-block-norm": FULL + [
        "--recompute-method", "block", "--recompute-num-layers", "10", "--recompute-norm"], "swap": pols["swap"],
        "rank-77": ["--rank", "77", "--mhc-recompute"], "bf16": ["--mixed-precision-param", "bfloat16"],
        "bf16-fine-swap": ["--mixed-precision-param", "bfloat16", *pols["fine"], *pols["swap"]]}
    for pol, flags in flash_pols.items():
        yield f"memplan/deepseek-v4-flash/{pol}", lambda flags=flags: memplan_entries(ds4(flash + flags))


# ------------------------------------------------------------------ golden file

def case_hash(entries):
    return sha("".join(f"{n} {h}\n" for n, h in entries).encode())


def read_golden():
    cases, listings = {}, {}
    with open(GOLDEN) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split()
            if parts[0].startswith("@"):
                listings.setdefault(parts[0][1:], []).append((parts[1], parts[2]))
            else:
                cases[parts[0]] = parts[1]
    return cases, listings


def write_golden(results):
    lines = ["# Golden hashes of ds4's bitwise results: written by `python3 tests/test_golden.py --record`; read",
             "# the top of tests/test_golden.py before re-recording (only for an intended change of numerics).",
             "# <case> <sha256 of its entries>, then the entries of each distinct case hash:",
             "# @<first 16 hex of the case hash> <entry> <first 8 hex of the entry's sha256>"]
    lines += [f"{name} {case_hash(e)}" for name, e in results]
    seen = set()
    for _, e in results:
        key = case_hash(e)[:16]
        if key not in seen:
            seen.add(key)
            lines += [f"@{key} {n} {h[:SHORT]}" for n, h in e]
    os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
    with open(GOLDEN, "w") as f:
        f.write("\n".join(lines) + "\n")


def explain(name, entries, want_hash, listings):
    """Which entries of a case differ from the recorded listing."""
    old = dict(listings.get(want_hash[:16], []))
    new = {n: h[:SHORT] for n, h in entries}
    if not old:
        return "no recorded listing"
    diff = [n for n in new if n in old and new[n] != old[n]]
    gone = [n for n in old if n not in new]
    extra = [n for n in new if n not in old]
    parts = []
    for label, names in (("differ", diff), ("missing", gone), ("new", extra)):
        if names:
            parts.append(f"{len(names)} {label}: " + ", ".join(names[:8]) + (" ..." if len(names) > 8 else ""))
    return "; ".join(parts) or "the same entries, in another order"


def main():
    if not os.access(DS4, os.X_OK):
        check("ds4 binary", False, f"{DS4} not found (make first)")
        return
    if RECORD and DEVICE:
        check("--record", False, "records the cpu's bits: drop --device")
        return
    if RECORD and (ONLY or shutil.which("mpirun") is None):
        check("--record", False, "records every case: drop --only" if ONLY else "records every case: needs mpirun")
        return
    tmp = tempfile.mkdtemp(prefix="ds4-golden-")
    t0 = time.time()
    results, attempted = [], set()
    want, listings = ({}, {}) if RECORD else read_golden()
    try:
        for name, run in [*debug_cases(tmp), *train_cases(tmp), *memplan_cases()]:
            if not selected(name):
                continue
            attempted.add(name)
            why = next((w for k, w in NOT_ON_DEVICE.items() if k in name), None) if DEVICE else None
            if why:
                print(f"SKIP {name} on {DEVICE}: {why}")
                check(name, True)
                continue
            if run is None:
                print(f"SKIP {name}: mpirun not found")
                check(name, True)
                continue
            t = time.time()
            try:
                entries = run()
            except (RuntimeError, OSError, KeyError, ValueError, subprocess.TimeoutExpired) as e:
                check(name, False, str(e))
                continue
            if "-v" in args:
                print(f"{name}: {len(entries)} entries, {time.time() - t:.2f} s")
            results.append((name, entries))
            if RECORD:
                check(name, len(entries) > 0, "no entries")
                continue
            got = case_hash(entries)
            if name not in want:
                check(name, False, "not in tests/data/golden.txt")
            else:
                check(name, got == want[name], explain(name, entries, want[name], listings))
        if not RECORD:
            for name in (n for n in want if selected(n)):
                check(f"{name} still runs", name in attempted, "recorded case no longer produced")
        elif failed() == 0:
            write_golden(results)
            print(f"recorded {len(results)} cases in {os.path.relpath(GOLDEN, ROOT)}")
    finally:
        if KEEP:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"({time.time() - t0:.1f} s)")


if os.environ.get("DS4_SKIP_GOLDEN"):  # `make test-levels`: this test pins DS4_ISA=generic itself, so it ran already
    print("SKIP test_golden: DS4_SKIP_GOLDEN is set")
else:
    main()
finish("test_golden")
