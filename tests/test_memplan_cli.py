"""ds4 memplan --device-memory and --policies on a small config: a budget below the planned peak says
"does not fit" and by how many bytes, one above it says "fits" and how many bytes are free, the boundary
(exactly the peak) fits with 0 free; --policies prints every policy with fits and margin = budget - peak;
the exit code is 0 either way (a report); bad sizes and conflicting flags are one `error:` line.
--memory-report: the grads peak split by what held it (all resident on one process; FSDP's shard, open groups
and reduce-scatters in flight on 2 ranks) and the workspace users, their at-peak bytes summing to the workspace
peak; which of them grow with T.
--saved-activations: one table per kind of block after the unchanged plan; a recompute flag flips exactly its
units' rows to recomputed, bf16 mixed precision halves exactly the rows it holds in bf16, the blocks' kept bytes
plus the pass's tensors outside the blocks are the act peak (the backward's transients on top under bf16).
A pipeline (--pp 2, alone and as pp 2 x fsdp 2 with EP 2): a column per stage, each pp x fsdp rank below its
stage's pp-alone peak; --policies: the 28 policies (the layer-input swap's too), each row's max the plan of its own
flags, the swap's largest peak below off's;
--device-memory: each stage's margin, how many fit, the largest's line, and the policies' fits and margins;
--memory-report: one rank's report after the table, its owners summing to its column's peaks;
--saved-activations: each stage's rank's blocks (one process's tables, split over the stages), the passes its
schedule keeps at once and their kept bytes, the rest of its column's act peak each pass's tensors outside the
blocks; with --policies one error line."""
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ds4 = os.path.abspath(os.path.join(build, "ds4"))
BASE = ["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--micro-batch", "2", "--threads", "1"]
FIT = re.compile(r"^device memory [\d.]+ GiB \((\d+) bytes\): the step (fits, [\d.]+ GiB \((\d+) bytes\) free at its "
                 r"peak|does not fit: [\d.]+ GiB \((\d+) bytes\) over)$", re.M)


def memplan(*args):
    return subprocess.run([ds4, *BASE, *args], capture_output=True, text=True, timeout=60)


def peak_total(out):
    m = re.search(r"^  peak total +(\d+) ", out, re.M)
    return int(m.group(1)) if m else None


def fit(out):
    """(device bytes, margin) from the device line: margin > 0 free, < 0 over; None when absent."""
    m = FIT.search(out)
    if not m:
        return None
    return int(m.group(1)), int(m.group(3)) if m.group(3) else -int(m.group(4))


plain = memplan()
peak = peak_total(plain.stdout)
check("plain plan", plain.returncode == 0 and peak and peak > 2 ** 20, plain.stdout + plain.stderr)
check("no device line without --device-memory", "device memory" not in plain.stdout, plain.stdout)

# a budget below the peak, above it, exactly it and a byte short, in each spelling of a size
for name, size, device in [("1MiB", "1MiB", 2 ** 20), ("1GiB", "1GiB", 2 ** 30), ("1GB", "1GB", 10 ** 9),
                           ("0.5 GiB", "0.5 GiB", 2 ** 29), ("exactly the peak", str(peak), peak),
                           ("a byte short", str(peak - 1), peak - 1)]:
    r = memplan("--device-memory", size)
    got = fit(r.stdout)
    check(f"{name}: exit 0", r.returncode == 0, r.stderr)
    check(f"{name}: same plan", peak_total(r.stdout) == peak, r.stdout)
    check(f"{name}: device {device} bytes, margin {device - peak}", got == (device, device - peak),
          f"got {got}: {r.stdout}")
check("exactly the peak fits", "fits, 0.000 GiB (0 bytes) free" in memplan("--device-memory", str(peak)).stdout)
check("a byte short is 1 byte over", "(1 bytes) over" in memplan("--device-memory", str(peak - 1)).stdout)

# --policies: every policy, margin = budget - its peak, fits = margin >= 0; off is the plain plan
budget = 2 ** 30
r = memplan("--policies", "--device-memory", "1GiB")
rows = re.findall(r"^  (\S+(?: \+\S+)?) +(\d+) +[\d.]+ +[\d.]+ +(yes|no) +(-?\d+) +-?[\d.]+ +[\d.]+$", r.stdout, re.M)
check("policies: exit 0", r.returncode == 0, r.stderr)
check("policies: 28 rows", len(rows) == 28, r.stdout)
names = [row[0] for row in rows]
check("policies: the list", names[:7] == ["off", "csa", "mhc", "norm", "csa+mhc", "csa+mhc+norm", "full"] and
      names[7] == "off +swap-opt" and names[14] == "off +swap-in" and names[21] == "off +swap-opt+in", names)
check("policies: off is the plain plan", rows and int(rows[0][1]) == peak, rows[:1])
for name, p, fits, margin in rows:
    check(f"policies: {name} margin", int(margin) == budget - int(p) and (fits == "yes") == (int(margin) >= 0),
          (name, p, fits, margin))
peaks = sorted(int(row[1]) for row in rows)
mid = (peaks[0] + peaks[-1]) // 2
r = memplan("--policies", "--device-memory", str(mid))
fits = re.findall(r" (yes|no) +-?\d+ ", r.stdout)
check("policies: a budget between the smallest and largest peak splits them", "yes" in fits and "no" in fits and
      len(fits) == 28, r.stdout)
