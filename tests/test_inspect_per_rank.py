"""ds4 inspect on a per-rank checkpoint step folder (shards.json + shard-RRRRR-of-WWWWW.safetensors): it
lists each shard file's tensors, then the files, the ranges sorted by packed offset and the totals; --check
refuses it with one line pointing to `ds4 export`; a broken index is one `error:` line naming shards.json."""
import json
import os
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ds4 = os.path.abspath(os.path.join(build, "ds4"))


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, bytes), written in the safetensors layout."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def write_shard(folder, rank, world, n):
    floats = struct.pack(f"<{n}f", *range(n))
    write_safetensors(os.path.join(folder, f"shard-{rank:05d}-of-{world:05d}.safetensors"),
                      {"adamw.step": ("I64", [1], struct.pack("<q", 12)), "params": ("F32", [n], floats),
                       "adamw.m": ("F32", [n], floats), "adamw.v": ("F32", [n], floats)})


def ds4_run(*args):
    return subprocess.run([ds4, *args], capture_output=True, text=True, timeout=60)


with tempfile.TemporaryDirectory() as tmp:
    step = os.path.join(tmp, "step-12")
    os.mkdir(step)
    write_shard(step, 0, 2, 4)
    write_shard(step, 1, 2, 3)
    index = {"format": "ds4-per-rank-1", "world": 2, "packed_numel": 7, "files": [
        {"file": "shard-00000-of-00002.safetensors", "elements": 4, "ranges": [[0, 0, 2], [5, 2, 2]]},
        {"file": "shard-00001-of-00002.safetensors", "elements": 3, "ranges": [[2, 0, 3]]}]}
    with open(os.path.join(step, "shards.json"), "w") as f:
        json.dump(index, f)

    r = ds4_run("inspect", step)
    out = r.stdout
    check("inspect exit 0", r.returncode == 0, r.stderr + out)
    check("tensors of both files", out.count("adamw.step") == 2 and "8 tensors," in out, out)
    check("header names the step and totals", "per-rank checkpoint" in out and "step 12, 2 shard files, 7 packed elements" in out, out)
    lines = out.splitlines()
    check("file rows", any(l.split() == ["shard-00000-of-00002.safetensors", "4", "2"] for l in lines)
          and any(l.split() == ["shard-00001-of-00002.safetensors", "3", "1"] for l in lines), out)
    rows = [l.split() for l in lines if len(l.split()) == 4 and all(w.isdigit() for w in l.split())]
    check("ranges sorted by packed offset", rows == [["0", "0", "0", "2"], ["1", "2", "0", "3"], ["0", "5", "2", "2"]], rows)
    check("tiling total and export hint", "3 ranges tile [0, 7)" in out and "ds4 export --checkpoint" in out, out)

    r = ds4_run("inspect", step, "--stats")
    check("--stats exit 0", r.returncode == 0 and "params" in r.stdout, r.stderr + r.stdout)

    r = ds4_run("inspect", step, "--check")
    check("--check refused, one line", r.returncode == 2 and r.stderr.count("\n") == 1 and "ds4 export" in r.stderr, r.stderr)

    index["files"][1]["ranges"] = [[3, 0, 3]]  # packed element 2 in no file
    with open(os.path.join(step, "shards.json"), "w") as f:
        json.dump(index, f)
    r = ds4_run("inspect", step)
    err = r.stderr.strip()
    check("broken index fails", r.returncode != 0, r.stdout)
    check("one error line naming shards.json", err.startswith("error:") and "\n" not in err
          and "shards.json" in err and "in no file" in err, r.stderr)

finish("test_inspect_per_rank")
