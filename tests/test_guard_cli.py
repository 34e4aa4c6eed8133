"""The commands that are not golden cases, on the cpu-guard backend against the cpu: `ds4 eval` (the same
loss line), `ds4 generate` (the same text and tokens, sampled), and `ds4 train` with Muon, stopped at step 2
and resumed to step 3 (the same checkpoint bytes as the cpu's uninterrupted run), in one process and under
`mpirun -np 2` with FSDP + EP 2. cpu-guard's buffers are
unreachable from the host outside its ops and copies, so a layer that still touched tensor bytes itself
would kill its run (naming the buffer) instead of passing; a run that passes gives the cpu's bits.

Usage: python3 tests/test_guard_cli.py [--build DIR]"""
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from fixed_inputs import write_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
args = sys.argv[1:]
build = args[args.index("--build") + 1] if "--build" in args else "build"
DS4 = os.path.join(ROOT, build, "ds4") if not os.path.isabs(build) else os.path.join(build, "ds4")
ENV = dict(os.environ, DS4_ISA="generic", OMP_NUM_THREADS="2", OMP_WAIT_POLICY="passive")

TOML = """[model]
config = "{root}/tests/configs/tiny-a.json"
seed = 5
[training]
steps = 3
seq_len = 64
global_batch_size = 2
micro_batch_size = 1
seed = 2
threads = 2
[optimizer]
name = "Muon"
lr = 3e-3
[lr_scheduler]
warmup_steps = 1
decay_steps = 3
[data]
train = "{tmp}/train.bin"
[checkpoint]
interval = 2
keep_latest_k = 2
"""


MPI = ["timeout", "240", "mpirun", "-np", "2", "--bind-to", "none", "-x", "DS4_ISA", "-x", "OMP_NUM_THREADS"]
MPI_ENV = dict(ENV, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", ASAN_OPTIONS="detect_leaks=0")


def ds4(argv, device, mpi=False):
    flag = ["--training.device", device] if argv[0] == "train" else ["--device", device]
    return subprocess.run([*(MPI if mpi else []), DS4, *argv, *flag], capture_output=True, text=True,
                          errors="replace", timeout=300, env=MPI_ENV if mpi else ENV, cwd=ROOT)


def same_output(name, argv, keep):
    """argv on cpu and on cpu-guard: both succeed, and the lines `keep` picks are the same."""
    out = {}
    for dev in ("cpu", "cpu-guard"):
        r = ds4(argv, dev)
        check(f"{name} on {dev}", r.returncode == 0, (r.stdout + r.stderr)[-600:])
        out[dev] = [line for line in r.stdout.splitlines() if keep(line)]
    check(f"{name}: cpu-guard prints what cpu prints", out["cpu"] == out["cpu-guard"] and out["cpu"],
          f"cpu {out['cpu']} vs cpu-guard {out['cpu-guard']}")


def files_of(folder):
    got = {}
    for d, _, names in os.walk(folder):
        for n in names:
            if n.endswith(".safetensors") or n == "optim.state":
                with open(os.path.join(d, n), "rb") as f:
                    got[os.path.relpath(os.path.join(d, n), folder)] = f.read()
    return got


def muon_runs(tmp, mpi):
    """Muon on cpu, and on cpu-guard stopped after the step-2 checkpoint and resumed: the same checkpoint bytes.
    mpi: under `mpirun -np 2` with FSDP + EP 2 (the shards, gathered weights and Muon's whole matrices on the
    backend, their collectives host-staged)."""
    what = "FSDP + EP 2 Muon" if mpi else "Muon"
    extra = ["--parallel.ep", "2", "--training.threads", "1"] if mpi else []
    runs = {}
    for dev in ("cpu", "cpu-guard"):
        folder = os.path.join(tmp, f"ckpt-{dev}-{int(mpi)}")
        base = ["train", "--config", os.path.join(tmp, "train.toml"), "--checkpoint.folder", folder, *extra]
        if dev == "cpu-guard":  # stopped after the step-2 checkpoint, resumed to the end
            r = ds4(base + ["--training.steps", "2"], dev, mpi)
            check(f"{what} train to step 2 on cpu-guard", r.returncode == 0, (r.stdout + r.stderr)[-600:])
        r = ds4(base, dev, mpi)
        check(f"{what} train on {dev}", r.returncode == 0, (r.stdout + r.stderr)[-600:])
        runs[dev] = files_of(folder)
    check(f"{what} train: checkpoints written", len(runs["cpu"]) >= 2, sorted(runs["cpu"]))
    check(f"{what} train resumed on cpu-guard: the cpu's checkpoint bytes", runs["cpu"] == runs["cpu-guard"],
          f"differ: {sorted(k for k in runs['cpu'] if runs['cpu'][k] != runs['cpu-guard'].get(k))}")


def main():
    tmp = tempfile.mkdtemp(prefix="ds4-guard-cli-")
    try:
        model = os.path.join(tmp, "model")
        r = subprocess.run([DS4, "init", "--config", "configs/ds4-demo-small.json", "--seed", "3", "--out", model],
                           capture_output=True, text=True, env=ENV, cwd=ROOT)
        check("init", r.returncode == 0, r.stderr[-300:])
        write_shard(os.path.join(tmp, "train.bin"), 256, 6, 700, seed=31)
        same_output("eval", ["eval", "--model", model, "--data", os.path.join(tmp, "train.bin"), "--seq-len", "64",
                             "--batch", "2", "--max-batches", "3"], lambda line: line.startswith("eval loss"))
        same_output("generate", ["generate", "--model", model, "--prompt", "In the beginning", "--max-new-tokens",
                                 "24", "--seed", "3", "--temperature", "0.8"],
                    lambda line: not re.search(r"tokens/s|parameters", line))
        with open(os.path.join(tmp, "train.toml"), "w") as f:
            f.write(TOML.format(root=ROOT, tmp=tmp))
        muon_runs(tmp, mpi=False)
        if shutil.which("mpirun"):
            muon_runs(tmp, mpi=True)
        else:
            print("SKIP Muon under mpirun: no mpirun")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if not os.access(DS4, os.X_OK):
    check("ds4 binary", False, f"{DS4} not found (make first)")
else:
    main()
finish("test_guard_cli")