r = memplan("--policies", "--device-memory", "1GiB", "--mixed-precision-param", "bfloat16")
bf16 = re.findall(r"^  (\S+(?: \+\S+)?) +(\d+) +[\d.]+ +[\d.]+ +(yes|no) +(-?\d+) ", r.stdout, re.M)


def category_bytes(out, name):
    m = re.search(rf"^  {name} +(\d+) ", out, re.M)
    return int(m.group(1)) if m else 0


# the bf16 compute copy of the GEMM matrices: 2 bytes per element of the flat layout, held all step long, and
# its region list (metadata: regions never mix the compute dtypes, so there are more of them)
o32, o16 = memplan().stdout, memplan("--mixed-precision-param", "bfloat16").stdout
p32, p16 = category_bytes(o32, "params"), category_bytes(o16, "params")
check("bf16: the parameters hold the compute copy, 2 bytes an element beside fp32's 4",
      p16 > p32 and 2 * (p16 - p32) <= p32 < 2 * (p16 - p32) + 65536, (p32, p16))
copy = p16 - p32 + category_bytes(o16, "other") - category_bytes(o32, "other")
# bf16 holds the saved activations in half the bytes: never a peak higher than fp32's by more than the copy, a
# lower one for off (whose peak is the activations'); with the optimizer's update as the peak (small configs,
# swap, full recompute) the copy may put it above fp32's
check("policies in bf16: every policy, peaks <= fp32's + the copy, off's lower",
      r.returncode == 0 and "bfloat16" in r.stdout.splitlines()[0] and len(bf16) == 28 and copy is not None and
      all(b[0] == f[0] and int(b[1]) <= int(f[1]) + copy for b, f in zip(bf16, rows)) and
      int(bf16[0][1]) < int(rows[0][1]), r.stdout)
r = memplan("--policies")
check("policies without a budget: no fits column", r.returncode == 0 and "fits" not in r.stdout and
      len(re.findall(r"^  \S", r.stdout, re.M)) == 29, r.stdout)


def expect_error(name, args, *needles):
    r = memplan(*args)
    err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    check(name, r.returncode == 2 and len(err) == 1 and all(n in err[0] for n in needles) and r.stdout == "",
          f"rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}")


for bad in ["64G", "abc", "-1GiB", "", "64 GiBs", "1e9", "99999999999999999999"]:
    expect_error(f"bad size {bad!r}", ["--device-memory", bad], "--device-memory", f"'{bad}'")
expect_error("zero bytes", ["--device-memory", "0"], "--device-memory")
expect_error("no value", ["--device-memory"], "--device-memory")
expect_error("policies with recompute flags", ["--policies", "--mhc-recompute"], "--policies")
expect_error("policies with swap flags", ["--policies", "--swap-optimizer"], "--policies")
expect_error("an unknown backend", ["--device", "nope"], "--device", "'nope'", "built in: cpu")
expect_error("an unknown matmul precision", ["--matmul-precision", "fp16"], "--matmul-precision", "'fp16'")
expect_error("fp32 GEMMs under bf16 mixed precision", ["--matmul-precision", "fp32", "--mixed-precision-param",
             "bfloat16"], "--matmul-precision", "--mixed-precision-param")
r = memplan("--device", "cpu")
check("--device cpu plans the default backend", r.returncode == 0 and peak_total(r.stdout) == peak, r.stdout)
r = memplan("--matmul-precision", "bf16")
check("--matmul-precision bf16 says so and keeps fp32 parameters", r.returncode == 0 and
      "matmul precision: bf16" in r.stdout and category_bytes(r.stdout, "params") == category_bytes(o32, "params"),
      r.stdout)
r = memplan("--device-memory", "1.5")
check("1.5 bytes is a size, rounded down to one byte", fit(r.stdout) == (1, 1 - peak), r.stdout)

# --config: the run a training TOML describes, read as ds4 train reads it, planned through the trainer's
# builders: the same bytes as the flags that say the same, and settings the flags cannot say
import tempfile  # noqa: E402

tmp = tempfile.mkdtemp(prefix="ds4-memplan-")
toml = os.path.join(tmp, "run.toml")
with open(toml, "w") as f:
    f.write('[model]\nconfig = "tests/configs/tiny-a.json"\n[training]\nsteps = 1\nseq_len = 64\n'
            'micro_batch_size = 2\nthreads = 1\n[data]\ntrain = "unused_*.bin"\n')


def run_plan(*args):
    return subprocess.run([ds4, "memplan", "--config", toml, *args], capture_output=True, text=True, timeout=60)


def categories(out):
    out = out.split("offload tier")[0]  # the memory tier's table
    return re.findall(r"^  (params|grads|optim|activations|workspace|comm|other|peak total|resident) +(\d+) ", out, re.M)


for name, run_args, flag_args in [
        ("plain", [], []),
        ("recompute and swap flags", ["--recompute-csa-attention", "--swap-optimizer"],
         ["--recompute-csa-attention", "--swap-optimizer"]),
        ("bf16 mixed precision", ["--training.mixed_precision_param", "bfloat16"], ["--mixed-precision-param", "bfloat16"]),
        ("Muon", ["--optimizer.name", "Muon"], ["--muon"]),
        ("two ranks, EP 2", ["--training.global_batch_size", "4", "--parallel.ep", "2", "--world", "2"],
         ["--world", "2", "--ep", "2"]),
        ("MoE FB overlap, two micro-batches", ["--training.global_batch_size", "4", "--moe-fb-overlap"],
         ["--moe-fb-overlap"])]:
    a, b = run_plan(*run_args), memplan(*flag_args)
    ca = categories(a.stdout)
    check(f"--config {name}: the flags' bytes", a.returncode == 0 and len(ca) == 9 and ca == categories(b.stdout),
          a.stdout + a.stderr + b.stdout)
