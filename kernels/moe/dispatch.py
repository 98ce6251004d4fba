"""Which kernel runs ``fused_moe`` on which GPU and shape, with which tiles.

- :data:`TABLES`: the routes, first match wins. The Gluon fast paths name the H200 (9, 0), the
  only GPU they ran on; other GPUs, shapes and the interpreter run :mod:`.triton_moe`.
- :data:`TRITON_TILES`: its tiles by rows per expert hit (``P / min(P, E)``: 1.0 at T <= 42
  of top-6 over 256 experts, 6 at T = 256), measured on the H200 (:data:`TUNED_TILES`: tables
  of other GPUs); :func:`tiles_for` trims the pipeline to a device's shared memory, so a first
  call times nothing.
- :func:`offline_cases`: the launches "auto" makes on a GPU, for compiling them offline.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.device import DeviceProps, Route, choose, gluon_unsupported, interpreting
from dsv4lab.kernels.device import props as device_props
from dsv4lab.kernels.launch import Launch, kernel_params, planned, report_verdict, workspace
from dsv4lab.kernels.moe import align, triton_moe
from dsv4lab.kernels.moe.triton_moe import Tiles

H200 = frozenset({(9, 0)})


def rows_per_expert(T: int, topk: int, E: int) -> float:
    """Average rows (token, expert pairs) per expert hit."""
    P = T * topk
    return P / max(1, min(P, E))


def _gemv_applies(props, *, T, H, I, rows, gluon, aligned, **_):
    return gluon and aligned and T == 1 and rows <= 1 and H % 2048 == 0 and I % 2048 == 0


def _mma_applies(props, *, H, I, rows, gluon, aligned, **_):
    return gluon and aligned and 1 < rows <= 2 and H % 512 == 0 and I % 512 == 0


TABLES = {"fused_moe": (
    Route("gemv_sm90", H200,
          "one token, hidden and intermediate sizes multiples of 2048 (Flash's)",
          "one launch of GEMVs on the CUDA cores, x in registers: fastest at T = 1 "
          "(`dsv4lab bench moe`)", _gemv_applies),
    Route("mma_sm90", H200,
          "1 to 2 rows per expert hit (T ~ 64 of 256 experts), sizes multiples of 512",
          "mma.sync with hand-picked operand layouts, no register shuffles: fastest at T = 64 "
          "(`dsv4lab bench moe`)", _mma_applies),
    Route("triton_moe", None, "every other shape, GPU and the interpreter",
          "the portable lesson kernel: grouped GEMMs, decode in registers, tensor cores "
          "(`dsv4lab bench moe`, every other T)"),
)}

_PREFILL = Tiles(BM=64, BN1=64, BN2=128, BK1=128, BK2=128, FASTDEC=False, XPRE=False)
TRITON_TILES = (
    (1.0, {"mxfp4": Tiles(BK1=128, BK2=128, SPLIT1=2, SPLIT2=2),
           "nvfp4": Tiles(BK1=128, BK2=128, SPLIT1=2, SPLIT2=2)}),
    (2.0, {"mxfp4": Tiles(BK1=128, BN2=128, BK2=256, ROWMAX=True), "nvfp4": Tiles()}),
    (16.0, {"mxfp4": Tiles(BK1=128, BK2=128), "nvfp4": Tiles()}),
    (math.inf, {"mxfp4": _PREFILL, "nvfp4": _PREFILL}),
)
# tables tuned on other GPUs, by capability (tools/tune_moe.py prints one); else TRITON_TILES
TUNED_TILES: dict[tuple[int, int], tuple] = {}


def smem_bound(tiles: Tiles, fmt: str, props: DeviceProps) -> int:
    """An upper bound on a program's shared memory (bytes): num_stages - 1 K-steps of
    weights, scales and x in flight, plus an x tile and barriers on sm_90 and sm_100."""
    gs = 8 if fmt == "nvfp4" else 16                       # packed bytes a scale
    xbytes = 2 if tiles.XPRE else 4
    worst = 0
    for n_mat, bn, bkh in ((2, tiles.BN1, tiles.BK1 // 2), (1, tiles.BN2, tiles.BK2 // 2)):
        x_tile = 2 * tiles.BM * bkh * xbytes              # x's even and odd columns
        stage = n_mat * (bn * bkh + bn * (bkh // gs)) + x_tile
        extra = x_tile + 64 if props.capability[0] in (9, 10) else 0
        worst = max(worst, (tiles.num_stages - 1) * stage + extra)
    return worst


@functools.lru_cache(maxsize=1024)
def tiles_for(T: int, topk: int, E: int, fmt: str, props: DeviceProps) -> Tiles:
    """The lesson kernel's tiles on ``props``, fewer stages where shared memory is short."""
    r = rows_per_expert(T, topk, E)
    table = TUNED_TILES.get(props.capability, TRITON_TILES)
    tiles = next(row[fmt] for bound, row in table if r <= bound)
    while tiles.num_stages > 1 and smem_bound(tiles, fmt, props) > props.smem_per_block:
        tiles = dataclasses.replace(tiles, num_stages=tiles.num_stages - 1)
    return tiles


