"""Sparse MLA decode: which kernel runs where, with which launch configuration.

:data:`TABLES` (first route that applies wins): the warp-specialised sm_90 kernel
(``ws_sm90.py``) where it was run and measured to win, else lesson 2's portable kernel
(``mma.py``). The latter's configuration comes from the device, never its name: :data:`TUNED`
by capability, else :func:`portable_config` by shared memory a block; no timing, no host sync.
Plans and launches are made once per (device, shape). :func:`check_indices` is the op's value
check; tests/test_portability.py compiles every launch of :func:`offline_cases`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsv4lab.kernels.attention.mma import Config, mma_launches, plan_splits, split_rows
from dsv4lab.kernels.device import (DeviceProps, Route, choose, gluon_unsupported, interpreting,
                                    props)
from dsv4lab.kernels.launch import Launch, report_verdict, value_check, workspace

OP = "sparse_mla_decode"
SM90 = frozenset({(9, 0)})


def size_class(rows: int) -> str:
    """The tuned entries' key for ``rows`` = B x S_q query positions."""
    return "tiny" if rows <= 2 else "small" if rows <= 16 else "mid" if rows <= 64 else "large"


def _ws_applies(p: DeviceProps, *, rows=64, heads=64, dim=512, d_v=512, q_dtype=torch.bfloat16,
                fp8=False, aligned=True, offline=False, **_) -> bool:
    """The ws_sm90 route's condition (defaults: V4 decode at B 64; ``offline``: for ``p``'s GPU
    on the route's Triton, whatever runs here)."""
    if not offline and (interpreting() or gluon_unsupported() is not None):
        return False
    if not (heads == 64 and dim == d_v == 512 and aligned and rows > 16):
        return False
    if q_dtype != torch.bfloat16 and (fp8 or q_dtype != torch.float16):
        return False            # the FP8 cache's RoPE part is bf16: it takes bf16 q only
    try:
        from dsv4lab.kernels.attention import ws_sm90
    except ImportError:         # a Triton whose Gluon lacks what the kernel uses
        return False
    return ws_sm90.smem_bytes(fp8, lazy=fp8 and size_class(rows) == "large") <= p.smem_per_block


TABLES = {OP: (
    Route("ws_sm90", SM90,
          when="64 heads, D = d_v = 512, bf16/fp16 q and cache or bf16 q and the FP8 cache, "
               "B x S_q > 16, Triton 3.6",
          why="a producer warp group gathers while two consumers compute: faster from B x S_q "
              "= 17 on (`dsv4lab bench sparse_mla`)",
          applies=_ws_applies),
    Route("mma", None, when="every other call",
          why="the portable tensor-core kernel (lesson 2), configured by the device"),
)}

# The Triton kernel's fastest configurations on the H200 at 64 heads, D = d_v = 512, 16-bit q
# (tools/tune_sparse_mla.py prints such entries); ``evict_kv`` applies at S_q = 1 only.
TUNED = {
    (9, 0): {
        ("bf16", "tiny"): Config(64, 4, 2, 16, pdl=True),
        ("bf16", "small"): Config(64, 8, 2, 64, evict_kv=True),
        ("fp8", "tiny"): Config(32, 4, 2, 16, pdl=True, evict_kv=True),
        ("fp8", "small"): Config(64, 8, 3, 64, pipe_gather=True, split_qk=True, evict_kv=True),
    },
}
INTERPRETER = Config(16, 4, 1, 64)      # small tiles, so a short list spans several of them


def portable_config(p: DeviceProps, rows: int, dim: int, fp8: bool) -> Config:
    """The Triton kernel's configuration by the shared memory a block may have: beside a
    [64, 512] fp32 accumulator Q or the FP8 tiles fit in registers only with 32 heads a block
    (16 for FP8, and for 1-2 query positions, to fill SMs). D > 512 takes the smallest tiles."""
    if dim > 512:
        return Config(16, 4, 1, 16)
    if fp8:
        return Config(32, 4, 2, 16) if p.smem_per_block >= 110 * 1024 else Config(16, 4, 2, 16)
    if rows <= 2:
        return Config(32, 4, 2, 16)
    return Config(32, 8, 2, 64) if p.smem_per_block >= 200 * 1024 else Config(32, 8, 2, 32)


