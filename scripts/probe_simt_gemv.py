"""Can a CUDA-core GEMV with x in registers read the T = 1 MoE's weights faster? (GPU only.)

    python3 scripts/probe_simt_gemv.py [--quick]

The rows of the 6 experts' gate/up matrices (24576 rows of 4096 MXFP4 elements, 2 KB and 128
scale bytes each) and of their down matrices (24576 rows of 2048) times one token, by
:func:`dsv4lab.kernels.moe_simt.rows_times_x` (kernels/moe_simt.py: lane l owns 64 elements of
every row, x in registers, fp16x2 fma, the block scale on the block's fp32 sum), checked
against the fp32 torch reference, then timed as ``dsv4lab bench`` times (CUDA graph, dirty
L2) against a read of the same bytes (:func:`dsv4lab.kernels.stream_read.rows_read`, the
MoE's pattern, and :func:`~dsv4lab.kernels.stream_read.stream_read`). Configurations: rows a
program (R), rows a warp an iteration (RB), the fp16 pairs by ``prmt`` or ``cvt``, one or two
fp16 chains a block, warps a program.

H200 printout at 3a6d357 (us; gate/up 51.0 MB, down 25.5 MB): stream_read of the gate/up rows
21.0; rows_read in the MoE's pattern 23.5, then the down rows 33.5; 256 bytes a row a step 20.1 /
29.0. These rows times x (error against the fp32 reference 7.1e-4 of its largest value, 5.2e-4
with two fp16 chains): R 64 RB 2 21.5 / 33.4; RB 1 22.3 / 35.9; R 128 24.6 / 42.2; RB 4 25.3 /
36.3; ``cvt`` 21.7 / 33.7; two chains 21.7 / 33.9; R 128 at 8 warps 21.3 / 33.6; R 32 22.2 /
32.1; R 128 RB 4 22.7 / 37.2; R 32 RB 1 22.8 / 33.1; R 256 36.3 / 54.1. The GEMV reads at the
speed of the read alone: the reason for kernels/moe_simt.py's decode (the T = 1 entry since
session 22).
"""
from __future__ import annotations

import argparse
import sys

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
import torch
import triton

from dsv4lab import bench
from dsv4lab.kernels.moe_simt import rows_times_x, x_pairs
from dsv4lab.kernels.stream_read import rows_read, stream_read
from dsv4lab.quant import mxfp4_dequantize


def _weights(n, k, gen, dev):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
    s = torch.randint(118, 127, (n, k // 32), dtype=torch.uint8, device=dev, generator=gen)
    return w, s


def _check(w, s, x, slices, cfg) -> float:
    out = rows_times_x(w, s, x, slices=slices, **cfg).sum(0)
    ref = torch.cat([mxfp4_dequantize(w[i:i + 2048], s[i:i + 2048]) @ x.float()
                     for i in range(0, w.shape[0], 2048)])
    return ((out - ref).abs().max() / ref.abs().max()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first configurations only")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_simt_gemv: needs a CUDA GPU")
        return 2
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    n = 6 * 4096
    w13, s13 = _weights(n, 4096, gen, dev)
    w2, s2 = _weights(n, 2048, gen, dev)
    x = torch.randn(4096, device=dev, generator=gen)
    a = torch.randn(2048, device=dev, generator=gen) * 3
    xq1, cx1 = x_pairs(x, 2)
    xq2, cx2 = x_pairs(a, 1)
    out1 = torch.empty(2, n, device=dev)
    out2 = torch.empty(1, n, device=dev)
    us = lambda fn: bench.time_graph(fn)["ms"] * 1e3      # noqa: E731
    print(f"{torch.cuda.get_device_name()}, triton {triton.__version__}; CUDA graph, dirty L2; "
          f"gate/up {(w13.numel() + s13.numel()) / 2**20:.1f} MB, down {(w2.numel() + s2.numel()) / 2**20:.1f} MB")
    words13, words2 = w13.view(torch.int32).reshape(-1), w2.view(torch.int32).reshape(-1)
    gu = dict(row_bytes=2048, rows=64, step=64, slices=2, evict=True)
    dn = dict(row_bytes=1024, rows=32, step=64, slices=1, evict=True)
    print(f"  stream_read gate/up                      {us(lambda: stream_read(words13)):6.1f} us")
    print(f"  rows_read (the MoE's pattern)            {us(lambda: rows_read(words13, **gu)):6.1f} us; "
          f"then down {us(lambda: (rows_read(words13, **gu), rows_read(words2, **dn))):6.1f}")
    print(f"  rows_read 256 B a row a step             "
          f"{us(lambda: rows_read(words13, **dict(gu, step=256))):6.1f} us; then down "
          f"{us(lambda: (rows_read(words13, **dict(gu, step=256)), rows_read(words2, **dict(dn, step=256)))):6.1f}")
    cfgs = [dict(R=64, RB=2), dict(R=64, RB=1), dict(R=128, RB=2), dict(R=64, RB=4),
            dict(R=64, RB=2, dec="cvt"), dict(R=64, RB=2, chains=2), dict(R=128, RB=2, num_warps=8),
            dict(R=32, RB=2), dict(R=128, RB=4), dict(R=32, RB=1), dict(R=256, RB=2)]
    if args.quick:
        cfgs = cfgs[:3]
    print(f"  {'config':44s} {'err':>8s} {'gate/up':>8s} {'+down':>8s}")
    for cfg in cfgs:
        try:
            err = max(_check(w13, s13, x, 2, cfg), _check(w2, s2, a, 1, cfg))
            t1 = us(lambda: rows_times_x(w13, s13, None, slices=2, xq=xq1, cx=cx1, out=out1, **cfg))
            t2 = us(lambda: (rows_times_x(w13, s13, None, slices=2, xq=xq1, cx=cx1, out=out1, **cfg),
                             rows_times_x(w2, s2, None, slices=1, xq=xq2, cx=cx2, out=out2,
                                          **dict(cfg, R=min(cfg["R"], 128)))))
            print(f"  {str(cfg):44s} {err:8.1e} {t1:8.1f} {t2:8.1f}")
        except Exception as exc:  # noqa: BLE001  (a probe: report and go on)
            print(f"  {str(cfg):44s} failed: {type(exc).__name__}: {str(exc)[:200]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
