"""`ds4 train` under a pipeline (world = pp, docs/pipeline.md) against the one-process run of the same TOML:
the metrics' losses and grad_norm, and the checkpoint bytes (model.safetensors, optim.state) at step 2 and 3,
with the pipelined run stopped after the step-2 checkpoint and resumed to step 3, and the "validation loss" line
the run prints at its end (20 batches of data.val: under a pipeline, forward-only passes through the stages,
ds4_pp_eval_rank, in groups of 8 micro-batches a chunk). Cases: pp 2 1F1B (AdamW
and Muon), pp 4 (also with full block recompute), pp 2 vpp 2 on the uneven layout E|tt|t|tmL (Muon) and under
bf16 mixed precision (uniform); the layer-input swap (--swap-layer-input) on pp 2 1F1B (AdamW; its activation
peak below the same pipeline's without it) and on pp 2 vpp 2 with full block + CSA recompute (Muon), against one
process without the swap; and a pipelined run resumed from one process's step-2 checkpoint; pp with EP
on pp ranks refused, --moe-fb-overlap under a pipeline refused, and a world that is not a multiple of pp. pp x fsdp (`mpirun -np 4`, pp 2 with 2 FSDP data ranks a
stage): against FSDP over 2 ranks without a pipeline (the same data ranks and sums; FSDP itself is not one
process's bits), the same losses, grad_norm, checkpoint bytes and validation line for pp 2 1F1B (AdamW),
pp 2 vpp 2 (Muon), pp 2 with EP 2 inside each stage (Muon; FSDP + EP is FSDP's bits) and pp 2 1F1B with
the layer-input swap (AdamW, against FSDP without it), and FSDP resumed from the pp x fsdp run's step-2 checkpoint; each rank's gradients and
optimizer state are below half its stage's (a shard of the stage, not the stage). The bubble: under pp the step line's `bubble X.X%` and the metrics' pp_bubble (the mean over the
ranks, in [0, 1)), pp_bubble_max and pp_bubble_ranks (each rank's, in (0, 1)); none of them in a one-process
run; the trace (--trace) of pp 2 1F1B and pp 2 vpp 2 holds one "F ck mbi" and one "B ck mbi" span a step per
(chunk, micro-batch) of each rank, on its "pp" row, in the order of the rank's schedule (1F1B re-derived
here); the TensorBoard scalar pp_bubble under pp only. Each pipelined run's startup lines say what every rank holds,
checked against one process's checkpoint (stage-local weights). Needs mpirun (skipped without it).

Usage: python3 tests/test_pp_train.py [--build DIR] [--quick]"""
import json
import os
import re
import shutil
import struct
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
ENV = dict(os.environ, DS4_ISA="generic", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="passive",
           OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
           ASAN_OPTIONS="detect_leaks=0")

# 4 micro-batches a step: a multiple of pp for the interleaved schedule, more than pp 2's warm-up
TOML = """[model]
config = "{root}/tests/configs/tiny-a.json"
seed = 5
[training]
steps = 3
seq_len = 64
global_batch_size = 4
micro_batch_size = 1
seed = 2
threads = 1
[optimizer]
name = "{opt}"
lr = 3e-3
[lr_scheduler]
warmup_steps = 1
decay_steps = 3
[data]
train = "{tmp}/train.bin"
val = "{tmp}/val.bin"
val_batches = 20
[checkpoint]
interval = 2
keep_latest_k = 3
"""

KEYS = ("loss", "mtp_loss", "indexer_loss", "total_loss", "grad_norm", "lr")


def ds4(argv, np=1):
    mpi = ["timeout", "300", "mpirun", "-np", str(np), "--bind-to", "none", "-x", "DS4_ISA", "-x",
           "OMP_NUM_THREADS"] if np > 1 else []
    return subprocess.run([*mpi, DS4, *argv], capture_output=True, text=True, errors="replace", timeout=400,
                          env=ENV, cwd=ROOT)


def files_of(folder):
    got = {}
    for d, _, names in os.walk(folder):
        for n in names:
            if n.endswith(".safetensors") or n == "optim.state":
                with open(os.path.join(d, n), "rb") as f:
                    got[os.path.relpath(os.path.join(d, n), folder)] = f.read()
    return got