def triton_config(p: DeviceProps, *, rows, heads, dim, d_v, q_dtype, fp8, offline=False,
                  **_) -> Config:
    """The Triton kernel's launch configuration on ``p`` for this shape."""
    if (interpreting() and not offline) or not p.is_gpu:
        return INTERPRETER
    if heads >= 64 and dim == d_v == 512 and q_dtype != torch.float32:
        tuned = TUNED.get(p.capability, {}).get(("fp8" if fp8 else "bf16", size_class(rows)))
        if tuned is not None:
            return tuned
    return portable_config(p, rows, dim, fp8)


class Plan(NamedTuple):
    """What one call launches (``config``: None for ws_sm90; ``lazy``: its lazy rescale)."""
    kernel: str
    config: Config | None
    splits: int
    split_rows: int
    lazy: bool
    evict_kv: bool


@functools.lru_cache(maxsize=4096)
def plan(p: DeviceProps, *, B, S_q, H, D, d_v, topk, q_dtype, fp8, aligned, offline=False) -> Plan:
    """The launch plan of a call (cached). ``offline``: as for :func:`_ws_applies`."""
    shape = dict(rows=B * S_q, heads=H, dim=D, d_v=d_v, q_dtype=q_dtype, fp8=fp8,
                 aligned=aligned, offline=offline)
    if choose(TABLES[OP], p, **shape).kernel == "ws_sm90":
        splits, rows = plan_splits(B * S_q, topk, p.sm_count)
        return Plan("ws_sm90", None, splits, rows, fp8 and size_class(B * S_q) == "large",
                    S_q == 1)
    return _triton_plan(p, B, S_q, H, topk, shape)


def _triton_plan(p: DeviceProps, B, S_q, H, topk, shape) -> Plan:
    cfg = triton_config(p, **shape)
    cfg = cfg._replace(evict_kv=cfg.evict_kv and S_q == 1)
    block_h = min(cfg.block_h, max(16, triton.next_power_of_2(H)))
    splits, rows = plan_splits(B * S_q * triton.cdiv(H, block_h), topk, p.sm_count)
    return Plan("mma", cfg, splits, rows, False, cfg.evict_kv)


_CALLS: dict = {}


def sparse_mla_decode(q, kv, indices, sink, scale, d_v, *, fp8=False, num_splits=None,
                      kernel=None):
    """The family's entry: plan the call on q's device and launch it. q [B, S_q, H, D]; kv
    [N, D] in q's dtype or uint8 [N, 584] (``fp8``), both contiguous; indices int32 [B, S_q,
    topk]; sink fp32 [H] or None -> (out [B, S_q, H, d_v], lse fp32 [B, S_q, H]).
    ``num_splits`` overrides the split-KV plan (1: never split); ``kernel="mma"`` runs the
    portable kernel where the table would pick a fast path (the benchmark's baseline)."""
    B, S_q, H, D = q.shape
    qp, kp = q.data_ptr(), kv.data_ptr()
    key = (q.device, B, S_q, H, D, d_v, indices.shape[-1], q.dtype, fp8, not (qp | kp) & 15,
           not kp & 7, sink is not None, num_splits, kernel)
    call = _CALLS.get(key)
    if call is None:
        call = _CALLS[key] = launches(*key)
    return call(q, kv, indices, sink, scale)


def launches(device, B, S_q, H, D, d_v, topk, q_dtype, fp8, aligned, word_aligned, has_sink,
             num_splits=None, kernel=None):
    """The launches of one call shape (``MmaLaunches`` or ``WsLaunches``) by :func:`plan`."""
    p = props(device)
    pl = plan(p, B=B, S_q=S_q, H=H, D=D, d_v=d_v, topk=topk, q_dtype=q_dtype, fp8=fp8,
              aligned=aligned)
    if kernel not in (None, pl.kernel):
        if kernel != "mma":
            raise ValueError(f"kernel must be None or 'mma' (the portable kernel), got {kernel!r}")
        pl = _triton_plan(p, B, S_q, H, topk, dict(rows=B * S_q, heads=H, dim=D, d_v=d_v,
                                                   q_dtype=q_dtype, fp8=fp8))
    splits, rows = (pl.splits, pl.split_rows) if num_splits is None else \
        split_rows(num_splits, topk)
    if pl.kernel == "ws_sm90":
        from dsv4lab.kernels.attention import ws_sm90
        return ws_sm90.ws_launches(device, B, S_q, q_dtype, topk, fp8=fp8, splits=splits,
                                   split_rows=rows, has_sink=has_sink, lazy=pl.lazy,
                                   evict_kv=pl.evict_kv)
    fp8_hw = interpreting() or device.type != "cuda" or p.capability >= (8, 9)
    return mma_launches(device, B, S_q, H, D, d_v, topk, q_dtype, pl.config, fp8=fp8,
                        splits=splits, rows_per_split=rows, has_sink=has_sink,
                        word_aligned=word_aligned, fp8_hw=fp8_hw)


