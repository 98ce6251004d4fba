"""The small pieces every layer uses: RMSNorm, RoPE on a vector's tail, the mHC
hyper-connections, and the linear layers' decode path.

- mHC: ``hc_mult`` residual streams. Before each sub-block the streams are reduced with
  weights ``pre``; after it, ``streams = post * out + comb @ streams`` where ``comb`` is a
  Sinkhorn-normalised (doubly stochastic) matrix. pre/post/comb are computed per token from
  the RMS-normalised streams (:func:`dsv4lab.ops.mhc_pre`).
- Linear layers are plain ``nn.Linear`` without bias, or :class:`BlockScaledFP8Linear`: the
  released checkpoint's dense projections, an e4m3 weight ``[N, K]`` with one power-of-two
  fp32 scale per 128 x 128 block. On the decode path (a ``backends`` dict given) both run
  through :func:`dsv4lab.ops.linear`, one launch for the 1 + k rows of a step.
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


# ---- FP8 block-scaled projections (the released checkpoint's dense weights) -------------------
FP8_BLOCK = (128, 128)           # (rows, columns) a scale covers: quantization_config's weight_block_size
E4M3_MAX = 448.0
_E8M0_MIN, _E8M0_MAX = -127, 127   # the exponents an E8M0 byte holds (255 is NaN)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expand_block_scale(scale: torch.Tensor, shape, block=FP8_BLOCK) -> torch.Tensor:
    """Per-block scales ``[ceil(N/bn), ceil(K/bk)]`` -> one per weight ``[N, K]`` (fp32)."""
    N, K = shape
    return scale.float().repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]


def fp8_block_quantize(w: torch.Tensor, block=FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> (float8_e4m3fn ``[N, K]``, fp32 scales ``[ceil(N/bn), ceil(K/bk)]``).

    Each block's scale is the smallest power of two ``s`` with ``amax / s <= 448`` (ue8m0, as
    the released checkpoint's ``scale_fmt``; an all-zero block gets 1); values round to the
    nearest e4m3. Non-finite input is a ValueError."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float tensor [N, K], got {w.dtype} {tuple(w.shape)}")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("w has NaN or Inf values: FP8 block quantisation needs finite weights")
    N, K = wf.shape
    bn, bk = block
    nb, kb = _cdiv(N, bn), _cdiv(K, bk)
    pad = torch.nn.functional.pad(wf, (0, kb * bk - K, 0, nb * bn - N))
    amax = pad.view(nb, bn, kb, bk).abs().amax(dim=(1, 3))
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))))
    scale = torch.exp2(e.clamp(_E8M0_MIN, _E8M0_MAX))
    q = (wf / expand_block_scale(scale, (N, K), block)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


class BlockScaledFP8Linear(nn.Module):
    """A projection stored as DeepSeek-V4's checkpoint stores its dense weights: ``weight``
    float8_e4m3fn ``[N, K]`` and ``weight_scale`` fp32 ``[ceil(N/128), ceil(K/128)]`` (powers
    of two), ``W = weight * its block's scale``; both buffers (no gradient, kept by
    :func:`dsv4lab.model.to_dtype`). The plain forward is :func:`dsv4lab.ops.linear`'s torch
    reference (dequantise, fp32 product); the decode path (:func:`apply_linear`) hands the
    same tensors to ``ops.linear``'s kernels."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, block=FP8_BLOCK):
        super().__init__()
        if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
            raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
        block = tuple(int(b) for b in block)
        want = (_cdiv(weight.shape[0], block[0]), _cdiv(weight.shape[1], block[1]))
        if tuple(weight_scale.shape) != want:
            raise ValueError(f"weight_scale must be {list(want)} for weight {list(weight.shape)} in "
                             f"{block[0]}x{block[1]} blocks, got {list(weight_scale.shape)}")
        self.block = block
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", weight_scale.float())

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @classmethod
    def quantize(cls, w: torch.Tensor, block=FP8_BLOCK) -> "BlockScaledFP8Linear":
        """The FP8 form of a float weight ``w [N, K]`` (:func:`fp8_block_quantize`)."""
        return cls(*fp8_block_quantize(w, block), block)

    def dequantize(self, dtype=torch.float32) -> torch.Tensor:
        """``W [N, K]`` in ``dtype`` (exact in fp32: e4m3 times a power of two)."""
        return (self.weight.float() * expand_block_scale(self.weight_scale, self.weight.shape,
                                                         self.block)).to(dtype)

    def forward(self, x, groups: int = 1):
        """``x @ W^T`` (``groups`` G: row group g of W applied to column group g of x)."""
        return ops.linear(x, self.weight, weight_scale=self.weight_scale, block=self.block, groups=groups,
                          backend="torch")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, block={self.block}"


def linear_as(module: nn.Module, projections: str, dtype=torch.bfloat16) -> nn.Module:
    """``module`` (an ``nn.Linear`` or :class:`BlockScaledFP8Linear`) in format ``projections``:
    "fp8" (quantised, :func:`fp8_block_quantize`) or "bf16" (dequantised to ``dtype``); the
    module itself when it already is."""
    if projections == "fp8":
        if isinstance(module, BlockScaledFP8Linear):
            return module
        return BlockScaledFP8Linear.quantize(module.weight)
    if projections != "bf16":
        raise ValueError(f"projections must be 'bf16' or 'fp8', got {projections!r}")
    if not isinstance(module, BlockScaledFP8Linear):
        return module
    out = nn.Linear(module.in_features, module.out_features, bias=False, device=module.weight.device,
                    dtype=dtype)
    out.weight.data = module.dequantize(dtype)
    out.weight.requires_grad_(False)
    return out


def apply_linear(module: nn.Module, x: torch.Tensor, backends: dict | None, groups: int = 1) -> torch.Tensor:
    """``module(x)``; on the decode path (``backends`` a dict) through :func:`dsv4lab.ops.linear`
    with backend ``backends["linear"]`` (the one-launch small-M kernel for a few rows, the FP8
    kernel for block-scaled weights), value checks off (the weights were checked where they
    were made: the quantiser, the checkpoint loader). ``groups`` (FP8 only): the grouped output
    projection. ``backends=None`` (the training forwards) is the module's own forward."""
    fp8 = isinstance(module, BlockScaledFP8Linear)
    if backends is None:
        return module(x, groups) if fp8 else module(x)
    w = module.weight
    kw = dict(weight_scale=module.weight_scale, block=module.block, groups=groups) if fp8 else {}
    y = ops.linear(x.reshape(-1, x.shape[-1]), w, backend=backends.get("linear", "auto"), validate=False, **kw)
    return y.view(*x.shape[:-1], w.shape[0])
