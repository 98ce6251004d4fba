"""``dsv4lab bench moe``: the FP4 MoE at DeepSeek-V4-Flash's shape.

256 experts, top-6, hidden 4096, intermediate 2048; T in {1, 8, 64, 256} tokens routed by
:func:`dsv4lab.ops.route` on random logits (realistic spread of experts). Rows:

- ``triton`` with MXFP4 and with NVFP4 experts (CUDA-graph timed: the decode path never
  syncs with the host): kernels/moe.py's table, which on sm_80+ GPUs runs
  kernels/moe_mma2.py at T = 1 (its one-launch decode) and T = 64;
- ``torch_ref``: the reference backend (dequantise each expert hit to fp32, matmul);
- ``torch_bf16``: "just dequantise at load": bf16 weights, a per-expert bf16 matmul loop.

Every row's roofline uses the FP4 bytes (packed weights + scales) of the experts the drawn
routing actually hits, at the row's format (the MXFP4 bytes for the torch rows, the
yardstick they are compared against), and 2 FLOPs per weight per routed token.

Weights are random bytes (every nibble and a realistic scale range), not a quantised
checkpoint: what is measured is data movement and decoding, which do not depend on the
values. Explained in notebooks/04_mxfp4_moe_port.ipynb.
"""
from __future__ import annotations

import torch

from dsv4lab import bench, runtime
from dsv4lab.ops import fused_moe, route
from dsv4lab.ops.moe import moe_dense
from dsv4lab.kernels.moe import _MMA2_T1, _MMA2_T1_REGS, _MMA2_T1_SMEM, _MMA2_T64, PLAIN, config_for
from dsv4lab.quant import mxfp4_dequantize, mxfp4_quantize, nvfp4_quantize

FLASH = dict(E=256, H=4096, I=2048, topk=6)
TOKENS = (1, 8, 64, 256)
SWIGLU_LIMIT = 10.0


def fp4_bytes(n_experts: int, H: int, I: int, fmt: str) -> float:
    """Packed weights + scales of ``n_experts`` experts (w13 and w2)."""
    weights = n_experts * 3 * H * I
    packed = weights / 2
    scales = weights / 32 if fmt == "mxfp4" else weights / 16
    return packed + scales


