"""The small pieces every layer uses: RMSNorm, RoPE on a vector's tail, the mHC
hyper-connections, and the linear layers' decode path.

- mHC: ``hc_mult`` residual streams. Before each sub-block the streams are reduced with
  weights ``pre``; after it, ``streams = post * out + comb @ streams`` where ``comb`` is a
  Sinkhorn-normalised (doubly stochastic) matrix. pre/post/comb are computed per token from
  the RMS-normalised streams (:func:`dsv4lab.ops.mhc_pre`).
- Linear layers are plain ``nn.Linear`` without bias; on the decode path (a ``backends``
  dict given) they run through :func:`dsv4lab.ops.linear`, one launch for the 1 + k rows of
  a step.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from dsv4lab import ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def _cos_sin(pos: torch.Tensor, rope_dim: int, theta: float, memo: dict | None = None):
    key = (id(pos), rope_dim, theta)
    if memo is not None and key in memo:
        return memo[key][1:]
    half = rope_dim // 2
    inv_freq = theta ** (-torch.arange(half, device=pos.device, dtype=torch.float32) / half)
    ang = pos.to(torch.float32).unsqueeze(-1) * inv_freq
    cs = (ang.cos(), ang.sin())
    if memo is not None:
        memo[key] = (pos,) + cs          # keep pos alive: its id stays unique
    return cs


def rope_tail(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, theta: float,
              inverse: bool = False, heads: bool = False, memo: dict | None = None) -> torch.Tensor:
    """Rotate the last ``rope_dim`` dims of ``x`` (half-split pairs) by position ``pos``.

    ``pos`` has ``x``'s leading shape (``heads``: all but the head dimension, the one
    before last). ``inverse`` rotates by ``-pos``. ``memo`` (a dict living for one
    forward) shares cos/sin between the layers.
    """
    cos, sin = _cos_sin(pos, rope_dim, theta, memo)
    if heads:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    half = rope_dim // 2
    nope, r = x[..., :-rope_dim], x[..., -rope_dim:].float()
    r1, r2 = r[..., :half], r[..., half:]
    rot = torch.cat([r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1)
    return torch.cat([nope, rot.to(x.dtype)], dim=-1)


class HyperConnection(nn.Module):
    """mHC around one sub-block: reduce ``n`` streams to one input, mix them back after.

    ``mixes = (flatten(streams) @ fn.T) * rsqrt(mean(streams^2))`` gives, per token,
    ``pre`` (n), ``post`` (n) and ``comb`` (n x n, Sinkhorn-normalised).
    """

    def __init__(self, n: int, dim: int, iters: int, eps: float = 1e-6):
        super().__init__()
        self.n, self.iters, self.eps = n, iters, eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * dim))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        n = self.n
        nn.init.normal_(self.fn, std=0.1 / math.sqrt(self.fn.shape[1]))
        self.base.zero_()
        self.base[:n] = math.log(1.0 / (n - 1)) if n > 1 else 4.0   # pre = 1/n: mean of streams
        self.base[2 * n:] = 4.0 * torch.eye(n).flatten()             # comb near identity
        self.scale.fill_(1.0)

    def pre(self, x: torch.Tensor, backends: dict | None = None):
        """x [.., n, d] -> (y [.., d], post [.., n], comb [.., n, n]) via :func:`dsv4lab.ops.mhc_pre`
        (backend ``backends["mhc"]``, default "auto")."""
        return ops.mhc_pre(x, self.fn, self.base, self.scale, iters=self.iters, eps=self.eps,
                           backend=(backends or {}).get("mhc", "auto"))

    @staticmethod
    def post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             backends: dict | None = None):
        """streams_i = post_i * out + sum_j comb_ij * residual_j (:func:`dsv4lab.ops.mhc_post`)."""
        return ops.mhc_post(out, residual, post, comb, backend=(backends or {}).get("mhc", "auto"))


class HCHead(nn.Module):
    """The final reduction of the streams to one vector (pre weights only)."""

    def __init__(self, n: int, dim: int, eps: float = 1e-6):
        super().__init__()
        self.n, self.eps = n, eps
        self.fn = nn.Parameter(torch.empty(n, n * dim))
        self.base = nn.Parameter(torch.full((n,), math.log(1.0 / (n - 1)) if n > 1 else 4.0))
        nn.init.normal_(self.fn, std=0.1 / math.sqrt(n * dim))

    def forward(self, x, backends: dict | None = None):
        """x [.., n, d] -> y [.., d] via :func:`dsv4lab.ops.mhc_head`."""
        return ops.mhc_head(x, self.fn, self.base, eps=self.eps,
                            backend=(backends or {}).get("mhc", "auto"))


def make_linear(i: int, o: int) -> nn.Linear:
    """A projection ``i -> o`` without bias (every linear layer of the model)."""
    return nn.Linear(i, o, bias=False)


def apply_linear(module: nn.Linear, x: torch.Tensor, backends: dict | None) -> torch.Tensor:
    """``module(x)``; on the decode path (``backends`` a dict) through :func:`dsv4lab.ops.linear`
    with backend ``backends["linear"]`` (the one-launch small-M kernel for a few rows).
    ``backends=None`` (the training forwards) is the plain ``nn.Linear``."""
    if backends is None:
        return module(x)
    w = module.weight
    y = ops.linear(x.reshape(-1, x.shape[-1]), w, backend=backends.get("linear", "auto"))
    return y.view(*x.shape[:-1], w.shape[0])
