"""TorchTitan's DeepSeek debug config, stored as it ships (tests/data/torchtitan_deepseek_v3_debug_model.toml),
trains the ds4 demo model unmodified, with TorchTitan-style overrides for the size of the run and the data:
every key it ignores is one `warning:` line with the reason, the aliases are reported, the losses are bit for
bit those of the same run written with ds4's own keys, and activation_checkpoint.mode = "full" (ds4's full
recompute) does not change them either. The setting-by-setting checks are in tests/test_titan.c."""
import os
import re
import struct
import subprocess
import sys
import tempfile
import tomllib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ds4 = os.path.abspath(os.path.join(build, "ds4"))
FIXTURE = "tests/data/torchtitan_deepseek_v3_debug_model.toml"


def write_shard(path, vocab, n_docs, doc_len):
    """A ds4 token shard (include/ds4/shard.h): u16 tokens, n_docs documents of doc_len tokens."""
    toks = [2 + (d * 7919 + i * 104729) % (vocab - 2) for d in range(n_docs) for i in range(doc_len)]
    out = b"DS4TOKS\0" + struct.pack("<IIIiiI", 1, vocab, 2, -1, -1, 0) + struct.pack("<QQ", len(toks), n_docs)
    out += struct.pack(f"<{n_docs + 1}Q", *[d * doc_len for d in range(n_docs + 1)])
    out += struct.pack(f"<{len(toks)}H", *toks)
    with open(path, "wb") as f:
        f.write(out)


def train(config, *overrides):
    return subprocess.run([ds4, "train", "--config", config, "--training.threads", "1", "--metrics.peak_tflops", "1",
                           *overrides], capture_output=True, text=True, timeout=600)


def steps(out):
    """(step, loss, grad_norm) of every log line."""
    return re.findall(r"^step +(\d+) +loss +(\S+) +grad_norm +(\S+)", out, re.M)


NATIVE = """[model]
config = "configs/ds4-demo-small.json"
[training]
steps = 2
seq_len = 64
micro_batch_size = 1
global_batch_size = 1
max_norm = 1.0
[optimizer]
lr = 8e-4
eps = 1e-8
[lr_scheduler]
warmup_steps = 2
decay_type = "linear"
min_lr = 0.0
[data]
train = "{shard}"
"""

