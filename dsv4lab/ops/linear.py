"""``linear``: ``y = x @ weight^T`` (no bias), with a one-launch kernel for a few rows.

The decode step's projections (queries, KV, output, compressor, indexer, router, shared
expert, LM head, MTP inputs) multiply 1 + k rows (k = speculative drafts) by small
weights. cuBLAS changes algorithm with the row count (GEMV at one row; GEMM + split-K
reduce at 2-3 rows) and the verify step pays for it; :mod:`dsv4lab.kernels.linear` runs
every row count from 1 to :data:`MAX_ROWS` with the same single kernel, so a row's result
does not depend on how many rows came with it (speculative output stays identical to
plain decoding).

Weights are float (fp32, bf16, fp16: x's dtype), or float8_e4m3fn with one scale per
128 x 128 block (DeepSeek-V4's released dense weights: ``weight_scale``), multiplied in
fp32 after dequantising.

Backends (key ``"linear"`` in the model's ``backends`` dict):

- ``"torch"``: ``torch.nn.functional.linear`` (cuBLAS on the GPU; differentiable); the
  only one that takes FP8 block-scaled weights (dequantised, then an fp32 product).
- ``"triton"``: the small-M kernel, made for at most :data:`MAX_ROWS` rows (flattened
  leading dims); more rows run in blocks of 8 (correct, slow: so an engine told to use it
  can still prefill).
- ``"auto"``: ``"triton"`` on a CUDA GPU when the row count is at most :data:`MAX_ROWS`,
  the weight is float with at most :data:`AUTO_MAX_WEIGHT` elements and no gradient is
  needed; ``"torch"`` otherwise: more rows are a real GEMM for cuBLAS; a big weight (most
  Flash-size projections, even at concurrency 1) is bandwidth-bound, where cuBLAS's GEMV
  is the tuned choice; and on the CPU the interpreter has nothing to gain (ask for
  ``backend="triton"`` to run the kernel there). Both limits depend on the weight and the
  row count only, and every row count of one weight up to 8 gets the same answer: plain
  and verify steps agree.

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4lab import backends

OP = "linear"
MAX_ROWS = 8                         # the kernel's row block: "auto" takes triton up to here
# "auto" leaves weights above this (64K elements, 256 KB fp32) to cuBLAS. The kernel has no
# split-K, so a tall-K, narrow-N weight gives it few programs and a long serial K loop; every
# projection of the mini model is below, and they are what the kernel was measured on.
AUTO_MAX_WEIGHT = 1 << 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
E8M0 = getattr(torch, "float8_e8m0fnu", None)
FLOAT, FP8_BLOCK = "float", "fp8_block"          # weight formats, as the registry knows them


def _torch(x, weight, scale=None, block=None):
    """torch.nn.functional.linear (cuBLAS on the GPU); FP8 weights dequantised first."""
    if scale is None:
        return F.linear(x, weight)
    N, K = weight.shape
    s = scale.repeat_interleave(block[0], 0)[:N].repeat_interleave(block[1], 1)[:, :K]
    return F.linear(x.float(), weight.float() * s).to(x.dtype)


def _triton(x2, weight):
    """One Triton launch (made for <= 8 rows); a row's result independent of the row count."""
    from dsv4lab.kernels.linear import linear as linear_kernel
    return linear_kernel(x2, weight)


backends.register(OP, "torch", kind="torch", priority=0, formats=(FLOAT, FP8_BLOCK),
                  description="torch.nn.functional.linear (cuBLAS; differentiable)")(_torch)
backends.register(OP, "triton", kind="triton", priority=10, min_capability=(8, 0), interpreter=True,
                  formats=(FLOAT,),
                  description=f"one-launch small-M kernel (made for <= {MAX_ROWS} rows), capture-safe")(_triton)


