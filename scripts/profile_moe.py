"""Where a fused_moe call's GPU time goes, kernel by kernel (torch.profiler, CUDA activity).

    python scripts/profile_moe.py [--tokens 1 64] [--reps 20]

Flash shape (E 256, H 4096, I 2048, top-6), random MXFP4 experts as in ``dsv4lab bench moe``;
one table per (backend/variant, T): each kernel's total GPU time over ``reps`` calls, its share,
and the time per call. A diagnosis aid for kernels/moe.py and kernels/moe_scaled.py; the
benchmark (CUDA-graph timing, recorded rows) stays ``dsv4lab bench moe``.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
from dsv4lab.benchmarks.moe import FLASH, VARIANTS, _random_experts
from dsv4lab.ops import fused_moe, route


def _kernel_times(fn, reps: int) -> dict[str, float]:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", nargs="*", default=None, help="names to profile (default: all)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    ex = _random_experts(E, H, I, "mxfp4", dev, gen)
    cases = [("triton", "triton", None)] + [(name, "triton", cfg) for name, cfg in VARIANTS] \
        + [("triton_scaled", "triton_scaled", None)]
    if args.cases:
        cases = [c for c in cases if c[0] in args.cases]
    for T in args.tokens:
        ids, w = route(torch.randn(T, E, device=dev, generator=gen), None, topk=k)
        x = torch.randn(T, H, device=dev, generator=gen).to(torch.bfloat16)
        for name, backend, cfg in cases:
            def call():
                return fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                                 fmt="mxfp4", swiglu_limit=10.0, backend=backend, kernel_config=cfg)
            try:
                times = _kernel_times(call, args.reps)
            except Exception as e:  # a variant this Triton cannot build: say so, go on
                print(f"T={T} {name}: {type(e).__name__}: {e}")
                continue
            tot = sum(times.values())
            print(f"T={T} {name}: {tot / args.reps:.1f} us a call (GPU kernel time)")
            for kname, t in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"    {t / args.reps:9.1f} us  {100 * t / tot:5.1f}%  {kname[:90]}")


if __name__ == "__main__":
    main()
