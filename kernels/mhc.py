"""
mHC (manifold-constrained hyper-connections): the per-token mixing math, fused
==============================================================================

DeepSeek-V4 keeps ``n`` (4) residual streams per token. Around each sub-block a
hyper-connection computes, per token, from the flattened streams ``xf`` (``n * d`` values)::

    mixes = (xf @ fn.T) * rsqrt(mean(xf^2) + eps)                  # (2 + n) * n values
    pre   = sigmoid(mixes[:n] * s0 + b[:n]) + eps                   # n
    post  = 2 * sigmoid(mixes[n:2n] * s1 + b[n:2n])                 # n
    comb  = sinkhorn(mixes[2n:] * s2 + b[2n:])                      # n x n
    y     = sum_i pre[i] * x[i]                                     # d: the sub-block input

and after the sub-block (output ``out``)::

    streams[i] = post[i] * out + sum_j comb[i, j] * x[j]

``sinkhorn``: row softmax, ``+ eps``, a column normalisation, then ``iters - 1`` rounds of
(row, column) normalisation. In torch: hundreds of tiny launches a layer, costing more than
the math (a few KB a token). Here:

- :func:`mhc_pre_kernel`: a program per (token, d-slice) reads the streams for the sum of
  squares, runs the n x n Sinkhorn in registers, stores ``post`` and ``comb`` (first slice)
  and its slice of ``y``. The ``xf @ fn.T`` GEMM stays outside. ``HEAD=True``: the model's
  final reduction (pre weights only, no ``scale``).
- :func:`mhc_post_kernel`: a program per (token, d-block): ``n`` rows of ``post * out + comb @ x``.

The passes over the streams are ``tl.range(..., num_stages=...)`` loops: without a ``tl.dot``
the pipeliner leaves loads alone unless asked. Fixed grids, no host sync (CUDA-graph safe),
fp32 math; runs in Triton's interpreter. Explained in notebooks/06_decode_step_at_scale.ipynb.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import DeviceProps, Route, props as device_props
from dsv4lab.kernels.launch import Launch, planned
from dsv4lab.kernels.offline import Case


@triton.jit
def mhc_pre_kernel(x_ptr, mix_ptr, base_ptr, scale_ptr, y_ptr, post_ptr, comb_ptr,
                   D, iters, eps, blocks_per_split,
                   N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr,
                   HEAD: tl.constexpr, STAGES: tl.constexpr):
    """x [T, N, D] (any float), mixes [T, M] fp32 (xf @ fn.T, not yet scaled), y [T, D]."""
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    M: tl.constexpr = N if HEAD else (2 + N) * N
    rows = tl.arange(0, NP)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_D)
    x_row = x_ptr + t * N * D

    # 1) sum of squares over all n*d values of the token (every d-slice needs it)
    acc = tl.zeros([NP, BLOCK_D], dtype=tl.float32)
    for d0 in tl.range(0, D, BLOCK_D, num_stages=STAGES):
        c = d0 + cols
        m = rmask[:, None] & (c < D)[None, :]
        v = tl.load(x_row + rows[:, None] * D + c[None, :], mask=m, other=0.0).to(tl.float32)
        acc += v * v
    ss = tl.sum(tl.sum(acc, axis=1), axis=0)
    r = tl.rsqrt(ss / (N * D) + eps)

    # 2) the per-token mixing weights (a few dozen scalars, in registers)
    mix = mix_ptr + t * M
    if HEAD:
        a_pre = tl.load(mix + rows, mask=rmask, other=0.0) * r
    else:
        a_pre = tl.load(mix + rows, mask=rmask, other=0.0) * r * tl.load(scale_ptr)
    pre = tl.sigmoid(a_pre + tl.load(base_ptr + rows, mask=rmask, other=0.0)) + eps
    pre = tl.where(rmask, pre, 0.0)

    if not HEAD:
        if s == 0:
            s1 = tl.load(scale_ptr + 1)
            s2 = tl.load(scale_ptr + 2)
            a_post = tl.load(mix + N + rows, mask=rmask, other=0.0) * r * s1
            post = 2.0 * tl.sigmoid(a_post + tl.load(base_ptr + N + rows, mask=rmask, other=0.0))
            tl.store(post_ptr + t * N + rows, post, mask=rmask)

            cidx = rows[:, None] * N + rows[None, :]
            cmask = rmask[:, None] & rmask[None, :]
            logits = tl.load(mix + 2 * N + cidx, mask=cmask, other=0.0) * r * s2 \
                + tl.load(base_ptr + 2 * N + cidx, mask=cmask, other=0.0)
            logits = tl.where(cmask, logits, float("-inf"))
            # row softmax + eps (padded entries stay exactly 0)
            mx = tl.where(rmask, tl.max(logits, axis=1), 0.0)   # padded rows: no -inf - -inf
            e = tl.exp(logits - mx[:, None])
            e = tl.where(cmask, e, 0.0)
            rs = tl.sum(e, axis=1)
            mat = tl.where(cmask, e / tl.where(rmask, rs, 1.0)[:, None] + eps, 0.0)
            cs = tl.sum(mat, axis=0)
            mat = mat / tl.where(rmask, cs, 1.0)[None, :]
            for _ in range(iters - 1):
                rs = tl.sum(mat, axis=1)
                mat = mat / tl.where(rmask, rs, 1.0)[:, None]
                cs = tl.sum(mat, axis=0)
                mat = mat / tl.where(rmask, cs, 1.0)[None, :]
            tl.store(comb_ptr + t * N * N + cidx, mat, mask=cmask)

    # 3) y = sum_i pre[i] * x[i] over this program's slice of d
    d_start = s * blocks_per_split * BLOCK_D
    d_end = tl.minimum(D, d_start + blocks_per_split * BLOCK_D)
    for d0 in tl.range(d_start, d_end, BLOCK_D, num_stages=STAGES):
        c = d0 + cols
        cm = c < d_end
        m = rmask[:, None] & cm[None, :]
        v = tl.load(x_row + rows[:, None] * D + c[None, :], mask=m, other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * v, axis=0)
        tl.store(y_ptr + t * D + c, y.to(y_ptr.dtype.element_ty), mask=cm)


@triton.jit
def mhc_post_kernel(out_ptr, res_ptr, post_ptr, comb_ptr, y_ptr, D,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[t, i, :] = post[t, i] * out[t, :] + sum_j comb[t, i, j] * res[t, j, :]."""
    t = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    rows = tl.arange(0, NP)
    rmask = rows < N
    c = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    cm = c < D
    res = tl.load(res_ptr + t * N * D + rows[:, None] * D + c[None, :],
                  mask=rmask[:, None] & cm[None, :], other=0.0).to(tl.float32)
    o = tl.load(out_ptr + t * D + c, mask=cm, other=0.0).to(tl.float32)
    for i in tl.static_range(N):
        p_i = tl.load(post_ptr + t * N + i)
        c_i = tl.load(comb_ptr + t * N * N + i * N + rows, mask=rmask, other=0.0)
        y = p_i * o + tl.sum(c_i[:, None] * res, axis=0)
        tl.store(y_ptr + t * N * D + i * D + c, y.to(y_ptr.dtype.element_ty), mask=cm)


