#!/usr/bin/python3
"""Independent PyTorch reference of the DeepSeek-V4 model, its three losses and their gradients.

    python3 ref/ds4_ref.py --model DIR --batch BATCH.safetensors --out OUT.safetensors [--dtype float32|float64]
                           [--mixed-precision-param float32|bfloat16]

does what `ds4 debug-state` does (docs/contract.md): forward of the whole model incl. MTP, loss,
mtp_loss, indexer_loss, total_loss, autograd backward of total_loss, and writes logits, mtp_logits,
the losses, grad.<name> for every floating-point parameter and indexer_topk.<L> for each CSA layer.

Plain float PyTorch with autograd, written for clarity and independence from the C engine:
attention is dense (a full [T, T+Nc] additive mask plus a sink column, softmax, sink column dropped),
experts are evaluated densely and weighted by a [tokens, E] routing matrix that is zero off the
selection. Section numbers refer to docs/dsv4-architecture.md.

--mixed-precision-param bfloat16 emulates ds4's BF16 mixed precision (docs/mixed-precision.md) in fp32
math (or float64 with --dtype float64): values are rounded to bf16 where ds4 rounds them and nowhere
else (see "bf16 emulation" below); tests/test_parity_bf16.py compares it with ds4.
"""
import argparse
import glob
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402


class RefError(Exception):
    """Bad input: the message names the file/tensor/key and what was expected."""


# ----------------------------------------------------------------------------- config

class Config:
    """The model config read from HF config.json keys (include/ds4/config.h lists them)."""

    def __init__(self, d, path="config.json"):
        def get(key, default=None, required=True):
            if key in d:
                return d[key]
            if required and default is None:
                raise RefError(f"{path}: missing key '{key}'")
            return default

        self.vocab = int(get("vocab_size"))
        self.dim = int(get("hidden_size"))
        self.n_layers = int(get("num_hidden_layers"))
        self.n_mtp = int(get("num_nextn_predict_layers", 0, required=False))
        self.n_heads = int(get("num_attention_heads"))
        self.n_kv_heads = int(get("num_key_value_heads", 1, required=False))
        self.head_dim = int(get("head_dim"))
        self.rope_dim = int(get("qk_rope_head_dim"))
        self.q_lora = int(get("q_lora_rank"))
        self.o_groups = int(get("o_groups"))
        self.o_lora = int(get("o_lora_rank"))
        self.window = int(get("sliding_window"))
        self.ratios = [int(r) for r in get("compress_ratios")]
        self.idx_heads = int(get("index_n_heads"))
        self.idx_dim = int(get("index_head_dim"))
        self.idx_topk = int(get("index_topk"))
        self.hc = int(get("hc_mult"))
        self.hc_iters = int(get("hc_sinkhorn_iters"))
        self.hc_eps = float(get("hc_eps"))
        self.n_experts = int(get("n_routed_experts"))
        self.n_shared = int(get("n_shared_experts"))
        self.topk_experts = int(get("num_experts_per_tok"))
        self.inter = int(get("moe_intermediate_size"))
        self.n_hash = int(get("num_hash_layers", 0, required=False))
        self.route_scale = float(get("routed_scaling_factor", 1.0, required=False))
        self.swiglu_limit = float(get("swiglu_limit", 0.0, required=False) or 0.0)
        self.rope_theta = float(get("rope_theta"))
        self.compress_rope_theta = float(get("compress_rope_theta"))
        self.norm_eps = float(get("rms_norm_eps"))
        rs = d.get("rope_scaling") or {}
        kind = rs.get("type", rs.get("rope_type", "yarn"))
        self.yarn = bool(rs) and kind == "yarn" and int(rs.get("original_max_position_embeddings", 0)) > 0
        self.rope_factor = float(rs.get("factor", 1.0)) if self.yarn else 1.0
        self.original_seq_len = int(rs.get("original_max_position_embeddings", 0)) if self.yarn else 0
        self.beta_fast = float(rs.get("beta_fast", 32)) if self.yarn else 32.0
        self.beta_slow = float(rs.get("beta_slow", 1)) if self.yarn else 1.0
        self.mtp_loss_weight = float(d.get("mtp_loss_weight", 0.3))
        self.indexer_loss_coeff = float(d.get("indexer_loss_coeff", 0.01))
        self.csa_dense = bool(d.get("csa_dense", False))
        self._validate(d, path)

    def _validate(self, d, path):
        def need(cond, msg):
            if not cond:
                raise RefError(f"{path}: {msg}")

        need(self.n_kv_heads == 1, f"num_key_value_heads is {self.n_kv_heads}; expected 1 (shared K=V head)")
        need(self.n_mtp in (0, 1), f"num_nextn_predict_layers is {self.n_mtp}; expected 0 or 1")
        need(len(self.ratios) == self.n_layers + self.n_mtp,
             f"compress_ratios has {len(self.ratios)} entries; expected num_hidden_layers + "
             f"num_nextn_predict_layers = {self.n_layers + self.n_mtp}")
        need(all(r >= 0 for r in self.ratios), "compress_ratios must be >= 0")
        need(all(self.ratios[self.n_layers + k] == 0 for k in range(self.n_mtp)),
             "compress_ratios entry of the MTP layer must be 0 (the MTP block is SWA-only)")
        need(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim,
             f"qk_rope_head_dim {self.rope_dim} must be even and <= head_dim {self.head_dim}")
        if any(r == 4 for r in self.ratios):
            need(self.rope_dim <= self.idx_dim, f"qk_rope_head_dim {self.rope_dim} must be <= index_head_dim")
        need((self.n_heads * self.head_dim) % self.o_groups == 0 and self.n_heads % self.o_groups == 0,
             f"num_attention_heads {self.n_heads} must be a multiple of o_groups {self.o_groups}")
        need(self.hc >= 1, "hc_mult must be >= 1")
        need(0 < self.topk_experts <= self.n_experts, "num_experts_per_tok must be in [1, n_routed_experts]")
        sf = d.get("scoring_func", "sqrtsoftplus")
        need(sf == "sqrtsoftplus", f"scoring_func is '{sf}'; only 'sqrtsoftplus' is supported")
        need(self.window >= 1, "sliding_window must be >= 1")

    @staticmethod
    def load(path):
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise RefError(f"{path}: cannot read config: {e}")
        return Config(d, path)


