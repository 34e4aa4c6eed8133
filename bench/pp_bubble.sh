#!/usr/bin/env bash
# The pipeline bubble, measured against its theory: `mpirun -np P ds4 train --parallel.pp P` on the
# Flash-shaped bench config (4 decoder layers + 1 MTP, seq 256, 1 thread a rank) for 1F1B pp 2 and pp 4 with
# m = 4 and 8 micro-batches a step, interleaved 1F1B pp 2 vpp 2 with m = 4, and pp 2 m 8 on the layout
# Ettt|tmL (one layer less on the head's stage). Prints a table: the measured bubble (rank 0's metrics.jsonl
# pp_bubble, the mean over the ranks of each one's idle share of the schedule; the median over steps 2..),
# the idlest rank's (pp_bubble_max), the theory (p-1)/(m+p-1), interleaved (p-1)/(v*m+p-1) (every action of
# equal cost, no communication), the stage-cost model (each rank's list run with each chunk's measured
# forward and backward times from the trace, no communication, a core a rank), rank 0's schedule seconds
# (its first action to the drain) and s/step; then the chunks' times. Keeps each run's log, metrics and trace
# (--trace: the pp row shows each rank's F / B actions and its waits) in OUT (default
# /tmp/ds4-bench-pp-bubble). The ranks share this machine's cores: more ranks than cores oversubscribe (the
# output says how many there are, and the load average). FLAGS: more `ds4 train` flags for every run.
#   bash bench/pp_bubble.sh [STEPS]        CASES="2:1:4 2:1:8:Ettt|tmL" bash bench/pp_bubble.sh  (pp:vpp:m[:layout])
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-5}
OUT=${OUT:-/tmp/ds4-bench-pp-bubble}
DS4=${DS4:-build/ds4}
SEQ=${SEQ:-256}
CASES=${CASES:-"2:1:4 2:1:8 4:1:4 4:1:8 2:2:4 2:1:8:Ettt|tmL"}
read -r -a FLAGS <<<"${FLAGS:-}" # more `ds4 train` flags, e.g. FLAGS="--sim-link-gbps 10"
mkdir -p "$OUT"
LOAD0=$(cut -d' ' -f1-3 /proc/loadavg)
# byte-level tokens of ds4's own documentation (the values do not matter to timing)
if [ ! -f "$OUT/data/train_000000.bin" ]; then
    cat README.md docs/*.md docs/*.md docs/*.md > "$OUT/corpus.txt"
    "$DS4" tokenize --input "$OUT/corpus.txt" --out "$OUT/data" --val-fraction 0.01 --overwrite >/dev/null
fi
# a waiting rank yields its core (MPI_Wait spins otherwise, taking a core from a computing rank)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
export OMPI_MCA_mpi_yield_when_idle=1
run_name() { echo "pp$1_vpp$2_m$3${4:+_$(tr -d '|' <<<"$4")}"; }
for c in $CASES; do
    IFS=: read -r pp vpp m layout <<<"$c"
    run=$(run_name "$pp" "$vpp" "$m" "$layout")
    lay=()
    [ -n "$layout" ] && lay=(--parallel.layout "$layout")
    cat > "$OUT/$run.toml" <<TOML
[model]
config = "bench/configs/recompute-flash-shape.json"
seed = 1
[training]
steps = $STEPS
seq_len = $SEQ
global_batch_size = $m
micro_batch_size = 1
seed = 1
threads = 1
[optimizer]
lr = 1e-3
[data]
train = "$OUT/data/train_*.bin"
[metrics]
peak_tflops = 1.0
TOML
    rm -f "$OUT/$run.jsonl"
    mpirun -np "$pp" --bind-to none -x OMP_NUM_THREADS "$DS4" train --config "$OUT/$run.toml" --parallel.pp "$pp" \
        --parallel.vpp "$vpp" "${lay[@]}" "${FLAGS[@]}" --metrics.jsonl "$OUT/$run.jsonl" --trace "$OUT/$run.trace.json" \
        > "$OUT/$run.log" 2>&1
done
python3 - "$OUT" "$STEPS" "$SEQ" "$LOAD0" $CASES <<'PY'
import collections, json, os, re, statistics, sys
out, steps, seq, load0, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5:]


def cost_model(trace, pp, vpp, m):
    """The bubble (mean over the ranks) of each rank's list, in the trace's order, run with every action taking
    the median time its (F / B, chunk) took in steps 2.. and nothing else: sends cost nothing, a rank has a
    core to itself. What unequal stage costs alone give."""
    with open(trace) as f:
        spans = sorted((e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and
                        re.fullmatch(r"[FB] c\d+ mb\d+", e["name"])), key=lambda e: e["ts"])
    n, lists, took = 2 * m * vpp, collections.defaultdict(list), collections.defaultdict(list)
    for e in spans:
        op, k, mb = re.fullmatch(r"([FB]) c(\d+) mb(\d+)", e["name"]).groups()
        lists[e["pid"]].append((op, int(k), int(mb)))
        if len(lists[e["pid"]]) > n:  # step 1 warms up
            took[(op, int(k))].append(e["dur"] / 1e6)
    cost = {key: statistics.median(v) for key, v in took.items()}
    nc, end, free, idle = pp * vpp, {}, [0.0] * pp, []
    for r in range(pp):
        lists[r] = lists[r][:n]
    ptr = [0] * pp
    while any(ptr[r] < n for r in range(pp)):
        for r in range(pp):
            while ptr[r] < n:
                op, k, mb = lists[r][ptr[r]]
                deps = [("F", k - 1, mb)] if op == "F" and k > 0 else []
                deps += [("F", k, mb)] + ([("B", k + 1, mb)] if k < nc - 1 else []) if op == "B" else []
                if any(d not in end for d in deps):
                    break
                start = max([free[r]] + [end[d] for d in deps])
                free[r] = end[(op, k, mb)] = start + cost[(op, k)]
                ptr[r] += 1
    for r in range(pp):  # every rank's wall ends with the last one's (the pipeline drained)
        work = sum(cost[(op, k)] for op, k, _ in lists[r])
        idle.append((max(free) - work) / max(free))
    return sum(idle) / pp, cost


def schedule_seconds(trace, vpp, m):
    """The median over steps 2.. of rank 0's schedule: from its first span on the pp row of a step to the end
    of its last (the drain included)."""
    with open(trace) as f:
        spans = sorted((e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and e.get("pid") == 0 and
                        re.fullmatch(r"(wait )?[FB] c\d+ mb\d+|wait sends|wait drain", e["name"])),
                       key=lambda e: e["ts"])
    steps, actions = [[]], 0
    for e in spans:
        if actions == 2 * m * vpp and not e["name"].startswith("wait s") and e["name"] != "wait drain":
            steps.append([])
            actions = 0
        steps[-1].append(e)
        actions += bool(re.fullmatch(r"[FB] c\d+ mb\d+", e["name"]))
    return statistics.median((max(e["ts"] + e["dur"] for e in st) - st[0]["ts"]) / 1e6 for st in steps[1:])


cores = os.cpu_count()
print(f"ds4 pipeline bubble: bench/configs/recompute-flash-shape.json, seq {seq}, micro-batch 1, 1 thread a rank, "
      f"{steps} steps (medians over steps 2..); {cores} cores here, load average {load0} before the runs, "
      f"{' '.join(open('/proc/loadavg').read().split()[:3])} after")
print("| schedule | layout | pp | vpp | m | ranks/cores | bubble (mean over ranks) | idlest rank "
      "| theory (equal costs) | stage-cost model | schedule s | s/step |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
costs = []
for c in cases:
    pp, vpp, m, layout = (c.split(":") + [""])[:4]
    pp, vpp, m = int(pp), int(vpp), int(m)
    run = os.path.join(out, f"pp{pp}_vpp{vpp}_m{m}" + (f"_{layout.replace('|', '')}" if layout else ""))
    with open(run + ".jsonl") as f:
        rows = [json.loads(ln) for ln in f if ln.strip()][1:]
    med = lambda k: statistics.median(r[k] for r in rows)
    theory = (pp - 1) / (vpp * m + pp - 1)
    model, cost = cost_model(run + ".trace.json", pp, vpp, m)
    costs.append(f"pp {pp} vpp {vpp} m {m}{' ' + layout if layout else ''}: " + ", ".join(
        f"c{k} F {1e3 * cost[('F', k)]:.0f} B {1e3 * cost[('B', k)]:.0f}" for k in range(pp * vpp)))
    cell = layout.replace("|", "\\|") or "uniform"  # a markdown cell
    print(f"| {'1F1B' if vpp == 1 else 'interleaved 1F1B'} | {cell} | {pp} | {vpp} | {m} | {pp}/{cores} | "
          f"{100 * med('pp_bubble'):.1f}% | {100 * med('pp_bubble_max'):.1f}% | {100 * theory:.1f}% | "
          f"{100 * model:.1f}% | "
          f"{schedule_seconds(run + '.trace.json', vpp, m):.3f} | {med('step_time'):.3f} |")
print("\nEach chunk's forward and backward, ms (median over steps 2.., what the stage-cost model runs):")
for line in costs:
    print(f"- {line}")
PY
