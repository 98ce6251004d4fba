"""Nsight Compute for the scripts that profile one kernel (scripts/ncu_sparse_mla.py,
scripts/ncu_moe_t1.py): run ``ncu`` on a driver command, print the kernel's duration and
throughputs, then read the per-instruction source page: the stall samples by reason, by code
segment and the instructions with the most samples, and the executed warp instructions by opcode.
ncu locks the clocks to base and flushes the caches before the profiled launch. Printouts only.
"""
from __future__ import annotations

import argparse
import csv
import re
import subprocess
from collections import Counter
from pathlib import Path

DETAILS = (r"SM Frequency|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)"
           r"|Warp Cycles Per Issued")


def parser(doc: str, out: str, calls: int) -> argparse.ArgumentParser:
    """The profiling scripts' common arguments: --top, --out and the driver's hidden --drive and
    --calls (the script runs itself under ncu with --drive)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=out)
    ap.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--calls", type=int, default=calls, help=argparse.SUPPRESS)
    return ap


def profile(kernel_regex: str, driver: list[str], calls: int, out: Path, top: int) -> Path | None:
    """Profile the one launch of the kernels matching ``kernel_regex`` two before the last of the
    ``calls`` that ``driver`` (a command) makes; print its details and stall samples. The report and
    the source page (source.csv, returned; None if ncu failed) stay in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    report = out / "report"
    cmd = ["ncu", "--kernel-name", f"regex:{kernel_regex}", "--launch-skip", str(calls - 2),
           "--launch-count", "1", "--section", "SpeedOfLight", "--section", "WarpStateStats",
           "--section", "SourceCounters", "-f", "-o", str(report)] + driver
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-2000:], run.stderr[-2000:])
        return None
    details = subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "details"],
                             capture_output=True, text=True).stdout
    for line in details.splitlines():
        if re.search(DETAILS, line):
            print(line.strip())
    source = out / "source.csv"
    source.write_text(subprocess.run(["ncu", "-i", f"{report}.ncu-rep", "--page", "source", "--csv",
                                      "--print-source", "sass"], capture_output=True, text=True).stdout)
    summarise(source, top)
    return source


def _source(source_csv: Path) -> tuple[dict[str, int], list[list[str]]]:
    """ncu's source page (``--page source --csv --print-source sass``) -> (column index by
    name, the instruction rows)."""
    rows = list(csv.reader(source_csv.open()))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = {name: i for i, name in enumerate(rows[head])}
    return cols, [r for r in rows[head + 1:] if len(r) == len(rows[head])]


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarise(source_csv: Path, top: int) -> None:
    """Print the stall samples of ncu's source page (``--page source --csv --print-source sass``)."""
    cols, data = _source(source_csv)
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


def opcodes(source_csv: Path, top: int) -> None:
    """Executed warp instructions by opcode (predicates and modifiers dropped)."""
    cols, data = _source(source_csv)
    executed = next((c for c in cols if c.startswith("Warp Instructions Executed")
                     or c == "Instructions Executed"), None)
    if executed is None:
        print("no executed-instruction column in the source page:", sorted(cols)[:12])
        return
    count = Counter()
    for r in data:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[cols["Source"]].strip()).split(" ")[0].split(".")[0]
        count[op] += _num(r[cols[executed]])
    total = sum(count.values()) or 1.0
    print(f"{total:.0f} warp instructions executed ({executed}); by opcode:")
    for op, v in count.most_common(top):
        print(f"  {op:10s} {v:12.0f} {100 * v / total:5.1f}%")
