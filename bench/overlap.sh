#!/usr/bin/env bash
# Overlap of communication with compute, measured on one machine: the Flash-shaped bench config under
# `mpirun -np 4 --parallel.ep 2` with a simulated link (default 25 Gb/s, 10 us), blocking collectives
# (--prefetch-depth 0) against overlap (--prefetch-depth 1, the default), one run after the other in one
# invocation. With FBO=1 each rank runs 2 micro-batches a step and every depth runs without and with
# --moe-fb-overlap (forward(i) beside backward(i - 1), each one's EP all-to-alls under the other's
# compute): four runs. Prints the median over steps 2.. of step time, compute, exposed FSDP and exposed
# EP (rank 0's metrics.jsonl), and keeps rank traces in OUT (default /tmp/ds4-bench-overlap).
#   bash bench/overlap.sh [STEPS] [GBPS] [LATENCY_US]        FBO=1 bash bench/overlap.sh ...
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-7}
GBPS=${2:-25}
LAT=${3:-10}
NP=${NP:-4}
EP=${EP:-2}
FBO=${FBO:-0}
OUT=${OUT:-/tmp/ds4-bench-overlap}
DS4=${DS4:-build/ds4}
MB=1
RUNS="depth0 depth1"
if [ "$FBO" = 1 ]; then
    MB=2
    RUNS="depth0 depth0fbo depth1 depth1fbo"
fi
mkdir -p "$OUT"
# byte-level tokens of ds4's own documentation (the values do not matter to timing)
if [ ! -f "$OUT/data/train_000000.bin" ]; then
    cat README.md docs/*.md docs/*.md docs/*.md > "$OUT/corpus.txt"
    "$DS4" tokenize --input "$OUT/corpus.txt" --out "$OUT/data" --val-fraction 0.01 --overwrite >/dev/null
fi
cat > "$OUT/bench.toml" <<TOML
[model]
config = "bench/configs/recompute-flash-shape.json"
seed = 1
[training]
steps = $STEPS
seq_len = 256
global_batch_size = $((NP * MB))
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
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 OMP_NUM_THREADS=1
for run in $RUNS; do
    depth=${run:5:1}
    fbo=()
    [[ $run == *fbo ]] && fbo=(--moe-fb-overlap)
    rm -f "$OUT/$run.jsonl"
    mpirun -np "$NP" --bind-to none "$DS4" train --config "$OUT/bench.toml" --parallel.ep "$EP" \
        --prefetch-depth "$depth" "${fbo[@]}" --sim-link-gbps "$GBPS" --sim-link-latency-us "$LAT" \
        --metrics.jsonl "$OUT/$run.jsonl" --trace "$OUT/$run.trace.json" > "$OUT/$run.log" 2>&1
done
python3 - "$OUT" "$NP" "$EP" "$GBPS" "$LAT" "$MB" $RUNS <<'PY'
import json, statistics, sys
out, np_, ep, gbps, lat, mb, *runs = sys.argv[1:]
print(f"Flash-shaped bench, mpirun -np {np_} --parallel.ep {ep}, {mb} micro-batch(es) per rank, simulated link "
      f"{gbps} Gb/s {lat} us, medians over steps 2.. (rank 0)")
print("| prefetch depth | MoE FB overlap | steps | step time (s) | compute (s) | exposed FSDP (s) | exposed EP (s) | exposed total (s) |")
print("|---|---|---|---|---|---|---|---|")
for run in runs:
    rows = [json.loads(l) for l in open(f"{out}/{run}.jsonl")][1:]
    med = lambda k: statistics.median(r[k] for r in rows)
    tot = statistics.median(r["exposed_fsdp_time"] + r["exposed_ep_time"] for r in rows)
    d = run[5]
    print(f"| {d}{' (blocking)' if d == '0' else ''} | {'on' if run.endswith('fbo') else 'off'} | {len(rows)} | "
          f"{med('step_time'):.3f} | {med('compute_time'):.3f} | {med('exposed_fsdp_time'):.3f} | "
          f"{med('exposed_ep_time'):.3f} | {tot:.3f} |")
PY
