"""ds4's training step against Hugging Face transformers' DeepSeek-V4 on PyTorch: the same config, tokens,
weights and cores (or GPU: --device cuda), steps interleaved. Run through bench/torch_compare.sh, which makes the venv (.venv-bench)
with PyPI's torch and transformers and builds ds4; `--help` lists the options.

Engines (each a worker process answering one step per command, so that a run that runs out of memory or
time is reported and the others go on):
  ds4-fp32      build/bench/train_step: ds4_train_step in fp32
  ds4-bf16      the same, bf16 mixed precision (fp32 master weights, bf16 GEMM operands and activations)
  hf-eager      transformers' DeepseekV4ForCausalLM, eager attention, fp32
  hf-bf16       the same with bf16 weights (and bf16 AdamW state)
  hf-compile    the fp32 model under torch.compile (its compilation is in the untimed first step)
  ds4-before-fp32, ds4-before-bf16   with --before REV: ds4-fp32 / ds4-bf16 as the code was at REV (the same
                bench/train_step.c compiled against that tree; no kernel profile)
A step is forward + backward + gradient clipping to norm 1 + AdamW (lr 1e-4, betas 0.9/0.95, eps 1e-8,
weight decay 0.1) on one sequence of T tokens (batch 1). Each cell (T, threads) starts every engine, runs
one untimed step each, then --steps rounds in which every engine runs one step, the order rotating each
round so that a shared machine's drift hits all alike; the table gives each engine's median. Then, for the
ds4 engines, --profile-steps more steps with the kernel profile on (ds4/profile.h) give the breakdown.
Weights: `ds4 init` (seed 1) of the config, exported with `ds4 export --names hf --dtype f32`: both sides
start from the same weights, hash routing table included, so the losses of the first (untimed) step agree.
--device cuda runs every engine on the GPU (ds4 on its cuda backend, PyTorch with the model and the ids on
cuda:0, each step timed between two torch.cuda.synchronize()); with --peak-tflops the table adds tok/s and
MFU: the architecture's sparse-aware FLOPs of a training step (ds4_train_flops_per_token, the same count for
every engine: the model's work, not what an engine happens to compute) per second over the peak.
"""
import argparse
import datetime
import json
import os
import platform
import random
import select
import signal
import struct
import subprocess
import sys
import shutil
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENGINES = ["ds4-fp32", "ds4-bf16", "hf-eager", "hf-bf16", "hf-compile"]
COMPUTES = {
    "ds4-fp32": "LM loss + MTP loss + indexer KL loss; sparse attention (window + indexer top-k / HCA), fp32",
    "ds4-bf16": "the same, bf16 mixed precision (fp32 master weights and AdamW state)",
    "hf-eager": "LM loss only (no MTP, no indexer loss); attention dense over T x T then masked to the sparse "
                "pattern; fp32",
    "hf-bf16": "as hf-eager, weights, activations and AdamW state in bf16",
    "hf-compile": "as hf-eager, the model under torch.compile (default mode)",
    "ds4-before-fp32": "as ds4-fp32, the code at {rev}",
    "ds4-before-bf16": "as ds4-bf16, the code at {rev}",
}
BEFORE = ["ds4-before-fp32", "ds4-before-bf16"]


# ---------------------------------------------------------------- the PyTorch worker (runs in .venv-bench)