def pick_backend(rows: int, backend: str = "auto", *, weight_elems: int = 0,
                 requires_grad: bool = False, fmt: str = FLOAT,
                 target: backends.Target | None = None,
                 device: torch.device | str | None = None) -> backends.Backend:
    """The backend a ``linear`` of ``rows`` (flattened) rows by a weight of
    ``weight_elems`` (N * K) elements in format ``fmt`` ("float" or "fp8_block") runs with.

    ``"auto"``: ``"triton"`` when the target is a CUDA GPU of sm_80+, ``rows <= MAX_ROWS``,
    ``weight_elems <= AUTO_MAX_WEIGHT``, the weight is float and no gradient is needed, else
    ``"torch"``. An explicit name goes through :func:`dsv4lab.backends.resolve`
    (``BackendUnavailable`` saying why it cannot run).

    Explained in notebooks/05_mtp_speculative.ipynb.
    """
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a str, got {type(backend).__name__}")
    target = target or backends.Target.current(device)
    if backend == "auto":
        small = (target.device == "cuda" and rows <= MAX_ROWS and weight_elems <= AUTO_MAX_WEIGHT
                 and not requires_grad)
        backend = "triton" if small else "torch"
        if backend == "triton" and backends.resolve(OP, "auto", fmt=fmt, target=target).name != "triton":
            backend = "torch"            # a GPU older than sm_80, or FP8 weights: cuBLAS it is
    be = backends.resolve(OP, backend, fmt=fmt, target=target)
    if requires_grad and be.kind != "torch":
        raise backends.BackendUnavailable(
            f"{OP}: backend {backend!r} has no backward and an input requires grad; "
            f"use 'torch' or run under torch.no_grad()")
    return be


def _check_scale(weight_scale, block, N: int, K: int, device) -> torch.Tensor:
    """``weight_scale`` as fp32 [ceil(N/bn), ceil(K/bk)]; E8M0 bytes s mean 2^(s - 127)."""
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in block)):
        raise ValueError(f"block must be two positive ints (rows, columns), got {block!r}")
    if not isinstance(weight_scale, torch.Tensor):
        raise ValueError(f"weight_scale must be a torch.Tensor, got {type(weight_scale).__name__}")
    want = (-(-N // block[0]), -(-K // block[1]))
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"weight_scale must be [ceil(N/{block[0]}), ceil(K/{block[1]})] = "
                         f"{list(want)} for weight [{N}, {K}], got shape {tuple(weight_scale.shape)}")
    if weight_scale.device != device:
        raise ValueError(f"weight_scale must be on x's device {device}, got {weight_scale.device}")
    if weight_scale.dtype == torch.uint8:
        return torch.exp2(weight_scale.float() - 127.0)
    if weight_scale.dtype == torch.float32 or (E8M0 is not None and weight_scale.dtype == E8M0):
        return weight_scale.float()
    raise ValueError(f"weight_scale must be float32 or E8M0 bytes (uint8), got {weight_scale.dtype}")


def linear(x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None,
           block=(128, 128), backend: str = "auto") -> torch.Tensor:
    """``x [M, K] or [B, S, K] @ weight [N, K]^T -> [M, N] / [B, S, N]`` in x's dtype.

    x: fp32, bf16 or fp16. weight: x's dtype, or float8_e4m3fn with ``weight_scale``
    [ceil(N/128), ceil(K/128)] (one scale per ``block`` of weights: float32 powers of two, or
    E8M0 bytes, 2^(s - 127)). fp32 accumulation. ``backend``: "auto", "torch" or "triton"
    (float weights, made for at most :data:`MAX_ROWS` rows: ``M`` or ``B * S``); see the
    module docstring for what "auto" picks.

    Checks: shapes, dtypes and devices, on the host; no value checks (scales are checked
    where weights are quantised or loaded).

    Explained in notebooks/05_mtp_speculative.ipynb.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.dim() not in (2, 3):
        raise ValueError(f"x must be 2-D [M, K] or 3-D [B, S, K], got shape {tuple(x.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"x's last dim must be K = {K} (weight is [N, K] = {tuple(weight.shape)}), "
                         f"got shape {tuple(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    scale = None
    if weight.dtype == FP8:
        if weight_scale is None:
            raise ValueError("weight is float8_e4m3fn: pass its weight_scale (one scale per block)")
        scale = _check_scale(weight_scale, block, N, K, x.device)
    elif weight_scale is not None:
        raise ValueError(f"weight_scale goes with float8_e4m3fn weights, got a {weight.dtype} weight")
    elif weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype} (or be float8_e4m3fn with a "
                         f"weight_scale), got {weight.dtype}")
    lead = tuple(x.shape[:-1])
    rows = 1
    for s in lead:
        rows *= s
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    be = pick_backend(rows, backend, weight_elems=N * K, requires_grad=grad,
                      fmt=FLOAT if scale is None else FP8_BLOCK, device=x.device)
    if scale is not None:
        return be.fn(x, weight, scale, tuple(block))
    if be.kind == "triton":
        x2 = x.reshape(rows, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        return be.fn(x2, w).view(*lead, N)
    return be.fn(x, weight)
