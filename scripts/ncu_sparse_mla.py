"""Where the sparse-MLA decode kernel's warps stall, by Nsight Compute's PC sampling (GPU only).

    python3 scripts/ncu_sparse_mla.py [--shape 64,1,2048] [--fp8] [--top 25] [--out DIR]

Profiles one call of the H200 table's launch (kernels/sparse_mla_mma.py DEVICE_TABLE) at the
shape (B,S_q,topk), after warm-up calls, with ``ncu`` (SpeedOfLight, WarpStateStats,
SourceCounters; ncu locks the clocks to base), then reads the per-instruction source page and
prints: the kernel's duration and throughputs, the stall samples by reason, by code segment
(the warp-specialised kernel's code is laid out a partition after another, each between
``USETMAXREG`` instructions), and the instructions with the most samples. The report and the source CSV
stay in ``--out``. Records nothing: a printout (the session notes quote it as such).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ncu_report  # noqa: E402


def drive(shape: str, fp8: bool, calls: int) -> None:
    """The profiled process: the table's launch at ``shape``, ``calls`` times."""
    sys.path.insert(0, str(ROOT))
    import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
    import torch
    from dsv4lab.benchmarks import sparse_mla as sb
    from dsv4lab.kernels import sparse_mla_mma as mma
    from dsv4lab.ops.attention import sparse_mla_decode_with_config
    B, S, T = (int(v) for v in shape.split(","))
    dev = torch.device("cuda")
    cases = sb._Cases(B, heads=64, dim=512, context=max(sb.CONTEXT, T), min_rows=sb.MIN_CACHE_ROWS,
                      device=dev, fp8=fp8)
    sets = cases.inputs(S, T, cases.rotate)
    cfg = mma.DEVICE_TABLE[torch.cuda.get_device_name(dev)][mma.workload_class(B * S, fp8)]
    kv = cases.kv_fp8 if fp8 else cases.kv
    print(cfg, flush=True)
    for i in range(calls):
        q, idx = sets[i % len(sets)]
        sparse_mla_decode_with_config(q, kv, idx, config=cfg, d_v=512, attn_sink=cases.sink,
                                      check_indices=False)
    torch.cuda.synchronize()


def main() -> int:
    ap = ncu_report.parser(__doc__, "build/ncu_sparse_mla", calls=8)
    ap.add_argument("--shape", default="64,1,2048", help="B,S_q,topk")
    ap.add_argument("--fp8", action="store_true", help="the FP8 cache")
    args = ap.parse_args()
    if args.drive:
        drive(args.shape, args.fp8, args.calls)
        return 0
    driver = [sys.executable, __file__, "--drive", "--shape", args.shape, "--calls",
              str(args.calls)] + (["--fp8"] if args.fp8 else [])
    if ncu_report.profile("_sparse_mla_ws_kernel|_sparse_mla_kernel", driver, args.calls,
                          Path(args.out), args.top) is None:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