def gluon_ok() -> bool:
    """Whether the Gluon fast paths may run: no interpreter, a Triton with their Gluon."""
    return not interpreting() and gluon_unsupported() is None


@functools.lru_cache(maxsize=256)
def _route(props: DeviceProps, gluon: bool, T: int, topk: int, E: int, H: int, I: int,
           aligned: bool) -> Route:
    return choose(TABLES["fused_moe"], props, T=T, H=H, I=I, rows=rows_per_expert(T, topk, E),
                  gluon=gluon, aligned=aligned)


def route_for(x, w13, w13_scale, w2, w2_scale, topk_ids, props: DeviceProps | None = None,
              gluon: bool | None = None) -> Route:
    """The route :func:`fused_moe` takes for these arguments (on ``props``, default: x's device)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    aligned = all(t.data_ptr() % 16 == 0 for t in (w13, w13_scale, w2, w2_scale))
    return _route(device_props(x.device) if props is None else props,
                  gluon_ok() if gluon is None else gluon, T, topk_ids.shape[1], E, H, two_i // 2,
                  aligned)


_CALLS: dict = {}


def fused_moe(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, *, fmt="mxfp4",
              w13_global=None, w2_global=None, swiglu_limit=None, props=None, gluon=None):
    """The FP4 MoE (arguments as ``dsv4lab.ops.fused_moe``, checked) by the first route of
    :data:`TABLES` that applies (``props``, ``gluon``: as on another device). No host sync."""
    args = (x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights)
    kw = dict(fmt=fmt, w13_global=w13_global, w2_global=w2_global, swiglu_limit=swiglu_limit)
    if props is not None or gluon is not None:
        return _by_route(route_for(x, w13, w13_scale, w2, w2_scale, topk_ids, props, gluon),
                         args, kw, props)
    aligned = not (w13.data_ptr() | w13_scale.data_ptr() | w2.data_ptr() | w2_scale.data_ptr()) & 15
    key = (x.device, x.shape, w13.shape, topk_ids.shape, fmt, aligned)
    route = _CALLS.get(key)
    if route is None:
        route = _CALLS[key] = route_for(x, w13, w13_scale, w2, w2_scale, topk_ids)
    return _by_route(route, args, kw, None)


def _by_route(route, args, kw, props):
    x, w13, _, _, _, topk_ids, _ = args
    if route.kernel == "gemv_sm90":
        from dsv4lab.kernels.moe import gemv_sm90
        return gemv_sm90.fused_decode(*args, **kw)
    if route.kernel == "mma_sm90":
        from dsv4lab.kernels.moe import mma_sm90
        return mma_sm90.fused_moe(*args, **kw)
    T, E = x.shape[0], w13.shape[0]
    p = device_props(x.device) if props is None else props
    return triton_moe.fused_moe(*args, **kw, tiles=tiles_for(T, topk_ids.shape[1], E, kw["fmt"], p))


# ------------------------------------------------------------------------ value check ----
@triton.jit(do_not_specialize=["slot", "stamp"])
def check_routing_kernel(x_ptr, ids_ptr, w_ptr, safe_ptr, flag_ptr, host_ptr, H, E, stride_x,
                         slot, stamp, K: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    """A token's expert ids into the copy the kernels read (outside [-1, E): -1), and the
    verdict (launch's ``report_verdict``; bad: such an id, or a NaN or Inf)."""
    t = tl.program_id(0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    mk = offs_k < K
    ids = tl.load(ids_ptr + t * K + offs_k, mask=mk, other=-1)
    bad_id = mk & ((ids < -1) | (ids >= E))
    tl.store(safe_ptr + t * K + offs_k, tl.where(bad_id, -1, ids), mask=mk)
    w = tl.load(w_ptr + t * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    bad = bad_id | (mk & ((w != w) | (tl.abs(w) == float("inf"))))
    worst = tl.max(bad.to(tl.int32), axis=0)
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        mh = h0 + offs_h < H
        xv = tl.load(x_ptr + t * stride_x + h0 + offs_h, mask=mh, other=0.0).to(tl.float32)
        worst = tl.maximum(worst, tl.max(((xv != xv) | (tl.abs(xv) == float("inf"))).to(tl.int32),
                                         axis=0))
    report_verdict(flag_ptr, host_ptr, slot, stamp, worst)


_CHECKS: dict = {}


def check_routing(x, topk_ids, topk_weights, E: int, verdict):
    """The value check of a ``fused_moe`` call (``verdict``: launch.value_check's) -> the ids
    to read."""
    T, H = x.shape
    K = topk_ids.shape[1]
    dev = x.device
    launch = planned(_CHECKS, (dev, T, H, K, E, x.stride(0)), dev, lambda: Launch(
        check_routing_kernel, (T,), dict(H=H, E=E, stride_x=x.stride(0), K=K,
                                          BLOCK_K=max(2, triton.next_power_of_2(K)),
                                          BLOCK_H=min(1024, triton.next_power_of_2(H))),
        device=dev, guard=(0, 1, 2), num_warps=4))
    safe = workspace(("moe ids", topk_ids.shape, topk_ids.dtype), dev,
                     lambda: torch.empty_like(topk_ids))
    launch(x, topk_ids, topk_weights, safe, *verdict.args)
    return safe


# ------------------------------------------------------------- offline compiles ----------
FLASH = dict(E=256, H=4096, I=2048, topk=6)
SMALL = dict(E=8, H=128, I=64, topk=2)           # the workbook's mini model's experts
OFFLINE_TOKENS = (1, 8, 64, 256, 4096)           # the routes and every row of TRITON_TILES
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "maxnreg")
_POINTER = {torch.uint8: "*u8", torch.int32: "*i32", torch.int64: "*i64", torch.float32: "*fp32",
            torch.float16: "*fp16", torch.bfloat16: "*bf16"}


class _Recorder:
    """Stands for a kernel in :func:`offline_cases`: records its launches instead."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


def _case(name: str, fn, args, kwargs):
    """A recorded launch as Triton specialises it (ints 1 constant, multiples of 16 divisible)."""
    from dsv4lab.kernels.offline import Case
    const_names = {name for name, const, _ in kernel_params(fn) if const}
    named = {k: v for k, v in kwargs.items() if k in fn.arg_names and k not in const_names}
    kwargs = {k: v for k, v in kwargs.items() if k not in named}
    args = tuple(args) + tuple(named[n] for n in fn.arg_names[len(args):] if n in named)
    consts = {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS or k in fn.arg_names}
    types, aligned = {}, []
    for pname, v in zip(fn.arg_names, args):
        if isinstance(v, torch.Tensor):
            types[pname] = _POINTER[v.dtype]
            aligned.append(pname)
        elif isinstance(v, int):
            if v == 1:
                consts[pname] = 1
                continue
            types[pname] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                aligned.append(pname)
        else:
            types[pname] = "fp32"
    options = {k: kwargs[k] for k in ("launch_pdl", "maxnreg") if k in kwargs}
    return Case(name, fn, consts, types=types, aligned=tuple(aligned),
                num_warps=kwargs.get("num_warps", 4), num_stages=kwargs.get("num_stages", 3),
                options=options)


def _meta_experts(E, H, I, fmt):
    dt = torch.uint8 if fmt == "mxfp4" else torch.float8_e4m3fn
    blk = 32 if fmt == "mxfp4" else 16
    w13 = torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device="meta")
    w2 = torch.empty(E, H, I // 2, dtype=torch.uint8, device="meta")
    s13 = torch.empty(E, 2 * I, H // blk, dtype=dt, device="meta")
    s2 = torch.empty(E, H, I // blk, dtype=dt, device="meta")
    g = torch.empty(E, dtype=torch.float32, device="meta") if fmt == "nvfp4" else None
    return w13, s13, w2, s2, g


def offline_cases(props: DeviceProps) -> list:
    """The distinct launches ``fused_moe`` makes on ``props`` at Flash's and the mini model's
    shapes, both formats, recorded from meta tensors. Call it with TRITON_INTERPRET=0."""
    from triton.runtime.jit import KernelInterface      # jit and interpreted kernels alike
    from dsv4lab.kernels.moe import gemv_sm90, mma_sm90
    modules = (align, triton_moe, mma_sm90, gemv_sm90)
    calls: list = []
    saved = [(m, n, v) for m in modules for n, v in vars(m).items() if isinstance(v, KernelInterface)]
    cases, seen = [], set()
    try:
        for m, n, v in saved:
            setattr(m, n, _Recorder(v, calls))
        for shape, tokens in ((FLASH, OFFLINE_TOKENS), (SMALL, (1,))):
            E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
            for fmt in ("mxfp4", "nvfp4"):
                w13, s13, w2, s2, g = _meta_experts(E, H, I, fmt)
                for T in tokens:
                    x = torch.empty(T, H, dtype=torch.bfloat16, device="meta")
                    ids = torch.empty(T, k, dtype=torch.int32, device="meta")
                    w = torch.empty(T, k, dtype=torch.float32, device="meta")
                    del calls[:]
                    route = route_for(x, w13, s13, w2, s2, ids, props, gluon=True)
                    fused_moe(x, w13, s13, w2, s2, ids, w, fmt=fmt, w13_global=g, w2_global=g,
                              swiglu_limit=10.0, props=props, gluon=True)
                    for fn, args, kwargs in calls:
                        fname = getattr(fn, "__name__", None) or fn.fn.__name__
                        case = _case(f"{route.kernel}:{fname}:{fmt}:H{H}:T{T}", fn, args, kwargs)
                        key = (id(fn), repr(sorted(case.constexprs.items())), repr(sorted(case.types.items())),
                               case.aligned, case.num_warps, case.num_stages)
                        if key not in seen:
                            seen.add(key)
                            cases.append(case)
    finally:
        for m, n, v in saved:
            setattr(m, n, v)
    return cases