r = run_plan("--device-memory", str(peak))
check("--config --device-memory: the fit line", r.returncode == 0 and fit(r.stdout) == (peak, 0), r.stdout + r.stderr)
r = run_plan("--training.global_batch_size", "4")
check("--config: two micro-batches per rank, said in the header",
      r.returncode == 0 and "micro-batch 2 x 2 per rank" in r.stdout, r.stdout + r.stderr)


def run_error(name, code, args, *needles):
    r = run_plan(*args)
    err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    check(name, r.returncode == code and len(err) == 1 and all(n in err[0] for n in needles) and r.stdout == "",
          f"rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}")


run_error("--config with --policies", 2, ["--policies"], "--policies")
run_error("--config with --model", 2, ["--model", "x"], "--model")
run_error("--config: an unknown key", 1, ["--training.nope", "1"], "training.nope")
run_error("--config: a batch two ranks cannot split", 1, ["--world", "2"], "global_batch_size", "2 ranks")
run_error("--config: an unknown flag", 2, ["--bogus"], "--bogus")
run_error("--config: a rank outside the world", 2, ["--world", "2", "--rank", "2"], "--rank")
r = subprocess.run([ds4, "memplan", "--config", os.path.join(tmp, "none.toml")], capture_output=True, text=True,
                   timeout=60)
check("--config: a missing file", r.returncode == 1 and "none.toml" in r.stderr and r.stdout == "", r.stderr)
# --saved-activations: one table per kind of block, its rows from the units' declarations
ROW = re.compile(r"^  (\S+) +(\S+) +\[([\d, ]+)\] +(fp32|bf16|i32|i64) +(\d+)  (kept|recomputed|swapped)$")
KIND = re.compile(r"^(.+): (\d+) blocks? \(the first is block (\d+)\)$")
ONE = re.compile(r"^  one block: (\d+) bytes kept \([\d.]+ GiB\), (\d+) recomputed, (\d+) swapped; (\d+) blocks?: "
                 r"(\d+) bytes kept$")
ALL = re.compile(r"^all (\d+) blocks: (\d+) bytes kept in memory \([\d.]+ GiB\), (\d+) recomputed, (\d+) swapped to "
                 r"the offload tier$", re.M)


def saved_tables(out):
    """{kind: (count, [(unit, tensor, shape, dtype, bytes, status)], one-block line)} in print order."""
    tables, kind = {}, None
    for line in out.split("saved activations:", 1)[-1].splitlines():
        if KIND.match(line):
            k = KIND.match(line)
            kind = f"{k.group(1)} #{k.group(3)}"  # a kind split by per-layer recompute masks prints twice
            tables[kind] = (int(k.group(2)), [], None)
        elif ROW.match(line) and kind:
            m = ROW.match(line)
            tables[kind][1].append((m.group(1), m.group(2), m.group(3), m.group(4), int(m.group(5)), m.group(6)))
        elif ONE.match(line) and kind:
            tables[kind] = (tables[kind][0], tables[kind][1], tuple(int(x) for x in ONE.match(line).groups()))
    return tables


def outside_blocks(N):
    """The act bytes of tiny-a's pass outside its blocks (D 64, n 4, V 256, MTP): token ids, the last stream,
    two heads (mixes, rsqrt, y, rstd, yn, logits, targets), the MTP input (e, en, en_rstd, hn, hn_rstd, out)."""
    n, D, V = 4, 64, 256
    head = N * n + N + N * D + N + N * D + N * V + N
    return 4 * (2 * N + N * n * D + 2 * head + 2 * N * D + N + N * n * D + N * n + N * n * D)


def without_time(out):
    return re.sub(r"\(planned in [\d.]+ s\)", "", out)


ATTN = {"q_up", "compressor", "indexer", "sparse_attn", "o_proj"}
MHC = {"hc_pre_attn", "hc_pre_ffn", "hc_post_attn"}
off = memplan("--saved-activations")
t_off = saved_tables(off.stdout)
kinds = list(t_off)
check("saved: exit 0, the plan's lines first and unchanged", off.returncode == 0 and
      without_time(off.stdout).startswith(without_time(plain.stdout)), off.stdout + off.stderr)
check("saved: nothing without the flag", "saved activations" not in plain.stdout, plain.stdout)
check("saved: a table per kind (SWA, CSA, HCA, MTP), blocks counted", [(k.split(" ")[0], t[0]) for k, t in
      t_off.items()] == [("sliding", 1), ("CSA", 2), ("HCA", 1), ("MTP", 1)], str(list(t_off.items())[:1]))
units = [set(r[0] for r in t[1]) for t in t_off.values()]
every = {"hc_pre_attn", "attn_norm", "q_down", "q_up", "kv", "sparse_attn", "o_proj", "hc_post_attn", "hc_pre_ffn",
         "ffn_norm", "router", "moe", "input"}
