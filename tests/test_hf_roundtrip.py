"""ds4's Hugging Face folders checked with transformers itself (scripts/install-deps.sh installs transformers
and tokenizers into the test venv .venv-hf; without it this test says SKIP):
- `ds4 export --names hf` of the byte-tokenized demo model: tokenizer.json + tokenizer_config.json that
  AutoTokenizer loads and that encode, decode and add BOS as ds4 does; a config AutoConfig reads without a
  warning about its types (attention_factor a float); no progress file left;
- `--names official` of a model with compress ratio 32: AutoConfig reads it (transformers maps only the
  ratios 4 and 128 of compress_ratios: layer_types + compress_rates are written beside it);
- a BPE tokenizer made with the tokenizers library, with a chat template: ds4 tokenize and transformers give
  the same ids, and the export carries the template;
- the other way: a folder as transformers' save_pretrained writes it: its config (qk_rope_head_dim beside
  partial_rotary_factor) and its tensor names (transformers' own reverse of its DeepSeek-V4 renaming, run by
  transformers' code on the model's names: official per-layer names under "model.", one tensor per expert, no
  MTP block) load in ds4 as the same model, `ds4 inspect --check` is clean, ds4 exports it back to the same
  bytes, and ds4 trains on it;
- where a torch >= 2.6 is present too: the export loads in AutoModelForCausalLM, pipeline("text-generation")
  runs, and its greedy text equals `ds4 generate` (SKIP elsewhere: Debian's torch is older)."""
import glob
import json
import os
import shutil
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
TEXTS = ["And God said, Let there be light: and there was light.", "naïve café — ünïcödé ✓ 中文",
         "  spaces\tand\nnewlines  ", "digits 0123456789 and punctuation !?;:"]


def run(*args, cwd=None):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=600, cwd=cwd)


def hf(py, prog, *args):
    """Runs prog under the venv's Python; its last stdout line is JSON."""
    r = subprocess.run([py, "-c", prog, *args], capture_output=True, text=True, timeout=600)
    out = r.stdout.strip().splitlines()
    return r, (json.loads(out[-1]) if r.returncode == 0 and out else None)


def shard_tokens(path):
    """Documents of a ds4 token shard (include/ds4/shard.h)."""
    raw = open(path, "rb").read()
    _, _, width, _, _, _ = struct.unpack_from("<IIIiiI", raw, 8)
    n_tok, n_docs = struct.unpack_from("<QQ", raw, 32)
    offs = struct.unpack_from(f"<{n_docs + 1}Q", raw, 48)
    base = 48 + 8 * (n_docs + 1)
    toks = struct.unpack_from(f"<{n_tok}{'H' if width == 2 else 'I'}", raw, base)
    return [list(toks[offs[i]:offs[i + 1]]) for i in range(n_docs)]


def ds4_ids(tmp, name, tokenizer, texts):
    """ds4 tokenize of each text as one .jsonl document."""
    d = os.path.join(tmp, name)
    os.makedirs(d)
    with open(os.path.join(d, "in.jsonl"), "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    r = run(ds4, "tokenize", "--input", os.path.join(d, "in.jsonl"), "--out", os.path.join(d, "out"),
            "--tokenizer", tokenizer, "--val-fraction", "0")
    check(f"ds4 tokenize ({name})", r.returncode == 0, r.stderr)
    docs = []
    for p in sorted(glob.glob(os.path.join(d, "out", "train_*.bin"))):
        docs += shard_tokens(p)
    return docs


ENCODE = """import importlib.util, json, sys
from transformers import AutoTokenizer
t = AutoTokenizer.from_pretrained(sys.argv[1])
texts = json.loads(sys.argv[2])
plain = [t.encode(x, add_special_tokens=False) for x in texts]
print(json.dumps({"plain": plain, "with_bos": t.encode(texts[0]), "decoded": [t.decode(i) for i in plain],
                  "bos": t.bos_token_id, "eos": t.eos_token_id,
                    "template": t.chat_template,
                  "chat": t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
                          if t.chat_template and importlib.util.find_spec("jinja2") else None}))
"""

CONFIG = """import json, logging, sys
from transformers import AutoConfig
from transformers.utils import logging as tl
tl.set_verbosity_warning()
msgs = []
class H(logging.Handler):
    def emit(self, rec): msgs.append(rec.getMessage())
tl.get_logger("transformers").addHandler(H())
try:
    c = AutoConfig.from_pretrained(sys.argv[1])
    if len(sys.argv) > 2: c.save_pretrained(sys.argv[2])
    print(json.dumps({"ok": True, "warnings": msgs, "layer_types": c.layer_types, "compress_rates": c.compress_rates,
                      "rope": c.rope_parameters}))
except Exception as e:
    print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}", "warnings": msgs}))
"""

