#!/usr/bin/python3
"""Muon beside AdamW in PyTorch, written from the recipe (docs/muon.md), not from ds4's C: the reference
that tests/test_muon_ref.py holds ds4's optimizer step against.

Groups (by name and shape, the recipe's list):
  Muon   2-D weight matrices: attention, compressors, indexer, router gate, every routed expert on its
         own, shared experts, MTP projections
  AdamW  everything else: embedding, head, norms, sinks, mHC (hc_*), compressor ape; the router bias
         (ffn.gate.bias) is not trained by gradients at all and stays as it is
Per Muon matrix W [A, B], gradient G, momentum M (zero at first):
  M = mu*M + G;  U = G + mu*M (Nesterov) or M
  O = NS(U): X = U (or U^T when A > B) / (||U||_F + 1e-7), then per iteration X = a*X + (b*S + c*S@S) @ X
      with S = X @ X^T; (a, b, c) = (3.4445, -4.7750, 2.0315), the last `final` ones (2, -1.5, 0.5)
  W = W - lr*wd*W - lr*scale*O, scale = update_rms*sqrt(max(A, B))
AdamW (decoupled decay on 2-D tensors except ape):
  m = b1*m + (1-b1)*g;  v = b2*v + (1-b2)*g^2
  W = W - lr*wd*W (decayed ones);  W = W - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
"""
import math

import torch

KELLER = (3.4445, -4.7750, 2.0315)
SETTLE = (2.0, -1.5, 0.5)


def is_muon(name, shape):
    if len(shape) != 2 or name in ("embed.weight", "head.weight"):
        return False
    leaf = name.rsplit(".", 1)[-1]
    return not (leaf.startswith("hc_") or leaf == "ape" or leaf == "tid2eid")


def is_frozen(name):
    return name.endswith("ffn.gate.bias")


def has_decay(name, shape):
    return len(shape) == 2 and not name.endswith(".ape")


def newton_schulz(u, steps, final, eps=1e-7):
    tall = u.shape[0] > u.shape[1]
    x = u.T if tall else u
    x = x / (torch.linalg.matrix_norm(x) + eps)
    for i in range(steps):
        a, b, c = SETTLE if i >= steps - final else KELLER
        s = x @ x.T
        x = a * x + (b * s + c * (s @ s)) @ x
    return x.T if tall else x


class Optimizer:
    """The state of one run: weights and moments by name, all in `dtype`."""

    def __init__(self, weights, dtype, lr, wd, b1=0.9, b2=0.95, eps=1e-8, mu=0.95, nesterov=True, steps=10,
                 final=2, update_rms=0.18):
        self.w = {k: v.to(dtype).clone() for k, v in weights.items()}
        self.m = {k: torch.zeros_like(v) for k, v in self.w.items()}
        self.v = {k: torch.zeros_like(v) for k, v in self.w.items()}
        self.t = 0
        self.lr, self.wd, self.b1, self.b2, self.eps = lr, wd, b1, b2, eps
        self.mu, self.nesterov, self.steps, self.final, self.update_rms = mu, nesterov, steps, final, update_rms

    def step(self, grads):
        self.t += 1
        for name, w in self.w.items():
            g = grads[name].to(w.dtype)
            if is_frozen(name):
                continue
            if is_muon(name, tuple(w.shape)):
                self.muon(name, w, g)
            else:
                self.adamw(name, w, g)

    def muon(self, name, w, g):
        m = self.m[name]
        m.mul_(self.mu).add_(g)
        u = g + self.mu * m if self.nesterov else m
        o = newton_schulz(u, self.steps, self.final)
        scale = self.update_rms * math.sqrt(max(w.shape))
        w.sub_(self.lr * self.wd * w)
        w.sub_(self.lr * scale * o)

    def adamw(self, name, w, g):
        m, v = self.m[name], self.v[name]
        m.mul_(self.b1).add_((1 - self.b1) * g)
        v.mul_(self.b2).add_((1 - self.b2) * g * g)
        bc1, bc2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        if has_decay(name, tuple(w.shape)):
            w.sub_(self.lr * self.wd * w)
        w.sub_((self.lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + self.eps))