# ----------------------------------------------------------------------------- parameter table (§8.1)

def layer_param_specs(cfg, prefix, layer_idx, ratio):
    """(name, shape, kind) for one block; kind picks the init rule and marks the integer table."""
    D, n, H, c = cfg.dim, cfg.hc, cfg.n_heads, cfg.head_dim
    M = (2 + n) * n
    qr, G, R = cfg.q_lora, cfg.o_groups, cfg.o_lora
    E, I, K = cfg.n_experts, cfg.inter, cfg.topk_experts
    Is = I * cfg.n_shared
    s = [
        ("attn_norm.weight", [D], "norm"), ("ffn_norm.weight", [D], "norm"),
        ("hc_attn_fn", [M, n * D], "normal"), ("hc_attn_base", [M], "zero"), ("hc_attn_scale", [3], "one"),
        ("hc_ffn_fn", [M, n * D], "normal"), ("hc_ffn_base", [M], "zero"), ("hc_ffn_scale", [3], "one"),
        ("attn.attn_sink", [H], "zero"),
        ("attn.wq_a.weight", [qr, D], "normal"), ("attn.q_norm.weight", [qr], "norm"),
        ("attn.wq_b.weight", [H * c, qr], "normal"),
        ("attn.wkv.weight", [c, D], "normal"), ("attn.kv_norm.weight", [c], "norm"),
        ("attn.wo_a.weight", [G * R, H * c // G], "normal"), ("attn.wo_b.weight", [D, G * R], "normal"),
    ]
    if ratio > 0:
        coff = 2 if ratio == 4 else 1
        s += [
            ("attn.compressor.wkv.weight", [coff * c, D], "normal"),
            ("attn.compressor.wgate.weight", [coff * c, D], "normal"),
            ("attn.compressor.ape", [ratio, coff * c], "zero"),
            ("attn.compressor.norm.weight", [c], "norm"),
        ]
    if ratio == 4:
        HI, dI = cfg.idx_heads, cfg.idx_dim
        s += [
            ("attn.indexer.wq_b.weight", [HI * dI, qr], "normal"),
            ("attn.indexer.weights_proj.weight", [HI, D], "normal"),
            ("attn.indexer.compressor.wkv.weight", [2 * dI, D], "normal"),
            ("attn.indexer.compressor.wgate.weight", [2 * dI, D], "normal"),
            ("attn.indexer.compressor.ape", [4, 2 * dI], "zero"),
            ("attn.indexer.compressor.norm.weight", [dI], "norm"),
        ]
    s.append(("ffn.gate.weight", [E, D], "normal"))
    if layer_idx < cfg.n_hash:
        s.append(("ffn.gate.tid2eid", [cfg.vocab, K], "tid2eid"))
    else:
        s.append(("ffn.gate.bias", [E], "zero"))
    for e in range(E):
        s += [(f"ffn.experts.{e}.w1.weight", [I, D], "normal"), (f"ffn.experts.{e}.w3.weight", [I, D], "normal"),
              (f"ffn.experts.{e}.w2.weight", [D, I], "normal")]
    s += [("ffn.shared_experts.w1.weight", [Is, D], "normal"), ("ffn.shared_experts.w3.weight", [Is, D], "normal"),
          ("ffn.shared_experts.w2.weight", [D, Is], "normal")]
    return [(prefix + name, shape, kind) for name, shape, kind in s]


def param_specs(cfg):
    """Every parameter of the model in official names: list of (name, shape, kind)."""
    V, D, n = cfg.vocab, cfg.dim, cfg.hc
    s = [("embed.weight", [V, D], "normal"), ("head.weight", [V, D], "normal"), ("norm.weight", [D], "norm"),
         ("hc_head_fn", [n, n * D], "normal"), ("hc_head_base", [n], "zero"), ("hc_head_scale", [1], "one")]
    for L in range(cfg.n_layers):
        s += layer_param_specs(cfg, f"layers.{L}.", L, cfg.ratios[L])
    for k in range(cfg.n_mtp):
        p = f"mtp.{k}."
        s += layer_param_specs(cfg, p, cfg.n_layers + k, cfg.ratios[cfg.n_layers + k])
        s += [(p + "e_proj.weight", [D, D], "normal"), (p + "h_proj.weight", [D, D], "normal"),
              (p + "enorm.weight", [D], "norm"), (p + "hnorm.weight", [D], "norm"), (p + "norm.weight", [D], "norm"),
              (p + "hc_head_fn", [n, n * D], "normal"), (p + "hc_head_base", [n], "zero"),
              (p + "hc_head_scale", [1], "one")]
    return s


def load_params(model_dir, cfg, dtype):
    """Reads every DIR/*.safetensors, checks names and shapes against the table, returns
    {name: tensor}: float parameters as leaf tensors of `dtype` requiring grad, tid2eid as int64."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise RefError(f"{model_dir}: no *.safetensors files")
    raw, where = {}, {}
    for path in files:
        try:
            part = safetensors_io.load(path)
        except (OSError, ValueError) as e:
            raise RefError(str(e))
        for name, t in part.items():
            if name in raw:
                raise RefError(f"{path}: tensor '{name}' also present in {where[name]}")
            raw[name], where[name] = t, path
    P = {}
    for name, shape, kind in param_specs(cfg):
        if name not in raw:
            raise RefError(f"{model_dir}: missing tensor '{name}' (expected shape {shape})")
        t = raw.pop(name)
        if list(t.shape) != shape:
            raise RefError(f"{where[name]}: tensor '{name}' has shape {list(t.shape)}; expected {shape}")
        if kind == "tid2eid":
            if t.is_floating_point():
                raise RefError(f"{where[name]}: tensor '{name}' must be I64 or I32")
            t = t.to(torch.int64)
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.n_experts):
                raise RefError(f"{where[name]}: tensor '{name}' has expert ids outside [0, {cfg.n_experts})")
            P[name] = t
        else:
            if not t.is_floating_point():
                raise RefError(f"{where[name]}: tensor '{name}' must be F32 or BF16")
            P[name] = t.to(dtype).requires_grad_(True)
    for name in sorted(raw):
        print(f"warning: {where[name]}: tensor '{name}' is not a parameter of this config; ignored", file=sys.stderr)
    return P


# ----------------------------------------------------------------------------- bf16 emulation
# ds4's bf16 mode rounds (round to nearest even, denormals to 0) at three kinds of points, and this
# reference rounds at the same ones when BF16 is set:
#   1. GEMM operands (linear_fwd / linear_bwd / grouped_linear / the experts' linears): both operands of
#      every forward and backward product, fp32 accumulation: linear(). The ops that are not GEMMs in
#      ds4 (mHC mixes, attention and indexer scores, Sinkhorn, norms, softmaxes) stay fp32 math.
#   2. unit outputs declared bf16: rounded once the unit has run: act(). Inside a unit, later ops read
#      the unrounded value in forward while ds4's backward reads the rounded saved one: split().
#   3. the residual streams X[l] and X_mid: act().
# Rounding has no backward of its own (a straight-through identity), as in ds4.
BF16 = False


def bf16_round(x):
    """x's values rounded to bf16 (nearest even; |x| < 2^-126 to 0, as gemm_bf16_bits), no gradient."""
    x = x.detach()
    r = x.float().to(torch.bfloat16).to(x.dtype)
    return torch.where(x.abs() < torch.finfo(torch.float32).tiny, torch.zeros_like(r), r)


def act(x):
    """A bf16 unit output or stream: value rounded, gradient passed through (identity when not BF16)."""
    return x + (bf16_round(x) - x).detach() if BF16 else x


def split(f, fwd, bwd):
    """f(*fwd) as the value, with the gradient of f taken at bwd (the unit's saved, rounded inputs of f):
    ds4's forward reads a GEMM output before the unit rounds it, its backward reads the rounded copy."""
    if not BF16:
        return f(*fwd)
    with torch.no_grad():
        y = f(*fwd)
    yb = f(*bwd)
    return y + (yb - yb.detach())


def rmsnorm_of_raw(x, w, eps):
    """rmsnorm(x, w) of a GEMM output x in the same unit: under BF16 its backward is ds4's, which reads
    the rounded x with the rstd of the unrounded one: dx = r·gw − (r³/D)·⟨gw, bf16(x)⟩·bf16(x)."""
    if not BF16:
        return rmsnorm(x, w, eps)
    with torch.no_grad():
        y = rmsnorm(x, w, eps)
    xb = act(x)
    ms = xb.pow(2).mean(-1, keepdim=True)
    shift = (x.pow(2).mean(-1, keepdim=True) - ms).detach()    # makes the rstd below that of x
    yb = xb * torch.rsqrt(ms + shift + eps)
    yb = yb if w is None else yb * w
    return y + (yb - yb.detach())


class _LinearBF16(torch.autograd.Function):
    """y = bf16(x) · bf16(w)^T; backward dx = bf16(dy) · bf16(w), dw = bf16(dy)^T · bf16(saved x).
    x: [..., IC]; w: [OC, IC]; saved: what ds4's backward reads as x (default x)."""

    @staticmethod
    def forward(ctx, x, w, saved):
        ctx.save_for_backward(x if saved is None else saved, w)
        return bf16_round(x) @ bf16_round(w).t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dyr = bf16_round(dy)
        dx = dyr @ bf16_round(w)
        dw = dyr.reshape(-1, dyr.shape[-1]).t() @ bf16_round(x).reshape(-1, x.shape[-1])
        return dx, dw, None


def linear(x, w, saved=None):
    """x @ w^T: a ds4 GEMM (bf16 operands under BF16)."""
    return _LinearBF16.apply(x, w, saved) if BF16 else x @ w.t()


# ----------------------------------------------------------------------------- small ops

def rmsnorm(x, w, eps):
    """y = w ⊙ x · rsqrt(mean(x²) + eps) over the last dim; w None = weightless."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def rope_freqs(cfg, ratio):
    """θ_i, i < rd/2, float64 (§4.1). Layers with ratio > 0 use compress_rope_theta and YaRN."""
    rd = cfg.rope_dim
    base = cfg.compress_rope_theta if ratio > 0 else cfg.rope_theta
    theta = base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    if ratio > 0 and cfg.yarn:
        def corr_dim(n_rot):
            return rd * math.log(cfg.original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(corr_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corr_dim(cfg.beta_slow)), rd - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(rd // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        theta = theta / cfg.rope_factor * (1 - smooth) + theta * smooth
    return theta


def rope_cos_sin(theta, positions, dtype):
    """cos, sin: [P, rd/2] of angle pos·θ_i, computed in float64 then cast."""
    ang = positions.to(torch.float64)[:, None] * theta[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def rope(x, cos, sin, inverse=False):
    """Rotates interleaved pairs (x[hd-rd+2i], x[hd-rd+2i+1]) of the trailing rd dims.
    x: [B, P, ..., hd] with positions on dim 1; cos, sin: [P, rd/2]."""
    rd = 2 * cos.shape[-1]
    shape = [1, cos.shape[0]] + [1] * (x.dim() - 3) + [cos.shape[1]]
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    nope, rot = x[..., :-rd], x[..., -rd:]
    x0, x1 = rot[..., 0::2], rot[..., 1::2]
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return torch.cat([nope, y], dim=-1)


def stable_topk_desc(scores, k):
    """Indices of the k largest along the last dim, ties toward the lower index."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


# ----------------------------------------------------------------------------- mHC (§3)

def sinkhorn(logits, iters, eps):
    """comb from the [.., n, n] logits exactly as the code does: row softmax, +eps, column
    normalise, then (iters-1) x (row, column) normalisations, each with +eps in the denominator."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_mixes(X, fn, norm_eps):
    """mixes = (fn · x) · rsqrt(mean(x²) + eps) over the flattened n·D streams.
    X: [B, T, n, D]; fn: [m, n·D] -> [B, T, m]."""
    x = X.flatten(2)
    return (x @ fn.t()) * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm_eps)


def hc_pre(X, fn, scale, base, cfg):
    """Collapses n streams to one: returns y [B,T,D], post [B,T,n], comb [B,T,n,n] (§3.2)."""
    n = cfg.hc
    mixes = hc_mixes(X, fn, cfg.norm_eps)
    pre = torch.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * scale[1] + base[n:2 * n])
    logits = (mixes[..., 2 * n:] * scale[2] + base[2 * n:]).unflatten(-1, (n, n))
    comb = sinkhorn(logits, cfg.hc_iters, cfg.hc_eps)
    y = act((pre.unsqueeze(-1) * X).sum(2))                                # bf16 unit output
    return y, post, comb


def hc_post(x, res, post, comb):
    """Y[k] = post[k]·x + Σ_j comb[j][k]·res[j] (sum over the FIRST comb index) (§3.3).
    x: [B,T,D]; res: [B,T,n,D] -> [B,T,n,D]."""
    return post.unsqueeze(-1) * x.unsqueeze(2) + torch.einsum("btjk,btjd->btkd", comb, res)


def hc_head(X, fn, scale, base, cfg):
    """y = Σ_j pre[j]·X[j], pre = sigmoid(mixes·scale + base) + hc_eps (§3.4). -> [B,T,D]."""
    mixes = hc_mixes(X, fn, cfg.norm_eps)
    pre = torch.sigmoid(mixes * scale[0] + base) + cfg.hc_eps
    return (pre.unsqueeze(-1) * X).sum(2)


# ----------------------------------------------------------------------------- attention (§4)

def compressor(x, wkv, wgate, ape, norm_w, ratio, d, cos_c, sin_c, norm_eps):
    """Pools each block of `ratio` tokens into one entry (§4.4); ratio 4 overlaps with the previous block.
    x: [B,T,D] -> [B, Nc, d], Nc = T // ratio, entry i roped at position i·ratio (cos_c, sin_c: [Nc, rd/2])."""
    B, T, _ = x.shape
    Nc = T // ratio
    if Nc == 0:
        return x.new_zeros(B, 0, d)
    a = linear(x, wkv)                                                     # [B, T, coff·d], bf16 slot
    z = linear(x, wgate)                                                   # fp32 slot (softmax logits)
    pooled = split(lambda a, z: compress_pool(a, z, ape, ratio, d), [a, z], [act(a), z])   # [B, Nc, d]
    return act(rope(rmsnorm_of_raw(pooled, norm_w, norm_eps), cos_c, sin_c))


def compress_pool(a, z, ape, ratio, d):
    """Softmax-gated pooling of each block (§4.4). a, z: [B, T, coff·d] -> [B, Nc, d]."""
    B, T, _ = a.shape
    Nc = T // ratio
    a = a[:, :Nc * ratio].unflatten(1, (Nc, ratio))                        # [B, Nc, r, coff·d]
    z = z[:, :Nc * ratio].unflatten(1, (Nc, ratio)) + ape                  # [B, Nc, r, coff·d]
    if ratio == 4:
        # slots 0..r-1: previous block's channels [0,d) (none for block 0: value 0, logit -inf);
        # slots r..2r-1: this block's channels [d, 2d)
        a_prev = torch.cat([a.new_zeros(B, 1, ratio, d), a[:, :-1, :, :d]], dim=1)
        z_prev = torch.cat([z.new_full((B, 1, ratio, d), float("-inf")), z[:, :-1, :, :d]], dim=1)
        a = torch.cat([a_prev, a[..., d:]], dim=2)                        # [B, Nc, 2r, d]
        z = torch.cat([z_prev, z[..., d:]], dim=2)
    return (a * torch.softmax(z, dim=2)).sum(2)                           # per-channel softmax over slots


def attention_probs(q, keys, mask, sink, scale):
    """Dense sink attention. q: [B,T,H,c]; keys (= values): [B,J,c]; mask: [B,T,J] additive (0 / -inf);
    sink: [H]. Softmax over [scores | sink column], sink column dropped. Returns o [B,T,H,c], p [B,T,H,J]."""
    B, T, H, _ = q.shape
    s = torch.einsum("bthc,bjc->bthj", q, keys) * scale + mask.unsqueeze(2)
    s = torch.cat([s, sink.view(1, 1, H, 1).expand(B, T, H, 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :-1]
    o = torch.einsum("bthj,bjc->bthc", p, keys)
    if BF16:
        # ds4's backward takes Σ_j p_j·(dO·key_j) as dO·o of the saved, rounded o: the score gradient
        # gains p·(dO·(o − bf16(o))), the gradient of (o − bf16(o))·lse(s) (its value here is 0)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        o = o + (o - bf16_round(o)).detach() * (lse - lse.detach())
    return act(o), p


def usable_mask(T, Nc, ratio):
    """[T, Nc] bool: compressed entry i usable by query t iff (i+1)·ratio <= t+1."""
    t = torch.arange(T)[:, None]
    i = torch.arange(Nc)[None, :]
    return (i + 1) * ratio <= t + 1


def window_mask(T, window):
    """[T, T] bool: key j in the window of query t iff t-window+1 <= j <= t."""
    t = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (j <= t) & (j > t - window)


def attention_mask(T, window, sel, dtype):
    """Additive mask [B, T, T+Nc]: 0 on the window keys of each query and on its compressed entries
    in `sel` (bool [B, T, Nc], Nc may be 0), -inf elsewhere."""
    B = sel.shape[0]
    keep = torch.cat([window_mask(T, window).expand(B, T, T), sel], dim=-1)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))


def select_topk(scores, usable, k):
    """The k usable entries with the highest score per row, ties to the lower index.
    scores: [B,T,Nc]; usable: [T,Nc] -> (selected bool [B,T,Nc], ids int32 [B,T,k] ascending, -1 padded)."""
    B, T, Nc = scores.shape
    masked = scores.detach().masked_fill(~usable, float("-inf"))
    sel = torch.zeros(B, T, Nc, dtype=torch.bool)
    if Nc > 0:
        top = stable_topk_desc(masked, min(k, Nc))
        sel.scatter_(-1, top, True)
        sel &= usable.unsqueeze(0)
    ids = torch.where(sel, torch.arange(Nc), Nc).sort(dim=-1).values   # selected ids first, ascending
    if Nc < k:
        ids = torch.cat([ids, torch.full((B, T, k - Nc), Nc, dtype=ids.dtype)], dim=-1)
    ids = ids[..., :k]
    return sel, torch.where(ids >= Nc, -1, ids).to(torch.int32)


def indexer_scores(qi, ki, w):
    """I[b,t,s] = Σ_h w[b,t,h]·ReLU(qi[b,t,h]·ki[b,s]). qi: [B,T,HI,dI]; ki: [B,Nc,dI]; w: [B,T,HI]."""
    return (torch.einsum("bthd,bsd->bths", qi, ki).relu() * w.unsqueeze(-1)).sum(2)


def indexer_kl(teacher, scores, sel):
    """Mean over rows with >= 1 selected entry of KL(p || softmax(scores over sel)), where p is the
    (detached) teacher mass L1-normalised over sel. teacher, scores: [B,T,Nc]; sel bool [B,T,Nc]."""
    valid = sel.any(-1)                                                       # [B,T]
    if not bool(valid.any()):
        return scores.sum() * 0
    tiny = torch.finfo(scores.dtype).tiny
    p = teacher.detach() * sel
    p = p / p.sum(-1, keepdim=True).clamp_min(tiny)
    # rows without entries keep finite logits (their p is 0, so they add nothing)
    logq = torch.log_softmax(scores.masked_fill(~sel & valid.unsqueeze(-1), float("-inf")), dim=-1)
    terms = p * (torch.log(p.clamp_min(tiny)) - logq.masked_fill(~sel, 0.0))
    kl = terms.sum(-1)                                                        # [B,T]
    return kl[valid].sum() / valid.sum()


def attention(P, pre, x, cfg, ratio, dtype):
    """One attention sub-layer (§4.1-4.7). x: [B,T,D] (attn_norm output).
    Returns out [B,T,D], and for CSA layers (ratio 4) the top-k ids [B,T,index_topk] and the indexer KL."""
    B, T, D = x.shape
    H, c, G, eps = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.norm_eps
    theta = rope_freqs(cfg, ratio)
    cos_t, sin_t = rope_cos_sin(theta, torch.arange(T), dtype)

    # query path (§4.2): qr is also the indexer's query latent
    qa = linear(x, P[pre + "attn.wq_a.weight"])                                                # [B,T,qr]
    qr = act(rmsnorm_of_raw(qa, P[pre + "attn.q_norm.weight"], eps))
    qraw = linear(qr, P[pre + "attn.wq_b.weight"]).unflatten(-1, (H, c))                       # [B,T,H,c]
    q = act(rope(rmsnorm_of_raw(qraw, None, eps), cos_t, sin_t))
    # shared K=V head (§4.3)
    kvraw = linear(x, P[pre + "attn.wkv.weight"])                                              # [B,T,c]
    kv = act(rope(rmsnorm_of_raw(kvraw, P[pre + "attn.kv_norm.weight"], eps), cos_t, sin_t))

    Nc = T // ratio if ratio > 0 else 0
    keys, sel, topk_ids, kl = kv, torch.zeros(B, T, 0, dtype=torch.bool), None, None
    if ratio > 0:
        cos_c, sin_c = rope_cos_sin(theta, torch.arange(Nc) * ratio, dtype)
        cp = pre + "attn.compressor."
        kvc = compressor(x, P[cp + "wkv.weight"], P[cp + "wgate.weight"], P[cp + "ape"], P[cp + "norm.weight"],
                         ratio, c, cos_c, sin_c, eps)                                            # [B,Nc,c]
        keys = torch.cat([kv, kvc], dim=1)                                                       # [B,T+Nc,c]
        usable = usable_mask(T, Nc, ratio)                                                       # [T,Nc]
        sel = usable.unsqueeze(0).expand(B, T, Nc)
        if ratio == 4:
            # lightning indexer (§4.5) on detached inputs, float only (no Hadamard, no FP4)
            HI, dI = cfg.idx_heads, cfg.idx_dim
            ip = pre + "attn.indexer."
            xd, qrd = x.detach(), qr.detach()
            qi = act(rope(linear(qrd, P[ip + "wq_b.weight"]).unflatten(-1, (HI, dI)), cos_t, sin_t))  # [B,T,HI,dI]
            ki = compressor(xd, P[ip + "compressor.wkv.weight"], P[ip + "compressor.wgate.weight"],
                            P[ip + "compressor.ape"], P[ip + "compressor.norm.weight"], 4, dI, cos_c, sin_c, eps)
            w = linear(xd, P[ip + "weights_proj.weight"]) * (dI ** -0.5 * HI ** -0.5)           # [B,T,HI]
            scores = indexer_scores(qi, ki, w)                                                   # [B,T,Nc]
            top_sel, topk_ids = select_topk(scores, usable, cfg.idx_topk)
            if not cfg.csa_dense:
                sel = top_sel
    mask = attention_mask(T, cfg.window, sel, dtype)                                             # [B,T,T+Nc]

    o, p = attention_probs(q, keys, mask, P[pre + "attn.attn_sink"], c ** -0.5)                 # [B,T,H,c]
    if ratio == 4:
        teacher = p[..., T:].detach().sum(2)                                                     # [B,T,Nc]
        kl = indexer_kl(teacher, scores, sel)

    # output path (§4.7): inverse rope at the query position, grouped wo_a, wo_b
    o = rope(o, cos_t, sin_t, inverse=True).reshape(B, T, G, H * c // G)
    wo_a = P[pre + "attn.wo_a.weight"].view(G, cfg.o_lora, H * c // G)
    if BF16:  # one GEMM per group
        z = act(torch.stack([linear(o[:, :, g], wo_a[g]) for g in range(G)], dim=2).flatten(2))
    else:
        z = torch.einsum("btgd,grd->btgr", o, wo_a).flatten(2)                                  # [B,T,G·R]
    return act(linear(z, P[pre + "attn.wo_b.weight"])), topk_ids, kl


# ----------------------------------------------------------------------------- MoE (§5)

def swiglu(g, u, limit):
    """silu(min(g, limit)) · clamp(u, -limit, limit); limit <= 0: no clamp."""
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return F.silu(g) * u


def moe(P, pre, x, ids, cfg, hash_layer):
    """x: [B,T,D], ids: [B,T] -> [B,T,D]. Routed experts evaluated densely, weighted by the
    [N, E] routing matrix (zero off the selection); the shared expert always added."""
    B, T, D = x.shape
    E, K = cfg.n_experts, cfg.topk_experts
    xf = x.reshape(B * T, D)                                                  # [N,D]
    s = torch.sqrt(F.softplus(linear(xf, P[pre + "ffn.gate.weight"])))         # [N,E] affinities
    if hash_layer:
        idx = P[pre + "ffn.gate.tid2eid"][ids.reshape(-1).long()]           # [N,K]
    else:
        idx = stable_topk_desc(s.detach() + P[pre + "ffn.gate.bias"].detach(), K)   # bias: selection only
    w = s.gather(1, idx)
    w = w / w.sum(-1, keepdim=True) * cfg.route_scale                         # [N,K]
    route = torch.zeros_like(s).scatter_add(1, idx, w)                       # [N,E]
    y = torch.zeros_like(xf)
    for e in range(E):
        ep = f"{pre}ffn.experts.{e}."
        y = y + expert(P, ep, xf, route[:, e:e + 1], cfg.swiglu_limit)       # weight applied before w2
    y = y + expert(P, pre + "ffn.shared_experts.", xf, None, cfg.swiglu_limit)
    return act(y.view(B, T, D))


def expert(P, ep, x, r, limit):
    """w2(r · swiglu(w1 x, w3 x)); r: [N, 1] routing weights or None (the shared expert). x: [N, D]."""
    h1, h3 = linear(x, P[ep + "w1.weight"]), linear(x, P[ep + "w3.weight"])      # [N,I] bf16 slots

    def gated(g, u):
        h = swiglu(g, u, limit)
        return h if r is None else h * r

    h = split(gated, [h1, h3], [act(h1), act(h3)])
    saved = gated(bf16_round(h1), bf16_round(h3)).detach() if BF16 else None    # what ds4's w2 backward reads
    return linear(h, P[ep + "w2.weight"], saved)


# ----------------------------------------------------------------------------- model (§2, §2.1)

def block(P, pre, X, ids, cfg, layer_idx, dtype):
    """One V4 block on the residual streams X: [B,T,n,D]."""
    ratio = cfg.ratios[layer_idx]
    eps = cfg.norm_eps
    res = X
    x, post, comb = hc_pre(X, P[pre + "hc_attn_fn"], P[pre + "hc_attn_scale"], P[pre + "hc_attn_base"], cfg)
    x, topk_ids, kl = attention(P, pre, act(rmsnorm(x, P[pre + "attn_norm.weight"], eps)), cfg, ratio, dtype)
    X = act(hc_post(x, res, post, comb))                                       # X_mid
    res = X
    x, post, comb = hc_pre(X, P[pre + "hc_ffn_fn"], P[pre + "hc_ffn_scale"], P[pre + "hc_ffn_base"], cfg)
    x = moe(P, pre, act(rmsnorm(x, P[pre + "ffn_norm.weight"], eps)), ids, cfg, layer_idx < cfg.n_hash)
    return hc_post(x, res, post, comb), topk_ids, kl


def mean_ce(logits, targets):
    """Mean cross-entropy over rows; 0 when there are none."""
    if targets.numel() == 0:
        return logits.sum() * 0
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def forward(P, ids, cfg):
    """Full forward and the losses (docs/contract.md). ids: int [B,T]. Returns a dict with
    logits, mtp_logits (or None), loss, mtp_loss, indexer_loss, total_loss, topk {layer: ids}."""
    dtype = P["embed.weight"].dtype
    B, T = ids.shape
    n, eps = cfg.hc, cfg.norm_eps
    ids = ids.long()
    X = act(P["embed.weight"][ids].unsqueeze(2).expand(B, T, n, cfg.dim))     # [B,T,n,D] all streams = embedding
    topk, kls = {}, []
    for L in range(cfg.n_layers):
        X, t_ids, kl = block(P, f"layers.{L}.", X, ids, cfg, L, dtype)
        X = act(X)                                                              # the stream X[L+1]
        if t_ids is not None:
            topk[L] = t_ids
            kls.append(kl)
    y = hc_head(X, P["hc_head_fn"], P["hc_head_scale"], P["hc_head_base"], cfg)
    logits = linear(rmsnorm(y, P["norm.weight"], eps), P["head.weight"])       # [B,T,V]
    loss = mean_ce(logits[:, :-1], ids[:, 1:])

    mtp_logits, mtp_loss = None, logits.sum() * 0
    if cfg.n_mtp:
        pre = "mtp.0."
        ids_next = torch.cat([ids[:, 1:], torch.zeros(B, 1, dtype=ids.dtype)], dim=1)   # token t+1, 0 at T-1
        e = rmsnorm(P["embed.weight"][ids_next], P[pre + "enorm.weight"], eps)           # [B,T,D]
        h = rmsnorm(X, P[pre + "hnorm.weight"], eps)                                     # [B,T,n,D] per stream
        Xm = linear(e, P[pre + "e_proj.weight"]).unsqueeze(2) + linear(h, P[pre + "h_proj.weight"])
        Xm, _, _ = block(P, pre, Xm, ids_next, cfg, cfg.n_layers, dtype)
        ym = hc_head(Xm, P[pre + "hc_head_fn"], P[pre + "hc_head_scale"], P[pre + "hc_head_base"], cfg)
        mtp_logits = linear(rmsnorm(ym, P[pre + "norm.weight"], eps), P["head.weight"])
        mtp_loss = mean_ce(mtp_logits[:, :-2], ids[:, 2:])

    indexer_loss = sum(kls) if kls else logits.sum() * 0
    total = loss + cfg.mtp_loss_weight * mtp_loss + cfg.indexer_loss_coeff * indexer_loss
    return {"logits": logits, "mtp_logits": mtp_logits, "loss": loss, "mtp_loss": mtp_loss,
            "indexer_loss": indexer_loss, "total_loss": total, "topk": topk}


def debug_state(P, ids, cfg):
    """Forward + backward of total_loss; returns the {name: tensor} dict that debug-state writes."""
    for t in P.values():
        if t.requires_grad:
            t.grad = None
    r = forward(P, ids, cfg)
    r["total_loss"].backward()
    out = {"logits": r["logits"].detach().float()}
    if r["mtp_logits"] is not None:
        out["mtp_logits"] = r["mtp_logits"].detach().float()
    for k in ("loss", "mtp_loss", "indexer_loss", "total_loss"):
        out[k] = r[k].detach().float().reshape(1)
    for name, t in P.items():
        if t.is_floating_point():
            g = t.grad if t.grad is not None else torch.zeros_like(t)
            out["grad." + name] = g.detach().float()
    for L, t_ids in r["topk"].items():
        out[f"indexer_topk.{L}"] = t_ids
    return out


def load_batch(path, vocab):
    try:
        b = safetensors_io.load(path)
    except (OSError, ValueError) as e:
        raise RefError(str(e))
    if "input_ids" not in b:
        raise RefError(f"{path}: missing tensor 'input_ids' (expected I32 [B, T])")
    ids = b["input_ids"]
    if ids.dtype != torch.int32 or ids.dim() != 2:
        raise RefError(f"{path}: tensor 'input_ids' is {ids.dtype} {list(ids.shape)}; expected I32 [B, T]")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise RefError(f"{path}: tensor 'input_ids' has ids outside [0, {vocab})")
    return ids


def main(argv=None):
    ap = argparse.ArgumentParser(description="ds4 PyTorch reference: debug-state")
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--mixed-precision-param", default="float32", choices=["float32", "bfloat16"],
                    help="bfloat16: round where ds4's bf16 mixed precision rounds (fp32 math otherwise)")
    a = ap.parse_args(argv)
    global BF16
    BF16 = a.mixed_precision_param == "bfloat16"
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    dtype = torch.float64 if a.dtype == "float64" else torch.float32
    try:
        cfg = Config.load(os.path.join(a.model, "config.json"))
        P = load_params(a.model, cfg, dtype)
        ids = load_batch(a.batch, cfg.vocab)
        out = debug_state(P, ids, cfg)
        safetensors_io.save(a.out, out)
    except RefError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
