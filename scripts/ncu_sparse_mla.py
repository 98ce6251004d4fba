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

import argparse
import csv
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarise(source_csv: Path, top: int) -> None:
    """Print the stall samples of ncu's source page (``--page source --csv --print-source sass``)."""
    rows = list(csv.reader(source_csv.open()))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = {name: i for i, name in enumerate(rows[head])}
    data = [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    samples = cols["Warp Stall Sampling (All Samples)"]
    reasons = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    base = int(data[0][cols["Address"]], 16)
    total = sum(_num(r[samples]) for r in data) or 1.0
    print(f"{total:.0f} stall samples")
    by_reason = {c: sum(_num(r[cols[c]]) for r in data) for c in reasons}
    for c, v in sorted(by_reason.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {c[6:]:22s} {v:7.0f} {100 * v / total:5.1f}%")
    part, by_part = 0, {}
    for r in data:
        if "USETMAXREG" in r[cols["Source"]]:
            part += 1
        by_part[part] = by_part.get(part, 0.0) + _num(r[samples])
    print("by code segment between USETMAXREG instructions (0: the prologue; a partition's code "
          "opens with one and closes with another):")
    for p, v in by_part.items():
        print(f"  {p:3d} {v:7.0f} {100 * v / total:5.1f}%")
    print(f"the {top} instructions with the most samples (address from the kernel's start):")
    for r in sorted(data, key=lambda r: -_num(r[samples]))[:top]:
        why = sorted(((_num(r[cols[c]]), c[6:]) for c in reasons), reverse=True)[:2]
        print(f"  {int(r[cols['Address']], 16) - base:6x} {_num(r[samples]):6.0f} "
              f"{r[cols['Source']].strip()[:64]:64s} " + " ".join(f"{c}:{v:.0f}" for v, c in why))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="64,1,2048", help="B,S_q,topk")
    ap.add_argument("--fp8", action="store_true", help="the FP8 cache")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="build/ncu_sparse_mla")
    ap.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        drive(args.shape, args.fp8, args.calls)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report"
    cmd = ["ncu", "--kernel-name", "regex:_sparse_mla_ws_kernel|_sparse_mla_kernel", "--launch-skip",
           str(args.calls - 2), "--launch-count", "1", "--section", "SpeedOfLight", "--section",
           "WarpStateStats", "--section", "SourceCounters", "-f", "-o", str(report), sys.executable,
           __file__, "--drive", "--shape", args.shape, "--calls", str(args.calls)] + (["--fp8"] if args.fp8 else [])
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-2000:])
        return run.returncode
    details = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "details"],
                             capture_output=True, text=True).stdout
    for line in details.splitlines():
        if re.search(r"SM Frequency|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)"
                     r"|Warp Cycles Per Issued", line):
            print(line.strip())
    source = out / "source.csv"
    source.write_text(subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "source", "--csv",
                                      "--print-source", "sass"], capture_output=True, text=True).stdout)
    summarise(source, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
