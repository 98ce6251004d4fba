"""``linear``: ``y = x @ weight^T`` (no bias), for float weights and for DeepSeek-V4's FP8
block-scaled weights, with one-launch kernels for a decode step's rows.

The decode step's projections (queries, KV, output, compressor, indexer, router, shared
expert, LM head, MTP inputs) multiply 1 + k rows (k = speculative drafts) by small
weights. cuBLAS changes algorithm with the row count (GEMV at one row; GEMM + split-K
reduce at 2-3 rows) and the verify step pays for it; :mod:`dsv4lab.kernels.linear` runs
every row count from 1 to :data:`MAX_ROWS` with the same single kernel, so a row's result
does not depend on how many rows came with it (speculative output stays identical to
plain decoding).

Weights are float (fp32, bf16, fp16: x's dtype), or float8_e4m3fn [N, K] with one scale per
128 x 128 block, ``weight_scale`` [ceil(N/128), ceil(K/128)] (the released checkpoint's dense
projections: float32 powers of two, or E8M0 bytes, float8_e8m0fnu or uint8, meaning
2^(b - 127)); W = e4m3 value * its block's scale. ``groups`` G applies the weight's G row
groups (N / G rows each) to x's G column groups (K each): the grouped output projection
``wo_a``, 8 groups of 4096 -> 1024 stored as one [8 x 1024, 4096] weight.

Backends (key ``"linear"`` in the model's ``backends`` dict):

- ``"torch"``: the reference. Float weights: ``torch.nn.functional.linear`` (cuBLAS on the
  GPU; differentiable); FP8 weights: dequantised to fp32, an fp32 product.
- ``"triton"``: float weights: the small-M kernel, made for at most :data:`MAX_ROWS` rows
  (flattened leading dims; more rows run in blocks of 8: correct, slow, so an engine told
  to use it can still prefill), one group; FP8 weights: the FP8 kernel at any row count
  (decode or prefill tiles: ``TABLES["linear_fp8"]`` in :mod:`dsv4lab.kernels.linear`),
  groups of a multiple of 16 rows.
- ``"auto"``: FP8 weights: ``"triton"`` on a CUDA GPU of sm_80+ when no gradient is needed
  (it reads half the bytes of bf16 weights; `dsv4lab bench linear`), else ``"torch"``. Float
  weights: ``"triton"`` on a CUDA GPU when the row count is at most :data:`MAX_ROWS`, the
  weight has at most :data:`AUTO_MAX_WEIGHT` elements, one group and no gradient is needed;
  ``"torch"`` otherwise: more rows are a real GEMM for cuBLAS; a big float weight is
  bandwidth-bound, where cuBLAS's GEMV is the tuned choice. On the CPU the interpreter has
  nothing to gain (ask for ``backend="triton"`` to run a kernel there). The choice depends
  on the weight and the row count only, and every row count of one weight up to 8 gets the
  same answer: plain and verify steps agree.

Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from dsv4lab import backends
from dsv4lab.runtime import is_capturing

OP = "linear"
MAX_ROWS = 8                         # the kernel's row block: "auto" takes triton up to here
# "auto" leaves float weights above this (64K elements, 256 KB fp32) to cuBLAS. The small-M
# kernel has no split-K, so a tall-K, narrow-N weight gives it few programs and a long serial
# K loop; every projection of the mini model is below, and they are what it was measured on.
AUTO_MAX_WEIGHT = 1 << 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = torch.float8_e4m3fn
E8M0 = getattr(torch, "float8_e8m0fnu", None)
SCALE_DTYPES = tuple(d for d in (torch.float32, E8M0, torch.uint8) if d is not None)
BLOCK = (128, 128)                   # the released checkpoint's weight block
FLOAT, FP8_BLOCK = "float", "fp8_block"          # weight formats, as the registry knows them


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """An FP8 block-scaled weight [N, K] as fp32: each e4m3 value times its 128 x 128 block's
    scale (float32, or E8M0 bytes 2^(b - 127))."""
    N, K = weight.shape
    s = weight_scale
    if s.dtype != torch.float32:
        s = torch.exp2(s.view(torch.uint8).float() - 127.0)
    s = s.repeat_interleave(BLOCK[0], 0)[:N].repeat_interleave(BLOCK[1], 1)[:, :K]
    return weight.float() * s


def _torch(x, weight, scale=None, groups=1):
    """The reference: torch.nn.functional.linear (cuBLAS); FP8 weights dequantised to fp32
    first, an fp32 product; groups as one einsum."""
    w = weight if scale is None else dequantize(weight, scale)
    xx = x if scale is None else x.float()
    if groups == 1:
        y = F.linear(xx, w)
    else:
        N, K = w.shape
        y = torch.einsum("...gk,gnk->...gn", xx.unflatten(-1, (groups, K)),
                         w.view(groups, N // groups, K)).flatten(-2)
    return y.to(x.dtype)


def _triton(x2, weight, scale=None, groups=1):
    """One Triton launch: the small-M kernel (float weights, made for <= 8 rows; a row's
    result independent of the row count) or the FP8 kernel (any row count)."""
    from dsv4lab.kernels import linear as kernels
    if scale is None:
        return kernels.linear(x2, weight)
    return kernels.fp8_linear(x2, weight, scale, groups=groups)


backends.register(OP, "torch", kind="torch", priority=0, formats=(FLOAT, FP8_BLOCK),
                  description="torch.nn.functional.linear (cuBLAS; differentiable); FP8 "
                              "weights dequantised to fp32: the reference")(_torch)
backends.register(OP, "triton", kind="triton", priority=10, min_capability=(8, 0), interpreter=True,
                  formats=(FLOAT, FP8_BLOCK),
                  description=f"one launch: the small-M kernel (float weights, made for <= "
                              f"{MAX_ROWS} rows) or the FP8 block-scaled kernel; capture-safe")(_triton)


def pick_backend(rows: int, backend: str = "auto", *, weight_elems: int = 0,
                 requires_grad: bool = False, fmt: str = FLOAT, groups: int = 1,
                 weight_rows: int | None = None, target: backends.Target | None = None,
                 device: torch.device | str | None = None) -> backends.Backend:
    """The backend a ``linear`` of ``rows`` (flattened) rows by a weight of
    ``weight_elems`` (N * K) elements in format ``fmt`` ("float" or "fp8_block"), in
    ``groups`` groups of its ``weight_rows`` (N) rows, runs with.

    ``"auto"``: for FP8 weights ``"triton"`` when the target is a CUDA GPU of sm_80+ and no
    gradient is needed; for float weights ``"triton"`` when it is, ``rows <= MAX_ROWS``,
    ``weight_elems <= AUTO_MAX_WEIGHT`` and there is one group; else ``"torch"``. An
    explicit name goes through :func:`dsv4lab.backends.resolve` (``BackendUnavailable``
    saying why it cannot run).

    Explained in notebooks/05_mtp_speculative.ipynb.
    """
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a str, got {type(backend).__name__}")
    target = target or backends.Target.current(device)
    grouped = _kernel_groups_reason(fmt, groups, weight_rows)
    if backend == "auto":
        if fmt == FP8_BLOCK:
            small = target.device == "cuda" and not requires_grad and grouped is None
        else:
            small = (target.device == "cuda" and rows <= MAX_ROWS and weight_elems <= AUTO_MAX_WEIGHT
                     and not requires_grad and grouped is None)
        backend = "triton" if small else "torch"
        if backend == "triton" and backends.resolve(OP, "auto", fmt=fmt, target=target).name != "triton":
            backend = "torch"            # a GPU older than sm_80: cuBLAS it is
    be = backends.resolve(OP, backend, fmt=fmt, target=target)
    if requires_grad and be.kind != "torch":
        raise backends.BackendUnavailable(
            f"{OP}: backend {backend!r} has no backward and an input requires grad; "
            f"use 'torch' or run under torch.no_grad()")
    if be.kind == "triton" and grouped is not None:
        raise backends.BackendUnavailable(f"{OP}: backend {backend!r} {grouped}; use 'torch'")
    return be


def _kernel_groups_reason(fmt: str, groups: int, weight_rows: int | None) -> str | None:
    """Why the Triton kernels cannot take these groups, or None."""
    if groups == 1:
        return None
    if fmt != FP8_BLOCK:
        return "takes groups > 1 only with FP8 block-scaled weights"
    if weight_rows is not None and (weight_rows // groups) % 16:
        return f"needs groups of a multiple of 16 weight rows, got {weight_rows // groups}"
    return None


# ------------------------------------------------------------------ checks of FP8 weights

def _check_block(block) -> None:
    if not isinstance(block, (tuple, list)) or tuple(block) != BLOCK:
        raise ValueError(f"block must be (128, 128), the released checkpoint's weight block "
                         f"(no other block is supported), got {block!r}")


def _check_scale(weight_scale, N: int, K: int, device) -> None:
    """Shape, dtype and device of ``weight_scale`` for a weight [N, K]."""
    if not isinstance(weight_scale, torch.Tensor):
        raise ValueError(f"weight_scale must be a torch.Tensor, got {type(weight_scale).__name__}")
    want = (-(-N // BLOCK[0]), -(-K // BLOCK[1]))
    if tuple(weight_scale.shape) != want:
        raise ValueError(f"weight_scale must be [ceil(N/128), ceil(K/128)] = {list(want)} for "
                         f"weight [{N}, {K}] (one scale per 128 x 128 block), got shape "
                         f"{tuple(weight_scale.shape)}")
    if weight_scale.dtype not in SCALE_DTYPES:
        raise ValueError(f"weight_scale must be float32 or E8M0 bytes (float8_e8m0fnu or uint8), "
                         f"got {weight_scale.dtype}")
    if weight_scale.device != device:
        raise ValueError(f"weight_scale must be on x's device {device}, got {weight_scale.device}")


_CLEAN: dict = {}            # (weight key, scale key) -> weak references to the pair found clean
_CLEAN_MAX = 4096


def _key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), t._version)


def check_fp8_values(weight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    """ValueError if ``weight`` holds an e4m3 NaN byte (0x7F / 0xFF) or ``weight_scale`` a
    scale that is not a finite positive power of two (float32), or the E8M0 NaN byte 255.

    One host sync for a pair not seen before; a pair found clean is remembered by its
    tensors' storage, shape, strides, dtype, device and version (an in-place write changes
    the version) with weak references to the very tensors, so reused memory is checked
    afresh, and is not read again."""
    key = (_key(weight), _key(weight_scale))
    seen = _CLEAN.get(key)
    if seen is not None and seen[0]() is weight and seen[1]() is weight_scale:
        return
    flags = [((weight.view(torch.uint8) & 0x7F) == 0x7F).any()]
    if weight_scale.dtype == torch.float32:
        mantissa = torch.frexp(weight_scale).mantissa          # 0.5 exactly for a power of two
        flags.append((~torch.isfinite(weight_scale) | (mantissa != 0.5)).any())
    else:
        flags.append((weight_scale.view(torch.uint8) == 255).any())
    bad_weight, bad_scale = torch.stack(flags).tolist()        # the one host sync
    if bad_weight:
        raise ValueError("weight contains e4m3 NaN bytes (0x7F / 0xFF)")
    if bad_scale:
        raise ValueError("weight_scale must hold finite positive powers of two (one per 128 x 128 "
                         "block)" if weight_scale.dtype == torch.float32 else
                         "weight_scale contains 255, the E8M0 NaN encoding")
    if len(_CLEAN) >= _CLEAN_MAX:
        _CLEAN.clear()
    _CLEAN[key] = (weakref.ref(weight), weakref.ref(weight_scale))


# ------------------------------------------------------------------------------ the op

def linear(x: torch.Tensor, weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None,
           block=(128, 128), groups: int = 1, backend: str = "auto",
           validate: bool = True) -> torch.Tensor:
    """``x [..., groups * K] @ weight [N, K]^T -> [..., N]`` in x's dtype, fp32 accumulation.

    x: fp32, bf16 or fp16, any leading dims (M rows in all). weight: x's dtype, or
    float8_e4m3fn with ``weight_scale`` [ceil(N/128), ceil(K/128)] (float32 powers of two, or
    E8M0 bytes: float8_e8m0fnu or uint8, 2^(b - 127)); ``block`` must be (128, 128).
    ``groups`` G: output columns g * N/G ... use x's columns g * K ... (G divides N).
    ``backend``: "auto", "torch" or "triton"; see the module docstring for what "auto" picks.

    Checks: shapes, dtypes, devices, ``block`` and ``groups`` always, on the host (free).
    With ``validate`` (the default) and FP8 weights, the values: no e4m3 NaN byte in weight,
    every scale a finite power of two (no E8M0 255), in one host sync the first time a
    (weight, weight_scale) pair is seen, never again for the same tensors unchanged
    (:func:`check_fp8_values`); skipped while a CUDA graph is being captured.
    ``validate=False`` does no value work (weights validated where they were loaded).

    Explained in notebooks/05_mtp_speculative.ipynb.
    """
    if torch.compiler.is_compiling():      # the custom op of dsv4lab/ops/library.py
        return torch.ops.dsv4lab.linear(x, weight, weight_scale, block=list(block), groups=groups, backend=backend)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or N % groups:
        raise ValueError(f"groups must be a positive int dividing N = {N}, got {groups!r}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dim [..., K], got a 0-d tensor")
    if x.shape[-1] != groups * K:
        what = "K" if groups == 1 else f"groups * K = {groups} * {K}"
        raise ValueError(f"x's last dim must be {what} = {groups * K} (weight is [N, K] = "
                         f"{tuple(weight.shape)}), got shape {tuple(x.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight must be on x's device {x.device}, got {weight.device}")
    _check_block(block)
    scale = None
    if weight.dtype == FP8:
        if weight_scale is None:
            raise ValueError("weight is float8_e4m3fn: pass its weight_scale (one scale per block)")
        _check_scale(weight_scale, N, K, x.device)
        scale = weight_scale
        if validate and not is_capturing(x):
            check_fp8_values(weight, scale)
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
                      fmt=FLOAT if scale is None else FP8_BLOCK, groups=groups, weight_rows=N,
                      device=x.device)
    if be.kind == "triton":
        x2 = x.reshape(rows, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        w = weight if weight.stride(-1) == 1 else weight.contiguous()
        if scale is not None and scale.stride(-1) != 1:
            scale = scale.contiguous()
        return be.fn(x2, w, scale, groups).view(*lead, N)
    return be.fn(x, weight, scale, groups)