def _random_experts(E, H, I, fmt, device, gen):
    """Random FP4 experts: uniform bytes, scales in a realistic range."""
    def packed(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=gen)
    w13, w2 = packed(E, 2 * I, H // 2), packed(E, H, I // 2)
    if fmt == "mxfp4":
        s13 = torch.randint(118, 122, (E, 2 * I, H // 32), dtype=torch.uint8, device=device, generator=gen)
        s2 = torch.randint(118, 122, (E, H, I // 32), dtype=torch.uint8, device=device, generator=gen)
        return dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, kw={})
    s13 = (torch.rand(E, 2 * I, H // 16, device=device, generator=gen) * 4 + 0.5).to(torch.float8_e4m3fn)
    s2 = (torch.rand(E, H, I // 16, device=device, generator=gen) * 4 + 0.5).to(torch.float8_e4m3fn)
    g = torch.full((E,), 2e-3, device=device)
    return dict(w13=w13, w13_scale=s13, w2=w2, w2_scale=s2, kw=dict(w13_global=g, w2_global=g.clone()))


def _quantised_experts(E, H, I, fmt, device, gen):
    """Small shapes (smoke): real quantisation of random weights."""
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 0.1
    w2 = torch.randn(E, H, I, generator=gen) * 0.1
    if fmt == "mxfp4":
        a, b = mxfp4_quantize(w13)
        c, d = mxfp4_quantize(w2)
        return dict(w13=a.to(device), w13_scale=b.to(device), w2=c.to(device), w2_scale=d.to(device), kw={})
    a, b, g1 = nvfp4_quantize(w13)
    c, d, g2 = nvfp4_quantize(w2)
    return dict(w13=a.to(device), w13_scale=b.to(device), w2=c.to(device), w2_scale=d.to(device),
                kw=dict(w13_global=g1, w2_global=g2))


def _dequant_bf16(ex, E):
    """mxfp4 -> bf16 once, expert by expert (the 'dequantise at load' baseline)."""
    w13 = torch.stack([mxfp4_dequantize(ex["w13"][e], ex["w13_scale"][e], dtype=torch.bfloat16) for e in range(E)])
    w2 = torch.stack([mxfp4_dequantize(ex["w2"][e], ex["w2_scale"][e], dtype=torch.bfloat16) for e in range(E)])
    return w13, w2


def _row(T, impl, fmt, hit, n_pairs, shape, timing, basis_fmt):
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    row = dict(T=T, impl=impl, fmt=fmt, E=E, hidden=H, intermediate=I, topk=k,
               experts_hit=hit, roofline_basis=f"{basis_fmt} bytes of the experts hit", **timing)
    return bench.with_roofline(row, bytes_moved=fp4_bytes(hit, H, I, basis_fmt),
                               flops=2.0 * n_pairs * 3 * H * I)


def print_table(rows: list[dict]) -> None:
    print(f"{'T':>4} {'impl':<17} {'fmt':<6} {'hit':>4} {'us':>11} {'roof us':>9} {'frac':>7}  timing")
    for r in rows:
        print(f"{r['T']:>4} {r['impl']:<17} {r['fmt']:<6} {r['experts_hit']:>4} {r['ms'] * 1e3:>11.1f} "
              f"{r['roofline_ms'] * 1e3:>9.2f} {r.get('roofline_fraction', 0):>7.4f}  {r['timing']}")


# Named layouts of kernels/moe.py, timed beside the default row (at the target token counts
# only, to keep the bench short). The default row (``triton``) is the promoted decode config of
# kernels/moe.py's CONFIGS (FASTDEC + XPRE; BK 128 and split-K 2/2 at T = 1 and 8; at T = 64
# MXFP4 with ROWMAX, BN2 128, BK2 256 and NVFP4 at BK 256; see there). Every variant is a FULL
# config built on ``PLAIN`` (the first port: BK 256, BN 64/64, byte decode, strided x, no
# split-K), so it does not inherit the promoted switches; a variant equal to the default of
# its (T, format) is skipped (its row would repeat ``triton``).
# FASTDEC: decode + block scale in packed inline PTX; XPRE: x and act as pre-split fp16
# operands the pipeliner streams ahead; BK 128: ~100-130 registers a thread, 4 programs an
# SM; SPLIT1/SPLIT2: split-K of the gate/up and down GEMMs (more programs when only 6
# experts are hit); ROWMAX (MXFP4): one scale split per row and slice, so the dots chain
# like NVFP4's (no effect on the NVFP4 rows); MAXNREG: a register cap (MXFP4 gate/up 150 ->
# 128 registers: 3 -> 4 programs an SM). Rows dropped over the sessions (slower, recorded in
# data/results/moe.jsonl): swap AB, DECODE32, FASTDEC alone, BN1 128, 8 warps, caps at 96,
# 4 stages, most FOLD layouts.
_FX = dict(PLAIN, FASTDEC=True, XPRE=True)
_FX128 = dict(_FX, BK1=128, BK2=128)
# Session 3 pruned the rows that never led (FOLD but one, the register caps at 96, split-K with
# a cap, 4 stages, ROWMAX under the cap at BK2 128) and added the T = 64 MXFP4 winners of its
# sweep: ROWMAX (the row max now one wide load a row) with a 256-element down K step, at 64 or
# 128 hidden columns a down program; the latter is now the MXFP4 default at T = 64, and
# ``triton_fd_xpre_bk128`` (its former default) stays as the row it is compared with.
VARIANTS = [
    ("triton_plain", dict(PLAIN)),
    ("triton_fd_xpre_bk128", dict(_FX128)),
    ("triton_fd_xpre_bk128_s2", dict(_FX128, SPLIT1=2, SPLIT2=2)),
    ("triton_fd_xpre_rm_bk128", dict(_FX128, ROWMAX=True)),
    ("triton_fd_xpre_bk128_r128", dict(_FX128, MAXNREG=128)),
    # FOLD (kernels/moe.py): the combine inside the down kernel, the split-K SwiGLU sum inside
    # the gate/up kernel (last program of a tile sums, fixed order) and the grouping + XPRE
    # copy + counter zeroing in one prologue launch: 6 -> 3 launches at T = 1
    ("triton_fd_xpre_bk128_s2_fold", dict(_FX128, SPLIT1=2, SPLIT2=2, FOLD=True)),
    ("triton_fd_xpre_bk128_r128_bn2_128", dict(_FX128, MAXNREG=128, BN2=128)),
    ("triton_fd_xpre_rm_bk128_bk2_256", dict(_FX128, ROWMAX=True, BK2=256)),
    ("triton_fd_xpre_rm_bk128_bk2_256_r128", dict(_FX128, ROWMAX=True, BK2=256, MAXNREG=128)),
    ("triton_fd_xpre_bk128_bn2_128_bk2_256", dict(_FX128, BN2=128, BK2=256)),
    # W16 (kernels/moe.py): int16 weight words and int32 scale words, so the dot's B operand
    # descends from 16/32-bit loads (kWidth 2: x's MMA fragments loaded in place, no register
    # moves), x and act in four K-phase planes; on the T = 1 and T = 64 MXFP4 defaults
    # (recorded at 10c5467: 83.2 vs 68.2 us at T = 1, 1519.6 vs 1029.0 us at T = 64: slower)
    ("triton_fd_xpre_w16_bk128_s2", dict(_FX128, SPLIT1=2, SPLIT2=2, W16=True)),
    ("triton_fd_xpre_rm_w16_bk128_bn2_128_bk2_256", dict(_FX128, ROWMAX=True, BN2=128, BK2=256,
                                                         W16=True)),
    # Session 8: the T = 64 default is kernels/moe_mma2.py's Gluon GEMMs (MMA2 in the table);
    # the Triton kernels' former T = 64 defaults stay as the rows it is compared with
    # (MXFP4: ROWMAX, BN2 128, BK2 256; NVFP4: FASTDEC + XPRE), and the Gluon GEMMs at their
    # best T = 1 launch (slower than the Triton kernels there in the session's probe)
    ("triton_fd_xpre_rm_bk128_bn2_128_bk2_256", dict(_FX128, ROWMAX=True, BN2=128, BK2=256)),
    ("triton_fd_xpre", dict(_FX)),
    ("mma2_t1", dict(PLAIN, MMA2=dict(BN1=64, SPLIT1=2, BN2=64, SPLIT2=1, STAGES=3, NSPS=2))),
    # Session 9: moe_mma2's one-launch decode (FUSED: x's copy, then everything in one
    # ticketed launch), at its best T = 1 layout in tune_moe round 11
    ("mma2_fused_t1", dict(PLAIN, MMA2=dict(FUSED=True, BN1=64, BN2=64, STAGES=2, NSPS=4))),
    # the table's MMA2 entries with FASTDEC's decode instead of the e5m2 conversion (CVT8,
    # the default on sm_89+): what the cheaper decode is worth
    ("mma2_fastdec_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, CVT8=False))),
    # Session 10: the T = 1 entry with the block scales on the accumulator (moe_mma2
    # ACC_SCALE: 13-14% fewer loop instructions, measured no faster; recorded at b7e6296 as
    # the default, against this entry as mma2_scaled_w_t1)
    ("mma2_acc_scale_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, ACC_SCALE=True))),
    # Session 11: the T = 1 entry launched without PDL (x's copy, which zeroes the counters,
    # then the decode as a plain launch): what the programmatic dependent launch is worth
    ("mma2_nopdl_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, PDL=False))),
    # Session 11: the K loops without shared memory (moe_mma2 REGS: the weight words loaded
    # into registers 2 or 4 K-steps ahead, no cp.async ring, no barrier), at the entry's split
    # and with the gate/up K unsplit between two slices (SPLIT1 2, SPLIT2 1: longer loops,
    # half the tiles)
    ("mma2_regs2_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, REGS=2))),
    ("mma2_regs4_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, REGS=4))),
    ("mma2_regs2_s2_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, REGS=2, SPLIT1=2, SPLIT2=1))),
    ("mma2_regs4_s2_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, REGS=4, SPLIT1=2, SPLIT2=1))),
    # the T = 1 entry before session 11's REGS default (the shared-memory ring), for the A/B
    ("mma2_smem_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_SMEM, REGS=0))),
    ("mma2_fastdec_t64", dict(PLAIN, MMA2=dict(_MMA2_T64, CVT8=False))),
    # Session 12: the T = 1 entry before its loads took an L2 evict-first policy (EVICT), with
    # the waiting down tiles' L2 prefetch as MXFP4 had it, for the A/B
    ("mma2_noevict_t1", dict(PLAIN, MMA2=dict(_MMA2_T1_REGS))),
    # Session 16: the T = 1 entry reading weights packed once so that a 16-row K-step is 1 KB
    # contiguous (moe_mma2.pack_tile_major; TILED): weights and scales, or the weights only
    ("mma2_tiled_t1", dict(PLAIN, MMA2=dict(_MMA2_T1, TILED=True))),
    ("mma2_tiled_w_t1", dict(PLAIN, MMA2=dict(_MMA2_T1, TILED="weights"))),
    # the T = 1 entry with a down tile's first ring loads issued after its wait for the
    # activations (EARLY off), as before session 12
    ("mma2_late_ring_t1", dict(PLAIN, MMA2=dict(_MMA2_T1, EARLY=False, SIMT=False))),
    # Session 22: the T = 1 entry is kernels/moe_simt.py's decode (SIMT); the register ring it
    # replaced, for the A/B
    ("mma2_regs_t1", dict(PLAIN, MMA2=dict(_MMA2_T1, SIMT=False))),
]
SWAP_AB_VARIANTS = VARIANTS          # its former name
VARIANT_TOKENS = (1, 64)
# variants timed at some of VARIANT_TOKENS only (the rest: all of them), to keep the bench short
VARIANT_ONLY = {"triton_fd_xpre_bk128_s2_fold": (1,), "triton_fd_xpre_bk128_r128_bn2_128": (64,),
                "triton_fd_xpre_rm_bk128_bk2_256": (64,), "triton_fd_xpre_rm_bk128_bk2_256_r128": (64,),
                "triton_fd_xpre_bk128_bn2_128_bk2_256": (64,), "triton_fd_xpre_w16_bk128_s2": (1,),
                "triton_fd_xpre_rm_w16_bk128_bn2_128_bk2_256": (64,),
                "triton_fd_xpre_rm_bk128_bn2_128_bk2_256": (64,), "triton_fd_xpre": (64,),
                "mma2_t1": (1,), "mma2_fused_t1": (1,), "mma2_fastdec_t1": (1,),
                "mma2_acc_scale_t1": (1,), "mma2_nopdl_t1": (1,), "mma2_regs2_t1": (1,),
                "mma2_regs4_t1": (1,), "mma2_regs2_s2_t1": (1,), "mma2_regs4_s2_t1": (1,),
                "mma2_smem_t1": (1,), "mma2_noevict_t1": (1,), "mma2_late_ring_t1": (1,),
                "mma2_tiled_t1": (1,), "mma2_tiled_w_t1": (1,), "mma2_regs_t1": (1,),
                "mma2_fastdec_t64": (64,)}


def experts_for(ex: dict, cfg: dict | None, fmt: str, T: int) -> dict:
    """The experts a kernel config reads at T tokens: ``ex`` (the canonical layout) itself, or,
    where the config's MMA2 entry applies and asks for ``TILED``, its weights (TILED True: and
    their scales) in moe_mma2.pack_tile_major's layout, packed once and kept in ``ex``."""
    mma2 = (cfg or {}).get("MMA2") or {}
    tiled = mma2.get("TILED")
    if not tiled or T > mma2.get("MAX_T", T):
        return ex
    key = "tiled" if tiled is True else "tiled_w"
    if key not in ex:
        from dsv4lab.kernels import moe_mma2
        scales = tiled is True
        w13, s13 = moe_mma2.pack_tile_major(ex["w13"], ex["w13_scale"], fmt, scales=scales)
        w2, s2 = moe_mma2.pack_tile_major(ex["w2"], ex["w2_scale"], fmt, scales=scales)
        ex[key] = dict(ex, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    return ex[key]


def token_case(T: int, E: int, H: int, topk: int, dev, gen: torch.Generator):
    """One decode step's routing and input as the MoE benchmarks draw them from ``gen``: T
    tokens' router logits and a small selection bias, routed (sqrt-softplus, top-k), then x in
    bf16 -> (topk_ids, topk_weights, x). Shared by ``dsv4lab bench moe``, scripts/tune_moe.py
    and scripts/ab_moe_t1.py, so that their cases are drawn alike."""
    logits = torch.randn(T, E, device=dev, generator=gen)
    bias = torch.randn(E, device=dev, generator=gen) * 0.1
    ids, w = route(logits, bias, topk=topk)
    return ids, w, torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)


@bench.benchmark("moe", "FP4 MoE at the Flash shape: Triton MXFP4/NVFP4 vs torch reference vs bf16")
def bench_moe(smoke: bool) -> list[dict]:
    dev = runtime.device()
    gen = torch.Generator(device=dev).manual_seed(0)
    if smoke:
        shape, tokens = dict(E=8, H=64, I=64, topk=2), (1, 4)
        make = _quantised_experts
        cpu_gen = torch.Generator().manual_seed(0)
        experts = {f: make(shape["E"], shape["H"], shape["I"], f, dev, cpu_gen) for f in ("mxfp4", "nvfp4")}
    else:
        shape, tokens = FLASH, TOKENS
        experts = {f: _random_experts(shape["E"], shape["H"], shape["I"], f, dev, gen) for f in ("mxfp4", "nvfp4")}
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    w13_bf16, w2_bf16 = _dequant_bf16(experts["mxfp4"], E)
    rows = []
    for T in tokens:
        ids, w, x = token_case(T, E, H, k, dev, gen)
        hit = int(torch.unique(ids).numel())
        pairs = ids.numel()
        for fmt in ("mxfp4", "nvfp4"):
            ex = experts[fmt]

            def run(ex=ex, fmt=fmt):
                return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w, fmt=fmt,
                                 swiglu_limit=SWIGLU_LIMIT, backend="triton", **ex["kw"])
            rows.append(_row(T, "triton", fmt, hit, pairs, shape, bench.time_graph(run), fmt))
            default = dict(PLAIN, **config_for(T, k, E, fmt))
            for name, cfg in ([] if smoke or T not in VARIANT_TOKENS else VARIANTS):
                if dict(PLAIN, **cfg) == default:     # the ``triton`` row times this config
                    continue
                if T not in VARIANT_ONLY.get(name, VARIANT_TOKENS):
                    continue
                # TILED variants: weights packed once, as a model would at load (``ex`` itself
                # stays canonical for the rows after)
                def run_variant(ex=experts_for(ex, cfg, fmt, T), fmt=fmt, cfg=cfg):
                    return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                     fmt=fmt, swiglu_limit=SWIGLU_LIMIT, backend="triton",
                                     kernel_config=cfg, **ex["kw"])
                try:      # one experimental layout that fails must not cost the other rows
                    timing = bench.time_graph(run_variant)
                except Exception as exc:          # (tests/test_moe.py runs every variant too)
                    print(f"bench moe: variant {name} ({fmt}, T={T}) failed: "
                          f"{type(exc).__name__}: {str(exc)[:200]}")
                    continue
                row = _row(T, name, fmt, hit, pairs, shape, timing, fmt)
                row["kernel_config"] = cfg
                rows.append(row)
        ex = experts["mxfp4"]

        def ref():
            return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w, fmt="mxfp4",
                             swiglu_limit=SWIGLU_LIMIT, backend="torch")
        t = bench.time_fn(ref, warmup_ms=1, rep_ms=50)
        rows.append(_row(T, "torch_ref", "mxfp4", hit, pairs, shape, t, "mxfp4"))

        def dense():
            return moe_dense(x, w13_bf16, w2_bf16, ids, w, swiglu_limit=SWIGLU_LIMIT)
        rows.append(_row(T, "torch_bf16", "bf16", hit, pairs, shape,
                         bench.time_fn(dense, warmup_ms=5, rep_ms=50), "mxfp4"))
    print_table(rows)
    return rows