check("saved: the units of each kind", units == [every, every | {"compressor", "indexer", "indexer_topk"},
      every | {"compressor"}, every], str(units))
csa = t_off[kinds[1]][1]
check("saved: CSA's tensors, shapes and bytes for 128 tokens",
      ("indexer_topk", "topk", "128, 4", "i32", 2048, "kept") in csa and
      ("compressor", "kvc", "2, 16, 32", "fp32", 4096, "kept") in csa and
      ("hc_post_attn", "X_mid", "128, 4, 64", "fp32", 131072, "kept") in csa and
      ("input", "X_in", "128, 4, 64", "fp32", 131072, "kept") in csa and
      all(r[4] == 4 * eval(r[2].replace(", ", "*")) for r in csa if r[3] in ("fp32", "i32")), str(csa))


def sums_agree(name, out, tables, transient=False, N=128):
    """Per block and over the blocks the totals are the rows' sums; kept + outside the blocks = the act peak."""
    one_ok = all(t[2] and t[2][0] == sum(r[4] for r in t[1] if r[5] == "kept") and
                 t[2][1] == sum(r[4] for r in t[1] if r[5] == "recomputed") and
                 t[2][2] == sum(r[4] for r in t[1] if r[5] == "swapped") and t[2][3] == t[0] and
                 t[2][4] == t[0] * t[2][0] for t in tables.values())
    a = ALL.search(out)
    kept = sum(t[2][4] for t in tables.values()) if one_ok else -1
    act = category_bytes(out, "activations")
    check(f"saved {name}: per-block and all-block totals", one_ok and a and int(a.group(2)) == kept and
          int(a.group(1)) == 5, out)
    rest = act - kept
    check(f"saved {name}: act peak {act} = kept {kept} + {outside_blocks(N)} outside the blocks" +
          (" + the backward's transients" if transient else ""),
          rest >= outside_blocks(N) if transient else rest == outside_blocks(N), f"rest {rest}")
    check(f"saved {name}: the last line says the difference", f"act peak {act} bytes = the blocks' kept {kept} + "
          f"{rest}:" in out, out)


sums_agree("off", off.stdout, t_off)


def flips(name, flag, want):
    """The rows whose status differs from off are exactly those of the flag's units on the main layers."""
    r = memplan(flag, "--saved-activations")
    t = saved_tables(r.stdout)
    changed = {(k, a[0]) for k in kinds for a, b in zip(t_off[k][1], t[k][1]) if a != b}
    same_rows = all([x[:5] for x in t[k][1]] == [x[:5] for x in t_off[k][1]] for k in kinds)
    expect = {(k, row[0]) for k in kinds if not k.startswith("MTP") for row in t_off[k][1] if row[0] in want}
    check(f"saved {name}: exactly its units' tensors recomputed, MTP's kept", r.returncode == 0 and list(t) == kinds
          and same_rows and changed == expect and all(row[5] == "recomputed" for k in kinds if not k.startswith("MTP")
          for row in t[k][1] if row[0] in want), f"changed {sorted(changed ^ expect)}")
    sums_agree(name, r.stdout, t)


flips("--recompute-csa-attention", "--recompute-csa-attention", ATTN)
flips("--mhc-recompute", "--mhc-recompute", MHC)

r = memplan("--recompute-norm", "--recompute-norm-num-layers", "2", "--saved-activations")
t = saved_tables(r.stdout)
normed = [k.split(" #")[1] for k in t if any(row[5] == "recomputed" for row in t[k][1])]
check("saved --recompute-norm-num-layers 2: the CSA kind split, only blocks 0 and 1 recompute their norms",
      r.returncode == 0 and [k.split(" ")[0] for k in t] == ["sliding", "CSA", "HCA", "CSA", "MTP"] and
      normed == ["0", "1"] and all({row[0] for row in t[k][1] if row[5] == "recomputed"} == {"attn_norm", "ffn_norm"}
                                   for k in t if k.split(" #")[1] in normed), r.stdout)
sums_agree("--recompute-norm-num-layers 2", r.stdout, t)

r = memplan("--mixed-precision-param", "bfloat16", "--saved-activations")
t_bf = saved_tables(r.stdout)
halved = [(a, b) for k in kinds for a, b in zip(t_off[k][1], t_bf[k][1]) if b[3] == "bf16"]
check("saved bf16: bf16 rows are half their fp32 bytes, the others unchanged", r.returncode == 0 and
      list(t_bf) == kinds and all(a[3] == "fp32" and b[4] * 2 == a[4] for a, b in halved) and
      all(a == b for k in kinds for a, b in zip(t_off[k][1], t_bf[k][1]) if b[3] != "bf16"), r.stdout)
held = {(k.split(" ")[0], b[0], b[1]) for k in kinds for a, b in zip(t_off[k][1], t_bf[k][1]) if b[3] == "bf16"}
check("saved bf16: the streams and projections bf16; statistics, softmax and router fp32",
      ("CSA", "input", "X_in") in held and ("MTP", "input", "X_in") not in held and ("CSA", "moe", "h1") in held and
      ("CSA", "kv", "kv") in held and not any(x[2] in ("mixes", "comb", "rstd", "lse", "logits", "scores", "w")
                                                for x in held), str(sorted(held)))
sums_agree("bf16", r.stdout, t_bf, transient=True)

