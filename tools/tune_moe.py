"""Sweep the portable Triton MoE kernel's tiles on this GPU and print a TUNED_TILES entry.

    python3 tools/tune_moe.py                     # on a GPU: Flash's shape, T in {1, 64, 256, 4096}
    python3 tools/tune_moe.py --tokens 1,8 --budget 60
    python3 tools/tune_moe.py --dry-run           # tiny shape in the interpreter (CPU smoke)

For each T (one row of kernels/moe/dispatch.py's table: rows per expert hit) and format, every
candidate ``Tiles`` (the table's entry and each one-parameter move from it) runs the lesson
kernel (kernels/moe/triton_moe.py) directly: checked against the fp32 torch reference (a wrong
one is never ranked), then timed as a CUDA-graph replay. Candidates that do not compile or launch on this GPU are reported and skipped; when the
budget (seconds) runs out the rest are skipped. Prints the ranking and, last, the winners as
a ``TUNED_TILES[(major, minor)]`` entry to paste into kernels/moe/dispatch.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import dsv4lab  # noqa: F401  (sets TRITON_INTERPRET before triton is imported on a CPU)
import torch

from dsv4lab import bench, runtime
from dsv4lab.benchmarks.moe import FLASH, random_experts, fp4_bytes, quantised_experts, token_case
from dsv4lab.kernels.device import props
from dsv4lab.kernels.moe import dispatch, triton_moe
from dsv4lab.kernels.moe.triton_moe import Tiles
from dsv4lab.ops import fused_moe

LIMIT = 10.0
TOL = 1.2e-2          # bf16 x and output: as tests/test_moe.py


def candidates(base: Tiles, smoke: bool) -> list[Tiles]:
    """The table's entry first, then every one-parameter move from it (deduplicated)."""
    if smoke:
        moves = dict(BK1=(32,), BK2=(32,), SPLIT2=(1,))
    else:
        moves = dict(BN1=(32, 64, 128), BN2=(32, 64, 128), BK1=(128, 256), BK2=(128, 256),
                     SPLIT1=(1, 2, 4), SPLIT2=(1, 2, 4), num_warps=(4, 8), num_stages=(2, 3, 4),
                     ROWMAX=(False, True))
    out = [base] + [dataclasses.replace(base, **{name: v}) for name, vals in moves.items() for v in vals]
    return list(dict.fromkeys(out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1,64,256,4096", help="T values (one table row each)")
    ap.add_argument("--formats", default="mxfp4,nvfp4")
    ap.add_argument("--budget", type=float, default=600.0, help="seconds before skipping the rest")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape, interpreter-friendly")
    args = ap.parse_args()
    t0 = time.time()
    dev = runtime.device()
    if not args.dry_run and dev.type != "cuda":
        print("tune_moe: no CUDA GPU here (--dry-run runs the CPU smoke)")
        return 2
    shape = dict(E=8, H=64, I=64, topk=2) if args.dry_run else FLASH
    tokens = (1, 4) if args.dry_run else tuple(int(t) for t in args.tokens.split(","))
    E, H, I, k = shape["E"], shape["H"], shape["I"], shape["topk"]
    gen = torch.Generator(device=dev).manual_seed(0)
    make = quantised_experts if args.dry_run else random_experts
    p = props(dev)
    print(f"tune_moe on {p.name or dev} (sm_{p.capability[0]}{p.capability[1]}, {p.sm_count} SMs), {shape}")
    winners: dict[float, dict] = {}
    for fmt in args.formats.split(","):
        ex = make(E, H, I, fmt, dev, gen)
        kw = {n: v.reshape(-1).expand(E).contiguous() for n, v in ex["kw"].items()}
        for T in tokens:
            ids, w, x = token_case(T, E, H, k, dev, gen)
            hit = int(torch.unique(ids).numel())
            args13 = (ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w)
            ref = fused_moe(x.float(), *args13, fmt=fmt, swiglu_limit=LIMIT, backend="torch", **kw).float()
            bound = next(b for b, _ in dispatch.TRITON_TILES if dispatch.rows_per_expert(T, k, E) <= b)
            base = dispatch.tiles_for(T, k, E, fmt, p)
            ranked = []
            for tiles in candidates(base, args.dry_run):
                if time.time() - t0 > args.budget:
                    print(f"  budget spent: the rest of T={T} {fmt} skipped")
                    break

                def run(tiles=tiles):
                    return triton_moe.fused_moe(x, *args13, fmt=fmt, swiglu_limit=LIMIT, tiles=tiles, **kw)
                try:
                    err = ((run().float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
                    if err > TOL:
                        print(f"  WRONG ({err:.1e}): {tiles}")
                        continue
                    ms = bench.time_graph(run, warmup_ms=3, rep_ms=15)["ms"]
                except Exception as exc:          # a candidate this GPU cannot build or launch
                    print(f"  skipped {tiles}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                    continue
                ranked.append((ms, tiles))
            ranked.sort(key=lambda r: r[0])
            roof = bench.with_roofline({}, bytes_moved=fp4_bytes(hit, H, I, fmt),
                                       flops=2.0 * ids.numel() * 3 * H * I)["roofline_ms"]
            print(f"T={T} {fmt} (rows/expert <= {bound}): {len(ranked)} ran; best first")
            for ms, tiles in ranked[:5]:
                print(f"  {ms * 1e3:9.1f} us  {roof / ms:.3f} of the roofline  {'(table) ' if tiles == base else ''}{tiles}")
            if ranked:
                winners.setdefault(bound, {})[fmt] = ranked[0][1]
    cap = p.capability
    print(f"\n# {p.name}, {time.strftime('%Y-%m-%d')}: paste into kernels/moe/dispatch.py")
    print(f"TUNED_TILES[{cap}] = (")
    for bound, _ in dispatch.TRITON_TILES:
        row = {f: winners.get(bound, {}).get(f) or dict(dispatch.TRITON_TILES)[bound][f]
               for f in ("mxfp4", "nvfp4")}
        b = "math.inf" if bound == math.inf else repr(bound)
        print(f"    ({b}, {{{', '.join(f'{f!r}: {t!r}' for f, t in row.items())}}}),")
    print(")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
