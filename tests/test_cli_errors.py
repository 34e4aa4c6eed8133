"""Bad input to the ds4 CLI: each case exits non-zero with one `error:` line that names the file and
the tensor or key, and never crashes (no signal, no sanitizer report)."""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ref"))
import safetensors_io as st  # noqa: E402
import torch  # noqa: E402

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ds4 = os.path.join(build, "ds4")
passed = failed = 0


def run(*args):
    return subprocess.run([ds4, *args], capture_output=True, text=True, timeout=120)


def expect_error(name, args, *needles):
    global passed, failed
    r = run(*args)
    err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    ok = r.returncode not in (0,) and r.returncode > 0 and len(err) == 1 and all(n in err[0] for n in needles)
    ok = ok and "Sanitizer" not in r.stderr and "runtime error" not in r.stderr
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {name}: rc={r.returncode} stderr={r.stderr.strip()[:400]!r} wanted {needles}")


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model")
    r = run("init", "--config", "tests/configs/tiny-a.json", "--seed", "1", "--out", model)
    assert r.returncode == 0, r.stderr
    good = os.path.join(tmp, "b.safetensors")
    st.save(good, {"input_ids": torch.randint(0, 256, (1, 40), dtype=torch.int32)})
    out = os.path.join(tmp, "o.safetensors")

    bad_ids = os.path.join(tmp, "bad_ids.safetensors")
    ids = torch.randint(0, 256, (1, 40), dtype=torch.int32)
    ids[0, 7] = 256
    st.save(bad_ids, {"input_ids": ids})
    expect_error("token id >= vocab", ["debug-state", "--model", model, "--batch", bad_ids, "--out", out],
                 "bad_ids.safetensors", "input_ids[0, 7]", "256")

    no_ids = os.path.join(tmp, "no_ids.safetensors")
    st.save(no_ids, {"tokens": torch.zeros((1, 8), dtype=torch.int32)})
    expect_error("missing input_ids", ["debug-state", "--model", model, "--batch", no_ids, "--out", out],
                 "no_ids.safetensors", "input_ids")

    f64_ids = os.path.join(tmp, "f_ids.safetensors")
    st.save(f64_ids, {"input_ids": torch.zeros((1, 8), dtype=torch.int64)})
    expect_error("input_ids wrong dtype", ["debug-state", "--model", model, "--batch", f64_ids, "--out", out],
                 "f_ids.safetensors", "input_ids", "I32")

    expect_error("bad precision", ["debug-state", "--model", model, "--batch", good, "--out", out,
                                   "--mixed-precision-param", "float16"], "--mixed-precision-param", "float16")
    expect_error("memplan bad precision", ["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64",
                                           "--micro-batch", "1", "--mixed-precision-param", "fp8"],
                 "--mixed-precision-param", "fp8")

    expect_error("missing model dir", ["debug-state", "--model", os.path.join(tmp, "nope"), "--batch", good,
                                       "--out", out], "nope")

    # a model dir whose safetensors lost a tensor
    broken = os.path.join(tmp, "broken")
    os.makedirs(broken)
    tensors = st.load(os.path.join(model, "model.safetensors"))
    del tensors["layers.1.attn.indexer.wq_b.weight"]
    st.save(os.path.join(broken, "model.safetensors"), tensors)
    with open(os.path.join(model, "config.json")) as f, open(os.path.join(broken, "config.json"), "w") as g:
        g.write(f.read())
    expect_error("missing tensor", ["debug-state", "--model", broken, "--batch", good, "--out", out],
                 "layers.1.attn.indexer.wq_b.weight")

    # a tensor with the wrong shape
    tensors["layers.1.attn.indexer.wq_b.weight"] = torch.zeros((3, 3))
    st.save(os.path.join(broken, "model.safetensors"), tensors)
    expect_error("wrong shape", ["debug-state", "--model", broken, "--batch", good, "--out", out],
                 "layers.1.attn.indexer.wq_b.weight", "[3, 3]")

    # truncated safetensors
    path = os.path.join(broken, "model.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    expect_error("truncated file", ["debug-state", "--model", broken, "--batch", good, "--out", out],
                 "model.safetensors")

    # malformed config.json
    with open(os.path.join(broken, "config.json"), "w") as g:
        g.write('{"hidden_size": 64,, }')
    expect_error("malformed config", ["debug-state", "--model", broken, "--batch", good, "--out", out],
                 "config.json")

    # an unknown config key
    cfg = os.path.join(tmp, "cfg.json")
    with open("tests/configs/tiny-a.json") as f:
        text = f.read().replace('"hidden_size"', '"hiden_size"')
    with open(cfg, "w") as g:
        g.write(text)
    expect_error("unknown config key", ["init", "--config", cfg, "--out", os.path.join(tmp, "m2")],
                 "hiden_size", "hidden_size")

    expect_error("unknown flag", ["debug-state", "--modle", model], "--modle")
    expect_error("incompatible recompute flags",
                 ["debug-state", "--model", model, "--batch", good, "--out", out, "--recompute-method", "block"],
                 "--recompute-method")
    plan = ["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--micro-batch", "1"]
    expect_error("memplan: ep does not divide the world", plan + ["--world", "2", "--ep", "3"], "--ep 3", "ranks (2)")
    expect_error("memplan: rank outside the world", plan + ["--world", "2", "--rank", "2"], "--rank 2")
    # --threads: an integer in [0, 1024] in every command that takes it (train: training.threads)
    data = os.path.join(tmp, "val.bin")
    threads_cmds = {
        "debug-state": ["debug-state", "--model", model, "--batch", good, "--out", out],
        "generate": ["generate", "--model", model, "--prompt", "a"],
        "eval": ["eval", "--model", model, "--data", data],
        "memplan": plan,
        "tokenize": ["tokenize", "--input", good, "--out", os.path.join(tmp, "tok")],
    }
    for cmd, argv in threads_cmds.items():
        for bad in ("-1", "1025", "99999999999"):
            expect_error(f"{cmd} --threads {bad}", argv + ["--threads", bad], f"ds4 {cmd}", f"--threads {bad}",
                         "[0, 1024]")
        expect_error(f"{cmd} --threads x", argv + ["--threads", "x"], f"ds4 {cmd}", "--threads", "'x'")
    for bad in ("-1", "1025"):
        expect_error(f"train --training.threads {bad}",
                     ["train", "--config", "configs/train/demo.toml", "--training.threads", bad],
                     f"training.threads = {bad}", "[0, 1024]")
    # --device: a backend by name, the same way in every command that computes (train: training.device)
    for cmd in ("debug-state", "generate", "eval", "memplan"):
        expect_error(f"{cmd} --device nope", threads_cmds[cmd] + ["--device", "nope"], f"ds4 {cmd}", "--device",
                     "'nope'", "built in: cpu")
    expect_error("train --training.device nope",
                 ["train", "--config", "configs/train/demo.toml", "--training.device", "nope"], "training.device",
                 "'nope'", "built in: cpu")
    # --device cuda where no GPU is visible (or in a ds4 built without it): one line saying which, before any
    # work, in every command that runs on it; memplan plans it without a device
    if not os.path.exists("/dev/nvidia0"):
        plugin = os.path.exists(os.path.join(os.path.dirname(ds4), "libds4cuda.so"))
        why = "no CUDA device is visible here" if plugin else "built without the CUDA backend"
        for cmd in ("debug-state", "generate", "eval"):
            expect_error(f"{cmd} --device cuda", threads_cmds[cmd] + ["--device", "cuda"], f"ds4 {cmd}",
                         "--device 'cuda'", why)
        expect_error("train --training.device cuda",
                     ["train", "--config", "configs/train/demo.toml", "--training.device", "cuda"],
                     "training.device 'cuda'", why)
        if plugin:
            r = run("memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--device", "cuda")
            ok = r.returncode == 0 and "peak total" in r.stdout
            passed, failed = passed + ok, failed + (not ok)
            if not ok:
                print(f"FAIL memplan --device cuda without a GPU: rc={r.returncode} {r.stderr.strip()[:300]!r}")
    # the pipeline layout (docs/pipeline.md): each problem one line, checked before the world: a layout of
    # more than one chunk runs under mpirun -np pp (tests/test_pp_train.py), one process refuses it
    pp_toml = os.path.join(tmp, "pp.toml")
    with open(pp_toml, "w") as f:
        f.write('[model]\nconfig = "tests/configs/tiny-a.json"\n[training]\nsteps = 1\nseq_len = 64\n'
                'micro_batch_size = 1\n[data]\ntrain = "%s"\n' % os.path.join(tmp, "none_*.bin"))
    tr = ["train", "--config", pp_toml]
    expect_error("train --pp 2", tr + ["--pp", "2"], "pp 2, vpp 1", "one rank per stage", "mpirun -np 2",
                 "this world has 1")
    expect_error("train --vpp 2", tr + ["--vpp", "2"], "pp 1, vpp 2", "not built yet")
    expect_error("memplan of a pipeline on a world not pp x fsdp", ["memplan", "--config", pp_toml, "--pp", "2",
                                                                   "--world", "3", "--training.global_batch_size", "3"],
                 "pp 2", "this world has 3")
    expect_error("memplan --model of a pipeline on a world not pp x fsdp",
                 ["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--pp", "2", "--world", "3"],
                 "--world 3 with --pp 2", "multiple of 2")
    expect_error("memplan --model of a pipeline, EP not dividing the stage's FSDP group",
                 ["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--pp", "2", "--world", "2",
                  "--ep", "2"], "--ep 2", "world / pp = 1 data ranks")
    # a pp x fsdp rank (EP inside the stage) is planned: memplan = measured per rank is tests/test_pp_local.c's
    for args, want in ((["memplan", "--config", pp_toml, "--pp", "2", "--world", "4", "--parallel.ep", "2",
                         "--training.global_batch_size", "4", "--rank", "3"], "(rank 3 of 4, EP 2)"),
                       (["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--pp", "2", "--world", "4",
                         "--ep", "2", "--rank", "1"], "world 4 = pp 2 x fsdp 2")):
        r = run(*args)
        ok = r.returncode == 0 and want in r.stdout and re.search(r"^  peak total +\d+", r.stdout, re.M) is not None
        ok = ok and (args[1] == "--config" or ("rank 1" in r.stdout and "rank 3" in r.stdout))
        passed, failed = passed + ok, failed + (not ok)
        if not ok:
            print(f"FAIL {' '.join(args)}: rc={r.returncode} {r.stdout[-600:]!r} {r.stderr[-300:]!r}")
    expect_error("train parallel.pp 2 + layout", tr + ["--parallel.pp", "2", "--parallel.layout", "Ett|ttmL"],
                 "mpirun -np 2")
    expect_error("train layout illegal token", tr + ["--pp", "2", "--pipeline-model-parallel-layout", "Etx|tmL"],
                 "'x' is not a layer")
    expect_error("train layout without MTP", tr + ["--pipeline-model-parallel-size", "2", "--layout", "Ett|ttL"],
                 "0 MTP layers (m), the model has 1")
    expect_error("train uneven uniform split", tr + ["--pp", "3"], "4 layers do not split evenly over pp 3")
    expect_error("train layers per virtual stage", tr + ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
                 "--num-layers-per-virtual-pipeline-stage 3")
    expect_error("train Interleaved1F1B on one chunk per stage",
                 tr + ["--parallelism.pipeline_parallel_degree", "2",
                       "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], "Interleaved1F1B")
    expect_error("memplan layout without embedding",
                 ["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--layout", "tt|ttmL", "--pp", "2"],
                 "the embedding (E) must come once")
    expect_error("memplan --saved-activations of a pipeline with --policies refused",
                 ["memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--pp", "2", "--policies",
                  "--saved-activations"], "--saved-activations explains the plan of one policy")
    r = run("memplan", "--model", "tests/configs/tiny-a.json", "--seq", "64", "--pp", "2", "--vpp", "2",
            "--enable-recompute-layers-per-pp-rank")
    ok = r.returncode == 0 and "pp 2 x vpp 2 chunks" in r.stdout and "pp rank 1" in r.stdout and \
        re.search(r"^  peak total +\d+ +\d+$", r.stdout, re.M) is not None
    ok = ok and [l.split()[:2] for l in r.stdout.splitlines() if l.strip()[:1].isdigit()] == \
        [["0", "0"], ["1", "0"], ["0", "1"], ["1", "1"]]
    passed, failed = passed + ok, failed + (not ok)
    if not ok:
        print(f"FAIL memplan --pp 2 --vpp 2 stage table: rc={r.returncode} {r.stdout[-600:]!r} {r.stderr[-300:]!r}")
    # a model whose weights hold a NaN: eval and generate name the first non-finite tensor (not `loss nan`)
    import shutil
    import struct
    nanm = os.path.join(tmp, "nan_model")
    shutil.copytree(model, nanm)
    w = st.load(os.path.join(nanm, "model.safetensors"))
    w["layers.1.attn.wq_b.weight"].view(-1)[5] = float("nan")
    st.save(os.path.join(nanm, "model.safetensors"), w)
    shard = os.path.join(tmp, "nan_val.bin")
    toks = [(i * 7) % 200 + 1 for i in range(400)]
    with open(shard, "wb") as f:
        f.write(b"DS4TOKS\0" + struct.pack("<IIIiiI", 1, 256, 2, -1, -1, 0) + struct.pack("<QQ", len(toks), 1) +
                struct.pack("<2Q", 0, len(toks)) + struct.pack(f"<{len(toks)}H", *toks))
    expect_error("eval of NaN weights names the tensor", ["eval", "--model", nanm, "--data", shard, "--seq-len", "64"],
                 "nan_model", "layers.1.attn.wq_b.weight", "non-finite", "element 5")
    expect_error("generate with NaN weights names the tensor", ["generate", "--model", nanm, "--prompt", "a"],
                 "layers.1.attn.wq_b.weight", "non-finite")

    # nothing was written by the failing runs
    if os.path.exists(out):
        failed += 1
        print("FAIL a failing run left an output file")
    else:
        passed += 1

print(f"test_cli_errors: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