# ------------------------------------------------------------------- the dispatch table
TABLES = {
    "mhc_pre": (Route("mhc_pre_kernel", None, "every shape (after the xf @ fn.T matmul)",
                      "one launch instead of the reference's ~hundred tiny ops (`dsv4lab bench mhc`)"),),
    "mhc_head": (Route("mhc_pre_kernel, HEAD", None, "every shape (after the xf @ fn.T matmul)",
                       "the final reduction: pre weights only, one launch"),),
    "mhc_post": (Route("mhc_post_kernel", None, "every shape",
                       "one launch for post * out + comb @ x (`dsv4lab bench mhc`)"),),
}

STAGES = 3            # pipeline depth of mhc_pre_kernel's two passes over the streams
NUM_WARPS = 4


def pre_launch(T: int, n: int, d: int, props: DeviceProps, *, block_d: int | None = None,
               split: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_D, split, blocks_per_split)`` of :func:`mhc_pre_kernel`: enough d-slices a
    token for two programs an SM (``block_d``, ``split``: overrides)."""
    np2 = triton.next_power_of_2(n)
    BLOCK_D = block_d or max(16, min(triton.next_power_of_2(d), 2048 // np2))
    n_blocks = triton.cdiv(d, BLOCK_D)
    if split is None:
        split = max(1, min(n_blocks, triton.cdiv(2 * props.sm_count, T)))
    split = max(1, min(split, n_blocks))
    per = triton.cdiv(n_blocks, split)
    return BLOCK_D, triton.cdiv(n_blocks, per), per


def post_block(n: int, d: int) -> int:
    """BLOCK_D of :func:`mhc_post_kernel`: n rows of BLOCK_D values, 1024 in all."""
    return max(16, min(triton.next_power_of_2(d), 1024 // triton.next_power_of_2(n)))


def mhc_pre(x: torch.Tensor, mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor | None,
            iters: int, eps: float, *, block_d: int | None = None, split: int | None = None,
            props: DeviceProps | None = None):
    """x [T, n, d], mixes [T, M] (``xf @ fn.T``), base [M], scale [3] (None: the head) ->
    (y [T, d], post [T, n], comb [T, n, n]); post and comb None for the head."""
    T, n, d = x.shape
    head = scale is None
    y = torch.empty((T, d), dtype=x.dtype, device=x.device)
    post = None if head else torch.empty((T, n), dtype=torch.float32, device=x.device)
    comb = None if head else torch.empty((T, n, n), dtype=torch.float32, device=x.device)
    if T == 0:
        return y, post, comb
    dev = x.device
    launch = planned(_PRE, (dev, T, n, d, head, int(iters), block_d, split, props), dev,
                     lambda: _pre_plan(dev, T, n, d, head, int(iters), block_d, split,
                                       props or device_props(dev)))
    launch(x, mixes, base, scale if not head else base, y, post if not head else y,
           comb if not head else y, float(eps))
    return y, post, comb


_PRE: dict = {}
_POST: dict = {}


def _pre_plan(device, T, n, d, head, iters, block_d, split, props) -> Launch:
    BLOCK_D, split, per = pre_launch(T, n, d, props, block_d=block_d, split=split)
    return Launch(mhc_pre_kernel, (T, split), dict(
        D=d, iters=iters, blocks_per_split=per, N=n, NP=triton.next_power_of_2(n),
        BLOCK_D=BLOCK_D, HEAD=head, STAGES=STAGES), device=device, guard=(0, 1, 2, 3),
        num_warps=NUM_WARPS)


def mhc_post(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             *, block_d: int | None = None) -> torch.Tensor:
    """out [T, d], residual [T, n, d], post, comb (fp32) -> streams [T, n, d]."""
    T, n, d = residual.shape
    y = torch.empty_like(residual)
    if T == 0:
        return y
    dev = residual.device
    BLOCK_D = block_d or post_block(n, d)
    launch = planned(_POST, (dev, T, n, d, BLOCK_D), dev, lambda: Launch(
        mhc_post_kernel, (T, triton.cdiv(d, BLOCK_D)),
        dict(D=d, N=n, NP=triton.next_power_of_2(n), BLOCK_D=BLOCK_D), device=dev,
        guard=(0, 1, 2, 3), num_warps=NUM_WARPS))
    launch(out, residual, post, comb, y)
    return y


# -------------------------------------------------------------------- offline compiles
def offline_cases(props: DeviceProps) -> list[Case]:
    """The launches on ``props`` at V4-Flash's shape (4 bf16 streams of 4096), T 1 and 64."""
    n, d, np2 = 4, 4096, 4
    cases = []
    for T in (1, 64):
        BLOCK_D, _, per = pre_launch(T, n, d, props)
        for head in (False, True):
            consts = dict(N=n, NP=np2, BLOCK_D=BLOCK_D, HEAD=head, STAGES=STAGES)
            if per == 1:                 # Triton makes an int argument of 1 a constant
                consts["blocks_per_split"] = 1
            if head:
                consts["iters"] = 1
            cases.append(Case(f"mhc_pre_kernel{', HEAD' if head else ''}, T {T}", mhc_pre_kernel,
                              consts, types=dict(x_ptr="*bf16", y_ptr="*bf16", eps="fp32"),
                              aligned=("*", "D"), num_warps=NUM_WARPS))
        cases.append(Case(f"mhc_post_kernel, T {T}", mhc_post_kernel,
                          dict(N=n, NP=np2, BLOCK_D=post_block(n, d)),
                          types=dict(out_ptr="*bf16", res_ptr="*bf16", y_ptr="*bf16"),
                          aligned=("*", "D"), num_warps=NUM_WARPS))
    return cases
