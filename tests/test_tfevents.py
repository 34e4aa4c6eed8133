"""TensorBoard event files of a `ds4 train` run, read back with a decoder written here from the format
specs alone (TFRecord framing with masked CRC32C; event.proto / summary.proto by field number), not
with ds4's code or TensorBoard's: the first Event is file_version "brain.Event:2", then one Event per
logged step whose scalars equal the run's JSONL metrics, the validation loss last; a resumed run
writes a second file that starts with SessionLog START at its first step, in Event field 7 (field 6 is the
deprecated log_message, which TensorBoard shows as text and purges nothing for). Field numbers from TensorBoard's
tensorboard/compat/proto/event.proto: 1 wall_time, 2 step, 3 file_version, 5 summary, 6 log_message,
7 session_log. Where TensorBoard is installed (scripts/install-deps.sh puts it in the test venv), its own
EventAccumulator reads the folder of the resumed run and must show every step once."""
import glob
import json
import os
import re
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402
from hf_venv import venv_python  # noqa: E402

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ds4 = os.path.abspath(os.path.join(build, "ds4"))


# ------------------------------------------------------------------ the decoder
def crc32c(data):
    """CRC-32C (Castagnoli): reflected polynomial 0x82F63B78, init and final xor 0xFFFFFFFF."""
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