r = memplan("--swap-layer-input", "--saved-activations")
t_sw = saved_tables(r.stdout)
sw = ALL.search(r.stdout)
off_act = re.search(r"offload tier \(outside memory\)\n  activations +(\d+) ", r.stdout)
check("saved --swap-layer-input: main layers' inputs swapped, MTP's kept, the offload tier's act is theirs",
      r.returncode == 0 and sw and off_act and int(sw.group(4)) == 4 * 131072 == int(off_act.group(1)) and
      all(row[5] == ("kept" if k.startswith("MTP") else "swapped") for k in kinds for row in t_sw[k][1]
          if row[0] == "input"), r.stdout)
r = run_plan("--mhc-recompute", "--saved-activations")
check("saved with --config: the flags' tables", r.returncode == 0 and saved_tables(r.stdout) ==
      saved_tables(memplan("--mhc-recompute", "--saved-activations").stdout), r.stdout + r.stderr)
r = memplan("--world", "2", "--ep", "2", "--saved-activations")
moe = [row for row in saved_tables(r.stdout).get(kinds[1], (0, []))[1] if row[0] == "moe"]
check("saved under EP 2: the received rows (balanced: 256 of them) saved too", r.returncode == 0 and
      ("moe", "xr", "256, 64", "fp32", 65536, "kept") in moe and ("moe", "h1", "256, 32", "fp32", 32768, "kept") in moe,
      str(moe))
# 63 tokens, K 2, 8 experts: 126 assignments, experts 0-5 get 16 and 6-7 get 15; each rank's two sources
# send what it sends, so rank 0 (experts 0-3) computes 2 x 64 rows, rank 1 (experts 4-7) 2 x 62
for rank, rows in [(0, 128), (1, 124)]:
    r = memplan("--seq", "63", "--micro-batch", "1", "--world", "2", "--ep", "2", "--rank", str(rank),
                "--saved-activations")
    t = saved_tables(r.stdout)
    xr = [row for row in t.get(kinds[1], (0, []))[1] if row[1] == "xr"]
    check(f"saved under EP 2, rank {rank} of uneven routing: {rows} received rows", r.returncode == 0 and
          xr == [("moe", "xr", f"{rows}, 64", "fp32", rows * 64 * 4, "kept")], str(xr))
    sums_agree(f"EP 2 rank {rank}", r.stdout, t, N=63)
expect_error("saved activations with --policies", ["--policies", "--saved-activations"], "--saved-activations",
             "--policies")

# --memory-report: the grads and workspace peaks by what held them, after the unchanged plan
GRAD_ROW = re.compile(r"^  (\S.*?) +(\d+) +[\d.]+(?:  (\d+) groups?)?$")
WORK_ROW = re.compile(r"^  (\S.*?) +(\d+) +[\d.]+ +(\d+)$")


def report(out):
    """({grads owner: (bytes, groups)}, grads sum, [(workspace user, most, at peak)], workspace sum)."""
    g = out.split("grads at their peak, by what held them:\n", 1)[-1].split("workspace users", 1)
    grads, gsum = {}, None
    for line in g[0].splitlines():
        m, t = GRAD_ROW.match(line), re.match(r"^  sum +(\d+) +[\d.]+  \(grads peak \d+\)$", line)
        if t:
            gsum = int(t.group(1))
        elif m:
            grads[m.group(1)] = (int(m.group(2)), int(m.group(3) or 0))
    users, wsum = [], None
    for line in (g[1] if len(g) > 1 else "").splitlines():
        m = WORK_ROW.match(line)
        if m:
            users.append((m.group(1), int(m.group(2)), int(m.group(3))))
        w = re.match(r"^  sum +(\d+)  \(workspace peak (\d+)\)$", line)
        if w:
            wsum = int(w.group(1))
    return grads, gsum, users, wsum


def report_agrees(name, r):
    grads, gsum, users, wsum = report(r.stdout)
    gpeak, wpeak = category_bytes(r.stdout, "grads"), category_bytes(r.stdout, "workspace")
    check(f"report {name}: exit 0, owners sum to the grads peak {gpeak}", r.returncode == 0 and grads and
          sum(b for b, _ in grads.values()) == gsum == gpeak, r.stdout + r.stderr)
    check(f"report {name}: users largest first, at-peak bytes sum to the workspace peak {wpeak}", users and
          [u[1] for u in users] == sorted((u[1] for u in users), reverse=True) and
          sum(u[2] for u in users) == wsum == wpeak and all(u[2] <= u[1] for u in users), r.stdout)
    return grads, users


check("report: nothing without the flag", "grads at their peak" not in plain.stdout and
      "workspace users" not in plain.stdout, plain.stdout)
r = memplan("--memory-report")
check("report: the plan's lines first and unchanged", without_time(r.stdout).startswith(without_time(plain.stdout)),
      r.stdout)
grads, users = report_agrees("one process", r)
check("report one process: all gradients resident", list(grads) == ["resident fp32 gradients"], grads)
r2 = memplan("--world", "2", "--ep", "2", "--memory-report")
grads, _ = report_agrees("2 ranks", r2)
check("report 2 ranks: resident shard, a group open, one in flight (prefetch depth 1)",
      grads.get("resident fp32 gradients", (0, 0))[0] > 0 and grads.get("unsharded, group in its backward",
      (0, 0))[1] >= 1 and grads.get("unsharded, reduce-scatter in flight", (0, 0))[1] == 1, r2.stdout)