def hf_worker(a):
    """Loads the exported model and answers "step" with one timed training step (protocol of bench/train_step.c)."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(1)
    dtype = torch.bfloat16 if a.variant == "bf16" else torch.float32
    model, info = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation="eager",
                                                       output_loading_info=True)
    bad = {k: len(v) for k, v in info.items() if v}
    gpu = a.device == "cuda"
    model.to(a.device)
    model.train()
    fwd = torch.compile(model) if a.variant == "compile" else model
    raw = open(a.ids, "rb").read()
    ids = torch.tensor(struct.unpack(f"<{len(raw) // 4}i", raw), dtype=torch.long).view(1, -1).to(a.device)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    n = sum(p.numel() for p in model.parameters())
    print(f"ready {n}" + (f" loading-info {json.dumps(bad)}" if bad else ""), flush=True)
    for line in sys.stdin:
        if line.startswith("quit"):
            break
        if not line.startswith("step"):
            print(f"error unknown command {line.strip()!r}", flush=True)
            return 1
        try:
            sync()
            t0 = time.perf_counter()
            loss = fwd(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            dt = time.perf_counter() - t0
        except (MemoryError, RuntimeError) as e:  # torch's allocators failing raise RuntimeError (CUDA's OOM too)
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            oom = isinstance(e, MemoryError) or "memory" in msg.lower() or "alloc" in msg.lower()
            print(f"error {'OOM ' if oom else ''}{msg[:200]}", flush=True)
            return 1
        print(f"step {dt:.6f} {loss.item():.9g}", flush=True)
    return 0


# ---------------------------------------------------------------- the driver

class Worker:
    """One engine's process for one cell; None of proc once it has failed (status says how)."""

    def __init__(self, name, argv, env, cpus, mem_limit):
        self.name, self.status, self.times, self.first_loss, self.note = name, None, [], None, ""
        self.profile, self.peak = None, None  # peak: ds4's GEMM engine rate (FLOP/s) at these threads, on the cpu
        self.mem_limit, self.peak_rss = mem_limit, 0

        def pin():
            os.setpgrp()
            if cpus:
                os.sched_setaffinity(0, cpus)
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty stderr never blocks it
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     text=True, env=env, preexec_fn=pin)
        self.buf = b""

    def rss(self):
        """Resident bytes of the worker and its children (torch.compile's helpers)."""
        total = 0
        try:
            pids = [self.proc.pid] + [int(p) for p in open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()]
        except OSError:
            return 0
        for pid in pids:
            try:
                for ln in open(f"/proc/{pid}/status"):
                    if ln.startswith("VmRSS:"):
                        total += int(ln.split()[1]) * 1024
            except OSError:
                pass
        return total

    def kill(self):
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()

    def fail(self, status):
        self.status = status
        self.kill()

    def ask(self, cmd, limit, until=None):
        """Sends cmd; returns the answer's lines up to the one starting with `until` (None: one line), or None
        after marking the worker failed (time limit, memory limit, death, an error line)."""
        if self.status:
            return None
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except OSError:
            return self.died()
        lines, deadline = [], time.monotonic() + limit
        while True:
            ln = self.line(deadline, f"time limit ({limit:g} s)")
            if ln is None:
                return None
            if ln.startswith("error"):
                self.fail(("OOM: " if " OOM " in ln + " " else "failed: ") + ln[6:].replace("OOM ", "")[:160])
                return None
            lines.append(ln)
            if until is None or ln.startswith(until):
                return lines

    def line(self, deadline, why):
        """The worker's next stdout line, watching its memory meanwhile; None after marking it failed (`why`
        once deadline passes). Reads the pipe itself: a buffered reader would hide lines from select."""
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.fail(why)
                return None
            r, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            rss = self.rss()
            self.peak_rss = max(self.peak_rss, rss)
            if self.mem_limit and rss > self.mem_limit:
                self.fail(f"OOM (resident {rss / 2**30:.1f} GiB > the {self.mem_limit / 2**30:.1f} GiB limit)")
                return None
            if r:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    return self.died()
                self.buf += chunk
        ln, self.buf = self.buf.split(b"\n", 1)
        return ln.decode(errors="replace")

    def died(self):
        rc = self.proc.wait()
        self.err.seek(0)
        tail = self.err.read()[-600:].strip().replace("\n", " / ")
        if rc == -signal.SIGKILL:
            self.status = "killed (SIGKILL: the system's out-of-memory killer?)"
        else:
            self.status = f"exited {rc}: {tail[-200:]}"
        return None


def engine_argv(a, name, work, T, threads):
    ids = os.path.join(work, f"ids-{T}.bin")
    if name.startswith("ds4"):
        exe = os.path.join(a.before_build, "bench", "train_step_basic") if name in BEFORE else \
            os.path.join(a.build, "bench", "train_step")
        argv = [exe, "--model", os.path.join(work, "model"), "--ids", ids,
                "--seq", str(T), "--threads", str(threads), "--device", a.device]
        return argv + (["--bf16"] if name.endswith("bf16") else [])
    return [sys.executable, os.path.abspath(__file__), "--worker", "--variant", name[3:], "--model",
            os.path.join(work, "hf"), "--ids", ids, "--threads", str(threads), "--device", a.device]