def masked(c):
    return ((((c >> 15) | (c << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


def records(raw):
    """TFRecord: u64 length, u32 masked crc of the length bytes, data, u32 masked crc of data."""
    off = 0
    while off < len(raw):
        (n,) = struct.unpack_from("<Q", raw, off)
        (c1,) = struct.unpack_from("<I", raw, off + 8)
        assert c1 == masked(crc32c(raw[off:off + 8])), "length crc"
        data = raw[off + 12:off + 12 + n]
        (c2,) = struct.unpack_from("<I", raw, off + 12 + n)
        assert c2 == masked(crc32c(data)), "data crc"
        yield data
        off += 16 + n


def fields(msg):
    """Protobuf wire format: (field number, wire type, value) of each field."""
    i = 0
    while i < len(msg):
        key, i = varint(msg, i)
        f, wt = key >> 3, key & 7
        if wt == 0:
            v, i = varint(msg, i)
        elif wt == 1:
            v, i = msg[i:i + 8], i + 8
        elif wt == 5:
            v, i = msg[i:i + 4], i + 4
        elif wt == 2:
            n, i = varint(msg, i)
            v, i = msg[i:i + n], i + n
        else:
            raise ValueError(f"wire type {wt}")
        yield f, wt, v


def varint(b, i):
    v = s = 0
    while True:
        v |= (b[i] & 0x7F) << s
        s += 7
        i += 1
        if not b[i - 1] & 0x80:
            return v, i


def event(data):
    """Event: 1 wall_time double, 2 step int64, 3 file_version, 5 summary, 6 log_message, 7 session_log."""
    e = {"step": 0, "scalars": {}}
    for f, wt, v in fields(data):
        if f == 1 and wt == 1:
            e["wall_time"] = struct.unpack("<d", v)[0]
        elif f == 2 and wt == 0:
            e["step"] = v
        elif f == 3 and wt == 2:
            e["file_version"] = v.decode()
        elif f == 5 and wt == 2:  # Summary { repeated Value value = 1 }
            for vf, _, val in fields(v):
                assert vf == 1
                tag = simple = None
                for xf, xwt, x in fields(val):  # Value { 1 tag, 2 simple_value float }
                    if xf == 1:
                        tag = x.decode()
                    elif xf == 2 and xwt == 5:
                        simple = struct.unpack("<f", x)[0]
                e["scalars"][tag] = simple
        elif f == 6:  # LogMessage (deprecated): never written by ds4
            e["log_message"] = v
        elif f == 7 and wt == 2:  # SessionLog { 1 status: START = 1 }
            e["session_log"] = dict((sf, sv) for sf, _, sv in fields(v)).get(1)
    return e


def read_events(path):
    with open(path, "rb") as f:
        return [event(r) for r in records(f.read())]


# ------------------------------------------------------------------ a run
def write_shard(path, vocab, n_docs, doc_len, seed):
    """A ds4 token shard (include/ds4/shard.h): u16 tokens, n_docs documents of doc_len tokens."""
    toks = [2 + (d * 7919 + i * 104729 + seed) % (vocab - 2) for d in range(n_docs) for i in range(doc_len)]
    out = b"DS4TOKS\0" + struct.pack("<IIIiiI", 1, vocab, 2, -1, -1, 0) + struct.pack("<QQ", len(toks), n_docs)
    out += struct.pack(f"<{n_docs + 1}Q", *[d * doc_len for d in range(n_docs + 1)])
    out += struct.pack(f"<{len(toks)}H", *toks)
    with open(path, "wb") as f:
        f.write(out)


TOML = """[job]
dump_folder = "{tmp}/run"
description = "tfevents test"
[model]
config = "{root}/tests/configs/tiny-a.json"
seed = 3
[training]
steps = {steps}
seq_len = 64
global_batch_size = 2
micro_batch_size = 1
threads = 1
[data]
train = "{tmp}/train.bin"
val = "{tmp}/train.bin"
val_batches = 2
[checkpoint]
folder = "{tmp}/ckpt"
interval = 2
[metrics]
log_freq = 1
jsonl = "{tmp}/metrics.jsonl"
peak_tflops = 1.0
enable_tensorboard = true
"""


def train(tmp, steps):
    cfg = os.path.join(tmp, "t.toml")
    with open(cfg, "w") as f:
        f.write(TOML.format(tmp=tmp, root=ROOT, steps=steps))
    return subprocess.run([ds4, "train", "--config", cfg], capture_output=True, text=True, timeout=300)


def close(a, b, tol=1e-5):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


with tempfile.TemporaryDirectory() as tmp:
    write_shard(os.path.join(tmp, "train.bin"), 256, 4, 300, seed=5)
    r = train(tmp, 3)
    check("train", r.returncode == 0, r.stderr)
    files = sorted(glob.glob(os.path.join(tmp, "run", "tb", "events.out.tfevents.*")))
    check("one event file under dump_folder/tb", len(files) == 1, files)
    check("file name", files and re.fullmatch(r"events\.out\.tfevents\.\d{10}\.[^/]+", os.path.basename(files[0])),
          files)
    ev = read_events(files[0]) if files else []
    check("file_version first", ev and ev[0].get("file_version") == "brain.Event:2", ev[:1])
    metrics = [json.loads(l) for l in open(os.path.join(tmp, "metrics.jsonl"))]
    steps = [e for e in ev[1:] if "loss" in e["scalars"]]
    check("one event per logged step", [e["step"] for e in steps] == [m["step"] for m in metrics] == [1, 2, 3],
          [e["step"] for e in steps])
    for e, m in zip(steps, metrics):
        s = e["scalars"]
        for tag, key in [("loss", "loss"), ("mtp_loss", "mtp_loss"), ("indexer_loss", "indexer_loss"),
                         ("grad_norm", "grad_norm"), ("lr", "lr"), ("memory_gib", "memory_gib"), ("tps", "tps"),
                         ("tflops", "tflops"), ("mfu", "mfu")]:
            check(f"step {m['step']} {tag}", tag in s and close(s[tag], m[key], 1e-4 if tag != "lr" else 1e-5),
                  f"{s.get(tag)} vs {m[key]}")
    val = re.search(r"validation loss ([0-9.]+)", r.stdout)
    last = ev[-1] if ev else {"scalars": {}}
    check("val_loss last", val and "val_loss" in last["scalars"] and last["step"] == 3 and
          abs(last["scalars"]["val_loss"] - float(val.group(1))) <= 1e-4, (last, r.stdout[-300:]))
    check("wall times", all(e["wall_time"] > 1.6e9 for e in ev) and
          all(a["wall_time"] <= b["wall_time"] for a, b in zip(ev, ev[1:])))

    # resume from step 2 (the checkpoint at step 3 removed): a new file, START at step 3
    for d in glob.glob(os.path.join(tmp, "ckpt", "step-*3*")):
        subprocess.run(["rm", "-rf", d], check=True)
    r = train(tmp, 4)
    check("resume", r.returncode == 0 and "resumed" in r.stdout, r.stdout[-500:] + r.stderr)
    files2 = sorted(glob.glob(os.path.join(tmp, "run", "tb", "events.out.tfevents.*")))
    new = [f for f in files2 if f not in files]
    check("second file", len(new) == 1, files2)
    ev2 = read_events(new[0]) if new else []
    check("START at the first step of the resumed run",
          len(ev2) > 2 and ev2[1].get("session_log") == 1 and ev2[1]["step"] == 3 and ev2[2]["step"] == 3,
          ev2[:3])

    check("no log_message events", all("log_message" not in e for e in ev + ev2))

    # what TensorBoard shows: files in name order, a SessionLog START purging the steps >= its own
    shown = []
    for path in sorted(glob.glob(os.path.join(tmp, "run", "tb", "events.out.tfevents.*"))):
        for e in read_events(path):
            if e.get("session_log") == 1:
                shown = [s for s in shown if s < e["step"]]
            elif "loss" in e["scalars"]:
                shown.append(e["step"])
    check("each step shown once after the resume", shown == [1, 2, 3, 4], shown)

    # TensorBoard's own reader, where it is installed
    py = venv_python("tensorboard")
    if not py:
        print("SKIP tensorboard's EventAccumulator: tensorboard not installed (scripts/install-deps.sh)")
    else:
        prog = ("import json, sys\n"
                "from tensorboard.backend.event_processing import event_accumulator as ea\n"
                "a = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0}, purge_orphaned_data=True)\n"
                "a.Reload()\n"
                "print(json.dumps({t: [[s.step, s.value] for s in a.Scalars(t)] for t in a.Tags()['scalars']}))\n")
        r = subprocess.run([py, "-c", prog, os.path.join(tmp, "run", "tb")], capture_output=True, text=True,
                           timeout=300)
        check("tensorboard reads the folder", r.returncode == 0, r.stderr[-1000:])
        tb = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {}
        check("tensorboard: loss at steps 1..4 once", [s for s, _ in tb.get("loss", [])] == [1, 2, 3, 4],
              tb.get("loss"))
        resumed = [json.loads(l) for l in open(os.path.join(tmp, "metrics.jsonl"))][-2:]
        check("tensorboard: the resumed run's losses at steps 3 and 4",
              [s for s, _ in tb.get("loss", [])][2:] == [m["step"] for m in resumed] and
              all(close(v, m["loss"], 1e-4) for (_, v), m in zip(tb.get("loss", [])[2:], resumed)),
              (tb.get("loss"), resumed))
        check("tensorboard: val_loss of both runs, the last at step 4",
              tb.get("val_loss") and tb["val_loss"][-1][0] == 4, tb.get("val_loss"))

finish("test_tfevents.py")