with tempfile.TemporaryDirectory() as tmp:
    shard = os.path.join(tmp, "train.bin")
    write_shard(shard, 258, 4, 600)
    size = ["--training.steps", "2", "--training.seq_len", "64", "--training.local_batch_size", "1",
            "--training.dataset_path", shard, "--job.dump_folder", os.path.join(tmp, "outputs")]
    a = train(FIXTURE, *size)
    check("fixture trains", a.returncode == 0 and len(steps(a.stdout)) == 2, a.stdout[-800:] + a.stderr[-800:])
    check("selective op -> norm + mHC recompute", "recompute mhc+norm" in a.stdout, a.stdout[:600])
    with open(FIXTURE, "rb") as f:
        fixture = tomllib.load(f)
    ignored = {"profiling.enable_profiling", "compile.enable", "compile.components", "training.dataset",
               "metrics.enable_wandb", "quantize.grouped_mm.float8.fqns", "checkpoint.last_save_model_only"}
    warned = dict(re.findall(r"^warning: config key (\S+) ignored: (.+)$", a.stderr, re.M))
    check("ignored keys warned, with a reason", ignored <= set(warned) and all(len(w) > 10 for w in warned.values()),
          sorted(warned))
    check("18 ignored keys, one line each", len(warned) == 18 and
          len([l for l in a.stderr.splitlines() if l.startswith("warning:")]) == 18, a.stderr)
    check("aliases reported", "config: training.local_batch_size read as training.micro_batch_size" in a.stdout and
          "config: parallelism.expert_parallel_degree read as parallel.ep" in a.stdout and
          "config: parallelism.pipeline_parallel_degree read as parallel.pp" in a.stdout, a.stdout[:1500])
    check("checkpoint.enable = false: no checkpoint", not os.path.exists(os.path.join(tmp, "outputs", "checkpoint")))

    native = os.path.join(tmp, "native.toml")
    with open(native, "w") as f:
        f.write(NATIVE.format(shard=shard))
    n = train(native)
    check("native run", n.returncode == 0, n.stderr[-500:])
    check("same losses as ds4's own keys", steps(a.stdout) == steps(n.stdout) and len(steps(n.stdout)) == 2,
          (steps(a.stdout), steps(n.stdout)))
    check("no TorchTitan notes for ds4's own keys", "config:" not in n.stdout and "warning:" not in n.stderr, n.stderr)

    full = train(FIXTURE, *size, "--activation_checkpoint.mode", "full")
    check("mode full -> full recompute", full.returncode == 0 and "recompute full-uniform-4" in full.stdout,
          full.stdout[:600] + full.stderr[-300:])
    check("recompute keeps the bits", steps(full.stdout) == steps(a.stdout), (steps(full.stdout), steps(a.stdout)))

    tp = train(FIXTURE, *size, "--parallelism.tensor_parallel_degree", "2")
    err = [l for l in tp.stderr.splitlines() if l.startswith("error:")]
    check("tensor parallel 2 refused", tp.returncode != 0 and len(err) == 1 and "tensor_parallel_degree" in err[0],
          tp.stderr[-400:])
    dp = train(FIXTURE, *size, "--parallelism.data_parallel_shard_degree", "4")
    check("shard degree checked against the world", dp.returncode != 0 and "(mpirun -np)" in dp.stderr, dp.stderr[-400:])

    # An error about a value set under TorchTitan's name names that name (and ds4's beside it)
    ep = train(FIXTURE, *size, "--parallelism.expert_parallel_degree", "3")
    err = [l for l in ep.stderr.splitlines() if l.startswith("error:")]
    check("alias error names the TorchTitan key", ep.returncode != 0 and len(err) == 1 and
          "key parallelism.expert_parallel_degree (ds4's parallel.ep): 3 must" in err[0], ep.stderr[-400:])
    lb = train(FIXTURE, *size, "--training.local_batch_size", "0")
    err = [l for l in lb.stderr.splitlines() if l.startswith("error:")]
    check("alias range error names the TorchTitan key", lb.returncode != 0 and len(err) == 1 and
          "training.local_batch_size (ds4's training.micro_batch_size) = 0" in err[0], lb.stderr[-400:])

    # TorchTitan's defaults from a fresh working directory: --job.config_file, dump_folder "./outputs" with
    # checkpoints and TensorBoard on: ./outputs/checkpoint and ./outputs/tb are made as by mkdir -p
    work = os.path.join(tmp, "fresh")
    os.makedirs(work)
    titan = [ds4, "train", "--job.config_file", os.path.join(ROOT, FIXTURE), "--training.threads", "1",
             "--metrics.peak_tflops", "1", "--training.steps", "2", "--training.seq_len", "64",
             "--training.local_batch_size", "1", "--training.dataset_path", shard,
             "--model.hf_assets_path", os.path.join(ROOT, "configs", "ds4-demo-small.json"),
             "--checkpoint.enable", "true", "--metrics.enable_tensorboard", "true"]
    d = subprocess.run(titan, cwd=work, capture_output=True, text=True, timeout=600)
    check("--job.config_file with TorchTitan's defaults trains", d.returncode == 0 and len(steps(d.stdout)) == 2,
          d.stdout[-600:] + d.stderr[-600:])
    check("./outputs/checkpoint made (mkdir -p)",
          os.path.isfile(os.path.join(work, "outputs", "checkpoint", "step-00000002", "state.json")),
          sorted(os.listdir(work)))
    check("./outputs/tb made", any(f.startswith("events.out.tfevents.")
                                   for f in os.listdir(os.path.join(work, "outputs", "tb"))
                                   if os.path.isdir(os.path.join(work, "outputs", "tb"))))
    check("same losses as --config", steps(d.stdout) == steps(a.stdout), (steps(d.stdout), steps(a.stdout)))
    two = subprocess.run(titan + ["--config", native], cwd=work, capture_output=True, text=True, timeout=60)
    check("--config and --job.config_file naming two files refused", two.returncode != 0 and
          "given twice" in two.stderr and native in two.stderr, two.stderr[-300:])
    blocker = os.path.join(tmp, "a-file")
    open(blocker, "w").close()
    bad = subprocess.run(titan + ["--job.dump_folder", os.path.join(blocker, "outputs")], cwd=work,
                         capture_output=True, text=True, timeout=60)
    err = [l for l in bad.stderr.splitlines() if l.startswith("error:")]
    check("a folder that cannot be made: one error naming it and why", bad.returncode != 0 and len(err) == 1 and
          f"cannot create {blocker}: a file of that name is in the way" in err[0] and "checkpoint folder" in err[0],
          bad.stderr[-400:])

finish("test_titan.py")