def prepare(a, work, seqs):
    """The shared weights (ds4 init + export) and each T's token ids."""
    cfg = json.load(open(a.config))
    need = max(seqs)
    if cfg.get("max_position_embeddings", 0) < need:  # the rope tables' rows; the YaRN settings are unchanged
        cfg["max_position_embeddings"] = need
    with open(os.path.join(work, "config.json"), "w") as f:
        json.dump(cfg, f)
    ds4 = os.path.join(a.build, "ds4")
    for argv in ([ds4, "init", "--config", os.path.join(work, "config.json"), "--seed", "1", "--out",
                  os.path.join(work, "model")],
                 [ds4, "export", "--checkpoint", os.path.join(work, "model"), "--out", os.path.join(work, "hf"),
                  "--dtype", "f32", "--names", "hf", "--tokenizer", "none", "--quiet"]):
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"torch_compare: {' '.join(argv[:2])} failed: {r.stderr.strip()}")
    rng = random.Random(1234)
    for T in seqs:
        with open(os.path.join(work, f"ids-{T}.bin"), "wb") as f:
            f.write(struct.pack(f"<{T}i", *(rng.randrange(cfg["vocab_size"]) for _ in range(T))))
    return cfg


def median(x):
    s = sorted(x)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def run_cell(a, work, T, threads, log):
    """Every engine's steps at one (T, threads): the workers, each stopped before this returns."""
    cpus = sorted(os.sched_getaffinity(0))[:threads] if a.pin else None
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), OMP_PROC_BIND="false")
    workers = []
    try:
        for name in a.engines:
            w = Worker(name, engine_argv(a, name, work, T, threads), env, cpus, int(a.mem_limit_gib * 2**30))
            workers.append(w)
            ans = read_ready(w, a.setup_timeout)  # the worker says "ready" unasked once loaded
            if ans and "loading-info" in ans:
                w.note = "transformers' loading info: " + ans.split("loading-info", 1)[1].strip()
            if ans and "flops-per-token" in ans:
                a.flops_per_token[T] = float(ans.split("flops-per-token", 1)[1].split()[0])
            if ans and "peak-gflops" in ans:
                w.peak = float(ans.split("peak-gflops", 1)[1].split()[0]) * 1e9
            log(f"  {name}: {'ready' if ans else w.status}")
        for w in workers:  # the untimed first step: first touch, torch.compile's compilation
            ans = w.ask("step", a.setup_timeout)
            if ans:
                w.first_loss = float(ans[0].split()[2])
            log(f"  {w.name}: first step {'loss ' + str(w.first_loss) if ans else w.status}")
        for k in range(a.steps):
            order = workers[k % len(workers):] + workers[:k % len(workers)]
            for w in order:
                ans = w.ask("step", a.cell_timeout)
                if ans:
                    w.times.append(float(ans[0].split()[1]))
            log(f"  round {k + 1}/{a.steps}: " + ", ".join(f"{w.name} {w.times[-1]:.3f}" if not w.status else
                                                           f"{w.name} -" for w in order))
        for w in workers:
            if a.profile_steps and w.name.startswith("ds4") and w.name not in BEFORE:
                ans = w.ask(f"profile {a.profile_steps}", a.cell_timeout * a.profile_steps, until="end")
                if ans:
                    w.profile = "\n".join(ans[:-1])
        for w in workers:
            if not w.status:
                w.proc.stdin.write("quit\n")
                w.proc.stdin.flush()
    except OSError:
        pass  # a worker that died is reported by its status
    finally:
        for w in workers:
            try:
                w.proc.wait(timeout=0 if w.status else 60)
            except subprocess.TimeoutExpired:
                pass
            w.kill()
    return workers


def read_ready(w, limit):
    """The worker's "ready" line, which it prints unasked once loaded."""
    ln = w.line(time.monotonic() + limit, f"time limit ({limit:g} s) while loading")
    if ln is not None and not ln.startswith("ready"):
        w.fail("failed: " + (ln[6:] if ln.startswith("error") else ln)[:160])
        return None
    return ln


def gpu_name():
    r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    return r.stdout.strip().splitlines()[0] if r and r.returncode == 0 and r.stdout.strip() else "no nvidia-smi"


