"""Race check of the one-launch MoE decodes: replays of a captured call on changing routing,
each output compared bit for bit with an eager call on the same routing.

    python3 scripts/stress_moe_decode.py [--replays 400] [--tokens 1 3 8] [--copies 4]

The launches checked are kernels/moe_mma2.py's ticketed FUSED decode (the launch keys of
tests/test_moe.py's graph test) and kernels/moe_simt.py's GEMV decode. Both sum their split-K
partials and their pairs in a fixed order, so every call on the same inputs gives the same
bits: a replay that differs read a partial sum, a counter or an activation before its writer
had finished, or the launch started on counters its copy had not zeroed. ``--copies N`` runs N
processes at once (the GPU time-slices them, preempting launches mid-flight, so their tiles
finish in orders a lone process does not see). Each eager output is also compared with the fp32
torch backend (printed: the largest error over the largest |reference|). Exits 1 on any
mismatch. A diagnosis aid: its printouts are not recorded rows.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

import torch

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
from dsv4lab import bench, ops
from dsv4lab.benchmarks.moe import SWIGLU_LIMIT, _random_experts, token_case

# moe_mma2.fused_moe launch keys (FUSED=True added): tests/test_moe.py's graph cases, then
# moe_simt's decode (its Flash-size default, then the register ring's twin without PDL)
LAUNCHES = [
    dict(),
    dict(SPLIT1=4, SPLIT2=2, STAGES=2, NSPS=2),
    dict(SPLIT1=4, SPLIT2=2, STAGES=3, NSPS=2, BN1=32, BN2=32, num_warps=2, ACC_SCALE=True),
    dict(SPLIT1=2, SPLIT2=1, BN1=32, BN2=32, num_warps=2, REGS=4),
    dict(SPLIT1=2, SPLIT2=1, BN1=32, BN2=32, num_warps=2, REGS=4, EVICT=True, PREFETCH=False),
    dict(SIMT=True),
    dict(SIMT=True, PDL=False),
]


def check(fmt: str, T: int, keys: dict, ex: dict, replays: int, routings: int, seed: int):
    """(mismatched replays, eager calls that differed, error vs the fp32 reference) of one
    launch config at T tokens over ``routings`` routings (a -1 slot in every other one)."""
    from dsv4lab.kernels import moe_mma2
    dev = torch.device("cuda")
    E, H = ex["w13"].shape[0], ex["w2"].shape[1]
    gen = torch.Generator(device=dev).manual_seed(seed)
    cases = []
    for r in range(routings):
        ids, w, x = token_case(T, E, H, 6, dev, gen)
        if r % 2:
            ids[T - 1, r % 6] = -1
        cases.append((ids, w, x))
    ids, w, x = (t.clone() for t in cases[0])
    kw = ex["kw"]

    def call():
        return moe_mma2.fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                  fmt=fmt, swiglu_limit=SWIGLU_LIMIT, FUSED=True, **kw, **keys)

    def load(r):
        for buf, val in zip((ids, w, x), cases[r]):
            buf.copy_(val)

    eager, unstable, err = [], 0, 0.0
    for r in range(routings):
        load(r)
        first = call().clone()
        unstable += int(not torch.equal(first, call()))
        ref = ops.fused_moe(x.float(), ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids,
                            w, fmt=fmt, swiglu_limit=SWIGLU_LIMIT, backend="torch", **kw)
        err = max(err, float((first.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
        eager.append(first)
    graph, out = bench.capture_graph(call)
    bad = torch.zeros((), dtype=torch.int32, device=dev)
    for i in range(replays):
        load(i % routings)
        graph.replay()
        bad += (out != eager[i % routings]).any().to(torch.int32)
    torch.cuda.synchronize()
    return int(bad), unstable, err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=400)
    ap.add_argument("--routings", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 3, 8])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--copies", type=int, default=1, help="processes run at once")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.copies > 1:
        cmd = [sys.executable, __file__, "--replays", str(args.replays), "--routings",
               str(args.routings), "--experts", str(args.experts), "--tokens",
               *map(str, args.tokens)]
        procs = [subprocess.Popen(cmd + ["--seed", str(args.seed + c)]) for c in range(args.copies)]
        return max(p.wait() for p in procs)
    if not torch.cuda.is_available():
        print("stress_moe_decode: needs a CUDA GPU")
        return 2
    H, I = 4096, 2048
    failed = False
    for fmt in ("mxfp4", "nvfp4"):
        gen = torch.Generator(device="cuda").manual_seed(args.seed)
        ex = _random_experts(args.experts, H, I, fmt, torch.device("cuda"), gen)
        for T in args.tokens:
            for keys in LAUNCHES:
                bad, unstable, err = check(fmt, T, keys, ex, args.replays, args.routings,
                                           args.seed * 1000 + T)
                failed |= bool(bad or unstable)
                print(f"seed {args.seed} {fmt} T={T} {keys}: {bad}/{args.replays} replays differ, "
                      f"{unstable}/{args.routings} eager pairs differ, error {err:.2e}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