def metrics_of(path):
    with open(path) as f:
        return [tuple([json.loads(line)["step"]] + [json.loads(line)[k] for k in KEYS]) for line in f if line.strip()]


def run(tmp, name, opt, np, extra, seed_from=None):
    """The run of opt's TOML on np ranks with extra flags: to step 2, then resumed to step 3 (seed_from: the
    checkpoint folder of another run, copied in at step 2 instead of running to step 2 here)."""
    toml = os.path.join(tmp, f"{opt}.toml")
    folder, jsonl = os.path.join(tmp, f"ckpt-{name}"), os.path.join(tmp, f"{name}.jsonl")
    base = ["train", "--config", toml, "--checkpoint.folder", folder, "--metrics.jsonl", jsonl, *extra]
    if seed_from:
        shutil.copytree(seed_from, folder, ignore=shutil.ignore_patterns("step-00000003", "*.lock"))
        shutil.copy(seed_from + ".jsonl", jsonl)
    elif np > 1:
        r = ds4(base + ["--training.steps", "2"], np)
        check(f"{name}: train to step 2", r.returncode == 0, (r.stdout + r.stderr)[-800:])
    r = ds4(base, np)
    check(f"{name}: train to step 3", r.returncode == 0, (r.stdout + r.stderr)[-800:])
    val = re.findall(r"^validation loss .*$", r.stdout, re.M)
    return metrics_of(jsonl) if os.path.exists(jsonl) else [], files_of(folder), folder, val, r.stdout


def peak_of(path):
    """The activation peak of step 1 (the metrics' activation_peak_bytes)."""
    with open(path) as f:
        return json.loads(f.readline())["activation_peak_bytes"]


def tensors_of(blob):
    """{name: (dtype, elements)} of a safetensors file's bytes."""
    n = struct.unpack("<Q", blob[:8])[0]
    head = json.loads(blob[8:8 + n])
    out = {}
    for k, v in head.items():
        if k != "__metadata__":
            e = 1
            for d in v["shape"]:
                e *= d
            out[k] = (v["dtype"], e)
    return out