def machine():
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    mem = next((int(ln.split()[1]) // 2**20 for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    return f"{cpu}, {os.cpu_count()} CPUs ({' '.join(isa)}), {mem} GiB, {platform.system()} {platform.release()}"


def versions(a):
    try:
        import torch
        import transformers
        tv = f"torch {torch.__version__} ({a.torch_source}), transformers {transformers.__version__}"
    except ImportError as e:
        tv = f"torch/transformers not importable here: {e}"
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    info = subprocess.run([os.path.join(a.build, "ds4"), "info"], capture_output=True, text=True).stdout
    eng = "; ".join(ln.strip() for ln in info.splitlines() if ln.startswith(("isa level", "gemm fp32", "gemm bf16",
                                                                             "other kernels")))
    return (f"ds4 {rev}{' (uncommitted changes)' if dirty else ''} ({eng}); {tv}; "
            f"Python {platform.python_version()}")


def report(a, cfg, cells, started, load0):
    out = []
    p = out.append
    where = f"the GPU ({gpu_name()})" if a.device == "cuda" else "the CPU"
    p(f"# ds4 vs transformers' DeepSeek-V4: a training step on {where} ({started:%Y-%m-%d %H:%M} UTC)\n")
    p(f"- machine: {machine()}; load average {load0[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    if a.note:
        p(f"- **{a.note}**")
    p(f"- {versions(a)}")
    p(f"- config: `{os.path.relpath(a.config, ROOT)}` ({cfg['num_hidden_layers']} layers + "
      f"{cfg.get('num_nextn_predict_layers', 0)} MTP, dim {cfg['hidden_size']}, {cfg['num_attention_heads']} heads, "
      f"{cfg['n_routed_experts']} routed experts top-{cfg['num_experts_per_tok']}, compress ratios "
      f"{cfg['compress_ratios']}, window {cfg['sliding_window']}, index top-k {cfg['index_topk']}); batch 1; "
      f"max_position_embeddings raised to {cfg['max_position_embeddings']} where a T needs it")
    p(f"- command: `bench/torch_compare.sh {a.argv}`")
    p(f"- per engine and cell: 1 untimed step, then the median of {a.steps} timed steps, engines interleaved; "
      f"limits: {a.cell_timeout:g} s a step ({a.setup_timeout:g} s to load + first step), "
      f"{a.mem_limit_gib:.1f} GiB resident; threads pinned to the first N CPUs: {'yes' if a.pin else 'no'}")
    p("- weights: the same on both sides (`ds4 init --seed 1`, exported with `ds4 export --names hf --dtype f32`; the "
      "hash layers' `tid2eid` table included, not zeros); the same token ids; 'loss, step 1' is the LM loss of the "
      "untimed first step, from the shared initial weights\n")
    p("What each engine computes:\n")
    for e in a.engines:
        p(f"- `{e}`: {COMPUTES[e].format(rev=a.before)}")
    p("")
    for (T, th), ws in cells:
        base = next((w for w in ws if w.name == "ds4-fp32" and w.times), None)
        p(f"## T = {T}, {th} thread{'s' if th > 1 else ''}\n")
        fpt = a.flops_per_token.get(T)
        mfu = bool(a.peak_tflops and fpt)
        gemm = bool(fpt and any(w.peak for w in ws))
        p("| engine | s/step (median) | min | max | vs ds4 fp32 | tok/s |" + (" MFU |" if mfu else "") +
          (" of GEMM peak |" if gemm else "") + " loss, step 1 | peak RSS GiB | notes |")
        p("|---|---:|---:|---:|---:|---:|" + ("---:|" if mfu else "") + ("---:|" if gemm else "") + "---:|---:|---|")
        for w in ws:
            if w.times:
                m = median(w.times)
                rel = f"{median(base.times) / m:.2f}x" if base else ""
                cols = f"{m:.3f} | {min(w.times):.3f} | {max(w.times):.3f} | {rel} | {T / m:.0f}"
                if mfu:
                    cols += f" | {100 * fpt * T / m / (a.peak_tflops * 1e12):.1f}%"
                if gemm:
                    cols += f" | {100 * fpt * T / m / w.peak:.0f}% of {w.peak / 1e9:.0f}" if w.peak else " | "
            else:
                cols = f"**{w.status or 'no step'}** | | | | " + ("| " if mfu else "") + ("| " if gemm else "")
            note = "; ".join(x for x in (w.note, w.status if w.times and w.status else "") if x)
            loss = f"{w.first_loss:.5f}" if w.first_loss is not None else ""
            p(f"| {w.name} | {cols} | {loss} | {w.peak_rss / 2**30:.2f} | {note} |")
        p("\nvs ds4 fp32: ds4 fp32's median / this median (> 1: faster than ds4 fp32)." +
          (f" MFU: {fpt:.4g} FLOPs per token (ds4_train_flops_per_token at this T, the architecture's sparse-aware "
           f"work, the same for every engine) x tok/s over {a.peak_tflops:g} TFLOP/s." if mfu else "") +
          (f" of GEMM peak: the same {fpt:.4g} FLOPs per token x tok/s over the engine's own GEMM rate at these "
           "threads (GFLOP/s, ds4_probe_gemm_rate: a 512^3 product of its GEMM engine and precision, best of repeats, in "
           "CPU time), measured by each ds4 worker as it starts." if gemm else "") + "\n")
        for w in ws:
            if w.profile:
                p(f"### {w.name}: kernel profile (ds4/profile.h; {a.profile_steps} more step{'s' if a.profile_steps > 1 else ''}, "
                  f"per step; GFLOP estimated from the ops' arguments)\n")
                p(w.profile + "\n")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", default="1024,4096,16384", help="comma-separated T values (default 1024,4096,16384)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--engines", default=None, help=f"comma-separated subset of {','.join(ENGINES + BEFORE)} "
                    "(default: all; the ds4-before ones with --before)")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also time ds4 as it was at commit REV (built by torch_compare.sh under build/before/)")
    ap.add_argument("--before-build", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=7, help="timed steps per engine and cell (default 7)")
    ap.add_argument("--quick", action="store_true", help="3 timed steps, 1 profiled step (a check that it all runs)")
    ap.add_argument("--profile-steps", type=int, default=2, help="ds4 steps with the kernel profile (default 2; 0: none)")
    ap.add_argument("--cell-timeout", type=float, default=900, help="seconds one timed step may take (default 900)")
    ap.add_argument("--setup-timeout", type=float, default=1800,
                    help="seconds to load and run the first, untimed step (torch.compile compiles there; default 1800)")
    ap.add_argument("--mem-limit-gib", type=float, default=None,
                    help="resident memory one engine may reach before it is stopped and reported OOM "
                         "(default: 80%% of the memory available at the start)")
    ap.add_argument("--config", default=os.path.join(ROOT, "bench", "configs", "recompute-flash-shape.json"))
    ap.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin engines to the first N CPUs")
    ap.add_argument("--note", default="", help="a line for the report's header (e.g. 'machine loaded')")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where every engine runs (cuda: ds4's cuda backend and PyTorch on cuda:0; default cpu)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the machine's peak for the MFU column (e.g. 989 for an H200's dense bf16); none: no MFU")
    ap.add_argument("--out", default=None, help="report file (default bench/results/torch-compare/DATE-TIME.md)")
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--torch-source", default="?", help=argparse.SUPPRESS)
    # worker mode (the driver starts it)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.threads = int(a.threads)
        return hf_worker(a)
    a.argv = os.environ.get("DS4_BENCH_ARGS", " ".join(sys.argv[1:]))
    a.flops_per_token = {}
    try:
        seqs = [int(x) for x in a.seq.split(",")]
        threads = [int(x) for x in a.threads.split(",")]
    except ValueError:
        ap.error("--seq and --threads take comma-separated integers")
    known = ENGINES + (BEFORE if a.before else [])
    a.engines = a.engines.split(",") if a.engines else known
    bad = [e for e in a.engines if e not in known]
    if bad or not a.engines:
        ap.error(f"--engines: unknown {','.join(bad)} (known: {','.join(known)}; ds4-before-* need --before REV)")
    if a.before and not a.before_build:
        ap.error("--before: run through bench/torch_compare.sh, which builds REV's tree")
    if a.quick:
        a.steps, a.profile_steps = 3, min(a.profile_steps, 1)
    if a.steps < 1 or min(seqs) < 2 or min(threads) < 1 or max(threads) > len(os.sched_getaffinity(0)):
        ap.error(f"need --steps >= 1, --seq >= 2 and 1 <= --threads <= {len(os.sched_getaffinity(0))} (this process's CPUs)")
    if a.mem_limit_gib is None:
        avail = next(int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemAvailable"))
        a.mem_limit_gib = 0.8 * avail / 2**20
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("torch_compare: terminated"))  # so the workers are stopped
    started = datetime.datetime.now(datetime.timezone.utc)
    load0 = os.getloadavg()
    out = a.out or os.path.join(ROOT, "bench", "results", "torch-compare", f"{started:%Y-%m-%d-%H%M}.md")
    cells = []
    with tempfile.TemporaryDirectory(prefix="ds4-torch-compare-") as work:
        cfg = prepare(a, work, seqs)
        for T in seqs:
            for th in threads:
                print(f"torch_compare: T={T}, {th} thread(s)", file=sys.stderr, flush=True)
                ws = run_cell(a, work, T, th, lambda s: print(s, file=sys.stderr, flush=True))
                cells.append(((T, th), ws))
    text = report(a, cfg, cells, started, load0)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(text)
    print(f"torch_compare: written {os.path.relpath(out, ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
