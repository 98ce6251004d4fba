"""Where a CUDA-graph-replayed call's time goes, kernel by kernel, after the benchmark's flush.

    python3 scripts/trace_graph.py [moe|mla|both]     # the traces (GPU only)
    python3 scripts/trace_graph.py moe --plain 4      # 4 plain calls, for a profiler such as
                                                      # ncu --launch-skip 3 --launch-count 1

The cases are the targets' shapes: the MXFP4 MoE at T = 1 (Flash shape, the bench's
routing) and bf16 sparse MLA at B 64 / S_q 1 / topk 2048. Each is captured in a CUDA graph
(:func:`dsv4lab.bench.capture_graph`) and replayed after ``do_bench``'s zero-fill flush of
256 MB, as ``dsv4lab bench`` times it. For a few replays the script prints every kernel's start
after the flush ends and its duration (torch.profiler, CUDA activity); then the graph's median
from :func:`dsv4lab.bench.time_graph`. It reads a call's launches and gaps; the recorded
figures stay ``dsv4lab bench moe`` and ``dsv4lab bench sparse_mla``.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
from dsv4lab import bench

FLUSH_BYTES = 256 * 2**20       # do_bench's flush


def trace(label: str, fn, reps: int = 8, shown: int = 3) -> None:
    """Print the kernels of ``shown`` graph replays of ``fn`` (each after a flush), the median
    span from the flush's end to the call's last kernel, and the graph's benchmark time."""
    graph = bench.capture_graph(fn)[0]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")
    for _ in range(3):
        flush.zero_()
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    calls = []
    for start, end, name in kernels:
        if end - start > 30 and "fill" in name.lower():      # the flush opens a call
            calls.append({"flush_end": end, "kernels": []})
        elif calls:
            calls[-1]["kernels"].append((start, end, name))
    print(f"== {label}: {len(calls)} calls traced (us after the flush ends)")
    for call in calls[1:1 + shown]:
        t0 = call["flush_end"]
        for start, end, name in call["kernels"]:
            print(f"   start +{start - t0:7.2f}  duration {end - start:7.2f}  {name[:70]}")
    spans = [c["kernels"][-1][1] - c["flush_end"] for c in calls if c["kernels"]]
    print(f"   median span from the flush's end to the last kernel's end: {statistics.median(spans):.2f} us")
    timing = bench.time_graph(fn)
    print(f"   dsv4lab.bench.time_graph: {timing['ms'] * 1e3:.2f} us (l2 {timing['l2']})")


def moe_call():
    """The MXFP4 MoE at T = 1, Flash shape, routed as ``dsv4lab bench moe`` routes."""
    from dsv4lab.benchmarks.moe import FLASH, SWIGLU_LIMIT, _random_experts
    from dsv4lab.ops import fused_moe, route
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    E, H, I, k = FLASH["E"], FLASH["H"], FLASH["I"], FLASH["topk"]
    ex = _random_experts(E, H, I, "mxfp4", dev, gen)
    logits = torch.randn(1, E, device=dev, generator=gen)
    ids, w = route(logits, torch.randn(E, device=dev, generator=gen) * 0.1, topk=k)
    x = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
    return lambda: fused_moe(x, ex["w13"], ex["w13_scale"], ex["w2"], ex["w2_scale"], ids, w,
                             fmt="mxfp4", swiglu_limit=SWIGLU_LIMIT, backend="triton", **ex["kw"])


def mla_call():
    """bf16 sparse MLA at B 64 / S_q 1 / topk 2048 on the bench's cache and indices."""
    from dsv4lab.benchmarks.sparse_mla import CONTEXT, D, H, MIN_CACHE_ROWS, _Cases
    from dsv4lab.ops import sparse_mla_decode
    cases = _Cases(64, heads=H, dim=D, context=CONTEXT, min_rows=MIN_CACHE_ROWS,
                   device=torch.device("cuda"), fp8=False)
    q, idx = cases.inputs(1, 2048, 1)[0]
    return lambda: sparse_mla_decode(q, cases.kv, idx, d_v=D, softmax_scale=D ** -0.5,
                                     attn_sink=cases.sink, backend="mma", check_indices=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", nargs="?", default="both", choices=("moe", "mla", "both"))
    ap.add_argument("--plain", type=int, default=0,
                    help="instead of the traces: this many plain calls of each case (for ncu)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("trace_graph: needs a CUDA GPU")
        return 2
    makers = {"moe": (moe_call, "MoE T = 1 MXFP4"), "mla": (mla_call, "sparse MLA B 64 S_q 1 bf16")}
    for name in (("moe", "mla") if args.case == "both" else (args.case,)):
        make, label = makers[name]
        fn = make()
        if args.plain:
            for _ in range(args.plain):
                fn()
            torch.cuda.synchronize()
        else:
            trace(label, fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
