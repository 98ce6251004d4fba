"""Where a CUDA-graph-replayed call's time goes, kernel by kernel.

    python tools/trace_graph.py indexer            # one of the named cases below (GPU only)
    python tools/trace_graph.py moe mla            # several
    python tools/trace_graph.py --call mymod:make  # any op: make() returns a zero-argument callable
    python tools/trace_graph.py moe --plain 4      # 4 plain calls instead, for a profiler such as
                                                   # ncu --launch-skip 3 --launch-count 1

Each call is captured in a CUDA graph (:func:`dsv4lab.bench.capture_graph`) and replayed after
``do_bench``'s zero-fill flush of 256 MB, as ``dsv4lab bench`` times it. For a few replays the
tool prints every kernel's start after the flush ends and its duration (torch.profiler, CUDA
activity), then the median span and the graph's :func:`dsv4lab.bench.time_graph` figure. The
named cases are the benchmarks' headline shapes, built from the public ops only; the recorded
figures stay those of ``dsv4lab bench``.
"""
from __future__ import annotations

import argparse
import importlib
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import dsv4lab  # noqa: F401  (configures the runtime before triton is imported)
from dsv4lab import bench, ops

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


def _gen():
    return torch.Generator(device="cuda").manual_seed(0)


def indexer_call():
    """indexer_topk, B 64, 512 actual tokens, 1M tokens of max context, e4m3 q and keys."""
    from dsv4lab.benchmarks.indexer import FULL, make_inputs
    L = 1048576 // 4
    args = make_inputs(batch=64, s_q=1, heads=FULL["heads"], head_dim=FULL["head_dim"],
                       page=FULL["page"], L=L, actual=512 // 4)
    return lambda: ops.indexer_topk(*args, max_context=L, topk=512, validate=False)


def mhc_call():
    """One hyper-connection (pre + post), hidden 4096, 4 bf16 streams, T 1, 20 iterations."""
    g = _gen()
    n, d = 4, 4096
    fn = torch.randn(24, n * d, device="cuda", generator=g) * (n * d) ** -0.5
    base, scale = torch.randn(24, device="cuda", generator=g), torch.ones(3, device="cuda")
    x = torch.randn(1, n, d, device="cuda", generator=g).bfloat16()
    out = torch.randn(1, d, device="cuda", generator=g).bfloat16()

    def call():
        _, post, comb = ops.mhc_pre(x, fn, base, scale, iters=20)
        return ops.mhc_post(out, x, post, comb)
    return call


def moe_call():
    """The MXFP4 MoE at T = 1, Flash shape (256 experts, top-6, hidden 4096, intermediate
    2048): random E2M1 bytes with E8M0 scales near 1, routed by random logits."""
    g = _gen()
    E, H, I, k = 256, 4096, 2048, 6
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device="cuda", generator=g)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device="cuda", generator=g)
    s13 = torch.randint(118, 122, (E, 2 * I, H // 32), dtype=torch.uint8, device="cuda", generator=g)
    s2 = torch.randint(118, 122, (E, H, I // 32), dtype=torch.uint8, device="cuda", generator=g)
    ids, w = ops.route(torch.randn(1, E, device="cuda", generator=g), None, topk=k)
    x = torch.randn(1, H, device="cuda", generator=g).bfloat16()
    return lambda: ops.fused_moe(x, w13, s13, w2, s2, ids, w, fmt="mxfp4", swiglu_limit=10.0)


def mla_call():
    """bf16 sparse MLA decode, B 64, S_q 1, 64 heads x 512, topk 2048 over a 128K-token cache."""
    g = _gen()
    B, H, D, topk, N = 64, 64, 512, 2048, 131072
    q = torch.randn(B, 1, H, D, device="cuda", generator=g).bfloat16()
    kv = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    idx = torch.randint(0, N, (B, 1, topk), dtype=torch.int32, device="cuda", generator=g)
    return lambda: ops.sparse_mla_decode(q, kv, idx, d_v=D)


CASES = {"indexer": indexer_call, "mhc": mhc_call, "moe": moe_call, "mla": mla_call}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="*", help=f"named cases: {', '.join(CASES)}")
    ap.add_argument("--call", action="append", default=[],
                    help="module:function returning a zero-argument callable to trace")
    ap.add_argument("--plain", type=int, default=0,
                    help="instead of the traces: this many plain calls of each case (for ncu)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown or not (args.cases or args.call):
        ap.error(f"name a case ({', '.join(CASES)}) or --call module:function"
                 + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    if not torch.cuda.is_available():
        print("trace_graph: needs a CUDA GPU")
        return 2
    makers = [(CASES[c], c) for c in args.cases]
    for spec in args.call:
        mod, _, name = spec.partition(":")
        makers.append((getattr(importlib.import_module(mod), name), spec))
    for make, label in makers:
        fn = make()
        if args.plain:
            for _ in range(args.plain):
                fn()
            torch.cuda.synchronize()
        else:
            trace(f"{label}: {(make.__doc__ or '').strip().splitlines()[0]}", fn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