r0 = memplan("--world", "2", "--ep", "2", "--prefetch-depth", "0", "--memory-report")
grads0, _ = report_agrees("2 ranks, blocking", r0)
check("report 2 ranks, blocking: nothing in flight", "unsharded, reduce-scatter in flight" not in grads0, r0.stdout)
# which workspace grows with the tokens: twice T, the model's buffers of [N, ...] and attention's workspace grow
# with it, the GEMM's packing reservation does not
r128 = subprocess.run([ds4, *BASE[:4], "128", *BASE[5:], "--memory-report"], capture_output=True, text=True,
                      timeout=60)
_, users128 = report_agrees("seq 128", r128)
most64, most128 = {u[0]: u[1] for u in users}, {u[0]: u[1] for u in users128}
check("report: block gradient buffers, stream gradients, sparse attention backward grow with T",
      all(most128.get(k, 0) > most64.get(k, 0) > 0 for k in
          ["block backward: gradient buffers", "backward: stream gradients", "op sparse_attn_bwd"]), (most64, most128))
check("report: the GEMM packing reservation does not grow with T",
      most128.get("op gemm_workspace_reserve") == most64.get("op gemm_workspace_reserve") > 0, (most64, most128))
r = run_plan("--training.global_batch_size", "4", "--parallel.ep", "2", "--world", "2", "--memory-report")
check("report with --config: the flags' report", r.returncode == 0 and
      report(r.stdout) == report(r2.stdout), r.stdout + r.stderr)
expect_error("report with --policies", ["--policies", "--memory-report"], "--memory-report", "--policies")

# a pipeline (docs/pipeline.md): every stage's column; pp x fsdp (--world a multiple of pp, EP inside each stage)
# plans the ranks of --rank's data rank; --policies under --pp: a row per policy a pipeline runs, each stage's
# peak, the largest, and the rows equal the plans of the policy's own flags
PP = ["--pp", "2"]


def stage_peaks(out):
    m = re.search(r"^  peak total((?: +\d+)+)$", out, re.M)
    return [int(v) for v in m.group(1).split()] if m else None


pp1 = memplan(*PP)
fs = memplan(*PP, "--world", "4")
ep = memplan(*PP, "--world", "4", "--ep", "2", "--rank", "1")
check("pp 2: two stage columns", pp1.returncode == 0 and len(stage_peaks(pp1.stdout) or []) == 2, pp1.stdout)
check("pp 2 x fsdp 2: the ranks of data rank 0 (0 and 2), each below its stage's peak on pp ranks alone",
      fs.returncode == 0 and "world 4 = pp 2 x fsdp 2" in fs.stdout and re.search(r"rank 0 +rank 2", fs.stdout) and
      all(a < b for a, b in zip(stage_peaks(fs.stdout) or [0, 0], stage_peaks(pp1.stdout) or [0, 0])),
      fs.stdout + pp1.stdout)
check("pp 2 x fsdp 2 EP 2, --rank 1: the ranks of data rank 1 (1 and 3), EP 2 said",
      ep.returncode == 0 and re.search(r"rank 1 +rank 3", ep.stdout) and "EP 2 inside each stage" in ep.stdout and
      len(stage_peaks(ep.stdout) or []) == 2, ep.stdout + ep.stderr)