BPE = """import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
t = Tokenizer(models.BPE())
t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
t.decoder = decoders.ByteLevel()
tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
t.train_from_iterator(json.loads(sys.argv[2]) * 20, tr)
t.save(sys.argv[1] + "/tokenizer.json")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"},
          open(sys.argv[1] + "/tokenizer_config.json", "w"))
print(json.dumps({"vocab": t.get_vocab_size()}))
"""

SAVED_NAMES = r"""
import ast, json, re, struct, sys, __future__
from collections import defaultdict
from typing import Any
import transformers
# transformers' own pattern code (core_model_loading.py imports torch at the top: its pure-Python classes
# and functions are taken from the module's source) and its deepseek_v4 entry of conversion_mapping.py
src = transformers.__path__[0] + "/core_model_loading.py"
want = {"process_target_pattern", "process_source_pattern", "apply_renamings", "apply_converters",
        "WeightTransform", "WeightRenaming", "WeightConverter"}
mod = ast.Module(body=[n for n in ast.parse(open(src).read()).body if getattr(n, "name", None) in want], type_ignores=[])
class Stub:
    def __init__(self, *a, **k): pass
    def __getattr__(self, n): return Stub()
    def __call__(self, *a, **k): return Stub()
    reverse_op = property(lambda self: Stub())
ns = {"re": re, "defaultdict": defaultdict, "Any": Any, "__name__": "cml"}
for n in ["torch", "Future", "ConversionOps", "logger", "nn", "MergeModulelist", "Concatenate"]:
    ns[n] = Stub
exec(compile(mod, src, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
cm = open(transformers.__path__[0] + "/conversion_mapping.py").read()
start = cm.index('"deepseek_v4": [') + len('"deepseek_v4": ')
depth, end = 0, start
for end in range(start, len(cm)):
    depth += (cm[end] == "[") - (cm[end] == "]")
    if depth == 0:
        break
rev = [c.reverse_transform() for c in eval(cm[start:end + 1], ns)[::-1]]  # what save_pretrained applies
renamings = [r for r in rev if isinstance(r, ns["WeightRenaming"])]
converters = [r for r in rev if isinstance(r, ns["WeightConverter"])]
raw = open(sys.argv[1], "rb").read()
hdr = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
out = {}
for k in hdr:
    if k != "__metadata__":
        rk, pattern = ns["apply_converters"](k, converters)
        out[k] = ns["apply_renamings"](rk if pattern else k, renamings)
print(json.dumps(out))
"""


