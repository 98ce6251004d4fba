"""Where the T = 1 fused MoE decode's warps stall, and what they issue (Nsight Compute; GPU only).

    python3 scripts/ncu_moe_t1.py [--fmt mxfp4|nvfp4] [--launch '{"TILED": true}'] [--top 25]
        [--out DIR]

Profiles one call of kernels/moe_mma2.py's ``_decode_kernel`` (the table's T = 1 config, with
``--launch`` keys over its MMA2 entry; weights packed as the keys ask, as ``dsv4lab bench moe``
packs them) at Flash's shape, after warm-up calls, with ``ncu`` (SpeedOfLight, WarpStateStats,
SourceCounters; ncu locks the clocks to base and flushes the caches before the profiled call).
Prints the kernel's duration and throughputs, the stall samples by reason and the instructions
with the most samples (as scripts/ncu_sparse_mla.py does), then the executed warp instructions
by opcode. The diagnostic builds of scripts/moe_t1_diagnostics.patch are profiled the same way
(their switches in the environment). Records nothing: a printout.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ncu_sparse_mla import _num, summarise  # noqa: E402


def drive(fmt: str, launch: str | None, calls: int) -> None:
    """The profiled process: the T = 1 call, ``calls`` times."""
    sys.path.insert(0, str(ROOT))
    import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
    import torch
    from dsv4lab.benchmarks.moe import FLASH, SWIGLU_LIMIT, _random_experts, experts_for, token_case
    from dsv4lab.kernels.moe import config_for
    from dsv4lab.ops import fused_moe
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    cfg = dict(config_for(1, k, E, fmt))
    if launch:
        cfg["MMA2"] = dict(cfg["MMA2"], **json.loads(launch))
    ex = experts_for(_random_experts(E, H, I, fmt, dev, gen), cfg, fmt, 1)
    ids, w, x = token_case(1, E, H, k, dev, gen)
    print(cfg, flush=True)
    for _ in range(calls):
        fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w, fmt=fmt,
                  swiglu_limit=SWIGLU_LIMIT, backend="triton", kernel_config=cfg, **ex["kw"])
    torch.cuda.synchronize()


def opcodes(source_csv: Path, top: int) -> None:
    """Executed warp instructions by opcode (predicates and modifiers dropped)."""
    rows = list(csv.reader(source_csv.open()))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = {name: i for i, name in enumerate(rows[head])}
    executed = next((c for c in cols if c.startswith("Warp Instructions Executed")
                     or c == "Instructions Executed"), None)
    if executed is None:
        print("no executed-instruction column in the source page:", sorted(cols)[:12])
        return
    count = Counter()
    for r in rows[head + 1:]:
        if len(r) != len(rows[head]):
            continue
        op = re.sub(r"^@!?U?P\w+\s+", "", r[cols["Source"]].strip()).split(" ")[0].split(".")[0]
        count[op] += _num(r[cols[executed]])
    total = sum(count.values()) or 1.0
    print(f"{total:.0f} warp instructions executed ({executed}); by opcode:")
    for op, v in count.most_common(top):
        print(f"  {op:10s} {v:12.0f} {100 * v / total:5.1f}%")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="mxfp4", choices=("mxfp4", "nvfp4"))
    ap.add_argument("--launch", default=None, help="JSON of moe_mma2 launch keys over the config")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="build/ncu_moe_t1")
    ap.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drive:
        drive(args.fmt, args.launch, args.calls)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report"
    cmd = ["ncu", "--kernel-name", "regex:_decode_kernel", "--launch-skip", str(args.calls - 2),
           "--launch-count", "1", "--section", "SpeedOfLight", "--section", "WarpStateStats",
           "--section", "SourceCounters", "-f", "-o", str(report), sys.executable, __file__,
           "--drive", "--fmt", args.fmt, "--calls", str(args.calls)]
    if args.launch:
        cmd += ["--launch", args.launch]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-2000:])
        return run.returncode
    details = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "details"],
                             capture_output=True, text=True).stdout
    for line in details.splitlines():
        if re.search(r"SM Frequency|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)"
                     r"|Warp Cycles Per Issued|Issue Slot|Active Warps|Eligible", line):
            print(line.strip())
    source = out / "source.csv"
    source.write_text(subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "source", "--csv",
                                      "--print-source", "sass"], capture_output=True, text=True).stdout)
    summarise(source, args.top)
    opcodes(source, 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
