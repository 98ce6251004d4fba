"""mHC (hyper-connections): the per-token stream mixing, as ops with a fused kernel.

DeepSeek-V4 carries ``n`` (4) residual streams. Before each sub-block :func:`mhc_pre`
reduces them to one input and computes the mixing weights; after it :func:`mhc_post`
mixes the output back in; :func:`mhc_head` is the model's final reduction. The math
(fp32; ``xf`` = a token's ``n * d`` stream values)::

    mixes = (xf @ fn.T) * rsqrt(mean(xf^2) + eps)
    pre   = sigmoid(mixes[:n] * scale[0] + base[:n]) + eps
    post  = 2 * sigmoid(mixes[n:2n] * scale[1] + base[n:2n])
    comb  = sinkhorn(mixes[2n:] * scale[2] + base[2n:], iters, eps)      # n x n
    y     = sum_i pre[i] * x[i]                       (cast to x's dtype)
    streams[i] = post[i] * out + sum_j comb[i, j] * residual[j]   (residual's dtype)

Backends (key ``"mhc"`` in the model's ``backends`` dict):

- ``"torch"``: the reference (the model's code before the kernel; differentiable).
- ``"triton"``: :mod:`dsv4lab.kernels.mhc`: the ``xf @ fn.T`` matmul goes through
  :func:`dsv4lab.ops.linear` (its small-M kernel for a decode step's few rows, cuBLAS
  otherwise), everything after it is one kernel for ``pre`` and one for ``post``
  instead of hundreds of tiny ones (20 Sinkhorn iterations of [T, 4, 4] ops). Capture-safe.
- ``"auto"``: ``"triton"`` on a CUDA GPU when no gradient is needed; otherwise
  ``"torch"`` (the kernels have no backward; on the CPU the interpreter gains nothing
  from fusing, so the model's CPU tests keep the fast reference; ask for
  ``backend="triton"`` to run the kernels in the interpreter, or set
  ``AUTO_CPU_BACKEND = "triton"`` to make "auto" do so).

Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import backends
from dsv4lab.ops import library
from dsv4lab.ops.linear import linear

OP = "mhc"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
AUTO_CPU_BACKEND = "torch"     # what "auto" runs on CPU tensors (tests switch it to "triton")


# ------------------------------------------------------------------- fp32 reference

def sinkhorn(logits: torch.Tensor, iters: int, eps: float = 1e-6) -> torch.Tensor:
    """[.., n, n] logits -> a (nearly) doubly stochastic matrix: row softmax (+ eps), a
    column normalisation, then ``iters - 1`` rounds of row and column normalisation.

    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    m = logits.softmax(-1) + eps          # every entry >= eps: the sums below are > 0
    m = m / m.sum(-2, keepdim=True)
    for _ in range(iters - 1):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def _mixes_torch(x, fn, eps):
    xf = x.flatten(-2).float()
    return (xf @ fn.float().t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class _Torch:
    """fp32 torch: the reference (differentiable)."""

    @staticmethod
    def pre(x, fn, base, scale, iters, eps):
        n = x.shape[-2]
        with torch.autocast(x.device.type, enabled=False):
            mixes = _mixes_torch(x, fn, eps)
            s, b = scale.float(), base.float()
            pre = torch.sigmoid(mixes[..., :n] * s[0] + b[:n]) + eps
            post = 2 * torch.sigmoid(mixes[..., n:2 * n] * s[1] + b[n:2 * n])
            comb = (mixes[..., 2 * n:] * s[2] + b[2 * n:]).unflatten(-1, (n, n))
            comb = sinkhorn(comb, iters, eps)
            y = (pre.unsqueeze(-1) * x.float()).sum(-2)
        return y.to(x.dtype), post, comb

    @staticmethod
    def head(x, fn, base, eps):
        with torch.autocast(x.device.type, enabled=False):
            mixes = _mixes_torch(x, fn, eps)
            pre = torch.sigmoid(mixes + base.float()) + eps
            y = (pre.unsqueeze(-1) * x.float()).sum(-2)
        return y.to(x.dtype)

    @staticmethod
    def post(out, residual, post, comb):
        with torch.autocast(out.device.type, enabled=False):
            y = post.unsqueeze(-1) * out.float().unsqueeze(-2) + comb @ residual.float()
        return y.to(residual.dtype)


def _mixes(x3, fn):
    """``xf @ fn.T`` in fp32 through :func:`dsv4lab.ops.linear` ("auto": one small-M launch for
    a decode step's few rows and a small ``fn``, whatever the row count: a speculative verify
    step's mixes then match a plain step's bit for bit; cuBLAS otherwise)."""
    T, n, d = x3.shape
    with torch.autocast(x3.device.type, enabled=False):
        return linear(x3.reshape(T, n * d).float(), fn.float().contiguous()).contiguous()


class _Triton:
    """``xf @ fn.T`` (:func:`_mixes`), then one fused Triton kernel per mix (kernels/mhc.py)."""

    @staticmethod
    def _flat(x):
        lead = x.shape[:-2]
        return lead, x.reshape(-1, x.shape[-2], x.shape[-1]).contiguous()

    @staticmethod
    def pre(x, fn, base, scale, iters, eps):
        from dsv4lab.kernels import mhc as K
        n, d = x.shape[-2:]
        lead, x3 = _Triton._flat(x)
        mixes = _mixes(x3, fn)
        y, post, comb = K.mhc_pre(x3, mixes, base.float().contiguous(), scale.float().contiguous(),
                                  iters, eps)
        return y.view(*lead, d), post.view(*lead, n), comb.view(*lead, n, n)

    @staticmethod
    def head(x, fn, base, eps):
        from dsv4lab.kernels import mhc as K
        n, d = x.shape[-2:]
        lead, x3 = _Triton._flat(x)
        mixes = _mixes(x3, fn)
        y, _, _ = K.mhc_pre(x3, mixes, base.float().contiguous(), None, 1, eps)
        return y.view(*lead, d)

    @staticmethod
    def post(out, residual, post, comb):
        from dsv4lab.kernels import mhc as K
        n, d = residual.shape[-2:]
        lead, r3 = _Triton._flat(residual)
        T = r3.shape[0]
        y = K.mhc_post(out.reshape(T, d).contiguous(), r3,
                       post.reshape(T, n).float().contiguous(),
                       comb.reshape(T, n, n).float().contiguous())
        return y.view(*lead, n, d)


backends.register(OP, "torch", kind="torch", priority=0,
                  description="fp32 torch reference (tiny ops; differentiable)")(_Torch)
backends.register(OP, "triton", kind="triton", priority=10, min_capability=(8, 0), interpreter=True,
                  description="fp32 mixes (ops.linear) + one fused Triton kernel per mix, capture-safe")(_Triton)


# --------------------------------------------------------------------------- checks

def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _float(name, t):
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _same_device(**ts):
    devs = {t.device for t in ts.values()}
    if len(devs) != 1:
        raise ValueError(f"{', '.join(ts)} must be on one device, got {sorted(str(d) for d in devs)}")


def _check_eps(eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")


def _check_streams(x):
    _tensor("x", x)
    _float("x", x)
    if x.dim() < 3:
        raise ValueError(f"x must be [..., n, d] with at least one leading dim, got shape {tuple(x.shape)}")
    n, d = x.shape[-2:]
    if n == 0 or d == 0:
        raise ValueError(f"x must have n >= 1 streams of d >= 1 values, got shape {tuple(x.shape)}")
    return n, d


def _check_weights(fn, base, n, d, M):
    _tensor("fn", fn)
    _tensor("base", base)
    _float("fn", fn)
    _float("base", base)
    if tuple(fn.shape) != (M, n * d):
        raise ValueError(f"fn must be [{M}, n*d] = [{M}, {n * d}] for x's n={n}, d={d}, "
                         f"got shape {tuple(fn.shape)}")
    if tuple(base.shape) != (M,):
        raise ValueError(f"base must be [{M}], got shape {tuple(base.shape)}")


def _pick(backend, device, tensors):
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a str, got {type(backend).__name__}")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if backend == "auto" and (grad or device.type != "cuda"):
        backend = "torch" if grad else AUTO_CPU_BACKEND
    elif grad and backend != "torch":
        be = library.resolve(OP, backend, device=device)       # unknown/unavailable first
        if be.kind != "torch":
            raise backends.BackendUnavailable(
                f"{OP}: backend {backend!r} has no backward and an input requires grad; "
                f"use 'torch' or run under torch.no_grad()")
    return library.resolve(OP, backend, device=device)


# -------------------------------------------------------------------- public ops

def mhc_pre(x, fn, base, scale, *, iters, eps=1e-6, backend="auto"):
    """Hyper-connection before a sub-block: ``(y, post, comb)``.

    x [..., n, d] (fp32/bf16/fp16) streams; fn [(2+n)*n, n*d], base [(2+n)*n], scale [3]
    (float, used in fp32). Returns y [..., d] in x's dtype (the sub-block's input),
    post [..., n] fp32 and comb [..., n, n] fp32 (Sinkhorn-normalised, ``iters`` >= 1
    iterations). See the module docstring for the math.

    Checks: shapes, dtypes, devices and the scalar arguments, on the host; no value checks.
    Under ``torch.compile``: the custom op ``torch.ops.dsv4lab.mhc_pre``.

    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.mhc_pre(x, fn, base, scale, iters=iters, eps=float(eps),
                                         backend=backend)
    n, d = _check_streams(x)
    M = (2 + n) * n
    _check_weights(fn, base, n, d, M)
    _tensor("scale", scale)
    _float("scale", scale)
    if tuple(scale.shape) != (3,):
        raise ValueError(f"scale must be [3], got shape {tuple(scale.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    _check_eps(eps)
    _same_device(x=x, fn=fn, base=base, scale=scale)
    be = _pick(backend, x.device, (x, fn, base, scale))
    return be.fn.pre(x, fn, base, scale, iters, float(eps))


def mhc_post(out, residual, post, comb, *, backend="auto"):
    """Hyper-connection after a sub-block: ``streams[i] = post[i] * out + sum_j comb[i, j] * residual[j]``.

    out [..., d] (the sub-block's output), residual [..., n, d] (the streams ``mhc_pre``
    read), post [..., n] and comb [..., n, n] (from ``mhc_pre``, fp32). Returns
    [..., n, d] in residual's dtype; the math runs in fp32.

    Checks: shapes, dtypes and devices, on the host; no value checks. Under
    ``torch.compile``: the custom op ``torch.ops.dsv4lab.mhc_post``.

    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.mhc_post(out, residual, post, comb, backend=backend)
    for name, t in (("out", out), ("residual", residual), ("post", post), ("comb", comb)):
        _tensor(name, t)
        _float(name, t)
    if residual.dim() < 3:
        raise ValueError(f"residual must be [..., n, d], got shape {tuple(residual.shape)}")
    lead, (n, d) = tuple(residual.shape[:-2]), tuple(residual.shape[-2:])
    if n == 0 or d == 0:
        raise ValueError(f"residual must have n >= 1 streams of d >= 1 values, "
                         f"got shape {tuple(residual.shape)}")
    if tuple(out.shape) != lead + (d,):
        raise ValueError(f"out must be [..., d] = {lead + (d,)} (residual's leading dims and d), "
                         f"got shape {tuple(out.shape)}")
    if tuple(post.shape) != lead + (n,):
        raise ValueError(f"post must be [..., n] = {lead + (n,)}, got shape {tuple(post.shape)}")
    if tuple(comb.shape) != lead + (n, n):
        raise ValueError(f"comb must be [..., n, n] = {lead + (n, n)}, got shape {tuple(comb.shape)}")
    _same_device(out=out, residual=residual, post=post, comb=comb)
    be = _pick(backend, residual.device, (out, residual, post, comb))
    return be.fn.post(out, residual, post, comb)


def mhc_head(x, fn, base, *, eps=1e-6, backend="auto"):
    """The model's final stream reduction: ``y = sum_i pre[i] * x[i]`` with
    ``pre = sigmoid((xf @ fn.T) * rsqrt(mean(xf^2) + eps) + base) + eps``.

    x [..., n, d]; fn [n, n*d]; base [n]. Returns y [..., d] in x's dtype.

    Checks: shapes, dtypes, devices and ``eps``, on the host; no value checks. Under
    ``torch.compile``: the custom op ``torch.ops.dsv4lab.mhc_head``.

    Explained in notebooks/06_decode_step_at_scale.ipynb.
    """
    if torch.compiler.is_compiling():
        return torch.ops.dsv4lab.mhc_head(x, fn, base, eps=float(eps), backend=backend)
    n, d = _check_streams(x)
    _check_weights(fn, base, n, d, n)
    _check_eps(eps)
    _same_device(x=x, fn=fn, base=base)
    be = _pick(backend, x.device, (x, fn, base))
    return be.fn.head(x, fn, base, float(eps))