def read_safetensors(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    hdr = json.loads(raw[8:8 + n])
    return {k: (v["dtype"], v["shape"], raw[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
            for k, v in hdr.items() if k != "__metadata__"}


def write_safetensors(path, tensors):
    hdr, off = {"__metadata__": {"format": "pt"}}, 0
    for k in sorted(tensors):
        dt, shape, data = tensors[k]
        hdr[k] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(tensors[k][2] for k in sorted(tensors)))


py = venv_python("transformers", "tokenizers")
if not py:
    print("SKIP test_hf_roundtrip.py: transformers is not installed (scripts/install-deps.sh puts it in .venv-hf)")
    finish("test_hf_roundtrip.py")

with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "m")
    r = run(ds4, "init", "--config", os.path.join(ROOT, "configs", "ds4-demo-small.json"), "--seed", "1", "--out", model)
    check("init", r.returncode == 0, r.stderr)

    # --- ds4 -> transformers: names hf, the byte tokenizer
    out = os.path.join(tmp, "hf")
    r = run(ds4, "export", "--checkpoint", model, "--out", out, "--quiet")
    check("export --names hf", r.returncode == 0, r.stderr)
    check("tokenizer files written", all(os.path.isfile(os.path.join(out, f))
                                         for f in ["tokenizer.json", "tokenizer_config.json", "config.json"]),
          os.listdir(out))
    check("no progress file left", not any(f.startswith(".ds4-convert") for f in os.listdir(out)), os.listdir(out))
    cr, c = hf(py, CONFIG, out)
    check("AutoConfig reads the export", c and c["ok"], (cr.stderr[-800:], c))
    check("no warning about attention_factor's type", c and not any("attention_factor" in w for w in c["warnings"]),
          c and c["warnings"])
    check("layer types", c and c["layer_types"] == ["sliding_attention", "compressed_sparse_attention",
                                                     "heavily_compressed_attention", "compressed_sparse_attention"]
          and c["compress_rates"]["heavily_compressed_attention"] == 32, c)
    check("attention_factor written as a float", '"attention_factor":\t1.0' in open(os.path.join(out, "config.json")).read()
          or '"attention_factor": 1.0' in open(os.path.join(out, "config.json")).read())
    er, e = hf(py, ENCODE, out, json.dumps(TEXTS))
    check("AutoTokenizer loads the byte tokenizer", e is not None, er.stderr[-800:])
    if e:
        ref = ds4_ids(tmp, "byte", "byte", TEXTS)
        check("byte tokenizer: transformers' ids are ds4's", e["plain"] == ref, (e["plain"][:2], ref[:2]))
        check("byte tokenizer: ids are the UTF-8 bytes", e["plain"] == [list(t.encode()) for t in TEXTS])
        check("byte tokenizer: decode gives the text back", e["decoded"] == TEXTS, e["decoded"])
        check("byte tokenizer: BOS first, as ds4 generate", e["with_bos"][0] == 256 and e["with_bos"][1:] == e["plain"][0]
              and e["bos"] == 256 and e["eos"] == 257, e["with_bos"][:3])

    # --- names official of a model with compress ratio 32
    off = os.path.join(tmp, "off")
    r = run(ds4, "export", "--checkpoint", model, "--out", off, "--names", "official", "--quiet")
    check("export --names official", r.returncode == 0, r.stderr)
    cr, c = hf(py, CONFIG, off)
    check("AutoConfig reads an official export with compress ratio 32", c and c["ok"] and
          c["compress_rates"]["heavily_compressed_attention"] == 32, (cr.stderr[-500:], c))

    # --- a BPE tokenizer with a chat template
    src = os.path.join(tmp, "bpe")
    os.makedirs(src)
    br, b = hf(py, BPE, src, json.dumps(TEXTS))
    check("a BPE tokenizer made by the tokenizers library", b is not None, br.stderr[-800:])
    if b:
        out2 = os.path.join(tmp, "hf-bpe")
        r = run(ds4, "export", "--checkpoint", model, "--out", out2, "--tokenizer", os.path.join(src, "tokenizer.json"),
                "--quiet")
        check("export --tokenizer PATH", r.returncode == 0, r.stderr)
        er, e = hf(py, ENCODE, out2, json.dumps(TEXTS))
        check("AutoTokenizer loads the exported BPE tokenizer", e is not None, er.stderr[-800:])
        if e:
            ref = ds4_ids(tmp, "bpe-ids", src, TEXTS)
            check("BPE: transformers' ids are ds4's", e["plain"] == ref, (e["plain"][:2], ref[:2]))
            check("BPE: the chat template travels", e["template"] and "m['content']" in e["template"], e["template"])
            if e["chat"] is None:
                print("SKIP applying the chat template: jinja2 not installed")
            else:
                check("BPE: the chat template applies", e["chat"] == "<s>user: hi</s>", e["chat"])

    # --- transformers -> ds4: the config save_pretrained writes, beside the export's weights
    saved = os.path.join(tmp, "saved")
    cr, c = hf(py, CONFIG, out, saved)
    check("save_pretrained of the config", c and c["ok"], (cr.stderr[-500:], c))
    sj = json.load(open(os.path.join(saved, "config.json")))
    check("save_pretrained writes qk_rope_head_dim beside partial_rotary_factor",
          "qk_rope_head_dim" in sj and "partial_rotary_factor" in sj, sorted(sj))
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(out, f), saved)
    nr, names = hf(py, SAVED_NAMES, os.path.join(out, "model.safetensors"))
    check("transformers' reverse renaming of the model's names", names is not None, nr.stderr[-1500:])
    tensors = read_safetensors(os.path.join(out, "model.safetensors"))
    saved_t = {}
    for name, (dt, shape, data) in tensors.items():
        to = (names or {}).get(name, name)
        if name.startswith("mtp."):
            continue  # transformers does not load the MTP block: save_pretrained writes none
        if "*" not in to:
            saved_t[to] = (dt, shape, data)
            continue
        E, rows, cols = shape
        parts = ["w1", "w3"] if to.endswith("w1.weight") else ["w2"]
        per = rows // len(parts) * cols * (len(data) // (E * rows * cols))
        for e in range(E):
            for k, w in enumerate(parts):
                at = (e * len(parts) + k) * per
                saved_t[to.replace("*", str(e)).replace("w1.weight", w + ".weight")] = \
                    (dt, [rows // len(parts), cols], data[at:at + per])
    write_safetensors(os.path.join(saved, "model.safetensors"), saved_t)
    check("the saved names are official names under model. (attn.norm for kv_norm)",
          "model.layers.0.attn.wq_a.weight" in saved_t and "model.layers.0.attn.norm.weight" in saved_t and
          "model.layers.0.ffn.experts.7.w3.weight" in saved_t and "head.weight" in saved_t and
          not any(k.startswith("mtp.") for k in saved_t), sorted(saved_t)[:8])
    r = run(ds4, "inspect", saved, "--check")
    check("ds4 inspect --check of the save_pretrained folder", r.returncode == 0 and "holds every tensor" in r.stdout
          and "stores no MTP block" in r.stdout, r.stdout[-800:] + r.stderr)
    back = os.path.join(tmp, "back")
    r = run(ds4, "export", "--checkpoint", saved, "--out", back, "--quiet")
    check("ds4 exports the save_pretrained folder", r.returncode == 0, r.stderr)
    if r.returncode == 0:
        again = read_safetensors(os.path.join(back, "model.safetensors"))
        first = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
        check("HF -> ds4 -> HF: the same tensors, bit for bit", again == first,
              sorted(set(again) ^ set(first))[:6])
    a = run(ds4, "inspect", "--config", os.path.join(out, "config.json"))
    b2 = run(ds4, "inspect", "--config", os.path.join(saved, "config.json"))
    check("the same model from ds4's and transformers' config", a.returncode == 0 and b2.returncode == 0 and
          a.stdout.replace(out, "X") == b2.stdout.replace(saved, "X"), (a.stdout[:300], b2.stdout[:300], b2.stderr))
    sj["qk_rope_head_dim"] = 8
    bad = os.path.join(tmp, "bad.json")
    json.dump(sj, open(bad, "w"))
    r = run(ds4, "inspect", "--config", bad)
    check("disagreeing spellings: one error naming both keys", r.returncode != 0 and "'qk_rope_head_dim' is 8" in r.stderr
          and "'partial_rotary_factor'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr)
    data = os.path.join(tmp, "data")
    ds4_ids(tmp, "train", "byte", TEXTS * 40)
    toml = os.path.join(tmp, "t.toml")
    with open(toml, "w") as f:
        f.write(f'[model]\ndir = "{saved}"\n[training]\nsteps = 2\nseq_len = 64\nglobal_batch_size = 1\n'
                f'micro_batch_size = 1\nthreads = 1\n[data]\ntrain = "{tmp}/train/out/train_*.bin"\n'
                f'[metrics]\npeak_tflops = 1.0\n')
    r = run(ds4, "train", "--config", toml)
    check("ds4 trains on the save_pretrained folder", r.returncode == 0 and "step     2" in r.stdout,
          r.stdout[-500:] + r.stderr[-500:])

    # --- the model itself, where transformers has a torch >= 2.6
    tpy = venv_python("transformers", "torch")
    ok = False
    if tpy:
        vr = subprocess.run([tpy, "-c", "from transformers.utils import is_torch_available as a; print(a())"],
                            capture_output=True, text=True, timeout=300)
        ok = vr.stdout.strip().endswith("True")
    if not ok:
        print("SKIP the model in transformers: no torch >= 2.6 beside transformers (Debian's python3-torch is older)")
    else:
        prompt = "And God said"
        g = run(ds4, "generate", "--model", out, "--prompt", prompt, "--max-new-tokens", "24", "--temperature", "0")
        gen = """import json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype="float32")
t = AutoTokenizer.from_pretrained(sys.argv[1])
p = pipeline("text-generation", model=m, tokenizer=t)
o = p(sys.argv[2], max_new_tokens=24, do_sample=False, return_full_text=False)
print(json.dumps({"text": o[0]["generated_text"]}))
"""
        mr, m = hf(tpy, gen, out, prompt)
        check("pipeline('text-generation') runs on the export", m is not None, mr.stderr[-1500:])
        check("greedy text equals ds4 generate", m and m["text"] in g.stdout, (m, g.stdout[-300:]))

finish("test_hf_roundtrip.py")