# ---- the value check: one launch before the kernels, its verdict read after them ------------------

@triton.jit(do_not_specialize=["slot", "stamp"])
def check_indices_kernel(idx_ptr, safe_ptr, kv_ptr, flag_ptr, host_ptr, n, N, slot, stamp,
                         BLOCK: tl.constexpr, FP8: tl.constexpr):
    """``safe`` = the indices with any outside [-1, N) made -1; the verdict (launch's
    ``report_verdict``) bad for such an index or (FP8) a selected row with scale byte 255."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    idx = tl.load(idx_ptr + offs, mask=m, other=-1)
    ok = (idx >= 0) & (idx < N)
    bad = (idx < -1) | (idx >= N)
    tl.store(safe_ptr + offs, tl.where(ok, idx, -1), mask=m)
    if FP8:
        j = tl.arange(0, 8)
        rows = tl.where(ok, idx, 0).to(tl.int64)
        sb = tl.load(kv_ptr + rows[:, None] * 584 + 576 + j[None, :],
                     mask=ok[:, None] & (j < 7)[None, :], other=0)
        bad = bad | (tl.max((sb == 255).to(tl.int32), axis=1) > 0)
    report_verdict(flag_ptr, host_ptr, slot, stamp, tl.max(bad.to(tl.int32), axis=0))


_CHECKS: dict = {}


def check_indices(indices, kv, fp8: bool):
    """Launch the value check of ``indices`` (contiguous int32) against ``kv`` [N, row] ->
    (the indices the kernels should read, the ``Verdict`` to read after them)."""
    dev = indices.device
    n, N = indices.numel(), kv.shape[0]
    key = (dev, n, N, fp8)
    launch = _CHECKS.get(key)
    if launch is None:
        block = 128 if interpreting() else 1024
        launch = _CHECKS[key] = Launch(check_indices_kernel, (triton.cdiv(n, block),),
                                       dict(n=n, N=N, BLOCK=block, FP8=fp8), device=dev,
                                       num_warps=4, guard=(0, 2))
    safe = workspace(("mla indices", indices.shape), dev, lambda: torch.empty_like(indices))
    verdict = value_check(dev)
    launch(indices, safe, kv, *verdict.args)
    return safe, verdict


# ---- the launches "auto" makes, for compiling offline (tests/test_portability.py) ----------

# (B, S_q, topk) per size class: V4-Flash's CSA layers (640 slots), 1M-context HCA ones (8,320)
V4_CASES = (("tiny", 1, 1, 640), ("tiny", 1, 1, 8320), ("small", 8, 1, 640),
            ("mid", 64, 1, 640), ("large", 128, 2, 640))


def _ints(**values):
    """The JIT's view of integer arguments: 1 is a constant, a multiple of 16 is aligned."""
    return ({k: 1 for k, v in values.items() if v == 1},
            tuple(k for k, v in values.items() if v != 1 and v % 16 == 0))


def _flags(consts) -> str:
    return "".join(f" {k.lower()}" for k in ("SPLIT", "PIPE_GATHER", "SPLIT_QK", "PDL", "LAZY_SS",
                                             "EVICT_KV") if consts.get(k))


