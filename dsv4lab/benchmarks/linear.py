"""``dsv4lab bench linear``: the FP8 block-scaled linear at DeepSeek-V4-Flash's projection shapes.

Shapes (``V4_FP8_WEIGHTS`` of :mod:`dsv4lab.kernels.linear`): q_a 4096 -> 1024, q_b 1024 ->
64 x 512, kv 4096 -> 512, the grouped output projection wo_a (8 groups of 4096 -> 1024, one
[8 x 1024, 4096] weight) and wo_b 8 x 1024 -> 4096, the shared expert (4096 -> 2 x 2048,
2048 -> 4096), the indexer's q (1024 -> 64 x 128) and weights (4096 -> 64); M (rows) in
1, 2, 4, 8, 64, 256. Random e4m3 weights with power-of-two block scales (the values do
not change the data movement), x in bf16. Rows (field ``impl``), each with ``mode``:

- ``triton_fp8``: ``ops.linear(x, w8, weight_scale=s)``, the family's dispatch (``kernel``
  names the route, with its tiles and split): ``graph`` (replayed, ``validate=False``, as
  a captured decode step calls it) and ``eager`` (the op with its default checks, whose
  verdict is cached after the first call, host included);
- ``cublas_bf16``: the same weights dequantised to bf16 once, ``torch.nn.functional.linear``
  (wo_a: ``torch.bmm`` over the groups), graph and eager;
- ``scaled_mm``: torch's FP8 GEMM, graph, on x quantised to e4m3 per 1 x 128 group outside
  the timing (DeepGEMM's W8A8) and the checkpoint's 128 x 128 weight scales, where it runs
  (``torch.nn.functional.scaled_mm``'s block-wise recipes: sm_90); elsewhere on sm_89+
  ``torch._scaled_mm`` with per-row scales (the weight re-quantised per row: the same bytes,
  not the checkpoint's numbers), ``note`` saying which; not at all before sm_89, on the
  grouped wo_a (one GEMM a call), or where it refuses a shape (printed).

Every row's roofline uses the FP8 bytes (e4m3 weight + fp32 block scales + x and y in bf16)
and 2 M N K flops at the FP8 peak (``roofline_basis``): the floor for this weight format,
the same for every implementation. ``rel_err``: the row's output against the fp32
reference (dequantised weights, fp32 x), as ||y - ref|| / ||ref||. Smoke mode: two tiny
shapes, M 1 and 3, in the interpreter (CPU). Runs in about a minute on an H200.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4lab import bench, ops, runtime
from dsv4lab.kernels import linear as K
from dsv4lab.kernels.device import choose
from dsv4lab.kernels.device import props as device_props
from dsv4lab.ops.linear import dequantize

ROWS = (1, 2, 4, 8, 64, 256)
SMOKE_WEIGHTS = (("tiny", 130, 200, 1), ("tiny_grouped", 64, 130, 4))
SMOKE_ROWS = (1, 3)
BASIS = "FP8 bytes: e4m3 weight + fp32 block scales + bf16 x and y; 2MNK flops at the FP8 peak"
TIMING = dict(warmup_ms=10, rep_ms=40)


def fp8_bytes(M: int, N: int, K_: int, groups: int) -> float:
    """Bytes one FP8 linear must move: the e4m3 weight, its fp32 scales, x and y (bf16)."""
    return N * K_ + 4 * (-(-N // 128)) * (-(-K_ // 128)) + 2 * M * groups * K_ + 2 * M * N


def random_fp8_weight(N: int, K_: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight [N, K] and fp32 power-of-two scales [ceil(N/128), ceil(K/128)]."""
    w8 = (torch.randn(N, K_, device=device, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-12, -6, (-(-N // 128), -(-K_ // 128)), device=device, generator=gen)
    return w8, torch.exp2(exps.float())


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float().reshape(ref.shape) - ref).norm() / ref.norm().clamp_min(1e-30))


def _cublas(x, w_bf16, groups):
    """cuBLAS bf16 on the dequantised weight: one GEMM, or one batched GEMM over the groups
    (y as [groups, M, N / groups])."""
    if groups == 1:
        return lambda: F.linear(x, w_bf16)
    M = x.shape[0]
    N, K_ = w_bf16.shape
    xg = x.view(M, groups, K_).transpose(0, 1)                       # [G, M, K], strided
    wg = w_bf16.view(groups, N // groups, K_).transpose(1, 2)        # [G, K, N/G]
    return lambda: torch.bmm(xg, wg)


def _quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 128) as e4m3 with one fp32 scale per 1 x 128 group."""
    M, K_ = x.shape
    g = x.float().view(M, K_ // 128, 128)
    scale = g.abs().amax(-1).clamp_min(1e-12) / 448.0
    return (g / scale[..., None]).to(torch.float8_e4m3fn).view(M, K_), scale


def _scaled_mm(x, w8, s, groups):
    """(callable, note, rows computed) for torch's FP8 GEMM on this GPU, or (None, why, 0)."""
    cap = runtime.capability()
    if cap is None or cap < (8, 9):
        return None, "needs a CUDA GPU of sm_89+ (FP8 tensor cores)", 0
    if groups > 1:
        return None, "a grouped GEMM: torch's scaled_mm takes one matrix a call", 0
    M, K_ = x.shape
    N = w8.shape[0]
    if K_ % 128 or N % 16:
        return None, f"K = {K_} not a multiple of 128 or N = {N} of 16", 0
    Mp = -(-M // 16) * 16                                 # rows padded to a multiple of 16
    xq, xs = _quantize_groups(F.pad(x, (0, 0, 0, Mp - M)))
    errors = []
    if cap == (9, 0) and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        kb = K_ // 128
        s_pad = F.pad(s, (0, -kb % 4))                    # K blocks padded to a multiple of 4
        a_scale = xs.t().contiguous().t()                 # [M, K/128], outer-dim-major
        b_scale = s_pad.t()                               # [L4, N/128], stride [1, L4]

        def blockwise():
            return F.scaled_mm(xq, w8.t(), a_scale, F.ScalingType.BlockWise1x128, b_scale,
                               F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        try:
            blockwise()
            return blockwise, "block-wise: x 1x128 groups (quantised outside the timing), W 128x128", Mp
        except Exception as e:  # noqa: BLE001  (recorded as the row's note)
            errors.append(f"block-wise refused: {type(e).__name__}: {str(e)[:120]}")
    w_dense = dequantize(w8, s)
    w_scale = w_dense.abs().amax(1).clamp_min(1e-12) / 448.0            # per row
    w_row = (w_dense / w_scale[:, None]).to(torch.float8_e4m3fn)
    xr = F.pad(x, (0, 0, 0, Mp - M)).float()
    x_scale = xr.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0
    x_row = (xr / x_scale).to(torch.float8_e4m3fn)

    def rowwise():
        return torch._scaled_mm(x_row, w_row.t(), scale_a=x_scale, scale_b=w_scale[None, :],
                                out_dtype=torch.bfloat16)
    try:
        rowwise()
        return rowwise, "; ".join(errors + ["per-row scales: W re-quantised per row (the same bytes, "
                                             "not the checkpoint's scales), x per row"]), Mp
    except Exception as e:  # noqa: BLE001
        errors.append(f"per-row refused: {type(e).__name__}: {str(e)[:120]}")
    return None, "; ".join(errors), 0


def _row(name, N, K_, groups, M, impl, mode, timing, ref_err, **extra) -> dict:
    row = dict(shape=name, N=N, K=K_, groups=groups, M=M, impl=impl, mode=mode,
               roofline_basis=BASIS, rel_err=ref_err, **extra, **timing)
    return bench.with_roofline(row, bytes_moved=fp8_bytes(M, N, K_, groups),
                               flops=2.0 * M * N * K_, dtype="fp8")


def print_table(rows: list[dict]) -> None:
    """One line a shape: the FP8 kernel's graph time at each M, its roofline fraction and its
    speedup over cuBLAS bf16 (graph) at M = 1 and 8."""
    by = {(r["shape"], r["M"], r["impl"], r["mode"]): r for r in rows}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    ms = sorted({r["M"] for r in rows})
    print(f"{'shape':<16}" + "".join(f"{'M ' + str(m) + ' us':>10}" for m in ms)
          + f"{'frac M1':>9}{'frac M8':>9}{'x cuBLAS M1':>13}{'M8':>6}")
    for s in shapes:
        cells = [by.get((s, m, "triton_fp8", "graph")) for m in ms]
        line = f"{s:<16}" + "".join(f"{c['ms'] * 1e3:>10.1f}" if c else f"{'-':>10}" for c in cells)
        for m in (1, 8):
            c = by.get((s, m, "triton_fp8", "graph"))
            line += f"{c['roofline_fraction']:>9.2f}" if c else f"{'-':>9}"
        for m, w in ((1, 13), (8, 6)):
            c, b = by.get((s, m, "triton_fp8", "graph")), by.get((s, m, "cublas_bf16", "graph"))
            line += f"{b['ms'] / c['ms']:>{w}.2f}" if c and b else f"{'-':>{w}}"
        print(line)


@bench.benchmark("linear", "FP8 block-scaled linear at V4-Flash's projection shapes, M 1..256: "
                           "the Triton kernel (graph and eager) vs cuBLAS bf16 vs torch's scaled_mm")
def bench_linear(smoke: bool) -> list[dict]:
    dev = runtime.device()
    gen = torch.Generator(device=dev).manual_seed(0)
    weights, row_counts = (SMOKE_WEIGHTS, SMOKE_ROWS) if smoke else (K.V4_FP8_WEIGHTS, ROWS)
    backend = "triton" if dev.type != "cuda" else "auto"        # the interpreter only when asked
    props = device_props(dev)
    rows, skipped = [], {}
    for name, N, K_, groups in weights:
        w8, s = random_fp8_weight(N, K_, dev, gen)
        dense = dequantize(w8, s)
        w_bf16 = dense.to(torch.bfloat16)
        for M in row_counts:
            x = torch.randn(M, groups * K_, device=dev, generator=gen).to(torch.bfloat16)
            ref = torch.einsum("mgk,gnk->mgn", x.float().view(M, groups, K_),
                               dense.view(groups, N // groups, K_)).reshape(M, N)
            cfg = K.fp8_config(N, K_, M, props, N // groups if groups > 1 else None)
            route = choose(K.TABLES["linear_fp8"], props, rows=M).kernel
            info = dict(kernel=route, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], split=cfg["SPLIT"],
                        fmt="fp8_e4m3_block128")

            def fp8(validate=True, x=x, w8=w8, s=s, groups=groups):
                return ops.linear(x, w8, weight_scale=s, groups=groups, backend=backend, validate=validate)
            err = _rel_err(fp8(), ref)
            rows.append(_row(name, N, K_, groups, M, "triton_fp8", "graph",
                             bench.time_graph(lambda: fp8(False), **TIMING), err, **info))
            rows.append(_row(name, N, K_, groups, M, "triton_fp8", "eager", bench.time_fn(fp8, **TIMING),
                             err, **info))
            dense_fn = _cublas(x, w_bf16, groups)
            y = dense_fn()
            err = _rel_err(y.transpose(0, 1) if groups > 1 else y, ref)
            for mode, timer in (("graph", bench.time_graph), ("eager", bench.time_fn)):
                rows.append(_row(name, N, K_, groups, M, "cublas_bf16", mode, timer(dense_fn, **TIMING), err,
                                 fmt="bf16"))
            if smoke:
                continue
            fn, note, computed = _scaled_mm(x, w8, s, groups)
            if fn is None:
                skipped.setdefault(note, []).append(f"{name} M {M}")
                continue
            err = _rel_err(fn()[:M], ref)
            rows.append(_row(name, N, K_, groups, M, "scaled_mm", "graph", bench.time_graph(fn, **TIMING), err,
                             fmt="fp8_e4m3", note=note, rows_computed=computed))
    print_table(rows)
    for why, where in skipped.items():
        print(f"scaled_mm not timed ({len(where)} cases, e.g. {where[0]}): {why}")
    return rows