for name, world in (("pp 2", []), ("pp 2 x fsdp 2 EP 2", ["--world", "4", "--ep", "2"])):
    r = memplan(*PP, *world, "--policies")
    rows = [l.split() for l in r.stdout.splitlines() if re.match(r"^  \S.* +\d+ +[\d.]+$", l)]
    names = [" ".join(x[:-5]) for x in rows]  # 2 stage columns, max GiB, max bytes, offload GiB
    base = ["off", "csa", "mhc", "norm", "csa+mhc", "csa+mhc+norm", "full"]
    check(f"{name} --policies: the 28 policies, the layer-input swap's too", r.returncode == 0 and
          names == base + [n + x for x in (" +swap-opt", " +swap-in", " +swap-opt+in") for n in base],
          r.stdout + r.stderr)
    for i, flags in ((0, []), (1, ["--recompute-csa-attention"]),
                     (6, ["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "1"]),
                     (12, ["--recompute-csa-attention", "--mhc-recompute", "--recompute-norm", "--swap-optimizer"]),
                     (14, ["--swap-layer-input"]), (22, ["--recompute-csa-attention", "--swap-optimizer",
                                                         "--swap-layer-input"])):
        one = stage_peaks(memplan(*PP, *world, *flags).stdout)
        check(f"{name} --policies row {names[i] if i < len(names) else i}: its max is the largest stage's plan",
              one and i < len(rows) and int(rows[i][-2]) == max(one), (rows[i] if i < len(rows) else None, one))
    check(f"{name} --policies: full recompute below off on every stage", len(rows) == 28 and
          all(float(f) < float(o) for f, o in zip(rows[6][1:-3], rows[0][1:-3])), rows[:7])
    check(f"{name} --policies: the layer-input swap's largest peak below off's", len(rows) == 28 and
          int(rows[14][-2]) < int(rows[0][-2]), (rows[0], rows[14] if len(rows) > 14 else None))
# --device-memory with --pp: the margin row is device - each column's peak, the count of those that fit and the
# largest peak's line; at exactly the largest peak all fit with 0 free, a byte less and the largest is 1 over
peaks = stage_peaks(ep.stdout) or [0, 0]
STAGE_FIT = re.compile(r"^device memory [\d.]+ GiB \((\d+) bytes\): (\d+) of (\d+) stages' ranks fit; the largest "
                       r"peak \(rank (\d+)\) (?:fits, [\d.]+ GiB \((\d+) bytes\) free at its peak|does not fit: "
                       r"[\d.]+ GiB \((\d+) bytes\) over)$", re.M)
for dev in (max(peaks), max(peaks) - 1, min(peaks), min(peaks) - 1):
    r = memplan(*PP, "--world", "4", "--ep", "2", "--rank", "1", "--device-memory", str(dev))
    m = re.search(r"^  margin((?: +-?\d+)+)$", r.stdout, re.M)
    f = STAGE_FIT.search(r.stdout)
    want_fit = sum(p <= dev for p in peaks)
    worst = 1 + 2 * peaks.index(max(peaks))
    check(f"pp 2 x fsdp 2 --device-memory {dev}: margins, {want_fit} of 2 fit, the largest's line",
          r.returncode == 0 and stage_peaks(r.stdout) == peaks and m is not None and
          [int(v) for v in m.group(1).split()] == [dev - p for p in peaks] and f is not None and
          (int(f.group(1)), int(f.group(2)), int(f.group(3)), int(f.group(4))) == (dev, want_fit, 2, worst) and
          (int(f.group(5)) if f.group(5) else -int(f.group(6))) == dev - max(peaks), r.stdout + r.stderr)
r = memplan(*PP, "--world", "4", "--ep", "2", "--policies")
pol = {" ".join(x[:-5]): int(x[-2]) for x in
       (l.split() for l in r.stdout.splitlines() if re.match(r"^  \S.* +\d+ +[\d.]+$", l))}
dev = (pol.get("off", 0) + pol.get("full", 0)) // 2
r = memplan(*PP, "--world", "4", "--ep", "2", "--policies", "--device-memory", str(dev))
fits = [(" ".join(x[:-7]), x[-3], int(x[-2]), int(x[-4])) for x in
        (l.split() for l in r.stdout.splitlines() if re.match(r"^  \S.* (yes|no) +-?\d+ +[\d.]+$", l))]
check("pp 2 x fsdp 2 --policies --device-memory between full's and off's max: fits and margin columns",
      r.returncode == 0 and len(fits) == 28 and all(n in pol and mx == pol[n] and mg == dev - mx and
                                                    yn == ("yes" if mx <= dev else "no") for n, yn, mg, mx in fits)
      and {y for _, y, _, _ in fits} == {"yes", "no"}, r.stdout + r.stderr)
# --memory-report with --pp: the report of rank --rank after the table; its owners sum to that rank's column's
# grads and workspace peaks
for name, args, col in (("pp 2, pp rank 1", ["--world", "2", "--rank", "1"], 1),
                        ("pp 2 x fsdp 2 EP 2, rank 3", ["--world", "4", "--ep", "2", "--rank", "3"], 1)):
    r = memplan(*PP, *args, "--memory-report")
    grads, gsum, users, wsum = report(r.stdout)
    row = {k: [int(v) for v in m.group(1).split()] for k in ("grads", "workspace")
           for m in [re.search(r"^  %s((?: +\d+)+)$" % k, r.stdout, re.M)] if m}
    check(f"report {name}: after the table, the owners sum to its column's grads and workspace peaks",
          r.returncode == 0 and "memory report of " in r.stdout and len(row) == 2 and grads and users and
          sum(b for b, _ in grads.values()) == gsum == row["grads"][col] and
          sum(u[2] for u in users) == wsum == row["workspace"][col], r.stdout + r.stderr)
check("report pp 2 x fsdp 2: a group open and a reduce-scatter in flight, the MTP rows on the head's stage",
      grads.get("unsharded, reduce-scatter in flight", (0, 0))[1] == 1 and
      grads.get("unsharded, group in its backward", (0, 0))[1] >= 1 and "MTP embedding rows, waiting" in grads, grads)

# --saved-activations with --pp: after the table, each stage's rank's blocks (a micro-batch's tables, as one
# process prints them), the kept bytes of the passes its schedule keeps at once, against its column's act peak
STAGE_ALL = re.compile(r"^all (\d+) blocks of its chunks:((?: chunk \d+ \d+)+); (\d+) bytes kept a micro-batch", re.M)
FLIGHT = re.compile(r"^in flight where they keep the most \((1F1B|interleaved 1F1B) of (\d+) micro-batches\):"
                    r"((?: chunk \d+ x \d+)+); (\d+) bytes kept", re.M)
STAGE_ACT = re.compile(r"^act peak (\d+) bytes = the in-flight blocks' kept (\d+) \+ (-?\d+):", re.M)


def stage_saved(out):
    """Per stage's section: (tables, blocks, {chunk: kept}, kept a micro-batch, {chunk: passes}, kept in flight,
    act peak, rest)."""
    parts = out.split("saved activations of ")[1:]
    got = []
    for part in parts:
        a, f, x = STAGE_ALL.search(part), FLIGHT.search(part), STAGE_ACT.search(part)
        if not (a and f and x):
            return None
        chunks = dict(map(int, c.split()) for c in re.findall(r"chunk (\d+ \d+)", a.group(2)))
        flight = dict(map(int, c.split(" x ")) for c in re.findall(r"chunk (\d+ x \d+)", f.group(3)))
        got.append((saved_tables("saved activations:" + part), int(a.group(1)), chunks, int(a.group(3)), flight,
                    int(f.group(4)), int(x.group(1)), int(x.group(3))))
    return got


def act_row(out):
    m = re.search(r"^  activations((?: +\d+)+)$", out, re.M)
    return [int(v) for v in m.group(1).split()] if m else []


N = 128  # --seq 64 x --micro-batch 2
r = memplan(*PP, "--saved-activations")
st = stage_saved(r.stdout)
acts = act_row(r.stdout)
check("saved pp 2: the table unchanged, then a section per stage's rank", r.returncode == 0 and st and len(st) == 2
      and re.sub(r"planned in [\d.]+ s", "", r.stdout).startswith(re.sub(r"planned in [\d.]+ s", "", pp1.stdout))
      and "of pp rank 0 (stage 0)" in r.stdout and
      "of pp rank 1 (stage 1)" in r.stdout, r.stdout + r.stderr)
if st and len(st) == 2:
    # every block on one stage: the stages' tables are one process's, split; the kept bytes add up to its
    whole = {k.split(" #")[0]: t[1] for k, t in t_off.items()}
    firsts = [[k.split(" #")[1] for k in s_[0]] for s_ in st]
    check("saved pp 2: stage 0 has blocks 0 and 1, stage 1 blocks 2, 3 and the MTP block, each kind's rows one "
          "process's", [s_[1] for s_ in st] == [2, 3] and firsts == [["0", "1"], ["2", "3", "4"]] and
          all(t[1] == whole.get(k.split(" #")[0]) for s_ in st for k, t in s_[0].items()), firsts)
    one_all = int(ALL.search(off.stdout).group(2))
    check("saved pp 2: the stages' kept a micro-batch add up to one process's blocks", st[0][3] + st[1][3] == one_all
          and st[0][2] == {0: st[0][3]} and st[1][2] == {1: st[1][3]}, (st[0][3], st[1][3], one_all))
    # 1F1B with 2 micro-batches keeps both on stage 0, one on stage 1; what is left of the act peak is each pass's
    # tensors outside the blocks: stage 0's token ids and the stream it hands on, the head's stage the whole
    # pass's (one process's outside_blocks)
    check("saved pp 2: in flight, stage 0 two micro-batches, stage 1 one", st[0][4] == {0: 2} and st[1][4] == {1: 1}
          and st[0][5] == 2 * st[0][3] and st[1][5] == st[1][3], (st[0][4:6], st[1][4:6]))
    check("saved pp 2: each act peak is its column's; kept in flight + each pass's outside tensors", acts and
          [s_[6] for s_ in st] == acts and st[0][7] == 2 * 4 * (2 * N + N * 4 * 64) and
          st[1][7] == outside_blocks(N), ([s_[6:] for s_ in st], acts))
# interleaved, pp x fsdp with EP, recompute: the sections follow the columns, kept in flight below each act peak
for name, args, chunks in (("pp 2 vpp 2", ["--vpp", "2"], [[0, 2], [1, 3]]),
                           ("pp 2 x fsdp 2 EP 2 csa", ["--world", "4", "--ep", "2", "--recompute-csa-attention"],
                            [[0], [1]])):
    r = memplan(*PP, *args, "--saved-activations")
    st, acts = stage_saved(r.stdout), act_row(r.stdout)
    check(f"saved {name}: a section per column, its chunks, kept in flight at most its act peak", r.returncode == 0
          and st and [s_[6] for s_ in st] == acts and [sorted(s_[2]) for s_ in st] == chunks and
          all(0 < s_[5] <= s_[6] and s_[5] == sum(s_[2][k] * n for k, n in s_[4].items()) for s_ in st),
          r.stdout[-3000:] + r.stderr)
    if "csa" in name:
        check(f"saved {name}: the CSA units recomputed on the main layers", st and any(
            row[5] == "recomputed" for s_ in st for k, t in s_[0].items() if not k.startswith("MTP") for row in t[1]
            if row[0] in ATTN), "")
# --config of a pipelined run: its rank's section, the --model form's of that stage (2 micro-batches a rank)
pm = stage_saved(memplan(*PP, "--saved-activations").stdout) or []
for rank in (0, 1):
    r = run_plan("--parallel.pp", "2", "--training.global_batch_size", "4", "--rank", str(rank), "--saved-activations")
    st = stage_saved(r.stdout)
    check(f"saved --config pp 2 rank {rank}: the --model form's section of stage {rank}, its act peak the plan's",
          r.returncode == 0 and st and len(st) == 1 and len(pm) == 2 and st[0] == pm[rank] and
          st[0][6] == int(dict(categories(r.stdout)).get("activations", -1)),
          r.stdout[-2000:] + r.stderr)
r = memplan(*PP, "--vpp", "2", "--saved-activations")
st = stage_saved(r.stdout)
check("saved pp 2 vpp 2: interleaving keeps several passes of each chunk on stage 0",
      st and sum(st[0][4].values()) > 2, st and st[0][4])
r = memplan(*PP, "--policies", "--saved-activations")
check("saved pp 2 with --policies: one error line", r.returncode == 2 and r.stdout == "" and
      r.stderr.count("\n") == 1 and "--saved-activations explains the plan of one policy" in r.stderr, r.stderr)

finish("test_memplan_cli")