def offline_cases(p: DeviceProps) -> list:
    """The launches :func:`sparse_mla_decode` makes on ``p``'s GPU at V4's shape (bf16 q, a
    sink), every size class and cache (on sm_90 also the Triton kernel other releases run), as
    offline.Cases, unmarked (an ``EVICT_KV`` build here would enter Triton 3.6's cache plain)."""
    from dsv4lab.kernels.attention import mma
    from dsv4lab.kernels.offline import Case
    cases = {}                       # one case a distinct launch, named by the shapes using it

    def add(case, shape):
        key = (case.fn, tuple(sorted((k, str(v)) for k, v in case.constexprs.items())),
               case.num_warps, case.num_stages, tuple(sorted(case.options.items())))
        if key in cases:
            cases[key][1].append(shape)
        else:
            cases[key] = (case, [shape])

    def add_combine(B, S_q, splits, pdl, kv_name):
        fn, _, consts = mma.combine_launch(B, S_q, 64, 512, splits, has_sink=True, pdl=pdl,
                                           sm_count=p.sm_count)
        consts.pop("launch_pdl", None)
        warps = consts.pop("num_warps")
        flags = "".join(f" {k.lower()}" for k in ("BLOCK_HC", "PDL") if consts.get(k))
        add(Case(f"combine: {splits} splits{flags}", fn, consts,
                 types={"opart_ptr": "*bf16", "out_ptr": "*bf16"}, aligned=("*", "H"),
                 num_warps=warps), f"{kv_name} B{B} S{S_q}")

    for fp8 in (False, True):
        kv_name = "fp8" if fp8 else "bf16"
        for size, B, S_q, topk in V4_CASES:
            shape = dict(B=B, S_q=S_q, H=64, D=512, d_v=512, topk=topk, q_dtype=torch.bfloat16,
                         fp8=fp8, aligned=True)
            plans = [plan(p, offline=True, **shape)]
            if plans[0].kernel != "mma":     # and the Triton kernel it runs on other releases
                plans.append(_triton_plan(p, B, S_q, 64, topk, dict(
                    rows=B * S_q, heads=64, dim=512, d_v=512, q_dtype=torch.bfloat16, fp8=fp8,
                    offline=True)))
            for cfg in plans:
                kernel = cfg.kernel
                split = cfg.splits > 1
                pdl = split and p.capability >= (9, 0)
                shape_name = f"{size} B{B} S{S_q} T{topk}"
                if kernel == "ws_sm90":
                    from dsv4lab.kernels.attention import ws_sm90
                    consts = ws_sm90.kernel_constexprs(fp8=fp8, split=split, has_sink=True, pdl=pdl,
                                                       lazy=cfg.lazy, evict=False)
                    consts.pop("maxnreg")
                    ones, aligned = _ints(topk=topk, num_splits=cfg.splits,
                                          split_rows=cfg.split_rows)
                    add(Case(f"ws_sm90 {kv_name}{_flags(consts)}", ws_sm90._sparse_mla_ws_kernel,
                             dict(consts, **ones),
                             types={"q_ptr": "*bf16", "out_ptr": "*bf16", "idx_ptr": "*i32",
                                    "opart_ptr": "*bf16" if split else "*fp32",
                                    "kv_ptr": "*u8" if fp8 else "*bf16", "qk_scale": "fp32"},
                             aligned=("*",) + aligned, num_warps=4, options={"maxnreg": 168}),
                        shape_name)
                else:
                    c = cfg.config
                    consts = mma.kernel_constexprs(
                        c, D=512, d_v=512, q_dtype=torch.bfloat16, fp8=fp8,
                        fp8_hw=p.capability >= (8, 9), split=split, has_sink=True,
                        pdl=split and c.pdl and pdl, evict=False, word_aligned=True)
                    warps, stages = consts.pop("num_warps"), consts.pop("num_stages")
                    n_hblk = triton.cdiv(64, c.block_h)
                    ones, aligned = _ints(H=64, topk=topk, n_hblk=n_hblk, num_splits=cfg.splits,
                                          split_rows=cfg.split_rows)
                    add(Case(f"mma {kv_name}: N{c.block_n} w{warps} s{stages} h{c.block_h}"
                             f"{_flags(consts)}",
                             mma._sparse_mla_mma_kernel, dict(consts, BLOCK_H=c.block_h, **ones),
                             types={"q_ptr": "*bf16", "out_ptr": "*bf16", "idx_ptr": "*i32",
                                    "opart_ptr": "*bf16" if split else "*fp32",
                                    "kv_ptr": "*u8" if fp8 else "*bf16", "qk_scale": "fp32"},
                             aligned=("*",) + aligned, num_warps=warps, num_stages=stages),
                        shape_name)
                if split:
                    add_combine(B, S_q, cfg.splits, pdl and (kernel == "ws_sm90" or cfg.config.pdl),
                                kv_name)
    return [dataclasses.replace(case, name=f"{case.name} ({'; '.join(shapes)})")
            for case, shapes in cases.values()]
