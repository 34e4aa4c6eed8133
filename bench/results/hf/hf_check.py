# By hand, on the GPU machine (it has torch): ds4's Hugging Face export loaded by transformers 5.23
# (AutoModelForCausalLM, AutoTokenizer, pipeline) and its greedy text against `ds4 generate` on the same folder.
import sys
sys.path.insert(0, "/tmp/site")
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
d = ".devhf/model"
print("transformers", transformers.__version__, "torch", torch.__version__)
tok = AutoTokenizer.from_pretrained(d)
model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, output_loading_info=True)
print("loading info:", {k: len(v) for k, v in info.items()}, {k: list(v)[:5] for k, v in info.items() if v})
model.eval()
pipe = pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
out = pipe("The model", max_new_tokens=40, do_sample=False)[0]["generated_text"]
ds4 = open(".devhf/ds4_generate.txt").read().rstrip("\n")
print("transformers pipeline:", repr(out))
print("ds4 generate         :", repr(ds4))
print("greedy text equal:", out == ds4)
ids = tok("The model")["input_ids"]
print("prompt ids:", ids)