def owners(layout, pp, n_layers=4):
    """{decoder layer: pp rank} of a layout string (tiny-a: 4 layers), or of the uniform split into pp x vpp
    chunks (layout: the vpp then); the embedding on rank 0, the head and MTP on the last chunk's rank."""
    chunks = layout.split("|") if isinstance(layout, str) else ["t" * (n_layers // (pp * layout))] * (pp * layout)
    where, l = {}, 0
    for k, ch in enumerate(chunks):
        for c in ch:
            if c == "t":
                where[l] = k % pp
                l += 1
    return where, (len(chunks) - 1) % pp


def rank_of(name, where, last):
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
        return where[int(m.group(1))]
    return 0 if name.startswith("embed.") else last


def stage_memory(name, out, model, optim, layout, pp, adamw, bf16):
    """The per-rank lines of the startup report against one process's checkpoint (its tensors by owner): each
    rank's gradients are the regions of its own groups (the allocator's count), below the whole model's;
    its parameters those regions (with their bf16 copy under bf16) and the integer tables; the optimizer state of its own tensors only
    (AdamW: 8 bytes an element of them, exactly), summed over the ranks one process's."""
    rows = re.findall(r"pipeline rank (\d+) holds: parameters (\d+) bytes \(its groups' values (\d+)\), gradients "
                      r"(\d+) bytes \(its groups' (\d+)\), optimizer state (\d+) bytes", out)
    check(f"{name}: a memory line per rank", [int(r[0]) for r in rows] == list(range(pp)), out[-600:])
    t = tensors_of(model)
    floats = {k: e for k, (d, e) in t.items() if d == "F32"}
    ints = sum(8 * e for d, e in t.values() if d == "I64")
    whole = 4 * sum(floats.values())
    where, last = owners(layout, pp)
    opt_total = sum(4 * e for d, e in tensors_of(optim).values() if d == "F32")
    for r, (_, params, values, grads, own_grads, opt) in enumerate(rows):
        params, values, grads, own_grads, opt = map(int, (params, values, grads, own_grads, opt))
        mine = 4 * sum(e for k, e in floats.items() if rank_of(k, where, last) == r)
        check(f"{name}: rank {r}'s gradients are its groups' regions, not the whole model's",
              grads == own_grads and mine <= grads < whole, f"{grads} {own_grads} {mine} {whole}")
        check(f"{name}: rank {r}'s parameters are its groups' values and the integer tables",
              params == values + ints and mine <= values < whole * (1.5 if bf16 else 1),
              f"{params} {values} {ints} {mine} {whole}")
        if adamw:
            check(f"{name}: rank {r}'s AdamW state is 8 bytes an element of its own tensors", opt == 2 * mine,
                  f"{opt} vs {2 * mine}")
        check(f"{name}: rank {r}'s optimizer state is less than one process's", opt < opt_total, f"{opt} {opt_total}")
    check(f"{name}: the ranks' optimizer states add up to one process's", sum(int(r[5]) for r in rows) == opt_total,
          f"{[r[5] for r in rows]} vs {opt_total}")


def fsdp_memory(name, out, model, optim, fsdp, pp):
    """pp x fsdp's per-rank lines: one per world rank (stage = rank / fsdp), each rank's gradients below the
    whole model's / fsdp and its optimizer state below one process's / fsdp; the ranks' optimizer states cover
    one process's (every element on some rank, with the regions' padding)."""
    rows = re.findall(r"rank (\d+) \(stage (\d+), data rank (\d+)\) holds: parameters (\d+) bytes, gradients (\d+) "
                      r"bytes, optimizer state (\d+) bytes", out)
    check(f"{name}: a memory line per rank", [tuple(map(int, r[:3])) for r in rows] ==
          [(r, r // fsdp, r % fsdp) for r in range(pp * fsdp)], out[-600:])
    opt_total = sum(4 * e for d, e in tensors_of(optim).values() if d == "F32")
    whole = sum(4 * e for d, e in tensors_of(model).values() if d == "F32")
    for r, _, _, _, grads, opt in rows:
        check(f"{name}: rank {r}'s gradients and optimizer state are a shard of its stage's",
              0 < int(grads) < whole / fsdp and 0 < int(opt) < opt_total / fsdp, f"{grads} {opt} {whole} {opt_total}")
    check(f"{name}: the ranks' optimizer states cover one process's", sum(int(r[5]) for r in rows) >= opt_total,
          f"{[r[5] for r in rows]} vs {opt_total}")


def same(name, ref, got, of="one-process"):
    check(f"{name}: 3 steps logged", len(got[0]) == 3, got[0])
    check(f"{name}: the {of} losses, grad_norm and lr", got[0] == ref[0], f"{got[0]} vs {ref[0]}")
    check(f"{name}: checkpoints written", len(ref[1]) >= 4, sorted(ref[1]))
    diff = sorted(k for k in ref[1] if ref[1][k] != got[1].get(k))
    check(f"{name}: the {of} checkpoint bytes", not diff and set(ref[1]) == set(got[1]), f"differ: {diff}")
    check(f"{name}: one validation line of 20 batches", len(ref[3]) == 1 and ref[3][0].endswith("(20 batches)"), ref[3])
    check(f"{name}: the {of} validation line", got[3] == ref[3], f"{got[3]} vs {ref[3]}")


def one_f_one_b(pp, rank, m):
    """Rank's actions of 1F1B (Megatron's order, re-derived): the warm-up forwards, F and B in turn, the rest."""
    warm = min(pp - rank - 1, m)
    acts = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        acts += [("F", warm + i), ("B", i)]
    return acts + [("B", i) for i in range(m - warm, m)]


def bubble_fields(name, out, jsonl, pp):
    """The step lines' bubble field and the metrics' pp_bubble, pp_bubble_max, pp_bubble_ranks of a pipelined run."""
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    check(f"{name}: every step line has 'bubble X.X%'",
          lines and all(re.search(r"  bubble +\d+\.\d%$", ln) for ln in lines), lines)
    with open(jsonl) as f:
        rows = [json.loads(ln) for ln in f if ln.strip()]
    check(f"{name}: metrics lines", len(rows) == len(lines), rows)
    for r in rows:
        ranks = r.get("pp_bubble_ranks", [])
        check(f"{name} step {r['step']}: pp_bubble in [0, 1)", 0 <= r.get("pp_bubble", -1) < 1, r)
        # every rank's receives block for some nanoseconds at least: a bubble of 0 is one never measured
        check(f"{name} step {r['step']}: pp_bubble_ranks, one a rank, each in (0, 1)",
              len(ranks) == pp and all(0 < b < 1 for b in ranks), r)
        check(f"{name} step {r['step']}: pp_bubble their mean, pp_bubble_max their max",
              ranks and abs(r["pp_bubble"] - sum(ranks) / pp) < 1e-5 and r.get("pp_bubble_max") == max(ranks), r)


def trace_actions(name, path, pp, vpp, m, steps):
    """The trace's pipeline spans: one F and one B a step per (chunk, micro-batch) of each rank; 1F1B in order."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    for rank in range(pp):
        mine = sorted((e for e in events if e.get("pid") == rank and e.get("ph") == "X"), key=lambda e: e["ts"])
        acts = [e for e in mine if re.fullmatch(r"[FB] c\d+ mb\d+", e["name"])]
        rows = {e["tid"] for e in acts}
        named = [e for e in events if e.get("pid") == rank and e.get("name") == "thread_name" and
                 e.get("tid") in rows and e["args"]["name"] == "pp"]
        check(f"{name} rank {rank}: the actions on one row named pp", len(rows) == 1 and len(named) == 1, (rows, named))
        want = sorted(f"{op} c{k} mb{i}" for op in "FB" for k in range(rank, pp * vpp, pp) for i in range(m)) * steps
        check(f"{name} rank {rank}: one F and one B span a step per (chunk, micro-batch)",
              sorted(e["name"] for e in acts) == sorted(want), sorted(e["name"] for e in acts))
        if vpp == 1:
            order = [f"{op} c{rank} mb{i}" for op, i in one_f_one_b(pp, rank, m)] * steps
            check(f"{name} rank {rank}: the spans in 1F1B's order", [e["name"] for e in acts] == order,
                  [e["name"] for e in acts])


def bubble_and_trace(tmp):
    """pp 2 1F1B and pp 2 vpp 2 (2 steps of 4 micro-batches) with --trace: the bubble fields and the pipeline's
    spans; one process: neither the field nor the keys."""
    toml = os.path.join(tmp, "AdamW.toml")
    for name, np, flags, vpp in (("bubble pp 2", 2, ["--parallel.pp", "2"], 1),
                                 ("bubble pp 2 vpp 2", 2, ["--parallel.pp", "2", "--parallel.vpp", "2"], 2),
                                 ("bubble one process", 1, [], 0)):
        tag = name.replace(" ", "_")
        jsonl, trace = os.path.join(tmp, f"{tag}.jsonl"), os.path.join(tmp, f"{tag}.trace.json")
        tb = os.path.join(tmp, f"tb-{tag}")
        r = ds4(["train", "--config", toml, "--training.steps", "2", "--checkpoint.folder",
                 os.path.join(tmp, f"ckpt-{tag}"), "--metrics.jsonl", jsonl, "--trace", trace,
                 "--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", tb, *flags], np)
        check(f"{name}: ran", r.returncode == 0, (r.stdout + r.stderr)[-800:])
        if r.returncode != 0:
            continue
        events = b"".join(open(os.path.join(tb, n), "rb").read() for n in os.listdir(tb))
        check(f"{name}: the TensorBoard scalar pp_bubble {'only ' if np == 1 else ''}under pp",
              (b"pp_bubble" in events) == (np > 1) and b"grad_norm" in events, len(events))
        if np == 1:
            with open(jsonl) as f:
                keys = {k for ln in f if ln.strip() for k in json.loads(ln)}
            check(f"{name}: no pp_bubble keys", keys and not any(k.startswith("pp_bubble") for k in keys), keys)
            steps = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
            check(f"{name}: no bubble in the step lines", len(steps) == 2 and not any("bubble" in ln for ln in steps),
                  steps)
            continue
        bubble_fields(name, r.stdout, jsonl, np)
        trace_actions(name, trace, np, vpp, 4, 2)


def pp_fsdp(tmp, quick):
    """pp 2 x fsdp 2 on 4 ranks (1F1B AdamW; pp 2 vpp 2 Muon; EP 2 inside each stage, Muon) against FSDP on 2 ranks: the same bits; FSDP
    resumed from the pp x fsdp run's step 2."""
    cases = [("pp 2 x fsdp 2 1F1B AdamW", "AdamW", ["--parallel.pp", "2"]),
             ("pp 2 vpp 2 x fsdp 2 Muon", "Muon", ["--parallel.pp", "2", "--parallel.vpp", "2"]),
             ("pp 2 x fsdp 2 ep 2 Muon", "Muon", ["--parallel.pp", "2", "--parallel.ep", "2"]),
             ("pp 2 x fsdp 2 1F1B AdamW swap-layer-input", "AdamW",
              ["--parallel.pp", "2", "--swap-layer-input", "--offload-dir", tmp])]
    ref = {}
    for name, opt, extra in cases[:1] if quick else cases:
        if opt not in ref:
            ref[opt] = run(tmp, f"fsdp2-{opt}", opt, 2, [])
        tag = name.replace(" ", "_")
        got = run(tmp, tag, opt, 4, extra)
        same(name, ref[opt], got, "FSDP 2's")
        check(f"{name}: the startup line names pp x fsdp", "FSDP over 2 data ranks (world = pp x fsdp" in got[4],
              got[4][-600:])
        fsdp_memory(name, got[4], ref[opt][1].get("step-00000002/model.safetensors", b""),
                    ref[opt][1].get("step-00000002/optim.state", b""), 2, 2)
        if name == cases[0][0]:  # FSDP resumes the pp x fsdp checkpoint of step 2: FSDP's step 3
            seed = os.path.join(tmp, "ppfsdp-step2")
            shutil.copytree(got[2], seed, ignore=shutil.ignore_patterns("step-00000003", "*.lock"))
            with open(seed + ".jsonl", "w") as f, open(os.path.join(tmp, f"{tag}.jsonl")) as src:
                f.write("".join(src.readlines()[:2]))
            same("FSDP 2 resumed from pp 2 x fsdp 2's step 2", ref[opt],
                 run(tmp, "fsdp2-from-ppfsdp", opt, 2, [], seed_from=seed), "FSDP 2's")


def main():
    quick = "--quick" in args
    tmp = tempfile.mkdtemp(prefix="ds4-pp-train-")
    try:
        write_shard(os.path.join(tmp, "train.bin"), 256, 6, 700, seed=31)
        write_shard(os.path.join(tmp, "val.bin"), 256, 3, 700, seed=37)
        for opt in ("AdamW", "Muon"):
            with open(os.path.join(tmp, f"{opt}.toml"), "w") as f:
                f.write(TOML.format(root=ROOT, tmp=tmp, opt=opt))
        bf16 = ["--training.mixed_precision_param", "bfloat16"]
        recompute = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"]
        swap = ["--swap-layer-input", "--offload-dir", tmp]
        # (name, optimizer, ranks, flags, the one-process run's flags)
        # (name, optimizer, ranks, flags, the one-process run's flags, the layout: a string or the vpp)
        cases = [("pp 2 1F1B AdamW", "AdamW", 2, ["--parallel.pp", "2"], [], 1),
                 ("pp 2 1F1B Muon", "Muon", 2, ["--parallel.pp", "2"], [], 1),
                 ("pp 2 vpp 2 E|tt|t|tmL Muon", "Muon", 2, ["--parallel.pp", "2", "--parallel.layout", "E|tt|t|tmL"], [],
                  "E|tt|t|tmL"),
                 ("pp 4 1F1B AdamW", "AdamW", 4, ["--parallel.pp", "4"], [], 1),
                 ("pp 4 1F1B AdamW full block recompute", "AdamW", 4, ["--parallel.pp", "4", *recompute], [], 1),
                 ("pp 2 vpp 2 AdamW bf16", "AdamW", 2, ["--parallel.pp", "2", "--parallel.vpp", "2", *bf16], bf16, 2),
                 # the layer-input swap: each in-flight micro-batch's inputs in a store of its own; one process keeps
                 # them in memory (the swap is one process's bits, tests/test_golden.py)
                 ("pp 2 1F1B AdamW swap-layer-input", "AdamW", 2, ["--parallel.pp", "2", *swap], [], 1),
                 ("pp 2 vpp 2 Muon swap-layer-input full block + CSA recompute", "Muon", 2,
                  ["--parallel.pp", "2", "--parallel.vpp", "2", *recompute, "--recompute-csa-attention", *swap], [], 2)]
        if quick:
            cases = cases[1:3]
        ref = {}
        for _, opt, _, _, one, _ in cases:
            key = (opt, tuple(one))
            if key not in ref:
                ref[key] = run(tmp, f"one-{opt}-{len(ref)}", opt, 1, one)
        for name, opt, np, extra, one, layout in cases:
            got = run(tmp, name.replace(" ", "_").replace("|", ""), opt, np, extra)
            want = ref[(opt, tuple(one))]
            same(name, want, got)
            check(f"{name}: the startup line says each rank holds its stage's parameters",
                  "each rank holds its stage's parameters" in got[4], got[4][-600:])
            stage_memory(name, got[4], want[1].get("step-00000002/model.safetensors", b""),
                         want[1].get("step-00000002/optim.state", b""), layout, np, opt == "AdamW", bool(one))
            if "--swap-layer-input" in extra:
                check(f"{name}: the startup line names the offload tier", "offload: layer inputs to" in got[4],
                      got[4][-600:])
        # the swap moved layer inputs out: pp 2's activation peak below the same pipeline's without it
        if not quick:
            peak = [peak_of(os.path.join(tmp, f"pp_2_1F1B_AdamW{x}.jsonl")) for x in ("", "_swap-layer-input")]
            check("pp 2 swap-layer-input: the activation peak below the run without it", 0 < peak[1] < peak[0], peak)
        # a one-process checkpoint resumed by a pipeline: the same step 3
        if not quick:
            one = os.path.join(tmp, "one-step2")
            muon = ref[("Muon", ())]
            shutil.copytree(muon[2], one, ignore=shutil.ignore_patterns("step-00000003", "*.lock"))
            with open(one + ".jsonl", "w") as f:
                with open(muon[2].replace("ckpt-", "") + ".jsonl") as src:
                    f.write("".join(src.readlines()[:2]))
            same("pp 2 resumed from one process's step 2", muon,
                 run(tmp, "pp2-from-one", "Muon", 2, ["--parallel.pp", "2"], seed_from=one))
        pp_fsdp(tmp, quick)
        bubble_and_trace(tmp)
        # EP without FSDP inside a stage, and a world that is not pp x fsdp: one line, on every rank alike
        r = ds4(["train", "--config", os.path.join(tmp, "AdamW.toml"), "--parallel.pp", "2", "--parallel.ep", "2",
                 "--checkpoint.interval", "0"], 2)
        check("pp 2 with ep 2 on 2 ranks refused with one line", r.returncode != 0 and
              "EP inside a stage divides its FSDP group" in r.stderr and "parallel.ep" in r.stderr,
              (r.stdout + r.stderr)[-600:])
        r = ds4(["train", "--config", os.path.join(tmp, "AdamW.toml"), "--parallel.pp", "2", "--moe-fb-overlap",
                 "--checkpoint.interval", "0"], 2)
        check("pp 2 with --moe-fb-overlap refused with one line", r.returncode != 0 and
              "pipeline parallelism (pp 2): --moe-fb-overlap is not built yet under a pipeline" in r.stderr,
              (r.stdout + r.stderr)[-600:])
        r = ds4(["train", "--config", os.path.join(tmp, "AdamW.toml"), "--parallel.pp", "2",
                 "--checkpoint.interval", "0"], 3)
        check("pp 2 on 3 ranks refused with one line", r.returncode != 0 and
              "runs pp x fsdp ranks: start it under mpirun -np 2 (one rank per stage) or a multiple of it" in r.stderr,
              (r.stdout + r.stderr)[-600:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if not os.access(DS4, os.X_OK):
    check("ds4 binary", False, f"{DS4} not found (make first)")
elif not shutil.which("mpirun"):
    print("SKIP test_pp_train: no mpirun")
else:
    main()
finish("test_pp_train")
