"""
Small-M linear: ``y[M, N] = x[M, K] @ w[N, K]^T`` for a handful of rows, in ONE launch
======================================================================================

The idea
--------
A decode step of a small model multiplies 1 to a few rows (tokens) by many small weight
matrices. Every such product is latency-bound: what a step pays is the number of kernels
and how long each one waits on memory. cuBLAS picks its algorithm by M: at one row a GEMV
(one kernel); at 2..3 rows, the verify step of speculative decoding, a GEMM plus a split-K
reduce (two kernels, each slower than the GEMV), and the two shapes round differently.

Here every M in 1..8 runs the same kernel:

- one program per ``BLOCK_N`` output columns (a fixed grid, no split-K, no atomics);
- the program walks K in ``BLOCK_K`` steps, loads its ``[BLOCK_N, BLOCK_K]`` weight tile
  ONCE and multiplies it with all ``BLOCK_M = 8`` rows of x at the same time (rows past M
  read as zeros), accumulating a ``[BLOCK_M, BLOCK_N, BLOCK_K]`` fp32 tile of products;
- one reduction over the ``BLOCK_K`` lanes at the end gives ``[BLOCK_M, BLOCK_N]``, stored
  in x's dtype;
- more than 8 rows run as blocks of 8, one after the other in the same program: correct,
  not fast (:func:`dsv4lab.ops.linear`'s "auto" sends only 1..8 rows here).

The math is fp32 multiply-adds on upcast operands, no ``tl.dot``: with at most 8 rows there
is nothing for a tensor core to fill, the upcast is exact, and the interpreter's bf16
``tl.dot`` problem cannot arise.

Row independence, which speculative decoding needs: the compiled kernel and its tiles
depend only on the weight's shape and the device, never on M or on where x lies (``M``,
x's address and row stride are not specialised). Each output element is the same sequence
of fp32 operations over its row of x whatever the other rows hold, so row i of an M = 3 call
equals the M = 1 call on that row bit for bit: a plain decode step (1 row) and a verify step
(1 + k rows) agree exactly.

Fixed grid, no host synchronisation: safe inside CUDA-graph capture.
Explained in notebooks/05_mtp_speculative.ipynb.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import DeviceProps, Route, props as device_props
from dsv4lab.kernels.offline import Case

BLOCK_M = 8                 # rows per block: M <= 8 is one pass over the weights
ACC_ELEMS = 1024            # BLOCK_N * BLOCK_K (times BLOCK_M = 8192 fp32 accumulators)
NUM_WARPS = 4

# Nothing about x may change the compiled kernel: not the row count (M = 1 would otherwise
# be specialised as a constant) and not x's address or row stride (16-byte alignment would
# otherwise pick other load layouts). x is at most 8 rows: unvectorised loads of it cost
# nothing. (do_not_specialize_on_alignment is newer than some Triton releases.)
_X_ARGS = ["M", "x_ptr", "stride_xm"]
_JIT_KW = {"do_not_specialize": _X_ARGS}
if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
    _JIT_KW["do_not_specialize_on_alignment"] = _X_ARGS


@triton.jit(**_JIT_KW)
def linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K,
                  stride_xm, stride_wn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  STAGES: tl.constexpr):
    """x [M, K], w [N, K], y [M, N]; unit stride along K and N. One program: BLOCK_N columns
    of every row (rows in blocks of BLOCK_M, each block the same code)."""
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn          # [BN, 1]

    for m0 in range(0, M, BLOCK_M):               # one iteration for M <= BLOCK_M
        rm = m0 + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm      # [BM, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            k = k0 + rk
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        y = tl.sum(acc, axis=2)                                       # [BM, BN]
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ------------------------------------------------------------------- the dispatch table

TABLES = {
    "linear": (Route("linear_kernel", None, "1..8 rows by a small weight (ops.linear's 'auto' rule)",
                     "one launch for every row count, each row's bits independent of the others "
                     "(plain and verify steps agree; `dsv4lab bench spec`)"),),
}


def tile_config(N: int, K: int, props: DeviceProps) -> dict:
    """``BLOCK_N``, ``BLOCK_K``, ``STAGES`` for a weight of shape [N, K] on ``props``.

    A function of the weight and the device only (never of M): every row count runs the
    same compiled kernel. ``BLOCK_N``: the largest of 16, 8, 4 that still gives at least one
    program per SM (4 when N is too small for that); ``BLOCK_K``: up to
    ``ACC_ELEMS // BLOCK_N``, no wider than K needs; the K loop pipelined when it is long.
    """
    block_n = 4
    for bn in (16, 8):
        if triton.cdiv(N, bn) >= props.sm_count:
            block_n = bn
            break
    block_k = max(16, min(ACC_ELEMS // block_n, triton.next_power_of_2(max(K, 1))))
    stages = 3 if K > 2 * block_k else 1
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "STAGES": stages}


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None, *,
           props: DeviceProps | None = None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T -> [M, N]`` in x's dtype (fp32 accumulation).

    Made for M <= 8 (one pass over the weights); more rows run in blocks of 8, each block
    re-reading the program's weight tile (from L2): correct, row-independent, not fast.
    x and w: same float dtype and device, unit stride along K (:func:`dsv4lab.ops.linear`
    checks and prepares them). ``out`` (optional, [M, N], x's dtype, unit stride along N)
    receives the result; ``props`` plans for another device than x's.
    """
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("x and w need unit stride along K")
    y = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    cfg = tile_config(N, K, props or device_props(x.device))
    linear_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=BLOCK_M, num_warps=NUM_WARPS, **cfg)
    return y


# -------------------------------------------------------------------- offline compiles

# The projections a verify step of the mini model multiplies (fp32 weights [N, K]); every
# DeepSeek-V4-Flash projection is larger than ops.linear's "auto" limit and goes to cuBLAS.
VERIFY_WEIGHTS = ((4, 128), (8, 128), (24, 512), (32, 128), (64, 128), (128, 64), (128, 128),
                  (256, 64), (256, 128))


def offline_cases(props: DeviceProps) -> list[Case]:
    """The launches on ``props`` for the verify step's weights (M 1..8 share one kernel)."""
    cases, seen = [], set()
    for N, K in VERIFY_WEIGHTS:
        cfg = tile_config(N, K, props)
        ints = dict(N=N, K=K, stride_wn=K, stride_ym=N)
        key = (tuple(cfg.items()), tuple(v % 16 == 0 for v in ints.values()), N == 1)
        if key in seen:
            continue
        seen.add(key)
        consts = dict(BLOCK_M=BLOCK_M, **cfg)
        aligned = ("w_ptr", "y_ptr") + tuple(k for k, v in ints.items() if v % 16 == 0)
        cases.append(Case(f"linear_kernel, weight [{N}, {K}] fp32", linear_kernel, consts,
                          types=dict(M="i32"), aligned=aligned, num_warps=NUM_WARPS))
    return cases
