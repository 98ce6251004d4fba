"""``linear``: ``y = x @ weight^T`` (no bias), with a one-launch kernel for a few rows.

The decode step's projections (queries, KV, output, compressor, indexer, router, shared
expert, LM head, MTP inputs) multiply 1 + k rows (k = speculative drafts) by small
weights. cuBLAS changes algorithm with the row count (GEMV at one row; SGEMM + split-K
reduce at 2-3 rows) and the verify step pays for it; :mod:`dsv4lab.kernels.linear_small`
runs every row count from 1 to :data:`MAX_ROWS` with the same single kernel, so a row's
result does not depend on how many rows came with it (speculative output stays
identical to plain decoding).

Backends (key ``"linear"`` in the model's ``backends`` dict):

- ``"torch"``: ``torch.nn.functional.linear`` (cuBLAS on the GPU; differentiable).
- ``"triton"``: the small-M kernel, made for at most :data:`MAX_ROWS` rows (flattened
  leading dims); more rows run in blocks of 8 (correct, slow: so an engine told to use it
  can still prefill).
- ``"auto"``: ``"triton"`` on a CUDA GPU when the row count is at most :data:`MAX_ROWS`,
  the weight has at most :data:`AUTO_MAX_WEIGHT` elements and no gradient is needed;
  ``"torch"`` otherwise: more rows (a batched step, the Flash-size step benchmark's 64
  rows) are a real GEMM for cuBLAS; a big weight (most Flash-size projections, even at
  concurrency 1) is bandwidth-bound, where cuBLAS's GEMV is the tuned choice; and on the
  CPU the interpreter has nothing to gain (ask for ``backend="triton"`` to run the
  kernel there). Both limits depend on the weight and the row count only, and every row
  count of one weight up to 8 gets the same answer: plain and verify steps agree.

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4lab import backends

OP = "linear"
MAX_ROWS = 8                         # the kernel's row block: "auto" takes triton up to here
# "auto" leaves weights above this to cuBLAS: 64K elements (256 KB fp32). The kernel has no
# split-K, so a tall-K, narrow-N weight gives it few programs and a long serial K loop (Flash's
# router, 256 x 4096, runs on 64 programs; the mHC mixes, 24 x 16384, on 6): those stay with
# cuBLAS's GEMV until measured. Every mini-model weight is below (the largest, the LM head,
# is 256 x 128; the mHC mixes 24 x 512), and they are what the kernel was measured on.
AUTO_MAX_WEIGHT = 1 << 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _torch(x2, weight):
    """torch.nn.functional.linear (cuBLAS on the GPU)."""
    return F.linear(x2, weight)


def _triton(x2, weight):
    """One Triton launch (made for <= 8 rows); a row's result independent of the row count."""
    from dsv4lab.kernels.linear_small import linear_small
    return linear_small(x2, weight)


backends.register(OP, "torch", kind="torch", priority=0,
                  description="torch.nn.functional.linear (cuBLAS; differentiable)")(_torch)
backends.register(OP, "triton", kind="triton", priority=10, min_capability=(8, 0), interpreter=True,
                  description=f"one-launch small-M kernel (made for <= {MAX_ROWS} rows), capture-safe")(_triton)


def pick_backend(rows: int, backend: str = "auto", *, weight_elems: int = 0,
                 requires_grad: bool = False, target: backends.Target | None = None,
                 device: torch.device | str | None = None) -> backends.Backend:
    """The backend a ``linear`` of ``rows`` (flattened) rows by a weight of
    ``weight_elems`` (N * K) elements runs with on ``target``.

    ``"auto"``: ``"triton"`` when the target is a CUDA GPU of sm_80+, ``rows <= MAX_ROWS``,
    ``weight_elems <= AUTO_MAX_WEIGHT`` and no gradient is needed, else ``"torch"``. An
    explicit name goes through :func:`dsv4lab.backends.resolve` (``BackendUnavailable``
    saying why it cannot run).

    Explained in notebooks/05_mtp_speculative.ipynb.
    """
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a str, got {type(backend).__name__}")
    target = target or backends.Target.current(device)
    if backend == "auto":
        small = (target.device == "cuda" and rows <= MAX_ROWS and weight_elems <= AUTO_MAX_WEIGHT
                 and not requires_grad)
        backend = "triton" if small else "torch"
        if backend == "triton" and backends.resolve(OP, "auto", target=target).name != "triton":
            backend = "torch"            # e.g. a GPU older than sm_80: cuBLAS it is
    be = backends.resolve(OP, backend, target=target)
    if requires_grad and be.kind != "torch":
        raise backends.BackendUnavailable(
            f"{OP}: backend {backend!r} has no backward and an input requires grad; "
            f"use 'torch' or run under torch.no_grad()")
    return be


def linear(x: torch.Tensor, weight: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``x [M, K] or [B, S, K] @ weight [N, K]^T -> [M, N] / [B, S, N]`` in x's dtype.

    x and weight: same float dtype (fp32, bf16, fp16) and device; fp32 accumulation.
    ``backend``: "auto", "torch" or "triton" (made for at most :data:`MAX_ROWS` rows:
    ``M`` or ``B * S``); see the module docstring for what "auto" picks (a CUDA GPU,
    at most 8 rows, a weight of at most :data:`AUTO_MAX_WEIGHT` elements: the kernel).

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
    if weight.dtype != x.dtype:
        raise ValueError(f"weight must have x's dtype {x.dtype}, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    lead = tuple(x.shape[:-1])
    rows = 1
    for s in lead:
        rows *= s
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    be = pick_backend(rows, backend, weight_elems=N * K, requires_grad=grad, device=x.device)
    if be.kind == "triton":
        x2 = x.reshape(rows, K)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        return be.fn(x2, w).view(*lead, N)
    return be.fn(x, weight)
